"""One torchrun launch of a benchmark script's own workers (benchmarks/collect_processes.py, train_ddp.py): the
script runs itself with `--worker RESULT.json` on n processes, rank 0 writes its figures there."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.errors import UserError  # noqa: E402


def launch(script: str, n: int, args: list[str], threads: int, timeout: int) -> dict:
    """Run `script --worker OUT *args` on n processes (torchrun --standalone), `threads` torch threads each;
    returns the JSON rank 0 wrote to OUT. A failed launch exits with its stderr's tail."""
    torchrun = Path(sys.executable).with_name("torchrun")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        cmd = [str(torchrun), "--standalone", f"--nproc_per_node={n}", script, "--worker", str(out), *args]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
        # on a timeout the workers are stopped with torchrun (killing torchrun alone left them running)
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(p.pid)
            p.communicate()
            raise UserError(f"the {n}-process launch ran past --timeout {timeout} s: stopped, workers and all")
        if p.returncode != 0:
            sys.exit(f"error: the {n}-process launch failed:\n{err[-3000:]}")
        return json.loads(out.read_text())


def _kill_tree(root: int) -> None:
    """SIGKILL `root` and every process below it, found before any is killed: torchrun starts its workers in
    sessions of their own, so killing its process group left them running (and holding the output pipes)."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:  # after the command in parentheses: state, ppid
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, grew = {root}, True
    while grew:
        below = {pid for pid, pp in parent.items() if pp in tree} - tree
        grew = bool(below)
        tree |= below
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
