"""Tests for the state-tracking tasks parity and shell_game (issue 21), and that adding them left the three
probing tasks (texts, fingerprints, token ids) exactly as they were."""
from __future__ import annotations

import collections
import dataclasses

import pytest

import tasks
from common.errors import UserError
from tasks import (ALL_TASKS, LABEL_WORDS, TASKS, TRACKING_TASKS, Sample, build_tokenizer, dataset_fingerprint,
                   label_token_ids, make_dataset, tokenize_samples)

CUPS = ("A", "B", "C")
S3_TASKS = ("parity", "shell_game")  # issue 21's tasks (s5 / a5, issue 40: tests/test_tasks_groups.py)
UPDATE_PREFIX = {"parity": "x ^= ", "shell_game": "swap "}
FIRST_LINE = {"parity": ("x = 0",), "shell_game": tuple(f"ball under {c}" for c in CUPS)}
LAST_LINE = {"parity": "parity:", "shell_game": "ball under:"}
# Prompt length in tokens: 4 per update line plus the fixed first and query lines.
TOKENS = {"parity": lambda n: 4 * n + 6, "shell_game": lambda n: 4 * n + 7}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _pairs(samples):
    assert len(samples) % 2 == 0
    return [(samples[i], samples[i + 1]) for i in range(0, len(samples), 2)]


def _updates(s):
    lines = s.text.split("\n")
    return lines[1:-1]


def _direct(s):
    """(label, running) recomputed from the text alone: XOR of the bits, or the swaps simulated."""
    lines = s.text.split("\n")
    running = []
    if s.task == "parity":
        assert lines[0] == "x = 0"
        x = 0
        for ln in lines[1:-1]:
            bit = ln.removeprefix("x ^= ")
            assert bit in ("0", "1") and ln == f"x ^= {bit}"
            x ^= int(bit)
            running.append(x)
        return x, running
    start = lines[0].removeprefix("ball under ")
    cups = {start: True, **{c: False for c in CUPS if c != start}}  # cup -> ball under it
    assert len(cups) == 3
    for ln in lines[1:-1]:
        word, p, q = ln.split(" ")
        assert word == "swap" and p in CUPS and q in CUPS and p < q
        cups[p], cups[q] = cups[q], cups[p]
        running.append(CUPS.index(next(c for c, ball in cups.items() if ball)))
    return running[-1], running


def test_task_lists():
    assert TASKS == ("completion", "memory", "multi_register")
    assert TRACKING_TASKS == ("parity", "shell_game", "s5", "a5")  # s5 / a5: tests/test_tasks_groups.py
    from tasks import LANGUAGE_TASKS

    assert ALL_TASKS == TASKS + TRACKING_TASKS + LANGUAGE_TASKS
    assert {"TASKS", "TRACKING_TASKS", "ALL_TASKS"} <= set(tasks.__all__)
    assert LABEL_WORDS["parity"] == ("0", "1") and LABEL_WORDS["shell_game"] == CUPS


@pytest.mark.parametrize("task", S3_TASKS)
@pytest.mark.parametrize("n", (1, 4, 16, 256))
def test_shape_fields_and_final_token(task, n):
    ds = make_dataset(task, 6, n, seed=3)
    assert len(ds) == 12
    assert [s.pair_id for s in ds] == [i // 2 for i in range(12)]
    for s in ds:
        assert isinstance(s, Sample) and s.task == task
        assert s.text.endswith(":") and not s.text.endswith(" :")
        lines = s.text.split("\n")
        assert lines[0] in FIRST_LINE[task] and lines[-1] == LAST_LINE[task]
        assert len(lines) == n + 2
        assert all(ln.startswith(UPDATE_PREFIX[task]) for ln in _updates(s))
        assert s.n_distractors == n and s.writes == 0 and s.n_tokens is None
        assert isinstance(s.running, tuple) and len(s.running) == n and all(type(v) is int for v in s.running)
        assert type(s.diff_line) is int and 0 <= s.diff_line < n
        assert s.answer == LABEL_WORDS[task][s.label]
        assert s.full_text == s.text + " " + s.answer


@pytest.mark.parametrize("task", S3_TASKS)
@pytest.mark.parametrize("n", (1, 2, 8, 64))
def test_pairs_differ_in_exactly_one_update_line(task, n):
    for a, b in _pairs(make_dataset(task, 30, n, seed=1)):
        assert a.label != b.label
        assert a.pair_id == b.pair_id and a.group_id == b.group_id and a.diff_line == b.diff_line
        la, lb = a.text.split("\n"), b.text.split("\n")
        assert len(la) == len(lb) == n + 2
        diff = [i for i, (x, y) in enumerate(zip(la, lb)) if x != y]
        assert diff == [a.diff_line + 1]  # text line 0 is the start line; diff_line counts update lines
        assert la[diff[0]].startswith(UPDATE_PREFIX[task]) and lb[diff[0]].startswith(UPDATE_PREFIX[task])
        j = a.diff_line
        # same state before the differing line, different from it on (the later updates are bijections)
        assert a.running[:j] == b.running[:j]
        assert all(x != y for x, y in zip(a.running[j:], b.running[j:]))


@pytest.mark.parametrize("task", S3_TASKS)
@pytest.mark.parametrize("n", (1, 3, 32, 256))
def test_labels_and_running_match_direct_computation(task, n):
    for s in make_dataset(task, 40, n, seed=n):
        label, running = _direct(s)
        assert s.label == label == s.running[-1]
        assert list(s.running) == running


def test_diff_line_and_start_vary():
    ds = make_dataset("shell_game", 60, 8, seed=0)
    assert len({s.diff_line for s in ds}) == 8
    assert {s.text.split("\n")[0] for s in ds} == set(FIRST_LINE["shell_game"])
    assert len({s.diff_line for s in make_dataset("parity", 60, 8, seed=0)}) == 8


@pytest.mark.parametrize("n", (1, 8, 256))
def test_parity_balance(n):
    ds = make_dataset("parity", 25, n, seed=2)
    assert [s.label for s in ds] == [0, 1] * 25  # label 0 first in every pair


@pytest.mark.parametrize("n_pairs", range(1, 14))
def test_shell_game_balance(n_pairs):
    # Rule: every block of 3 consecutive pairs holds each cup exactly twice (once per pair position), so
    # the counts are exact when n_pairs % 3 == 0 and differ by at most 1 otherwise.
    ds = make_dataset("shell_game", n_pairs, 5, seed=n_pairs)
    counts = collections.Counter(s.label for s in ds)
    assert sum(counts.values()) == 2 * n_pairs and set(counts) <= {0, 1, 2}
    c = [counts[k] for k in range(3)]
    assert max(c) - min(c) <= 1
    if n_pairs % 3 == 0:
        assert c == [2 * n_pairs // 3] * 3
    for start in range(0, n_pairs - n_pairs % 3, 3):
        block = ds[2 * start:2 * start + 6]
        assert sorted(s.label for s in block) == [0, 0, 1, 1, 2, 2]
        assert sorted(s.label for s in block[::2]) == [0, 1, 2]  # first members alone are balanced too
    # all six ordered pairs of different cups appear
    if n_pairs >= 6:
        assert {(a.label, b.label) for a, b in _pairs(ds)} == {(p, q) for p in range(3) for q in range(3) if p != q}


def _template(s):
    lines = s.text.split("\n")
    return s.diff_line, tuple(lines[:s.diff_line + 1]), tuple(lines[s.diff_line + 2:])


@pytest.mark.parametrize("task", S3_TASKS)
@pytest.mark.parametrize("n", (1, 2, 3, 16))
def test_groups_are_pair_templates(task, n):
    ds = make_dataset(task, 80, n, seed=4)
    key_of_group = {}
    for s in ds:
        key = _template(s)  # the pair's lines with the differing one masked out
        assert key_of_group.setdefault(s.group_id, key) == key
    assert len(set(key_of_group.values())) == len(key_of_group)  # group ids equal iff templates equal
    assert sorted(key_of_group) == list(range(len(key_of_group)))  # small ints, first-appearance order
    n_templates = {"parity": 2 ** (n - 1) * n, "shell_game": 3 * 3 ** (n - 1) * n}[task]
    assert len(key_of_group) <= n_templates
    if n == 1 and task == "parity":
        assert len(key_of_group) == 1  # one template only: grouped CV needs N > 1
    if n == 16:
        assert [s.group_id for s in ds] == [s.pair_id for s in ds]  # in practice one group per pair


@pytest.mark.parametrize("task", S3_TASKS)
@pytest.mark.parametrize("n", (1, 8))
def test_tokenization_final_token_and_answers(tok, task, n):
    ds = make_dataset(task, 6, n, seed=2)
    ids, out = tokenize_samples(ds, tok)
    colon = tok.convert_tokens_to_ids(":")
    assert all(row[-1] == colon for row in ids)
    assert [s.n_tokens for s in out] == [len(r) for r in ids] == [TOKENS[task](n)] * len(ds)
    assert [dataclasses.replace(s, n_tokens=None) for s in out] == ds
    words = label_token_ids(tok, task)
    assert words == tok.convert_tokens_to_ids(list(LABEL_WORDS[task])) and len(set(words)) == len(words)
    for s, row in zip(ds, ids):
        assert tok.unk_token_id not in row
        assert tok.decode(row) == s.text
        full = tok(s.full_text, add_special_tokens=False)["input_ids"]
        assert full == row + [words[s.label]]


@pytest.mark.parametrize("task", S3_TASKS)
def test_token_lengths_up_to_256(tok, task):
    for n in (4, 16, 64, 256):
        _, out = tokenize_samples(make_dataset(task, 4, n, seed=0), tok)
        assert {s.n_tokens for s in out} == {TOKENS[task](n)}


def test_label_token_ids_of_old_tasks_unchanged(tok):
    assert label_token_ids(tok, "completion") == [35, 36]
    assert label_token_ids(tok, "memory") == [37, 38]
    assert label_token_ids(tok, "multi_register") == [2, 3]
    assert label_token_ids(tok, "parity") == [2, 3]
    assert label_token_ids(tok, "shell_game") == [12, 13, 14]


# The vocabulary before the tracking tasks, in id order: these ids must never move.
OLD_VOCAB = ["[PAD]", "[UNK]", *"0123456789", *"ABCDEFGH", "required", "completed", "scratch", "Status", "state",
             "final", "value", "get", "nop", "=", "+=", "^=", ":", "#", "\n", "MORE", "DONE", "ZERO", "ONE"]


def test_vocab_only_appended(tok):
    vocab = tok.get_vocab()
    assert {w: vocab[w] for w in OLD_VOCAB} == {w: i for i, w in enumerate(OLD_VOCAB)}
    assert sorted(vocab, key=vocab.get)[len(OLD_VOCAB):] == ["x", "parity", "ball", "under", "swap", "cycle"]


@pytest.mark.parametrize("task", S3_TASKS)
def test_deterministic_and_fingerprint(task):
    a = make_dataset(task, 10, 8, seed=7)
    b = make_dataset(task, 10, 8, seed=7)
    c = make_dataset(task, 10, 8, seed=8)
    assert a == b
    assert "\x00".join(s.text for s in a).encode() == "\x00".join(s.text for s in b).encode()
    assert a != c
    fa = dataset_fingerprint(a)
    assert fa == dataset_fingerprint(b) and fa != dataset_fingerprint(c)
    # the tracking fields are part of the fingerprint when set
    assert fa != dataset_fingerprint([dataclasses.replace(a[0], diff_line=a[0].diff_line + 1), *a[1:]])
    assert fa != dataset_fingerprint([dataclasses.replace(a[0], running=a[0].running[:-1]), *a[1:]])
    assert fa == dataset_fingerprint([dataclasses.replace(s, n_tokens=3) for s in a])


def test_tracking_fingerprints_are_known_values():
    # If these change on purpose (new text format), bump generators.FORMAT_VERSION and update the values.
    assert dataset_fingerprint(make_dataset("parity", 3, 4, seed=0)) == \
        "b0d55d854644dd21a78e2c9c63a0bd7e21dcef8e244fdea2a45e78f09b5bd34f"
    assert dataset_fingerprint(make_dataset("shell_game", 3, 4, seed=0)) == \
        "4f62edf0c7d58c225552d41a5633284e6629c09e9be775e42bfb7859696fc3dd"


# dataset_fingerprint(make_dataset(task, 10, n, seed)) computed BEFORE the tracking tasks and the optional
# Sample fields existed: adding them must leave every old dataset and its cache key untouched. (completion's
# values are from 2026-12-06, when its groups became R alone: the same texts and labels, other group ids.)
OLD_FINGERPRINTS = {
    ("completion", 0, 0): "9d8fa67838add220ae390a89965ed8bce6ce77e1d4be34745686dfdd9b8b0912",
    ("completion", 0, 1): "a794e724b61ac8a3b4c173f03a6566b83ad7adb45b75347371c6fd22265528ba",
    ("completion", 8, 0): "e297640574201e78c3577584f193ea9e2530630d0b81f863dd0a08b7293490c2",
    ("completion", 8, 1): "1f3edb0c0b431ca031769290a11cb9b93947ad68727f0c0d46b5f511560d0827",
    ("completion", 256, 0): "88e235d17314336adc614296dc483f1e178ebd915468e6a89e09fce54a834b71",
    ("completion", 256, 1): "8f8c303877f9834a25b421fb1e63b4026d324fe69f1a80e16d26782752efef92",
    ("memory", 0, 0): "9084906f45c8541d7e3850747f91c49167ff19fc527c952b1a7b548ea642ed2b",
    ("memory", 0, 1): "9084906f45c8541d7e3850747f91c49167ff19fc527c952b1a7b548ea642ed2b",
    ("memory", 8, 0): "3df353864d832113385a413012b2014035f11a2fe633230690605732fbdad78f",
    ("memory", 8, 1): "6b15779b3fa1241693e240ca61ef395b243e36df69d359684a32ef9fa000e324",
    ("memory", 256, 0): "b3754a59d65d3bd1f7689f9fa8874dcd2984bf2ab0371fe24933af5b3c9d33e2",
    ("memory", 256, 1): "54dedf0f4196885c0136bef00924d121a338f0cfb771c53a13541d82fe43c0f0",
    ("multi_register", 0, 0): "5ac6a0aebd132369c2f592e396c4ac92e1c426a814a814cc2316b70047a21096",
    ("multi_register", 0, 1): "e8349a1001c658043fcee37529bd3ccf5f1fec90dd4e675db702c5b6e33bcdc1",
    ("multi_register", 8, 0): "47f81d4892e95b39183fbe198167ffbe214ff6a962f223e589e219aee28b0b87",
    ("multi_register", 8, 1): "c0e5c5794ab864346ead2438df64e224f612c4a2d9dd63b51f7614a68887349a",
    ("multi_register", 256, 0): "c50cffb9b6d092996cea45eaa91fdd6cfdbe3d3e8d1f9d750c8c731590cac304",
    ("multi_register", 256, 1): "53b71600823d5b57643afc0412063471e9c8e173562ce13c9460463c71d3312b",
}


@pytest.mark.parametrize("task, n, seed", sorted(OLD_FINGERPRINTS))
def test_old_task_fingerprints_unchanged(task, n, seed):
    ds = make_dataset(task, 10, n, seed=seed)
    assert all(s.diff_line is None and s.running is None for s in ds)
    assert dataset_fingerprint(ds) == OLD_FINGERPRINTS[task, n, seed]


@pytest.mark.parametrize("task", S3_TASKS)
def test_user_errors(task):
    with pytest.raises(UserError, match=r"at least 1 update line") as info:
        make_dataset(task, 2, 0)
    assert task in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(UserError, match="non-negative"):
        make_dataset(task, 2, -1)
    with pytest.raises(UserError, match="writes"):
        make_dataset(task, 2, 1, writes=2)
    with pytest.raises(UserError, match="reads"):
        make_dataset(task, 2, 1, reads=2)
    with pytest.raises(UserError, match="registers"):
        make_dataset(task, 2, 1, registers=2)
    with pytest.raises(UserError, match=", ".join(ALL_TASKS)):
        make_dataset("bogus", 2, 1)


def test_a_tokenizer_without_the_task_words_is_refused():
    """The shipped models' tokenizers predate the tracking tasks: their words would become [UNK] silently."""
    from pathlib import Path

    from transformers import PreTrainedTokenizerFast

    shipped = Path(__file__).resolve().parent.parent / "checkpoints" / "tiny-fbt" / "tokenizer.json"
    old = PreTrainedTokenizerFast(tokenizer_file=str(shipped), unk_token="[UNK]", pad_token="[PAD]")
    tokenize_samples(make_dataset("memory", 2, 4, seed=0), old)
    with pytest.raises(UserError, match="does not know every word of the parity task"):
        tokenize_samples(make_dataset("parity", 2, 4, seed=0), old)
