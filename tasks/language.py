"""Natural-language tasks a small pretrained LM solves (issue 39): induction, ioi, lookup and binding.

Built like the synthetic tasks (paired, grouped, seeded, fingerprinted), for real LMs such as SmolLM2-135M:
every pair differs in exactly one word of the prompt, and that word changes the answer. The answer is one
token read at the last position. Each sample also names its *key token* (``Sample.key_char``: the character
offset of the word in the prompt whose state the answer depends on), which targeted recirculation mixes alone.

    induction  "tiger, apple, river, chair. tiger, apple," -> " river": a random span of common words, then
               its start repeated up to a cue; the answer is the word after the cue's first occurrence. N = span
               length. The pair replaces that word (so the answer) with another. Key: the repeated cue.
    ioi        "When Mary and John went to the store, John gave a drink to" -> " Mary" (indirect-object
               identification, Wang et al. 2022). N = filler sentences before it ("The weather was nice."). The pair
               swaps which name is repeated (the subject's second mention, S2), so the answer is the other name.
               Key: S2.
    lookup     a table of N "key: digit" lines, a blank line, four answered queries, then "key: " -> the digit
               (few-shot key-value lookup). The pair asks for another key with another value. Key: the queried key.
    binding    code-like variable binding, six solved examples then the query block: roots "a = 7", N distractor
               assignments, 1..3 hops "b = a", "print(b)", "# " -> the digit. The pair points the first hop at a
               root with another value. Key: that hop's bound variable.

The word lists hold words that are one token, with their leading space, under SmolLM2's tokenizer (lookup keys
and binding variables also at the start of a line); tasks.tokenize_samples checks that each pair still differs in
exactly one token under whatever tokenizer is given, and refuses in one line where it does not.
lookup and binding answer a digit with no space before it (``ANSWER_SEP``): byte-level BPE tokenizers split
" 7" into " " and "7", so those prompts end with the space and the digit is the one answer token.
"""
from __future__ import annotations

import random

from .samples import GroupIds as _Groups, Sample
from .words import KEYS, NAMES, VARIABLES, WORDS

IOI_TEMPLATES = (  # one sentence each; N filler sentences go before it
    "When {A} and {B} went to the store, {S} gave a drink to",
    "When {A} and {B} went to the park, {S} gave a ball to",
    "While {A} and {B} were working at the office, {S} gave a book to",
    "After {A} and {B} had lunch at the cafe, {S} gave a gift to",
    "When {A} and {B} arrived at the station, {S} handed a ticket to",
    "After {A} and {B} finished the game, {S} passed the ball to",
)
IOI_FILLERS = ("It was a sunny day.", "They had been friends for years.", "The weather was nice.",
               "Nobody else was there.", "It was late in the afternoon.", "The street was quiet.")
LOOKUP_SHOTS = 4
BINDING_SHOTS = 6
BINDING_HOPS = (1, 2, 3)  # cycled over the pair index

LANGUAGE_DISTRACTORS = {"induction": (4, 8, 16, 32), "ioi": (0, 1, 2, 4), "lookup": (6, 8, 12), "binding": (0, 2, 4)}
# Smallest and largest N each generator can make (induction: a span and a different replacement word; lookup: the
# shots and two queried keys; binding: the variables of one block).
LANGUAGE_N_RANGE = {"induction": (2, len(WORDS) - 1), "ioi": (0, 64), "lookup": (LOOKUP_SHOTS + 2, len(KEYS)),
                    "binding": (0, len(VARIABLES) - 2 - max(BINDING_HOPS))}


def _induction(n_pairs: int, n: int, rng: random.Random) -> list[Sample]:
    # Group = the pair's template (span without the answer word, cue index): in practice each pair its own.
    groups, out = _Groups(), []
    for pair_id in range(n_pairs):
        span = rng.sample(WORDS, n)
        j = rng.randrange(min(n // 2, n - 2), n - 1)  # the cue is span[j]; the repeat is long enough to induct
        other = rng.choice([w for w in WORDS if w not in span])
        gid = groups((tuple(span[:j + 1]), tuple(span[j + 2:])))
        for answer in (span[j + 1], other):
            words = [*span[:j + 1], answer, *span[j + 2:]]
            first = ", ".join(words) + ". "
            text = first + ", ".join(words[:j + 1]) + ","
            key = len(first) + len(", ".join(words[:j]) + (", " if j else ""))  # the repeated cue
            out.append(Sample("induction", text, WORDS.index(answer), pair_id, gid, n, key_char=key))
    return out


def _ioi(n_pairs: int, n: int, rng: random.Random) -> list[Sample]:
    # Group = the unordered name pair: a held-out group's two names never appear together in training.
    groups, out = _Groups(), []
    for pair_id in range(n_pairs):
        a, b = rng.sample(NAMES, 2)
        template = rng.choice(IOI_TEMPLATES)
        gid = groups(tuple(sorted((a, b))))
        head = "".join(rng.choice(IOI_FILLERS) + " " for _ in range(n))
        before, after = template.split("{S}")
        before = head + before.format(A=a, B=b)
        for s, io in ((b, a), (a, b)):
            out.append(Sample("ioi", before + s + after, NAMES.index(io), pair_id, gid, n, key_char=len(before)))
    return out


def _lookup(n_pairs: int, n: int, rng: random.Random) -> list[Sample]:
    groups, out = _Groups(), []
    for pair_id in range(n_pairs):
        keys = rng.sample(KEYS, n)
        while True:
            values = [rng.randrange(10) for _ in keys]
            order = rng.sample(range(n), LOOKUP_SHOTS + 2)
            q0, q1 = order[-2:]
            if values[q0] != values[q1]:
                break
        table = "".join(f"{k}: {v}\n" for k, v in zip(keys, values))
        shots = "".join(f"{keys[q]}: {values[q]}\n" for q in order[:LOOKUP_SHOTS])
        head = table + "\n" + shots
        gid = groups((head, tuple(sorted((q0, q1)))))
        for q in (q0, q1):
            out.append(Sample("lookup", f"{head}{keys[q]}: ", values[q], pair_id, gid, n, key_char=len(head)))
    return out


def _binding_block(rng: random.Random, n: int, hops: int, roots: int = 2):
    """Lines of one block, the index of the first hop line, the roots' values and names."""
    names = rng.sample(VARIABLES, roots + n + hops)
    values = [rng.randrange(10) for _ in range(roots + n)]
    while len(set(values[:roots])) < roots:  # the roots differ, so a hop's target decides the answer
        values[:roots] = [rng.randrange(10) for _ in range(roots)]
    body = [f"{v} = {x}" for v, x in zip(names[:roots + n], values)]
    rng.shuffle(body)
    chain = names[roots + n:]
    return body, chain, names[:roots], values[:roots]


def _binding(n_pairs: int, n: int, rng: random.Random) -> list[Sample]:
    groups, out = _Groups(), []
    for pair_id in range(n_pairs):
        hops = BINDING_HOPS[pair_id % len(BINDING_HOPS)]
        shots = []
        for _ in range(BINDING_SHOTS):  # solved examples: hop from a random assigned variable
            body, chain, roots, vals = _binding_block(rng, n, hops)
            names = [line.split(" = ")[0] for line in body]
            src = rng.choice(names)
            answer = dict(line.split(" = ") for line in body)[src]
            lines = [*body]
            for c in chain:
                lines.append(f"{c} = {src}")
                src = c
            shots.append("\n".join([*lines, f"print({chain[-1]})", f"# {answer}"]))
        body, chain, roots, vals = _binding_block(rng, n, hops)
        head = "\n\n".join(shots) + "\n\n" + "\n".join(body) + f"\n{chain[0]} = "
        tail = "".join(f"\n{c} = {p}" for p, c in zip(chain, chain[1:])) + f"\nprint({chain[-1]})\n# "
        gid = groups((head, tail))
        for root, value in zip(roots, vals):
            out.append(Sample("binding", head + root + tail, value, pair_id, gid, n, key_char=len(head)))
    return out


GENERATORS = {"induction": _induction, "ioi": _ioi, "lookup": _lookup, "binding": _binding}
