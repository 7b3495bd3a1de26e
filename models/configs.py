"""Base-model configs for the tiny presets and for tests (Qwen3-style and GPT-2-style decoders)."""
from __future__ import annotations

from transformers import GPT2Config, Qwen3Config


def qwen3_config(vocab_size: int, n_layers: int = 6, d_model: int = 128, n_heads: int = 4, n_kv_heads: int = 2,
                 d_ff: int | None = None, max_len: int = 2048, attn_window: int | None = None, **kw) -> Qwen3Config:
    """Qwen3-style: RMSNorm, RoPE, SwiGLU, GQA, QK-norm, tied embeddings (unless tie_word_embeddings=False).

    `attn_window` W: every layer is sliding-window attention, each position attending to itself and the W-1
    before it (HF's `sliding_attention` layer type); None = full causal attention.
    """
    kw.setdefault("tie_word_embeddings", True)
    if attn_window:
        kw.update(layer_types=["sliding_attention"] * n_layers, sliding_window=attn_window, use_sliding_window=True,
                  max_window_layers=0)
    return Qwen3Config(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=d_ff or 3 * d_model,
                       num_hidden_layers=n_layers, num_attention_heads=n_heads, num_key_value_heads=n_kv_heads,
                       head_dim=d_model // n_heads, max_position_embeddings=max_len,
                       pad_token_id=0, bos_token_id=None, eos_token_id=None, **kw)


def gpt2_config(vocab_size: int, n_layers: int = 2, d_model: int = 64, n_heads: int = 4, max_len: int = 512,
                **kw) -> GPT2Config:
    kw.setdefault("tie_word_embeddings", True)
    return GPT2Config(vocab_size=vocab_size, n_embd=d_model, n_layer=n_layers, n_head=n_heads, n_positions=max_len,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      pad_token_id=0, bos_token_id=None, eos_token_id=None, **kw)


def check_config(config, where) -> None:
    """UserError (one line) for a base-model config that HF builds but that computes nonsense: a NaN model (RoPE
    theta 0, a norm eps <= 0, a soft-cap <= 0), a window of no tokens (every answer wrong) or none where a layer slides, sizes < 1,
    heads that do not split the width or KV heads that do not split the heads, more experts per token than experts.
    For full-bandwidth checkpoints and plain HF models alike (models.full_bandwidth.FullBandwidthLM.from_pretrained,
    models.loading._load_hf_lm)."""
    import math

    from common.errors import UserError

    from models.families import FAMILIES, HEAD_DIM_FROM_WIDTH, model_type_of

    ignored = {"head_dim"} if model_type_of(config) in HEAD_DIM_FROM_WIDTH else set()  # width // heads there

    def get(key):
        return None if key in ignored else getattr(config, key, None)

    def refuse(what):
        raise UserError(f"bad model config in {where}: {what}")

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    def is_num(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "n_inner", "head_dim", "max_position_embeddings", "moe_intermediate_size",
                "num_local_experts", "num_experts"):
        v = get(key)
        if v is not None and (not is_int(v) or v < 1):
            refuse(f"{key} must be a positive integer, got {v!r}")
    for key in ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps"):
        v = get(key)
        if v is not None and (not is_num(v) or v <= 0):
            refuse(f"{key} must be a finite number > 0, got {v!r}")
    softcapped = any(model_type_of(config) in f.softcap_types for f in FAMILIES)  # HF reads them (a stray key: no)
    for key in ("final_logit_softcapping", "attn_logit_softcapping") if softcapped else ():  # tanh(x / cap) * cap
        v = get(key)
        if v is not None and (not is_num(v) or v <= 0):  # 0: every logit 0 (a blind model); null turns it off
            refuse(f"{key} must be a finite number > 0 or null, got {v!r}")
    window = get("sliding_window")
    if window is not None and (not is_int(window) or window < 1) and _windowed(config):
        refuse(f"sliding_window must be an integer >= 1 (tokens attended) or null, got {window!r}")
    if window is None and _windowed(config, by_type=True):  # HF's forward fails on such a layer, in its mask code
        refuse("layer_types has sliding_attention layers but no sliding_window (null, or use_sliding_window false)")
    top_k, experts = get("num_experts_per_tok"), get("num_local_experts") or get("num_experts")
    if top_k is not None and (not is_int(top_k) or top_k < 1 or (experts is not None and top_k > experts)):
        refuse(f"num_experts_per_tok must be an integer in 1..{experts} (the experts), got {top_k!r}"
               if experts is not None else f"num_experts_per_tok must be a positive integer, got {top_k!r}")
    # RoPE: v5 keeps theta in rope_parameters (per layer type in some models), older configs at the top level
    rope = [("rope_theta", get("rope_theta"))]
    stack = [("rope_parameters", get("rope_parameters"))]
    if get("rope_scaling") != get("rope_parameters"):  # an alias of rope_parameters in transformers 5
        stack.append(("rope_scaling", get("rope_scaling")))
    while stack:
        name, d = stack.pop()
        if isinstance(d, dict):
            for k, v in d.items():
                if k in ("rope_theta", "factor"):
                    rope.append((f"{name}.{k}", v))
                elif isinstance(v, dict):
                    stack.append((f"{name}.{k}", v))
    for key, v in rope:
        if v is not None and (not is_num(v) or v <= 0):
            refuse(f"{key} must be a finite number > 0, got {v!r}")
    width, heads, kv = get("hidden_size"), get("num_attention_heads"), get("num_key_value_heads")
    if width and heads and get("head_dim") is None and width % heads:
        refuse(f"num_attention_heads {heads} does not divide hidden_size {width}")
    if heads and kv and heads % kv:
        refuse(f"num_key_value_heads {kv} does not divide num_attention_heads {heads}")
    head_dim = get("head_dim") or (width // heads if width and heads else None)
    partial = get("partial_rotary_factor") is not None or "partial_rotary_factor" in str(get("rope_parameters"))
    if any(v is not None for _, v in rope) and not partial and head_dim and head_dim % 2:
        refuse(f"head dimension {head_dim} is odd; RoPE rotates pairs of dimensions")


def _windowed(config, by_type: bool = False) -> bool:
    """Whether any layer of this model applies `sliding_window` (Qwen2-MoE's config writes 0 where none does);
    True for a model type no family covers (its loading refuses it anyway). `by_type`: whether any layer is a
    sliding one by the `layer_types` of a model type that reads them (False for other types)."""
    from common.errors import UserError
    from models.families import family_of

    try:
        family = family_of(config)
    except UserError:
        return not by_type
    if by_type:
        return (family.window_rule(config) == "layer_types"
                and "sliding_attention" in (getattr(config, "layer_types", None) or ()))
    return any(w is not None for w in family.windows(config))
