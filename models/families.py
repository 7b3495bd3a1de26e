"""Architecture families: where each kind of HF causal LM keeps its blocks, norm, embedding and head.

One small frozen adapter per family says, for the models of the `model_type`s it covers:
    blocks        the decoder blocks (an nn.ModuleList), relative to `lm.base_model`
    final_norm    the norm between the last block and the LM head, relative to `lm.base_model`
    embedding     the input token embedding, relative to `lm.base_model`
    head          the LM head, relative to the causal LM (`lm`)
    attn / mlp    the attention and MLP modules inside a block (OPT has no MLP module: its fc2, whose output is the
                  MLP's, on rows flattened to [batch * cols, d_model]: `flat_mlp`)
    attn_out      the attention's output projection inside `attn` (o_proj / c_proj / dense): its *input* is the
                  concatenation of the heads' outputs [.., n_heads * head_dim], the per-head site
    depth / width / heads / head_dim / context   the config fields that give them (GPT-2 spells them n_layer,
                  n_embd, n_head, n_positions)
    windows       per-layer attention windows from `layer_types` and `sliding_window` (HF's meaning: a sliding
                  layer's position attends to itself and the `sliding_window - 1` before it); None = full causal.
                  Only where the model type's HF base model reads them (`window_rules`): Mistral applies
                  `sliding_window` to every layer, Qwen2/3 and Gemma 2/3 per `layer_types`; Llama, Gemma 1, GPT-2
                  and GPT-NeoX ignore both, so a stray `sliding_window` in their config.json changes nothing
    post_norms    the model types whose blocks norm each branch's output before the residual add (Gemma 2 / 3,
                  OLMo 2): there the attn_out / mlp_out sites are those norms' outputs (what is added, as in
                  TransformerLens)
    logit_softcap the config field of a final logit soft-cap (Gemma 2/3: logits = c * tanh(logits / c))
    rope_by_layer_type  the model types whose HF model builds a rotary embedding per layer type from a nested
                  rope_parameters (Gemma 3); the others read it flat (engine.inputs reads it as the model does)
    lean_step     whether models.lean_step runs its cached one-token steps (else HF's base model does)
    own_causal_bias  the attention adds a causal bias of its own (GPT-Neo): blockwise recirculation is refused
    attention_masks  a custom 4-D mask pattern with each layer's window applied (HF uses a 4-D mask as given)

Semantics the engine relies on and every family here shares: the decoder blocks take the residual stream as
their first argument (positionally or as `hidden_states`) and return it as a tensor (transformers 5; a tuple's
first element is accepted by engine/hooks.py), `base_model(inputs_embeds=..., attention_mask=...,
position_ids=..., cache=..., use_cache=...)` runs them, and a 4-D float attention mask is used as given. What a
family adds inside the base model before block 0 (GPT-2's learned position embedding; Gemma's sqrt(width) scale
lives in its embedding module) is part of depth 0, the vector entering block 0.

`family_of(model_or_config)` returns the adapter of a causal LM, a FullBandwidthLM, an HF config or a config
dict; any other `model_type` is refused in one line naming the supported families. docs/design.md, "Extending",
says how to add a family.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from common.errors import UserError


def _field(config, key):
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def _path(root: nn.Module, path: str, what: str, family: str) -> nn.Module:
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise UserError(f"the {family} family adapter finds no {what} at `{path}` of {type(root).__name__}")
    return obj


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    blocks: str = "layers"
    final_norm_path: str = "norm"
    embedding_path: str = "embed_tokens"
    head_path: str = "lm_head"
    attn_path: str = "self_attn"
    mlp_path: str = "mlp"
    attn_out_path: str = "o_proj"
    depth_field: str = "num_hidden_layers"
    width_field: str = "hidden_size"
    heads_field: str = "num_attention_heads"
    context_field: str = "max_position_embeddings"
    logit_softcap_field: str | None = None
    softcap_types: tuple[str, ...] = ()  # the model types whose HF model reads the soft-caps (Gemma 2 / 3, not 1)
    positions: str = "rotary"  # how positions enter: "rotary" (in attention) or "learned" (added before block 0)
    lean_step: bool = False  # models.lean_step reproduces its one-token step (HF's Llama / Qwen decoder layers)
    flat_mlp: bool = False  # the MLP runs on the rows flattened, [batch * cols, d_model] (OPT)
    # its attention adds a causal bias of its own (GPT-Neo, local windows included), sliced as though the queries
    # were the last keys: a custom pattern whose queries are not (blockwise recirculation) would be masked wrongly
    own_causal_bias: bool = False
    # (model_type, rule) for the types whose HF base model windows attention: "all" (every layer gets
    # `sliding_window`, Mistral) or "layer_types" (the layers typed "sliding_attention"); other types attend fully
    window_rules: tuple[tuple[str, str], ...] = ()
    # the model types whose HF model builds one rotary embedding per layer type from a nested rope_parameters
    # (Gemma 3: {"full_attention": {...}, "sliding_attention": {...}}); the others read it flat, whatever it holds
    rope_by_layer_type: tuple[str, ...] = ()
    # (model_type, attention's post-norm, MLP's post-norm) for the types whose blocks norm each branch's output
    # before adding it to the residual stream (sandwich norms: Gemma 2 / 3, OLMo 2)
    post_norms: tuple[tuple[str, str, str], ...] = ()

    # ----- modules ------------------------------------------------------------------------------------------
    def layers(self, lm) -> nn.ModuleList:
        layers = _path(lm.base_model, self.blocks, "decoder blocks", self.name)
        if not isinstance(layers, nn.ModuleList):
            raise UserError(f"the {self.name} family adapter expects the decoder blocks of {type(lm).__name__} at "
                            f"`{self.blocks}` to be a ModuleList, got {type(layers).__name__}")
        return layers

    def final_norm(self, lm) -> nn.Module:
        return _path(lm.base_model, self.final_norm_path, "final norm", self.name)

    def embedding(self, lm) -> nn.Module:
        return _path(lm.base_model, self.embedding_path, "input embedding", self.name)

    def head(self, lm) -> nn.Module:
        return _path(lm, self.head_path, "LM head", self.name)

    def attention(self, block: nn.Module) -> nn.Module:
        return _path(block, self.attn_path, "attention module", self.name)

    def mlp(self, block: nn.Module) -> nn.Module:
        return _path(block, self.mlp_path, "MLP module", self.name)

    def residual_update(self, block: nn.Module, site: str, model_type: str) -> nn.Module:
        """The module whose output block `block` adds to the residual stream for `site` ("attn_out" | "mlp_out"):
        the attention or the MLP, or the norm after it in a model type with sandwich norms. That sum is what
        TransformerLens' hook_attn_out / hook_mlp_out hold ("that which is added to the residual stream")."""
        post = dict((t, (a, m)) for t, a, m in self.post_norms).get(model_type)
        if post is not None:
            path = post[0] if site == "attn_out" else post[1]
            return _path(block, path, f"{site} post-norm", self.name)
        return self.attention(block) if site == "attn_out" else self.mlp(block)

    def attn_out(self, block: nn.Module) -> nn.Module:
        """The attention's output projection; its input [.., heads * head_dim] holds head h at
        [h * head_dim, (h + 1) * head_dim) (GPT-2's c_proj is a Conv1D: weight [in, out])."""
        return _path(self.attention(block), self.attn_out_path, "attention output projection", self.name)

    def embed_scale(self, lm) -> float:
        """The factor the embedding module multiplies its rows by (Gemma: sqrt(width); else 1)."""
        scale = getattr(self.embedding(lm), "embed_scale", None)
        return 1.0 if scale is None else float(scale)

    def logits(self, lm, top: torch.Tensor) -> torch.Tensor:
        """The causal LM's logits from its post-final-norm state: the head, then the family's soft-cap if any."""
        logits = self.head(lm)(top)
        capped = self.logit_softcap_field and _field(lm.config, "model_type") in self.softcap_types
        cap = _field(lm.config, self.logit_softcap_field) if capped else None  # a stray key elsewhere: none (HF's)
        if cap is not None:  # as HF tests it (models.configs.check_config refuses a cap <= 0)
            logits = torch.tanh(logits / cap) * cap
        return logits

    # ----- config fields ------------------------------------------------------------------------------------
    def depth(self, config) -> int:
        return _field(config, self.depth_field)

    def width(self, config) -> int:
        return _field(config, self.width_field)

    def heads(self, config) -> int:
        return _field(config, self.heads_field)

    def head_dim(self, config) -> int:
        """The per-head width: the config's head_dim where the model type's HF attention reads it, else width / heads
        (GPT-2, GPT-J, GPT-NeoX, OPT and StableLM ignore a head_dim key)."""
        if model_type_of(config) in HEAD_DIM_FROM_WIDTH:
            return self.width(config) // self.heads(config)
        return _field(config, "head_dim") or self.width(config) // self.heads(config)

    def context(self, config) -> int | None:
        return _field(config, self.context_field)

    def window_rule(self, config) -> str | None:
        """How this model type's HF base model windows attention: "all", "layer_types" or None (`window_rules`)."""
        return dict(self.window_rules).get(model_type_of(config))

    def windows(self, config) -> list[int | None]:
        """Per-layer attention window (HF's `sliding_window`), None for full causal attention, as the model type's
        HF base model applies them (`window_rules`)."""
        n = self.depth(config)
        rule = self.window_rule(config)
        window, types = _field(config, "sliding_window"), _field(config, "layer_types")
        if rule == "layer_types" and types:
            return [window if t == "sliding_attention" else None for t in types[:n]]
        return [window if rule == "all" else None] * n

    def attention_masks(self, config, allowed: torch.Tensor, q_cols: torch.Tensor, k_cols: torch.Tensor,
                        dtype: torch.dtype):
        """`attention_mask` for a custom pattern: `allowed` bool [batch, q, k] over queries and keys that are the
        prompt columns q_cols [q] and k_cols [k] (a column may appear twice, e.g. recirculation's two branches).

        HF uses a 4-D mask as given, in every layer, so a sliding layer would attend to the whole pattern; here
        each layer's window is applied as HF applies it (a key more than window - 1 columns before its query is
        masked). Returns one additive float mask [batch, 1, q, k] (0 allowed, dtype's finite min masked) when
        every layer has the same window, else {layer type: mask}, the form models with `layer_types` take."""
        windows = self.windows(config)
        lag = q_cols.to(allowed.device)[:, None] - k_cols.to(allowed.device)[None, :]  # [q, k]

        def mask(window):
            ok = allowed if window is None else allowed & (lag < window)[None]
            m = torch.zeros(ok.shape, dtype=dtype, device=ok.device)
            m.masked_fill_(~ok, torch.finfo(dtype).min)
            return m[:, None]

        if len(set(windows)) == 1:
            return mask(windows[0])
        types = _field(config, "layer_types")
        return {t: mask(w) for t, w in dict(zip(types, windows)).items()}


HEAD_DIM_FROM_WIDTH = frozenset({"gpt2", "gptj", "gpt_neo", "gpt_neox", "opt", "stablelm"})  # their attention: width // heads

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("llama", "mistral"), lean_step=True, window_rules=(("mistral", "all"),)),
    Family("qwen", ("qwen2", "qwen3"), lean_step=True,
           window_rules=(("qwen2", "layer_types"), ("qwen3", "layer_types"))),
    # Llama's layout (model.layers, self_attn.o_proj, mlp, model.norm) with other blocks: HF's own one-token step
    # (the mixture-of-experts types among them route each token alone: `mlp` is the sparse block, its output the site)
    Family("llama_like", ("olmo", "olmo2", "phi3", "stablelm", "starcoder2", "smollm3",
                          "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"),
           window_rules=(("phi3", "all"), ("starcoder2", "all"), ("smollm3", "layer_types"), ("mixtral", "all"),
                         ("qwen2_moe", "layer_types"), ("qwen3_moe", "all")),
           post_norms=(("olmo2", "post_attention_layernorm", "post_feedforward_layernorm"),)),
    Family("phi", ("phi",), final_norm_path="final_layernorm", attn_out_path="dense"),
    Family("gpt2", ("gpt2",), blocks="h", final_norm_path="ln_f", embedding_path="wte", attn_path="attn",
           attn_out_path="c_proj", depth_field="n_layer", width_field="n_embd", heads_field="n_head",
           context_field="n_positions", positions="learned"),
    Family("gptj", ("gptj",), blocks="h", final_norm_path="ln_f", embedding_path="wte", attn_path="attn",
           attn_out_path="out_proj", depth_field="n_layer", width_field="n_embd", heads_field="n_head",
           context_field="n_positions"),
    # OPT's block has no MLP module: fc2's output is the MLP's (before the residual add)
    Family("opt", ("opt",), blocks="decoder.layers", final_norm_path="decoder.final_layer_norm",
           embedding_path="decoder.embed_tokens", mlp_path="fc2", attn_out_path="out_proj", positions="learned",
           flat_mlp=True),
    Family("gpt_neo", ("gpt_neo",), blocks="h", final_norm_path="ln_f", embedding_path="wte", attn_path="attn",
           attn_out_path="attention.out_proj", depth_field="num_layers", heads_field="num_heads",
           positions="learned", own_causal_bias=True),
    Family("gpt_neox", ("gpt_neox",), final_norm_path="final_layer_norm", embedding_path="embed_in",
           attn_path="attention", attn_out_path="dense"),
    Family("gemma", ("gemma", "gemma2", "gemma3_text"), logit_softcap_field="final_logit_softcapping",
           softcap_types=("gemma2", "gemma3_text"),
           window_rules=(("gemma2", "layer_types"), ("gemma3_text", "layer_types")),
           rope_by_layer_type=("gemma3_text",),
           post_norms=(("gemma2", "post_attention_layernorm", "post_feedforward_layernorm"),
                       ("gemma3_text", "post_attention_layernorm", "post_feedforward_layernorm"))),
)
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def supported() -> str:
    """The supported families and their model types, for messages."""
    return "; ".join(f"{f.name} ({', '.join(f.model_types)})" for f in FAMILIES)


def model_type_of(model_or_config) -> str | None:
    obj = model_or_config
    if isinstance(obj, dict):
        return obj.get("model_type")
    obj = getattr(obj, "lm", obj)  # a FullBandwidthLM: its wrapped causal LM
    obj = getattr(obj, "config", obj)
    return getattr(obj, "model_type", None)


def family_of(model_or_config) -> Family:
    """The family adapter of a causal LM, a FullBandwidthLM, an HF config or a config dict; UserError (one line)
    for a model type no family covers."""
    model_type = model_type_of(model_or_config)
    family = _BY_TYPE.get(model_type) if isinstance(model_type, str) else None  # a list or dict: unhashable
    if family is None:
        raise UserError(f"unsupported model family (model_type {model_type!r}): supported are {supported()}")
    return family


__all__ = ["Family", "FAMILIES", "family_of", "model_type_of", "supported"]
