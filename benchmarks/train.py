"""Multi-pass training benchmark: what does a K-pass training step cost against K one-pass steps?

One training step = multi-pass loss (forward of K passes) + backward + gradient clipping + AdamW step, as
`training.train` runs it but for the recipe's extras: no warm no-grad passes and no fixed-point start (the
tiny-fbt preset takes them on about half its micro-batches), so the ratio measures the bare passes. K = 1, 2, 3 are timed side by side in one run on the same fixed batch (default: the
tiny-fbt preset's architecture, --rows x --length tokens of random ids, no padding, a random-length unfused
prefix per row as the prefix mixin gives, state noise on). After --warmup rounds, --repeats rounds each time
one step of every K, the order rotated round by round so a noisy machine hits every K alike.

Figures: median step time per K and tokens/s; for K = 2, 3 the ratio (K-pass time) / (K x one-pass time),
headline = median of the per-round ratios (robust to background load), the ratio of the medians printed too.
Goal <= 1.05 (the passes add no overhead beyond their own compute). Every figure is given on two clocks: wall time
(the headline) and this process's CPU time, which a CPU shared with other jobs disturbs far less (with
--threads 1 it is the step's own compute).

Human-readable lines first; the LAST line of stdout is one JSON object with all the figures.

    python benchmarks/train.py                  # defaults
    python benchmarks/train.py --threads 1 --repeats 5
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without an install

from common.cli import DefaultsFormatter, Parser, add_seed_flag, add_threads_flag, int_in, set_threads  # noqa: E402
from common.cpus import available_cpus  # noqa: E402
from common.errors import cli_entry  # noqa: E402
from training.loss import multipass_loss  # noqa: E402
from training.model import build_model  # noqa: E402
from training.presets import PRESETS  # noqa: E402

GOAL_RATIO = 1.05
PASSES = (1, 2, 3)


def parse_args(argv=None):
    p = Parser(prog="python benchmarks/train.py", description=__doc__.split("\n\n")[0],
               formatter_class=DefaultsFormatter)
    p.add_argument("--preset", default="tiny-fbt", choices=[k for k in PRESETS],
                   help="training preset whose architecture and loss settings are timed")
    add_threads_flag(p, available_cpus(), default_text=f"{available_cpus()}, the CPUs available to this process")
    p.add_argument("--rows", type=int_in(1, 4096), default=16, help="sequences per batch, 1..4096")
    p.add_argument("--length", type=int_in(2, 1_048_576), default=256,
                   help="tokens per sequence, 2..1048576 and at most the preset's max_len (rows x length ~ batch "
                        "tokens)")
    p.add_argument("--vocab", type=int_in(2, 1_000_000), default=None,
                   help="vocabulary size, 2..1000000 (default: the task tokenizer's)")
    p.add_argument("--warmup", type=int_in(0, 10_000), default=2,
                   help="untimed rounds (one step of every K each), 0..10000")
    p.add_argument("--repeats", type=int_in(1, 10_000), default=7, help="timed rounds, 1..10000; medians over these")
    add_seed_flag(p, "the random weights, tokens and noise")
    a = p.parse_args(argv)
    if a.length > PRESETS[a.preset].max_len:
        p.error(f"--length {a.length} exceeds {a.preset}'s context (max_len {PRESETS[a.preset].max_len})")
    return a


@cli_entry
def main(argv=None) -> dict:
    a = parse_args(argv)
    a.threads = set_threads(a.threads)
    cfg = replace(PRESETS[a.preset], seed=a.seed)
    if a.vocab is None:
        from tasks import build_tokenizer
        vocab = len(build_tokenizer())
    else:
        vocab = a.vocab
    model = build_model(cfg, vocab).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(a.seed)
    ids = torch.randint(1, vocab, (a.rows, a.length), generator=g)
    mask = torch.ones_like(ids)
    has_prefix = torch.rand(a.rows, generator=g) < cfg.prefix_mix
    fuse_from = torch.where(has_prefix, (torch.rand(a.rows, generator=g) * a.length).long(), torch.zeros(a.rows).long())
    tokens = a.rows * a.length

    def step(k: int, i: int) -> tuple[float, float]:
        gen = torch.Generator().manual_seed(a.seed * 1_000_003 + i)
        t, c = time.perf_counter(), time.process_time()
        loss, _ = multipass_loss(model, ids, mask, k, cfg, fuse_from, gen)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return time.perf_counter() - t, time.process_time() - c

    print(f"model: {a.preset} architecture ({cfg.arch}, {cfg.n_layers} layers, d_model {cfg.d_model}, "
          f"vocab {vocab}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params); "
          f"batch {a.rows}x{a.length} = {tokens} tokens, no padding; threads {a.threads}")
    times: dict[int, list[float]] = {k: [] for k in PASSES}
    cpu: dict[int, list[float]] = {k: [] for k in PASSES}
    for r in range(a.warmup + a.repeats):
        order = PASSES[r % len(PASSES):] + PASSES[:r % len(PASSES)]  # rotate: every K goes first in turn
        for k in order:
            dt, dc = step(k, r * 10 + k)
            if r >= a.warmup:
                times[k].append(dt)
                cpu[k].append(dc)
    med = {k: statistics.median(v) for k, v in times.items()}
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    res = {"preset": a.preset, "threads": a.threads, "batch_tokens": tokens, "rows": a.rows, "length": a.length,
           "vocab": vocab, "warmup": a.warmup, "repeats": a.repeats, "goal_ratio": GOAL_RATIO,
           "step_s": {}, "tokens_per_s": {}, "ratio": {}, "ratio_of_medians": {}, "meets_goal": {},
           "cpu_step_s": {}, "cpu_ratio": {}, "cpu_ratio_of_medians": {}}
    for k in PASSES:
        res["step_s"][str(k)] = round(med[k], 4)
        res["tokens_per_s"][str(k)] = round(tokens / med[k], 1)  # sequence tokens per second of training
        res["cpu_step_s"][str(k)] = round(cmed[k], 4)
        print(f"K={k}: step {med[k] * 1000:8.1f} ms (median of {a.repeats}; min {min(times[k]) * 1000:.1f}, "
              f"max {max(times[k]) * 1000:.1f})   {tokens / med[k]:9.0f} tokens/s   "
              f"{k * tokens / med[k]:9.0f} token-passes/s   CPU {cmed[k] * 1000:8.1f} ms")
    for k in PASSES[1:]:
        per_round = [tk / (k * t1) for tk, t1 in zip(times[k], times[1])]
        ratio, of_medians = statistics.median(per_round), med[k] / (k * med[1])
        res["ratio"][str(k)] = round(ratio, 4)
        res["ratio_of_medians"][str(k)] = round(of_medians, 4)
        res["meets_goal"][str(k)] = ratio <= GOAL_RATIO
        print(f"K={k}: time / ({k} x one-pass) = {ratio:.3f} (median of per-round ratios; ratio of medians "
              f"{of_medians:.3f}); goal <= {GOAL_RATIO}: {'met' if ratio <= GOAL_RATIO else 'NOT met'}")
        c_ratio = statistics.median(ck / (k * c1) for ck, c1 in zip(cpu[k], cpu[1]))
        res["cpu_ratio"][str(k)] = round(c_ratio, 4)
        res["cpu_ratio_of_medians"][str(k)] = round(cmed[k] / (k * cmed[1]), 4)
        print(f"K={k}: on CPU time = {c_ratio:.3f} (ratio of medians {cmed[k] / (k * cmed[1]):.3f})")
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
