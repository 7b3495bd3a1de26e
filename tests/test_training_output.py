"""What a run may do to its output folder (training.output): a killed run's complete pending checkpoint counts as
an earlier run, and a killed --overwrite run's staging folder with checkpoints is never removed without a word."""
from __future__ import annotations

import re

import pytest

import training.cli as tcli
from common.errors import UserError
from training.checkpoint import PENDING, STATE_FILE
from training.output import RunOutput, check_output

FAST = ["--preset", "smoke", "--threads", "1", "--no-progress"]


def _expect_error(argv, capsys, match):
    with pytest.raises(SystemExit) as e:
        tcli.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert re.search(match, err), err


def _state(folder):
    """A folder holding a trainer state (only its presence is judged before a run loads anything)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / STATE_FILE).write_bytes(b"state")
    return folder


def test_a_complete_pending_checkpoint_is_an_earlier_run(tmp_path, capsys):
    out = tmp_path / "run"
    _state(out / PENDING)  # a kill cut the move of its newest checkpoint short: --resume moves it in
    with pytest.raises(UserError, match="already holds a checkpoint; use --resume"):
        check_output(out, resume=False, overwrite=False)
    _expect_error(FAST + ["--out", str(out)], capsys, "already holds a checkpoint")
    assert (out / PENDING / STATE_FILE).read_bytes() == b"state"
    assert check_output(out, resume=False, overwrite=True) is True  # --overwrite replaces it, staged
    check_output(out, resume=True, overwrite=False)  # and --resume takes it


def test_an_incomplete_pending_checkpoint_is_no_run(tmp_path):
    (tmp_path / "run" / PENDING).mkdir(parents=True)  # a save cut short: nothing to continue, removed by the run
    assert check_output(tmp_path / "run", resume=False, overwrite=False) is False


@pytest.mark.parametrize("flags", [["--resume"], []])
def test_a_killed_overwrite_runs_progress_is_refused_not_removed(tmp_path, capsys, flags):
    out = _state(tmp_path / "run")  # the earlier run
    staging = _state(tmp_path / ".run.staging-k1ll3d")  # the --overwrite run killed after a checkpoint
    _expect_error(FAST + ["--out", str(out), *flags], capsys,
                  re.escape(str(staging)) + r" holds the checkpoints of a killed --overwrite run.*move it into "
                  r"place.*--overwrite")
    assert (staging / STATE_FILE).read_bytes() == b"state"
    assert check_output(out, resume=False, overwrite=True)  # --overwrite discards it (its --help says so)


def test_a_fresh_run_keeps_a_staging_folder_with_progress(tmp_path):
    """Only --overwrite discards a staging folder's checkpoints; one without any (a kill before the first save)
    is a killed run's litter, removed."""
    out = tmp_path / "run"
    progress = _state(tmp_path / ".run.staging-a" / PENDING).parent  # killed mid-move: complete pending only
    litter = tmp_path / ".run.staging-b"
    litter.mkdir()
    with RunOutput(out, staged=False):
        pass
    assert progress.is_dir() and not litter.exists()
    # --overwrite into a missing --out (not staged: nothing to replace) discards it as its --help says
    with RunOutput(out, staged=False, overwrite=True):
        pass
    assert not progress.exists()


def test_overwrite_help_says_an_interrupted_overwrite_run_cannot_be_resumed():
    text = " ".join(tcli.build_parser().format_help().split())
    assert "an interrupted --overwrite run cannot be resumed" in text
