"""Mutation-testing gaps in training/data.py, training/loop.py and training/checkpoint.py: each test checks behaviour
against a hand-written reference or an invariant taken from the documented definitions (docstrings, docs/), and
names in its docstring the mutant it was written to kill (a one-line change of the code that the rest of the suite
let pass)."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from training import data as tdata
from training import loop as tloop
from training.presets import get_preset


def _cfg(**kw):
    return replace(get_preset("smoke"), **kw)


# ------------------------------------------------------------------------------------------------ training.loop

def test_lr_at_is_a_linear_warm_up_then_a_cosine_to_a_tenth_by_hand():
    """lr_at: a linear warm-up over `warmup` steps (config: "linear learning-rate warm-up steps") reaching --lr
    (config: "peak learning rate") at step `warmup`, then a cosine from lr down to 0.1 lr at step `steps`; with
    lr_legs each leg's cosine runs from the warm-up's end to that leg's end (config: "as a run resumed with a larger
    --steps at each"). Written out by hand for warmup 4, steps 20, legs (10,). Mutants killed: `step < warmup` ->
    `step <= warmup` (step `warmup` at (w+1)/w of the peak), the warm-up `(step + 1) / warmup` -> `step / warmup`
    (step 0 at rate 0), the floor 0.1 dropped."""
    cfg = _cfg(lr=1.0, warmup=4, steps=20, lr_legs=())
    cos = lambda t: 0.1 + 0.45 * (1 + math.cos(math.pi * t))
    want = [0.25, 0.5, 0.75, 1.0] + [cos((s - 4) / 16) for s in range(4, 20)]
    assert [tloop.lr_at(cfg, s) for s in range(20)] == pytest.approx(want, rel=1e-12)
    assert tloop.lr_at(cfg, 4) == pytest.approx(1.0) and tloop.lr_at(cfg, 19) == pytest.approx(cos(15 / 16))
    legs = replace(cfg, lr_legs=(10,))
    want = [0.25, 0.5, 0.75, 1.0] + [cos((s - 4) / 6) for s in range(4, 10)] + [cos((s - 4) / 16) for s in range(10, 20)]
    assert [tloop.lr_at(legs, s) for s in range(20)] == pytest.approx(want, rel=1e-12)


# ------------------------------------------------------------------------------------------------ training.data

def test_the_curriculum_keeps_n_at_most_curriculum_max_n_for_exactly_curriculum_steps_steps():
    """_n_mixture: during the curriculum (steps 0 .. curriculum_steps - 1) only N <= curriculum_max_n, the weights
    renormalized; from step curriculum_steps on the whole mixture. Mutants killed: `step < curriculum_steps` ->
    `<=` (one step too many on short samples), `n <= curriculum_max_n` -> `<` (N = curriculum_max_n dropped)."""
    cfg = _cfg(distractors={0: 0.1, 8: 0.3, 16: 0.2, 32: 0.4}, curriculum_steps=5, curriculum_max_n=8)
    for step in (0, 4):
        ns, p = tdata._n_mixture(cfg, step)
        assert ns == [0, 8] and p.tolist() == pytest.approx([0.25, 0.75])
    ns, p = tdata._n_mixture(cfg, 5)
    assert ns == [0, 8, 16, 32] and p.tolist() == pytest.approx([0.1, 0.3, 0.2, 0.4])


def test_passes_are_one_during_the_curriculum_and_drawn_from_its_first_step_on():
    """_passes: "1 pass during the curriculum" (steps 0 .. curriculum_steps - 1), the schedule's draw from step
    curriculum_steps on; warm passes are drawn uniformly from 1..warm_passes, and none (nor a fixed-point start) in
    a 1-pass batch. Mutants killed: `step < curriculum_steps` -> `<=`, the warm draw's upper end warm_passes + 1
    -> max(warm_passes, 2) (warm_passes never drawn), the fixed-point draw without its `k > 1`."""
    cfg = _cfg(schedule="0/1", curriculum_steps=3, warm_passes=3, warm_prob=1.0, fixed_point_prob=0.0)
    assert [tdata._passes(cfg, s, np.random.default_rng(s))[0] for s in range(6)] == [1, 1, 1, 2, 2, 2]
    warm = {tdata._passes(cfg, 10, np.random.default_rng(i))[1] for i in range(200)}
    assert warm == {1, 2, 3}
    fp = replace(cfg, fixed_point_prob=1.0)
    assert [tdata._passes(fp, s, np.random.default_rng(s)) for s in range(3)] == [(1, 0)] * 3
    assert tdata._passes(fp, 3, np.random.default_rng(0)) == (2, tdata.FIXED_POINT)


def test_the_state_noise_is_a_stream_of_seed_and_step():
    """noise_generator: "the state noise of a step: a CPU stream of (seed, step), the same in every process" -- the
    same (seed, step) draws the same numbers, another step or another seed other numbers. Mutant killed: the step
    left out of the generator's seed (every step drew the same noise)."""
    draw = lambda cfg, step: torch.rand(8, generator=tloop.noise_generator(cfg, step))
    a, b = _cfg(seed=0), _cfg(seed=1)
    assert draw(a, 3).equal(draw(a, 3))
    assert not draw(a, 3).equal(draw(a, 4)) and not draw(a, 0).equal(draw(a, 1))
    assert not draw(a, 3).equal(draw(b, 3))


@pytest.fixture(scope="module")
def tok():
    from tasks import build_tokenizer

    return build_tokenizer()


def test_a_packed_batch_has_batch_tokens_over_seq_len_rows_and_the_curriculum_row_length(tok):
    """make_batch: rows of exactly seq_len tokens (min(seq_len, curriculum_seq_len) during the curriculum, steps
    0 .. curriculum_steps - 1), batch_tokens // seq_len of them (at least one; the config refuses batch_tokens < seq_len). Mutants killed: at least 2 rows
    (`max(1, ...)` -> `max(2, ...)`), the curriculum's row length kept one step past the curriculum (`<` -> `<=`)."""
    assert tdata.make_batch(_cfg(batch_tokens=128, seq_len=128), tok, 0).ids.shape == (1, 128)
    assert tdata.make_batch(_cfg(batch_tokens=384, seq_len=128), tok, 0).ids.shape == (3, 128)
    cfg = _cfg(batch_tokens=256, seq_len=128, curriculum_steps=2, curriculum_seq_len=64)
    assert [tdata.make_batch(cfg, tok, s).ids.shape for s in range(4)] == [(4, 64), (4, 64), (2, 128), (2, 128)]


def test_packed_labels_are_each_samples_last_token_before_its_newline(tok):
    """make_batch: a row streams samples, each as `full text + newline`; the label position is each sample's last
    token, so every labelled column that is not the row's last is followed by the newline token. Mutant killed: the
    label one column late (on the newline itself)."""
    newline = tok("\n", add_special_tokens=False)["input_ids"][0]
    seen = 0
    for step in range(4):
        b = tdata.make_batch(_cfg(seq_len=128, batch_tokens=512, distractors={0: 1.0}), tok, step)
        for r, c in b.label_pos.nonzero().tolist():
            seen += 1
            if c + 1 < b.ids.shape[1]:
                assert b.ids[r, c + 1] == newline and b.ids[r, c] != newline, (step, r, c)
    assert seen >= 8


def test_unpaired_rows_draw_either_member_of_a_pair(tok):
    """make_batches with pairs off: one sample per row, a member of the drawn pair chosen at random. A pair's members
    differ in their answer (make_dataset's first pair has labels 0 / 1, `_training_pair`'s docstring), so rows always
    taking the first member would train one label only. Mutant killed: `pair[int(rng.integers(2))]` -> `pair[0]`."""
    from tasks import label_token_ids

    cfg = _cfg(tasks=("parity",), packing=False, batch_tokens=300, distractors={4: 1.0})
    answers = [int(mb.ids[r, mb.label_pos[r]][-1]) for s in range(2) for mb in tdata.make_batches(cfg, tok, s)
               for r in range(mb.ids.shape[0])]
    assert set(answers) == set(label_token_ids(tok, "parity"))


def test_a_steps_gradient_and_figures_are_the_mean_over_its_micro_batches(tok):
    """_step_gradients: "gradient accumulation: the step's loss is their mean" -- the gradient, the loss, the
    per-pass losses and the consistency terms of a step are the means over its micro-batches, recomputed here one
    micro-batch at a time. Mutants killed: the backward, the logged loss, the per-pass losses (after the first
    micro-batch) or the consistency terms summed instead of averaged (a gradient len(micro) times too large, before
    the clipping at norm 1)."""
    from training.loss import StepLoss
    from training.model import build_model

    cfg = _cfg(packing=False, schedule="0/1", noise=0.0, consistency=1.0, warm_passes=0, prefix_mix=0.0)
    micro = tdata.make_batches(cfg, tok, 0)
    assert len(micro) == 3 and all(mb.k == 2 for mb in micro)
    model = build_model(cfg, len(tok)).train()
    net = StepLoss(model, cfg)
    grads, losses, parts, cons = {}, [], [], []
    for mb in micro:
        model.zero_grad(set_to_none=True)
        l, p, c = net(mb, tloop.noise_generator(cfg, 0))
        l.backward()
        for n, q in model.named_parameters():
            if q.grad is not None:
                grads[n] = grads.get(n, 0) + q.grad / len(micro)
        losses.append(float(l.detach())), parts.append([float(x.detach()) for x in p]), cons.append([float(x.detach()) for x in c])
    model.zero_grad(set_to_none=True)
    procs = tloop.Processes(1, 0, torch.device("cpu"))
    loss, got_parts, got_cons = tloop._step_gradients(net, micro, cfg, tloop.noise_generator(cfg, 0), procs)
    assert float(loss) == pytest.approx(np.mean(losses), rel=1e-5)
    assert [float(x) for x in got_parts] == pytest.approx(np.mean(parts, axis=0).tolist(), rel=1e-5)
    assert len(cons[0]) > 0 and [got_cons[j] for j in sorted(got_cons)] == pytest.approx(np.mean(cons, axis=0).tolist(), rel=1e-5)
    for n, q in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(q.grad, grads[n], rtol=1e-4, atol=1e-7)


def test_the_first_non_finite_parameter_is_named_where_one_entry_is_nan():
    """_first_nonfinite names the first parameter holding a non-finite value (the divergence check after an
    update: "a NaN/inf run is stopped, never saved"); one NaN among finite entries is one. Mutant killed:
    `isfinite(p).all()` -> `.any()` (a parameter counted as finite while any of its entries is)."""
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    assert tloop._first_nonfinite(net) is None
    with torch.no_grad():
        net[1].weight[0, 1] = float("nan")
    assert tloop._first_nonfinite(net) == "1.weight"
    with torch.no_grad():
        net[0].bias[2] = float("inf")
    assert tloop._first_nonfinite(net) == "0.bias"


def test_a_run_is_evaluated_at_its_last_step_off_the_eval_grid(tmp_path, monkeypatch):
    """The loop evaluates every eval_every steps and at the run's last step (`step == cfg.steps`), so a run whose
    length is not a multiple of eval_every still ends with an evaluation in its log. Mutant killed: the
    `or step == cfg.steps` dropped."""
    import training.cli as tcli

    calls = []

    def cheap_eval(model, tok, cfg, context=None):  # quick_eval costs seconds; the step is all that is checked
        calls.append(1)
        return {}

    monkeypatch.setattr(tloop, "quick_eval", cheap_eval)
    out = tmp_path / "run"
    tcli.main(["--preset", "smoke", "--threads", "1", "--no-progress", "--out", str(out), "--steps", "3",
               "--eval-every", "2", "--save-every", "2"])
    log = __import__("json").loads((out / "train_log.json").read_text())
    assert [e["step"] for e in log["evals"]] == [2, 3] and len(calls) == 2


def test_s5_pairs_answer_across_the_whole_label_cycle_without_all_answers():
    """_training_pair: "s5 / a5 always" draw their pair at a random place of the label cycle ("their label cycle's
    first entry alone would never answer cups 2-4"), all_answers or not. Mutant killed: the offset drawn only under
    all_answers."""
    from tasks.tracking import tracker

    cfg = _cfg(tasks=("s5",), all_answers=False, distractors={4: 1.0})
    rng = np.random.default_rng(0)
    labels = {s.label for _ in range(60) for s in tdata._training_pair(cfg, "s5", 4, rng)}
    assert labels == {a for pair in tracker("s5").labels for a in pair} == set(range(5))  # cups 0-4, not only 0 / 1


def test_padding_is_skipped_by_the_loss_with_skip_values_on():
    """make_batches without packing: "right-padded, `real` marks the tokens; the loss skips the padding", and
    skip_values adds the random value symbols to the skipped columns (`_value_targets`), it does not replace the
    padding. Step 22 of this multi_register recipe (reads of 8) holds rows of 128 and 142 tokens. Mutant killed:
    `skip_pos |= _value_targets(...)` -> `skip_pos = ...` (the padding of such a batch became loss targets)."""
    from tasks import build_tokenizer

    tok = build_tokenizer()
    cfg = replace(get_preset("tiny-fbt"), tasks=("multi_register",), task_weights=None, batch_tokens=400)
    assert cfg.skip_values and cfg.reads
    mb = tdata.make_batches(cfg, tok, 22)[0]
    ends = [int(r.nonzero()[-1]) + 1 for r in mb.label_pos]  # a row's last label is its last real token
    assert sorted(set(ends)) == [128, 142] and mb.ids.shape[1] == 142
    pad = torch.zeros_like(mb.skip_pos)
    for r, end in enumerate(ends):
        pad[r, end:] = True
    assert mb.skip_pos[pad].all()
    plain = tdata.make_batches(replace(cfg, skip_values=False), tok, 22)[0]
    assert torch.equal(plain.skip_pos, pad) and torch.equal(mb.skip_pos & plain.skip_pos, plain.skip_pos)


def test_a_micro_batch_of_two_rows_gets_decoys():
    """make_batches: decoy columns for every micro-batch with a donor row ("a micro-batch of one row has no donor:
    the caller gives it none"); two rows are each other's donors. Here parity's micro-batch holds 2 rows. Mutant
    killed: decoys only for `len(seqs) > 2`."""
    from tasks import build_tokenizer

    tok = build_tokenizer()
    cfg = replace(get_preset("tiny-fbt-track"), length_doubling=0, distractors={6: 1.0}, decoy=0.5, batch_tokens=200)
    two, three = tdata.make_batches(cfg, tok, 0)
    assert two.ids.shape[0] == 2 and three.ids.shape[0] == 3
    assert two.decoy is not None and two.decoy_donor.tolist() == [1, 0] and two.decoy.any()


def _train(out, *flags):
    import training.cli as tcli

    tcli.main(["--preset", "smoke", "--threads", "1", "--no-progress", "--out", str(out), *flags])


def test_adamw_keeps_stepping_the_fusion_in_a_one_pass_step(tmp_path, monkeypatch):
    """The loop zeroes gradients with set_to_none=False: a parameter that has had a gradient keeps a zero one, so
    "AdamW went on stepping it (moments, weight decay) in steps that leave it unused, such as the fusion in a 1-pass
    step" (training.checkpoint.load_resume, which restores exactly that on --resume). After a 2-pass step, the next
    1-pass step still moves the fusion's weights. Mutant killed: `zero_grad(set_to_none=True)` (the fusion frozen
    in every 1-pass step, and a resumed run identical to it, so the resume tests pass)."""
    seen = []
    real = tloop.save_checkpoint

    def record(model, *a, **kw):
        seen.append({n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("fusion.")})
        return real(model, *a, **kw)

    monkeypatch.setattr(tloop, "quick_eval", lambda *a, **k: {})
    monkeypatch.setattr(tloop, "save_checkpoint", record)
    out = tmp_path / "run"
    _train(out, "--steps", "6", "--save-every", "1", "--eval-every", "100", "--schedule", "50/50")
    passes = [h["passes"] for h in __import__("json").loads((out / "train_log.json").read_text())["history"]]
    after = [i for i in range(1, 6) if passes[i] == 1 and 2 in passes[:i]]
    assert seen[0] and after, passes  # the case is really there: a 1-pass step after a 2-pass one
    for i in after:
        assert all(not torch.equal(seen[i][n], seen[i - 1][n]) for n in seen[i]), (i, passes)


def test_resume_keeps_the_wall_time_and_refuses_a_run_already_at_its_end(tmp_path, monkeypatch, capsys):
    """--resume continues the run's wall time (`t0 = now - log["wall_s"]`: the card's wall time is the whole run's)
    and, at a step already equal to the one asked for, refuses in one line ("nothing to train"). Mutants killed:
    t0 without the saved wall_s (a resumed run's wall_s restarts from 0); the refusal only for `step > stop` (a
    resume to the step it stands at ran nothing and said done)."""
    clock = iter(range(0, 10**6, 100))
    monkeypatch.setattr(tloop.time, "time", lambda: float(next(clock)))
    monkeypatch.setattr(tloop, "quick_eval", lambda *a, **k: {})
    out = tmp_path / "run"
    _train(out, "--steps", "2")
    wall = lambda: __import__("json").loads((out / "train_log.json").read_text())["wall_s"]
    first = wall()
    _train(out, "--steps", "3", "--resume")
    assert wall() > first > 0
    capsys.readouterr()
    with pytest.raises(SystemExit):  # the CLI's one-line refusal
        _train(out, "--steps", "3", "--resume")
    assert "is at step 3 already" in capsys.readouterr().err


def test_a_process_without_rows_takes_the_last_row_and_the_shares_are_contiguous():
    """rows_of: contiguous shares differing by at most one row; "a process without rows of its own gets the last
    row again, weighted 0". Worked by hand for 10 rows over 3 processes and 2 rows over 3. Mutant killed: the
    fallback slice(n - 1, n) -> slice(0, 1)."""
    assert [tdata.rows_of(10, r, 3) for r in range(3)] == [slice(0, 3), slice(3, 6), slice(6, 10)]
    assert [tdata.has_rows(2, r, 3) for r in range(3)] == [False, True, True]
    assert [tdata.rows_of(2, r, 3) for r in range(3)] == [slice(1, 2), slice(0, 1), slice(1, 2)]


def test_shard_slices_the_decoy_columns_with_the_rows():
    """shard: "every per-row tensor sliced alike" -- the decoy columns [batch, pos] too (decoy_donor, row numbers of
    the whole micro-batch, is not sharded). Mutant killed: "decoy" left out of ROW_FIELDS (every process kept the
    whole micro-batch's decoy mask beside its own rows)."""
    from tasks import build_tokenizer

    tok = build_tokenizer()
    cfg = replace(get_preset("tiny-fbt-track"), length_doubling=0, distractors={6: 1.0}, decoy=0.5, batch_tokens=200)
    mb = tdata.make_batches(cfg, tok, 0)[1]
    assert mb.ids.shape[0] == 3 and mb.decoy is not None
    for rank in range(2):
        part, rows = tdata.shard(mb, rank, 2), tdata.rows_of(3, rank, 2)
        assert torch.equal(part.ids, mb.ids[rows]) and torch.equal(part.decoy, mb.decoy[rows])
        assert torch.equal(part.decoy_donor, mb.decoy_donor)


def test_decoy_donors_are_a_shift_of_the_rows_never_the_row_itself():
    """_decoy: "the donors are a shift of the rows, never a row itself" (a row fed its own state is no decoy); the
    columns 1 .. L-3 alone, alike in every row. Mutant killed: the shift drawn from 0 .. rows - 1 (shift 0: every
    row its own donor)."""
    for seed in range(40):
        for rows in (2, 3, 5):
            cols, donor = tdata._decoy(9, 12, rows, 1.0, np.random.default_rng(seed))
            shift = (donor - torch.arange(rows)) % rows
            assert len(set(shift.tolist())) == 1 and 0 < int(shift[0]) < rows, (seed, rows)
            assert cols[:, 1:7].all() and not cols[:, 0].any() and not cols[:, 7:].any()


def test_longest_sample_probes_the_mixtures_largest_n():
    """longest_sample: the longest of the training pairs "drawn at the mixture's largest N" (what --base's context
    is checked against): a mixture with N = 0 beside N = 64 probes exactly what N = 64 alone does, and longer rows
    than N = 0 alone. Mutant killed: the probe drawn at min(distractors)."""
    from tasks import build_tokenizer

    tok = build_tokenizer()
    cfg = lambda mix: _cfg(tasks=("completion", "memory"), distractors=mix)
    top = tdata.longest_sample(cfg({64: 1.0}), tok)
    assert tdata.longest_sample(cfg({0: 0.5, 64: 0.5}), tok) == top > tdata.longest_sample(cfg({0: 1.0}), tok)


# ------------------------------------------------------------------------------------------ training.checkpoint

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(folder, model builder, cfg) of a checkpoint at step 1 of a smoke model with one AdamW step taken."""
    from tasks import build_tokenizer
    from training.checkpoint import save_checkpoint
    from training.model import build_model

    tok, cfg = build_tokenizer(), _cfg()
    model = build_model(cfg, len(tok))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()
    out = tmp_path_factory.mktemp("ckpt") / "run"
    save_checkpoint(model, tok, opt, cfg, 1, {"history": [1]}, out)

    def resume(folder):
        from training.checkpoint import load_resume

        fresh = build_model(cfg, len(tok))
        return load_resume(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3), cfg, folder)

    return out, resume, cfg


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _rewrite_state(folder, **changes):
    """The trainer state of `folder` with header entries changed (the tensors kept)."""
    import json

    from safetensors.torch import save_file

    from training.checkpoint import STATE_FILE, read_trainer_state

    meta, tensors = read_trainer_state(folder)
    save_file(tensors, str(folder / STATE_FILE), metadata={"trainer_state": json.dumps({**meta, **changes})})


def test_resume_refuses_a_log_other_than_the_one_saved(saved, tmp_path):
    """The trainer state "records the digests of the model and log files it belongs to, so a save cut short ... is
    refused on --resume". A train_log.json rewritten after the save is refused by name. Mutant killed: the log's
    digest left out of the check."""
    from common.errors import UserError

    out, resume, _ = saved
    run = _copy(out, tmp_path / "run")
    assert resume(run)[0] == 1
    (run / "train_log.json").write_text('{"history": [1, 2]}')
    with pytest.raises(UserError, match="train_log.json is not the one"):
        resume(run)


@pytest.mark.parametrize("changes, words", [({"step": True}, "bad step True"),
                                            ({"format": "fbt-trainer-state/0"}, "is not a fbt-trainer-state/1")])
def test_resume_refuses_a_boolean_step_and_another_format(saved, tmp_path, changes, words):
    """load_resume: the step must be an int >= 0, and a JSON `true` is not one (bool is an int in Python);
    read_trainer_state refuses a header of another format. Mutants killed: the `isinstance(step, bool)` guard dropped
    (a step of True resumed as step 1); the format check dropped."""
    from common.errors import UserError

    out, resume, _ = saved
    run = _copy(out, tmp_path / "run")
    _rewrite_state(run, **changes)
    with pytest.raises(UserError, match="corrupt checkpoint") as e:
        resume(run)
    assert words in str(e.value)


def test_finishing_a_pending_move_leaves_a_killed_writes_temporary_behind(saved, tmp_path):
    """finish_pending moves the pending checkpoint's files into the run's folder, the trainer state last, and
    removes the pending folder, "empty now (but for a temporary a kill may have left)": a dot-named temporary is
    not a checkpoint file and is not moved in. Mutant killed: the `not p.name.startswith(".")` filter dropped (a
    stray temporary moved into the run's folder)."""
    import os

    from training.checkpoint import PENDING, STATE_FILE, finish_pending

    out, resume, _ = saved
    run = _copy(out, tmp_path / "run")
    (run / PENDING).mkdir()
    os.replace(run / STATE_FILE, run / PENDING / STATE_FILE)
    (run / PENDING / ".model.safetensors.x1.tmp").write_bytes(b"half")
    finish_pending(run)
    assert not (run / PENDING).exists() and (run / STATE_FILE).is_file()
    assert sorted(p.name for p in run.iterdir()) == sorted(p.name for p in out.iterdir())
    assert resume(run)[0] == 1


def test_a_looped_steps_truncation_and_iterations_are_its_draw_then_the_trained_r(tmp_path, monkeypatch):
    """Each step of a looped model runs the r it drew (1 + Poisson(r - 1)), with iterations 1..r - k under no_grad
    at --loop-truncate k ("backpropagate through the last k iterations"), and then puts the model back at the trained
    r with nothing frozen, which evaluation and the saved checkpoint see. Mutants killed: frozen = r - k - 1 or
    r - k + 1 (one iteration too many or too few with gradient); the model left at the last step's draw after it."""
    from training.model import loop_iterations_at

    during, after = [], []
    real = tloop._step_gradients

    def record(net, micro, cfg, gen, procs):
        during.append((net.model.iterations, net.model.frozen_iterations))  # net: the StepLoss (one process)
        return real(net, micro, cfg, gen, procs)

    def at_eval(model, *a, **k):
        after.append((model.iterations, model.frozen_iterations))
        return {}

    monkeypatch.setattr(tloop, "_step_gradients", record)
    monkeypatch.setattr(tloop, "quick_eval", at_eval)
    out = tmp_path / "run"
    flags = ("--steps", "8", "--eval-every", "1", "--save-every", "100", "--loop-core", "1", "--loop-iterations", "3",
             "--loop-truncate", "2", "--objective", "multipass", "--schedule", "1")
    _train(out, *flags)
    cfg = _cfg(steps=8, loop_core=1, loop_iterations=3, loop_truncate=2, objective="multipass", schedule="1")
    drawn = [loop_iterations_at(cfg, s) for s in range(8)]
    assert len(set(drawn)) > 1 and max(drawn) > 2  # the case is there: r varies, some steps freeze iterations
    assert during == [(r, max(0, r - 2)) for r in drawn]
    assert after == [(3, 0)] * 8


def test_a_save_removes_an_earlier_versions_pickle(tmp_path):
    """An earlier version's trainer_state.pt "must not lie beside" a new checkpoint (--resume refuses a folder
    holding it): save_checkpoint removes it, and the folder then resumes. Mutant killed: the unlink dropped (a
    folder saved over an old run's pickle, refused on its next --resume)."""
    from tasks import build_tokenizer
    from training.checkpoint import LEGACY_STATE_FILE, load_resume, save_checkpoint
    from training.model import build_model

    tok, cfg = build_tokenizer(), _cfg()
    model = build_model(cfg, len(tok))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = tmp_path / "run"
    out.mkdir()
    (out / LEGACY_STATE_FILE).write_bytes(b"an old pickle")
    save_checkpoint(model, tok, opt, cfg, 1, {"history": [1]}, out)
    assert not (out / LEGACY_STATE_FILE).exists()
    fresh = build_model(cfg, len(tok))
    assert load_resume(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3), cfg, out)[0] == 1


def test_resume_refuses_another_sliding_window(tmp_path):
    """load_resume compares "what each position attends to and how far" with the checkpoint: a run saved with
    16-token windows does not resume as a model of 32-token windows (every layer sliding in both: only the
    window's size differs). Mutant killed: sliding_window left out of the compared keys."""
    from common.errors import UserError
    from tasks import build_tokenizer
    from training.checkpoint import load_resume, save_checkpoint
    from training.model import build_model

    tok = build_tokenizer()
    cfg16, cfg32 = _cfg(attn_window=16), _cfg(attn_window=32)
    model = build_model(cfg16, len(tok))
    out = tmp_path / "run"
    save_checkpoint(model, tok, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg16, 1, {"history": [1]}, out)
    other = build_model(cfg32, len(tok))
    assert other.lm.config.layer_types == model.lm.config.layer_types  # the case is there: the size alone differs
    with pytest.raises(UserError, match="another architecture \\(sliding_window differ"):
        load_resume(other, torch.optim.AdamW(other.parameters(), lr=1e-3), cfg32, out)
