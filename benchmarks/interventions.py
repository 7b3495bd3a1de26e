"""Benchmark: wall time of the whole default causal report, and each intervention's cost relative to one plain
(standard, untraced) forward of the same batch.

    python benchmarks/interventions.py [--model tiny-fbt] [--task completion] [--n-pairs 200] [--distractors 8]
                                      [--mode recurrent-full] [--max-positions 64] [--budget full]

Runs `interventions.run` into a temporary directory (nothing under figures/ is touched), reads the per-stage
timings the suite records, and times a plain forward and one clean recurrent-full prefill (the engine's,
engine.prefill.prefill) on the identical batch (median of 5). `sweep_per_position_vs_recurrent_full` = the
position sweep's time per patched position / one recurrent-full run: the budget is about 1 (a patch at t
reruns T - t cached steps from the shared clean prefix, about half a run on average).
`standard_patch_full_vs_suffix`: a residual patch under standard prefill at each of the last 8 positions (and
all depths), timed two ways side by side, interleaved: a whole patched forward (the routine before the cached
suffix) / the suffix from the clean cache (engine.patching.StandardPatcher). The last line of stdout is one JSON
object.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.cli import Parser, add_model_flag, add_task_flags, int_in  # noqa: E402
from common.errors import cli_entry  # noqa: E402
from interventions.run import MAX_DISTRACTORS, MAX_POSITIONS, N_PAIRS_RANGE  # noqa: E402
from tasks import ALL_TASKS  # noqa: E402


@cli_entry
def main(argv=None) -> int:
    p = Parser(prog="python benchmarks/interventions.py", description=__doc__.splitlines()[0])
    add_model_flag(p, "tiny-fbt")
    add_task_flags(p, ALL_TASKS, "completion", custom=False)
    p.add_argument("--n-pairs", type=int_in(*N_PAIRS_RANGE), default=200,
                   help=f"sample pairs (2 samples each), {N_PAIRS_RANGE[0]}..{N_PAIRS_RANGE[1]} (default 200)")
    p.add_argument("--distractors", type=int_in(0, MAX_DISTRACTORS), default=8,
                   help=f"distractor lines per prompt, 0..{MAX_DISTRACTORS} (default 8)")
    p.add_argument("--control-model", default=None,
                   help="interventions.run's negative-control model (default: its own, tiny-std when its checkpoint "
                        "exists; 'none' to skip)")
    p.add_argument("--mode", default="recurrent-full",
                   help="the prefill mode intervened on, as interventions.run's --mode (default recurrent-full)")
    p.add_argument("--max-positions", type=int_in(0, MAX_POSITIONS), default=64,
                   help=f"position sweep and layer-patching heatmap over the last P positions, 0..{MAX_POSITIONS} "
                        "(0 = all; default 64)")
    p.add_argument("--budget", default="full", choices=("quick", "full"),
                   help="interventions.run's --budget: quick or full (default full)")
    args = p.parse_args(argv)

    import torch

    from interventions.core import Batch
    from interventions.run import _load, main as run_main
    from tasks import make_dataset

    with tempfile.TemporaryDirectory() as tmp:
        cli = ["--model", args.model, "--task", args.task, "--n-pairs", str(args.n_pairs), "--distractors",
               str(args.distractors), "--out", tmp, "--no-progress", "--mode", args.mode, "--max-positions",
               str(args.max_positions), "--budget", args.budget]
        if args.control_model is not None:  # '' goes on to interventions.run, which refuses it
            cli += ["--control-model", args.control_model]
        t = time.perf_counter()
        rc = run_main(cli)
        wall = time.perf_counter() - t
        report = json.loads((Path(tmp) / "causal_report.json").read_text())
    if rc:
        return rc
    model, tok, _ = _load(args.model)
    batch = Batch.from_samples(make_dataset(args.task, int(args.n_pairs), int(args.distractors), 0), tok, args.task)
    times = []
    with torch.no_grad():
        model(batch.input_ids, batch.attention_mask)  # warm-up
        for _ in range(5):
            t = time.perf_counter()
            model(batch.input_ids, batch.attention_mask)
            times.append(time.perf_counter() - t)
    fwd = statistics.median(times)
    from engine.prefill import prefill

    rtimes = []
    for _ in range(5):
        t = time.perf_counter()
        prefill(model, batch.input_ids, batch.attention_mask, "recurrent-full", collect=False)
        rtimes.append(time.perf_counter() - t)
    rfull = statistics.median(rtimes)
    # standard-prefill residual patches: a whole patched forward vs the cached suffix, interleaved
    from engine.patching import Patch, _hooks
    from interventions.core import CausalContext

    ctx = CausalContext(model, batch, modes=("standard",), check_engine=False)
    r = ctx.runners["standard"]
    T = batch.input_ids.shape[1]
    full_t, suffix_t = [], []
    with torch.no_grad():
        for pos in range(-8, 0):
            for d in range(model.n_layers + 1):
                value = ctx.resid("standard")[:, T + pos, d][batch.pair]
                t = time.perf_counter()
                with _hooks(model, [Patch("resid", value, d, pos)], r.col):
                    model(batch.input_ids, batch.attention_mask)
                full_t.append(time.perf_counter() - t)
                t = time.perf_counter()
                ctx.run("standard", [Patch("resid", value, d, pos)])
                suffix_t.append(time.perf_counter() - t)
    std_ratio = statistics.median(full_t) / statistics.median(suffix_t)
    print(f"standard residual patch, last 8 positions x {model.n_layers + 1} depths: whole forward "
          f"{1e3 * statistics.median(full_t):.2f} ms / cached suffix {1e3 * statistics.median(suffix_t):.2f} ms "
          f"= {std_ratio:.1f}x")
    stages = report["results"]["timings_s"]
    mode = report["config"]["mode"]
    per = {k: v for k, v in stages.items() if not k.endswith(("dose", "layer_patching/standard",
                                                                f"layer_patching/{mode}", "position_sweep"))}
    rel = {k: v / fwd for k, v in per.items()}
    for k, v in sorted(rel.items(), key=lambda kv: -kv[1]):
        print(f"{k:40s} {per[k]:8.3f} s  {v:8.1f} x plain forward")
    sweep = stages.get("position_sweep/per_position")
    ratio = None if sweep is None else sweep / rfull
    n_sweep = len((report["results"].get("position_sweep") or {}).get("positions", []))
    print(f"whole report ({mode}): {wall:.1f} s; plain forward {1e3 * fwd:.1f} ms, recurrent-full prefill "
          f"{1e3 * rfull:.1f} ms on {tuple(batch.input_ids.shape)}")
    if ratio is not None:
        print(f"position sweep: {n_sweep} positions, {stages['position_sweep']:.2f} s, "
              f"{ratio:.2f} recurrent-full runs per patched position")
    print(json.dumps({"benchmark": "interventions", "model": args.model, "task": args.task,
                      "batch": list(batch.input_ids.shape), "report_wall_s": round(wall, 3),
                      "plain_forward_s": round(fwd, 5), "mode": mode,
                      "recurrent_full_prefill_s": round(rfull, 5), "sweep_positions": n_sweep,
                      "sweep_s": stages.get("position_sweep"),
                      "sweep_per_position_vs_recurrent_full": None if ratio is None else round(ratio, 3),
                      "budget": args.budget, "standard_patch_full_vs_suffix": round(std_ratio, 2),
                      "cost_vs_plain_forward": {k: round(v, 2) for k, v in rel.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
