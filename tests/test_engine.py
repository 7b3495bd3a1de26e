"""The engine's contract: one mode parser, recirculation behind the same prefill/generate, one hook helper."""
from __future__ import annotations

import pytest
import torch

from common.errors import UserError
from engine.hooks import CallCounter, ResidualRecorder, on_depth, patched
from engine.modes import Mode, canonical_modes, parse_mode
from engine.prefill import call_schedule, generate, pad_left, prefill, prefill_many
from engine.recirculation import RecirculatedLM, parse_recirculate
from models.full_bandwidth import FullBandwidthLM, decoder_layers
from probes.collect import Collector

SEQS = [[7, 3, 41, 12, 5, 29, 33, 8], [4, 9, 2], [11, 12, 13, 14, 15]]
RECIRC = "recirc-2:1:0.3:convex"


# ----- modes --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spelling, name", [
    ("standard", "standard"), ("std", "standard"), ("fused-0", "standard"), ("recurrent-0", "standard"),
    ("soft", "recurrent-1"), ("recurrent-1", "recurrent-1"), ("fused", "fused-1"), ("recurrent-full", "recurrent-full"),
    (" fused-3 ", "fused-3"), ("recirc-2:1:0.3", RECIRC), ("recirc-2:1:0.30:convex", RECIRC),
])
def test_one_canonical_spelling(spelling, name):
    assert parse_mode(spelling).name == name
    assert parse_mode(parse_mode(spelling)) == parse_mode(name)


def test_canonical_modes_deduplicates_in_order():
    assert canonical_modes("std,recurrent-1,standard,soft,fused-0,recirc-2:1:0.3") == \
        ["standard", "recurrent-1", RECIRC]
    assert canonical_modes(["fused-2", Mode("fused", 2), "recurrent-full"]) == ["fused-2", "recurrent-full"]


@pytest.mark.parametrize("bad", ["bogus", "recurrent-", "fused--1", "Standard", "fused-1001", "recurrent-100001"])
def test_bad_mode_is_one_user_error(bad):
    with pytest.raises(UserError) as e:
        parse_mode(bad)
    assert "\n" not in str(e.value) and repr(bad) in str(e.value)


def test_recirc_depths_checked_against_the_model():
    parse_mode("recirc-5:1:0.1")  # no model yet: syntax only
    with pytest.raises(UserError, match="out of range"):
        parse_mode("recirc-5:1:0.1", n_layers=2)
    with pytest.raises(UserError, match="alpha"):
        parse_mode("recirc-2:1:1.5")


def test_has_feedback():
    assert [parse_mode(m).has_feedback for m in ("standard", "soft", "fused-2", RECIRC)] == [False, True, True, False]


# ----- recirculation behind the same contract ----------------------------------------------------------------
def test_prefill_of_a_recirc_mode_is_the_recirculation_engine(tiny_model):
    ids, mask = pad_left(SEQS)
    T = ids.shape[1]
    res = prefill(tiny_model, ids, mask, RECIRC, positions=(-1, -3), collect=True)
    rlm = RecirculatedLM(FullBandwidthLM(tiny_model.lm, fusion=False).eval(), parse_recirculate("2:1:0.3"))
    ref = rlm.sequential(ids, mask, cols=torch.tensor([T - 1, T - 3]), collect=True)
    assert res.mode == RECIRC
    assert torch.equal(res.logits, ref.logits) and torch.equal(res.top, ref.top) and torch.equal(res.resid, ref.resid)
    assert res.resid.shape == (3, 2, tiny_model.n_layers + 1, tiny_model.d_model)
    # and it is not the standard pass
    std = prefill(tiny_model, ids, mask, "standard", positions=(-1, -3))
    assert (res.logits - std.logits).abs().max() > 1e-3


def test_alpha_zero_recirc_mode_equals_standard_bit_for_bit(tiny_model):
    ids, mask = pad_left(SEQS)
    got = prefill_many(tiny_model, ids, mask, ["standard", "recirc-2:1:0"], positions=(-1, -2))
    for field in ("logits", "top", "resid"):
        assert torch.equal(getattr(got["standard"], field), getattr(got["recirc-2:1:0"], field)), field


def test_generate_under_recirc_is_the_recirculated_decoder(tiny_model):
    ids, mask = pad_left(SEQS)
    base = FullBandwidthLM(tiny_model.lm, fusion=False).eval()
    ref = RecirculatedLM(base, parse_recirculate("2:1:0.3")).generate(ids, mask, 5)
    assert torch.equal(generate(tiny_model, ids, mask, 5, RECIRC), ref)
    assert torch.equal(generate(tiny_model, ids, mask, 5, "recirc-2:1:0"), generate(base, ids, mask, 5, "std"))


def test_recirc_inputs_checked_like_any_mode(tiny_model):
    ids, mask = pad_left(SEQS)
    mask = mask.clone()
    mask[0, -1] = 0
    for mode in ("standard", RECIRC):
        with pytest.raises(UserError, match="left-padded"):
            prefill(tiny_model, ids, mask, mode)
    # a hole: a padding column between real tokens (recurrent-full fed no state across it: logits off by 0.07)
    ids, mask = pad_left(SEQS)
    mask = mask.clone()
    row = int(mask.sum(-1).argmax())
    mask[row, 2] = 0
    for mode in ("standard", "recurrent-full", "fused-2", RECIRC):
        with pytest.raises(UserError, match="row 0 has a padding column between real tokens".replace("0", str(row))):
            prefill(tiny_model, ids, mask, mode)


def test_no_fusion_model_refuses_feedback_but_runs_recirc(tiny_model):
    base = FullBandwidthLM(tiny_model.lm, fusion=False).eval()
    ids, mask = pad_left(SEQS)
    with pytest.raises(UserError, match="no fusion module"):
        prefill(base, ids, mask, "recurrent-1")
    assert prefill(base, ids, mask, RECIRC).logits.shape[:2] == (3, 1)


# ----- the call schedule is the engine's, and it is what the engine does -------------------------------------
@pytest.mark.parametrize("modes", [["standard"], ["recurrent-2", "standard", "fused-1"],
                                   ["fused-2", RECIRC, "recurrent-full"], ["recirc-2:1:0", "standard"]])
def test_call_schedule_counts_the_engine_calls(tiny_model, modes):
    ids, mask = pad_left(SEQS)
    T = ids.shape[1]
    _, n = call_schedule(modes, T)
    with CallCounter(tiny_model) as c:
        prefill_many(tiny_model, ids, mask, modes, collect=False)
    assert c.n == n


def test_collector_reads_recirc_and_feedback_modes_in_one_trace(tiny_model):
    modes = ["recurrent-full", RECIRC, "standard", "fused-2"]
    got = Collector(tiny_model, batch_size=8, progress=False).collect(SEQS, modes)
    for i, s in enumerate(SEQS):
        ids, mask = pad_left([s])
        ref = prefill_many(tiny_model, ids, mask, modes, collect=True)
        for m in modes:
            assert torch.allclose(torch.from_numpy(got[m][i]), ref[m].resid[0, 0], atol=1e-5), m


# ----- the one hook helper ------------------------------------------------------------------------------------
def test_read_only_hooks_change_nothing(tiny_model):
    ids, mask = pad_left(SEQS)
    clean = tiny_model(ids, mask).logits
    layers = decoder_layers(tiny_model.lm)
    seen = []
    handles = [on_depth(layers, d, lambda h, d=d: seen.append(d)) for d in range(len(layers) + 1)]
    try:
        assert torch.equal(tiny_model(ids, mask).logits, clean)
    finally:
        for h in handles:
            h.remove()
    assert seen == list(range(len(layers) + 1))  # depth 0 (block 0's input) first, then every block's output


def test_patched_identity_is_clean_and_a_patch_lands(tiny_model):
    ids, mask = pad_left(SEQS)
    T = ids.shape[1]
    with ResidualRecorder(tiny_model) as rec:
        rec.cols = torch.arange(T)
        clean = tiny_model(ids, mask).logits
        resid = rec.take()  # [B, T, L+1, D]
    with patched(tiny_model, resid={1: [(T - 2, resid[:, T - 2, 1])]}):
        assert torch.equal(tiny_model(ids, mask).logits, clean)
    donor = resid[[1, 2, 0], T - 2, 1]
    with patched(tiny_model, resid={1: [(T - 2, donor)]}):
        with ResidualRecorder(tiny_model) as rec:
            rec.cols = torch.tensor([T - 2])
            out = tiny_model(ids, mask).logits
            assert torch.equal(rec.take()[:, 0, 1], donor)  # the recorder sees the patched value
    real = mask[:, :T - 2].bool()  # causal: earlier columns untouched (padding columns' logits are not defined)
    assert torch.allclose(out[:, :T - 2][real], clean[:, :T - 2][real], atol=1e-6)
    assert (out[:, -1] - clean[:, -1]).abs().max() > 1e-4


@pytest.mark.parametrize("spec, name", [
    ("recirc-4:1:0.1", "recirc-4:1:0.1:convex"), ("recirc-4:1:0.1000004", "recirc-4:1:0.1000004:convex"),
    ("recirc-4:1:1.0", "recirc-4:1:1:convex"), ("recirc-4:1:1e-5:residual", "recirc-4:1:1e-05:residual"),
    ("loop-4:1e-3", "loop-4:0.001"), ("loop-4:0.0010000004", "loop-4:0.0010000004")])
def test_a_mode_name_keeps_its_number_exactly(spec, name):
    """A canonical name is a cache key and a row key: two alphas (or tolerances) never share one, and the name
    parses back to the same mode."""
    from engine.modes import parse_mode

    m = parse_mode(spec)
    assert m.name == name and parse_mode(m.name).name == name and parse_mode(m.name) == m


def test_a_position_asked_for_twice_is_filled_twice(tiny_model):
    """prefill_many fills each column once: a repeated position left its first slot uninitialised under the
    recurrent modes (1.5e30 off) and the standard pass's values under recurrent-1. Every mode now computes the
    distinct positions once and hands each slot its column."""
    from engine.prefill import pad_left, prefill_many

    ids, mask = pad_left([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12]])
    modes = ["standard", "recurrent-1", "recurrent-full", "fused-2", "recirc-2:1:0.4"]
    once = prefill_many(tiny_model, ids, mask, modes, positions=(-1, -3))
    twice = prefill_many(tiny_model, ids, mask, modes, positions=(-1, -3, -1))
    for m in modes:
        assert twice[m].positions == (-1, -3, -1)
        for a, b in ((twice[m].logits, once[m].logits), (twice[m].top, once[m].top), (twice[m].resid, once[m].resid)):
            assert torch.equal(a[:, [0, 1]], b) and torch.equal(a[:, 2], b[:, 0]), m
