"""Odd but legal model folders (the loading review of 2026-12-07): each loads as the model its files hold, or is
refused in one line; never a model other than the one saved."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
IDS = torch.tensor([[1, 2, 3, 4, 5]])


def _llama(vocab, **kw):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, initializer_range=0.2, **kw)


def _hf_folder(path: Path, config, tok=None, seed=0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    if tok is not None:
        tok.save_pretrained(path)
    return path


def _edit(path: Path, edit) -> None:
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


def test_a_config_that_says_tied_over_two_tensors_loads_as_hf_and_saves_as_it_is(tmp_path):
    """HF keeps both tensors of such a folder (and warns); saving that model wrote tie_word_embeddings true beside
    two tensors, and loading it back put the head over the input embedding (5.86 logits off)."""
    from transformers import AutoModelForCausalLM

    from common.errors import UserError
    from models.loading import load_model
    from tasks import build_tokenizer

    tok = build_tokenizer()
    src = _hf_folder(tmp_path / "a", _llama(len(tok), tie_word_embeddings=False), tok)
    _edit(src / "config.json", lambda c: c.update(tie_word_embeddings=True))
    want = AutoModelForCausalLM.from_pretrained(src).eval()(IDS).logits
    model, t, _ = load_model(str(src))
    assert torch.allclose(model.lm(IDS).logits, want, atol=1e-5)
    model.save_pretrained(tmp_path / "b", tokenizer=t)
    saved = json.loads((tmp_path / "b" / "config.json").read_text())
    assert saved["base_config"]["tie_word_embeddings"] is False  # what the weights are
    again, _, _ = load_model(str(tmp_path / "b"))
    assert torch.allclose(again.lm(IDS).logits, want, atol=1e-5)
    _edit(tmp_path / "b" / "config.json", lambda c: c["base_config"].update(tie_word_embeddings=True))
    with pytest.raises(UserError, match="ties .* and the file holds different tensors for them"):
        load_model(str(tmp_path / "b"))


def test_a_checkpoint_config_in_bfloat16_does_not_round_its_float32_weights(tmp_path):
    from models.full_bandwidth import FullBandwidthLM
    from models.loading import load_model
    from tasks import build_tokenizer

    tok = build_tokenizer()
    src = FullBandwidthLM.from_config(_llama(len(tok)), seed=0).eval()
    src.save_pretrained(tmp_path / "c", tokenizer=tok)
    _edit(tmp_path / "c" / "config.json", lambda c: c["base_config"].update(dtype="bfloat16"))
    model, _, _ = load_model(str(tmp_path / "c"))
    assert next(model.parameters()).dtype == torch.float32
    for (name, a), b in zip(src.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name  # not 2e-3 off (bfloat16 rounding)


def test_weights_with_no_place_in_the_config_are_refused_but_old_saved_buffers_load(tmp_path):
    """A config of fewer layers than the file ran as the smaller model, HF's multi-line table the only sign."""
    from safetensors.torch import load_file, save_file

    from common.errors import UserError
    from models.configs import gpt2_config
    from models.loading import load_model
    from tasks import build_tokenizer

    tok = build_tokenizer()
    src = _hf_folder(tmp_path / "l", _llama(len(tok)), tok)
    _edit(src / "config.json", lambda c: c.update(num_hidden_layers=1))
    with pytest.raises(UserError, match=r"9 weights in its files have no place .* first model\.layers\.1\."):
        load_model(str(src))
    # GPT-2 folders of older transformers saved their causal-mask buffers: those load as before
    g = _hf_folder(tmp_path / "g", gpt2_config(len(tok), n_layers=1, d_model=16), tok)
    sd = load_file(g / "model.safetensors")
    sd["transformer.h.0.attn.bias"] = torch.ones(1, 1, 8, 8)
    sd["transformer.h.0.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(sd, g / "model.safetensors", metadata={"format": "pt"})
    model, _, _ = load_model(str(g))
    assert model.n_layers == 1


def test_a_plain_config_that_mentions_the_format_is_still_a_plain_model(tmp_path):
    from models.loading import load_model
    from tasks import build_tokenizer

    tok = build_tokenizer()
    src = _hf_folder(tmp_path / "n", _llama(len(tok)), tok)
    _edit(src / "config.json", lambda c: c.update(note="full-bandwidth-lm"))
    model, _, _ = load_model(str(src))
    assert not model.has_fusion


def test_a_run_resumed_under_another_tokenizer_is_refused(tmp_path):
    from common.errors import UserError
    from models.full_bandwidth import FullBandwidthLM
    from tasks import build_tokenizer
    from training.checkpoint import load_resume

    tok = build_tokenizer()
    model = FullBandwidthLM.from_config(_llama(len(tok)), seed=0)
    model.save_pretrained(tmp_path / "r", tokenizer=tok)
    (tmp_path / "r" / "trainer_state.safetensors").write_bytes(b"")  # a run's folder (its state is read later)

    class Swapped:  # the same ids but "0" and "1" exchanged: another --base of the same shape
        def get_vocab(self):
            v = dict(tok.get_vocab())
            v["0"], v["1"] = v["1"], v["0"]
            return v

    with pytest.raises(UserError, match="another tokenizer"):
        load_resume(model, None, None, tmp_path / "r", Swapped())  # the same architecture, other ids


def test_the_scripts_refuse_a_model_without_a_tokenizer_in_one_line(tmp_path):
    from tasks import build_tokenizer

    src = _hf_folder(tmp_path / "nt", _llama(len(build_tokenizer())))  # no tokenizer saved
    r = subprocess.run([sys.executable, "scripts/argmax_counts.py", str(src), "parity", "4"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                                                                         "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().startswith("error: ") and "has no tokenizer of its own" in r.stderr


def test_the_smollm2_conversion_starts_over_on_force_or_another_gguf_file(tmp_path, monkeypatch):
    """`--force` did nothing and a stamp of another GGUF file kept the old weights: conversion skipped every file
    that existed. It now resumes only an interrupted conversion of the same file."""
    import transformers

    import models.smollm2 as sm

    gguf = tmp_path / "pkg" / sm.GGUF_FILE
    gguf.parent.mkdir()
    gguf.write_bytes(b"v1")
    monkeypatch.setenv("FBPROBE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sm, "gguf_path", lambda: gguf)
    monkeypatch.setattr(sm, "_check_converters", lambda: None)
    made = []

    class Fake:
        hf_quantizer, config = None, type("C", (), {})()

        def save_pretrained(self, out):
            made.append("model")
            (Path(out) / "model.safetensors").write_text(gguf.read_text())

    class FakeTok:
        def save_pretrained(self, out):
            made.append("tok")
            (Path(out) / "tokenizer.json").write_text(gguf.read_text())

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Fake())
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: FakeTok())
    out = sm.convert()
    assert made == ["model", "tok"] and (out / "model.safetensors").read_text() == "v1"
    assert sm.convert() == out and made == ["model", "tok"]  # stamp matches: nothing done
    sm.convert(force=True)
    assert made == ["model", "tok"] * 2
    gguf.write_bytes(b"v2-upgraded")  # another GGUF file (size, mtime): the old weights must go
    sm.convert()
    assert (out / "model.safetensors").read_text() == "v2-upgraded" and made == ["model", "tok"] * 3
    assert not (out / "converting_from.json").exists()
