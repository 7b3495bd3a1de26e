"""Running the model on LEACE-erased values (the statistics: stats.erasure, fitted per grouped fold).

Running the model on an erased residual goes through interventions.core (`Patch` values, `CausalContext.run`);
`run_recording` reads the residual stream of such a run at T with the engine's ResidualRecorder, and
`erased_depth_acts` is what `probes.run --erase DEPTH` uses (probes.erase): per fold, the residual at (DEPTH, T)
of every row erased by that fold's eraser, the model run on, and depths DEPTH..L at T recorded (recomputed from
the erased value and the unchanged context).
"""
from __future__ import annotations

import numpy as np
import torch

from stats.erasure import FoldErasers


# ----- running the model on erased values (interventions.core's patch runner) ------------------------------
def run_recording(ctx, mode: str, patches) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits at T [B, V], residual stream at T [B, L+1, D]) of `ctx.run(mode, patches)`.

    The recorder keeps the last column of every model call; the last call of every mode computes T
    (recurrent: the one-token step at T; standard / fused-n: the full-width pass), so what remains is T.
    Recorder hooks run before the patch hooks (registered first), so a patched depth itself shows the
    unpatched value; it is overwritten with the patch value here."""
    from engine.hooks import ResidualRecorder

    patches = list(patches)
    with ResidualRecorder(ctx.model) as rec:
        rec.cols = torch.tensor([-1])
        logits = ctx.run(mode, patches).logits
        resid = rec.take()[:, 0]  # [B, L+1, D]
    for p in patches:
        if p.site == "resid" and p.pos == -1:
            resid[:, p.depth] = p.value.to(resid.dtype)
    return logits, resid


def erased_depth_acts(model, token_ids, samples, label_ids, mode: str, depth: int, clean_at_depth: np.ndarray,
                      folds, n_classes: int, batch_pairs: int = 16,
                      pad_id: int = 0) -> tuple[list[np.ndarray], FoldErasers]:
    """probes.run --erase: per fold f, activations [n, L+1, D] at T of every row with the residual at
    (depth, T) replaced by fold f's LEACE-erased value (depths < depth: zeros, not recomputed).

    `clean_at_depth` [n, D]: the clean residual at (depth, T) (the collector's), on which the erasers are fitted
    (training rows of each fold). Rows are run in batches of whole pairs (interventions.core.Batch needs them)."""
    from engine.prefill import pad_left

    from .core import Batch, CausalContext, Patch

    n = len(samples)
    y = np.array([s.label for s in samples])
    groups = np.array([s.group_id for s in samples])
    X = torch.from_numpy(np.asarray(clean_at_depth, dtype=np.float32))
    fe = FoldErasers(X, y, folds, n_classes)
    members: dict = {}
    for i, s in enumerate(samples):
        members.setdefault(s.pair_id, []).append(i)
    pairs = sorted(members.values(), key=lambda m: (max(len(token_ids[i]) for i in m), m))
    L = model.n_layers
    out = [np.zeros((n, L + 1, model.d_model), dtype=np.float32) for _ in folds]
    for s in range(0, len(pairs), batch_pairs):
        rows = [i for m in pairs[s:s + batch_pairs] for i in m]
        local = {r: j for j, r in enumerate(rows)}
        pair = [local[next(o for o in members[samples[r].pair_id] if o != r)] for r in rows]
        ids, mask = pad_left([token_ids[r] for r in rows], pad_id)
        b = Batch(ids, mask, torch.tensor(y[rows]), torch.tensor(pair), groups[rows], tuple(label_ids))
        ctx = CausalContext(model, b, check_engine=False, modes=(mode,))
        for f in range(len(folds)):
            value = fe.by_fold(X[rows], f)
            _, resid = run_recording(ctx, mode, [Patch("resid", value, depth=depth, pos=-1)])
            out[f][rows, depth:] = resid[:, depth:].float().numpy()
    return out, fe
