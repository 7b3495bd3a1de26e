"""What a prefill returns, in every mode (engine.prefill and engine.recirculation both build it)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common.errors import UserError


@dataclass
class PrefillResult:
    mode: str
    positions: tuple[int, ...]  # negative offsets from the end
    logits: torch.Tensor | None  # [batch, n_pos, vocab]; None from prefill_many(logits=False)
    top: torch.Tensor  # [batch, n_pos, d_model] post-final-norm state (fed back at the next position)
    resid: torch.Tensor | None = None  # [batch, n_pos, L+1, d_model] residual stream at every depth
    iterations: torch.Tensor | None = None  # [batch] loop-R:TOL only: the iterations each prompt ran (its exit)


def require_finite(logits: torch.Tensor, where: str, cause: str | None = None) -> None:
    """UserError where any row of `logits` [batch, ..., vocab] holds a NaN or inf: a model whose forward overflows
    (or diverges) has no accuracy or logit difference there, and a number computed from it would be wrong.
    `cause`: what the message blames (default: the forward overflows in the logits' dtype; a caller that has moved
    the logits to float32 names the model's own dtype)."""
    bad = ~torch.isfinite(logits).reshape(logits.shape[0], -1).all(-1)  # [batch]
    if bool(bad.any()):
        cause = cause or f"its forward overflows or diverges in {logits.dtype}"
        raise UserError(f"{where}: the model's logits are NaN or inf in {int(bad.sum())} of {len(bad)} rows "
                        f"({cause}): no accuracy or logit difference is defined there")
