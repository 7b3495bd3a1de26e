"""What a command is given is what it does (the CLI fuzz of 2026-12-07): a repeated key or task is refused, not
folded; an empty value is refused where it used to mean the default; a device or FIFO is never replaced by an
output nor read as an input; a card keeps its notes; a benchmark fails when its arms disagree."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("flags, words", [
    (["--distractors", "0:0.5,8:0.25,8:0.25"], "8 given more than once"),  # N = 8 kept 1/3, not 1/2
    (["--tasks", "parity,shell_game", "--variants", "uniform:0.5,hold:0.2,hold:0.3"], "hold given more than once"),
    (["--tasks", "completion,completion,memory"], "lists completion more than once"),  # completion got 6/7
    (["--base", ""], "--base is empty"),  # the preset's base, silently
])
def test_a_recipe_is_taken_as_written_or_refused(flags, words, tmp_path, capsys):
    from training.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny-fbt", "--out", str(tmp_path / "o"), *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and words in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_an_output_never_replaces_a_device_or_fifo_and_an_input_is_never_read_from_one(tmp_path):
    from common.cli import output_file

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match="not a regular file"):
        output_file(str(fifo), "--html")
    with pytest.raises(UserError, match="not a regular file"):
        output_file("/dev/null", "--out")
    # a FIFO waited forever, /dev/zero filled memory: read in a child with a timeout, so a regression fails here
    code = ("import sys; from common.jsonio import read_user_json\n"
            "try:\n    read_user_json(sys.argv[1], 'x')\nexcept Exception as e:\n    print(e)")
    for path in (fifo, "/dev/zero"):
        r = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, text=True,
                           timeout=60, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
        assert "is not a regular file" in r.stdout, (path, r.stdout, r.stderr[-500:])


def test_depth_curves_replaces_an_explicit_file_only_with_overwrite(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "tests"))
    from test_depth_curves import fake_doc

    from probes.depth_curves import main

    pj = tmp_path / "probes.json"
    pj.write_text(json.dumps(fake_doc()))
    other = tmp_path / "notes.txt"
    other.write_text("mine")
    with pytest.raises(SystemExit) as e:
        main([str(pj), "--html", str(other)])
    assert e.value.code == 2 and "--overwrite" in capsys.readouterr().err and other.read_text() == "mine"
    for flag in ("--html", "--png"):
        with pytest.raises(SystemExit):
            main([str(pj), flag, ""])  # '' was "the default": it replaced the page beside the JSON
        assert "is empty" in capsys.readouterr().err
    assert not (tmp_path / "depth_curves.html").exists()
    main([str(pj)])  # the default page beside the JSON: drawn, and redrawn, without the flag
    main([str(pj)])
    assert (tmp_path / "depth_curves.html").is_file()
    main([str(pj), "--html", str(other), "--overwrite"])
    assert other.read_text() != "mine"


def test_rewriting_a_card_keeps_its_notes(tmp_path):
    from models.checkpoints import checkpoint_dir
    from training.card import main

    ck = tmp_path / "tiny-fbt"
    shutil.copytree(checkpoint_dir("tiny-fbt"), ck)
    before = (ck / "MODEL_CARD.md").read_text()
    notes = before.split("\n## Notes\n", 1)[1].strip()
    assert len(notes.splitlines()) > 20
    main([str(ck), "--command", "python -m training.train --preset tiny-fbt"])
    after = (ck / "MODEL_CARD.md").read_text()
    assert after.split("\n## Notes\n", 1)[1].strip() == notes  # 65 lines of notes were dropped
    bad = tmp_path / "notes.md"
    bad.write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(SystemExit):
        main([str(ck), "--command", "x", "--notes", str(bad)])
    with pytest.raises(SystemExit):
        main([str(ck), "--command", " "])
    assert (ck / "MODEL_CARD.md").read_text() == after


def test_benchmark_goals_and_agreement_are_part_of_a_pass():
    """patching.py said "checked to agree" and passed whatever the difference; prefill.py's goals were fixed
    numbers (4.5 passed quadratic growth at 2x lengths) and its --naive-samples 1 summed one step."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import prefill

    with pytest.raises(UserError, match="--naive-samples: must be an integer in 2"):
        prefill.parse_args(["--naive-samples", "1"])
    assert prefill.GOAL_SCALING_FACTOR * 256 / 128 < 4.0  # quadratic growth at 2x no longer passes
    import patching

    assert patching.AGREE_TOL <= 1e-3


def test_scripts_refuse_what_they_cannot_read(tmp_path):
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    bad = tmp_path / "report.json"
    bad.write_text(json.dumps({"config": {}, "results": {}}))
    for cmd in ([sys.executable, "scripts/verdict_table.py", str(bad)],
                [sys.executable, "scripts/swap_persistence.py", "checkpoints/tiny-fbt-track", "memory", "4"],
                [sys.executable, "benchmarks/probes_run.py", "--baseline-commit", "deadbeef"],
                [sys.executable, "benchmarks/probes_run.py", "--baseline-dir", ""]):
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (cmd, r.stderr[-1500:])
        assert r.stderr.strip().startswith("error: ") and r.stdout == "", (cmd, r.stdout, r.stderr)
