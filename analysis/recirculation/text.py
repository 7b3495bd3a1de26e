"""The study's text: documents, a tuning / held-out split of fixed-length chunks, a byte tokenizer for the
random smoke-test models."""
from __future__ import annotations

import random
from pathlib import Path

import torch

from common.errors import UserError


def builtin_documents() -> list[tuple[str, str]]:
    """(name, text) documents that exist offline on any machine with CPython: the pydoc topics."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - stripped Python builds
        topics = {}
    docs = [(f"pydoc:{k}", v) for k, v in sorted(topics.items()) if len(v) > 400]
    if not docs:
        raise UserError("no built-in English text found (pydoc_data.topics is missing): pass --text FILE...")
    return docs


def file_documents(paths: list[str]) -> list[tuple[str, str]]:
    docs = []
    for p in paths:
        f = Path(p)
        if not f.is_file():
            raise UserError(f"--text: {p} is a folder, not a text file" if f.is_dir() else f"--text: no such file {p}")
        text = f.read_text(errors="replace")
        if not text.strip():
            raise UserError(f"--text: {p} is empty")
        twin = next((name for name, t in docs if t == text), None)
        if twin is not None:  # one text in both splits: the held-out perplexity would score tuned-on text
            raise UserError(f"--text: {p} holds the same text as {twin}; give each text once")
        docs.append((str(f), text))
    return docs


def make_splits(docs, tokenizer, seq_len: int, n_tune: int, n_test: int, seed: int = 0):
    """Chunks of seq_len token ids: ([tune chunks], [held-out chunks]), from disjoint documents when possible."""
    rng = random.Random(seed)
    order = list(range(len(docs)))
    rng.shuffle(order)
    halves: list[list[tuple[list[int], bool]]] = [[], []]  # (chunk, its document holds ids it could not spell)
    unk, unk_text = getattr(tokenizer, "unk_token_id", None), getattr(tokenizer, "unk_token", None)
    for i, di in enumerate(order):
        text = docs[di][1]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        # an unk id the text does not write out is a word the tokenizer could not spell; a written-out unk token
        # (SmolLM2's is <|endoftext|>, a document separator) is text it spelled
        unspelled = unk is not None and ids.count(unk) > (text.count(unk_text) if unk_text else 0)
        chunks = [(ids[j:j + seq_len], unspelled) for j in range(0, len(ids) - seq_len + 1, seq_len)]
        if len(docs) == 1:  # one file: first half of its chunks tunes, the second half is held out
            h = len(chunks) // 2
            halves[0] += chunks[:h]
            halves[1] += chunks[h:]
        else:
            halves[i % 2] += chunks
    for h in halves:
        rng.shuffle(h)
    tune = halves[0][:n_tune]
    # two documents of one text (the pydoc topics `if` and `else`) can fall into both halves: a held-out chunk
    # identical to a tuning chunk would score tuned-on text, so it is skipped
    tuned = {tuple(c) for c, _ in tune}
    test = [c for c in halves[1] if tuple(c[0]) not in tuned][:n_test]
    n_unk = sum(c.count(unk) for c, unspelled in tune + test if unspelled)
    if n_unk:  # a perplexity of text the model cannot read measures nothing (the task words' tokenizer on pydoc
        # text: 85% [UNK], perplexity 1.8e7); only the chunks measured count
        total = sum(len(c) for c, _ in tune + test)
        raise UserError(f"the text has {n_unk} of {total} tokens the tokenizer cannot spell ({unk_text}): pass "
                        "--text in the model's own words (a model with the task tokenizer knows only the tasks' words)")
    tune, test = [c for c, _ in tune], [c for c, _ in test]
    if len(tune) < n_tune or len(test) < n_test:
        raise UserError(f"not enough text for {n_tune} + {n_test} chunks of {seq_len} tokens "
                        f"(got {len(tune)} + {len(test)}): pass more --text or lower --seq-len / --n-tune / --n-test")
    return torch.tensor(tune), torch.tensor(test)


class ByteTokenizer:
    """Stand-in tokenizer for the random smoke-test models: bytes folded into the model's vocabulary."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [2 + b % (self.vocab - 2) for b in text.encode()]}


