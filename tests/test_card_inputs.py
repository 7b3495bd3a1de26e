"""python -m training.card on bad inputs (one line, exit 2, the card untouched), the recipe changes of a resumed
run listed per segment, and the card written atomically."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from training.card import main, write_card

SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-fbt-track2"


@pytest.fixture
def run(tmp_path):
    if not (SHIPPED / "model.safetensors").is_file():
        pytest.skip("no shipped tiny-fbt-track2 checkpoint")
    return shutil.copytree(SHIPPED, tmp_path / "m")


def _log(run):
    return json.loads((run / "train_log.json").read_text())


def _expect_error(run, capsys, match):
    before = (run / "MODEL_CARD.md").read_bytes()
    with pytest.raises(SystemExit) as e:
        main([str(run), "--command", "cmd"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert "Traceback" not in err and re.search(match, err), err
    assert (run / "MODEL_CARD.md").read_bytes() == before


def _truncate(run):
    data = (run / "model.safetensors").read_bytes()
    (run / "model.safetensors").write_bytes(data[: len(data) // 2])


def _config(**over):
    def edit(run):
        log = _log(run)
        log["config"] = {**log["config"], **over}
        for k, v in over.items():
            if v is None:
                del log["config"][k]
        (run / "train_log.json").write_text(json.dumps(log))
    return edit


def _write(name, data):
    return lambda run: (run / name).write_bytes(data if isinstance(data, bytes) else data.encode())


@pytest.mark.parametrize("damage, match", [
    (_truncate, r"model.safetensors cannot be read as safetensors weights"),
    (_write("train_log.json", "[1, 2]"), r"training log .* is not a JSON object"),
    (_write("train_log.json", b"\xff\xfe{}"), r"training log .*: not UTF-8 text"),
    (_write("train_log.json", '{"config": {"steps": 1e999}}'), r"1e999 is out of range"),
    (_config(lr=None), r"config of training log .* lacks lr"),  # printed "lr None"
    (_config(lr="fast"), r"is not a valid recipe: lr must be a finite number"),
    (_config(learning_rate=0.1), r"has fields no training run writes \(learning_rate\)"),
    (_write("train_log.json", '{"history": [{"loss": "low"}]}'), r"history must be a list of steps"),
    (_write("train_log.json", '{"config_changes": [{"step": 3}]}'), r"config_changes must be a list"),
    (_write("eval.json", '{"results": 5}'), r"evaluation .*eval.json: results must be a non-empty list"),
    (_write("eval.json", '{"results": [{"task": "parity"}], "meta": {"seed": 1}}'), r"results must be"),
    (_write("eval.json", '{"results": [{"task": "parity", "mode": "std", "n_distractors": 8, "n_samples": 2, '
                         '"accuracy": 1.0}], "meta": []}'), r"meta must hold the eval seed"),
])
def test_bad_inputs_are_one_line_and_leave_the_card(run, capsys, damage, match):
    damage(run)
    _expect_error(run, capsys, match)


def test_a_resumed_runs_recipe_changes_are_listed_per_segment(run):
    """A run resumed with another lr, seed and steps: the card printed only the last segment's lr."""
    log = _log(run)
    first = {**log["config"], "lr": 0.002, "seed": 0, "steps": 400}
    second = {**log["config"], "lr": 0.01, "seed": 0, "steps": 400}
    log["config_changes"] = [{"step": 300, "previous": first}, {"step": 400, "previous": second}]
    log["config"] = {**log["config"], "lr": 0.01, "seed": 5}
    (run / "train_log.json").write_text(json.dumps(log))
    card = write_card(run, "cmd")
    assert "- resumed at step 300 under a changed recipe: lr 0.002 -> 0.01\n" in card
    assert f"- resumed at step 400 under a changed recipe: steps 400 -> {log['config']['steps']}, seed 0 -> 5\n" in card
    assert "seed 5 (the last segment's; changes below)" in card


def test_the_card_is_written_atomically(run, monkeypatch):
    """A write that fails midway leaves the earlier card whole (plain write_text truncated it first)."""
    import common.io

    before = (run / "MODEL_CARD.md").read_bytes()

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(common.io.os, "replace", fail)
    with pytest.raises(OSError):
        write_card(run, "cmd")
    assert (run / "MODEL_CARD.md").read_bytes() == before
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]
