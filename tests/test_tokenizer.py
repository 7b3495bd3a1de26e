"""Tests for the task tokenizer and tokenize_samples."""
from __future__ import annotations

import dataclasses
import re

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from common.errors import UserError
from tasks import TASKS, build_tokenizer, make_dataset, tokenize_samples


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_special_tokens(tok):
    assert tok.pad_token == "[PAD]" and tok.pad_token_id == 0
    assert tok.unk_token == "[UNK]"
    assert tok("get A\nvalue:", add_special_tokens=True)["input_ids"] == tok(
        "get A\nvalue:", add_special_tokens=False)["input_ids"]  # no BOS/EOS


def test_keeps_newlines_and_operators(tok):
    ids = tok("scratch += 0\nscratch ^= 1\n# final state:", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == [
        "scratch", "+=", "0", "\n", "scratch", "^=", "1", "\n", "#", "final", "state", ":"]


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("n", (0, 8))
def test_no_unk_same_final_token_and_decode(tok, task, n):
    ds = make_dataset(task, 6, n, seed=2)
    ids, out = tokenize_samples(ds, tok)
    colon = tok.convert_tokens_to_ids(":")
    assert all(row[-1] == colon for row in ids)
    assert [s.n_tokens for s in out] == [len(r) for r in ids]
    assert [dataclasses.replace(s, n_tokens=None) for s in out] == ds
    for s, row in zip(ds, ids):
        assert tok.unk_token_id not in row
        assert tok.decode(row) == s.text
        full = tok(s.full_text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in full and full[:-1] == row


def test_save_load_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    texts = [s.full_text for t in TASKS for s in make_dataset(t, 2, 8, seed=0)]
    want = tok(texts, add_special_tokens=False)["input_ids"]
    for loaded in (AutoTokenizer.from_pretrained(tmp_path), PreTrainedTokenizerFast.from_pretrained(tmp_path)):
        assert loaded(texts, add_special_tokens=False)["input_ids"] == want
        assert loaded.get_vocab() == tok.get_vocab()
        assert loaded.pad_token_id == 0


def test_empty_dataset(tok):
    with pytest.raises(UserError, match="empty dataset"):
        tokenize_samples([], tok)


def test_mismatched_ending_is_reported(tok):
    ds = make_dataset("memory", 3, 2, seed=0)
    bad = dataclasses.replace(ds[3], text=ds[3].text + " ONE")
    with pytest.raises(UserError) as info:
        tokenize_samples(ds[:3] + [bad] + ds[4:], tok)
    msg = str(info.value)
    assert "'ONE'" in msg and "expected final token ':'" in msg
    assert type(tok).__name__ in msg  # names the tokenizer (no name_or_path for a freshly built one)
    assert "\n" not in msg  # one line: decoded newlines appear escaped by repr


def test_mismatched_ending_names_loaded_tokenizer(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    ds = make_dataset("completion", 2, 0, seed=0)
    bad = dataclasses.replace(ds[0], text=ds[0].text + "\n")
    with pytest.raises(UserError, match=re.escape(str(tmp_path))):
        tokenize_samples([bad] + ds[1:], loaded)
