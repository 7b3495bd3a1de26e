"""The natural-language tasks of issue 39 (tasks.language): pinned fingerprints, the pair contract (exactly one
token differs, and it changes the answer) under the language word-level tokenizer and SmolLM2's, the one-line
refusal under the shipped checkpoints' tokenizer, label ids, key tokens and the answer each prompt implies."""
from __future__ import annotations

import re

import pytest

from common.errors import UserError
from tasks import (LABEL_WORDS, LANGUAGE_TASKS, build_tokenizer, dataset_fingerprint, key_token_positions,
                   label_token_ids, make_dataset, resolve_task, tokenize_samples)
from tasks.language import LANGUAGE_DISTRACTORS, LANGUAGE_N_RANGE
from tasks.words import ANSWER_SEP

# make_dataset(task, 8, N, seed=0): a change of any generator's output must be deliberate (bump FORMAT_VERSION).
PINNED = {
    ("induction", 8): "246324b2f7a23f35822ddd12132293cba146b79240f2720a2a4201e4665be301",
    ("ioi", 2): "b086913bb55ddd64933be8a6970cf58e629a3edb1bff46b8e7a5db6d09b65779",
    ("lookup", 8): "ffd6848e7497011f2a82a890720c3ab6e7390d4baed5120e04688fd449bf5ba8",
    ("binding", 2): "fd2b42e2b25e61006d34f80cb6ca84b9763b74c6128ffe17a719dc522d570fa4",
}


@pytest.mark.parametrize("task,n", sorted(PINNED))
def test_fingerprints_pinned(task, n):
    assert dataset_fingerprint(make_dataset(task, 8, n, seed=0)) == PINNED[(task, n)]
    assert dataset_fingerprint(make_dataset(task, 8, n, seed=1)) != PINNED[(task, n)]


def _answer(s) -> str:
    """The answer each prompt implies, computed from the text alone (an independent reading of the generator)."""
    t = s.text
    if s.task == "induction":
        first, second = t.split(". ")
        words, cue = first.split(", "), second.rstrip(",").split(", ")
        assert words[:len(cue)] == cue  # the repeat is the span's start
        return words[len(cue)]
    if s.task == "ioi":
        a, b = re.search(r"(\w+) and (\w+) ", t).groups()
        subject = re.findall(r"\b(" + "|".join(map(re.escape, (a, b))) + r")\b", t)[-1]
        return b if subject == a else a
    if s.task == "lookup":
        table, queries = t.split("\n\n")
        values = dict(line.split(": ") for line in table.splitlines())
        for line in queries.splitlines()[:-1]:  # the shots agree with the table
            k, v = line.split(": ")
            assert values[k] == v
        return values[queries.splitlines()[-1].rstrip(": ")]
    if s.task == "binding":
        block = t.split("\n\n")[-1]
        env = {}
        for line in block.splitlines():
            if " = " in line:
                k, v = line.split(" = ")
                env[k] = env[v] if v in env else v
        var = re.search(r"print\((\w)\)", block).group(1)
        return env[var]
    raise AssertionError(s.task)


@pytest.mark.parametrize("task", LANGUAGE_TASKS)
def test_pairs_one_word_apart_and_labels_follow_the_text(task):
    for n in LANGUAGE_DISTRACTORS[task]:
        ds = make_dataset(task, 30, n, seed=3)
        assert len(ds) == 60
        for a, b in zip(ds[::2], ds[1::2]):
            assert a.pair_id == b.pair_id and a.group_id == b.group_id and a.label != b.label
            wa, wb = a.text.split(" "), b.text.split(" ")
            assert len(wa) == len(wb) and sum(x != y for x, y in zip(wa, wb)) == 1, (task, n)
            assert a.text.endswith(b.text[-2:])  # one shared ending
        for s in ds:
            assert s.answer == LABEL_WORDS[task][s.label] == _answer(s), (task, n, s.text)
            assert s.full_text == s.text + ANSWER_SEP.get(task, " ") + s.answer
            assert 0 <= s.key_char < len(s.text) and not s.text[s.key_char].isspace()


@pytest.mark.parametrize("task", LANGUAGE_TASKS)
def test_n_out_of_range_refused_in_one_line(task):
    lo, hi = LANGUAGE_N_RANGE[task]
    for n in (lo - 1, hi + 1):
        if n < 0:
            continue
        with pytest.raises(UserError, match=f"{lo}..{hi}"):
            make_dataset(task, 2, n)
    make_dataset(task, 2, hi)  # the bounds themselves work
    assert resolve_task(task).min_distractors == lo


def _check_one_token_pairs(task, tok):
    for n in LANGUAGE_DISTRACTORS[task]:
        ids, ds = tokenize_samples(make_dataset(task, 20, n, seed=5), tok)
        keys = key_token_positions(ds, tok)
        for i in range(0, len(ds), 2):
            a, b = ids[i], ids[i + 1]
            assert len(a) == len(b)
            diff = [j for j in range(len(a)) if a[j] != b[j]]
            assert len(diff) == 1
            if task != "induction":  # the pair differs in the key word itself (induction: in the answer's
                assert keys[i] == keys[i + 1] == diff[0]  # first occurrence; its key is the repeated cue)
        for s, row, k in zip(ds, ids, keys):
            word = s.text[s.key_char:].split()[0].rstrip(",:()")
            assert tok.decode([row[k]]).strip().rstrip(",:()") == word
        assert len({row[-1] for row in ids}) == 1  # one final token
    lab = label_token_ids(tok, task)
    assert len(lab) == len(set(lab)) == len(LABEL_WORDS[task])


@pytest.mark.parametrize("task", LANGUAGE_TASKS)
def test_one_token_pairs_under_the_language_word_tokenizer(task):
    _check_one_token_pairs(task, build_tokenizer(language=True))


@pytest.mark.parametrize("task", LANGUAGE_TASKS)
def test_shipped_task_tokenizer_refuses_in_one_line(task):
    with pytest.raises(UserError, match="does not know every word") as e:
        tokenize_samples(make_dataset(task, 2, LANGUAGE_DISTRACTORS[task][0]), build_tokenizer())
    assert "\n" not in str(e.value)


def test_default_vocabulary_unchanged():
    # the shipped checkpoints' vocabulary: the language words are appended only when asked
    base, lang = build_tokenizer().get_vocab(), build_tokenizer(language=True).get_vocab()
    assert len(base) == 45 and all(lang[w] == i for w, i in base.items()) and len(lang) > len(base)  # 45: + cycle (s5 / a5)


def test_a_tokenizer_that_splits_the_contrast_is_refused():
    class Splitting:  # a tokenizer that splits one name in two tokens (its decode gives the text back)
        name_or_path = "splitting"
        unk_token_id = None

        def __init__(self):
            self.vocab, self.texts = build_tokenizer(language=True).get_vocab(), {}

        def _ids(self, text):
            out = []
            for w in re.findall(r"\w+|[^\w\s]+|\n", text):
                out += [self.vocab["Mary"], self.vocab["."]] if w == "Mary" else [self.vocab[w]]
            self.texts[tuple(out)] = text
            return out

        def __call__(self, texts, add_special_tokens=False):
            one = isinstance(texts, str)
            rows = [self._ids(t) for t in ([texts] if one else texts)]
            return {"input_ids": rows[0] if one else rows}

        def batch_decode(self, rows, **kw):
            return [self.texts[tuple(r)] for r in rows]

        def decode(self, row, **kw):
            return self.texts.get(tuple(row), "")

    ds = [s for s in make_dataset("ioi", 200, 0, seed=0) if "Mary" in s.text]
    pair = [s for s in make_dataset("ioi", 200, 0, seed=0) if s.pair_id == ds[0].pair_id]
    with pytest.raises(UserError, match="differ in more than one token"):
        tokenize_samples(pair, Splitting())


@pytest.mark.parametrize("task", LANGUAGE_TASKS)
def test_one_token_pairs_under_smollm2s_tokenizer(task, smollm2):
    _check_one_token_pairs(task, smollm2[1])


def test_synthetic_tasks_have_no_key_token():
    with pytest.raises(UserError, match="no key token"):
        key_token_positions(make_dataset("memory", 1, 0), build_tokenizer())


def test_pair_roles():
    from tasks import pair_roles

    ds = make_dataset("ioi", 5, 0, seed=2)
    roles = pair_roles(ds)
    assert roles == [0, 1] * 5
    # ioi's role is a task variable: role 0 answers the first-named person
    for s, r in zip(ds, roles):
        first = re.search(r"(\w+) and (\w+) ", s.text).group(1)
        assert (s.answer == first) == (r == 0)
    assert pair_roles(list(reversed(ds))) == [0, 1] * 5  # by dataset order, whatever the member


def test_probe_labels_choose_the_answer_or_the_pair_role():
    from tasks import pair_roles, probe_labels
    from tasks.samples import ANSWER_PROBE_LABEL, ROLE_PROBE_LABEL

    ds = make_dataset("memory", 20, 8, seed=0)  # binary, enough groups: the labels themselves
    assert probe_labels(ds, 5) == ([s.label for s in ds], ANSWER_PROBE_LABEL)
    ioi = make_dataset("ioi", 48, 0, seed=0)  # 40 names: too few groups per name, so the pair role
    assert probe_labels(ioi, 5) == (pair_roles(ioi), ROLE_PROBE_LABEL)
    with pytest.raises(UserError, match="too few groups"):
        probe_labels(make_dataset("ioi", 3, 0, seed=0), 5)  # too few pairs for either
    with pytest.raises(UserError, match="too few groups"):
        probe_labels(make_dataset("memory", 2, 8, seed=0), 5)  # a binary task is never relabelled
