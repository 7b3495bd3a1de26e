"""Worst-case prompts for a state-tracking task beyond analysis.evaluate's variants, read off one mode.

    python scripts/stress_tracking.py parity --model checkpoints/tiny-fbt-track3 --distractors 1024

Every family is built from the task's generators (tasks.tracking.tracker), so it applies to parity, the shell
game, s5 and a5 alike; "moving" lines change the tracked value at that point, "fixing" lines leave it where it
is (parity: x ^= 0; a swap or cycle not touching the ball):

    repeat-K          all N lines the same generator K (for each K; the same line twice in a row is a held-out
                      pair of parity and the shell game)
    move-then-hold    one moving line, then N - 1 fixing lines (the value must survive N - 1 still lines)
    hold-then-move    N - 1 fixing lines, then one moving line
    sparse-70         a moving line every 70 lines (more than a 64-token window apart), fixing lines between
    blocks-100        100 uniform lines, 100 fixing lines, alternately
    biased-90         each line the first moving generator with probability 0.9, else uniform
    uniform-4x        uniform lines, 4N of them

The label is the value after the last line; the answer is the argmax over the label words at the last position.
Prints one row per family and ends with one JSON line.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.cli import Parser, add_model_flag, add_seed_flag, add_threads_flag, int_in, set_threads  # noqa: E402
from common.errors import UserError, cli_entry  # noqa: E402

TASKS = ("parity", "shell_game", "s5", "a5")


def _fixing(tr, s):
    return [k for k, p in enumerate(tr.perms) if p[s] == s]


def _moving(tr, s):
    return [k for k, p in enumerate(tr.perms) if p[s] != s]


def _lines(tr, start, rng, n, family):
    """Generator indices of one prompt of `family` (module doc), from state `start`."""
    idx, s = [], start

    def put(choices):
        nonlocal s
        k = choices[rng.randrange(len(choices))]
        idx.append(k)
        s = tr.perms[k][s]

    every = range(len(tr.perms))
    for i in range(4 * n if family == "uniform-4x" else n):
        if family.startswith("repeat-"):
            put([int(family.split("-")[1])])
        elif family == "move-then-hold":
            put(_moving(tr, s) if i == 0 else _fixing(tr, s))
        elif family == "hold-then-move":
            put(_moving(tr, s) if i == n - 1 else _fixing(tr, s))
        elif family == "sparse-70":
            put(_moving(tr, s) if i % 70 == 69 else _fixing(tr, s))
        elif family == "blocks-100":
            put(list(every) if (i // 100) % 2 == 0 else _fixing(tr, s))
        elif family == "biased-90":
            put([_moving(tr, tr.starts[0])[0]] if rng.random() < 0.9 else list(every))
        else:  # uniform-4x
            put(list(every))
    return idx, s


def families(task: str) -> list[str]:
    from tasks.tracking import tracker

    return [f"repeat-{k}" for k in range(len(tracker(task).lines))] + [
        "move-then-hold", "hold-then-move", "sparse-70", "blocks-100", "biased-90", "uniform-4x"]


def prompts(task: str, family: str, n: int, samples: int, seed: int) -> tuple[list[str], list[int]]:
    """`samples` prompts of one family and their labels (the tracked value after the last line)."""
    from tasks.tracking import tracker

    tr = tracker(task)
    rng = random.Random(f"{seed}-{task}-{family}")
    texts, labels = [], []
    for _ in range(samples):
        start = tr.starts[rng.randrange(len(tr.starts))]
        idx, end = _lines(tr, start, rng, n, family)
        texts.append(tr.text(start, [tr.lines[k] for k in idx]))
        labels.append(end)
    return texts, labels


def accuracy(model, tok, task: str, texts, labels, mode: str, batch_size: int) -> float:
    import torch

    from engine.prefill import prefill_many
    from engine.inputs import pad_left
    from tasks.tokenizer import label_token_ids, prompt_ids, prompt_prefix

    ids = torch.tensor(label_token_ids(tok, task))
    lead = prompt_prefix(tok)  # a BOS first, where the tokenizer puts one before a text (as every command)
    right = 0
    for i in range(0, len(texts), batch_size):
        batch, mask = pad_left([prompt_ids(tok, t, lead) for t in texts[i:i + batch_size]], tok.pad_token_id)
        out = prefill_many(model, batch, mask, (mode,), positions=(-1,))[mode]
        pred = out.logits[:, -1, ids].argmax(-1).tolist()
        right += sum(p == y for p, y in zip(pred, labels[i:i + batch_size]))
    return right / len(texts)


@cli_entry
def main(argv=None) -> int:
    p = Parser(prog="python scripts/stress_tracking.py", description=__doc__.splitlines()[0])
    p.add_argument("task", choices=TASKS, help="the tracking task")
    add_model_flag(p, "tiny-fbt-track3")
    p.add_argument("--distractors", type=int_in(2, 16384), default=1024, help="update lines N, 2..16384 (default 1024)")
    p.add_argument("--samples", type=int_in(1, 1000), default=8, help="prompts per family, 1..1000 (default 8)")
    p.add_argument("--mode", default="recurrent-full", help="the prefill mode (default recurrent-full)")
    p.add_argument("--batch-size", type=int_in(1, 1024), default=8, help="prompts per forward, 1..1024 (default 8)")
    p.add_argument("--families", default=None,
                   help="comma-separated families to run (default: all of them, listed in the module doc)")
    add_seed_flag(p, "the prompts")
    add_threads_flag(p, 2)
    a = p.parse_args(argv)
    set_threads(a.threads)
    from engine.modes import parse_mode
    from models.loading import load_model

    known = families(a.task)
    chosen = known if a.families is None else [f.strip() for f in a.families.split(",") if f.strip()]
    bad = [f for f in chosen if f not in known]
    if bad or not chosen:
        raise UserError(f"unknown family {', '.join(bad) or '(none given)'}; valid for {a.task}: {', '.join(known)}")
    parse_mode(a.mode)  # one line for a bad mode before the model loads
    model, tok, name = load_model(a.model)
    if tok is None:
        raise UserError(f"{a.model} has no tokenizer of the tracking tasks")
    result = {"model": name, "task": a.task, "mode": a.mode, "n": a.distractors, "samples": a.samples,
              "seed": a.seed, "accuracy": {}}
    for fam in chosen:
        texts, labels = prompts(a.task, fam, a.distractors, a.samples, a.seed)
        acc = accuracy(model, tok, a.task, texts, labels, a.mode, a.batch_size)
        result["accuracy"][fam] = acc
        print(f"{a.task:10s} {fam:16s} N = {a.distractors * (4 if fam == 'uniform-4x' else 1):6d}  "
              f"{acc:.3f}  ({a.samples} prompts)", flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
