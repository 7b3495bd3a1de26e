"""Running the model on LEACE-erased values (the statistics: stats.erasure, fitted per grouped fold).

Running the model on an erased residual goes through interventions.core (`Patch` values, `CausalContext.run`);
`run_recording` reads the residual stream of such a run at T with the engine's recorder (engine.patching.
record_at_T). `probes.run --erase` runs the engine's patcher itself (probes.erase).
"""
from __future__ import annotations

import torch


# ----- running the model on erased values (interventions.core's patch runner) ------------------------------
def run_recording(ctx, mode: str, patches) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits at T [B, V], residual stream at T [B, L+1, D]) of `ctx.run(mode, patches)` (engine.patching.
    record_at_T)."""
    from engine.patching import record_at_T

    patches = list(patches)
    return record_at_T(ctx.runner(mode), lambda: ctx.run(mode, patches).logits, patches)
