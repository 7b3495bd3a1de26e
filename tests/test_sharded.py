"""probes.run under torchrun: 2 processes split the batches, rank 0 gathers and scores; the results are exactly
those of one process (the same batches through the same engine), and only rank 0 writes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--task", "completion", "--distractors", "0,8", "--n-pairs", "24", "--modes", "standard,recurrent-1",
        "--n-boot", "50", "--batch-size", "5", "--no-mdl", "--fed-lens", "--no-progress"]


def _run(cmd, tmp):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_two_processes_give_the_one_process_results(tiny_ckpt, tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not installed beside this Python")
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["--model", str(tiny_ckpt), *ARGS]
    _run([sys.executable, "-m", "probes.run", *common, "--out", str(one), "--cache-dir", str(tmp_path / "c1")],
         tmp_path)
    r = _run([str(torchrun), "--standalone", "--nproc_per_node=2", "-m", "probes.run", *common, "--out", str(two),
              "--cache-dir", str(tmp_path / "c2")], tmp_path)
    a = json.loads((one / "probes.json").read_text())
    b = json.loads((two / "probes.json").read_text())
    assert b["meta"]["processes"] == 2 and "processes" not in a["meta"]
    assert a["results"] == b["results"] and a["fed_state_lens"] == b["fed_state_lens"] and len(a["fed_state_lens"]) == 2
    assert a["meta"]["datasets"] == b["meta"]["datasets"] and a["meta"]["run"] == b["meta"]["run"]
    assert r.stdout.count("wrote ") == 1  # rank 0 alone writes (and reports)
    # the cache rank 0 wrote holds the same activations as the one-process run's, entry for entry
    import numpy as np

    c1, c2 = sorted((tmp_path / "c1").glob("*.npz")), sorted((tmp_path / "c2").glob("*.npz"))
    assert [p.name for p in c1] == [p.name for p in c2] and len(c1) == 4  # 2 N x 2 modes
    for p, q in zip(c1, c2):
        assert np.array_equal(np.load(p)["resid"], np.load(q)["resid"]), p.name


def test_each_process_runs_only_its_batches(tiny_model):
    """Rank r of 2 runs batches r, r+2, ... of the one-process batching, and hands exactly those rows over."""
    import numpy as np

    from common.distributed import Processes
    from probes.collect import Collector

    seqs = [[3 + (i * 7 + j) % 40 for j in range(2 + i % 5)] for i in range(11)]
    col = Collector(tiny_model, batch_size=2, progress=False)
    full = col.collect(seqs, ["standard"])["standard"]
    batches = col._batches([len(s) for s in seqs])
    handed = {}

    class Rank(Processes):  # world 2 without a process group: capture what would be gathered
        def gather_rows(self, local, rows, n):
            handed[self.rank] = (rows, local)
            return None

    for rank in (0, 1):
        assert Collector(tiny_model, batch_size=2, progress=False).collect(
            seqs, ["standard"], procs=Rank(2, rank, None)) is None
        rows, local = handed[rank]
        assert rows == [i for b in batches[rank::2] for i in b]
        assert np.array_equal(local["standard"], full[rows])
    assert sorted(handed[0][0] + handed[1][0]) == list(range(len(seqs)))


@pytest.mark.parametrize("cli", ["probes.run", "training"])
def test_a_refusal_at_rank_0s_lock_is_every_process_s_and_said_once(tiny_ckpt, tmp_path, cli):
    """Only rank 0 takes --out's lock: its refusal (another run holds it) left rank 1 waiting in the next
    collective until rank 0's exit broke it with a ~30-line gloo traceback. The refusal is now every process's,
    printed once by rank 0; what torchrun prints of its own after a failed worker is its business."""
    import fcntl

    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not installed beside this Python")
    out = tmp_path / "out"
    out.mkdir()
    args = (["-m", "probes.run", "--model", str(tiny_ckpt), *ARGS, "--cache-dir", str(tmp_path / "c")] if cli == "probes.run"
            else ["-m", "training", "--preset", "smoke", "--steps", "2", "--no-progress"])
    fd = os.open(out, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another run, writing there right now
    try:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        r = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node=2", *args, "--out", str(out)], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=600)
    finally:
        os.close(fd)
    assert r.returncode != 0
    assert r.stderr.count("error: another ") == 1, r.stderr[-3000:]
    assert "gloo" not in r.stderr and "Connection closed" not in r.stderr, r.stderr[-3000:]
    ours = [ln for ln in r.stderr.splitlines()  # a frame of this repository's code (not torchrun's own report)
            if ln.strip().startswith(f'File "{ROOT}/') and "/.venv/" not in ln]
    assert not ours, r.stderr[-3000:]
    assert list(out.iterdir()) == []
