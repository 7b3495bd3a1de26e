"""Interchange training (--pairs, --interchange): the engine's differentiable state swap against a hand-written
no-cache recurrence, the pairs batches and their exchanged targets, and the refusals; and the shell game's
training answers (--all-answers).

The swap is the training-time twin of the suite's state patch: row r is fed its partner's top state at one
column, and the rest of the recurrence is recomputed from it.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from common.errors import UserError
from engine.modes import parse_mode
from engine.prefill import recurrent_logits, recurrent_run
from interventions.batch import Patch
from engine.patching import RecurrentPatcher
from tasks import build_tokenizer
from training.config import TrainConfig
from training.presets import get_preset
import training.data as tdata
import training.loss as tloss
import training.model as tmodel

from test_prefill import naive_recurrent, ref_forward, shifted

A = [7, 3, 41, 12, 5, 29, 33, 8, 19, 4]
B = [7, 3, 41, 30, 5, 29, 33, 8, 19, 4]  # differs from A at column 3 only, as a pair in one update line


@torch.no_grad()
def naive_swapped(model, ids, donor_ids, c) -> torch.Tensor:
    """Logits [T, V] of recurrent-full on `ids` fed, at column c, the top state of column c - 1 of recurrent-full
    on `donor_ids` instead of its own; every position recomputed from the whole prefix, no cache."""
    own, donor = naive_recurrent(model, ids), naive_recurrent(model, donor_ids)
    logits, top = own.logits.clone(), own.top.clone()
    fuse = torch.arange(len(ids)) >= 1
    for t in range(c, len(ids)):
        state = shifted(top, t)
        state[c] = donor.top[c - 1]
        r = ref_forward(model, ids[:t + 1], state, fuse[:t + 1])
        logits[t], top[t] = r.logits[-1], r.top[-1]
    return logits


@pytest.mark.parametrize("c", [1, 4, 9])
def test_engine_swap_equals_the_hand_written_recurrence(tiny_model, c):
    ids = torch.tensor([A, B])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        got = recurrent_logits(tiny_model, ids, mask, (torch.tensor([c, c]), torch.tensor([1, 0])))
    torch.testing.assert_close(got[0], naive_swapped(tiny_model, A, B, c), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], naive_swapped(tiny_model, B, A, c), rtol=1e-4, atol=1e-5)


def test_engine_swap_is_the_suites_state_patch(tiny_model):
    """The same exchange through interventions.core (the suite's one patching routine): the same answer at T."""
    ids = torch.tensor([A, B])
    mask = torch.ones_like(ids)
    T, c = ids.shape[1], 5
    runner = RecurrentPatcher(tiny_model, ids, mask, parse_mode("recurrent-full"))
    want = runner.run([Patch("state", runner.state(c - T)[[1, 0]], pos=c - T)])
    with torch.no_grad():
        got = recurrent_logits(tiny_model, ids, mask, (torch.tensor([c, c]), torch.tensor([1, 0])))[:, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_patched_run_runs_the_head_at_T_alone(tiny_model, head_calls):
    """A patched recurrent-full run reads T: its one-token steps before T run no LM head (a step's head is ~1/4 of
    a SmolLM2-sized step), and the answer is the one with every head run (engine.prefill.recurrent_logits)."""
    ids = torch.tensor([A, B])
    mask = torch.ones_like(ids)
    T, c = ids.shape[1], 3
    runner = RecurrentPatcher(tiny_model, ids, mask, parse_mode("recurrent-full"))
    with head_calls(tiny_model) as widths:
        got = runner.run([Patch("state", runner.state(c - T)[[1, 0]], pos=c - T)])
    assert widths == [1]  # the step at T
    with torch.no_grad():
        want = recurrent_logits(tiny_model, ids, mask, (torch.tensor([c, c]), torch.tensor([1, 0])))[:, -1]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_no_swap_and_one_sided_swap(tiny_model):
    ids = torch.tensor([A, B])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        clean = recurrent_logits(tiny_model, ids, mask)
        none = recurrent_logits(tiny_model, ids, mask, (torch.tensor([0, 0]), torch.tensor([1, 0])))
        one = recurrent_logits(tiny_model, ids, mask, (torch.tensor([6, 0]), torch.tensor([1, 0])))
    assert torch.equal(none, clean)  # column 0 is never recomputed: nothing is swapped
    assert torch.equal(one[1], clean[1])  # the donor row runs as it would alone
    assert torch.equal(one[0, :6], clean[0, :6]) and not torch.allclose(one[0, 6:], clean[0, 6:])


def _donor_gradient(model, swap) -> float:
    """|d logit(row 0, T) / d embeddings of row 1| summed over row 1's columns (rows are otherwise independent)."""
    ids = torch.tensor([A, B])
    saved = []

    def keep(module, inputs, out):
        out.retain_grad()
        saved.append(out)

    handle = model.lm.get_input_embeddings().register_forward_hook(keep)
    try:
        run = recurrent_run(model, ids, torch.ones_like(ids), None, torch.arange(len(A)), full_std=False, swap=swap)
    finally:
        handle.remove()
    run.logits[0, -1].sum().backward()
    return sum(float(e.grad[1].abs().sum()) for e in saved if e.grad is not None)


def test_swap_gradient_reaches_the_donor_row(tiny_model):
    """The exchange is differentiable: a loss on the recipient's answer reaches the donor's inputs."""
    assert _donor_gradient(tiny_model, None) == 0.0
    tiny_model.zero_grad()
    assert _donor_gradient(tiny_model, (torch.tensor([5, 0]), torch.tensor([1, 0]))) > 0.0


# ----- data ---------------------------------------------------------------------------------------------------
def _track(**kw) -> TrainConfig:
    kw = {"pairs": True, "interchange": 0.5, **kw}
    return replace(get_preset("tiny-fbt-track"), length_doubling=0, distractors={6: 1.0}, batch_tokens=1200, **kw)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_pairs_batches_hold_both_members(tok):
    for mb in tdata.make_batches(_track(interchange=0.0), tok, 3):
        assert mb.ids.shape[0] % 2 == 0 and mb.swap is None
        for i in range(0, mb.ids.shape[0], 2):
            diff = (mb.ids[i] != mb.ids[i + 1]).nonzero().flatten().tolist()
            # one update line (parity: one token; shell game: the swapped cups) and the answer
            assert 2 <= len(diff) <= 3 and diff[-1] == mb.ids.shape[1] - 1, diff
            assert mb.dense[i, -2] != mb.dense[i + 1, -2]  # opposite (different) answers


def test_interchange_targets_are_the_partners_from_the_swap_on(tok):
    cfg = _track()
    plain = tdata.make_batches(replace(cfg, interchange=0.0), tok, 3)
    swapped = tdata.make_batches(cfg, tok, 3)
    n_swapped = 0
    for p, s in zip(plain, swapped):
        assert torch.equal(p.ids, s.ids)  # a twin without interchange trains on the same rows
        T = s.ids.shape[1]
        for i in range(0, s.ids.shape[0], 2):
            c = int(s.swap[i])
            assert int(s.swap[i + 1]) == c
            if c == 0:
                assert torch.equal(s.dense[i:i + 2], p.dense[i:i + 2])
                continue
            n_swapped += 1
            last = int((s.ids[i, :T - 1] != s.ids[i + 1, :T - 1]).nonzero()[-1])
            assert last < c <= T - 2
            assert torch.equal(s.ids[i, c:T - 1], s.ids[i + 1, c:T - 1])  # the same inputs from the swap on
            assert torch.equal(s.dense[i, :c], p.dense[i, :c]) and torch.equal(s.dense[i, c:], p.dense[i + 1, c:])
            assert torch.equal(s.dense[i + 1, :c], p.dense[i + 1, :c]) and torch.equal(s.dense[i + 1, c:], p.dense[i, c:])
    pairs = sum(mb.ids.shape[0] // 2 for mb in swapped)
    assert 0.2 * pairs <= n_swapped <= 0.8 * pairs  # interchange = 0.5 of the pairs


def test_interchange_loss_trains_the_swapped_recurrence(tok):
    cfg = replace(_track(), n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64, attn_window=0)
    model = tmodel.build_model(cfg, len(tok)).train()
    mb = tdata.make_batches(cfg, tok, 0)[0]
    assert bool((mb.swap > 0).any())
    loss = tloss.StepLoss(model, cfg)(mb)[0]
    rows = torch.arange(mb.ids.shape[0])
    logits = recurrent_logits(model, mb.ids, mb.mask, (mb.swap, rows ^ 1))
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), mb.dense.reshape(-1),
                                             ignore_index=-100)
    torch.testing.assert_close(loss, want)
    plain = recurrent_logits(model, mb.ids, mb.mask)
    assert not torch.allclose(plain, logits)  # the swap is really in the loss


@pytest.mark.parametrize("kw, msg", [
    (dict(interchange=0.5, pairs=False), "interchange needs --pairs"),
    (dict(interchange=0.5, objective="multipass"), "interchange needs --pairs"),
    (dict(interchange=0.5, dense_targets=False, dense_every=False), "interchange needs --pairs"),
    (dict(interchange=1.5), "interchange must be"),
    (dict(pairs=True, packing=True, dense_targets=False, dense_every=False, tasks=("memory",), task_weights=None,
          distractors={0: 1.0}, interchange=0.0),
     "pairs needs unpacked"),
])
def test_refusals(kw, msg):
    with pytest.raises(UserError, match=msg):
        replace(get_preset("tiny-fbt-track"), **{"pairs": True, **kw})


def test_options_off_keep_logged_configs():
    d = TrainConfig().to_dict()
    assert "pairs" not in d and "interchange" not in d
    d = _track().to_dict()
    assert d["pairs"] is True and d["interchange"] == 0.5


def test_interchange_uses_each_pairs_own_length():
    """A right-padded pair: its answer column is its own last real column, not the batch's; no swap lands in
    padding, and padding keeps no targets."""
    T = 9
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0, 0], [1, 2, 9, 4, 5, 6, 8, 0, 0],  # length 7, answer at 6
                        [1, 2, 3, 4, 5, 6, 7, 3, 7], [1, 5, 3, 4, 5, 6, 7, 3, 9]])  # length 9
    dense = torch.full((4, T), -100)
    dense[0, 5], dense[1, 5], dense[2, 7], dense[3, 7] = 10, 11, 12, 13  # each ":" predicts its answer
    dense[2, 4], dense[3, 4] = 14, 15
    rng = np.random.default_rng(0)
    for _ in range(50):
        swap, d = tdata._interchange(ids, dense, [7, 9], 1.0, rng)
        assert 3 <= int(swap[0]) == int(swap[1]) <= 5  # after column 2, up to the pair's own ":" at 5
        assert 2 <= int(swap[2]) == int(swap[3]) <= 7
        assert torch.equal(d[0], torch.where(torch.arange(T) >= swap[0], dense[1], dense[0]))
        assert torch.equal(d[2], torch.where(torch.arange(T) >= swap[2], dense[3], dense[2]))
        assert (d[:2, 7:] == -100).all()


def test_interchange_is_refused_under_torchrun(monkeypatch, capsys):
    import training.cli as tcli

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")  # torchrun sets both
    monkeypatch.setattr(tcli, "train", lambda *a, **k: pytest.fail("work started"))
    argv = ["--preset", "tiny-fbt-track-iit", "--out", "unused-dir-never-made", "--no-progress"]
    with pytest.raises(SystemExit) as e:
        tcli.main(argv)
    assert e.value.code != 0
    err = capsys.readouterr().err
    assert "--interchange trains on one process" in err and "Traceback" not in err


def test_batches_without_pairs_are_the_shipped_runs():
    """--pairs off keeps the data stream of earlier runs: the tasks and N the shipped tiny-fbt-track logged at
    each step are the ones make_batches draws today (a change in the order of the rng's draws would move them)."""
    import json
    from pathlib import Path

    log = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-fbt-track" / "train_log.json"
    if not log.is_file():
        pytest.skip("no shipped tiny-fbt-track")
    history = {h["step"]: h["batch"] for h in json.loads(log.read_text())["history"]}
    cfg, tok = get_preset("tiny-fbt-track"), build_tokenizer()
    for step in (0, 1, 450, 999):
        assert "; ".join(mb.desc for mb in tdata.make_batches(cfg, tok, step)) == history[step + 1], step


def test_all_answers_balances_the_shell_games_final_answers(tok):
    """Without all_answers every training pair of the shell game answers A / B (make_dataset's first pair);
    with it the three cups are final answers alike, and pair members still differ in one line."""
    from tasks.generators import _SHELL_LABELS

    assert len(_SHELL_LABELS) == tdata.SHELL_ANSWER_PAIRS
    words = {w: i for i, w in enumerate(__import__("tasks").label_token_ids(tok, "shell_game"))}

    def answers(cfg):
        mb = [b for b in tdata.make_batches(cfg, tok, 5) if b.desc.startswith("shell_game")][0]
        return np.bincount([words[int(t)] for t in mb.dense[:, -2]], minlength=3), mb

    old, _ = answers(_track(interchange=0.0, all_answers=False))
    assert old[2] == 0 and old[0] == old[1] > 0
    new, mb = answers(_track(interchange=0.0, all_answers=True))
    assert new.min() >= 0.2 * new.sum(), new
    for i in range(0, mb.ids.shape[0], 2):
        assert mb.dense[i, -2] != mb.dense[i + 1, -2]


def test_init_offset_draws_other_weights_from_the_same_data(tok):
    """--init-offset changes the initial weights only: the batches (data, swap columns) stay the shipped run's,
    so a seed study keeps one twin; offset 0 is the shipped init, and leaves the logged config as it was."""
    base, other = _track(), _track(init_offset=3)
    for step in (0, 7):
        for a, b in zip(tdata.make_batches(base, tok, step), tdata.make_batches(other, tok, step)):
            assert torch.equal(a.ids, b.ids) and torch.equal(a.dense, b.dense) and torch.equal(a.swap, b.swap)
    v = len(tok)
    w0, w0b, w3 = (dict(tmodel.build_model(c, v).named_parameters()) for c in (base, base, other))
    assert all(torch.equal(w0[k], w0b[k]) for k in w0)
    assert not torch.equal(w0["lm.model.embed_tokens.weight"], w3["lm.model.embed_tokens.weight"])
    assert "init_offset" not in base.to_dict() and other.to_dict()["init_offset"] == 3


def test_attn_dropout_acts_in_training_only():
    """--attn-dropout reaches the attention of the recurrence in train mode (two runs differ) and not in eval mode
    (the evaluation tools see the trained network); off, the logged config is as before; refused with --base."""
    cfg = replace(get_preset("tiny-fbt-track"), n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, d_ff=64,
                  attn_dropout=0.5)
    model = tmodel.build_model(cfg, 64)
    assert model.lm.config.attention_dropout == 0.5
    ids = torch.randint(0, 64, (2, 12))
    mask = torch.ones_like(ids)
    model.train()
    torch.manual_seed(0)
    a = recurrent_logits(model, ids, mask)
    b = recurrent_logits(model, ids, mask)
    assert not torch.allclose(a, b)
    model.eval()
    assert torch.equal(recurrent_logits(model, ids, mask), recurrent_logits(model, ids, mask))
    assert "attn_dropout" not in get_preset("tiny-fbt-track").to_dict()
    with pytest.raises(UserError, match="attn_dropout"):
        replace(get_preset("tiny-fbt"), attn_dropout=0.1)
