"""Row by row: the fed-state swap from the first position after a pair's differing line, one position at a time.

    python scripts/first_line_rows.py checkpoints/tiny-fbt-track parity 64 [LINE [POSITIONS [N_PAIRS]]]

Samples as `interventions.run --task TASK --distractors N --n-pairs N_PAIRS` (seed 0; default 50 pairs),
recurrent-full; only the rows whose pair differs in update line LINE (0-based, default 0: the first). For each
row: its update lines LINE - 3 to LINE + 3, the LD (own label word minus the donor's) after the swap at the
report's `first_line_after` position, and the first of the next POSITIONS (default 16) positions where the swap
makes the answer follow the donor. The report's per-bin figures are means over rows; this shows whether a bin's
50% is every row at a tie or half the rows flipping outright.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, not whatever the venv's install points to

import numpy as np

from common.cli import Parser, add_model_flag, add_task_flags, int_in
from common.errors import UserError, cli_entry
from interventions.core import Batch, CausalContext
from interventions.suite import first_line_after_positions
from tasks import ALL_TASKS, resolve_task
from models.loading import load_model
from models.tokenizers import resolve_tokenizer


MAX_N = 1024  # interventions.run's --distractors bound
MAX_POSITIONS = 100_000  # interventions.run's --max-positions bound
MAX_PAIRS = 5000  # interventions.run's --n-pairs bound


def run(model_path: str, task: str, n: int, line: int = 0, positions: int = 16, n_pairs: int = 50) -> None:
    model, tok, _ = load_model(model_path)
    tok = resolve_tokenizer(model, tok, model_path)  # none of its own: one line, not a TypeError later
    source = resolve_task(task)
    rows = [s for s in source.make(n_pairs, n, 0) if s.diff_line == line]
    if not rows:
        raise UserError(f"no pair of {n_pairs} differs in update line {line}")
    b = Batch.from_samples(rows, tok, source)
    ctx = CausalContext(model, b, modes=("recurrent-full",))
    # prompt line index of update line `line` is line + 1 (line 0 of the prompt sets the start value)
    start, _ = first_line_after_positions(b, np.full(b.size, line + 1))
    if len(set(start.tolist())) != 1:  # the built-in tracking tasks' lines have fixed token counts
        raise UserError("the rows' first positions after the line differ; this script swaps them all at one "
                        "position")
    start = int(start[0])
    y, r, ids = b.labels, b.labels[b.pair], b.label_ids

    def ld(logits):  # [B]: logit(own label word) - logit(donor's label word)
        return [float(logits[i, ids[y[i]]] - logits[i, ids[r[i]]]) for i in range(b.size)]

    first_flip, at_start = [None] * b.size, None
    for p in range(start, min(start + max(positions, 1), 0)):
        lds = ld(ctx.swap_state(b.pair, "recurrent-full", p))
        at_start = at_start or lds  # the report's first_line_after swap
        for i, v in enumerate(lds):
            if v < 0 and first_flip[i] is None:
                first_flip[i] = p
    T = b.input_ids.shape[1]
    print(f"{task}, N = {n}: {b.size} rows differ in update line {line}; swap from position {start}")
    for i, s in enumerate(rows):
        lo = max(0, line - 3)
        lines = s.text.split("\n")[1 + lo:line + 5]  # prompt line 0 sets the start value
        where = "never" if first_flip[i] is None else \
            f"{first_flip[i]} ({tok.decode([int(b.input_ids[i, T + first_flip[i]])])!r})"
        print(f"row {i} (pair {int(b.pair[i])}, label {s.answer}): update lines {lo}-{line + 3} {lines}; "
              f"LD after the first-line swap {at_start[i]:+.3f}; first position whose swap flips it: {where}")


@cli_entry
def main(argv=None) -> None:
    p = Parser(prog="python scripts/first_line_rows.py", description=__doc__)
    add_model_flag(p, positional=True)
    add_task_flags(p, ALL_TASKS, positional=True)
    p.add_argument("n", metavar="N", type=int_in(0, MAX_N), help=f"distractor lines per prompt, 0..{MAX_N}")
    p.add_argument("line", metavar="LINE", nargs="?", type=int_in(0, MAX_N - 1), default=0,
                   help=f"the differing update line, 0-based, 0..{MAX_N - 1} and below N (default 0: the first)")
    p.add_argument("positions", metavar="POSITIONS", nargs="?", type=int_in(1, MAX_POSITIONS), default=16,
                   help=f"positions after it searched for a flip, 1..{MAX_POSITIONS} (default 16)")
    p.add_argument("n_pairs", metavar="N_PAIRS", nargs="?", type=int_in(1, MAX_PAIRS), default=50,
                   help=f"sample pairs, 1..{MAX_PAIRS} (default 50)")
    a = p.parse_args(argv)
    run(a.model, a.task, a.n, a.line, a.positions, a.n_pairs)


if __name__ == "__main__":
    main()
