"""FullBandwidthLM: any HF causal LM whose next input fuses the previous position's top state.

Address space (nnsight / named_modules):
    lm                      the wrapped HF causal LM (untouched; its blocks are `lm.<base>.layers.i` or `.h.i`)
    fusion                  Fusion(state, embed) -> fused input of block 0   [batch, pos, d_model]
    fusion.up / .gate / .norm  W_U, W_G and the post-fusion RMSNorm

The fed-back state is the vector the LM head reads (post-final-norm), which keeps its scale O(1).

Checkpoint format (a directory):
    config.json         {"format": "full-bandwidth-lm", "format_version": 1,
                         "base_config": <HF config dict of the wrapped LM>,
                         "fusion": {"enabled": bool, "d_model": int, "eps": float, "state": "post_final_norm"}}
    model.safetensors   state dict: "lm.*" (the HF model's own names under "lm."),
                        "fusion.up.weight", "fusion.gate.weight", "fusion.norm.weight" ([d_model, d_model],
                        [d_model, d_model], [d_model]); tied weights stored once.
    tokenizer.json etc. optional, written by the tokenizer's own save_pretrained.
    MODEL_CARD.md / train_log.json  optional, written by the trainer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from common.errors import UserError
from models.fusion import Fusion

FORMAT = "full-bandwidth-lm"
FORMAT_VERSION = 1


@dataclass
class LMOutput:
    logits: torch.Tensor  # [batch, pos, vocab]
    top: torch.Tensor  # [batch, pos, d_model] post-final-norm state: what the LM head reads and what is fed back
    cache: object | None = None
    hidden: tuple | None = None  # with hidden_states=True: block 0's input and every block's output ([-1] = top)


def decoder_layers(lm: PreTrainedModel) -> nn.ModuleList:
    """The list of transformer blocks of an HF causal LM (Llama/Qwen3-style `layers`, GPT-2-style `h`)."""
    base = lm.base_model
    for name in ("layers", "h", "blocks"):
        layers = getattr(base, name, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise UserError(f"cannot find the decoder blocks of {type(lm).__name__} (looked for layers/h/blocks)")


def positions_from_mask(attention_mask: torch.Tensor, q_len: int) -> torch.Tensor:
    """Position ids of the last q_len columns for a left-padded mask: count of real tokens before each."""
    pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return pos[:, -q_len:]


def embedding_rms(lm: PreTrainedModel) -> float:
    """RMS of the input token embeddings: the scale the blocks were built for."""
    return float(lm.get_input_embeddings().weight.detach().float().pow(2).mean().sqrt())


class FullBandwidthLM(nn.Module):
    def __init__(self, lm: PreTrainedModel, fusion: bool = True, eps: float = 1e-6):
        super().__init__()
        self.lm = lm
        d_model = lm.config.hidden_size
        self.fusion = Fusion(d_model, eps) if fusion else None
        if self.fusion is not None:
            # Start the fused input at the scale of the token embeddings the blocks were built for.
            with torch.no_grad():
                self.fusion.norm.weight.fill_(embedding_rms(lm))

    # ----- construction -------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, base_config, fusion: bool = True, seed: int | None = None) -> "FullBandwidthLM":
        if seed is not None:
            torch.manual_seed(seed)
        lm = AutoModelForCausalLM.from_config(base_config)
        return cls(lm, fusion=fusion)

    @property
    def config(self):
        return self.lm.config

    @property
    def n_layers(self) -> int:
        return len(decoder_layers(self.lm))

    @property
    def d_model(self) -> int:
        return self.lm.config.hidden_size

    @property
    def has_fusion(self) -> bool:
        return self.fusion is not None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm.get_input_embeddings()(input_ids)  # [batch, pos, d_model]

    def token_gate(self, input_ids: torch.Tensor) -> torch.Tensor:
        """sigmoid(W_G e_t) for these tokens: [batch, q, d_model] (pass it as forward's `gate` to reuse it)."""
        if self.fusion is None:
            raise UserError("this model has no fusion module: only standard (unfused) prefill is possible")
        return self.fusion.token_gate(self.embed(input_ids))

    # ----- forward ------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,  # [batch, q]
        attention_mask: torch.Tensor | None = None,  # [batch, past + q]
        state: torch.Tensor | None = None,  # [batch, q, d_model]; state[:, t] is the top state of position t-1
        fuse_mask: torch.Tensor | None = None,  # [batch, q] bool; where False the plain embedding is used
        cache=None,
        use_cache: bool = False,
        position_ids: torch.Tensor | None = None,
        gate: torch.Tensor | None = None,  # [batch, q, d_model]: token_gate(input_ids), precomputed (see Fusion)
        hidden_states: bool = False,  # also return the residual stream after every block (LMOutput.hidden)
    ) -> LMOutput:
        x = self.embed(input_ids)
        if state is not None:
            if self.fusion is None:
                raise UserError("this model has no fusion module: only standard (unfused) prefill is possible")
            fused = self.fusion(state.to(x.dtype), x, gate)
            x = fused if fuse_mask is None else torch.where(fuse_mask[..., None], fused, x)
        if attention_mask is None:
            attention_mask = torch.ones(input_ids.shape[0], input_ids.shape[1], dtype=torch.long,
                                        device=input_ids.device)
        if position_ids is None:
            position_ids = positions_from_mask(attention_mask, input_ids.shape[1])
        padded = not bool(attention_mask.all())
        # CPU SDPA with an explicit padding mask falls back to a slow kernel (measured ~3x slower than eager
        # on the tiny presets); without padding the mask is dropped so SDPA takes its causal fast path.
        impl = self.lm.config._attn_implementation
        use_eager = padded and input_ids.shape[1] > 1 and impl == "sdpa"
        if use_eager:
            self.lm.config._attn_implementation = "eager"
        try:
            out = self.lm.base_model(inputs_embeds=x, attention_mask=attention_mask if padded else None,
                                     position_ids=position_ids, cache=cache, use_cache=use_cache,
                                     **({"output_hidden_states": True} if hidden_states else {}))
        finally:
            self.lm.config._attn_implementation = impl
        top = out.last_hidden_state
        logits = self.lm.get_output_embeddings()(top)
        return LMOutput(logits=logits, top=top, cache=out.cache if use_cache else None,
                        hidden=tuple(out.hidden_states) if hidden_states else None)

    # ----- persistence --------------------------------------------------------------------------------
    def fusion_settings(self) -> dict:
        return {"enabled": self.fusion is not None, "d_model": self.d_model,
                "eps": self.fusion.norm.eps if self.fusion is not None else 1e-6, "state": "post_final_norm"}

    def save_pretrained(self, path: str | Path, tokenizer=None) -> None:
        from safetensors.torch import save_model

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        cfg = {"format": FORMAT, "format_version": FORMAT_VERSION, "base_config": self.lm.config.to_dict(),
               "fusion": self.fusion_settings()}
        # Write to temporary names, then rename: a crash never leaves a half-written checkpoint.
        tmp_w, tmp_c = path / "model.safetensors.tmp", path / "config.json.tmp"
        save_model(self, str(tmp_w))
        tmp_c.write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
        tmp_w.replace(path / "model.safetensors")
        tmp_c.replace(path / "config.json")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))

    @classmethod
    def read_config(cls, path: str | Path) -> dict:
        path = Path(path)
        cfg_file = path / "config.json"
        if not path.is_dir():
            raise UserError(f"no checkpoint directory at {path}")
        if not cfg_file.is_file() or not (path / "model.safetensors").is_file():
            raise UserError(f"{path} is not a full-bandwidth checkpoint (needs config.json and model.safetensors)")
        try:
            cfg = json.loads(cfg_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"corrupt checkpoint config {cfg_file}: {e}") from None
        if not isinstance(cfg, dict) or cfg.get("format") != FORMAT:
            fmt = cfg.get("format") if isinstance(cfg, dict) else type(cfg).__name__
            raise UserError(f"{cfg_file} is not a {FORMAT} config (format={fmt!r})")
        base, fusion = cfg.get("base_config"), cfg.get("fusion")
        if not (isinstance(base, dict) and isinstance(base.get("model_type"), str)
                and isinstance(fusion, dict) and isinstance(fusion.get("enabled"), bool)):
            raise UserError(f"corrupt checkpoint config {cfg_file}: needs base_config.model_type and fusion.enabled")
        return cfg

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "FullBandwidthLM":
        from safetensors.torch import load_model

        path = Path(path)
        cfg = cls.read_config(path)
        base = dict(cfg["base_config"])
        model_type = base.pop("model_type")
        try:
            base_config = AutoConfig.for_model(model_type, **base)
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"cannot build the base model config of {path} (model_type={model_type!r}): "
                            f"{str(e)[:200]}") from None
        model = cls.from_config(base_config, fusion=cfg["fusion"]["enabled"])
        try:
            missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
        except Exception as e:  # safetensors raises several types for truncated/corrupt files
            raise UserError(f"corrupt checkpoint weights {path / 'model.safetensors'}: {e}") from None
        # Tied output weights are legitimately absent; anything else missing means a broken checkpoint.
        tied = {k for k in missing if k.endswith("lm_head.weight") and model.lm.config.tie_word_embeddings}
        if set(missing) - tied or unexpected:
            raise UserError(f"checkpoint {path} does not match its config (missing {sorted(set(missing) - tied)[:3]}, "
                            f"unexpected {sorted(unexpected)[:3]})")
        model.eval()
        return model
