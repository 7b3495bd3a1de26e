"""Sharded collection benchmark: activation-collection throughput on 1 process against 2 (probes.collect under
torchrun: the batches dealt out to the processes, rank 0 gathers), as `torchrun -m probes.run` collects.

The same dataset (completion prompts of --distractors lines, --n-pairs pairs) and modes for every process count;
each count runs in its own torchrun launch with --threads torch threads per process (2 processes use twice the
cores of 1). Each launch collects --repeats times after one untimed warm-up; a repeat is timed on rank 0 from a
barrier to the gathered result. Headline = speedup = (1-process median) / (2-process median), and the scaling
efficiency = speedup / 2. On a CPU shared with other jobs the figures are noise: measure on an idle machine.

Human-readable lines first; the LAST line of stdout is one JSON object with all the figures.

    python benchmarks/collect_processes.py                   # tiny-fbt, standard + recurrent-1
    python benchmarks/collect_processes.py --modes recurrent-full --n-pairs 64
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere without an install

from common.cli import DefaultsFormatter, Parser, add_model_flag, add_threads_flag, int_in, set_threads  # noqa: E402
from common.errors import cli_entry  # noqa: E402

PROCS = (1, 2)


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(prog="python benchmarks/collect_processes.py", description=__doc__.split("\n\n")[0],
               formatter_class=DefaultsFormatter)
    add_model_flag(p, "tiny-fbt")
    p.add_argument("--modes", default="standard,recurrent-1", help="modes collected")
    p.add_argument("--n-pairs", type=int_in(5, 5000), default=96,
                   help="pairs of the completion dataset, 5..5000 (probes.run's range)")
    p.add_argument("--distractors", type=int_in(0, 256), default=32,
                   help="distractor lines per prompt, 0..256 (probes.run's range)")
    p.add_argument("--batch-size", type=int_in(1, 4096), default=32, help="rows per nnsight trace, 1..4096")
    add_threads_flag(p, 1, "; per process")
    p.add_argument("--repeats", type=int_in(1, 10_000), default=5,
                   help="timed collections per launch, 1..10000; medians over these")
    p.add_argument("--timeout", type=int_in(1, 86_400), default=1800,
                   help="seconds allowed per launch (a hang guard), 1..86400")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: this process is one of a launch's workers
    return p.parse_args(argv)


def worker(a) -> None:
    import torch

    from common.distributed import Processes
    from probes.collect import Collector
    from tasks import make_dataset, tokenize_samples
    from models.loading import load_model

    set_threads(a.threads)
    procs = Processes.start()
    try:
        model, tok, _ = load_model(a.model)
        ids, _ = tokenize_samples(make_dataset("completion", a.n_pairs, a.distractors, seed=0), tok)
        col = Collector(model, batch_size=a.batch_size, pad_id=tok.pad_token_id or 0, progress=False)
        modes = a.modes.split(",")
        times = []
        for i in range(a.repeats + 1):
            procs.barrier()
            t = time.perf_counter()
            out = col.collect(ids, modes, procs=procs)
            procs.barrier()
            if i:
                times.append(time.perf_counter() - t)
        if procs.is_main:
            assert all(v.shape[0] == len(ids) for v in out.values())
            tokens = sum(len(r) for r in ids)
            Path(a.worker).write_text(json.dumps({"times": times, "samples": len(ids), "tokens": tokens}))
    finally:
        procs.end()


def launch(a, n: int) -> dict:
    from benchmarks.torchrun_launch import launch as run_workers

    return run_workers(__file__, n, ["--model", a.model, "--modes", a.modes, "--n-pairs", str(a.n_pairs),
                                     "--distractors", str(a.distractors), "--batch-size", str(a.batch_size),
                                     "--threads", str(a.threads), "--repeats", str(a.repeats)],
                       a.threads, a.timeout)


@cli_entry
def main(argv=None) -> None:
    a = parse_args(argv)
    if a.worker:
        return worker(a)
    a.threads = a.threads or set_threads(0)  # 0: torch's own default, resolved here for the launched workers
    from engine.modes import canonical_modes
    from models.loading import model_dir

    canonical_modes([m.strip() for m in a.modes.split(",")])  # here, in one line: not in every worker's traceback
    model_dir(a.model)
    res = {n: launch(a, n) for n in PROCS}
    med = {n: statistics.median(r["times"]) for n, r in res.items()}
    tok = res[1]["tokens"]
    for n in PROCS:
        print(f"{n} process(es) x {a.threads} thread(s): median {med[n]:.3f} s per collection "
              f"({tok / med[n]:.0f} tokens/s; {res[n]['samples']} samples, modes {a.modes})")
    speedup = med[1] / med[2]
    print(f"speedup 2 vs 1 processes: {speedup:.2f}x (efficiency {speedup / 2:.2f})")
    print(json.dumps({"benchmark": "collect_processes", "model": a.model, "modes": a.modes,
                      "samples": res[1]["samples"], "tokens": tok, "threads_per_process": a.threads,
                      "median_s": {str(n): med[n] for n in PROCS}, "speedup_2_vs_1": speedup,
                      "efficiency": speedup / 2}))


if __name__ == "__main__":
    main()
