"""Sample record and constants shared by the synthetic probing tasks (docs/design.md, Tasks).

``TASKS`` are the three probing tasks the shipped models were trained on (CLIs default to them);
``TRACKING_TASKS`` are the state-tracking tasks of issue 21 (parity, and the S3 shell game) and issue 40 (the S5 and
A5 word problems ``s5``, ``a5``: tasks.groups), whose words
the shipped checkpoints' tokenizers do not know; ``LANGUAGE_TASKS`` are the natural-language tasks of issue 39
(induction, ioi, lookup, binding: tasks.language) for pretrained LMs; ``ALL_TASKS`` is all of them.

Every prompt of a task ends with the same final token (``:`` for the synthetic tasks) so that, under standard
prefill, the layer-0 vector at the last position is identical for all samples and a layer-0 probe is at chance
by construction.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .words import ANSWER_SEP, LANGUAGE_LABEL_WORDS, LANGUAGE_TASKS

TASKS = ("completion", "memory", "multi_register")
# The word problems of S5 and A5 (issue 40; tasks.groups): five cups, 5 classes.
GROUP_TASKS = ("s5", "a5")
TRACKING_TASKS = ("parity", "shell_game", *GROUP_TASKS)
ALL_TASKS = TASKS + TRACKING_TASKS + LANGUAGE_TASKS
DISTRACTOR_COUNTS = (0, 8, 32, 128, 256)
# Index = label. multi_register and parity answer with the bare bit so the answer is a digit token;
# shell_game (3 classes) answers with the cup the ball ends under.
CUPS = ("A", "B", "C")
CUPS5 = ("0", "1", "2", "3", "4")  # s5 / a5 cups and label words
# The three transpositions of S3 as cup-index pairs; line text "swap A B" etc. (always in this order).
SHELL_SWAPS = ((0, 1), (0, 2), (1, 2))
# shell_game labels of the two pair members, by pair_id % 6: every block of 3 consecutive pairs holds
# each cup exactly twice (once as first member, once as second), so the dataset is exactly balanced when
# n_pairs is a multiple of 3 and the three class counts differ by at most 1 otherwise; each ordered pair
# of different cups appears once per 6 pairs.
SHELL_LABELS = ((0, 1), (1, 2), (2, 0), (1, 0), (2, 1), (0, 2))
LABEL_WORDS = {"completion": ("MORE", "DONE"), "memory": ("ZERO", "ONE"), "multi_register": ("0", "1"),
               "parity": ("0", "1"), "shell_game": CUPS, "s5": CUPS5, "a5": CUPS5,
               **LANGUAGE_LABEL_WORDS}
WRITES_CHOICES = (2, 4, 8)
REGISTERS = ("A", "B", "C", "D", "E", "F", "G", "H")
FINAL_TOKEN = ":"


class GroupIds:
    """Small ints assigned to group keys in order of first appearance (every generator's cross-validation groups)."""

    def __init__(self) -> None:
        self._ids: dict = {}

    def __call__(self, key) -> int:
        return self._ids.setdefault(key, len(self._ids))


@dataclass(frozen=True)
class Sample:
    """One prompt with its label and the bookkeeping probes need (pair, CV group, N, length).

    Labels are binary for the synthetic tasks except shell_game (3 classes), s5 and a5 (5); the language tasks have one class per
    word of their list (``LABEL_WORDS``). For the tracking tasks ``n_distractors`` is the
    number of update lines, ``diff_line`` the 0-based update line in which the two pair members differ and
    ``running`` the tracked value (label index) after each update line; both stay ``None`` for the other
    tasks and are then left out of ``dataset_fingerprint``.
    """

    task: str
    text: str  # the prompt; always ends with the final token ":"
    label: int  # index into LABEL_WORDS[task]: 0/1, 0/1/2 for shell_game, a word's index for the language tasks
    pair_id: int
    group_id: int  # cross-validation group: whole groups are held out together
    n_distractors: int
    writes: int = 0  # multi_register: writes per register (2, 4 or 8); 0 for other tasks
    n_tokens: int | None = None  # filled by tasks.tokenize_samples
    diff_line: int | None = None  # tracking tasks: update line (0-based) where the pair members differ
    running: tuple[int, ...] | None = None  # tracking tasks: value after each update line (length N)
    key_char: int | None = None  # language tasks: character offset in `text` of the key word (tasks.language)
    # custom tasks (tasks.custom): their label words; built-in tasks look theirs up in LABEL_WORDS. Not part of
    # the sample's identity (left out of equality and of dataset_fingerprint).
    label_words: tuple[str, ...] | None = field(default=None, compare=False, repr=False)
    # custom tasks: the text between prompt and answer (tasks.custom: a file's "answer_sep"); None: ANSWER_SEP's
    answer_sep: str | None = field(default=None, compare=False, repr=False)

    @property
    def answer(self) -> str:
        return (self.label_words or LABEL_WORDS[self.task])[self.label]

    @property
    def full_text(self) -> str:
        """Prompt plus answer: the text a model is trained on."""
        sep = self.answer_sep if self.answer_sep is not None else ANSWER_SEP.get(self.task, " ")
        return self.text + sep + self.answer


def pair_roles(samples) -> list[int]:
    """Each sample's role in its pair: 0 for the pair's first member in dataset order, 1 for the second.

    The probe label of a task whose answer has too many classes for grouped cross-validation (the language tasks:
    one class per word). For ioi the role is a task variable (0: the answer is the first-named person, the
    subject repeated second); for the other language tasks it is which of two random candidates the pair drew
    first, so a probe of it sits at chance wherever nothing about the draw order is kept."""
    seen: set = set()
    out = []
    for s in samples:
        out.append(int(s.pair_id in seen))
        seen.add(s.pair_id)
    return out


ANSWER_PROBE_LABEL = "the answer (the label)"
ROLE_PROBE_LABEL = "the pair role (tasks.pair_roles)"


def probe_labels(samples, n_splits: int, roles: bool | None = None) -> tuple[list[int], str]:
    """(what a probe fits, its name): the labels where grouped cross-validation with `n_splits` folds can score
    them; for a task with more than 3 answer classes whose classes fall in too few groups (the language tasks:
    one class per word), each sample's role in its pair (``pair_roles``). UserError (one line) where neither
    works (too few pairs). probes.run and interventions.run both choose this way. `roles`: None = choose so;
    True = the pair roles; False = the labels or a refusal (a user's task: its pair order means nothing)."""
    from stats.linear import check_groups

    from common.errors import UserError

    y, groups = [s.label for s in samples], [s.group_id for s in samples]
    if not roles:
        try:
            check_groups(y, groups, n_splits)
            return y, ANSWER_PROBE_LABEL
        except UserError as e:
            if roles is False or len(set(y)) <= 3 or "label" not in str(e):
                raise
    roles = pair_roles(samples)
    check_groups(roles, groups, n_splits)
    return roles, ROLE_PROBE_LABEL


def probe_target(sample_sets, n_splits: int, roles_allowed: bool = True) -> bool:
    """Whether a run of several datasets (one per N) probes the pair roles: one target for all of them (where
    one N needs the roles, every N fits them), so that every row of a run probes one thing against one chance
    level. `roles_allowed` False (a user's task): never, and a dataset whose labels cannot be scored is refused."""
    if not roles_allowed:
        for s in sample_sets:
            probe_labels(s, n_splits, roles=False)
        return False
    return any(probe_labels(s, n_splits)[1] == ROLE_PROBE_LABEL for s in sample_sets)


def copies_across_groups(samples, keys=None) -> int:
    """How many samples have their exact text in another group. Grouped cross-validation holds whole groups out so
    that no probe is scored on its training data; a text in two groups breaks that (short tracking prompts: parity
    at N = 8 has 2**8 texts, and 106 of 96 pairs' 192 samples recur across groups; at N <= 4 all do). probes.run
    and interventions.run record the count and say so where it is not 0. `keys`: what makes two prompts one
    (default the text; the token rows, where whitespace the tokenizer drops makes two texts one input)."""
    keys = [s.text for s in samples] if keys is None else [tuple(k) for k in keys]
    groups_of: dict = {}
    for k, s in zip(keys, samples):
        groups_of.setdefault(k, set()).add(s.group_id)
    return sum(len(groups_of[k]) > 1 for k in keys)
