"""The model a run trains: built from the recipe (from scratch or warm-started from a base), its fusion gate's init."""
from __future__ import annotations

import math

import torch

from models.configs import gpt2_config, qwen3_config
from models.full_bandwidth import FullBandwidthLM, embedding_rms
from common.errors import UserError
from training.config import TrainConfig, most_loop_iterations


def _init_gate(model: FullBandwidthLM, cfg: TrainConfig) -> FullBandwidthLM:
    # The gate reads raw token embeddings (RMS ~0.02-0.05). With nn.Linear's default init its pre-activation has
    # std ~emb_rms / sqrt(3), so sigmoid(W_G e) is ~0.5 for every token and a token barely reaches its own fused
    # input (measured on tiny-fbt after training: |gate("0") - gate("1")| = 0.013 per unit). "unit" starts the
    # pre-activation at std 1 instead.
    if cfg.gate_init == "unit" and model.fusion is not None:
        with torch.no_grad():
            model.fusion.gate.weight.normal_(0.0, cfg.gate_std / (embedding_rms(model.lm) * model.d_model ** 0.5))
    return model


def build_model(cfg: TrainConfig, vocab_size: int, base: str | None = None) -> FullBandwidthLM:
    torch.manual_seed(cfg.seed + cfg.init_offset)  # the data's streams take cfg.seed alone
    if base:
        from models.loading import load_model
        model, _, _ = load_model(base)
        if cfg.base_fusion:
            if model.fusion is None:
                raise UserError(f"--base-fusion: {base} has no fusion to keep (a plain LM); drop --base-fusion")
            return model  # every trained weight, the fusion's included; only the optimizer starts afresh
        return _init_gate(FullBandwidthLM(model.lm, fusion=True), cfg)
    if cfg.loop_core:  # feedback in depth (models.looped): prelude / core x r / coda, no fusion
        from transformers import AutoModelForCausalLM

        from models.looped import LoopedLM, LoopSpec

        lm = AutoModelForCausalLM.from_config(qwen3_config(
            vocab_size, n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads, max_len=cfg.max_len,
            tie_word_embeddings=cfg.tie_embeddings, n_kv_heads=cfg.n_kv_heads, d_ff=cfg.d_ff,
            attn_window=cfg.attn_window or None, attention_dropout=cfg.attn_dropout))
        spec = LoopSpec(cfg.loop_prelude, cfg.loop_core, cfg.n_layers - cfg.loop_prelude - cfg.loop_core,
                        cfg.loop_iterations, cfg.loop_inject)
        return LoopedLM(lm, spec)
    mk = qwen3_config if cfg.arch == "qwen3" else gpt2_config
    kw = dict(n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads, max_len=cfg.max_len,
              tie_word_embeddings=cfg.tie_embeddings)
    if cfg.arch == "qwen3":
        kw.update(n_kv_heads=cfg.n_kv_heads, d_ff=cfg.d_ff, attn_window=cfg.attn_window or None,
                  attention_dropout=cfg.attn_dropout)
    model = _init_gate(FullBandwidthLM.from_config(mk(vocab_size, **kw)), cfg)
    if cfg.depth_scale:
        with torch.no_grad():
            for name, p in model.lm.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight", "c_proj.weight")):
                    p.mul_(1 / math.sqrt(2 * cfg.n_layers))
    return model


def loop_iterations_at(cfg: TrainConfig, step: int) -> int:
    """The r of a looped model's training step: 1 + Poisson(r - 1), capped at 2r, from a stream seeded by (seed,
    step) alone, so every process of a run (and a resumed run) draws the same r."""
    import numpy as np

    r = cfg.loop_iterations
    return int(min(most_loop_iterations(r), 1 + np.random.default_rng([cfg.seed, step, 0x100F]).poisson(r - 1)))


def context_limit(lm) -> int | None:
    c = lm.config
    return getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)
