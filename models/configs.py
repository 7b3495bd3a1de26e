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
