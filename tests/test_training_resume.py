"""`--resume` continues the run's own recipe: a bare --resume trains what the run was saved with (not the default
preset's), and a flag given with it changes only its field, printed old -> new (training.cli)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import training.cli as tcli
import training.loop as tloop

# the recipe of the run to resume: not the smoke preset's lr (0.002) or steps (4)
RUN = ["--preset", "smoke", "--steps", "6", "--lr", "0.01", "--eval-every", "1000", "--save-every", "1000"]
QUIET = ["--threads", "1", "--no-progress"]


def _cheap_eval(model, tok, cfg, context=None):
    return {}  # quick_eval costs seconds per call; no test here reads it


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """The run straight to step 6, and the same run stopped (with a checkpoint) at step 3."""
    base = tmp_path_factory.mktemp("resume")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tloop, "quick_eval", _cheap_eval)
        tcli.main(RUN + QUIET + ["--out", str(base / "straight")])
        tcli.main(RUN + QUIET + ["--out", str(base / "stopped"), "--stop-at", "3"])
    return base


def _resume(stopped, tmp_path, monkeypatch, *flags):
    out = tmp_path / "run"
    shutil.copytree(stopped / "stopped", out)
    monkeypatch.setattr(tloop, "quick_eval", _cheap_eval)
    tcli.main(QUIET + ["--out", str(out), "--resume", *flags])
    return out, json.loads((out / "train_log.json").read_text())


def test_a_bare_resume_continues_the_saved_recipe_bit_identically(stopped, tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file

    out, log = _resume(stopped, tmp_path, monkeypatch)
    assert [h["step"] for h in log["history"]] == [1, 2, 3, 4, 5, 6]  # to the run's 6 steps, not the preset's 4
    assert log["config"]["lr"] == 0.01 and log["config"]["steps"] == 6
    assert "config_changes" not in log
    assert log["device"] == "1 process on cpu, 1 thread each"  # (--threads 1: it said "1 threads")
    assert "--resume:" not in capsys.readouterr().out  # nothing changed, nothing said
    a, b = load_file(str(stopped / "straight" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    straight = json.loads((stopped / "straight" / "train_log.json").read_text())
    assert straight["history"] == log["history"]


def test_a_flag_given_on_resume_changes_its_field_only_and_is_printed(stopped, tmp_path, monkeypatch, capsys):
    out, log = _resume(stopped, tmp_path, monkeypatch, "--seed", "5")
    printed = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("--resume:")]
    assert printed == ["--resume: seed 0 -> 5"]
    assert log["config"]["seed"] == 5 and log["config"]["lr"] == 0.01 and log["config"]["steps"] == 6
    assert [(c["step"], c["previous"]["seed"]) for c in log["config_changes"]] == [(3, 0)]


def test_a_preset_given_on_resume_replaces_the_recipe_and_says_how(stopped, tmp_path, monkeypatch, capsys):
    """--preset with --resume is the chain of presets (a shared 1-pass phase): that preset's recipe, every change
    from the run's printed."""
    out, log = _resume(stopped, tmp_path, monkeypatch, "--preset", "smoke")
    printed = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("--resume:")]
    assert sorted(printed) == ["--resume: eval_every 1000 -> 2", "--resume: lr 0.01 -> 0.002",
                               "--resume: save_every 1000 -> 2", "--resume: steps 6 -> 4"]
    assert log["config"]["lr"] == 0.002 and [h["step"] for h in log["history"]][-1] == 4


def test_an_architecture_change_on_resume_is_refused_before_anything_is_said_or_built(stopped, tmp_path, monkeypatch,
                                                                                       capsys):
    """--resume --d-model 64 printed 'd_model 32 -> 64' and was refused only once the model was built."""
    out = tmp_path / "run"
    shutil.copytree(stopped / "stopped", out)
    monkeypatch.setattr(tcli, "train", lambda *a, **k: pytest.fail("the run started"))
    saved = json.loads((out / "train_log.json").read_text())["config"]["d_model"]
    with pytest.raises(SystemExit) as e:
        tcli.main(QUIET + ["--out", str(out), "--resume", "--d-model", str(2 * saved)])
    captured = capsys.readouterr()
    assert e.value.code == 2 and "--resume:" not in captured.out
    assert f"has another architecture than this recipe (d_model {saved} -> {2 * saved})" in captured.err
