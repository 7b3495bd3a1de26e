"""The default battery of interventions (SPEC section 5), every one a call of `CausalContext.run`.

Reference for the normalized effect and the flip rate: the donor when there is one (swap, dose, subspace and
layer patches: the paired sample; resample: the random donor), otherwise (bypass, mean, zero, random state)
the paired opposite-label sample, so "1" always means "behaves like the other answer's clean run".
"""
from __future__ import annotations

import time

import torch

from common.errors import UserError
from probes.linear import ProbeConfig

from .core import MODES, POS_NAMES, POSITIONS, CausalContext
from .metrics import label_ld, summarize
from .subspace import energy_fraction, fold_subspaces, per_fold_states

DOSE_GRID = tuple(round(a / 10, 1) for a in range(11))

DESCRIPTIONS = {
    "clean": "no intervention",
    "gate_bypass": "e_T fed to block 0 instead of the fused input",
    "state_swap": "h_{T-1} from the paired sample (opposite label)",
    "resample": "h_{T-1} from a random sample of another pair",
    "mean": "h_{T-1} replaced by its mean over the batch",
    "zero": "h_{T-1} replaced by zeros",
    "random_state": "h_{T-1} replaced by a Gaussian vector of the same norm",
    "subspace_swap": "only the probe-subspace component of h_{T-1} from the paired sample",
    "complement_swap": "only the component orthogonal to the probe subspace from the paired sample",
    "random_subspace_swap": "only a random subspace (same rank) component from the paired sample",
}


class Suite:
    def __init__(self, ctx: CausalContext, n_boot: int = 1000, seed: int = 0):
        self.ctx, self.n_boot, self.seed = ctx, n_boot, seed
        b = ctx.batch
        self.y = b.labels
        self.lds = {m: label_ld(r.logits, self.y, b.label_ids) for m, r in ctx.clean.items()}
        # The paired sample's clean LD against this row's labels (= -LD of the pair).
        self.ref_pair = {m: label_ld(r.logits[b.pair], self.y, b.label_ids) for m, r in ctx.clean.items()}
        self.timings: dict[str, float] = {}

    def metrics(self, logits, mode="recurrent-1", donor=None) -> dict:
        b = self.ctx.batch
        donor = b.pair if donor is None else donor
        ld = label_ld(logits, self.y, b.label_ids)
        ref = label_ld(self.ctx.clean[mode].logits[donor], self.y, b.label_ids)
        return summarize(ld, self.lds[mode], ref, self.y.numpy(), self.y[donor].numpy(), b.groups,
                         self.n_boot, self.seed)

    def _timed(self, name, fn):
        t = time.perf_counter()
        out = fn()
        self.timings[name] = time.perf_counter() - t
        return out

    # ---------------------------------------------------------------------------------------------------
    def clean(self) -> dict:
        return {m: self.metrics(self.ctx.clean[m].logits, m, donor=torch.arange(self.ctx.batch.size))
                for m in self.ctx.clean}

    def state_interventions(self) -> list[dict]:
        ctx, b = self.ctx, self.ctx.batch
        h = ctx.h_prev
        B = b.size
        g = torch.Generator().manual_seed(self.seed)
        # resample: a uniformly random row of another pair
        rs = torch.randint(0, B - 2, (B,), generator=g)
        pair_lo = torch.minimum(torch.arange(B), b.pair)
        pair_hi = torch.maximum(torch.arange(B), b.pair)
        rs = rs + (rs >= pair_lo).long()
        rs = rs + (rs >= pair_hi).long()
        rnd = torch.randn(h.shape, generator=g, dtype=h.dtype)
        rnd = rnd * (h.norm(dim=-1, keepdim=True) / rnd.norm(dim=-1, keepdim=True))
        runs = [
            ("gate_bypass", lambda: ctx.gate_bypass(), None),
            ("state_swap", lambda: ctx.swap_state(b.pair), None),
            ("resample", lambda: ctx.swap_state(rs), rs),
            ("mean", lambda: ctx.patch_state(h.mean(0, keepdim=True).expand_as(h).clone()), None),
            ("zero", lambda: ctx.patch_state(torch.zeros_like(h)), None),
            ("random_state", lambda: ctx.patch_state(rnd), None),
        ]
        out = []
        for name, fn, donor in runs:
            logits = self._timed(name, fn)
            out.append({"name": name, "description": DESCRIPTIONS[name], "mode": "recurrent-1",
                        "reference": "donor" if donor is not None else "paired sample",
                        **self.metrics(logits, donor=donor)})
        return out

    def subspace(self, rank: int = 1, probe_config: ProbeConfig | None = None) -> dict:
        ctx, b = self.ctx, self.ctx.batch
        h, donor = ctx.h_prev, ctx.h_prev[b.pair]
        t = time.perf_counter()
        folds = fold_subspaces(h, b.labels.numpy(), b.groups, rank, probe_config)
        self.timings["probe_fit"] = time.perf_counter() - t
        rows = []
        for name, part, rseed in (("subspace_swap", "subspace", None), ("complement_swap", "complement", None),
                                  ("random_subspace_swap", "subspace", self.seed + 1000)):
            states = per_fold_states(h, donor, folds, part, rseed)
            logits = self._timed(name, lambda: ctx.patch_state(states))
            rows.append({"name": name, "description": DESCRIPTIONS[name], "mode": "recurrent-1",
                         "reference": "donor", **self.metrics(logits)})
        n = sum(len(f.test) for f in folds)
        probe_acc = sum(f.probe_accuracy * len(f.test) for f in folds) / n
        return {"rank": rank, "n_folds": len(folds), "probe_heldout_accuracy": probe_acc,
                "probe_fold_accuracies": [f.probe_accuracy for f in folds],
                "energy_fraction": energy_fraction(h, donor, folds),
                "rows": rows}

    def dose(self, grid=DOSE_GRID) -> dict:
        ctx, b = self.ctx, self.ctx.batch
        h, donor = ctx.h_prev, ctx.h_prev[b.pair]
        rows = []
        t = time.perf_counter()
        for a in grid:
            logits = ctx.patch_state((1 - a) * h + a * donor)
            rows.append({"alpha": float(a), **self.metrics(logits)})
        self.timings["dose"] = time.perf_counter() - t
        self.timings["dose_per_point"] = self.timings["dose"] / max(1, len(grid))
        return {"alphas": [float(a) for a in grid], "rows": rows}

    def layer_patching(self, modes=MODES) -> dict:
        ctx, b = self.ctx, self.ctx.batch
        L = ctx.n_layers
        out = {"modes": list(modes), "positions": [POS_NAMES[p] for p in POSITIONS], "depths": list(range(L + 1)),
               "cells": {}}
        for mode in modes:
            if mode not in ctx.clean:
                continue
            grid = {k: [[None] * len(POSITIONS) for _ in range(L + 1)] for k in
                    ("normalized_effect", "flip_rate", "ld_mean", "accuracy")}
            cells = []
            t = time.perf_counter()
            for d in range(L + 1):
                for j, pos in enumerate(POSITIONS):
                    m = self.metrics(ctx.patch_resid(mode, d, pos, b.pair), mode)
                    for k in grid:
                        grid[k][d][j] = m[k]
                    cells.append({"depth": d, "position": POS_NAMES[pos], **m})
            self.timings[f"layer_patching/{mode}"] = time.perf_counter() - t
            self.timings[f"layer_patching/{mode}/per_cell"] = self.timings[f"layer_patching/{mode}"] / len(cells)
            out[mode] = grid
            out["cells"][mode] = cells
        return out


def run_suite(ctx: CausalContext, rank: int = 1, n_boot: int = 1000, seed: int = 0, dose_grid=DOSE_GRID,
              layers: bool = True, probe_config: ProbeConfig | None = None, progress=None) -> dict:
    """Every intervention of the report on one context; returns the JSON-ready result dict."""
    if not ctx.model.has_fusion:
        raise UserError("the model has no fusion module: there is no fed state to intervene on")
    s = Suite(ctx, n_boot, seed)
    steps = [("clean", s.clean), ("interventions", s.state_interventions),
             ("subspace", lambda: s.subspace(rank, probe_config)), ("dose", lambda: s.dose(dose_grid))]
    if layers:
        steps.append(("layer_patching", s.layer_patching))
    res = {}
    for name, fn in steps:
        if progress:
            progress(name)
        res[name] = fn()
    res["timings_s"] = s.timings
    return res


def run_control(ctx: CausalContext, n_boot: int = 1000, seed: int = 0) -> dict:
    """The negative control: clean, state swap, gate bypass and zero on another model (same batch)."""
    if not ctx.model.has_fusion:
        return {"clean": Suite(ctx, n_boot, seed).clean(), "interventions": [],
                "note": "the control model has no fusion module: the fed state does not exist there"}
    s = Suite(ctx, n_boot, seed)
    rows = []
    for name, fn in (("state_swap", lambda: ctx.swap_state(ctx.batch.pair)), ("gate_bypass", ctx.gate_bypass),
                     ("zero", lambda: ctx.patch_state(torch.zeros_like(ctx.h_prev)))):
        rows.append({"name": name, "description": DESCRIPTIONS[name], "mode": "recurrent-1",
                     "reference": "paired sample", **s.metrics(fn())})
    return {"clean": s.clean(), "interventions": rows}

