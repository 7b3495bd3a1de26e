"""The causal report's `first_line_after` swap, split by (own answer, donor answer).

    python scripts/first_line_by_answer.py checkpoints/tiny-fbt-track shell_game 64

Samples as `interventions.run --task TASK --distractors N --n-pairs 50` (seed 0); recurrent-full. Prints the
share of rows whose answer follows the donor's after the fed state is swapped at the row's first position of
the line after its first differing token (the report's overall figure first, as a check).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, not whatever the venv's install points to

import numpy as np
import torch

from common.cli import Parser, add_model_flag, add_task_flags, int_in
from common.errors import cli_entry
from interventions.core import Batch, CausalContext
from interventions.suite import Suite, first_line_after_positions
from tasks import ALL_TASKS, resolve_task
from models.loading import load_model
from models.tokenizers import resolve_tokenizer


MAX_N = 1024  # interventions.run's --distractors bound


def run(model_path: str, task: str, n: int, n_pairs: int = 50) -> None:
    model, tok, _ = load_model(model_path)
    tok = resolve_tokenizer(model, tok, model_path)  # none of its own: one line, not a TypeError later
    model = model.float().eval()
    source = resolve_task(task)
    samples = source.make(n_pairs, n, 0)
    b = Batch.from_samples(samples, tok, source)
    ctx = CausalContext(model, b, modes=("recurrent-full",))
    suite = Suite(ctx, n_boot=200)
    first = [int((b.input_ids[i] != b.input_ids[b.pair[i]]).nonzero()[0]) for i in range(b.size)]
    line = np.array([b.line_index[i, c] for i, c in enumerate(first)])
    pos, _ = first_line_after_positions(b, line)  # the report's rule
    y = b.labels.numpy()
    r = y[b.pair]
    follow = np.zeros(b.size)
    with torch.no_grad():
        for p in sorted({int(v) for v in pos}):
            rows = pos == p
            a = suite.arrays(ctx.swap_state(b.pair, "recurrent-full", p), "recurrent-full")
            follow[rows] = a["follow"][rows] if "follow" in a else (a["ld"][rows] < 0)
    print(f"follows the donor: {follow.mean():.2f} of {b.size} rows")
    for rr in sorted(set(r)):
        m = r == rr
        print(f"  donor answer {rr}: {follow[m].mean():.2f} ({m.sum()} rows)")
    for yy in sorted(set(y)):
        for rr in sorted(set(r)):
            m = (y == yy) & (r == rr)
            if m.any():
                print(f"  own {yy}, donor {rr}: {follow[m].mean():.2f} ({m.sum()} rows)")


@cli_entry
def main(argv=None) -> None:
    p = Parser(prog="python scripts/first_line_by_answer.py", description=__doc__)
    add_model_flag(p, positional=True)
    add_task_flags(p, ALL_TASKS, positional=True)
    p.add_argument("n", metavar="N", type=int_in(0, MAX_N), help=f"distractor lines per prompt, 0..{MAX_N}")
    a = p.parse_args(argv)
    run(a.model, a.task, a.n)


if __name__ == "__main__":
    main()
