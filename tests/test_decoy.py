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


@pytest.mark.parametrize("cols", [[4], [4, 7], [8]])
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
    assert not torch.allclose(got[0, first + 1:], clean[0, first + 1:])


@torch.no_grad()
def naive_decoy_both(model, rows, cols) -> torch.Tensor:
    """As naive_decoy for two rows that are each other's donors at the same columns, as in training: each
    donor's state is that of its own decoyed chain. Both chains advance together, position by position."""
    refs = [naive_recurrent(model, ids) for ids in rows]
    logits, top = [r.logits.clone() for r in refs], [r.top.clone() for r in refs]
    fuse = torch.arange(len(rows[0])) >= 1
    for t in range(1, len(rows[0])):
        for i, ids in enumerate(rows):
            state = shifted(top[i], t)
            for c in cols:
                if c < t:
                    state[c] = top[1 - i][c - 1]  # the partner's chain, itself decoyed before c
            r = ref_forward(model, ids[:t + 1], state, fuse[:t + 1])
            logits[i][t], top[i][t] = r.logits[-1], r.top[-1]
    return torch.stack(logits)


def test_decoy_of_both_rows_equals_the_hand_written_recurrence(tiny_model):
    """Both rows decoyed at two columns after the rows first differ (column 3): the training case."""
    ids = torch.tensor([A, B])
    at = torch.zeros_like(ids, dtype=torch.bool)
    at[:, [4, 7]] = True
    with torch.no_grad():
        got = recurrent_logits(tiny_model, ids, torch.ones_like(ids), decoy=(at, torch.tensor([1, 0])))
    torch.testing.assert_close(got, naive_decoy_both(tiny_model, [A, B], [4, 7]), rtol=1e-4, atol=1e-5)


def test_decoy_gradient_reaches_the_donor_row(tiny_model):
    """Differentiable, as documented: row 0's answer depends on row 1's inputs through the decoy only."""
    ids = torch.tensor([A, B])
    emb = tiny_model.lm.get_input_embeddings()
    saved = []

    def keep(module, inputs, out):  # returns None: the output stays as it is
        out.retain_grad()
        saved.append(out)

    handle = emb.register_forward_hook(keep)
    try:
        at = torch.zeros_like(ids, dtype=torch.bool)
        at[0, 5] = True
        recurrent_logits(tiny_model, ids, torch.ones_like(ids), decoy=(at, torch.tensor([1, 0])))[0, -1].sum().backward()
    finally:
        handle.remove()
        tiny_model.zero_grad()
    assert sum(float(e.grad[1].abs().sum()) for e in saved if e.grad is not None) > 0.0


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
            L = int(b.mask.sum(1).min())
            assert cols.shape == (rows, T) and not cols[:, 0].any() and not cols[:, L - 2:].any()
            assert (cols == cols[:1]).all()  # every row alike: one extra step per decoy column
            assert (donor != torch.arange(rows)).all() and donor.min() >= 0 and donor.max() < rows
            share = cols[:, 1:-1].float().mean()
            assert 0.15 < float(share) < 0.35, share


def test_decoy_refusals():
    with pytest.raises(UserError, match="decoy"):
        replace(get_preset("tiny-fbt-track"), objective="multipass", decoy=0.2)
    with pytest.raises(UserError, match="decoy"):
        _track(decoy=1.0)
    with pytest.raises(UserError, match="decoy"):
        replace(get_preset("tiny-fbt-track"), packing=True, dense_targets=False, dense_every=False, decoy=0.2)
    with pytest.raises(UserError, match="one at a time"):
        replace(get_preset("tiny-fbt-track"), pairs=True, interchange=0.5, decoy=0.2)
