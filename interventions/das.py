"""Distributed alignment search (Geiger et al. 2023, "Finding alignments between interpretable causal variables and
distributed neural representations"; pyvene's LowRankRotatedSpaceIntervention) on any site of any mechanism.

The question DAS answers that a probe does not: along which rank-k subspace of a site does *interchanging* the value
between two inputs make the model follow the source's label? A probe finds where the label is decodable; DAS finds
where it is read.

    RotatedSubspace(d, k)      R [d, k] with orthonormal columns (torch.nn.utils.parametrizations.orthogonal on a
                               Linear(d, k): the parametrization pyvene's rotated-space interventions are built on)
    forward(base, source)      base + (source - base) R R^T          (engine.edits.SubspaceInterchange(source, R))
    fit_rotation(run, ...)     R trained so that the interchanged run's label-word logits follow the source's label
                               (cross-entropy over the K label words), on the training rows only, full batch, Adam

Scoring (`das_battery`): the outer grouped folds of the probes and LEACE (stats.erasure.grouped_folds over the
probe labels, the same StratifiedGroupKFold): per fold and rank k a rotation is fitted on the fold's training rows
and applied to its held-out rows, so no row is ever scored with a subspace fitted on it. Base = every row, source =
its paired sample (the donor of the state swap), counterfactual label = the donor's label.
    interchange-intervention accuracy (IIA) = the share of held-out rows whose prediction (argmax over the label
    words, 1/m on an m-way tie) is the donor's label: interventions.metrics.decisions' "follow"
with a cluster-bootstrap CI over groups. At k = d the span is everything: the interchange is the whole swap, and its
IIA equals the state swap's follows-donor rate on the same rows (a consistency test; the evaluation projects R
onto exact orthonormality in float64 so that k = d gives the donor's value to float32 rounding).
Beside it, on the same folds and rows: the probe subspace (interventions.subspace.fold_subspaces, rank r = K - 1 by
default) and LEACE's (the column space of the eraser's rank-(K-1) perturbation Q = proj_left proj_right: the
interchange base + Q (source - base) takes from the source exactly what LEACE erases), a random rank-k subspace per
k, and the principal angles between the three (scipy.linalg.subspace_angles; cosines, 1 = shared direction).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from scipy.linalg import subspace_angles
from torch import nn

from common.errors import UserError
from engine.edits import Lambda, SubspaceInterchange
from stats.bootstrap import group_bootstrap_ci

from .metrics import decisions
from .subspace import fold_ranks, orthonormal, random_subspace


@dataclass(frozen=True)
class DasConfig:
    """How each rotation is trained: full-batch Adam on the fold's training rows for `steps` steps."""

    ranks: tuple[int, ...] = (1, 2, 4, 8, 16)
    steps: int = 100
    lr: float = 0.01
    seed: int = 0

    def __post_init__(self):
        if not self.ranks or any(int(k) < 1 for k in self.ranks):
            raise UserError("DAS ranks must be positive integers")
        if not 1 <= self.steps <= 100_000:
            raise UserError(f"DAS steps must be in 1..100000, got {self.steps}")
        if not 0 < self.lr <= 10:
            raise UserError(f"DAS learning rate must be in (0, 10], got {self.lr}")

    def to_dict(self) -> dict:
        return {**asdict(self), "ranks": list(self.ranks), "optimizer": "Adam (full batch)",
                "loss": "cross-entropy over the label words, target = the source's label",
                "parametrization": "torch.nn.utils.parametrizations.orthogonal (Linear(d, k), orthonormal rows)"}


class RotatedSubspace(nn.Module):
    """The learnable rank-k subspace of a d-wide site: R = W^T [d, k], W [k, d] kept with orthonormal rows."""

    def __init__(self, d: int, k: int, seed: int = 0):
        super().__init__()
        if not 1 <= k <= d:
            raise UserError(f"DAS rank {k} must be in 1..{d} (the site's width)")
        # Everything random here comes from `seed`: the start W, and the parametrization's completion of W to a
        # d x d basis (drawn from torch's global generator when k < d), so a fit never depends on global state.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            lin = nn.Linear(d, k, bias=False)
            with torch.no_grad():
                lin.weight.copy_(random_subspace(d, k, seed).T)
            self.lin = nn.utils.parametrizations.orthogonal(lin)
        self.d, self.k = d, k

    @property
    def basis(self) -> torch.Tensor:
        """R [d, k], orthonormal columns (differentiable)."""
        return self.lin.weight.T

    def exact_basis(self) -> torch.Tensor:
        """R re-orthonormalized in float64 (detached): the evaluation's basis, exact to float64 rounding."""
        return orthonormal(self.basis.detach().double())

    def edit(self, source: torch.Tensor, exact: bool = False) -> SubspaceInterchange:
        """The interchange as an engine edit: base + (source - base) R R^T, applied where the patcher meets the site."""
        if exact:
            return exact_interchange(source, self.exact_basis())
        return SubspaceInterchange(source, self.basis)

    def forward(self, base: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        return self.edit(source)(base)


def label_logits(logits: torch.Tensor, label_ids) -> torch.Tensor:
    """[B, K] logits of the K label words."""
    return logits[:, list(label_ids)].float()


STILL_FALLING = 0.05  # a fit whose loss still fell 5% over its last tenth of steps had not converged
CONVERGED_LOSS = 0.05  # ... unless it is already this low (cross-entropy: every answer near certain)


def fit_rotation(run, source: torch.Tensor, target: torch.Tensor, train: np.ndarray, label_ids, k: int,
                 config: DasConfig, seed: int) -> tuple[RotatedSubspace, dict]:
    """A rank-k RotatedSubspace trained on the `train` rows. `run(edit)` -> logits [B, V] of the model with `edit`
    applied at the site (differentiable in the edit's tensors); `source` [B, d] the source values; `target` [B]
    the counterfactual labels (indices into label_ids)."""
    rot = RotatedSubspace(source.shape[1], k, seed)
    params = list(rot.parameters())
    opt = torch.optim.Adam(params, lr=config.lr)
    idx = torch.as_tensor(train, dtype=torch.long)
    losses = []
    for _ in range(config.steps):
        opt.zero_grad()
        with torch.enable_grad():
            z = label_logits(run(rot.edit(source)), label_ids)
            if not z.requires_grad:
                raise UserError("DAS needs a differentiable patched run at this site: this mechanism's runs are not "
                                "(recirculation runs without gradient)")
            loss = nn.functional.cross_entropy(z[idx.to(z.device)], target[idx].to(z.device))
            # the rotation's gradient only: the model's parameters keep no .grad from a DAS fit
            grads = torch.autograd.grad(loss, params)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        losses.append(loss.item())
    # still learning: the loss fell by more than STILL_FALLING of itself over the last tenth of the steps
    tail = losses[max(0, len(losses) - 1 - max(1, len(losses) // 10))]
    falling = tail - losses[-1] > STILL_FALLING * tail and losses[-1] > CONVERGED_LOSS
    return rot, {"loss_first": losses[0], "loss_last": losses[-1], "still_falling": bool(falling)}


def _iia(logits, target, label_ids, rows) -> np.ndarray:
    """Per-row IIA (1/m on an m-way tie) of `rows`."""
    logits = logits.detach().to("cpu", torch.float32)
    _, follow = decisions(logits[rows], target[rows], target[rows], label_ids)
    return follow


def _cosines(A: torch.Tensor | np.ndarray, B: torch.Tensor | np.ndarray) -> list[float]:
    """cos of the principal angles between span(A) and span(B) (columns), largest first."""
    A, B = np.asarray(A, dtype=np.float64), np.asarray(B, dtype=np.float64)
    return [float(c) for c in np.sort(np.cos(subspace_angles(A, B)))[::-1]]


def _mean_cos(pairs) -> list[float] | None:
    """Element-wise mean over folds of the cosine lists (folds without a subspace left out)."""
    pairs = [p for p in pairs if p]
    if not pairs:
        return None
    n = min(len(p) for p in pairs)
    return [float(np.mean([p[i] for p in pairs])) for i in range(n)]


def leace_basis(eraser) -> torch.Tensor | None:
    """Orthonormal basis [d, r] of the column space of LEACE's perturbation Q = proj_left proj_right (what it
    erases), or None."""
    if eraser is None:
        return None
    Q = (eraser.proj_left @ eraser.proj_right).double()
    u, s, _ = torch.linalg.svd(Q)
    r = int((s > s.max() * 1e-8).sum()) if s.numel() and float(s.max()) > 0 else 0
    return u[:, :r] if r else None


def das_battery(run, base: torch.Tensor, source: torch.Tensor, target: torch.Tensor, label_ids, groups, folds,
                rows: np.ndarray, config: DasConfig, probe_folds=None, leace=None, full_swap=None,
                n_boot: int = 1000, on_fit=None) -> dict:
    """IIA vs rank for DAS, beside the probe and LEACE subspaces and a random one (module doc).

    `run(edit)` -> logits [B, V] (the site's patched run, differentiable); `base`, `source` [B, d] the clean values
    at the site (own row, donor row); `target` [B] the donor's label; `folds` [(train, test)] grouped folds; `rows`
    [B] bool: the rows where the site is real (scored and trained on); `probe_folds`: interventions.subspace.
    FoldSubspace per fold; `leace`: stats.erasure.FoldErasers; `full_swap`: logits of the whole swap (for the
    consistency row); `on_fit()`: called once per fitted rotation (a progress bar's step)."""
    B, d = base.shape
    ranks = sorted({int(k) for k in config.ranks})
    if ranks[-1] > d:
        raise UserError(f"--das rank {ranks[-1]} exceeds the site's width {d}")
    rows = np.asarray(rows, dtype=bool)
    test_sets = [te[rows[te]] for _, te in folds]
    train_sets = [tr[rows[tr]] for tr, _ in folds]
    scored = np.concatenate(test_sets)
    g = np.asarray(groups)[scored]
    tgt = target.long()

    def pooled(per_fold_logits) -> dict:
        iia = np.concatenate([_iia(lg, tgt, label_ids, torch.as_tensor(te, dtype=torch.long))
                              for lg, te in zip(per_fold_logits, test_sets)])
        return {"iia": float(iia.mean()), "iia_ci": group_bootstrap_ci(iia, g, n_boot, config.seed),
                "n": int(len(iia))}

    def run_per_fold(edit_of_fold) -> list[torch.Tensor]:
        with torch.no_grad():
            return [run(edit_of_fold(f)) for f in range(len(folds))]

    out_rows, t0 = [], time.perf_counter()
    for k in ranks:
        rots, fits = [], []
        for f, tr in enumerate(train_sets):
            if len(np.unique(tgt[torch.as_tensor(tr)].numpy())) < 2:
                raise UserError("a DAS training fold has a single counterfactual label: too few pairs")
            rot, info = fit_rotation(run, source, tgt, tr, label_ids, k, config, seed=config.seed * 1000 + 37 * k + f)
            rots.append(rot)
            fits.append(info)
            if on_fit is not None:
                on_fit()
        fitted = run_per_fold(lambda f: rots[f].edit(source, exact=True))  # one run per fold: held-out and train
        das = pooled(fitted)
        train_iia = float(np.mean(np.concatenate([_iia(lg, tgt, label_ids, torch.as_tensor(tr, dtype=torch.long))
                                                  for lg, tr in zip(fitted, train_sets)])))
        rnd = pooled(run_per_fold(lambda f: exact_interchange(
            source, random_subspace(d, k, config.seed * 7919 + 101 * k + f, torch.float64))))
        row = {"k": k, **das, "train_iia": train_iia, "random_iia": rnd["iia"], "random_iia_ci": rnd["iia_ci"],
               "loss_first": float(np.mean([i["loss_first"] for i in fits])),
               "loss_last": float(np.mean([i["loss_last"] for i in fits])),
               "still_falling": int(sum(i["still_falling"] for i in fits))}  # folds whose fit had not converged
        bases = [r.exact_basis() for r in rots]
        if probe_folds is not None:
            row["cos_probe"] = _mean_cos([_cosines(b, pf.U) for b, pf in zip(bases, probe_folds)])
        if leace is not None:
            row["cos_leace"] = _mean_cos([_cosines(b, lb) if lb is not None else None
                                          for b, lb in zip(bases, (leace_basis(e) for e in leace.erasers))])
        out_rows.append(row)
    out = {"ranks": ranks, "d": d, "rows": out_rows, "settings": config.to_dict(),
           "fit_s": time.perf_counter() - t0, "n_folds": len(folds)}
    if probe_folds is not None:
        ranks_found = fold_ranks(probe_folds)  # fewer than asked on a fold whose training rows gave out
        out["probe"] = {"rank": min(ranks_found), "fold_ranks": ranks_found,
                        **pooled(run_per_fold(lambda f: exact_interchange(source, probe_folds[f].U)))}
    if leace is not None:
        lbases = [leace_basis(e) for e in leace.erasers]
        out["leace"] = {"rank": max((b.shape[1] for b in lbases if b is not None), default=0),
                        **pooled(run_per_fold(lambda f: _leace_edit(leace.erasers[f], source)))}
        if probe_folds is not None:
            out["cos_probe_leace"] = _mean_cos([_cosines(pf.U, lb) if lb is not None else None
                                                for pf, lb in zip(probe_folds, lbases)])
    if full_swap is not None:
        out["full_swap"] = pooled([full_swap] * len(folds))
    return out


def exact_interchange(source: torch.Tensor, U: torch.Tensor) -> Lambda:
    """base + (source - base) U U^T in float64 (U [d, k] orthonormal columns): at k = d the source itself, to the
    base dtype's rounding (engine.edits.SubspaceInterchange computes in float32)."""
    U = U.detach().double()

    def interchange(base):
        delta = source.to(base.device).double() - base.double()
        return base.double() + (delta @ U.to(base.device)) @ U.T.to(base.device)

    return Lambda(interchange)


def _leace_edit(eraser, source: torch.Tensor) -> Lambda:
    """base + Q (source - base): the part LEACE erases, taken from the source (identity where no eraser)."""
    if eraser is None:
        return Lambda(lambda base: base)
    Q = (eraser.proj_left @ eraser.proj_right).double()  # [d, d], column convention: erase(x) = x - Q (x - b)

    def interchange(base):
        delta = source.to(base.device).double() - base.double()
        return base.double() + delta @ Q.T.to(base.device)

    return Lambda(interchange)
