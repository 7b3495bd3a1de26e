"""Prompts start as the model's tokenizer starts a text (tasks.prompt_prefix): a Llama's or Gemma's BOS, nothing for
the task tokenizer, SmolLM2 or GPT-2. Held to the tokenizer's own default call, ``tokenizer(text)``, and, end to end,
to HF's ``output_hidden_states`` of a tiny random Llama saved with a tokenizer that adds a BOS (no download)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tasks import (build_tokenizer, key_token_positions, make_dataset, prompt_ids, prompt_prefix,
                   prompt_prefix_tokens, tokenize_samples)


def bos_tokenizer(language: bool = False, eos: bool = False, bos: bool = True):
    """The task tokenizer with <s> / </s> and a post-processor that puts <s> before a text (as a Llama's
    tokenizer.json does), optionally </s> after it."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend = build_tokenizer(language).backend_tokenizer
    backend.add_special_tokens(["<s>", "</s>"])
    b, e = backend.token_to_id("<s>"), backend.token_to_id("</s>")
    single = " ".join((["<s>"] if bos else []) + ["$A"] + (["</s>"] if eos else []))
    backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<s>", b), ("</s>", e)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="[PAD]",
                                   unk_token="[UNK]")


def test_prefix_is_what_the_tokenizer_puts_before_a_text():
    tok = bos_tokenizer()
    bos = tok.convert_tokens_to_ids("<s>")
    assert prompt_prefix(tok) == [bos] and prompt_prefix_tokens(tok) == ["<s>"]
    assert prompt_prefix(bos_tokenizer(eos=True)) == [bos]  # an EOS after the text is not taken: a prompt goes on
    assert prompt_prefix(bos_tokenizer(bos=False, eos=True)) == []
    assert prompt_prefix(build_tokenizer()) == [] and prompt_prefix_tokens(build_tokenizer()) == []
    assert prompt_ids(tok, "0 : x") == tok("0 : x")["input_ids"]


@pytest.mark.parametrize("task", ["memory", "parity", "ioi"])
def test_tokenized_prompts_equal_the_tokenizers_default_call(task):
    tok = bos_tokenizer(language=task == "ioi")
    samples = make_dataset(task, 4, 3 if task != "ioi" else 2, seed=1)
    ids, out = tokenize_samples(samples, tok)
    assert ids == [tok(s.text)["input_ids"] for s in samples]
    assert all(row[0] == tok.bos_token_id for row in ids) and [s.n_tokens for s in out] == list(map(len, ids))
    # the same texts under the task tokenizer: no prefix, the rest the same tokens
    plain, _ = tokenize_samples(samples, build_tokenizer(language=task == "ioi"))
    assert [row[1:] for row in ids] == plain


def test_key_tokens_count_the_prefix():
    tok = bos_tokenizer(language=True)
    samples = make_dataset("ioi", 6, 2, seed=3)
    ids, _ = tokenize_samples(samples, tok)
    for s, row, k in zip(samples, ids, key_token_positions(samples, tok)):
        word = s.text[s.key_char:].split()[0].strip(",.")
        assert tok.convert_ids_to_tokens(row[k]) == word


@pytest.fixture(scope="module")
def llama_bos_dir(tmp_path_factory):
    """A tiny random Llama saved with the BOS tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.full_bandwidth import save_tokenizer

    tok = bos_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok.get_vocab()), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2, bos_token_id=tok.bos_token_id, eos_token_id=None, pad_token_id=None)
    path = tmp_path_factory.mktemp("llama_bos")
    LlamaForCausalLM(cfg).eval().save_pretrained(str(path))
    save_tokenizer(tok, path)
    return path


def test_probes_read_what_hf_computes_on_the_tokenizers_ids(llama_bos_dir, tmp_path):
    """Every saved activation (depth l, the prompt's last position) equals HF's hidden state of the model run on
    tokenizer(text), the BOS included; without it they differ (the check can fail)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from probes.run import main

    out = tmp_path / "p"
    assert main(["--model", str(llama_bos_dir), "--task", "completion", "--modes", "standard", "--distractors", "2",
                 "--n-pairs", "40", "--out", str(out), "--save-activations", "--no-cache", "--no-progress"]) == 0
    doc = json.loads((out / "probes.json").read_text())
    assert doc["meta"]["prompt_prefix"] == ["<s>"] and doc["meta"]["run"]["tokenizer"].endswith("+prefix[45]")
    act = np.load(next((out / "activations").glob("N2_standard*.npz")))
    resid, n_tokens = act["resid"], act["n_tokens"]
    hf, tok = AutoModelForCausalLM.from_pretrained(str(llama_bos_dir)).eval(), AutoTokenizer.from_pretrained(
        str(llama_bos_dir))
    samples = make_dataset("completion", 40, 2, seed=doc["meta"]["seed"])
    with torch.no_grad():
        for i, s in enumerate(samples):
            ids = torch.tensor([tok(s.text)["input_ids"]])  # [1, T], <s> first
            assert ids[0, 0] == tok.bos_token_id and n_tokens[i] == ids.shape[1]
            hs = hf(ids, output_hidden_states=True).hidden_states
            for depth in (0, 1):  # the embedding, block 0's output
                np.testing.assert_allclose(resid[i, depth], hs[depth][0, -1].numpy(), rtol=1e-5, atol=1e-5)
            bare = hf(ids[:, 1:], output_hidden_states=True).hidden_states[1][0, -1].numpy()
            assert np.abs(bare - resid[i, 1]).max() > 1e-3


def test_causal_report_records_the_prefix(llama_bos_dir, tmp_path):
    from interventions.run import main

    out = tmp_path / "i"
    assert main(["--model", str(llama_bos_dir), "--mode", "standard", "--task", "parity", "--n-pairs", "10",
                 "--distractors", "3", "--max-positions", "0", "--out", str(out), "--no-progress"]) == 0
    rep = json.loads((out / "causal_report.json").read_text())
    assert rep["config"]["prompt_prefix"] == ["<s>"]
    assert rep["dataset"]["tokens_min"] == len(build_tokenizer()(make_dataset("parity", 1, 3, seed=0)[0].text)[
        "input_ids"]) + 1


def test_a_text_that_writes_the_prefix_out_gets_it_once():
    """A task file written for the old no-BOS prompts ("<s> ..." in its texts) is not given a second BOS."""
    import dataclasses

    tok = bos_tokenizer()
    samples = make_dataset("memory", 4, 3, seed=2)
    ids, _ = tokenize_samples(samples, tok)
    written = [dataclasses.replace(s, text="<s> " + s.text) for s in samples]
    assert tokenize_samples(written, tok)[0] == ids
    assert prompt_ids(tok, written[0].text) == ids[0] == prompt_ids(tok, samples[0].text)


@pytest.mark.parametrize("preset", ["tiny-fbt", "tiny-fbt-track"])
def test_training_rows_read_samples_as_analysis_does(preset):
    """training.train --base on a BOS tokenizer: every sample of a training row starts with the BOS, as every analysis
    command reads its prompts, once, and the targets stay on the answer (the row's last real token, predicted at the
    column before it); the task tokenizer's rows hold no BOS."""
    from training.data import make_batches
    from training.presets import get_preset

    cfg = get_preset(preset)
    tok, plain = bos_tokenizer(), build_tokenizer()
    bos, newline = tok.bos_token_id, plain("\n", add_special_tokens=False)["input_ids"][0]
    for b in make_batches(cfg, tok, 3):
        for r in range(b.ids.shape[0]):
            row = b.ids[r].tolist()
            if cfg.packing:  # a stream of samples, each "<s> text answer\n"
                at = [j for j, t in enumerate(row) if t == bos]
                assert at[0] == 0 and all(row[j - 1] == newline for j in at[1:])  # after every sample's newline
                assert len(at) - int(b.label_pos[r].sum()) in (0, 1)  # one per sample (the last may lose its answer)
            else:  # one sample per row, right-padded
                n = int((b.ids[r] != tok.pad_token_id).sum())
                assert row[0] == bos and row.count(bos) == 1 and bool(b.label_pos[r, n - 1])
                if b.dense is not None:
                    assert b.dense[r, n - 2] == row[n - 1]  # the prompt's last token predicts the answer
    assert all(bos not in b.ids.tolist() for b in make_batches(cfg, plain, 3))


def test_prefix_of_a_tokenizer_that_cannot_spell_the_probe_texts_or_does_not_name_its_bos(tmp_path):
    """A word-level tokenizer without an unk token raises on words it does not know ("a b"): the prefix is read off
    texts it can spell. A tokenizer.json alone whose template puts <s> first loads with no named BOS
    (all_special_ids empty): its special-tokens mask still marks it."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from models.tokenizers import load_tokenizer_dir
    from tasks.tokenizer import _SPLIT_PATTERN, _vocab

    vocab = {w: i for i, w in enumerate(w for w in _vocab() if w != "[UNK]")}
    vocab["<s>"] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab))  # no unk token
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="removed", invert=True)
    backend.add_special_tokens(["<s>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", pad_token="[PAD]")
    with pytest.raises(Exception):
        tok("a b")
    samples = make_dataset("memory", 2, 2, seed=0)
    assert prompt_prefix(tok) == [vocab["<s>"]]
    assert tokenize_samples(samples, tok)[0] == [tok(s.text)["input_ids"] for s in samples]

    backend.save(str(tmp_path / "tokenizer.json"))  # no tokenizer_config.json: <s> is named nowhere
    unnamed = load_tokenizer_dir(tmp_path)
    assert unnamed.bos_token is None and vocab["<s>"] not in unnamed.all_special_ids
    assert prompt_prefix(unnamed) == [vocab["<s>"]] == unnamed(samples[0].text)["input_ids"][:1]
