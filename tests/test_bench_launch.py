"""benchmarks/torchrun_launch.py: a launch that runs past its timeout is stopped with every worker, in one line.
Killing torchrun alone left its workers (sessions of their own) running and holding the output pipes: the
benchmark then waited on them forever."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_kill_tree_reaches_processes_in_sessions_of_their_own(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from torchrun_launch import _kill_tree

    pids = tmp_path / "pids"
    p = subprocess.Popen(["bash", "-c", f"sleep 300 & echo $! >> {pids}; setsid sleep 300 & echo $! >> {pids}; wait"])
    for _ in range(100):
        if pids.exists() and len(pids.read_text().split()) == 2:
            break
        time.sleep(0.05)
    kids = [int(x) for x in pids.read_text().split()]
    assert all(_alive(k) for k in kids)
    _kill_tree(p.pid)
    p.wait(timeout=10)
    time.sleep(0.2)
    assert not any(_alive(k) for k in kids)


def test_a_launch_past_its_timeout_is_stopped_whole(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not installed beside this Python")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common.errors import UserError
    from torchrun_launch import launch

    script = tmp_path / "sleeper.py"
    marker = tmp_path / "pids"
    script.write_text(f"import os, time\nopen({str(marker)!r}, 'a').write(f'{{os.getpid()}}\\n')\ntime.sleep(600)\n")
    t0 = time.time()
    with pytest.raises(UserError, match="ran past --timeout 8 s"):
        launch(str(script), 2, [], 1, 8)
    assert time.time() - t0 < 60
    time.sleep(0.3)
    workers = [int(x) for x in marker.read_text().split()]
    assert len(workers) == 2 and not any(_alive(w) for w in workers)
