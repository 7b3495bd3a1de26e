"""Where a first-line state swap wins or loses: the running value read out at every line end after it.

    python scripts/swap_persistence.py checkpoints/tiny-fbt-track shell_game 64

For a model trained with dense targets (`--dense-targets`: the running value is the LM head's target at the last
token of every update line). Samples as `interventions.run --task TASK --distractors N --n-pairs 50` (seed 0),
recurrent-full. Each pair's rows are fed each other's state at the first column of the line after the pair's
differing line (the causal report's `first_line_after` swap, here through the engine's differentiable swap,
engine.prefill.recurrent_logits), and the recurrence runs on to T. At the k-th update line end after the swap,
the argmax over the task's label words is compared with the donor's and the row's own running value (after the
differing line the two always differ: both tasks' updates are bijections). A model that carries its state only
in the fed vector follows the donor at every k; one that recovers its own value from the cached columns shows
where it does so.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, not whatever the venv's install points to

from collections import defaultdict

import torch

from common.cli import Parser, add_model_flag, add_task_flags, int_in
from common.errors import UserError, cli_entry
from engine.prefill import recurrent_logits
from tasks import TRACKING_TASKS, label_token_ids, prompt_ids, prompt_prefix, resolve_task
from models.loading import load_model
from models.tokenizers import resolve_tokenizer


MAX_N = 1024  # interventions.run's --distractors bound


def run(model_path: str, task: str, n: int, n_pairs: int = 50) -> None:
    model, tok, _ = load_model(model_path)
    tok = resolve_tokenizer(model, tok, model_path)  # none of its own: one line, not a TypeError later
    model = model.float().eval()
    samples = resolve_task(task).make(n_pairs, n, 0)
    words = torch.tensor(label_token_ids(tok, task))
    newline = tok("\n", add_special_tokens=False)["input_ids"][0]
    by_k = defaultdict(lambda: [0, 0, 0])  # line ends after the swap -> [follows the donor, its own value, rows]
    final = []
    lead = prompt_prefix(tok)  # a BOS first, where the tokenizer puts one before a text (as every command)
    with torch.no_grad():
        for a, b in zip(samples[::2], samples[1::2]):
            ids = torch.tensor([prompt_ids(tok, s.text, lead) for s in (a, b)])  # [2, T]
            first = int((ids[0] != ids[1]).nonzero()[0])
            col = first + 1 + int((ids[0, first:] == newline).nonzero()[0])  # first column of the next line
            ends = [j - 1 for j in range(ids.shape[1]) if ids[0, j] == newline][1:]  # update lines' last tokens
            logits = recurrent_logits(model, ids, torch.ones_like(ids), (torch.tensor([col, col]), torch.tensor([1, 0])))
            pred = words[logits[:, :, words].argmax(-1)]  # [2, T] the label word each column predicts
            for r, (own, donor) in enumerate(((a, b), (b, a))):
                after = [(line, j) for line, j in enumerate(ends[:len(own.running)]) if j >= col]
                for k, (line, j) in enumerate(after, 1):
                    cell = by_k[k]
                    cell[0] += int(pred[r, j] == words[donor.running[line]])
                    cell[1] += int(pred[r, j] == words[own.running[line]])
                    cell[2] += 1
                final.append(int(pred[r, -1] == words[donor.label]))
    print(f"{task}, N = {n}: the answer follows the donor in {sum(final) / len(final):.2f} of {len(final)} rows")
    for k in sorted(by_k):
        if k <= 4 or k % 8 == 0:
            f, o, m = by_k[k]
            print(f"  line end {k:3d} after the swap: donor's value {f / m:.2f}, own {o / m:.2f}, "
                  f"other {1 - (f + o) / m:.2f} ({m} rows)")


@cli_entry
def main(argv=None) -> None:
    p = Parser(prog="python scripts/swap_persistence.py", description=__doc__)
    add_model_flag(p, positional=True)
    add_task_flags(p, TRACKING_TASKS, positional=True)  # the running value at every line end: tracking tasks
    p.add_argument("n", metavar="N", type=int_in(0, MAX_N), help=f"distractor lines per prompt, 0..{MAX_N}")
    a = p.parse_args(argv)
    if a.task.split("@")[0] not in TRACKING_TASKS:  # no running value to read at the line ends
        raise UserError(f"task {a.task!r}: the running value is read at every update line's end, which the tracking "
                        f"tasks have ({', '.join(TRACKING_TASKS)})")
    run(a.model, a.task, a.n)


if __name__ == "__main__":
    main()
