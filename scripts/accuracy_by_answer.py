"""Recurrent-full accuracy split by the true answer, and how often each answer is predicted.

    python scripts/accuracy_by_answer.py runs/re/tiny-fbt-track shell_game 8

Samples as `interventions.run --task TASK --distractors N --n-pairs 60` (seed 0). A K-way model stuck near
(K-1)/K can be one that never gives one of the answers: training pairs whose answers leave one label out (the
shell game's, before `--all-answers`) make exactly that plateau.
"""
import sys
from collections import Counter

import torch

from engine.prefill import recurrent_logits
from tasks import label_token_ids, resolve_task
from models.loading import load_model


def main(model_path: str, task: str, n: int, n_pairs: int = 60) -> None:
    model, tok, _ = load_model(model_path)
    model = model.float().eval()
    words = torch.tensor(label_token_ids(tok, task))
    right, rows, said = Counter(), Counter(), Counter()
    with torch.no_grad():
        for s in resolve_task(task).make(n_pairs, n, 0):
            ids = torch.tensor([tok(s.text, add_special_tokens=False)["input_ids"]])  # [1, T]
            pred = int(recurrent_logits(model, ids, torch.ones_like(ids))[0, -1, words].argmax())
            right[s.label] += int(pred == s.label)
            rows[s.label] += 1
            said[pred] += 1
    print(f"{task}, N = {n}, recurrent-full: " + ", ".join(
        f"answer {k}: {right[k]}/{rows[k]} right, predicted {said[k]} times" for k in sorted(rows)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
