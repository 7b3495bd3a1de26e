"""Task generators for tests/test_custom_task.py, named by `--task tests.data.custom_tasks:<function>`.

Words are from the task tokenizer (tasks.build_tokenizer). `first_bit`: "state = b", N "x ^= r" filler lines,
"# final state:"; label = b (binary). The pair differs only in the first line; each pair is its own group.
"""
from __future__ import annotations

import random

from tasks import Sample


def first_bit(n_pairs, n_distractors, seed):
    rng = random.Random(seed)
    out = []
    for pair in range(n_pairs):
        filler = [f"x ^= {rng.randrange(2)}" for _ in range(n_distractors)]
        for label in (0, 1):
            text = "\n".join([f"state = {label}", *filler, "# final state:"])
            out.append(Sample("first_bit", text, label, pair, pair, n_distractors))
    return out


first_bit.label_words = ("0", "1")
first_bit.distractors = (2, 4)


def same_labels(n_pairs, n_distractors, seed):
    return [Sample("bad", "state = 0\n# final state:", 0, p, p, n_distractors) for p in range(n_pairs)
            for _ in range(2)]


same_labels.label_words = ("0", "1")


def crashes(n_pairs, n_distractors, seed):
    raise ValueError("boom")


crashes.label_words = ("0", "1")


def no_words(n_pairs, n_distractors, seed):
    return first_bit(n_pairs, n_distractors, seed)


def wrong_n(n_pairs, n_distractors, seed):  # samples that say another N than the one asked for
    return [s.__class__(s.task, s.text, s.label, s.pair_id, s.group_id, n_distractors + 5)
            for s in first_bit(n_pairs, n_distractors, seed)]


wrong_n.label_words = ("0", "1")


def extra_pairs(n_pairs, n_distractors, seed):  # more pairs than asked for
    return first_bit(n_pairs + 2, n_distractors, seed)


extra_pairs.label_words = ("0", "1")


def crashes_on_two_lines(n_pairs, n_distractors, seed):
    raise RuntimeError("boom\nsecond line")


crashes_on_two_lines.label_words = ("0", "1")
