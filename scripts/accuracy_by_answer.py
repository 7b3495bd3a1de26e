"""Recurrent-full accuracy split by the true answer, and how often each answer is predicted.

    python scripts/accuracy_by_answer.py runs/re/tiny-fbt-track shell_game 8

Samples as `interventions.run --task TASK --distractors N --n-pairs 60` (seed 0). A K-way model stuck near
(K-1)/K can be one that never gives one of the answers: training pairs whose answers leave one label out (the
shell game's, before `--all-answers`) make exactly that plateau.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, not whatever the venv's install points to

from collections import Counter

import torch

from common.cli import Parser, add_model_flag, add_task_flags, int_in
from common.errors import cli_entry
from engine.prefill import recurrent_logits
from tasks import ALL_TASKS, label_token_ids, prompt_ids, prompt_prefix, resolve_task
from models.loading import load_model
from models.tokenizers import resolve_tokenizer


MAX_N = 1024  # interventions.run's --distractors bound


def run(model_path: str, task: str, n: int, n_pairs: int = 60) -> None:
    model, tok, _ = load_model(model_path)
    tok = resolve_tokenizer(model, tok, model_path)  # none of its own: one line, not a TypeError later
    model = model.float().eval()
    words = torch.tensor(label_token_ids(tok, task))
    right, rows, said = Counter(), Counter(), Counter()
    lead = prompt_prefix(tok)  # a BOS first, where the tokenizer puts one before a text (as every command)
    with torch.no_grad():
        for s in resolve_task(task).make(n_pairs, n, 0):
            ids = torch.tensor([prompt_ids(tok, s.text, lead)])  # [1, T]
            pred = int(recurrent_logits(model, ids, torch.ones_like(ids))[0, -1, words].argmax())
            right[s.label] += int(pred == s.label)
            rows[s.label] += 1
            said[pred] += 1
    print(f"{task}, N = {n}, recurrent-full: " + ", ".join(
        f"answer {k}: {right[k]}/{rows[k]} right, predicted {said[k]} times" for k in sorted(rows)))


@cli_entry
def main(argv=None) -> None:
    p = Parser(prog="python scripts/accuracy_by_answer.py", description=__doc__)
    add_model_flag(p, positional=True)
    add_task_flags(p, ALL_TASKS, positional=True)
    p.add_argument("n", metavar="N", type=int_in(0, MAX_N), help=f"distractor lines per prompt, 0..{MAX_N}")
    a = p.parse_args(argv)
    run(a.model, a.task, a.n)


if __name__ == "__main__":
    main()
