"""One torchrun launch of a benchmark script's own workers (benchmarks/collect_processes.py, train_ddp.py): the
script runs itself with `--worker RESULT.json` on n processes, rank 0 writes its figures there."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def launch(script: str, n: int, args: list[str], threads: int, timeout: int) -> dict:
    """Run `script --worker OUT *args` on n processes (torchrun --standalone), `threads` torch threads each;
    returns the JSON rank 0 wrote to OUT. A failed launch exits with its stderr's tail."""
    torchrun = Path(sys.executable).with_name("torchrun")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        cmd = [str(torchrun), "--standalone", f"--nproc_per_node={n}", script, "--worker", str(out), *args]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            sys.exit(f"error: the {n}-process launch failed:\n{r.stderr[-3000:]}")
        return json.loads(out.read_text())
