"""The decoder's one-token step without HF's per-call machinery: the same ops, in the same order, as HF computes
them, so the result is bit for bit HF's (tests/test_lean_step.py), at less cost: a step ~35% cheaper than HF's on
the tiny presets, ~10% at SmolLM2's 30-layer shape (`benchmarks/decode.py`, docs/benchmarks.md).

Why: a cached one-token step of a small model is all overhead. On the benchmark's 4-layer model HF spends ~3.5 ms
in a step whose arithmetic takes well under one: ~80 module calls, decorators, config look-ups, mask building.
The recurrence (recurrent-k, recurrent-full) and greedy decoding are nothing but such steps.

When it runs (`step_plan` returns a StepPlan), FullBandwidthLM.forward calls `lean_step` instead of the base model:
  * one column (q = 1), a cache given, no autograd, the model in eval mode; padded batches and sliding-window
    layers get HF's own masks, made by the functions the family's base model calls;
  * a family with `lean_step` (models.families: llama / mistral, qwen2 / qwen3) whose base model is exactly one
    of HF's base-model classes and every block exactly one of its decoder-layer classes built of its own modules
    (`_block_classes`), attention through "sdpa";
  * a cache that is not compileable (HF's StaticCache masks its unwritten slots);
  * nothing observes or rewrites the model's insides: no forward or backward hooks on any module, no global
    module hooks, no `forward` replaced on an instance (nnsight's wrapper, accelerate's, a tensor-parallel one),
    no `module.compile()`, no kernels-hub function swapped in, no other "sdpa" registered with HF, except the
    residual-stream hooks on the blocks themselves that carry `RESIDUAL_HOOK` (engine.hooks.on_depth marks its
    own): those are called here exactly as nn.Module calls them, with the block's input as the only argument.
    HF's own output-capturing hooks, left on the modules for good by any `output_hidden_states` call, are
    allowed while no capture runs (they return at once).
  Not detected: a class-level monkeypatch of HF's modeling code (a replaced `LlamaMLP.forward`, Liger-style
  swaps of module functions); the step reproduces the classes as transformers ships them.
Anything else takes HF's own path, unchanged. `enabled(False)` switches it off (benchmarks, tests).
"""
from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _module
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

RESIDUAL_HOOK = "_reads_residual_only"  # attribute of a block hook that reads or replaces only the residual
#                                         stream: the block's first argument (pre-hook) or its output (post)
_ON = [True]


@contextmanager
def enabled(on: bool = True):
    """Within the block, the lean step runs where it can (on) or never (off)."""
    prev, _ON[0] = _ON[0], bool(on)
    try:
        yield
    finally:
        _ON[0] = prev


def _block_classes() -> tuple[dict, dict]:
    """HF's classes this step reproduces: {base model: how it masks ("llama": the causal mask for every block;
    "mistral": the sliding-window one when `sliding_window` is set; "qwen": per `layer_types`)} and {decoder
    layer: (RMSNorm, attention, MLP class, has q_norm / k_norm)}."""
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.mistral import modeling_mistral as mistral
    from transformers.models.qwen2 import modeling_qwen2 as qwen2
    from transformers.models.qwen3 import modeling_qwen3 as qwen3
    bases = {llama.LlamaModel: "llama", mistral.MistralModel: "mistral", qwen2.Qwen2Model: "qwen",
             qwen3.Qwen3Model: "qwen"}
    blocks = {llama.LlamaDecoderLayer: (llama.LlamaRMSNorm, llama.LlamaAttention, llama.LlamaMLP, False),
              mistral.MistralDecoderLayer: (mistral.MistralRMSNorm, mistral.MistralAttention, mistral.MistralMLP,
                                            False),
              qwen2.Qwen2DecoderLayer: (qwen2.Qwen2RMSNorm, qwen2.Qwen2Attention, qwen2.Qwen2MLP, False),
              qwen3.Qwen3DecoderLayer: (qwen3.Qwen3RMSNorm, qwen3.Qwen3Attention, qwen3.Qwen3MLP, True)}
    return bases, blocks


_CLASSES: list = []  # filled on first use: importing the model modules costs ~0.1 s


def _classes() -> tuple[dict, dict]:
    if not _CLASSES:
        _CLASSES.extend(_block_classes())
    return _CLASSES[0], _CLASSES[1]


try:
    from transformers.utils.output_capturing import _active_collector as _capture
except ImportError:  # another transformers: its capturing hooks count as foreign ones
    _capture = None


def _capture_inactive() -> bool:
    """No HF output capture (`output_hidden_states` / `output_attentions`) is running now."""
    return _capture is not None and _capture.get() is None


def _inert(hook, capture_inactive: bool) -> bool:
    """HF's output-capturing hook, which any `output_hidden_states` call installs on the blocks and attention modules
    for good, while no capture runs: it returns at once."""
    return (capture_inactive and getattr(hook, "__module__", None) == "transformers.utils.output_capturing"
            and getattr(hook, "__name__", None) == "output_capturing_hook")


def _unwrapped(d: dict) -> bool:
    """A module, given by its instance `__dict__` (nn.Module's __getattr__ fallback is slow), runs its class's own
    forward: none set on the instance (nnsight, accelerate, tensor parallelism), no `m.compile()`, no kernels-hub
    function swapped in (HF's `use_kernelized_func` wrappers); eval mode; no backward hooks."""
    if ("forward" in d or d.get("_compiled_call_impl") is not None or d.get("training")
            or d.get("_backward_hooks") or d.get("_backward_pre_hooks")):
        return False
    funcs = d.get("_kernel_funcs")
    return not funcs or not any("forward" in f.__dict__ for f in funcs.values())


def _all_plain(parts: tuple, capture_inactive: bool) -> bool:
    """No hook on any of `parts` but an inert capturing one, and each unwrapped. Plain loops over instance dicts:
    this runs before every step (a 30-layer model has ~450 parts; 54 -> 31 us a step on the 4-layer benchmark
    model against `all()` over per-module attribute reads)."""
    for m in parts:
        d = m.__dict__
        if not _unwrapped(d) or d.get("_forward_pre_hooks"):
            return False
        hooks = d.get("_forward_hooks")
        if hooks:
            for h in hooks.values():
                if not _inert(h, capture_inactive):
                    return False
    return True


def _residual_hooks_only(block: nn.Module, capture_inactive: bool) -> bool:
    """Unwrapped, and every hook on it the engine's residual hooks (called by `lean_step`) or inert."""
    d = block.__dict__
    if not _unwrapped(d) or d.get("_forward_hooks_with_kwargs") or d.get("_forward_hooks_always_called"):
        return False
    return (all(getattr(h, RESIDUAL_HOOK, False) for h in block._forward_pre_hooks.values())
            and all(getattr(h, RESIDUAL_HOOK, False) or _inert(h, capture_inactive)
                    for h in block._forward_hooks.values()))


class StepPlan(NamedTuple):
    """What the step runs, found once per model structure: the blocks with their parts, and every module link
    the plan was read through (re-checked at each call: a replaced submodule, or one of another class, makes a
    new plan)."""
    n_layers: int
    window_fields: tuple  # (sliding_window, layer_types) as the plan found them
    links: tuple  # (parent._modules, name, child, its class)
    blocks: tuple  # (block, attention, mlp, has q_norm / k_norm)
    parts: tuple  # every module the step runs other than the blocks: plain at each call
    linears: tuple  # the nn.Linear and RMSNorm parts, whose weight (and bias) must be parameters at each call
    norms: tuple
    rotary: nn.Module | None  # the base model's rotary embedding and final norm
    norm: nn.Module | None
    masks: dict  # {mask kind: HF's mask function, as the family's base model calls it}
    mask_kinds: tuple  # each block's mask kind ("full_attention" / "sliding_attention")
    why: str | None  # why this structure takes HF's path; None: the lean step reproduces it


_PLANS: "weakref.WeakKeyDictionary[nn.Module, StepPlan]" = weakref.WeakKeyDictionary()


def _child(links: list, parent: nn.Module, name: str):
    child = parent._modules.get(name)
    links.append((parent._modules, name, child, type(child)))
    return child


def _new_plan(lm, family, n: int, window_fields: tuple) -> StepPlan:
    links, blocks, parts, kinds, all_linears, all_norms = [], [], [], [], [], []
    rotary = norm = None
    masks = {}

    def plan(why):
        return StepPlan(n, window_fields, tuple(links), tuple(blocks), tuple(parts), tuple(all_linears),
                        tuple(all_norms), rotary, norm, masks, tuple(kinds), why)

    base = _child(links, lm, lm.base_model_prefix)
    layers = _child(links, base, family.blocks) if base is not None else None
    if base is not None:
        norm, rotary = _child(links, base, "norm"), _child(links, base, "rotary_emb")
    bases, specs = _classes()
    if type(base) not in bases:
        return plan(f"base model {type(base).__name__}")
    if layers is None or norm is None or rotary is None or len(layers) < n:
        return plan("a base model without layers, norm and rotary_emb")
    parts += [base, rotary, norm]
    if type(norm) not in {spec[0] for spec in specs.values()}:
        return plan(f"final norm {type(norm).__name__}")
    all_norms.append(norm)
    for i in range(n):
        block = _child(links, layers, str(i))
        spec = specs.get(type(block))
        if spec is None:
            return plan(f"block {type(block).__name__}")
        norm_cls, attn_cls, mlp_cls, qk = spec
        a, m = _child(links, block, "self_attn"), _child(links, block, "mlp")
        norms = [_child(links, block, "input_layernorm"), _child(links, block, "post_attention_layernorm")]
        if qk:
            norms += [_child(links, a, "q_norm"), _child(links, a, "k_norm")]
        linears = [_child(links, a, k) for k in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
            [_child(links, m, k) for k in ("gate_proj", "up_proj", "down_proj")]
        act = _child(links, m, "act_fn")
        if (type(a) is not attn_cls or type(m) is not mlp_cls or any(type(x) is not norm_cls for x in norms)
                or any(type(x) is not nn.Linear for x in linears) or not isinstance(act, nn.Module)):
            return plan(f"block {i} holds parts HF's {type(block).__name__} does not")
        blocks.append((block, a, m, qk))
        parts += [a, m, act, *norms, *linears]
        all_linears += linears
        all_norms += norms
    masks, kinds[:] = _mask_plan(base, bases[type(base)], n, window_fields)
    return plan(None)


def _mask_plan(base: nn.Module, rule: str, n: int, window_fields: tuple) -> tuple[dict, list]:
    """Which of HF's mask functions each block's attention gets, as the base model's forward chooses them (see
    `_block_classes`), taken from the base model's own module."""
    hf = sys.modules[type(base).__module__]
    full, sliding = "full_attention", "sliding_attention"
    window, types = window_fields
    if rule == "qwen":
        kinds = list(types[:n]) if types else [full] * n
    elif rule == "mistral":
        kinds = [full if window is None else sliding] * n
    else:
        kinds = [full] * n
    fns = {full: hf.create_causal_mask}
    if sliding in kinds:
        fns[sliding] = hf.create_sliding_window_causal_mask
    return fns, kinds


def step_plan(lm, family, inputs_embeds: torch.Tensor, cache) -> StepPlan | str:
    """The plan by which `lean_step` reproduces `lm.base_model` on this call, or why it cannot (a few words)."""
    if not _ON[0]:
        return "switched off"
    if inputs_embeds.shape[1] != 1 or cache is None:
        return "not a one-token step with a cache"
    if getattr(cache, "is_compileable", False):  # a static cache: HF masks its unwritten slots, even unpadded
        return "a compileable (static) cache"
    if torch.is_grad_enabled():
        return "autograd"
    if not family.lean_step:
        return f"family {family.name}"
    config = lm.config
    if config._attn_implementation != "sdpa" or ALL_ATTENTION_FUNCTIONS.get("sdpa") is not sdpa_attention_forward:
        return "attention not through HF's sdpa"
    if (_module._global_forward_hooks or _module._global_forward_pre_hooks or _module._global_backward_hooks
            or _module._global_backward_pre_hooks):
        return "global module hooks"
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)  # a copy: an in-place edit of the config's list is a change
    window_fields = (getattr(config, "sliding_window", None), None if types is None else tuple(types))
    plan = _PLANS.get(lm)
    if plan is None or plan.n_layers != n or plan.window_fields != window_fields or not _links_hold(plan.links):
        plan = _new_plan(lm, family, n, window_fields)
        _PLANS[lm] = plan
    if plan.why is not None:
        return plan.why
    inactive = _capture_inactive()
    if lm.training or not (_all_plain(plan.parts, inactive)
                           and all(_residual_hooks_only(b[0], inactive) for b in plan.blocks)):
        return "hooks, wrappers or training mode inside the model"
    for m in plan.linears:
        p = m.__dict__["_parameters"]
        if "weight" not in p or "bias" not in p:
            return "a weight or bias that is not a parameter"
    for m in plan.norms:
        if "weight" not in m.__dict__["_parameters"]:
            return "a weight or bias that is not a parameter"
    return plan


def _links_hold(links: tuple) -> bool:
    """Every module link the plan was read through still holds the same module, of the same class."""
    for d, k, v, c in links:
        if d.get(k) is not v or type(v) is not c:
            return False
    return True


def _w(module: nn.Module, name: str = "weight"):
    return module._parameters[name]  # a plain nn.Linear / RMSNorm (the plan checked): no __getattr__ per step


def _rms(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    # HF's LlamaRMSNorm / Qwen*RMSNorm / MistralRMSNorm forward, op for op (its casts are no-ops in float32)
    if x.dtype == torch.float32:
        return _w(norm) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return _w(norm) * h.to(x.dtype)


def _linear(x: torch.Tensor, lin: nn.Module) -> torch.Tensor:
    return F.linear(x, _w(lin), _w(lin, "bias"))


def _rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's (x * cos) + (rotate_half(x) * sin) with rotate_half(x) * sin = roll(x, half) * [-sin_1, sin_2]: the
    same products (a negation is exact), in two ops instead of five."""
    return (x * cos) + (torch.roll(x, x.shape[-1] // 2, -1) * signed_sin)


def _call_hooks(block: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """nn.Module's hook protocol on one block whose only argument is `x`: its pre-hooks (out None; returns the
    input they leave) or its forward hooks (returns the output they leave)."""
    args = (x,)
    if out is not None:
        for hook in block._forward_hooks.values():
            r = hook(block, args, out)
            if r is not None:
                out = r
        return out
    for hid, hook in block._forward_pre_hooks.items():
        if hid in block._forward_pre_hooks_with_kwargs:
            r = hook(block, args, {})
            if r is not None:
                args = r[0] if r[0] else (r[1]["hidden_states"],)
        else:
            r = hook(block, args)
            if r is not None:
                args = r if isinstance(r, tuple) else (r,)
    return args[0]


def _block(x: torch.Tensor, block: nn.Module, a: nn.Module, m: nn.Module, qk: bool, cos: torch.Tensor,
           sin: torch.Tensor, cache, mask: torch.Tensor | None) -> torch.Tensor:
    """One decoder layer on one column [batch, 1, d_model], as HF's LlamaDecoderLayer and LlamaAttention (with
    Qwen3's q_norm / k_norm) compute it; `cos`, `sin` [batch, 1, 1, head_dim] (`sin` signed, see _rotary)."""
    mods = a._modules
    hidden_shape = (x.shape[0], 1, -1, a.head_dim)
    residual = x
    h = _rms(x, block._modules["input_layernorm"])
    q = _linear(h, mods["q_proj"]).view(hidden_shape)
    k = _linear(h, mods["k_proj"]).view(hidden_shape)
    if qk:
        q, k = _rms(q, mods["q_norm"]), _rms(k, mods["k_norm"])
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # [batch, heads, 1, head_dim]
    v = _linear(h, mods["v_proj"]).view(hidden_shape).transpose(1, 2)
    q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
    k, v = cache.update(k, v, a.layer_idx)  # [batch, kv_heads, cols, head_dim]
    o, _ = sdpa_attention_forward(a, q, k, v, mask, dropout=0.0, scaling=a.scaling)  # HF's own
    x = residual + _linear(o.reshape(x.shape[0], 1, -1).contiguous(), mods["o_proj"])
    mods = m._modules
    h = _rms(x, block._modules["post_attention_layernorm"])
    return x + _linear(mods["act_fn"].forward(_linear(h, mods["gate_proj"])) * _linear(h, mods["up_proj"]),
                       mods["down_proj"])


def lean_step(plan: StepPlan, config, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None,
              position_ids: torch.Tensor, cache) -> torch.Tensor:
    """`lm.base_model(inputs_embeds=..., attention_mask=..., position_ids=..., cache=..., use_cache=True)
    .last_hidden_state` on a call `step_plan` accepted: the post-final-norm state [batch, 1, d_model]; the cache
    gains the column. `attention_mask` [batch, past + 1] or None (no padding)."""
    x = inputs_embeds
    if attention_mask is None and len(plan.masks) == 1 and "full_attention" in plan.masks:
        # HF's causal mask of an unpadded one-token query over a non-compileable cache is none (tested)
        masks = {"full_attention": None}
    else:  # HF's own masks, made before any block writes the cache, as its base model makes them
        masks = {kind: fn(config=config, inputs_embeds=x, attention_mask=attention_mask, cache=cache,
                          position_ids=position_ids) for kind, fn in plan.masks.items()}
    cos, sin = plan.rotary(x, position_ids)  # [batch, 1, head_dim]
    half = sin.shape[-1] // 2
    cos, sin = cos.unsqueeze(1), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)
    for (block, a, m, qk), kind in zip(plan.blocks, plan.mask_kinds):
        if block._forward_pre_hooks:
            x = _call_hooks(block, x)
        y = _block(x, block, a, m, qk, cos, sin, cache, masks[kind])
        x = _call_hooks(block, x, y) if block._forward_hooks else y
    return _rms(x, plan.norm)
