"""Decoy columns (engine.prefill.recurrent_run's `decoy`): a column's cached keys and values computed from another
row's fed state while the row's own recurrence goes on, against a hand-written no-cache recurrence; the
batches and the refusals of `--decoy`."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from common.errors import UserError
from engine.prefill import recurrent_logits
from tasks import build_tokenizer
from training.presets import get_preset
import training.data as tdata

from test_interchange import A, B
from test_prefill import naive_recurrent, ref_forward, shifted


@torch.no_grad()
def naive_decoy(model, ids, donor_ids, cols) -> torch.Tensor:
    """Logits [T, V] of recurrent-full on `ids` whose columns `cols` are seen by every LATER position as if fed
    the top state of the column before on `donor_ids` (its own recurrence), while each position itself, and the
    chain after it, is fed the row's own top state; every position recomputed from the whole prefix, no cache."""
    donor = naive_recurrent(model, donor_ids)
    own = naive_recurrent(model, ids)
    logits, top = own.logits.clone(), own.top.clone()
    fuse = torch.arange(len(ids)) >= 1
    for t in range(1, len(ids)):
        state = shifted(top, t)
        for c in cols:
            if c < t:  # an earlier column, as the cache holds it; column t itself is the chain's
                state[c] = donor.top[c - 1]
        r = ref_forward(model, ids[:t + 1], state, fuse[:t + 1])
        logits[t], top[t] = r.logits[-1], r.top[-1]
    return logits


@pytest.mark.parametrize("cols", [[4], [2, 6], [9]])
def test_decoy_equals_the_hand_written_recurrence(tiny_model, cols):
    ids = torch.tensor([A, B])
    at = torch.zeros_like(ids, dtype=torch.bool)
    at[0, cols] = True  # row 0 only: row 1 runs as it would alone
    with torch.no_grad():
        got = recurrent_logits(tiny_model, ids, torch.ones_like(ids), decoy=(at, torch.tensor([1, 0])))
        clean = recurrent_logits(tiny_model, ids, torch.ones_like(ids))
    torch.testing.assert_close(got[0], naive_decoy(tiny_model, A, B, cols), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], clean[1], rtol=0, atol=0)
    first = min(cols)
    assert torch.equal(got[0, :first + 1], clean[0, :first + 1])  # the decoy column's own logits are the chain's
    if first < ids.shape[1] - 1:
        assert not torch.allclose(got[0, first + 1:], clean[0, first + 1:])


def test_decoy_from_itself_changes_nothing(tiny_model):
    """A row its own donor: the cache is rebuilt from the same state (the identity patch)."""
    ids = torch.tensor([A, B])
    at = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        got = recurrent_logits(tiny_model, ids, torch.ones_like(ids), decoy=(at, torch.tensor([0, 1])))
        clean = recurrent_logits(tiny_model, ids, torch.ones_like(ids))
    torch.testing.assert_close(got, clean, rtol=1e-5, atol=1e-6)


def _track(**kw):
    return replace(get_preset("tiny-fbt-track"), length_doubling=0, distractors={6: 1.0}, batch_tokens=1200, **kw)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_decoy_batches(tok):
    """Every row gets decoy columns at about the asked rate, never column 0 nor the answer's, a donor that is
    another row of its micro-batch; the rows, targets and swaps are the run's without --decoy."""
    plain, dec = _track(), _track(decoy=0.25)
    for step in (0, 3):
        for a, b in zip(tdata.make_batches(plain, tok, step), tdata.make_batches(dec, tok, step)):
            assert a.decoy is None
            assert torch.equal(a.ids, b.ids) and torch.equal(a.dense, b.dense)
            cols, donor = b.decoy, b.decoy_donor
            rows, T = b.ids.shape
            assert cols.shape == (rows, T) and not cols[:, 0].any() and not cols[:, -1].any()
            assert (donor != torch.arange(rows)).all() and donor.min() >= 0 and donor.max() < rows
            share = cols[:, 1:-1].float().mean()
            assert 0.15 < float(share) < 0.35, share


def test_decoy_refusals():
    with pytest.raises(UserError, match="decoy"):
        replace(get_preset("tiny-fbt"), decoy=0.2)  # multipass objective
    with pytest.raises(UserError, match="decoy"):
        _track(decoy=1.0)
    with pytest.raises(UserError, match="decoy"):
        replace(get_preset("tiny-fbt-track"), packing=True, dense_targets=False, decoy=0.2)
