"""Data-parallel training benchmark: training-step throughput on 1 process against 2 (DistributedDataParallel,
gloo on CPU), as `python -m training.train` runs a step under torchrun.

One step = the step's global batch (training.data.make_batches, built by every process), each process's share
of forward + backward (training.loop._step_gradients: DDP all-reduces the gradients), gradient clipping and the
AdamW step; the same preset, seed and steps for every process count, so every count trains the same batches.
Each count runs in its own torchrun launch with --threads torch threads per process (so 2 processes use twice
the cores of 1); after --warmup untimed steps, --steps steps are timed one by one on rank 0.

Figures: median step time and tokens/s per process count; headline = speedup = (1-process median step time) /
(2-process median step time), and the scaling efficiency = speedup / 2. The time spent building the batch (every
process builds the whole global batch) is reported beside it. On a CPU shared with other jobs the figures are
noise: measure on an idle machine.

Human-readable lines first; the LAST line of stdout is one JSON object with all the figures.

    python benchmarks/train_ddp.py                          # tiny-fbt, 1 thread per process
    python benchmarks/train_ddp.py --preset smoke --steps 4 --warmup 1
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere without an install

from common.cli import DefaultsFormatter, Parser, add_threads_flag, int_in, set_threads  # noqa: E402
from common.errors import cli_entry  # noqa: E402

PROCS = (1, 2)


def parse_args(argv=None) -> argparse.Namespace:
    from training.presets import PRESETS

    p = Parser(prog="python benchmarks/train_ddp.py", description=__doc__.split("\n\n")[0],
               formatter_class=DefaultsFormatter)
    p.add_argument("--preset", default="tiny-fbt", choices=list(PRESETS), help="training recipe whose steps are timed")
    add_threads_flag(p, 1, "; per process")
    p.add_argument("--warmup", type=int_in(0, 10_000), default=2, help="untimed steps first, 0..10000")
    p.add_argument("--steps", type=int_in(1, 10_000), default=10, help="timed steps, 1..10000; medians over these")
    p.add_argument("--first-step", type=int_in(0, 10_000_000), default=0,
                   help="first step index, 0..10000000 (the recipe's batches and pass counts at these steps are "
                        "timed)")
    p.add_argument("--timeout", type=int_in(1, 86_400), default=1800,
                   help="seconds allowed per launch (a hang guard), 1..86400")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: this process is one of a launch's workers
    return p.parse_args(argv)


def worker(a: argparse.Namespace) -> None:
    """One process of a launch: time the trainer's steps; rank 0 writes the figures to a.worker."""
    import torch

    from tasks import build_tokenizer
    from training.loop import Processes, _step_gradients, _wrap, lr_at, noise_generator
    from training.loss import StepLoss
    from training.model import build_model
    from training.presets import get_preset
    from training.data import make_batches

    set_threads(a.threads)
    procs = Processes.start()
    try:
        cfg = get_preset(a.preset)
        tok = build_tokenizer()
        if cfg.base:
            from models.loading import load_model
            tok = load_model(cfg.base)[1] or tok
        model = build_model(cfg, len(tok), cfg.base).train()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        net = _wrap(StepLoss(model, cfg), procs)
        step_s, data_s, tokens, passes = [], [], [], []
        for i in range(a.warmup + a.steps):
            step = a.first_step + i
            t = time.perf_counter()
            micro = make_batches(cfg, tok, step)
            t_data = time.perf_counter() - t
            for g in opt.param_groups:
                g["lr"] = lr_at(cfg, step)
            opt.zero_grad(set_to_none=False)
            _step_gradients(net, micro, cfg, noise_generator(cfg, step), procs)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if i >= a.warmup:
                step_s.append(time.perf_counter() - t)
                data_s.append(t_data)
                tokens.append(sum(int(mb.mask.sum()) for mb in micro))
                passes.append(micro[0].k)
        if procs.rank == 0:
            Path(a.worker).write_text(json.dumps({"world": procs.world, "step_s": step_s, "data_s": data_s,
                                                  "tokens": tokens, "passes": passes}))
        procs.barrier()
    except BaseException:
        procs.end()
        raise
    # Done: leave without destroy_process_group, whose gloo teardown deadlocked here on the GIL (rank 0, after a
    # timed step 0 of the smoke preset; pytorch issue 56297). torchrun reads the exit code.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(a: argparse.Namespace, n: int) -> dict:
    from benchmarks.torchrun_launch import launch as run_workers

    return run_workers(__file__, n, ["--preset", a.preset, "--threads", str(a.threads), "--warmup", str(a.warmup),
                                     "--steps", str(a.steps), "--first-step", str(a.first_step)],
                       a.threads, a.timeout)


@cli_entry
def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.worker:
        worker(a)
        return {}
    a.threads = a.threads or set_threads(0)  # 0: torch's own default, resolved here for the launched workers
    runs = {n: launch(a, n) for n in PROCS}
    if runs[1]["tokens"] != runs[2]["tokens"] or runs[1]["passes"] != runs[2]["passes"]:
        sys.exit("error: the process counts trained different batches")  # the data is a function of (seed, step)
    res = {"preset": a.preset, "threads_per_process": a.threads, "warmup": a.warmup, "steps": a.steps,
           "first_step": a.first_step, "passes": runs[1]["passes"], "step_s": {}, "data_s": {}, "tokens_per_s": {}}
    print(f"preset {a.preset}, steps {a.first_step + a.warmup}..{a.first_step + a.warmup + a.steps - 1} (pass counts "
          f"{runs[1]['passes']}), {a.threads} thread(s) per process")
    for n in PROCS:
        med, dmed = statistics.median(runs[n]["step_s"]), statistics.median(runs[n]["data_s"])
        tps = sum(runs[n]["tokens"]) / sum(runs[n]["step_s"])
        res["step_s"][str(n)], res["data_s"][str(n)], res["tokens_per_s"][str(n)] = \
            round(med, 4), round(dmed, 4), round(tps, 1)
        print(f"{n} process(es): step {med * 1000:8.1f} ms (median of {a.steps}; min "
              f"{min(runs[n]['step_s']) * 1000:.1f}, max {max(runs[n]['step_s']) * 1000:.1f}), of which the batch "
              f"{dmed * 1000:.1f} ms; {tps:9.0f} tokens/s")
    speedup = res["step_s"]["1"] / res["step_s"]["2"]
    res["speedup"], res["efficiency"] = round(speedup, 4), round(speedup / 2, 4)
    print(f"speedup 2 vs 1 process(es): {speedup:.3f} (efficiency {speedup / 2:.3f})")
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
