"""Where a run ran, as train_log.json and the model card say it: "1 thread", not "1 threads"."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from training.card import write_card
from training.loop import where_it_ran


def test_where_it_ran_says_singular_and_plural():
    assert where_it_ran(1, "cpu", 1) == "1 process on cpu, 1 thread each"
    assert where_it_ran(2, "cpu", 4) == "2 processes on cpu, 4 threads each"
    assert where_it_ran(1, "cuda", 8) == "1 process on cuda"


def test_the_card_says_one_thread_for_a_log_that_said_1_threads(tmp_path):
    shipped = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-std"
    if not (shipped / "model.safetensors").is_file():
        pytest.skip("no shipped tiny-std checkpoint")
    run = shutil.copytree(shipped, tmp_path / "m")
    log = json.loads((run / "train_log.json").read_text())
    for device, shown in (("1 process on cpu, 1 threads each", "(1 process on cpu, 1 thread each)"),
                          ("1 process on cpu, 11 threads each", "(1 process on cpu, 11 threads each)")):
        (run / "train_log.json").write_text(json.dumps({**log, "device": device}))
        assert shown in write_card(run, "cmd")
