"""The word problems of S5 and A5 (issue 40): five cups 0..4, a ball under one, N update lines that permute cups.

    ball under 3
    swap 1 4          the contents of cups 1 and 4 trade places
    cycle 0 2 3       the content of cup 0 moves to cup 2, of 2 to 3, of 3 to 0
    ...
    ball under:       label: the cup the ball ends under (5 classes, label words "0".."4")

`s5` draws each line uniformly from the 10 swaps and the 20 three-cycles (the swaps alone generate S5); `a5` from
the 20 three-cycles (they generate A5, the even permutations). Both groups are non-solvable, so their word problem
is NC1-complete: no constant-depth transformer solves it at every length (Merrill and Sabharwal, "The Illusion of
State"), while a recurrence over the running permutation does.

Pairs (built by tasks.tracking, like every tracking task's variants) differ in exactly one update line
(`diff_line`, uniform), and that line changes the label: just before it the ball is under some cup p, the lines
after it are a bijection f, so a member whose line j sends p to f^-1(l) ends under l. Each pair's two labels follow
``GROUP_LABELS`` (by pair_id): every block of 5 consecutive pairs has each cup once as the first member's label and
once as the second's, and all 20 ordered pairs of different cups appear once per 20 pairs. Line j of each member is
drawn uniformly among the generators that give its label; the start cup and the other lines are uniform. Group
(cross-validation) = the pair's template (start, diff_line, the other lines), as for the shell game. ``running`` is
the ball's cup after each line; ``running_permutations`` the whole state.
"""
from __future__ import annotations

import itertools

from .samples import CUPS5, FINAL_TOKEN, GROUP_TASKS, Sample

N_CUPS = len(CUPS5)
# A generator as (line text, perm) with perm[c] = the cup the content of cup c moves to.
_SWAPS = tuple((f"swap {a} {b}", tuple(b if c == a else a if c == b else c for c in range(N_CUPS)))
               for a, b in itertools.combinations(range(N_CUPS), 2))
_CYCLES = tuple((f"cycle {x} {y} {z}", tuple({x: y, y: z, z: x}.get(c, c) for c in range(N_CUPS)))
                for a, b, c3 in itertools.combinations(range(N_CUPS), 3) for x, y, z in ((a, b, c3), (a, c3, b)))
GENERATORS = {"s5": _SWAPS + _CYCLES, "a5": _CYCLES}
ORDERS = {"s5": 120, "a5": 60}
# Labels (first member, second member) by pair_id % 20: shift k = 1..4, then cup a = 0..4 -> (a, a + k mod 5).
GROUP_LABELS = tuple((a, (a + k) % N_CUPS) for k in range(1, N_CUPS) for a in range(N_CUPS))


def line_perm(task: str, line: str) -> tuple[int, ...]:
    """The permutation of one update line of `task` (KeyError on a line that is not one of its generators)."""
    return _BY_TEXT[task][line]


_BY_TEXT = {t: dict(gens) for t, gens in GENERATORS.items()}


def text(start: int, lines: list[str]) -> str:
    return "\n".join([f"ball under {start}", *lines, "ball under" + FINAL_TOKEN])


def running_permutations(sample: Sample) -> list[tuple[int, ...]]:
    """The whole state after each update line of an s5 / a5 sample: sigma_t with sigma_t[c] = the cup the content
    that started under cup c is under after line t (the ball's cup is sigma_t[start])."""
    lines = sample.text.split("\n")[1:-1]
    sigma = tuple(range(N_CUPS))
    out = []
    for line in lines:
        p = line_perm(sample.task, line)
        sigma = tuple(p[s] for s in sigma)
        out.append(sigma)
    return out


def permutation_index(sigma: tuple[int, ...]) -> int:
    """A permutation's rank in lexicographic order (0..119): the class of a 120-way probe of the running state."""
    rest, idx = list(range(N_CUPS)), 0
    for i, s in enumerate(sigma):
        k = rest.index(s)
        idx += k * _FACT[N_CUPS - 1 - i]
        rest.pop(k)
    return idx


_FACT = [1, 1, 2, 6, 24, 120]
