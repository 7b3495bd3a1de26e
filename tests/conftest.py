"""Shared test fixtures: tiny float32, eval-mode models of each supported base-model family.

`tiny_config` is parametrized over a Qwen3-style and a GPT-2-style config (2 layers, d_model 32, vocab 50);
`tiny_model` is a FullBandwidthLM built from it with seed 0;
`make_tiny_config(family, **overrides)` builds a variant; `tiny_ckpt` is a saved 2-layer Qwen3-style checkpoint
with the task tokenizer (module scope), for CLI tests. Only tests that request them are parametrized.
"""
from __future__ import annotations

import pytest
import torch

TINY_VOCAB = 50


def tiny_config_for(family: str, **kw):
    from models.configs import gpt2_config, qwen3_config

    # A larger init than HF's 0.02 keeps activations O(1), so the comparisons below are sensitive.
    kw.setdefault("initializer_range", 0.1)
    build = {"qwen3": qwen3_config, "gpt2": gpt2_config}[family]
    return build(TINY_VOCAB, n_layers=2, d_model=32, **kw)


@pytest.fixture
def make_tiny_config():
    """`make_tiny_config(family, **overrides)` for tests that need a variant (e.g. a short context)."""
    return tiny_config_for


@pytest.fixture(params=["qwen3", "gpt2"])
def tiny_config(request):
    return tiny_config_for(request.param)


@pytest.fixture
def tiny_model(tiny_config):
    from models.full_bandwidth import FullBandwidthLM

    return FullBandwidthLM.from_config(tiny_config, seed=0).eval().float()


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from models.configs import qwen3_config
    from models.full_bandwidth import FullBandwidthLM
    from tasks import build_tokenizer

    tok = build_tokenizer()
    model = FullBandwidthLM.from_config(qwen3_config(len(tok), n_layers=2, d_model=32, n_heads=2, n_kv_heads=1,
                                                     initializer_range=0.1), seed=0).eval()
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    model.save_pretrained(path, tokenizer=tok)
    return path
