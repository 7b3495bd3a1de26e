"""What a prefill returns, in every mode (engine.prefill and engine.recirculation both build it)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillResult:
    mode: str
    positions: tuple[int, ...]  # negative offsets from the end
    logits: torch.Tensor | None  # [batch, n_pos, vocab]; None from prefill_many(logits=False)
    top: torch.Tensor  # [batch, n_pos, d_model] post-final-norm state (fed back at the next position)
    resid: torch.Tensor | None = None  # [batch, n_pos, L+1, d_model] residual stream at every depth
    iterations: torch.Tensor | None = None  # [batch] loop-R:TOL only: the iterations each prompt ran (its exit)
