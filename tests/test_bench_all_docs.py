"""scripts/bench_all.sh runs the commands docs/benchmarks.md quotes with its figures: a summary row's command is
the one bench_all runs for that script (flags and environment included), every script of the summary is run,
and a script with several rows (prefill) or none (cold_step) runs a command the page quotes."""
from __future__ import annotations

import os
import re
import subprocess
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "benchmarks.md").read_text()
CMD = re.compile(r"^(?:(?:[A-Z_]+=\S+) )*python benchmarks/(\w+)\.py(?: .*)?$")


def _bench_all() -> dict[str, str]:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "bench_all.sh"), "--list"], capture_output=True, text=True,
                         check=True).stdout
    cmds = {}
    for line in out.splitlines():
        m = CMD.match(line)
        assert m, line
        assert m.group(1) not in cmds, line
        cmds[m.group(1)] = line
    return cmds


def _summary() -> dict[str, set[str]]:
    table = PAGE.split("## Summary", 1)[1].split("\n## ", 1)[0]
    rows = defaultdict(set)
    for line in table.splitlines():
        cells = line.split(" | ")
        if len(cells) > 1:
            m = re.match(r"`([^`]+)`", cells[1].strip())
            if m and CMD.match(m.group(1)):
                rows[CMD.match(m.group(1)).group(1)].add(m.group(1))
    return rows


def test_every_script_runs_once_and_exists():
    cmds = _bench_all()
    assert set(cmds) == {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - {"torchrun_launch"}


def test_summary_rows_name_the_commands_bench_all_runs():
    cmds, rows = _bench_all(), _summary()
    assert len(rows) >= 12
    for script, documented in rows.items():
        assert script in cmds, script
        if len(documented) == 1:
            assert cmds[script] == next(iter(documented)), (script, documented)
    for script, cmd in cmds.items():
        if len(rows.get(script, ())) != 1:
            assert f"`{cmd}`" in PAGE, cmd


def test_a_bad_option_is_refused():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "bench_all.sh"), "--nope"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "error:" in r.stderr


def test_an_existing_log_folder_is_refused_before_anything_runs(tmp_path):
    (tmp_path / "run1").mkdir()
    (tmp_path / "run1" / "bench_collect.log").write_text("an earlier run's log\n")
    env = {**os.environ, "OUT": str(tmp_path), "STAMP": "run1"}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "bench_all.sh")], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "exists" in r.stderr and r.stdout == ""
    assert (tmp_path / "run1" / "bench_collect.log").read_text() == "an earlier run's log\n"


def test_the_default_log_folder_is_git_ignored():
    assert "/bench_logs/" in (ROOT / ".gitignore").read_text().splitlines()


def test_a_benchmark_past_its_limit_is_killed_if_sigterm_does_not_end_it(tmp_path):
    """Every CLI turns SIGTERM into an exception (common.errors.cli_entry), which a process blocked in C (a gloo
    collective or rendezvous: the hangs a limit is for) only raises once the call returns: `timeout` must follow its
    SIGTERM with a SIGKILL. A stand-in `timeout` records how each benchmark is started."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "timeout").write_text('#!/bin/bash\necho "$*" >> "$SHIM_LOG"\nexit 0\n')
    (shim / "timeout").chmod(0o755)
    log = tmp_path / "calls.txt"
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}", "SHIM_LOG": str(log), "OUT": str(tmp_path / "o"),
           "STAMP": "run"}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "bench_all.sh")], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines()
    assert len(calls) == len(_bench_all()) and all(re.match(r"-k \d+ \d+ env ", c) for c in calls), calls
