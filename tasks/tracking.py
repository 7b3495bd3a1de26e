"""Every state-tracking task as a permutation puzzle, and the input variants that test it (issue 40).

A tracking task is a start line, N update lines and a query line; each update line is a generator: a
permutation of the task's few states (parity: the bit, "x ^= 1" swaps 0 and 1, "x ^= 0" fixes both; shell_game:
three cups, swaps; s5 / a5: five cups, tasks.groups). The label is the state after the last line. With that one
view, one builder makes pairs for every task under any *draw* of the template's lines:

    uniform    every line uniform over the generators (parity and shell_game keep their original generators in
               tasks.generators, byte for byte; s5 and a5 are built here)
    hold       one stretch of ceil(N/2)..N-1 lines that all leave the tracked value unchanged (x ^= 0; a swap or
               cycle not touching the ball's cup; N = 1 has no room for one: uniform), placed uniformly; the pair's
               differing line comes after it,
               so both members hold through it. A stretch longer than a windowed model's attention span is where
               a state that rides on the window instead of the feedback is lost.
    periodic   a random pattern of 1..4 lines repeated to fill the N lines (one line then differs in a pair)
    heldout    the held-out transition pairs of arXiv 2606.07254: ``heldout_pairs(task)`` are ordered pairs of
               consecutive update lines that training data drawn with `exclude_heldout` never hold; here each
               line after the first follows its predecessor as a held-out pair with probability 1/2 where one
               exists

`exclude_heldout` (training, any draw but heldout): every line is drawn among those that do not complete a held-out
pair with the line before, and the pair's differing line among those that keep the prompt free of them (the
template is drawn again where no such line exists).

The pair rule is the one of tasks.groups: line j (the differing line) is chosen per member among the generators
that send the state before it to the one the lines after it map to the member's label; pairs' labels follow
the task's label cycle (``LABEL_CYCLE``). Group = the pair's template (start, j, every other line).
"""
from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass
from typing import Callable

from common.errors import UserError

from .samples import CUPS, FINAL_TOKEN, GroupIds, Sample

VARIANTS = ("uniform", "hold", "periodic", "heldout")
HELDOUT_FRACTION = 0.1  # of the ordered line pairs of s5 / a5 (parity and shell_game: fixed choices below)


@dataclass(frozen=True)
class Tracker:
    task: str
    lines: tuple[str, ...]  # generator texts
    perms: tuple[tuple[int, ...], ...]  # perm[state] = the state after the line
    starts: tuple[int, ...]  # possible start states (drawn uniformly)
    labels: tuple[tuple[int, int], ...]  # the label cycle: (first member, second member) by pair_id
    text: Callable[[int, list[str]], str]  # (start, line texts) -> prompt

    @property
    def n_states(self) -> int:
        return len(self.perms[0])


def _trackers() -> dict[str, Tracker]:
    from . import groups
    from .samples import SHELL_LABELS as _SHELL_LABELS, SHELL_SWAPS as _SWAPS

    shell = Tracker(
        "shell_game", tuple(f"swap {CUPS[a]} {CUPS[b]}" for a, b in _SWAPS),
        tuple(tuple(b if c == a else a if c == b else c for c in range(3)) for a, b in _SWAPS), (0, 1, 2),
        _SHELL_LABELS, lambda s, ls: "\n".join([f"ball under {CUPS[s]}", *ls, "ball under" + FINAL_TOKEN]))
    parity = Tracker("parity", ("x ^= 0", "x ^= 1"), ((0, 1), (1, 0)), (0,), ((0, 1),),
                     lambda s, ls: "\n".join(["x = 0", *ls, "parity" + FINAL_TOKEN]))
    out = {"parity": parity, "shell_game": shell}
    for t in groups.GROUP_TASKS:
        gens = groups.GENERATORS[t]
        out[t] = Tracker(t, tuple(g[0] for g in gens), tuple(g[1] for g in gens), tuple(range(groups.N_CUPS)),
                         groups.GROUP_LABELS, groups.text)
    return out


@functools.lru_cache(maxsize=None)
def tracker(task: str) -> Tracker:
    return _trackers()[task]


@functools.lru_cache(maxsize=None)
def heldout_pairs(task: str) -> frozenset:
    """The held-out ordered pairs (previous line, next line) of generator indices: parity x ^= 1 twice; the shell
    game's same swap twice (A B) and swap A C then B C; s5 / a5 a fixed 10% of all ordered pairs, every line
    keeping allowed successors."""
    if task == "parity":
        return frozenset({(1, 1)})
    if task == "shell_game":
        return frozenset({(0, 0), (1, 2)})
    n = len(tracker(task).lines)
    rng = random.Random(f"heldout-{task}")  # fixed: the split is part of the task
    pairs = [(a, b) for a in range(n) for b in range(n)]
    return frozenset(rng.sample(pairs, round(HELDOUT_FRACTION * len(pairs))))


def count_heldout(task: str, sample: Sample) -> int:
    """How many consecutive update-line pairs of a sample are held-out pairs."""
    idx = line_indices(sample)
    held = heldout_pairs(task)
    return sum((a, b) in held for a, b in zip(idx, idx[1:]))


def line_indices(sample: Sample) -> list[int]:
    """The generator index of each update line of a tracking sample."""
    tr = tracker(sample.task)
    by_text = {t: i for i, t in enumerate(tr.lines)}
    return [by_text[line] for line in sample.text.split("\n")[1:-1]]


def _run(perms, start: int, idx) -> list[int]:
    out, s = [], start
    for k in idx:
        s = perms[k][s]
        out.append(s)
    return out


# ----- draws: (rng, n, tracker, start, ok) -> (template line indices, differing line j) -----------------------
# `ok(prev, next)`: whether line `next` may follow line `prev` (all True, or False on a held-out pair when
# training data exclude them); a draw returns None where it cannot meet it (the template is drawn again).
def _pick(rng, options):
    return options[rng.randrange(len(options))] if options else None


def _chain(rng, n, tr, ok, first=None, among=None):
    """n lines, each uniform over `among` (default: every line) that may follow the previous one."""
    pool = range(len(tr.lines)) if among is None else among
    out, prev = [], first
    for _ in range(n):
        k = _pick(rng, [b for b in pool if prev is None or ok(prev, b)])
        if k is None:
            return None
        out.append(k)
        prev = k
    return out


def _uniform(rng, n, tr, start, ok):
    idx = _chain(rng, n, tr, ok)
    return None if idx is None else (idx, rng.randrange(n))


def _hold(rng, n, tr, start, ok):
    if n < 2:
        return _uniform(rng, n, tr, start, ok)
    length = rng.randint(math.ceil(n / 2), n - 1)
    a = rng.randint(0, n - 1 - length)
    idx = _chain(rng, a, tr, ok)
    if idx is None:
        return None
    s = _run(tr.perms, start, idx)[-1] if idx else start
    fixing = [k for k, p in enumerate(tr.perms) if p[s] == s]
    stretch = _chain(rng, length, tr, ok, first=idx[-1] if idx else None, among=fixing)
    rest = None if stretch is None else _chain(rng, n - a - length, tr, ok, first=stretch[-1])
    if rest is None:
        return None
    return idx + stretch + rest, rng.randint(a + length, n - 1)


def _periodic(rng, n, tr, start, ok):
    pattern = _chain(rng, rng.randint(1, 4), tr, ok)
    if pattern is None or not ok(pattern[-1], pattern[0]):
        return None
    return [pattern[i % len(pattern)] for i in range(n)], rng.randrange(n)


def _heldout_draw(rng, n, tr, start, ok):
    held = heldout_pairs(tr.task)
    nxt = {}
    for a, b in sorted(held):
        nxt.setdefault(a, []).append(b)
    idx = [rng.randrange(len(tr.lines))]
    for _ in range(n - 1):
        options = nxt.get(idx[-1])
        idx.append(options[rng.randrange(len(options))] if options and rng.random() < 0.5
                   else rng.randrange(len(tr.lines)))
    return idx, rng.randrange(n)


DRAWS = {"uniform": _uniform, "hold": _hold, "periodic": _periodic, "heldout": _heldout_draw}


def tracking_pairs(task: str, n_pairs: int, n: int, rng: random.Random, draw: str = "uniform",
                   label_offset: int = 0, exclude_heldout: bool = False) -> list[Sample]:
    """2 * n_pairs samples of a tracking task with n update lines, the template drawn by `draw` (module doc).
    `label_offset`: pair i takes the labels of cycle entry i + label_offset (training draws one pair anywhere in
    the cycle without building the whole cycle). `exclude_heldout` (training data): no two consecutive lines of
    any prompt form a held-out pair (``heldout_pairs``); refused with the heldout draw."""
    if draw not in DRAWS:
        raise UserError(f"unknown variant {draw!r}; valid: {', '.join(VARIANTS)}")
    if exclude_heldout and draw == "heldout":
        raise UserError("the heldout variant is made of held-out pairs: it cannot exclude them")
    tr = tracker(task)
    held = heldout_pairs(task) if exclude_heldout else frozenset()
    ok = (lambda a, b: (a, b) not in held)
    groups = GroupIds()
    out = []
    for pair_id in range(n_pairs):
        for _attempt in range(1000):
            start = tr.starts[rng.randrange(len(tr.starts))] if len(tr.starts) > 1 else tr.starts[0]
            drawn = DRAWS[draw](rng, n, tr, start, ok)
            if drawn is None:
                continue
            idx, j = drawn
            p = _run(tr.perms, start, idx[:j])[-1] if j else start
            after = idx[j + 1:]
            members = []
            for label in tr.labels[(pair_id + label_offset) % len(tr.labels)]:
                need = next(c for c in range(tr.n_states) if (_run(tr.perms, c, after)[-1] if after else c) == label)
                choices = [k for k, perm in enumerate(tr.perms) if perm[p] == need
                           and (j == 0 or (idx[j - 1], k) not in held) and (j == n - 1 or (k, idx[j + 1]) not in held)]
                if not choices:
                    break
                members.append((label, choices[rng.randrange(len(choices))]))
            if len(members) == 2:
                break
        else:
            raise UserError(f"{task}: no {draw} template without held-out pairs found in 1000 draws (N = {n})")
        gid = groups((start, j, tuple(idx[:j]), tuple(idx[j + 1:])))
        for label, k in members:
            trial = [*idx[:j], k, *idx[j + 1:]]
            run = _run(tr.perms, start, trial)
            assert run[-1] == label
            out.append(Sample(task, tr.text(start, [tr.lines[i] for i in trial]), label, pair_id, gid, n,
                              diff_line=j, running=tuple(run)))
    return out
