"""Test-time compute of a looped model (models.looped): the adaptive exit of a loop-R:TOL mode.

Huginn-0125 stops iterating a token once its state stops changing. For the prefill the suite scores (one answer at
T), the exit is taken per prompt: one pass with R iterations records the loop state at T after every iteration
(s_0 .. s_R, depth P + R_core i); the prompt's exit is the first i >= 1 with |s_i - s_(i-1)| / |s_i| < TOL (R if
none), and its answer is the model run with exactly that many iterations (every column iterated as often: the
coda reads all of them). Rows are independent, so the prompts that exit at the same i run together.
"""
from __future__ import annotations

import torch

from engine.hooks import ResidualRecorder
from engine.result import PrefillResult


def exit_iterations(states: torch.Tensor, tol: float) -> torch.Tensor:
    """[batch] the first i in 1..R whose relative change |s_i - s_(i-1)| / |s_i| < tol (R where none), from the
    loop states at T, states [batch, R+1, D] (s_0 .. s_R)."""
    change = (states[:, 1:] - states[:, :-1]).norm(dim=-1) / states[:, 1:].norm(dim=-1).clamp_min(1e-12)  # [B, R]
    below = change < tol
    R = states.shape[1] - 1
    return torch.where(below.any(1), below.float().argmax(1) + 1, torch.full_like(below[:, 0], R, dtype=torch.long))


def adaptive_exit(model, ids: torch.Tensor, mask: torch.Tensor, r_max: int, tol: float, positions, name: str
                  ) -> PrefillResult:
    """The PrefillResult of loop-R:TOL (module doc), with `iterations` [batch] the exit of every prompt."""
    from models.looped import looping, require_looped

    model = require_looped(model, name)
    spec = model.spec
    T = ids.shape[1]
    with looping(model, r_max), ResidualRecorder(model) as rec:
        rec.cols = torch.tensor([T - 1])
        model(ids, mask, last_logits=True)
        resid = rec.take()[:, 0]  # [B, L+1, D] at T
    states = resid[:, [spec.prelude + spec.core * i for i in range(r_max + 1)]].float()
    r_exit = exit_iterations(states, tol)
    cols = torch.tensor([T + p for p in positions])
    logits = top = None
    for r in sorted(set(r_exit.tolist())):
        rows = (r_exit == r).nonzero()[:, 0]
        with looping(model, r):
            out = model(ids[rows], mask[rows])
        if logits is None:
            logits = out.logits.new_zeros((ids.shape[0], len(cols), out.logits.shape[-1]))
            top = out.top.new_zeros((ids.shape[0], len(cols), out.top.shape[-1]))
        logits[rows], top[rows] = out.logits[:, cols], out.top[:, cols]
    return PrefillResult(name, tuple(positions), logits, top, None, r_exit.cpu())
