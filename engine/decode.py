"""Greedy decoding after a prefill: the checks every decoding makes and the cached one-token loop.

engine.prefill.generate runs every decoding (std, soft, fused) through these; `greedy` is std decoding alone
(token embeddings only: the base model's own cached greedy decoding), which engine.recirculation also uses for
identity mixing. Below both, so neither imports the other for it.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from common.cpus import sequential_threads
from common.errors import UserError
from engine.cache import new_cache
from engine.inputs import check_inputs, check_stepwise, model_context, to_model


def check_generation(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) on the model's device; UserError for a negative count, bad inputs, or a run
    longer than the model's context."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise UserError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    check_inputs(model, input_ids, attention_mask, (-1,))
    input_ids, attention_mask = to_model(model, input_ids, attention_mask)
    ctx = model_context(model)
    longest = int(attention_mask.sum(-1).max())
    if ctx is not None and longest + max_new_tokens - 1 > ctx:  # the last new token is never fed back in
        raise UserError(f"{longest} prompt tokens + {max_new_tokens} new tokens exceed the model's context ({ctx})")
    # the prompt in one call, then a step a token (the last new one is never fed back in)
    check_stepwise(model, attention_mask, "generation", steps=0, new_tokens=max(max_new_tokens - 1, 0))
    return input_ids, attention_mask


def next_token(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(greedy token ids [batch], whether each row's top logit is finite [batch]) from logits [batch, vocab]: a NaN
    row's max is NaN, where argmax answers a token all the same. One pass (max), and no host sync per step: the
    caller collects the flags and checks them once (`check_finite_steps`)."""
    top, tok = logits.max(-1)  # max's index is argmax's (the first maximum)
    return tok, torch.isfinite(top)


def check_finite_steps(ok: torch.Tensor, dtype: torch.dtype) -> None:
    """UserError where any row's greedy step met NaN / inf logits (`ok`: [batch] flags, and-ed over the steps)."""
    if not bool(ok.all()):
        cause = f"its forward overflows or diverges in {dtype}"
        if dtype == torch.float64:
            cause += ("; in float64, eager attention turns a left-padded row's masked queries into NaN: run the "
                      "model in float32 or with SDPA attention")
        raise UserError(f"generation: the model's logits are NaN or inf in {int((~ok).sum())} of {len(ok)} rows "
                        f"({cause}): their tokens would be arbitrary")


@contextmanager
def step_loop():
    """The context of every loop of cached one-token steps (the recurrence, decoding): 1 torch thread
    (common.cpus.sequential_threads) and, without autograd, torch.inference_mode, ~12% less per-op overhead on a
    step that is nearly all overhead. Tensors made inside are inference tensors: a caller copies what it keeps
    into tensors of its own (functional ops outside read them freely), and engine.cache.GrowLayer copies such a
    buffer before writing it outside."""
    with sequential_threads(), (torch.inference_mode() if not torch.is_grad_enabled() else nullcontext()):
        yield


def greedy_steps(model, out, cache, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 fed: bool) -> torch.Tensor:
    """New token ids [batch, max_new_tokens] after a prefill `out` (its logits and top state at the last column)
    and its KV `cache`; `fed`: every new token is fused with the previous top state (soft, fused), else token
    embeddings only (std)."""
    prev, logits = out.top[:, -1], out.logits[:, -1]
    mask = attention_mask
    new, ok = [], torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    with step_loop():
        for step in range(max_new_tokens):
            tok, finite = next_token(logits)  # [batch]
            new.append(tok)
            ok = ok & finite
            if step == max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            state = prev[:, None] if fed else None
            out = model(tok[:, None], mask, state=state, cache=cache, use_cache=True)
            prev, logits = out.top[:, -1], out.logits[:, -1]
    check_finite_steps(ok, logits.dtype)
    return torch.stack(new, dim=1) if new else input_ids.new_zeros((input_ids.shape[0], 0))


@torch.no_grad()
def greedy(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """std decoding: the model's cached greedy decoding on token embeddings. New token ids [batch, max_new_tokens]."""
    input_ids, attention_mask = check_generation(model, input_ids, attention_mask, max_new_tokens)
    out = model(input_ids, attention_mask, cache=new_cache(reserve=max_new_tokens), use_cache=True)
    return greedy_steps(model, out, out.cache, input_ids, attention_mask, max_new_tokens, fed=False)
