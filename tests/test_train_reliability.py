"""`python -m training.train` under bad input, divergence, crafted files, concurrent runs and failed overwrites
(issue "reliability pass"): every refusal is one stderr line and exit 2 before anything is touched, a NaN run is
never saved, resume runs no pickle, --overwrite replaces an earlier run only once the new one is complete, and
no temporary survives.

Cheap: the `smoke` preset, 1-4 steps, in-process `main(argv)` (one subprocess for the real CLI).
"""
from __future__ import annotations

import math
import os
import pickle
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from common.errors import UserError
from common.io import DirLock
from training.presets import get_preset
import training.checkpoint as tckpt
import training.cli as tcli
import training.loop as tloop
import training.loss as tloss

ROOT = Path(__file__).resolve().parent.parent
FAST = ["--preset", "smoke", "--threads", "1", "--no-progress", "--eval-every", "1000"]


def _cheap_eval(model, tok, cfg, context=None):  # quick_eval costs seconds on a shared CPU; its mode toggling is kept
    model.eval()
    model.train()
    return {}


@pytest.fixture(autouse=True)
def cheap_eval(monkeypatch):
    monkeypatch.setattr(tloop, "quick_eval", _cheap_eval)


def _snapshot(path: Path) -> dict:
    """Every file under `path` (relative name -> bytes, mode)."""
    return {str(f.relative_to(path)): (f.read_bytes(), f.stat().st_mode) for f in sorted(path.rglob("*"))
            if f.is_file()}


def _expect_error(argv, capsys, match, code=2):
    with pytest.raises(SystemExit) as e:
        tcli.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == code, err
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err and "usage:" not in err, err
    assert re.search(match, err), err
    return err


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A finished 2-step smoke run (a checkpoint that --resume and --overwrite can meet)."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tloop, "quick_eval", _cheap_eval)
        tcli.main(FAST + ["--out", str(out), "--steps", "4", "--stop-at", "2", "--save-every", "1"])
    return out


def _copy(ckpt: Path, tmp_path: Path, extra=("eval.json", "MODEL_CARD.md")) -> Path:
    out = tmp_path / "old"
    shutil.copytree(ckpt, out)
    for name in extra:  # what analysis.evaluate / training.card put beside a checkpoint
        (out / name).write_text(f"old {name}\n")
    return out


def _no_leftovers(parent: Path, name: str = "old") -> None:
    """Nothing but `name` itself in its parent (no staging folder), and no temporary inside it."""
    assert sorted(p.name for p in parent.iterdir()) == [name]
    left = [p.name for p in (parent / name).rglob("*") if p.name.endswith(".tmp") or ".staging-" in p.name]
    assert not left, left


# ----- 1. non-finite numbers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--lam", "--lr", "--gate-std", "--noise", "--label-weight", "--prefix-mix",
                                  "--warm-prob", "--fixed-point-prob", "--fixed-point-tol", "--consistency"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_flags_are_refused_up_front(tmp_path, capsys, flag, value):
    out = tmp_path / "x"
    _expect_error(FAST + ["--out", str(out), f"{flag}={value}"], capsys, f"argument {flag}: must be a finite number")
    assert not out.exists()


def test_float_flags_show_their_range_in_help(capsys):
    with pytest.raises(SystemExit) as e:
        tcli.main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for bound in ("lambda, weight of the later passes; [0, 1000]", "peak learning rate; (0, 1]",
                  "1..1000000", "0..4294967295", "0..1024", "1..10000000"):
        assert bound in text, bound


class _Diverge:
    """multipass_loss, turned NaN from its `at`-th call on (one call per step: packed smoke batches)."""

    def __init__(self, at: int):
        self.at, self.calls, self.real = at, 0, tloss.multipass_loss

    def __call__(self, *a, **kw):
        total, parts = self.real(*a, **kw)
        self.calls += 1
        return (total * float("nan"), parts) if self.calls >= self.at else (total, parts)


def _finite_checkpoint_at(out: Path, step: int) -> None:
    from safetensors.torch import load_file

    assert all(bool(torch.isfinite(t).all()) for t in load_file(str(out / "model.safetensors")).values())
    meta, tensors = tckpt.read_trainer_state(out)
    assert meta["step"] == step and all(bool(torch.isfinite(t).all()) for t in tensors.values())
    assert "NaN" not in (out / "train_log.json").read_text()


def test_nan_loss_stops_training_and_is_never_saved(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tloss, "multipass_loss", _Diverge(at=2))
    out = tmp_path / "run"
    _expect_error(FAST + ["--out", str(out), "--steps", "4", "--save-every", "1"], capsys,
                  r"training diverged at step 2: non-finite loss nan.*last checkpoint .* is step 1")
    _finite_checkpoint_at(out, 1)  # step 1's checkpoint, never a NaN one
    _no_leftovers(tmp_path, "run")


def test_non_finite_parameter_stops_training(tmp_path, capsys, monkeypatch):
    real_step = torch.optim.AdamW.step

    def step_then_overflow(self, *a, **kw):  # as an update that overflows float32
        out = real_step(self, *a, **kw)
        with torch.no_grad():
            self.param_groups[0]["params"][-1].view(-1)[0] = float("inf")
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step_then_overflow)
    out = tmp_path / "run"
    _expect_error(FAST + ["--out", str(out), "--steps", "2"], capsys,
                  r"diverged at step 1: non-finite parameter .* after the update.*nothing was saved")
    assert not out.exists()  # the run made the folder and leaves none behind


def test_divergence_under_overwrite_keeps_the_earlier_run(ckpt, tmp_path, capsys, monkeypatch):
    old = _copy(ckpt, tmp_path)
    before = _snapshot(old)
    monkeypatch.setattr(tloss, "multipass_loss", _Diverge(at=3))
    _expect_error(FAST + ["--out", str(old), "--overwrite", "--steps", "4", "--save-every", "1"], capsys,
                  "diverged at step 3.*still holds the earlier run")
    assert _snapshot(old) == before
    _no_leftovers(tmp_path)


# ----- 2. no pickle on --resume ------------------------------------------------------------------------------
class _Payload:
    """Unpickling this creates `marker`: what a crafted trainer state could do instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("where", ["legacy", "renamed-pickle", "renamed-torch-save"])
def test_crafted_trainer_state_runs_no_code(ckpt, tmp_path, capsys, where):
    out = shutil.copytree(ckpt, tmp_path / "run")
    marker = tmp_path / "pwned"
    payload = {"step": 2, "optimizer": _Payload(marker)}
    if where == "legacy":  # an old-style trainer_state.pt, the new state gone
        (out / tckpt.STATE_FILE).unlink()
        torch.save(payload, out / tckpt.LEGACY_STATE_FILE)
        match = r"--resume: .* holds trainer_state\.pt.*pickle.*not loaded"
    elif where == "renamed-pickle":
        (out / tckpt.STATE_FILE).write_bytes(pickle.dumps(payload))
        match = "--resume: corrupt checkpoint"
    else:
        torch.save(payload, out / tckpt.STATE_FILE)
        match = "--resume: corrupt checkpoint"
    before = _snapshot(out)
    _expect_error(FAST + ["--out", str(out), "--steps", "4", "--resume"], capsys, match)
    assert not marker.exists()
    assert _snapshot(out) == before


def test_resume_never_calls_torch_load_and_stays_bit_identical(ckpt, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    straight = tmp_path / "straight"
    tcli.main(FAST + ["--out", str(straight), "--steps", "4", "--save-every", "1"])
    split = shutil.copytree(ckpt, tmp_path / "split")

    def no_pickle(*a, **kw):
        raise AssertionError("torch.load called on resume")

    monkeypatch.setattr(torch, "load", no_pickle)
    tcli.main(FAST + ["--out", str(split), "--steps", "4", "--save-every", "1", "--resume"])
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(split / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa, ta = tckpt.read_trainer_state(straight)
    sb, tb = tckpt.read_trainer_state(split)
    assert sa["optimizer"] == sb["optimizer"] and ta.keys() == tb.keys()
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    # the optimizer state goes back exactly as it came (tuples, int keys, 0-dim step tensors)
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), betas=(0.9, 0.95))
    sd = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}}, "param_groups": opt.state_dict()["param_groups"]}
    tensors: dict = {}
    back = tckpt._unflatten(tckpt._flatten(sd, tensors), tensors)
    assert back["param_groups"] == sd["param_groups"] and back["param_groups"][0]["betas"] == (0.9, 0.95)
    assert torch.equal(back["state"][0]["step"], sd["state"][0]["step"])


def test_resume_refuses_a_model_from_another_save(ckpt, tmp_path, capsys):
    out = shutil.copytree(ckpt, tmp_path / "run")
    other = tmp_path / "other"
    tcli.main(FAST + ["--out", str(other), "--steps", "4", "--stop-at", "1"])
    shutil.copy(other / "model.safetensors", out / "model.safetensors")  # as a save cut short would leave it
    _expect_error(FAST + ["--out", str(out), "--steps", "4", "--resume"], capsys,
                  "corrupt checkpoint.*model.safetensors is not the one")


# ----- 3. --overwrite never loses the earlier run ------------------------------------------------------------
def test_invalid_stop_at_under_overwrite_deletes_nothing(tmp_path, capsys):
    shipped = ROOT / "checkpoints" / "tiny-fbt"
    if not (shipped / "model.safetensors").is_file():
        pytest.skip("no shipped tiny-fbt checkpoint")
    out = shutil.copytree(shipped, tmp_path / "old")
    before = _snapshot(out)
    _expect_error(["--preset", "smoke", "--out", str(out), "--overwrite", "--stop-at", "999"], capsys,
                  r"--stop-at must be in 1\.\.4")
    assert _snapshot(out) == before
    _no_leftovers(tmp_path)


def test_overwrite_replaces_every_file_of_the_earlier_run(ckpt, tmp_path):
    old = _copy(ckpt, tmp_path, extra=("eval.json", "MODEL_CARD.md", tckpt.LEGACY_STATE_FILE))
    (old / ".train_log.json.abc123.tmp").write_text("a killed run's temporary")
    mode = old.stat().st_mode
    tcli.main(FAST + ["--out", str(old), "--overwrite", "--steps", "3", "--seed", "5"])
    names = sorted(p.name for p in old.iterdir())
    assert names == sorted(["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                            tckpt.LOG_FILE, tckpt.STATE_FILE]), names
    meta, _ = tckpt.read_trainer_state(old)
    assert meta["step"] == 3 and meta["config"]["seed"] == 5
    assert old.stat().st_mode == mode
    _no_leftovers(tmp_path)


class _Interrupt(BaseException):
    pass


@pytest.mark.parametrize("kind", ["error", "interrupt"])
def test_failed_overwrite_keeps_the_earlier_run(ckpt, tmp_path, capsys, monkeypatch, kind):
    old = _copy(ckpt, tmp_path)
    before = _snapshot(old)
    real = tloop.save_checkpoint

    def save_then_fail(model, tok, opt, cfg, step, log, out):
        real(model, tok, opt, cfg, step, log, out)
        if step == 2:  # after a complete new checkpoint, before the run's end
            raise KeyboardInterrupt if kind == "interrupt" else UserError("disk full (simulated)")

    monkeypatch.setattr(tloop, "save_checkpoint", save_then_fail)
    if kind == "interrupt":
        with pytest.raises(SystemExit) as e:
            tcli.main(FAST + ["--out", str(old), "--overwrite", "--steps", "4", "--save-every", "1"])
        assert e.value.code == 130
    else:
        _expect_error(FAST + ["--out", str(old), "--overwrite", "--steps", "4", "--save-every", "1"], capsys,
                      "disk full")
    assert _snapshot(old) == before
    _no_leftovers(tmp_path)


def test_overwrite_refuses_a_folder_with_other_files(ckpt, tmp_path, capsys):
    old = _copy(ckpt, tmp_path)
    (old / "notes.txt").write_text("mine")
    before = _snapshot(old)
    _expect_error(FAST + ["--out", str(old), "--overwrite"], capsys, "--overwrite: .* also holds notes.txt")
    assert _snapshot(old) == before


def test_without_overwrite_files_of_an_earlier_run_are_kept(tmp_path, capsys):
    out = tmp_path / "old"
    out.mkdir()
    (out / "train_log.json").write_text("{}")
    _expect_error(FAST + ["--out", str(out)], capsys, r"already holds files of an earlier run \(train_log.json\)")
    assert sorted(p.name for p in out.iterdir()) == ["train_log.json"]


def test_stale_staging_folder_of_a_killed_run_is_removed(ckpt, tmp_path):
    old = _copy(ckpt, tmp_path)
    stale = tmp_path / ".old.staging-killed"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    tcli.main(FAST + ["--out", str(old), "--overwrite", "--steps", "1"])
    _no_leftovers(tmp_path)


# ----- 4. one run per output directory -----------------------------------------------------------------------
@pytest.mark.parametrize("case", ["fresh", "resume", "overwrite"])
def test_a_locked_output_directory_is_refused(ckpt, tmp_path, capsys, case):
    out = tmp_path / "old"
    if case != "fresh":
        shutil.copytree(ckpt, out)
    flags = {"fresh": [], "resume": ["--resume"], "overwrite": ["--overwrite"]}[case]
    with DirLock(out):
        before = _snapshot(out)
        _expect_error(FAST + ["--out", str(out), "--steps", "4"] + flags, capsys, "another training run is writing")
        assert _snapshot(out) == before
    _no_leftovers(tmp_path)


# ----- 5. bad input --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, match", [
    (["--task-weights", "nan,1,1", "--no-packing"], "task_weights needs one positive weight per task"),
    (["--task-weights", "inf,1,1", "--no-packing"], "task_weights needs one positive weight per task"),
    (["--eval-every", "0"], "argument --eval-every: must be an integer in 1..10000000, got 0"),
    (["--save-every", "0"], "argument --save-every: must be an integer in 1..10000000"),
    (["--seed", "-1"], "argument --seed: must be an integer in 0..4294967295"),
    (["--seed", str(2**32)], "argument --seed"),
    (["--threads", "-2"], "argument --threads: must be an integer in 0..1024"),  # common.cli.MAX_THREADS
    (["--threads", "1025"], "argument --threads"),
    (["--distractors", "0:nan"], "bad --distractors '0:nan'"),
    (["--distractors", "0:inf,8:1"], "bad --distractors"),
    (["--distractors", "0:-1,8:1"], "bad --distractors"),
    (["--distractors", "5000:1"], "bad --distractors"),
    (["--distractors", "0:0"], "distractors must map N in 0..1024 to finite non-negative weights with a positive, "
                               "finite sum"),
    # a sum past the float range made every probability 0: numpy's traceback after the model was built
    (["--distractors", "0:1e308,8:1e308"], "positive, finite sum"),
    (["--schedule", "1e308/1e308"], "positive, finite sum"),
    (["--tasks", "parity", "--distractors", "1:1", "--variants", "uniform:1e308,hold:1e308"], "positive, finite sum"),
    (["--batch-tokens", "1e12"], "argument --batch-tokens: must be an integer in 1..1000000"),
    (["--batch-tokens", "1000000000000"], "argument --batch-tokens"),
    (["--steps", "0"], "argument --steps"),
    (["--steps", "99999999999"], "argument --steps"),
    (["--stop-at", "0"], "argument --stop-at"),
    (["--stop-at", "5"], r"--stop-at must be in 1\.\.4"),
    (["--seq-len", "4096"], r"seq_len \(4096\) .* max_len \(2048\)"),
    (["--curriculum-seq-len", "0"], "argument --curriculum-seq-len"),
    (["--warm-passes", "100000"], "argument --warm-passes"),
    (["--reads", "-1"], "argument --reads"),
    (["--schedule", "inf/1"], "bad schedule 'inf/1'"),
    (["--schedule", "/".join(["1"] * 17)], "at most 16"),
    (["--prefix-mix", "1.5"], "argument --prefix-mix"),
    (["--lr", "0"], "argument --lr"),
    (["--steps", "x"], "argument --steps: must be an integer"),
    (["--no-such-flag"], "unrecognized arguments"),
])
def test_bad_input_is_one_line_before_any_work(tmp_path, capsys, monkeypatch, argv, match):
    def no_work(*a, **kw):
        raise AssertionError("a model was built for a run that was bound to fail")

    monkeypatch.setattr(tloop, "build_model", no_work)
    out = tmp_path / "x"
    _expect_error(FAST + ["--out", str(out)] + argv, capsys, match)
    assert not out.exists()


def test_seq_len_beyond_the_base_models_context_is_refused(tmp_path, capsys, monkeypatch):
    short = replace(get_preset("smoke"), max_len=64, seq_len=32, curriculum_seq_len=32)
    with monkeypatch.context() as mp:
        mp.setattr(tcli, "get_preset", lambda name: replace(short))
        tcli.main(FAST + ["--out", str(tmp_path / "base"), "--steps", "1"])
    out = tmp_path / "x"
    _expect_error(FAST + ["--out", str(out), "--base", str(tmp_path / "base"), "--seq-len", "128"], capsys,
                  r"seq_len \(128\) .* context of --base .* \(64\)")
    assert not out.exists()


def _short_base(tmp_path, monkeypatch, max_len=64):
    """A base trained from scratch (1 step) with a context of `max_len` tokens."""
    short = replace(get_preset("smoke"), max_len=max_len, seq_len=32, curriculum_seq_len=32)
    with monkeypatch.context() as mp:
        mp.setattr(tcli, "get_preset", lambda name: replace(short))
        tcli.main(FAST + ["--out", str(tmp_path / "base"), "--steps", "1"])
    return tmp_path / "base"


def test_unpacked_rows_beyond_the_base_models_context_are_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """One sample per row (--no-packing) at N = 8 is longer than a 64-token context: refused in one line before the
    model is built (a GPT-2 base, learned positions, ended in an IndexError; a rotary one trained past it)."""
    base = _short_base(tmp_path, monkeypatch)

    def no_work(*a, **kw):
        raise AssertionError("a model was built for a run that was bound to fail")

    monkeypatch.setattr(tloop, "build_model", no_work)
    out = tmp_path / "x"
    _expect_error(FAST + ["--out", str(out), "--base", str(base), "--no-packing", "--distractors", "8:1"], capsys,
                  r"--base .*: its training samples at N = 8 are \d+ tokens .* longer than its context \(64\)")
    assert not out.exists()


def test_quick_evaluations_longer_than_the_base_models_context_are_left_out(tmp_path, capsys, monkeypatch):
    """The quick evaluations' prompts at N = 8 outgrow a 64-token context: they are left out with a note (the
    run used to train and then stop at its first evaluation, losing its work), and the run completes."""
    import json

    from tasks import build_tokenizer
    from training.quick_eval import quick_eval, settings

    base = _short_base(tmp_path, monkeypatch)
    capsys.readouterr()
    monkeypatch.setattr(tloop, "quick_eval", quick_eval)  # the real one, here
    cfg = replace(get_preset("smoke"), max_len=64, seq_len=32, curriculum_seq_len=32)
    kept, dropped = settings(build_tokenizer(), cfg, 64)
    assert dropped and all(tokens > 64 for _, _, tokens in dropped)
    out = tmp_path / "x"
    tcli.main(FAST + ["--out", str(out), "--base", str(base), "--seq-len", "32", "--steps", "1", "--eval-every", "1"])
    notes = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("note: the quick evaluations")]
    assert len(notes) == len(dropped)
    evals = json.loads((out / "train_log.json").read_text())["evals"]
    assert evals and set(evals[-1]["label_acc"]) == {t for t, _ in kept}


def test_a_looped_base_is_refused(tmp_path, capsys, monkeypatch):
    """A looped checkpoint's blocks are not its inner LM's parameters: wrapped in the fusion it trained nothing but
    the embeddings and wrote a checkpoint no command could load."""
    def no_work(*a, **kw):
        raise AssertionError("a model was built for a run that was bound to fail")

    monkeypatch.setattr(tloop, "build_model", no_work)
    out = tmp_path / "x"
    _expect_error(FAST + ["--out", str(out), "--base", "tiny-loop-track"], capsys, "a looped model .* takes no fusion")
    assert not out.exists()


@pytest.mark.parametrize("field, value", [
    ("lam", math.nan), ("noise", math.inf), ("lr", math.nan), ("gate_std", math.nan), ("label_weight", -1.0),
    ("eval_every", 0), ("save_every", 0), ("seed", -1), ("batch_tokens", 10**12), ("steps", 0),
    ("task_weights", (math.nan, 1.0, 1.0)), ("task_weights", (1.0, 1.0, math.inf)),
    ("distractors", {0: math.nan}), ("distractors", {0: 1.0, 8: -0.5}), ("seq_len", 4096),
    ("warmup", -1), ("weight_decay", math.nan), ("steps", True),
])
def test_recipe_values_are_checked_whatever_their_source(field, value):
    with pytest.raises(UserError, match=field.split("_")[0]):
        replace(get_preset("smoke"), **{field: value})


@pytest.mark.parametrize("name", ["tiny-base", "tiny-fbt", "tiny-std", "tiny-fbt-no3", "tiny-fbt-track",
                                  "tiny-std-track"])
def test_shipped_recipes_are_the_presets(name):
    """The recipe logged with each shipped checkpoint is its preset's (an edit to a preset that changes what
    `--preset NAME` trains shows here), and it still validates."""
    import json

    log = ROOT / "checkpoints" / name / "train_log.json"
    if not log.is_file():
        pytest.skip(f"no shipped {name} checkpoint")
    assert json.loads(log.read_text())["config"] == get_preset(name).to_dict()


# ----- 6. output locations -------------------------------------------------------------------------------------
def test_empty_out_is_refused(capsys):
    _expect_error(FAST + ["--out", ""], capsys, "--out is empty")


def test_out_on_a_pseudo_file_system_is_refused(capsys, monkeypatch):
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc")
    monkeypatch.setattr(tloop, "build_model", lambda *a, **kw: pytest.fail("work started"))
    _expect_error(FAST + ["--out", "/proc/x"], capsys, "--out /proc/x")


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("x")
    _expect_error(FAST + ["--out", str(f)], capsys, "exists and is not a directory")
    assert f.read_text() == "x"


def test_real_cli_error_has_no_usage_block(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "training.train", "--preset", "smoke", "--lam", "nan",
                        "--out", str(tmp_path / "x")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: argument --lam: must be a finite number in [0.0, 1000.0], got nan"]
    assert not (tmp_path / "x").exists()


# ----- 7. temporaries ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["model", "trainer state"])
def test_an_interrupted_save_leaves_no_temporary(tmp_path, monkeypatch, which):
    import safetensors.torch

    real = safetensors.torch.save_file

    def write_half_then_interrupt(tensors, path, metadata=None):
        if (which == "trainer state") == ("trainer_state" in (metadata or {})):
            Path(path).write_bytes(b"half")
            raise _Interrupt
        return real(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", write_half_then_interrupt)
    out = tmp_path / "run"
    with pytest.raises(_Interrupt):
        tcli.main(FAST + ["--out", str(out), "--steps", "1"])
    left = sorted(p.name for p in out.iterdir()) if out.exists() else []  # an empty folder it made is removed
    assert not [n for n in left if n.endswith(".tmp")] and tckpt.STATE_FILE not in left, left
    # the checkpoint is written whole beside the previous one (none here) before it replaces it: nothing is left
    assert left == [], left


def test_temporaries_of_a_killed_run_are_removed_on_resume(ckpt, tmp_path):
    out = shutil.copytree(ckpt, tmp_path / "run")
    (out / ".train_log.json.x1.tmp").write_text("{")
    (out / "model.safetensors.tmp").write_bytes(b"half")
    (out / ".tokenizer.x2.tmp").mkdir()
    (out / ".tokenizer.x2.tmp" / "tokenizer.json").write_text("{")
    tcli.main(FAST + ["--out", str(out), "--steps", "4", "--resume"])
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    assert tckpt.read_trainer_state(out)[0]["step"] == 4


@pytest.mark.parametrize("flags", [[], ["--overwrite"]])
def test_a_run_written_between_the_checks_and_the_lock_is_not_replaced(tmp_path, monkeypatch, capsys, flags):
    """Run B checks --out (empty), then spends a while loading (a --base, a big model); run A finishes into --out
    meanwhile. B took the lock and wrote over A's checkpoint with exit 0: it checks --out again once it holds the
    lock."""
    out = tmp_path / "run"
    out.mkdir()
    real_build = tloop.build_model

    def build_while_another_run_finishes(*a, **k):
        (out / "model.safetensors").write_bytes(b"run A")
        (out / "config.json").write_text("{}")
        return real_build(*a, **k)

    monkeypatch.setattr(tloop, "build_model", build_while_another_run_finishes)
    _expect_error(FAST + ["--out", str(out), "--steps", "1", *flags], capsys,
                  "was written by another run after this run's checks")
    assert (out / "model.safetensors").read_bytes() == b"run A" and sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors"]


def test_resume_completes_a_final_move_a_kill_cut_short(ckpt, tmp_path, capsys):
    """A kill while the last save's files moved in leaves a complete pending checkpoint (the trainer state moves
    last): --resume completes the move, and that was all there was to do (it was refused as "nothing to train")."""
    run = shutil.copytree(ckpt, tmp_path / "run")
    before = _snapshot(run)
    pending = run / tckpt.PENDING
    pending.mkdir()
    os.replace(run / tckpt.STATE_FILE, pending / tckpt.STATE_FILE)
    step = tckpt.read_trainer_state(pending)[0]["step"]
    capsys.readouterr()
    assert tcli.main(FAST + ["--out", str(run), "--steps", "4", "--stop-at", str(step), "--resume"]) in (0, None)
    out = capsys.readouterr().out
    assert f"completed the move of step {step}'s checkpoint" in out, out
    assert not pending.exists() and _snapshot(run) == before
    _expect_error(FAST + ["--out", str(run), "--steps", "4", "--stop-at", str(step), "--resume"], capsys,
                  rf"at step {step} already.*nothing to train")  # done: a second resume has nothing left


def test_resume_with_nothing_to_train_is_refused(ckpt, tmp_path, capsys):
    """--resume to a step the run already passed printed "done" and changed nothing."""
    run = shutil.copytree(ckpt, tmp_path / "run")
    before = _snapshot(run)
    step = tckpt.read_trainer_state(run)[0]["step"]
    _expect_error(FAST + ["--out", str(run), "--steps", str(step), "--resume"], capsys,
                  rf"at step {step} already.*nothing to train")
    assert _snapshot(run) == before
