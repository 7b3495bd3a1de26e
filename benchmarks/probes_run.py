"""The default probes command, end to end, against an earlier commit's: `python -m probes.run --task completion
--no-cache` (each run into a fresh temporary --out), run as whole processes, baseline and current in turn
(B A B A ...: the baseline first in every pair, the order fixed), so a machine whose speed drifts (other jobs)
slows both alike.

    python benchmarks/probes_run.py                          # baseline: commit 7e5b62d in a temporary worktree
    python benchmarks/probes_run.py --baseline-dir /tmp/old  # an existing checkout of the baseline
    python benchmarks/probes_run.py --repeats 7 -- --task memory   # other probes.run arguments after --

Both run with this interpreter (the same packages); the baseline from its own checkout's code and shipped
checkpoints. Per run: wall seconds and CPU seconds (user + system of the child, its own accounting). Reported:
each side's median (min..max), the ratio of the medians and the median of the per-pair ratios (goal <= 1.15 on
wall time; commit 7e5b62d is the last one before the logit lens and the online code landed). One warm-up pair
is run and not counted. Human-readable lines first; the LAST line of stdout is one JSON object.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere without an install

from common.cli import Parser, int_in  # noqa: E402
from common.errors import UserError, cli_entry  # noqa: E402

BASELINE = "7e5b62d"
GOAL = 1.15
DEFAULT_ARGS = ["--task", "completion"]


def parse_args(argv=None):
    p = Parser(prog="python benchmarks/probes_run.py", description=__doc__)
    p.add_argument("--baseline-commit", default=BASELINE,
                   help=f"commit checked out into a temporary git worktree (default {BASELINE})")
    p.add_argument("--baseline-dir", default=None, help="an existing checkout of the baseline instead")
    p.add_argument("--repeats", type=int_in(1, 1000), default=5, help="counted pairs, 1..1000 (default 5)")
    p.add_argument("--warmup", type=int_in(0, 1000), default=1,
                   help="pairs run first and not counted, 0..1000 (default 1)")
    p.add_argument("probes_args", nargs="*", help=f"probes.run arguments after -- (default {' '.join(DEFAULT_ARGS)})")
    return p.parse_args(argv)


def run_once(checkout: Path, args: list[str]) -> dict:
    """One whole `python -m probes.run ARGS --no-cache --no-progress --out <fresh dir>` in `checkout`."""
    out = Path(tempfile.mkdtemp(prefix="probes_run_bench."))
    log = out.with_suffix(".log")
    cmd = [sys.executable, "-m", "probes.run", *args, "--no-cache", "--no-progress", "--out", str(out / "o")]
    try:
        with open(log, "wb") as f:
            t = time.perf_counter()
            proc = subprocess.Popen(cmd, cwd=checkout, stdout=f, stderr=subprocess.STDOUT)
            _, status, ru = os.wait4(proc.pid, 0)
            wall = time.perf_counter() - t
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            raise SystemExit(f"{' '.join(cmd[1:])} in {checkout} exited {code}: "
                             f"{log.read_text(errors='replace').strip()[-400:]}")
        return {"wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime}
    finally:
        shutil.rmtree(out, ignore_errors=True)
        log.unlink(missing_ok=True)


def _summary(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


@cli_entry
def main(argv=None):
    a = parse_args(argv)
    args = a.probes_args or DEFAULT_ARGS
    worktree = None
    if a.baseline_dir is not None:
        if not str(a.baseline_dir).strip() or not Path(a.baseline_dir).is_dir():
            raise UserError(f"--baseline-dir {a.baseline_dir!r} is not a folder (give a checkout of the baseline)")
        base = Path(a.baseline_dir).resolve()
        if not (base / "probes" / "run.py").is_file():
            raise UserError(f"--baseline-dir {base} holds no probes/run.py: not a checkout of this project")
        label = str(base)
    else:
        known = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet",
                                f"{a.baseline_commit}^{{commit}}"], capture_output=True)
        if known.returncode != 0:  # before the worktree folder exists: nothing left behind
            raise UserError(f"--baseline-commit {a.baseline_commit!r} names no commit of this repository")
        worktree = Path(tempfile.mkdtemp(prefix="probes_run_baseline."))
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), a.baseline_commit],
                       check=True, capture_output=True)
        base, label = worktree, a.baseline_commit
    try:
        print(f"probes.run {' '.join(args)} --no-cache: baseline {label} vs current {ROOT}; "
              f"{a.warmup} warm-up pair(s), {a.repeats} counted, load average {os.getloadavg()[0]:.2f}")
        runs = {"baseline": [], "current": []}
        for i in range(a.warmup + a.repeats):
            pair = {side: run_once(base if side == "baseline" else ROOT, args) for side in ("baseline", "current")}
            tag = "warm-up" if i < a.warmup else f"pair {i - a.warmup + 1}"
            print(f"  {tag}: baseline {pair['baseline']['wall_s']:.1f} s wall / {pair['baseline']['cpu_s']:.1f} s "
                  f"cpu, current {pair['current']['wall_s']:.1f} s / {pair['current']['cpu_s']:.1f} s, ratio "
                  f"{pair['current']['wall_s'] / pair['baseline']['wall_s']:.3f}", flush=True)
            if i >= a.warmup:
                for side in runs:
                    runs[side].append(pair[side])
    finally:
        if worktree is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)],
                           capture_output=True)
            shutil.rmtree(worktree, ignore_errors=True)
    result = {"command": "python -m probes.run " + " ".join(args) + " --no-cache", "baseline": label,
              "repeats": a.repeats, "load_avg_1min_end": os.getloadavg()[0], "goal_max": GOAL}
    for clock in ("wall_s", "cpu_s"):
        b = [r[clock] for r in runs["baseline"]]
        c = [r[clock] for r in runs["current"]]
        pairs = [y / x for x, y in zip(b, c)]
        result[clock] = {"baseline": _summary(b), "current": _summary(c),
                         "ratio_of_medians": statistics.median(c) / statistics.median(b),
                         "pair_ratios": _summary(pairs)}
        r = result[clock]
        print(f"{clock[:-2]}: baseline {r['baseline']['median']:.1f} s ({r['baseline']['min']:.1f}..."
              f"{r['baseline']['max']:.1f}), current {r['current']['median']:.1f} s ({r['current']['min']:.1f}..."
              f"{r['current']['max']:.1f}); ratio of medians {r['ratio_of_medians']:.3f}, per-pair ratios "
              f"{r['pair_ratios']['median']:.3f} ({r['pair_ratios']['min']:.3f}...{r['pair_ratios']['max']:.3f})")
    result["ratio"] = result["wall_s"]["ratio_of_medians"]
    result["pass"] = result["ratio"] <= GOAL
    print(f"current / baseline = {result['ratio']:.3f} (goal <= {GOAL}) {'PASS' if result['pass'] else 'FAIL'}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
