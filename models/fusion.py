"""The gated state fusion u_t = RMSNorm((W_U h_{t-1}) * sigmoid(W_G e_t)): the one place it is computed."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in float32 so the norm is exact for half-precision inputs too.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype)


class Fusion(nn.Module):
    """Fuse the carried top state with the current token embedding.

    The state is on the value path and the token is the gate: an additive fusion would let training
    switch the state off, a multiplicative gate cannot ignore the value path entirely.
    Submodules: `up` (W_U), `gate` (W_G), `norm` (RMSNorm after fusion); all addressable by nnsight.
    """

    def __init__(self, d_model: int, eps: float = 1e-6):
        super().__init__()
        self.up = nn.Linear(d_model, d_model, bias=False)  # W_U: state value path
        self.gate = nn.Linear(d_model, d_model, bias=False)  # W_G: token gate
        self.norm = RMSNorm(d_model, eps)

    def token_gate(self, embed: torch.Tensor) -> torch.Tensor:
        """sigmoid(W_G e_t): [batch, pos, d_model]. Depends on the tokens only, so the same in every Jacobi pass."""
        return torch.sigmoid(self.gate(embed))

    def forward(self, state: torch.Tensor, embed: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        # state, embed: [batch, pos, d_model] -> [batch, pos, d_model]. `gate`: token_gate(embed), when the caller
        # already has it (the multi-pass trainer computes it once per batch, not once per pass).
        if gate is None:
            gate = self.token_gate(embed)
        return self.norm(self.up(state) * gate)
