"""Benchmark: the exact state-swap sweep over every fed position vs attribution patching of every site, one batch.

    python benchmarks/attribution.py [--model tiny-fbt-track] [--task parity] [--mode recurrent-full]
                                     [--n-pairs 50] [--distractors 64] [--repeats 2] [--threads 2]

Timed side by side, `--repeats` pairs on the same CausalContext, in a fixed order (exact, then attribution):
  exact        the paired sample's fed state swapped at every fused position t, each run recomputing t..T-1
               (interventions.suite.Suite.position_sweep with no position cap: T - 1 patched runs)
  attribution  engine.attribution.site_gradients: one forward and one backward giving the gradient at the fed state
               of every position and the residual stream at every (depth, position) (interventions.attribution)
Headline: exact / attribution, the median of the per-repeat ratios. How far the estimate is from the exact
effects is in the causal report (interventions.run --attribution), not here. The last line of stdout is one JSON
object.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.cli import Parser, add_model_flag, add_task_flags, add_threads_flag, int_in, set_threads  # noqa: E402
from common.errors import cli_entry  # noqa: E402
from tasks import ALL_TASKS  # noqa: E402


@cli_entry
def main(argv=None) -> int:
    p = Parser(prog="python benchmarks/attribution.py", description=__doc__.splitlines()[0])
    add_model_flag(p, "tiny-fbt-track")
    add_task_flags(p, ALL_TASKS, "parity", custom=False)
    p.add_argument("--mode", default="recurrent-full", help="a recurrent-K mode or standard (default recurrent-full)")
    p.add_argument("--n-pairs", type=int_in(10, 5000), default=50, help="sample pairs, 10..5000 (default 50)")
    p.add_argument("--distractors", type=int_in(0, 1024), default=64,
                   help="distractor lines per prompt, 0..1024 (default 64)")
    p.add_argument("--repeats", type=int_in(1, 100), default=2,
                   help="timed (exact, attribution) pairs, 1..100 (default 2)")
    add_threads_flag(p, 2)
    args = p.parse_args(argv)

    args.threads = set_threads(args.threads)
    from interventions.core import Batch, CausalContext
    from interventions.run import _load
    from interventions.suite import Suite
    from tasks import make_dataset

    model, tok, _ = _load(args.model)
    batch = Batch.from_samples(make_dataset(args.task, args.n_pairs, args.distractors, 0), tok, args.task)
    ctx = CausalContext(model, batch, modes=("standard", args.mode), check_engine=False)
    suite = Suite(ctx, n_boot=10, max_positions=None)
    n_pos = len(suite.sweep_positions())
    exact, attr = [], []
    for r in range(args.repeats):
        t = time.perf_counter()
        suite.position_sweep()
        exact.append(time.perf_counter() - t)
        t = time.perf_counter()
        suite.attribution()
        attr.append(time.perf_counter() - t)
        print(f"repeat {r}: exact sweep {exact[-1]:.1f} s ({n_pos} positions), attribution {attr[-1]:.1f} s",
              file=sys.stderr)
    ratios = [e / a for e, a in zip(exact, attr)]
    out = {"benchmark": "attribution", "model": args.model, "task": args.task, "mode": ctx.mode,
           "n_rows": batch.size, "T": int(batch.input_ids.shape[1]), "positions": n_pos, "threads": args.threads,
           "exact_s": exact, "attribution_s": attr, "exact_over_attribution": statistics.median(ratios)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
