"""The looped family (models.looped): the unrolled forward against a hand-written loop, r = 1 without injection
against the plain stack, per-iteration recordings, an identity patch of a loop state, the KV-cache slots, the
checkpoint round trip and truncated backpropagation."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from common.errors import UserError
from engine.hooks import ResidualRecorder
from models.configs import qwen3_config
from models.full_bandwidth import FullBandwidthLM
from models.looped import LoopedLM, LoopSpec, looping

V = 40


def make(spec=LoopSpec(1, 2, 1, 3), window=None, seed=0) -> LoopedLM:
    torch.manual_seed(seed)
    cfg = qwen3_config(V, n_layers=spec.n_blocks, d_model=32, n_heads=2, n_kv_heads=1, attn_window=window)
    model = LoopedLM(AutoModelForCausalLM.from_config(cfg), spec).eval()
    if model.adapter is not None:  # an adapter that is not the mean (the init): the injection must matter
        with torch.no_grad():
            model.adapter.weight.add_(0.2 * torch.randn_like(model.adapter.weight))
    return model


def ids_of(B=3, T=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (B, T), generator=g)
    return ids, torch.ones_like(ids)


def hand_loop(model: LoopedLM, ids, r: int):
    """The loop written out: prelude, r iterations of the core with Huginn's injection (s_0 = e), coda; full causal
    attention, no padding. Returns (logits [B, T, V], states [s_0 .. s_r])."""
    lm, s = model.lm, model.spec
    T = ids.shape[1]
    h = lm.model.embed_tokens(ids)
    pos = torch.arange(T)[None].expand(ids.shape[0], -1)
    pe = lm.model.rotary_emb(h, pos)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]

    def block(j, x):
        out = model.blocks[j](x, attention_mask=mask, position_embeddings=pe, position_ids=pos)
        return out[0] if isinstance(out, tuple) else out

    for j in range(s.prelude):
        h = block(j, h)
    e = state = h
    states = [state]
    for _ in range(r):
        x = model.adapter(torch.cat([state, e], -1)) if model.adapter is not None else state
        for j in range(s.core):
            x = block(s.prelude + j, x)
        state = x
        states.append(state)
    h = state
    for j in range(s.coda):
        h = block(s.prelude + s.core + j, h)
    return lm.lm_head(lm.model.norm(h)), states


@pytest.mark.parametrize("r", [1, 3, 5])
def test_unrolled_forward_and_recordings_equal_the_hand_written_loop(r):
    model = make()
    ids, mask = ids_of()
    with torch.no_grad(), looping(model, r):
        want, states = hand_loop(model, ids, r)
        with ResidualRecorder(model) as rec:
            rec.cols = torch.arange(ids.shape[1])
            got = model(ids, mask).logits
            resid = rec.take()  # [B, T, L+1, D] over the unrolled stack
        assert resid.shape[2] == model.n_layers + 1 == model.spec.n_blocks + model.spec.core * (r - 1) + 1
        for i, s in enumerate(states):
            assert torch.allclose(resid[:, :, model.state_depth(i)], s, atol=1e-5), i
    assert torch.allclose(got, want, atol=1e-5)
    assert model.iterations == 3  # looping() restored the trained r


def test_one_iteration_without_injection_is_the_plain_stack():
    torch.manual_seed(0)
    cfg = qwen3_config(V, n_layers=4, d_model=32, n_heads=2, n_kv_heads=1)
    lm = AutoModelForCausalLM.from_config(cfg).eval()
    plain = FullBandwidthLM(copy.deepcopy(lm), fusion=False).eval()
    looped = LoopedLM(lm, LoopSpec(1, 2, 1, 1, inject=False)).eval()
    ids, mask = ids_of()
    with torch.no_grad():
        assert torch.equal(looped(ids, mask).logits, plain(ids, mask).logits)
        looped.set_iterations(2)  # two iterations of a non-identity core: no longer the plain stack
        assert not torch.allclose(looped(ids, mask).logits, plain(ids, mask).logits, atol=1e-3)


def test_patching_a_loop_state_with_its_own_clean_value_changes_nothing():
    from interventions.core import Batch, CausalContext, Patch

    model = make()
    ids, mask = ids_of(B=4, T=9)
    batch = Batch(ids, mask, torch.tensor([0, 1, 0, 1]), torch.tensor([1, 0, 3, 2]), np.array([0, 0, 1, 1]), (5, 6))
    ctx = CausalContext(model, batch, modes=("standard",))
    clean = ctx.clean["standard"].logits
    resid = ctx.resid("standard")
    for i in range(model.iterations + 1):
        d = model.state_depth(i)
        for pos in (-1, -4):
            out = ctx.run("standard", [Patch("resid", resid[:, ids.shape[1] + pos, d], depth=d, pos=pos)]).logits
            assert torch.equal(out, clean), (i, pos)
    # the donor's state at an iteration moves the answer (the site is live; the coda still reads own columns)
    for i in (1, model.iterations):
        d = model.state_depth(i)
        swapped = ctx.run("standard", [Patch("resid", resid[:, -1, d][batch.pair], depth=d, pos=-1)]).logits
        assert (swapped - clean).abs().max() > 1e-3


@pytest.mark.parametrize("window", [None, 4])
def test_each_unrolled_block_has_its_own_cache_slot(window):
    """A cached prefix then one-token steps equal the full forward: every iteration keeps its own keys/values."""
    from engine.cache import new_cache

    model = make(window=window)
    ids, mask = ids_of(T=10)
    with torch.no_grad():
        full = model(ids, mask).logits
        cache = new_cache(model, slack=0) if window else new_cache()
        out = model(ids[:, :6], mask[:, :6], cache=cache, use_cache=True)
        steps = [out.logits[:, -1]]
        for t in range(6, 10):
            steps.append(model(ids[:, t:t + 1], mask[:, :t + 1], cache=cache, use_cache=True).logits[:, -1])
    assert len(cache.layers) == model.n_layers
    assert torch.allclose(torch.stack(steps[1:], 1), full[:, 6:], atol=1e-5)


def test_checkpoint_round_trip_and_refusals(tmp_path):
    import json

    model = make()
    ids, mask = ids_of()
    model.save_pretrained(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["format_version"] == 2 and cfg["loop"] == {"prelude": 1, "core": 2, "coda": 1, "iterations": 3,
                                                         "inject": True}
    assert cfg["base_config"]["num_hidden_layers"] == 4
    back = FullBandwidthLM.from_pretrained(tmp_path / "m")
    assert isinstance(back, LoopedLM) and back.iterations == 3
    with torch.no_grad():
        assert torch.equal(back(ids, mask).logits, model(ids, mask).logits)
    cfg["loop"]["core"] = 3  # 1 + 3 + 1 blocks for a 4-block base
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="needs a base model of 5 blocks"):
        FullBandwidthLM.from_pretrained(tmp_path / "m")
    del cfg["loop"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="go together"):
        FullBandwidthLM.from_pretrained(tmp_path / "m")
    for bad in (dict(prelude=-1, core=1, coda=0, iterations=1), dict(prelude=0, core=0, coda=0, iterations=1),
                dict(prelude=0, core=1, coda=0, iterations=0)):
        with pytest.raises(UserError):
            LoopSpec(**bad)
    with pytest.raises(UserError):
        model.set_iterations(0)


def test_truncated_backpropagation_trains_the_last_iterations_and_the_prelude_through_injection():
    model = make(LoopSpec(1, 1, 1, 4)).train()
    ids, mask = ids_of()
    model.frozen_iterations = 3  # only iteration 4 keeps its graph
    loss = model(ids, mask).logits.pow(2).mean()
    loss.backward()
    assert model.blocks[0].mlp.down_proj.weight.grad is not None  # prelude: through e injected into iteration 4
    assert model.blocks[1].mlp.down_proj.weight.grad.abs().sum() > 0  # the core (iteration 4)
    assert model.adapter.weight.grad.abs().sum() > 0
    # the same loss without truncation gives other core gradients (iterations 1-3 contribute)
    g_trunc = model.blocks[1].mlp.down_proj.weight.grad.clone()
    model.zero_grad()
    model.frozen_iterations = 0
    model(ids, mask).logits.pow(2).mean().backward()
    assert not torch.allclose(model.blocks[1].mlp.down_proj.weight.grad, g_trunc)
