"""Benchmark: wall time of the whole default causal report, and each intervention's cost relative to one plain
(standard, untraced) forward of the same batch.

    python benchmarks/interventions.py [--model tiny-fbt] [--task completion] [--n-pairs 200] [--distractors 8]

Runs `interventions.run` into a temporary directory (nothing under figures/ is touched), reads the per-stage
timings the suite records, and times a plain forward on the identical batch (median of 5). The last line of
stdout is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-fbt")
    p.add_argument("--task", default="completion")
    p.add_argument("--n-pairs", default="200")
    p.add_argument("--distractors", default="8")
    p.add_argument("--control-model", default=None)
    args = p.parse_args(argv)

    import torch

    from interventions.core import Batch
    from interventions.run import _load, main as run_main
    from tasks import make_dataset

    with tempfile.TemporaryDirectory() as tmp:
        cli = ["--model", args.model, "--task", args.task, "--n-pairs", args.n_pairs, "--distractors",
               args.distractors, "--out", tmp, "--no-progress"]
        if args.control_model:
            cli += ["--control-model", args.control_model]
        t = time.perf_counter()
        rc = run_main(cli)
        wall = time.perf_counter() - t
        report = json.loads((Path(tmp) / "causal_report.json").read_text())
    if rc:
        return rc
    model, tok, _ = _load(args.model, "the")
    batch = Batch.from_samples(make_dataset(args.task, int(args.n_pairs), int(args.distractors), 0), tok, args.task)
    times = []
    with torch.no_grad():
        model(batch.input_ids, batch.attention_mask)  # warm-up
        for _ in range(5):
            t = time.perf_counter()
            model(batch.input_ids, batch.attention_mask)
            times.append(time.perf_counter() - t)
    fwd = statistics.median(times)
    stages = report["results"]["timings_s"]
    per = {k: v for k, v in stages.items() if not k.endswith(("dose", "layer_patching/standard",
                                                                "layer_patching/recurrent-1"))}
    rel = {k: v / fwd for k, v in per.items()}
    for k, v in sorted(rel.items(), key=lambda kv: -kv[1]):
        print(f"{k:40s} {per[k]:8.3f} s  {v:8.1f} x plain forward")
    print(f"whole default report: {wall:.1f} s; plain forward {1e3 * fwd:.1f} ms on "
          f"{tuple(batch.input_ids.shape)}")
    print(json.dumps({"benchmark": "interventions", "model": args.model, "task": args.task,
                      "batch": list(batch.input_ids.shape), "report_wall_s": round(wall, 3),
                      "plain_forward_s": round(fwd, 5),
                      "cost_vs_plain_forward": {k: round(v, 2) for k, v in rel.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
