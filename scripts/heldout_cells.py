"""Which held-out transition fails: accuracy per (held-out line pair, tracked value entering its second line).

    python scripts/heldout_cells.py shell_game --model checkpoints/tiny-fbt-track3

Each prompt has N update lines (default 8) that hold exactly one held-out pair (tasks.tracking.heldout_pairs), at
lines N/2 - 1 and N/2; every other consecutive pair is one training data may hold. Prompts are grouped by the
pair and by the tracked value entering its second line (parity: the bit; the shell game, s5, a5: the ball's cup).
A model that learned the group answers every cell; one that learned the transitions it saw fails the cells whose
(value, line) arrival was never trained. Prints one row per cell and ends with one JSON line.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common.cli import Parser, add_model_flag, add_seed_flag, add_threads_flag, int_in, set_threads  # noqa: E402
from common.errors import UserError, cli_entry  # noqa: E402
from stress_tracking import TASKS, accuracy  # noqa: E402


def cells(task: str, n: int, per_cell: int, seed: int) -> dict[tuple[int, int, int], tuple[list[str], list[int]]]:
    """{(line a, line b, value entering b): (prompts, labels)} with `per_cell` prompts each (cells no start
    state reaches are left out)."""
    from tasks.tracking import heldout_pairs, tracker

    tr = tracker(task)
    held = heldout_pairs(task)
    rng = random.Random(f"{seed}-{task}-heldout-cells")
    j = n // 2  # the pair sits at update lines j - 1, j
    lines = range(len(tr.lines))

    def pick(prev, then=None):  # a line that forms no held-out pair with its neighbours
        options = [k for k in lines if (prev, k) not in held and (then is None or (k, then) not in held)]
        if not options:
            raise UserError(f"{task}: no line may stand between {prev} and {then} without a held-out pair")
        return options[rng.randrange(len(options))]

    out: dict = {}
    for a, b in sorted(held):
        for _ in range(50 * per_cell * tr.n_states):  # drawn forward (no rejection): any N fills every cell
            if all(len(out.get((a, b, s), ([],))[0]) >= per_cell for s in range(tr.n_states)):
                break
            idx: list[int] = []
            for i in range(n):
                prev = idx[-1] if idx else None
                idx.append(a if i == j - 1 else b if i == j else pick(prev, a if i == j - 2 else None))
            start = tr.starts[rng.randrange(len(tr.starts))]
            v = start
            for k in idx[:j]:
                v = tr.perms[k][v]
            texts, labels = out.setdefault((a, b, v), ([], []))
            if len(texts) >= per_cell:
                continue
            end = v
            for k in idx[j:]:
                end = tr.perms[k][end]
            texts.append(tr.text(start, [tr.lines[k] for k in idx]))
            labels.append(end)
    return out


@cli_entry
def main(argv=None) -> int:
    p = Parser(prog="python scripts/heldout_cells.py", description=__doc__.splitlines()[0])
    p.add_argument("task", choices=TASKS, help="the tracking task")
    add_model_flag(p, "tiny-fbt-track3")
    p.add_argument("--distractors", type=int_in(2, 1024), default=8, help="update lines N, 2..1024 (default 8)")
    p.add_argument("--per-cell", type=int_in(1, 10000), default=60, help="prompts per cell, 1..10000 (default 60)")
    p.add_argument("--mode", default="recurrent-full", help="the prefill mode (default recurrent-full)")
    p.add_argument("--batch-size", type=int_in(1, 4096), default=64, help="prompts per forward, 1..4096 (default 64)")
    add_seed_flag(p, "the prompts")
    add_threads_flag(p, 2)
    a = p.parse_args(argv)
    set_threads(a.threads)
    from engine.modes import parse_mode
    from models.loading import load_model
    from tasks.tracking import tracker

    parse_mode(a.mode)
    model, tok, name = load_model(a.model)
    if tok is None:
        raise UserError(f"{a.model} has no tokenizer of the tracking tasks")
    tr = tracker(a.task)
    rows = []
    for (la, lb, v), (texts, labels) in sorted(cells(a.task, a.distractors, a.per_cell, a.seed).items()):
        acc = accuracy(model, tok, a.task, texts, labels, a.mode, a.batch_size)
        rows.append({"first": tr.lines[la], "second": tr.lines[lb], "value_entering_second": v,
                     "n": len(texts), "accuracy": acc})
        print(f"{tr.lines[la]!r:14s} then {tr.lines[lb]!r:14s} value entering it {v}: {acc:.3f} ({len(texts)})",
              flush=True)
    print(json.dumps({"model": name, "task": a.task, "mode": a.mode, "n": a.distractors, "seed": a.seed,
                      "cells": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
