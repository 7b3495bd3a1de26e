"""Fixed-point start of the multi-pass trainer: the exact recurrence against Jacobi passes to a tolerance.

`--fixed-point-prob` batches start their fused passes from the fixed point of the feedback map. Exactly, that is
T cached one-token steps (`engine.prefill.fixed_point_top`), which a 2-core CPU runs at a few ms each whatever
the batch; with `--fixed-point-tol` (the shipped presets: 1e-3) the trainer first tries up to 16 parallel
Jacobi passes and keeps them once the largest relative state change is below the tolerance. This times both,
side by side, on the micro-batches the trainer itself draws (`training.data.make_batches`, preset tiny-fbt, a
run of consecutive steps), on a trained checkpoint (default tiny-fbt), the two in turn per micro-batch (exact
first, a fixed order), and reports the total time of each, their ratio, and how far the tolerance result is
from the exact one (relative error per position: max and mean over real positions).

Human-readable lines first; the LAST line of stdout is one JSON object with all the figures.

    python benchmarks/fixed_point.py
    python benchmarks/fixed_point.py --model checkpoints/tiny-fbt-no3 --steps 16 --threads 1
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without an install

from common.cli import (DefaultsFormatter, Parser, add_model_flag, add_threads_flag, float_in, int_in,  # noqa: E402
                        set_threads)
from common.cpus import available_cpus  # noqa: E402
from common.errors import UserError, cli_entry  # noqa: E402
from engine.prefill import fixed_point_top, shift_state  # noqa: E402
from models.loading import load_model  # noqa: E402
from training.presets import PRESETS  # noqa: E402
from training.data import make_batches  # noqa: E402


def parse_args(argv=None):
    p = Parser(prog="python benchmarks/fixed_point.py", description=__doc__.split("\n\n")[0],
               formatter_class=DefaultsFormatter)
    add_model_flag(p, "tiny-fbt", ", with a fusion module")
    p.add_argument("--preset", default="tiny-fbt", choices=list(PRESETS), help="whose batches are drawn")
    p.add_argument("--tol", type=float_in(0, 1, lo_open=True, hi_open=True), default=1e-3,
                   help="relative state-change tolerance of the Jacobi path, in (0, 1)")
    p.add_argument("--first-step", type=int_in(0, 10_000_000), default=3000,
                   help="first training step whose batches are used, 0..10000000")
    p.add_argument("--steps", type=int_in(1, 10_000), default=8,
                   help="consecutive training steps (3 micro-batches each), 1..10000")
    add_threads_flag(p, available_cpus(), default_text=f"{available_cpus()}, the CPUs available to this process")
    return p.parse_args(argv)


@cli_entry
@torch.no_grad()
def main(argv=None) -> dict:
    a = parse_args(argv)
    a.threads = set_threads(a.threads)
    model, tok, _ = load_model(a.model)
    if not model.has_fusion:
        raise UserError(f"{a.model} has no fusion module")
    model.eval()
    cfg = PRESETS[a.preset]
    t_exact = t_tol = 0.0
    rel_max, rel_sum, n_pos, shapes = 0.0, 0.0, 0, []
    for step in range(a.first_step, a.first_step + a.steps):
        for mb in make_batches(cfg, tok, step):
            top = model(mb.ids, mb.mask).top  # [batch, pos, d_model]: pass 1, the trainer's start
            gate = model.token_gate(mb.ids)
            cols = torch.arange(mb.ids.shape[1])[None]
            fuse = shift_state(top, mb.mask)[1] & (cols >= mb.fuse_from[:, None])
            t = time.perf_counter()
            exact = fixed_point_top(model, mb.ids, mb.mask, fuse, gate)
            t_exact += time.perf_counter() - t
            t = time.perf_counter()
            approx = fixed_point_top(model, mb.ids, mb.mask, fuse, gate, tol=a.tol, start=top)
            t_tol += time.perf_counter() - t
            rel = ((approx - exact).norm(dim=-1) / exact.norm(dim=-1).clamp_min(1e-12))[mb.mask.bool()]
            rel_max, rel_sum, n_pos = max(rel_max, float(rel.max())), rel_sum + float(rel.sum()), n_pos + rel.numel()
            shapes.append(list(mb.ids.shape))
    res = {"model": a.model, "preset": a.preset, "threads": a.threads, "tol": a.tol, "steps": a.steps,
           "first_step": a.first_step, "micro_batches": len(shapes), "exact_s": round(t_exact, 3),
           "tol_s": round(t_tol, 3), "speedup": round(t_exact / t_tol, 3), "rel_err_max": rel_max,
           "rel_err_mean": rel_sum / n_pos}
    print(f"{len(shapes)} micro-batches of training steps {a.first_step}..{a.first_step + a.steps - 1} "
          f"({a.preset} batches, model {a.model}, {a.threads} threads)")
    print(f"exact recurrence {t_exact:.2f} s, Jacobi to tol {a.tol:g} {t_tol:.2f} s: {t_exact / t_tol:.2f}x faster; "
          f"relative error vs exact: max {rel_max:.1e}, mean {rel_sum / n_pos:.1e}")
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
