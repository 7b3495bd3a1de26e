"""The patching API taken at its word (adversarial review, 2026-12-07): the engine's own `patcher(...).run()` checks
every patch as CausalContext does, edits take shapes as written (no silent broadcasting), a subspace basis is
checked in every dtype, and a bad value is one UserError line, never a misplaced patch or a torch traceback."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.errors import UserError
from engine.edits import Add, KeepSubspace, Mean, ProjectOut, Replace, RowSwap, Scale, SubspaceInterchange, Zero
from engine.hooks import ResidualRecorder
from engine.modes import parse_mode
from engine.patching import Patch, patcher, record_at_T
from interventions.batch import Batch
from interventions.core import CausalContext
from models.full_bandwidth import FullBandwidthLM

B, T, L, D, H = 4, 7, 3, 32, 4


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=D, intermediate_size=64, num_hidden_layers=L, num_attention_heads=H,
                      num_key_value_heads=H, max_position_embeddings=64, attn_implementation="eager")
    torch.manual_seed(3)
    m = FullBandwidthLM(LlamaForCausalLM(cfg).eval(), fusion=True).eval()
    with torch.no_grad():
        m.fusion.up.weight.normal_(0, 0.3)
        m.fusion.gate.weight.normal_(0, 0.3)
    return m


def _batch(pad=False):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 40, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    if pad:
        mask[0, :2] = 0
        mask[2, :1] = 0
        ids[mask == 0] = 0
    return Batch(ids, mask, torch.tensor([0, 1, 0, 1]), torch.tensor([1, 0, 3, 2]), np.array([0, 0, 1, 1]), (3, 4))


def test_record_at_T_applies_an_earlier_pass_patch_to_that_pass_only(model):
    """fused-2 with the residual at depth 2 zeroed in pass 0: the recorded last pass holds its own recomputed value
    there (the patch propagated), not the zero (record_at_T wrote every T patch into the last pass)."""
    b = _batch()
    with torch.no_grad():
        r = patcher(parse_mode("fused-2", L), model, b.input_ids, b.attention_mask)
        p = Patch("resid", torch.zeros(B, D), depth=2, pos=-1, pass_=0)
        _, resid = record_at_T(r, lambda: r.run([p]), [p])
        with ResidualRecorder(model) as rec:
            rec.cols = torch.tensor([-1])
            r.run([p])
            want = rec.take()[:, 0]
        assert resid[:, 2].abs().max() > 0.01
        torch.testing.assert_close(resid, want, rtol=0, atol=0)
        # the last pass's own patch is still applied to the record
        last = Patch("resid", torch.zeros(B, D), depth=2, pos=-1)
        assert record_at_T(r, lambda: r.run([last]), [last])[1][:, 2].abs().max() == 0


@pytest.mark.parametrize("mode", ["standard", "recurrent-2", "fused-2", "recirc-3:1:0.4"])
def test_the_engine_patcher_checks_every_patch_and_the_batch(model, mode):
    """patcher(...).run() used directly (probes.erase does): an out-of-range layer, a depth past the stack, a fed site
    the mode never reaches, a value of another batch: each one line, as through CausalContext (they ran silently: a
    no-op or a patch at another site)."""
    b = _batch()
    with torch.no_grad():
        r = patcher(parse_mode(mode, L), model, b.input_ids, b.attention_mask)
        bad = [Patch("mlp_out", Zero(), layer=L, pos=-1), Patch("resid", Zero(), depth=L + 1, pos=-1),
               Patch("head", Zero(), layer=0, head=H, pos=-1), Patch("resid", torch.zeros(B + 1, D), depth=1, pos=-1),
               Patch("state", torch.zeros(B, D), pos=-T)]
        for p in bad:
            with pytest.raises(UserError):
                r.run([p])
    right_padded = b.attention_mask.clone()
    right_padded[0, -2:] = 0
    with pytest.raises(UserError, match="left-padded"):
        patcher(parse_mode(mode, L), model, b.input_ids, right_padded)


@pytest.mark.parametrize("kw", [dict(depth=-1), dict(depth=1.0), dict(depth=True)])
def test_a_patch_index_is_a_non_negative_int(kw):
    with pytest.raises(UserError, match="non-negative integer"):
        Patch("resid", Zero(), pos=-1, **kw)
    for bad in (dict(layer=-1), dict(layer=1.0)):
        with pytest.raises(UserError, match="non-negative integer"):
            Patch("mlp_out", Zero(), pos=-1, **bad)
    with pytest.raises(UserError, match="non-negative integer"):
        Patch("head", Zero(), pos=-1, layer=0, head=True)
    with pytest.raises(UserError, match="torch tensor"):
        Patch("resid", np.zeros((B, D)), depth=1, pos=-1)
    with pytest.raises(UserError, match="bool \\[batch\\] mask"):  # a list, not a tensor: one line too
        Patch("state", torch.zeros(B, D), rows=[True, False, True, False])


def test_edits_take_shapes_as_written():
    base = torch.randn(B, D)
    v = torch.randn(D)
    for edit in (Replace(base[:1]), Replace(v), Replace(base[:, :1]), Replace(torch.tensor(1.0)),
                 SubspaceInterchange(v, torch.eye(D)[:, :2]), Mean(v.mean()), Mean(torch.ones(1)), Add(torch.ones(1)),
                 Add(torch.ones(B, 1)), Mean(torch.ones(2, D))):
        with pytest.raises(UserError, match="must be one"):
            edit(base)
    # what they do take
    torch.testing.assert_close(Mean(v)(base), v.expand(B, D))
    torch.testing.assert_close(Mean(v[None])(base), v.expand(B, D))
    torch.testing.assert_close(Add(v)(base), base + v)
    torch.testing.assert_close(Add(base)(base), 2 * base)
    torch.testing.assert_close(Scale(torch.tensor(0.5))(base), 0.5 * base)
    with pytest.raises(UserError, match="one real number"):
        Scale(torch.ones(B))


def test_row_swap_refuses_masks_and_donors_not_of_the_batch():
    base = torch.randn(B, D)
    rows = torch.tensor([True, False, True, False])
    torch.testing.assert_close(RowSwap(rows, torch.tensor([1, 0, 3, 2]))(base), base[[1, 1, 3, 3]])
    for edit in (RowSwap(rows, torch.tensor([1, 0, 9, 2])), RowSwap(rows.long(), torch.tensor([1, 0, 3, 2])),
                 RowSwap(rows, torch.tensor([1.0, 0, 3, 2])), RowSwap(rows[:2], torch.tensor([1, 0]))):
        with pytest.raises(UserError, match="RowSwap"):
            edit(base)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_subspace_basis_is_checked_in_every_dtype_and_with_autograd(dtype):
    U = torch.linalg.qr(torch.randn(D, 3, dtype=torch.float64)).Q
    for make in (KeepSubspace, ProjectOut, lambda W: SubspaceInterchange(torch.zeros(B, D), W)):
        make(U.to(dtype))  # an orthonormal basis, cast: taken
        make(torch.nn.Parameter(U.float()))
        for bad in ((3 * U).to(dtype), torch.nn.Parameter(3 * U.float()), torch.full((D, 3), torch.nan, dtype=dtype)):
            with pytest.raises(UserError, match="orthonormal"):
                make(bad)


def test_a_non_finite_patched_run_is_one_line(model):
    ctx = CausalContext(model, _batch(), modes=["recurrent-full"])
    with pytest.raises(UserError, match=r"patched at state T: .*NaN or inf in 4 of 4 rows \(a patch value"):
        ctx.run("recurrent-full", [Patch("state", Mean(torch.empty(0, D).mean(0)), pos=-1)])
    with pytest.raises(UserError, match="NaN or inf"):
        ctx.run("recurrent-full", [Patch("resid", Add(torch.full((D,), torch.inf)), depth=1, pos=-2)])


def test_causal_context_checks_the_batch_before_running(model):
    b = _batch()
    ids = b.input_ids.clone()
    ids[0, 3] = 999
    with pytest.raises(UserError, match="outside the model's vocabulary"):
        CausalContext(model, dataclasses.replace(b, input_ids=ids),
                      check_engine=False)


def test_a_float64_model_on_padded_rows_names_its_dtype(model):
    m64 = FullBandwidthLM(model.lm.double(), fusion=True)
    m64.fusion.load_state_dict({k: v.double() for k, v in model.fusion.state_dict().items()})
    try:
        with pytest.raises(UserError, match=r"torch\.float64; in float64, eager attention"):
            CausalContext(m64.double().eval(), _batch(pad=True), modes=["standard"])
    finally:
        model.lm.float()


def test_the_usage_page_head_patch_example_runs_as_written(model):
    """docs/usage.md's "From Python" head patch, executed from the page: the head of layer 1 at T takes the paired
    sample's value; a plain HF model wrapped without a fusion refuses a recurrent mode asked for by name."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "usage.md").read_text()
    code = re.search(r"One head's output at T.*?```python\n(.*?)```", page, re.S).group(1)
    batch = _batch()
    ctx = CausalContext(model, batch, modes=["standard"])
    scope = {"ctx": ctx, "batch": batch, "torch": torch}
    exec(code, scope)
    assert scope["logits"].shape == ctx.clean["standard"].logits.shape
    assert not torch.equal(scope["logits"], ctx.clean["standard"].logits)  # the head mattered
    plain = FullBandwidthLM(model.lm, fusion=False).eval()
    with pytest.raises(UserError, match="recurrent-1 needs a fusion module"):
        CausalContext(plain, batch, modes=["standard", "recurrent-1"])
    assert CausalContext(plain, batch).modes == ["standard"]  # the default modes: what the model has


def test_numpy_scalars_are_taken_as_the_numbers_they_are():
    """The type checks refused np.int64 depths and np.float32 factors (outside code indexes with numpy)."""
    p = Patch("resid", Zero(), depth=np.int64(2), pos=-1)
    assert p.depth == 2 and type(p.depth) is int
    base = torch.randn(B, D)
    torch.testing.assert_close(Scale(np.float32(2.0))(base), 2 * base)
    torch.testing.assert_close(Scale(np.int64(2))(base), 2 * base)
    with pytest.raises(UserError, match="non-negative integer"):
        Patch("resid", Zero(), depth=np.bool_(True), pos=-1)
