"""models.lean_step: the cached one-token step without HF's per-call machinery is bit for bit HF's own step (padded
rows and sliding windows included), and it runs only where it is: no foreign hook, wrapper, autograd or unknown
block.

Golden reference: the same FullBandwidthLM with the lean step switched off (`enabled(False)`), i.e. HF's base model
(`lm.base_model(inputs_embeds=..., cache=...)`); every comparison is `torch.equal`, not a tolerance."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.cache import new_cache
from engine.hooks import on_block, on_depth
from engine.prefill import prefill_many
from models.full_bandwidth import FullBandwidthLM
from models.lean_step import StepPlan, enabled, step_plan

TYPES = ("llama", "mistral", "qwen2", "qwen3")


def tiny_model(model_type: str, seed: int = 0, kv_heads: int = 2, dtype=torch.float32, **kw) -> FullBandwidthLM:
    from transformers import AutoConfig

    if model_type == "mistral":
        kw.setdefault("sliding_window", None)  # Mistral's default window (4096) is a sliding layer: HF's path
    cfg = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=8,
                               max_position_embeddings=256, initializer_range=0.2, bos_token_id=None,
                               eos_token_id=None, pad_token_id=None, **kw)
    return FullBandwidthLM.from_config(cfg, seed=seed).eval().to(dtype)


def steps(model, ids, n_steps=4, state_seed=1, mask=None, window_cache=False):
    """Prefill ids[:, :-n_steps] into a fresh cache (`window_cache`: a windowed model's sliding layers keep their
    window only), then the cached one-token fused steps of the rest, each fed a fixed random state: (tops, logits,
    final keys of every layer). `mask`: a left-padding mask (default none)."""
    g = torch.Generator().manual_seed(state_seed)
    T, s = ids.shape[1], ids.shape[1] - n_steps
    mask = torch.ones_like(ids) if mask is None else mask
    cache = new_cache(model) if not window_cache else new_cache(model, slack=0)
    tops, logits = [], []
    with torch.no_grad():
        model(ids[:, :s], mask[:, :s], cache=cache, use_cache=True)
        for t in range(s, T):
            state = torch.randn(ids.shape[0], 1, model.d_model, generator=g).to(model.lm.dtype)
            out = model(ids[:, t:t + 1], mask[:, :t + 1], state=state, cache=cache, use_cache=True)
            tops.append(out.top)
            logits.append(out.logits)
    return torch.cat(tops, 1), torch.cat(logits, 1), [layer.keys.clone() for layer in cache.layers]


def lean_and_hf(model, ids, **kw):
    """`steps` with the lean step, and with HF's own step (the golden reference)."""
    lean = steps(model, ids, **kw)
    with enabled(False):
        return lean, steps(model, ids, **kw)


def ids_for(batch=2, T=12, seed=3):
    return torch.randint(1, 64, (batch, T), generator=torch.Generator().manual_seed(seed))


def plan_of(model, grad=False, T=1):
    x = torch.zeros(1, T, model.d_model)
    with torch.set_grad_enabled(grad):
        return step_plan(model.lm, model.family, x, new_cache())


def assert_same(a, b):
    for x, y in zip(a[:2], b[:2]):
        assert torch.equal(x, y)
    assert all(torch.equal(x, y) for x, y in zip(a[2], b[2]))


@pytest.mark.parametrize("model_type", TYPES)
@pytest.mark.parametrize("kv_heads", (1, 2, 4))
def test_bit_for_bit_hf_step(model_type, kv_heads):
    model = tiny_model(model_type, kv_heads=kv_heads)
    assert isinstance(plan_of(model), StepPlan)
    ids = ids_for()
    lean = steps(model, ids)
    with enabled(False):
        assert plan_of(model) == "switched off"
        hf = steps(model, ids)
    assert_same(lean, hf)


@pytest.mark.parametrize("model_type", ("llama", "qwen3"))
def test_bit_for_bit_in_bfloat16(model_type):
    model = tiny_model(model_type, dtype=torch.bfloat16)
    ids = ids_for()
    lean, hf = lean_and_hf(model, ids)
    assert lean[0].dtype == torch.bfloat16
    assert_same(lean, hf)


def test_biases_are_used():
    """Qwen2's q/k/v biases (and Llama's attention_bias / mlp_bias) enter the lean step: made large, they change
    the result, and it still equals HF's."""
    for model_type, kw in (("qwen2", {}), ("llama", {"attention_bias": True, "mlp_bias": True})):
        model = tiny_model(model_type, **kw)
        ids = ids_for()
        before = steps(model, ids)
        with torch.no_grad():
            for name, p in model.lm.named_parameters():
                if name.endswith("bias"):
                    p.add_(1.0)
        after, hf = lean_and_hf(model, ids)
        assert not torch.equal(before[0], after[0])
        assert_same(after, hf)


def test_engine_modes_and_records_unchanged():
    """prefill_many's recurrent modes, with the residual recorder (engine.hooks marks its hooks RESIDUAL_HOOK, the
    lean step calls them), equal the HF path at every recorded depth; greedy generation too."""
    from engine.prefill import generate

    model = tiny_model("qwen3")
    ids = ids_for(T=16)
    mask = torch.ones_like(ids)
    modes = ("recurrent-full", "recurrent-3", "recurrent-1", "standard")
    lean = prefill_many(model, ids, mask, modes, positions=(-1, -4, -9))
    gen = [generate(model, ids, mask, 5, decoding) for decoding in ("std", "soft", "fused")]
    with enabled(False):
        hf = prefill_many(model, ids, mask, modes, positions=(-1, -4, -9))
        gen_hf = [generate(model, ids, mask, 5, decoding) for decoding in ("std", "soft", "fused")]
    for m in modes:
        assert torch.equal(lean[m].logits, hf[m].logits) and torch.equal(lean[m].top, hf[m].top)
        assert torch.equal(lean[m].resid, hf[m].resid)
    assert all(torch.equal(a, b) for a, b in zip(gen, gen_hf))


def test_residual_patch_is_applied():
    """An engine depth patch (a marked hook that replaces the residual) under the lean step: applied, and equal to
    HF's path with the same patch."""
    model = tiny_model("llama")
    ids = ids_for()
    clean = steps(model, ids)
    layers = model.lm.base_model.layers
    handle = on_depth(layers, 2, lambda h: h * 0.5)
    h0 = on_depth(layers, 0, lambda h: h + 0.25)
    try:
        assert isinstance(plan_of(model), StepPlan)
        lean, hf = lean_and_hf(model, ids)
    finally:
        handle.remove()
        h0.remove()
    assert not torch.equal(lean[0], clean[0])
    assert_same(lean, hf)
    assert_same(steps(model, ids), clean)  # the hooks removed: the clean step again


def test_foreign_hooks_take_hf_path():
    """A hook inside a block (the interventions' MLP-output site, or anyone's hook on any module) or on a block
    without the marker: the step is HF's, and the hook acts."""
    model = tiny_model("qwen3")
    ids = ids_for()
    clean = steps(model, ids)
    block = model.lm.base_model.layers[1]
    cases = [lambda: on_block(model.lm, 1, "mlp_out", lambda x: x * 0),
             lambda: block.self_attn.k_proj.register_forward_hook(lambda m, a, o: o + 1),
             lambda: block.register_forward_hook(lambda m, a, o: o * 2),  # unmarked hook on a block
             lambda: model.lm.base_model.norm.register_forward_pre_hook(lambda m, a: (a[0] * 3,)),
             lambda: nn.modules.module.register_module_forward_hook(lambda m, a, o: None),
             # backward hooks never fire in a no-grad step, but HF's path sets them up: the step leaves them to it
             lambda: block.mlp.down_proj.register_full_backward_hook(lambda m, gi, go: None),
             lambda: block.register_full_backward_pre_hook(lambda m, go: None)]
    for make in cases:
        handle = make()
        try:
            assert isinstance(plan_of(model), str)
            got, hf = lean_and_hf(model, ids)
        finally:
            handle.remove()
        assert_same(got, hf)
    assert isinstance(plan_of(model), StepPlan)  # nothing stale once the hooks are gone
    assert_same(steps(model, ids), clean)


def test_replaced_module_makes_a_new_plan():
    model = tiny_model("llama")
    ids = ids_for()
    steps(model, ids)
    mlp = model.lm.base_model.layers[2].mlp
    torch.manual_seed(5)
    mlp.down_proj = nn.Linear(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False)
    lean, hf = lean_and_hf(model, ids)
    assert_same(lean, hf)

    class Lora(nn.Linear):  # a subclass: not HF's plain nn.Linear, so HF's path
        pass

    old = mlp.up_proj
    mlp.up_proj = Lora(old.in_features, old.out_features, bias=False)
    assert "parts" in plan_of(model)


WINDOWED = [("qwen3", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 0}),
            ("qwen2", {"use_sliding_window": True, "sliding_window": 3,
                       "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}),
            ("mistral", {"sliding_window": 3})]


@pytest.mark.parametrize("model_type,kw", [(t, {}) for t in TYPES] + WINDOWED)
@pytest.mark.parametrize("window_cache", (False, True))
def test_bit_for_bit_padded_and_windowed(model_type, kw, window_cache):
    """Left-padded rows and sliding-window layers (windows shorter than the prompt), with the full cache and with
    the window cache (engine.cache.WindowLayer): HF's own masks, so HF's results, bit for bit."""
    from engine.inputs import pad_left

    model = tiny_model(model_type, **kw)
    ids, mask = pad_left([[5, 9, 2, 7, 3, 11, 4, 8, 6, 1], [6, 1, 12, 3, 10, 2, 9], [7, 7, 2, 5, 30, 4]])
    assert isinstance(plan_of(model), StepPlan)
    lean, hf = lean_and_hf(model, ids, mask=mask, window_cache=window_cache)
    assert_same(lean, hf)
    if kw:  # the window acts: the same steps with the window dropped differ
        assert not torch.equal(lean[0], steps(tiny_model(model_type), ids, mask=mask)[0])


def test_where_it_does_not_run(make_tiny_config):
    from nnsight import NNsight

    model = tiny_model("qwen3")
    assert plan_of(model, T=3) == "not a one-token step with a cache"
    assert plan_of(model, grad=True) == "autograd"
    gpt2 = FullBandwidthLM.from_config(make_tiny_config("gpt2"), seed=0).eval()
    assert plan_of(gpt2) == "family gpt2"
    base = model.lm.model
    base_cls = type(base)
    base.__class__ = type("OtherModel", (base_cls,), {})  # a base model whose forward this step does not know
    assert plan_of(model) == "base model OtherModel"
    base.__class__ = base_cls
    model.train()
    assert isinstance(plan_of(model), str)
    model.eval()
    assert isinstance(plan_of(model), StepPlan)
    NNsight(model)  # nnsight installs its controller as every module's instance `forward`
    assert isinstance(plan_of(model), str)


def test_padded_windowed_engine_and_autograd():
    """The engine's recurrence on a padded batch of a windowed model (window cache, recorder) equals HF's path;
    the trainer's differentiable recurrence (autograd: HF's path) agrees with the no-grad lean one."""
    from engine.inputs import pad_left
    from engine.prefill import recurrent_logits

    model = tiny_model("qwen3", use_sliding_window=True, sliding_window=3, max_window_layers=0)
    ids, mask = pad_left([[5, 9, 2, 7, 3, 11, 4, 8], [6, 1, 12, 3, 10]])
    lean = prefill_many(model, ids, mask, ("recurrent-full", "recurrent-2"), positions=(-1, -3))
    with enabled(False):
        hf = prefill_many(model, ids, mask, ("recurrent-full", "recurrent-2"), positions=(-1, -3))
    for m in lean:
        assert torch.equal(lean[m].logits, hf[m].logits) and torch.equal(lean[m].resid, hf[m].resid)
    model = tiny_model("qwen3")
    ids = ids_for(T=8)
    a = recurrent_logits(model, ids, torch.ones_like(ids))
    with torch.no_grad():
        b = prefill_many(model, ids, torch.ones_like(ids), ("recurrent-full",), positions=(-1,))["recurrent-full"]
    assert a.requires_grad
    torch.testing.assert_close(a[:, -1], b.logits[:, 0], rtol=0, atol=1e-5)


def test_what_the_review_found():
    """Cases a review found where the step ran but HF's path differs (or crashed), each now refused or followed:
    a static cache, an in-place edit of layer_types, `module.compile()`, another "sdpa" registered with HF, a
    kernels-hub function swapped in, a weight that is a buffer; and HF's inert capturing hooks left by an
    `output_hidden_states` call do not switch the step off."""
    from transformers import AttentionInterface, StaticCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = tiny_model("qwen3", layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                       use_sliding_window=True, sliding_window=3, max_window_layers=0)
    ids = ids_for()
    x = torch.zeros(1, 1, model.d_model)
    with torch.no_grad():
        assert step_plan(model.lm, model.family, x, StaticCache(config=model.config, max_cache_len=32)) == \
            "a compileable (static) cache"
    assert_same(*lean_and_hf(model, ids))
    model.config.layer_types[1] = "full_attention"  # in place: a new plan, HF's masks follow
    assert plan_of(model).mask_kinds == ("full_attention", "full_attention", "sliding_attention")
    assert_same(*lean_and_hf(model, ids))

    mlp = model.lm.model.layers[1].mlp
    mlp.compile()
    assert isinstance(plan_of(model), str)
    mlp._compiled_call_impl = None
    assert isinstance(plan_of(model), StepPlan)

    AttentionInterface.register("sdpa", lambda *a, **k: sdpa_attention_forward(*a, **k))
    try:
        assert plan_of(model) == "attention not through HF's sdpa"
    finally:
        AttentionInterface.register("sdpa", sdpa_attention_forward)
    assert isinstance(plan_of(model), StepPlan)

    attn = model.lm.model.layers[0].self_attn
    funcs = getattr(attn, "_kernel_funcs", {})
    if funcs:  # transformers' kernels-hub wrappers: kernelize swaps a wrapper's forward on the instance
        wrapper = next(iter(funcs.values()))
        wrapper.forward = wrapper.forward
        assert isinstance(plan_of(model), str)
        del wrapper.forward
        assert isinstance(plan_of(model), StepPlan)

    lin = model.lm.model.layers[2].self_attn.o_proj
    w = lin.weight.detach().clone()
    del lin.weight
    lin.register_buffer("weight", w)
    assert plan_of(model) == "a weight or bias that is not a parameter"
    assert_same(*lean_and_hf(model, ids))  # HF's path, no KeyError
    del lin.weight
    lin.weight = nn.Parameter(w)  # (a buffer and a parameter of one name cannot coexist: the buffer is gone)
    with torch.no_grad():
        model(ids, torch.ones_like(ids), hidden_states=True)  # HF installs its capturing hooks for good
    assert any(b._forward_hooks for b in model.lm.model.layers)
    assert isinstance(plan_of(model), StepPlan)
    assert_same(*lean_and_hf(model, ids))
