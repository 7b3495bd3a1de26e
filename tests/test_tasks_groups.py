"""The S5 / A5 word problems (tasks.groups) and the input variants of every tracking task (tasks.tracking), against
a simulation written here from the texts alone."""
from __future__ import annotations

import collections
import itertools
import math
import random

import pytest

from common.errors import UserError
from tasks import LABEL_WORDS, TRACKING_TASKS, build_tokenizer, dataset_fingerprint, label_token_ids, make_dataset
from tasks import tokenize_samples
from tasks.groups import permutation_index, running_permutations
from tasks.tracking import VARIANTS, count_heldout, heldout_pairs, line_indices

GROUPS = ("s5", "a5")
CUPS3 = ("A", "B", "C")


def simulate(text: str) -> tuple[str, list[int]]:
    """(task kind, the tracked value after each update line) from the prompt text alone."""
    lines = text.split("\n")
    if lines[0] == "x = 0":
        x, out = 0, []
        for ln in lines[1:-1]:
            assert ln in ("x ^= 0", "x ^= 1")
            x ^= int(ln[-1])
            out.append(x)
        assert lines[-1] == "parity:"
        return "parity", out
    assert lines[-1] == "ball under:" and lines[0].startswith("ball under ")
    start = lines[0].removeprefix("ball under ")
    cups = CUPS3 if start in CUPS3 else tuple("01234")
    under = {c: c == start for c in cups}  # cup -> whether the ball is under it
    out = []
    for ln in lines[1:-1]:
        word, *args = ln.split(" ")
        assert all(a in cups for a in args) and len(set(args)) == len(args)
        if word == "swap":
            a, b = args
            assert a < b
            under[a], under[b] = under[b], under[a]
        else:
            assert word == "cycle" and len(args) == 3 and cups != CUPS3 and args[0] == min(args)
            x, y, z = args  # x's content moves to y, y's to z, z's to x
            under[x], under[y], under[z] = under[z], under[x], under[y]
        out.append(cups.index(next(c for c, b in under.items() if b)))
    return ("shell_game" if cups == CUPS3 else "group"), out


@pytest.mark.parametrize("task", GROUPS)
@pytest.mark.parametrize("n", [1, 2, 7, 40])
def test_group_samples_match_the_simulation(task, n):
    ds = make_dataset(task, 40, n, seed=3)
    assert len(ds) == 80
    for a, b in zip(ds[::2], ds[1::2]):
        assert a.pair_id == b.pair_id and a.group_id == b.group_id and a.diff_line == b.diff_line
        la, lb = a.text.split("\n"), b.text.split("\n")
        diff = [i for i, (x, y) in enumerate(zip(la, lb)) if x != y]
        assert len(la) == len(lb) == n + 2 and diff == [a.diff_line + 1]
        assert a.label != b.label
        for s in (a, b):
            kind, run = simulate(s.text)
            assert kind == "group" and s.label == run[-1] and list(s.running) == run and s.n_distractors == n
            assert s.answer == str(s.label) and s.text.endswith("ball under:")
    words = {ln.split(" ")[0] for s in ds for ln in s.text.split("\n")[1:-1]}
    assert words == ({"cycle"} if task == "a5" else {"swap", "cycle"}) or (n < 7 and words <= {"swap", "cycle"})


@pytest.mark.parametrize("task", GROUPS)
def test_group_labels_are_balanced_in_every_block_of_five_pairs(task):
    ds = make_dataset(task, 40, 6, seed=0)
    pairs = [(ds[i].label, ds[i + 1].label) for i in range(0, len(ds), 2)]
    for k in range(0, 40, 5):
        block = pairs[k:k + 5]
        assert sorted(a for a, _ in block) == sorted(b for _, b in block) == [0, 1, 2, 3, 4]
    assert sorted(pairs[:20]) == sorted(itertools.permutations(range(5), 2))


def _closure(perms):
    seen, frontier = {tuple(range(5))}, [tuple(range(5))]
    while frontier:
        nxt = []
        for s in frontier:
            for p in perms:
                t = tuple(p[c] for c in s)
                if t not in seen:
                    seen.add(t)
                    nxt.append(t)
        frontier = nxt
    return seen


def _perm_of(line: str) -> tuple[int, ...]:
    word, *args = line.split(" ")
    a = [int(x) for x in args]
    m = {a[0]: a[1], a[1]: a[0]} if word == "swap" else {a[0]: a[1], a[1]: a[2], a[2]: a[0]}
    return tuple(m.get(c, c) for c in range(5))


@pytest.mark.parametrize("task,order,even", [("s5", 120, False), ("a5", 60, True)])
def test_generators_generate_the_group_and_running_permutations(task, order, even):
    ds = make_dataset(task, 100, 30, seed=1)
    lines = {ln for s in ds for ln in s.text.split("\n")[1:-1]}
    assert len(lines) == (30 if task == "s5" else 20)
    group = _closure([_perm_of(ln) for ln in lines])
    assert len(group) == order
    sign = lambda p: (-1) ** sum(p[i] > p[j] for i in range(5) for j in range(i + 1, 5))
    assert all(sign(p) == 1 for p in group) == even
    for s in ds[:20]:
        sigma, start = tuple(range(5)), int(s.text.split("\n")[0][-1])
        for ln, got, ball in zip(s.text.split("\n")[1:-1], running_permutations(s), s.running):
            sigma = tuple(_perm_of(ln)[c] for c in sigma)
            assert got == sigma and sigma[start] == ball
    assert sorted(permutation_index(p) for p in itertools.permutations(range(5))) == list(range(120))


def test_group_fingerprints_are_known_values():
    # If these change on purpose (new text format), bump generators.FORMAT_VERSION and update the values.
    got = {t: dataset_fingerprint(make_dataset(t, 3, 4, seed=0)) for t in GROUPS}
    got.update({f"{t}@{v}": dataset_fingerprint(make_dataset(t, 3, 12, seed=0, variant=v))
                for t in TRACKING_TASKS for v in VARIANTS[1:]})
    got.update({f"{t}@uniform-split": dataset_fingerprint(make_dataset(t, 3, 12, seed=0, exclude_heldout=True))
                for t in TRACKING_TASKS})
    assert got == KNOWN


KNOWN = {
    "s5": "fe72f468a76397a8d41d23759200c533e54d6928eb3b8dcecb460730dd2acf31",
    "a5": "e190654f429e5b1fa85687ceff29dec999c6f09128c5afd36dd904ffc8c5d2bb",
    "parity@hold": "135ad5fed542a93f623667fa6c5d0cd6574526d52e9e337c85d1497cca4ee400",
    "parity@periodic": "88d36860a245296755137c1ce807a5cd204a26f72bb24fe99ce38e7f54c63b02",
    "parity@heldout": "9682899e2c563c3c987c0becbc4d67397097187ae37898a2458e93868822e0a9",
    "shell_game@hold": "e359b93390a0256ee860cd715b7e2eb7dec5e837458acc435f5039c0b6754be5",
    "shell_game@periodic": "ce23ce220bcaf51ddfb1f10e9542560711f85427c1dada7bfe3fc011f3c2f0de",
    "shell_game@heldout": "ee5fa015e4762f88a30e2e4edfd4f324686a44d4f62008c3b99fd918268aea3a",
    "s5@hold": "d5be1b7d797e5a369adc5983df9fb359c39e0384dc1f893ee8e5156bb3921ff8",
    "s5@periodic": "945f44be7b3cdc8826469d071169638a836524fab97d606a29d7da28b39cd1fa",
    "s5@heldout": "94481937c1b3062f830d16ed0c091be140b0e0553f2f28d8b00da98e639e5232",
    "a5@hold": "a35bc0a9f2bc37b35a3470da11163067c59c828e0452b8d6fae2182092d68689",
    "a5@periodic": "a18e2757ee309cea19b69ed8e219d22d0c9777e5fac4c687e47174b3cf404b5d",
    "a5@heldout": "ce99f6c52822179e3c3dfb5145847d9274f10047665f83cb08d5362c529f8beb",
    "parity@uniform-split": "45ca7e134ae59f6849055c57529d998dc14daf4c87f71d7cf6f9f888d3a908af",
    "shell_game@uniform-split": "87c8191ff3f3c617d03dc5e892923b45a7c26969b79f545e826f0846a6d9bae6",
    "s5@uniform-split": "332fdb6019c74060816eda6b089e62a3b26d389f59dbe656ba1784efafc776d9",
    "a5@uniform-split": "bc5f8acbde37dba41abe17d16163f28da1d060586c53c90925d4faee0edb7505",
}


def test_group_tokens_and_label_ids():
    tok = build_tokenizer()
    for task in GROUPS:
        ids, ds = tokenize_samples(make_dataset(task, 5, 10, seed=0), tok)
        assert all(tok.unk_token_id not in r for r in ids)
        words = label_token_ids(tok, task)
        assert words == [tok.convert_tokens_to_ids(w) for w in LABEL_WORDS[task]] and len(set(words)) == 5


# ----- variants ------------------------------------------------------------------------------------------
def _members_agree_but_one_line(ds):
    for a, b in zip(ds[::2], ds[1::2]):
        la, lb = a.text.split("\n"), b.text.split("\n")
        assert [i for i, (x, y) in enumerate(zip(la, lb)) if x != y] == [a.diff_line + 1] and a.label != b.label
        for s in (a, b):
            _, run = simulate(s.text)
            assert s.label == run[-1] and list(s.running) == run


@pytest.mark.parametrize("task", TRACKING_TASKS)
@pytest.mark.parametrize("n", [1, 9, 33])
def test_hold_has_a_stretch_where_the_value_stays_in_both_members(task, n):
    ds = make_dataset(task, 24, n, seed=5, variant="hold")
    _members_agree_but_one_line(ds)
    need = math.ceil(n / 2) if n >= 2 else 0
    for s in ds:
        first = s.text.split("\n")[0]
        v0 = 0 if task == "parity" else (CUPS3.index(first[-1]) if task == "shell_game" else int(first[-1]))
        vals = [v0, *simulate(s.text)[1]]  # the value before the first line, then after each line
        best = run = 0
        for i in range(n):  # lines that leave the value as it was, in a row, before the differing line
            run = run + 1 if vals[i + 1] == vals[i] and i < s.diff_line else 0
            best = max(best, run)
        assert best >= need, (s.text, best)


@pytest.mark.parametrize("task", TRACKING_TASKS)
def test_periodic_templates_repeat_a_short_pattern(task):
    ds = make_dataset(task, 30, 20, seed=6, variant="periodic")
    _members_agree_but_one_line(ds)
    for s in ds[::2]:
        lines = s.text.split("\n")[1:-1]
        ok = [p for p in range(1, 5) if all(lines[i] == lines[i + p] for i in range(20 - p)
                                             if s.diff_line not in (i, i + p))]
        assert ok, s.text


@pytest.mark.parametrize("task", TRACKING_TASKS)
def test_excluding_heldout_pairs_and_the_heldout_variant(task):
    held = heldout_pairs(task)
    assert held and len(held) == ({"parity": 1, "shell_game": 2}.get(task) or round(0.1 * len(_lines(task)) ** 2))
    for n in (2, 8, 40):
        for v in ("uniform", "hold", "periodic"):
            split = make_dataset(task, 30, n, seed=7, variant=v, exclude_heldout=True)
            _members_agree_but_one_line(split)
            assert all(count_heldout(task, s) == 0 for s in split), v
        # ...while without the exclusion the same draws do hold them (the check is not vacuous)
        if n == 40:
            assert any(count_heldout(task, s) for s in make_dataset(task, 30, n, seed=7))
    ev = make_dataset(task, 30, 40, seed=7, variant="heldout")
    _members_agree_but_one_line(ev)
    assert all(count_heldout(task, s) > 0 for s in ev)
    # the count is what the texts hold (an independent count over line texts)
    texts = _lines(task)
    for s in ev[:6]:
        ls = s.text.split("\n")[1:-1]
        assert count_heldout(task, s) == sum((texts.index(a), texts.index(b)) in held for a, b in zip(ls, ls[1:]))
        assert [texts[i] for i in line_indices(s)] == ls


def _lines(task):
    from tasks.tracking import tracker

    return list(tracker(task).lines)


def test_variants_refuse_in_one_line():
    for args, msg in [(("parity", 2, 4), {"variant": "bogus"}), (("memory", 2, 4), {"variant": "hold"}),
                      (("memory", 2, 4), {"exclude_heldout": True}),
                      (("s5", 2, 4), {"variant": "heldout", "exclude_heldout": True})]:
        with pytest.raises(UserError) as e:
            make_dataset(*args, **msg)
        assert "\n" not in str(e.value) and ("variant" in str(e.value) or "held-out" in str(e.value))
    assert make_dataset("parity", 3, 5, seed=1, variant="uniform") == make_dataset("parity", 3, 5, seed=1)


def test_variants_are_deterministic():
    for task in TRACKING_TASKS:
        for v in VARIANTS:
            assert make_dataset(task, 4, 10, seed=2, variant=v) == make_dataset(task, 4, 10, seed=2, variant=v)
    assert make_dataset("s5", 4, 10, seed=2, variant="hold") != make_dataset("s5", 4, 10, seed=3, variant="hold")


def test_training_pairs_use_the_variants_and_the_whole_label_cycle():
    from training.data import _training_pair
    from training.presets import get_preset

    import numpy as np

    cfg = get_preset("tiny-fbt-group")
    rng = np.random.default_rng(0)
    labels = collections.Counter()
    for task in ("s5", "a5"):
        for _ in range(100):
            pair = _training_pair(cfg, task, 12, rng)
            _members_agree_but_one_line(pair)
            labels.update(s.label for s in pair)
            assert all(count_heldout(task, s) == 0 for s in pair)  # the preset's heldout_split
    assert set(labels) == {0, 1, 2, 3, 4}


def test_task_at_variant_resolves_everywhere_a_task_is_taken():
    from analysis.evaluate import TRACKING_DISTRACTORS, default_distractors
    from tasks.custom import resolve_task

    src = resolve_task("s5@hold")
    assert src.builtin and src.name == "s5@hold" and src.task == "s5" and src.variant == "hold"
    assert src.label_words == LABEL_WORDS["s5"] and src.min_distractors == 1
    assert src.make(4, 10, 3) == make_dataset("s5", 4, 10, seed=3, variant="hold")
    assert src.label_token_ids(build_tokenizer()) == label_token_ids(build_tokenizer(), "s5")
    assert default_distractors(src) == list(TRACKING_DISTRACTORS)
    assert resolve_task("parity").variant is None and resolve_task("parity").task == "parity"
    for bad, msg in (("parity@bogus", "unknown variant 'bogus' of parity"), ("memory@hold", "unknown task")):
        with pytest.raises(UserError, match=msg) as e:
            resolve_task(bad)
        assert "\n" not in str(e.value)
