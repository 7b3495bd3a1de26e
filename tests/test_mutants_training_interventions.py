"""Mutation-testing gaps in training/, interventions/ and engine/{cache,edits}: each test checks behaviour against a
hand-written reference or an invariant taken from the documented definitions (docstrings, docs/), and names in its
docstring the mutant it was written to kill (a one-line change of the code that the rest of the suite let pass)."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from common.errors import UserError


# ---------------------------------------------------------------------------------------------------------- edits

def test_scale_by_zero_and_minus_one_are_zero_and_negation():
    """Scale(factor) is factor * base for every real factor, 0 and negatives included (engine/edits.py module doc).
    Mutant killed: `Scale.forward` returning the base unchanged when factor == 0 (a zero-ablation by Scale(0) that
    ablates nothing)."""
    from engine.edits import Scale

    base = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(Scale(0.0)(base), torch.zeros_like(base))
    assert torch.equal(Scale(0)(base), torch.zeros_like(base))
    assert torch.equal(Scale(-1.0)(base), -base)


def test_a_basis_off_orthonormal_by_one_percent_is_refused():
    """_check_basis accepts |U^T U - I| within max(1e-3, 4 eps of U's dtype) and refuses more (docstring): a float32
    basis whose columns are 1% too long is not a projection basis. Mutant killed: the tolerance 1e-3 -> 1e-1."""
    from engine.edits import KeepSubspace, ProjectOut, SubspaceInterchange

    U = torch.linalg.qr(torch.randn(8, 2, generator=torch.Generator().manual_seed(1)))[0]
    off = U * 1.005  # U^T U = 1.010025 I: 1e-2 off, ten times the float32 tolerance
    src = torch.zeros(4, 8)
    for make in (KeepSubspace, ProjectOut, lambda W: SubspaceInterchange(src, W)):
        with pytest.raises(UserError, match="orthonormal columns"):
            make(off)
        make(U * (1 + 2e-4))  # 4e-4 off: within 1e-3, accepted


def test_row_swap_refuses_a_donor_one_past_the_last_row():
    """RowSwap's donor rows must lie in 0..B-1 (one UserError line, not an IndexError from inside a hook). Mutant
    killed: the range check `max >= B` -> `max > B` (donor == B slips through)."""
    from engine.edits import RowSwap

    base = torch.randn(4, 3)
    with pytest.raises(UserError, match="donor rows must lie in 0..3"):
        RowSwap(torch.ones(4, dtype=torch.bool), torch.tensor([1, 2, 3, 4]))(base)
    want = base[[1, 0, 3, 2]]
    assert torch.equal(RowSwap(torch.ones(4, dtype=torch.bool), torch.tensor([1, 0, 3, 2]))(base), want)


@pytest.mark.parametrize("rows", [2, 3])
def test_add_takes_one_vector_per_row_at_any_batch_size(rows):
    """Add(vector) with vector [batch, width] adds row r's vector to row r (module doc: `Add(vector)  base + vector`,
    [width] or [batch, width]); a batch of 2 rows is no special case. Mutant killed: the per-row branch taken only
    for `vector.shape[0] > 2` (a [2, width] vector then refused as not one vector)."""
    from engine.edits import Add

    g = torch.Generator().manual_seed(2)
    base, v = torch.randn(rows, 5, generator=g), torch.randn(rows, 5, generator=g)
    torch.testing.assert_close(Add(v)(base), base + v)
