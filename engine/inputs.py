"""Input checks and padding shared by both engines (feedback and recirculation): one message per mistake."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from common.errors import UserError


def pad_left(seqs: list[list[int]], pad_id: int | None = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists -> (input_ids [batch, T], attention_mask [batch, T]). `pad_id` None (a tokenizer
    without a pad token, as most GPT-2 and Llama ones): 0, an id every vocabulary has; masked, it is never read."""
    if not seqs:
        raise UserError("empty dataset: nothing to run")
    pad_id = 0 if pad_id is None else pad_id
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s) == 0:
            raise UserError(f"sample {i} is empty")
        ids[i, T - len(s):] = torch.as_tensor(s, dtype=torch.long)
        mask[i, T - len(s):] = 1
    return ids, mask


# Rotary types whose frequencies do not depend on max_position_embeddings or the sequence length: a windowed model
# with these sees only relative positions. The others (dynamic NTK rescales past the context, YaRN / LongRoPE are
# fitted to an original context) keep the limit.
RELATIVE_ROPE_TYPES = frozenset({"default", "linear"})


def _rope_params(config) -> list[dict]:
    """The rotary settings the model's layers use (transformers 5's rope_parameters, or an older rope_scaling): one
    dict, or one per layer type for a model type whose HF model builds its rotary per type (Family.rope_by_layer_type:
    Gemma 3's {"full_attention": {...}, "sliding_attention": {...}}, the keys naming layer types, as HF nests them);
    [] if none."""
    from models.families import FAMILIES, model_type_of

    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return []
    if not any(model_type_of(config) in f.rope_by_layer_type for f in FAMILIES):
        return [params]  # a flat reader: a stray per-type key changes nothing
    types = getattr(config, "layer_types", None) or ()
    nested = [params[k] for k in params if k in types and isinstance(params[k], dict)]
    return nested or [params]


def _rope_types(config) -> set[str]:
    """Every rotary type the model's layers use ({"default"} without settings)."""
    return {p.get("rope_type", p.get("type", "default")) for p in _rope_params(config)} or {"default"}


def context_length(config, windows=None) -> int | None:
    """The model's context (Llama-style max_position_embeddings, GPT-2-style n_positions), None if unbounded.

    `windows` (the per-layer attention windows, models.families): a rotary model whose every layer is windowed has
    no context limit (every position attends to its last W columns, and rotary positions are relative), so it is
    unbounded; a learned absolute position table (GPT-2's n_positions), any full-attention layer, or a scaled rotary
    type whose frequencies depend on the context (dynamic NTK, YaRN, LongRoPE, ...) keeps it."""
    if (windows and all(w is not None for w in windows) and getattr(config, "n_positions", None) is None
            and _rope_types(config) <= RELATIVE_ROPE_TYPES):
        return None
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def model_context(model) -> int | None:
    """context_length of an engine model (its family gives the windows)."""
    family = getattr(model, "family", None)
    return context_length(model.config, None if family is None else family.windows(model.config))


# Rotary types that pick their frequencies by the sequence length of each call (LongRoPE: the long factors once a
# call's positions pass the original context). Dynamic NTK is not one in transformers 5: it rescales only past
# max_position_embeddings, which check_inputs refuses.
PER_CALL_ROPE_TYPES = frozenset({"longrope"})


def _per_call_contexts(config) -> list[tuple[str, int]]:
    """(rotary type, original context) of each layer type whose rotary is a per-call one (they may differ)."""
    out = []
    for p in _rope_params(config):
        rope = p.get("rope_type", p.get("type"))
        original = p.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings",
                                                                         None)
        if rope in PER_CALL_ROPE_TYPES and original is not None:
            out.append((rope, int(original)))
    return out


def check_stepwise(model, attention_mask: torch.Tensor, what: str, steps: int | None = None,
                   new_tokens: int = 0) -> None:
    """Refuse (UserError) a run whose calls straddle a per-call rotary type's original context: its first call (the
    prompt's first `longest - steps + 1` columns; every column after the first when `steps` is None, the whole
    prompt when 0) within it and a later column past it, where a one-token step and a full pass are different
    models (HF's own generate recomputes without its cache there). `new_tokens`: generated tokens after the prompt.
    A run whose every call lies past it, or within it, is one model."""
    longest = int(attention_mask.sum(-1).max())
    first = 1 if steps is None else max(longest - max(steps - 1, 0), 1)  # k past the prompt: every column a step
    for rope, original in _per_call_contexts(model.config):
        if first <= original < longest + new_tokens:
            raise UserError(f"{what} on a model with {rope} rotary embeddings: its first call covers {first} of "
                            f"{longest + new_tokens} columns, across its original context ({original}), past which "
                            "the frequencies depend on each call's length (a one-token step and a full pass would "
                            f"compute different models); use at most {original} columns in all, or standard / "
                            "fused-N")


def check_inputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 positions: tuple[int, ...] = (-1,)) -> None:
    """Left-padded [batch, T] ids and mask within the model's context; positions are offsets -T..-1."""
    if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
        raise UserError("input_ids and attention_mask must both be [batch, T]")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise UserError("empty dataset: nothing to run")
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):  # positions are its running sum
        raise UserError("attention_mask must hold 0 (padding) and 1 (a real token) only")
    if not bool(attention_mask[:, -1].all()):
        raise UserError("prompts must be left-padded (the last column must be a real token in every row)")
    real = attention_mask.bool()
    holes = (real[:, :-1] & ~real[:, 1:]).any(-1)  # [batch] a real column before a padding one: a hole
    if bool(holes.any()):
        row = int(holes.nonzero()[0, 0])
        raise UserError(f"prompts must be left-padded: row {row} has a padding column between real tokens "
                        "(the fed state's chain would break there)")
    emb = model.lm.get_input_embeddings() if hasattr(model, "lm") else None
    if emb is not None and input_ids.numel():  # an id past the embedding table: one line, not an IndexError
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= emb.num_embeddings:
            raise UserError(f"token id {lo if lo < 0 else hi} is outside the model's vocabulary 0..{emb.num_embeddings - 1}")
    T = input_ids.shape[1]
    ctx = model_context(model)
    lengths = attention_mask.sum(-1)  # [batch] real tokens a row
    longest = int(lengths.max())
    if ctx is not None and longest > ctx:
        raise UserError(f"prompt of {longest} tokens is longer than the model's context ({ctx})")
    for rope, original in _per_call_contexts(model.config):  # HF picks them by the batch's longest row
        shortest = int(lengths.min())
        if shortest <= original < longest:
            raise UserError(f"a batch with prompts of {shortest} to {longest} tokens on a model "
                            f"with {rope} rotary embeddings: rows within its original context ({original}) would take "
                            "the frequencies of the rows past it (each call picks one set for the whole batch), not "
                            f"their own; batch the prompts of at most {original} tokens apart from the longer ones")
    for p in positions:
        if not (-T <= p < 0):
            raise UserError(f"position {p} out of range for prompts of {T} columns (use -1 .. -{T})")


def to_model(model, *tensors):
    """The tensors on the device of the model's input embedding (a device-mapped model: its first device)."""
    dev = model.lm.get_input_embeddings().weight.device
    return tuple(t.to(dev) for t in tensors)


@contextmanager
def eval_mode(model: torch.nn.Module):
    """Run the block with `model` in eval mode, then put every module back in the mode it was in (also on an
    error or interrupt): a library call that needs eval mode (the collector, a quick evaluation) leaves the
    caller's model as it found it, e.g. training with dropout."""
    was = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in was:
            m.training = training
