"""Which token a model answers with, over the full vocabulary, counted across a task's evaluation samples.

    python scripts/argmax_counts.py checkpoints/tiny-std-track shell_game 16 recurrent-full

Samples, batching and the full-vocabulary argmax at the final prompt token are analysis.evaluate's (seed 424242,
100 pairs = 200 samples by default), so the counts explain an eval.json cell: an accuracy of exactly 1/K can be
a model that gives one answer to every prompt, and an accuracy of 0 one whose answer is not a label word.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code, not whatever the venv's install points to

from collections import Counter

from analysis.evaluate import EVAL_SEED
from common.cli import Parser, add_model_flag, add_task_flags, int_in
from common.errors import cli_entry
from engine.prefill import pad_left, prefill_many
from tasks import ALL_TASKS
from tasks.custom import resolve_task
from models.loading import load_model
from models.tokenizers import resolve_tokenizer


def predictions(model, tok, task: str, n: int, mode: str = "recurrent-full", n_pairs: int = 100):
    """-> (answered token per sample, samples): analysis.evaluate's samples and batches, full-vocabulary argmax."""
    src = resolve_task(task)
    seqs, samples = src.tokenize(src.make(n_pairs, n, EVAL_SEED), tok)
    said = []
    for i in range(0, len(seqs), 64):  # analysis.evaluate's default batch
        ids, mask = pad_left(seqs[i:i + 64], tok.pad_token_id)
        logits = prefill_many(model, ids, mask, [mode], collect=False)[mode].logits[:, 0]  # [batch, vocab]
        said += [tok.decode([int(t)]) for t in logits.argmax(-1)]
    return said, samples


MAX_N = 1024  # analysis.evaluate's --distractors bound


def run(model_path: str, task: str, n: int, mode: str = "recurrent-full", n_pairs: int = 100) -> None:
    model, tok, _ = load_model(model_path)
    tok = resolve_tokenizer(model, tok, model_path)  # none of its own: one line, not a TypeError later
    said, samples = predictions(model, tok, task, n, mode, n_pairs)
    labels = Counter(s.answer for s in samples)
    print(f"{task}, N = {n}, {mode}, {len(samples)} samples: answered " +
          ", ".join(f"{w!r} {c}" for w, c in Counter(said).most_common()) +
          "; labels " + ", ".join(f"{w!r} {c}" for w, c in sorted(labels.items())))


@cli_entry
def main(argv=None) -> None:
    p = Parser(prog="python scripts/argmax_counts.py", description=__doc__)
    add_model_flag(p, positional=True)
    add_task_flags(p, ALL_TASKS, positional=True)
    p.add_argument("n", metavar="N", type=int_in(0, MAX_N), help=f"distractor lines per prompt, 0..{MAX_N}")
    p.add_argument("mode", metavar="MODE", nargs="?", default="recurrent-full",
                   help="prefill mode (default recurrent-full)")
    a = p.parse_args(argv)
    run(a.model, a.task, a.n, a.mode)


if __name__ == "__main__":
    main()
