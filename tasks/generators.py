"""Deterministic generators for the probing and tracking tasks, plus ``make_dataset`` and a fingerprint.

Samples come in adjacent pairs that differ only in the line that determines the label: label 0 first, then
label 1, so each binary dataset is exactly balanced (shell_game, s5 and a5 follow their own label schedules:
``_SHELL_LABELS``, tasks.tracking's ``GROUP_LABELS``).
All randomness comes from a ``random.Random(seed)`` local to the call: the same arguments always give
byte-identical samples.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import random

from common.errors import UserError

from .language import GENERATORS as LANGUAGE_GENERATORS, LANGUAGE_N_RANGE
from .tracking import VARIANTS, tracking_pairs
from .samples import (ALL_TASKS, CUPS, FINAL_TOKEN, GROUP_TASKS, REGISTERS, SHELL_LABELS, SHELL_SWAPS, TRACKING_TASKS,
                      WRITES_CHOICES, Sample)
from .samples import GroupIds as _GroupIds

# Writes per register a training curriculum may also use: 1 = each register written once (no recency needed).
CURRICULUM_WRITES = (1, *WRITES_CHOICES)

# Bump when the text format changes so cached artefacts keyed by the fingerprint are invalidated.
FORMAT_VERSION = 1


def _completion(n_pairs: int, n: int, rng: random.Random) -> list[Sample]:
    # Group = R: every sample with a given (R, C) combination lands in one group (the label-1 member's
    # (R, R) recurs in every pair with that R, so (R, C_mismatch) groups shared it: 61 of 192 texts had an
    # exact copy in another group), so a grouped-CV probe never saw the label of a held-out combination, nor
    # its text: it must compute C == R rather than memorise combinations. At most 10 groups (5 folds need
    # 5 distinct R: most seeds from 8 pairs, all but a few from 12: 67 of 20,000 seeds miss at 12, 2 at 16).
    groups = _GroupIds()
    distractors = ["scratch += 0"] * n
    out = []
    for pair_id in range(n_pairs):
        r = rng.randrange(10)
        c_mismatch = rng.choice([d for d in range(10) if d != r])
        s = rng.randrange(10)
        gid = groups(r)
        for label, c in ((0, c_mismatch), (1, r)):
            lines = [f"required = {r}", f"completed = {c}", f"scratch = {s}", *distractors, "Status" + FINAL_TOKEN]
            out.append(Sample("completion", "\n".join(lines), label, pair_id, gid, n))
    return out


def _memory(n_pairs: int, n: int, rng: random.Random) -> list[Sample]:
    # Group = the scratch context (the distractor lines): identical contexts share a group id. With
    # N = 0 every context is empty, so the whole dataset is ONE group; grouped CV then needs N > 0 (or
    # enough distinct contexts, 2**N of them exist) to have more groups than folds.
    groups = _GroupIds()
    out = []
    for pair_id in range(n_pairs):
        bits = tuple(rng.randrange(2) for _ in range(n))  # label-independent
        gid = groups(bits)
        distractors = [f"scratch ^= {b}" for b in bits]
        for label in (0, 1):
            lines = [f"state = {label}", "scratch = 0", *distractors, "# final state" + FINAL_TOKEN]
            out.append(Sample("memory", "\n".join(lines), label, pair_id, gid, n))
    return out


def _multi_register(n_pairs: int, n: int, rng: random.Random, writes: int | None, reads: int = 0,
                    read_rng: random.Random | None = None, registers: int = len(REGISTERS)) -> list[Sample]:
    # Group = the update history (incl. nop placement); in practice each pair is its own group.
    groups = _GroupIds()
    out = []
    for pair_id in range(n_pairs):
        w = writes if writes is not None else WRITES_CHOICES[pair_id % len(WRITES_CHOICES)]
        # Fewer registers (training curriculum only): a random subset of the names, drawn only then, so the
        # 8-register datasets stay byte-identical.
        names = REGISTERS if registers == len(REGISTERS) else sorted(rng.sample(REGISTERS, registers))
        while True:
            order = [reg for reg in names for _ in range(w)]
            rng.shuffle(order)
            values = [rng.randrange(2) for _ in order]
            latest = {reg: v for reg, v in zip(order, values)}
            # Need one register whose latest value is 0 and one whose latest is 1 to form a pair.
            if len(set(latest.values())) == 2:
                break
        total = len(order) + n
        nop_slots = set(rng.sample(range(total), n))
        history, it = [], iter(zip(order, values))
        for pos in range(total):
            if pos in nop_slots:
                history.append("nop")
            else:
                reg, v = next(it)
                history.append(f"{reg} = {v}")
        q0 = rng.choice([reg for reg in names if latest[reg] == 0])
        q1 = rng.choice([reg for reg in names if latest[reg] == 1])
        if reads:
            history = _with_reads(history, reads, read_rng)
        gid = groups(tuple(history))
        for label, q in ((0, q0), (1, q1)):
            lines = [*history, f"get {q}", "value" + FINAL_TOKEN]
            out.append(Sample("multi_register", "\n".join(lines), label, pair_id, gid, n, writes=w))
    return out


def _with_reads(history: list[str], reads: int, rng: random.Random) -> list[str]:
    """Training augmentation: `reads` answered queries ("get X", "value: v") of registers written so far.

    Each read is the final query's own format with its answer, so one sample teaches the latest-write
    lookup many times (early reads, with few writes behind them, are the easy cases). Evaluation data never
    has reads; reads come from their own random stream, so the plain history, query and label are the same
    as without reads.
    """
    slots = sorted(rng.choices(range(1, len(history) + 1), k=reads))
    out, latest, j = [], {}, 0
    for pos in range(len(history) + 1):
        while j < len(slots) and slots[j] == pos:
            if latest:
                reg = rng.choice(sorted(latest))
                out += [f"get {reg}", f"value{FINAL_TOKEN} {latest[reg]}"]
            j += 1
        if pos < len(history):
            line = history[pos]
            out.append(line)
            if line != "nop":
                reg, v = line.split(" = ")
                latest[reg] = int(v)
    return out


def _parity(n_pairs: int, n: int, rng: random.Random) -> list[Sample]:
    # "x = 0", N lines "x ^= b", "parity:"; label = XOR of the bits. The pair flips the bit of one update
    # line (diff_line, uniform), so the labels are opposite; the label-0 member's bits are uniform over the
    # even-parity strings. Group = the pair's template (diff_line and every other update line): identical
    # pairs share a group, in practice each pair is its own group once 2**(N-1) * N >> n_pairs (N = 1
    # has a single template, so one group). No coarser grouping keeps identical texts inside one group:
    # a text recurs in a different pair whenever another of its lines is picked, so only large N (2**N
    # texts) makes held-out texts unseen.
    groups = _GroupIds()
    out = []
    for pair_id in range(n_pairs):
        bits = [rng.randrange(2) for _ in range(n)]
        j = rng.randrange(n)
        if sum(bits) % 2:
            bits[j] ^= 1
        gid = groups((j, tuple(bits[:j]), tuple(bits[j + 1:])))
        for label in (0, 1):
            b = [*bits[:j], bits[j] ^ label, *bits[j + 1:]]
            running, x = [], 0
            for v in b:
                x ^= v
                running.append(x)
            lines = ["x = 0", *(f"x ^= {v}" for v in b), "parity" + FINAL_TOKEN]
            out.append(Sample("parity", "\n".join(lines), label, pair_id, gid, n,
                              diff_line=j, running=tuple(running)))
    return out


_SWAPS, _SHELL_LABELS = SHELL_SWAPS, SHELL_LABELS  # tasks.samples: shared with tasks.tracking


def _shell_run(start: int, swaps) -> list[int]:
    running, pos = [], start
    for k in swaps:
        a, b = _SWAPS[k]
        pos = b if pos == a else a if pos == b else pos
        running.append(pos)
    return running


def _shell_game(n_pairs: int, n: int, rng: random.Random) -> list[Sample]:
    # "ball under S", N lines "swap P Q", "ball under:"; label = the cup the ball ends under. The pair
    # differs in one swap line (diff_line, uniform): just before it the ball is under some cup p, and
    # the three swaps send p to three different cups (the two containing p move it, the third leaves it),
    # after which the remaining swaps are a bijection, so the three choices of that line end under three
    # different cups; each member takes the one choice that gives its label (_SHELL_LABELS). Start cup and
    # the other lines are uniform. Group = the pair's template (start, diff_line and the other swap lines),
    # as for parity; N = 1 has 3 templates (one per start cup).
    groups = _GroupIds()
    out = []
    for pair_id in range(n_pairs):
        start = rng.randrange(len(CUPS))
        swaps = [rng.randrange(len(_SWAPS)) for _ in range(n)]
        j = rng.randrange(n)
        gid = groups((start, j, tuple(swaps[:j]), tuple(swaps[j + 1:])))
        runs = {}
        for k in range(len(_SWAPS)):
            trial = [*swaps[:j], k, *swaps[j + 1:]]
            run = _shell_run(start, trial)
            runs[run[-1]] = (trial, run)
        assert len(runs) == len(CUPS)  # the three choices of line j end under three different cups
        for label in _SHELL_LABELS[pair_id % len(_SHELL_LABELS)]:
            trial, run = runs[label]
            lines = [f"ball under {CUPS[start]}",
                     *(f"swap {CUPS[_SWAPS[k][0]]} {CUPS[_SWAPS[k][1]]}" for k in trial),
                     "ball under" + FINAL_TOKEN]
            out.append(Sample("shell_game", "\n".join(lines), label, pair_id, gid, n,
                              diff_line=j, running=tuple(run)))
    return out


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def make_dataset(task: str, n_pairs: int, n_distractors: int, seed: int = 0,
                 writes: int | None = None, reads: int = 0, registers: int = len(REGISTERS),
                 variant: str = "uniform", exclude_heldout: bool = False) -> list[Sample]:
    """Return ``2 * n_pairs`` samples of ``task`` with ``n_distractors`` distractor lines each.

    ``task`` is any of ``ALL_TASKS``; for the tracking tasks (parity, shell_game) ``n_distractors`` is the
    number of update lines and must be at least 1 (a pair differs in one of them); for the language tasks
    (tasks.language) it is the task's own N (span length, filler sentences, table size, distractor
    assignments), within ``LANGUAGE_N_RANGE``.
    Pair members are adjacent (label 0 then label 1; shell_game: see ``_SHELL_LABELS``; language tasks: two
    different labels). For multi_register,
    ``writes`` fixes the number of writes per register; ``None`` cycles 2, 4, 8 over the pair index so all
    three appear. Training curriculum only (the task itself is 8 registers, 2/4/8 writes): ``registers`` < 8
    uses a random subset of the register names, and ``writes`` may also be 1 (a plain key-value lookup).
    ``variant`` (tracking tasks): how the update lines are drawn, tasks.tracking.VARIANTS (uniform, hold,
    periodic, heldout); ``exclude_heldout``: no held-out transition pair in any prompt (training data).
    """
    if task not in ALL_TASKS:
        raise UserError(f"unknown task {task!r}; valid tasks: {', '.join(ALL_TASKS)}")
    if not _is_int(n_distractors) or n_distractors < 0:
        raise UserError(f"number of distractors must be a non-negative integer, got {n_distractors!r}")
    if task in LANGUAGE_N_RANGE and not LANGUAGE_N_RANGE[task][0] <= n_distractors <= LANGUAGE_N_RANGE[task][1]:
        lo, hi = LANGUAGE_N_RANGE[task]
        raise UserError(f"task {task!r} takes N (number of distractors) in {lo}..{hi}, got {n_distractors}")
    if task in TRACKING_TASKS and n_distractors < 1:
        raise UserError(f"task {task!r} needs at least 1 update line (number of distractors >= 1) so that "
                        f"the two members of a pair can differ, got {n_distractors}")
    if not _is_int(n_pairs) or n_pairs < 1:
        raise UserError(f"number of pairs must be a positive integer, got {n_pairs!r}")
    if not _is_int(seed):
        raise UserError(f"seed must be an integer, got {seed!r}")
    if writes is not None:
        if task != "multi_register":
            raise UserError(f"writes only applies to task 'multi_register', not {task!r}")
        if not _is_int(writes) or writes not in CURRICULUM_WRITES:
            raise UserError(f"writes must be one of {', '.join(map(str, WRITES_CHOICES))} "
                            f"(1 for training curricula), got {writes!r}")
    if registers != len(REGISTERS) and (task != "multi_register" or not _is_int(registers)
                                        or not 2 <= registers <= len(REGISTERS)):
        raise UserError(f"registers must be an integer in 2..{len(REGISTERS)} and only applies to task "
                        f"'multi_register', got {registers!r}")
    if reads and (task != "multi_register" or not _is_int(reads) or reads < 0):
        raise UserError(f"reads must be a non-negative integer and only applies to task 'multi_register'")
    if (variant != "uniform" or exclude_heldout) and (task not in TRACKING_TASKS or variant not in VARIANTS):
        raise UserError(f"variant {variant!r} is not one of {task}'s: "
                        + (", ".join(VARIANTS) if task in TRACKING_TASKS else "only tracking tasks have variants"))
    rng = random.Random(seed)
    if task in LANGUAGE_GENERATORS:
        return LANGUAGE_GENERATORS[task](n_pairs, n_distractors, rng)
    if task == "completion":
        return _completion(n_pairs, n_distractors, rng)
    if task == "memory":
        return _memory(n_pairs, n_distractors, rng)
    if task in TRACKING_TASKS and (variant != "uniform" or exclude_heldout or task in GROUP_TASKS):
        return tracking_pairs(task, n_pairs, n_distractors, rng, variant, exclude_heldout=exclude_heldout)
    if task == "parity":
        return _parity(n_pairs, n_distractors, rng)
    if task == "shell_game":
        return _shell_game(n_pairs, n_distractors, rng)
    return _multi_register(n_pairs, n_distractors, rng, writes, reads, random.Random(seed * 1_000_003 + 7),
                           registers)


def dataset_fingerprint(samples) -> str:
    """SHA-256 hex digest of a canonical JSON dump of the samples, for cache keys.

    ``n_tokens`` is left out: it depends on the tokenizer, not on the dataset, so the fingerprint is the
    same before and after ``tokenize_samples`` (key the tokenizer separately). The tracking fields
    ``diff_line`` and ``running`` and the language tasks' ``key_char`` enter only when set, so the other tasks' fingerprints are those from
    before the fields existed.
    """
    rows = []
    for s in samples:
        d = dataclasses.asdict(s)
        d.pop("n_tokens", None)
        d.pop("label_words", None)  # the task's, not the sample's (and custom tasks' fingerprints predate it)
        if d.get("answer_sep") in (None, " "):  # only a custom task's other join enters (earlier ones keep theirs)
            d.pop("answer_sep", None)
        for key in ("diff_line", "running", "key_char"):
            if d[key] is None:
                del d[key]
        rows.append(d)
    blob = json.dumps({"format": FORMAT_VERSION, "samples": rows}, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()
