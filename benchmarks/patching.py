"""Benchmark: one residual patch through the suite's patcher vs plain PyTorch hooks doing the same patch.

    python benchmarks/patching.py [--model smollm2-135m] [--task completion] [--n-pairs 16] [--distractors 8]
                                  [--positions 12] [--repeats 3] [--threads 2]

The same patch (the paired sample's residual at (depth, t), every row) is timed two ways, interleaved, at
`--positions` columns spread evenly over the prompt (first to last) and 4 depths:
  hooks     the HF causal LM's own forward (`lm(input_ids, attention_mask)`, logits at every column, as a user of
            plain PyTorch writes it) with a forward hook on block d-1 replacing column t; logits at T read;
  hooks@T   the same with the head at T only (`logits_to_keep=1`): the same work as the patcher but its cache;
  patcher   `CausalContext.run("standard", [Patch("resid", ...)])` (engine.patching.StandardPatcher: the columns
            from t on the clean run's KV cache, the head at T only). It keeps nothing from one run to the next
            (an earlier version cached an unpatched suffix per column, which this loop's repeats at one column
            then reused: half of a sweep's real cost was timed).
The results are checked to agree (max |diff| of the logits at T). Headline: patcher / hooks, the median of the
per-pair ratios (goal <= 0.7); beside it patcher / hooks@T, what the cached prefix alone buys. The last line of
stdout is one JSON object.
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

GOAL = 0.7
AGREE_TOL = 1e-3  # logits at T (SmolLM2's run to 4.9e-5)


@cli_entry
def main(argv=None) -> int:
    p = Parser(prog="python benchmarks/patching.py", description=__doc__.splitlines()[0])
    add_model_flag(p, "smollm2-135m")
    add_task_flags(p, ALL_TASKS, "completion", custom=False)
    p.add_argument("--n-pairs", type=int_in(1, 5000), default=16, help="sample pairs, 1..5000 (default 16)")
    p.add_argument("--distractors", type=int_in(0, 1024), default=8,
                   help="distractor lines per prompt, 0..1024 (default 8)")
    p.add_argument("--positions", type=int_in(1, 100_000), default=12,
                   help="patched columns, spread over the prompt, 1..100000 (default 12)")
    p.add_argument("--repeats", type=int_in(1, 10_000), default=3,
                   help="timed pairs per (position, depth), 1..10000 (default 3)")
    add_threads_flag(p, 2)
    args = p.parse_args(argv)

    import torch

    args.threads = set_threads(args.threads)
    from engine.patching import Patch
    from interventions.core import Batch, CausalContext
    from interventions.run import _load
    from tasks import make_dataset

    model, tok, _ = _load(args.model)
    batch = Batch.from_samples(make_dataset(args.task, args.n_pairs, args.distractors, 0), tok, args.task)
    ids, mask = batch.input_ids, batch.attention_mask
    T, L = ids.shape[1], model.n_layers
    ctx = CausalContext(model, batch, modes=("standard",), check_engine=False)
    resid = ctx.resid("standard")
    layers = ctx.runners["standard"].layers
    cols = sorted({round(i * (T - 1) / max(1, args.positions - 1)) for i in range(args.positions)})
    depths = sorted({1, L // 3, 2 * L // 3, L})
    lm = model.lm

    def hooks_run(d, c, value, keep=0):
        def put(mod, a, out):
            h = (out[0] if isinstance(out, tuple) else out).clone()
            h[:, c] = value
            return (h,) + tuple(out[1:]) if isinstance(out, tuple) else h
        handle = layers[d - 1].register_forward_hook(put)
        try:
            return lm(input_ids=ids, attention_mask=mask, logits_to_keep=keep,
                      position_ids=(mask.long().cumsum(-1) - 1).clamp(min=0)).logits[:, -1]
        finally:
            handle.remove()

    ratios, ratios_at_T, t_hooks, t_hooks_T, t_patch, diff = [], [], [], [], [], 0.0
    with torch.no_grad():
        hooks_run(depths[0], cols[-1], resid[:, cols[-1], depths[0]])  # warm-up
        for c in cols:
            for d in depths:
                value = resid[:, c, d][batch.pair]
                patch = [Patch("resid", value, d, c - T)]
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    a = hooks_run(d, c, value)
                    t_hooks.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    a1 = hooks_run(d, c, value, keep=1)
                    t_hooks_T.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    b = ctx.run("standard", patch).logits
                    t_patch.append(time.perf_counter() - t)
                    ratios.append(t_patch[-1] / t_hooks[-1])
                    ratios_at_T.append(t_patch[-1] / t_hooks_T[-1])
                diff = max(diff, float((a.float() - b.float()).abs().max()), float((a1.float() - b.float()).abs().max()))
    ratio, ratio_at_T = statistics.median(ratios), statistics.median(ratios_at_T)
    ok = ratio <= GOAL and diff <= AGREE_TOL  # a fast patch that computes something else is no pass
    ratio_of_means = statistics.fmean(t_patch) / statistics.fmean(t_hooks)
    print(f"{args.model} {args.task}: batch {tuple(ids.shape)}, {len(cols)} columns x {len(depths)} depths x "
          f"{args.repeats} pairs; hooks {1e3 * statistics.median(t_hooks):.1f} ms, hooks@T "
          f"{1e3 * statistics.median(t_hooks_T):.1f} ms, patcher {1e3 * statistics.median(t_patch):.1f} ms (medians)")
    print(f"  patcher / hooks = {ratio:.3f} (median of per-pair ratios; ratio of mean times {ratio_of_means:.3f}); "
          f"goal <= {GOAL}, logits agreeing to {AGREE_TOL:g}: {'PASS' if ok else 'FAIL'}; max |logit diff| {diff:.2e}")
    print(f"  patcher / hooks@T (the same work but the cached prefix) = {ratio_at_T:.3f}")
    print(json.dumps({"benchmark": "patching", "model": args.model, "task": args.task, "batch": list(ids.shape),
                      "threads": args.threads, "columns": cols, "depths": depths, "repeats": args.repeats,
                      "hooks_median_s": statistics.median(t_hooks), "patcher_median_s": statistics.median(t_patch),
                      "hooks_at_T_median_s": statistics.median(t_hooks_T), "patcher_over_hooks_at_T": ratio_at_T,
                      "patcher_over_hooks": ratio, "ratio_of_means": ratio_of_means, "goal_max": GOAL,
                      "pass": ok, "agree_tol": AGREE_TOL, "max_abs_logit_diff": diff}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
