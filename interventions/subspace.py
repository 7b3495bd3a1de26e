"""The task-state subspace of h_{T-1}: probe direction(s) fitted on training folds only.

`fold_subspaces` splits the rows with StratifiedGroupKFold over their groups (a pair never straddles folds);
in each fold a `stats.linear.LinearProbe` is fitted on the TRAINING rows' h_{T-1} and its unit direction
spans the subspace (rank r > 1: iterative nullspace projection, each further probe fitted on the training
states with the earlier directions projected out). Each held-out row is then patched with the subspace of
the fold that held it out, so no row is ever patched along a direction fitted on it.

`swap_part(own, donor, U, part)`:
    subspace    own + P (donor - own)        P = U U^T (U orthonormal [D, r])
    complement  own + (I - P)(donor - own)
so subspace and complement swaps compose to the full swap: applying one on top of the other gives `donor`.

K > 2 classes (shell_game): the probe is multinomial; its direction is the top right singular vector of the
class-centred coefficient matrix (W_k / scale, k = 1..K) in the raw input space: the most class-discriminative
single direction (rank r > 1: iterated with nullspace projection as for binary probes).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from sklearn.model_selection import StratifiedGroupKFold

from common.errors import UserError
from stats.linear import LinearProbe, ProbeConfig


class NoDirection(UserError):
    """The state separates no label on a training fold: there is no subspace to swap along."""


@dataclass
class FoldSubspace:
    test: np.ndarray  # held-out row indices
    U: torch.Tensor  # [D, r] orthonormal basis of the probe subspace (fitted on the other folds)
    probe_accuracy: float  # held-out accuracy of the first probe on this fold


def orthonormal(M: torch.Tensor) -> torch.Tensor:
    q, _ = torch.linalg.qr(M.double())
    return q.to(M.dtype)


def random_subspace(d: int, rank: int, seed: int | None, dtype=torch.float32, *,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """An orthonormal basis [d, rank] of a uniformly random subspace: from `seed`, or drawn next from `generator`."""
    g = generator if generator is not None else torch.Generator().manual_seed(int(seed))
    return orthonormal(torch.randn(d, rank, generator=g, dtype=torch.float64)).to(dtype)


def fold_subspaces(H: torch.Tensor, labels, groups, rank: int = 1, config: ProbeConfig | None = None,
                   fit_mask=None, what: str = "the fed state") -> list[FoldSubspace]:
    """Per outer fold: probe subspace of rank `rank` fitted on the training rows of H [B, D] (only those where
    `fit_mask` [B] bool, e.g. the rows whose site is real rather than padding; the accuracy on those of the test
    rows). A fold whose training rows leave no further direction (few rows, a narrow site) keeps the ones found:
    its U has fewer than `rank` columns (`fold_ranks` says how many; the reports print them). `what` names the
    site in the refusal where a fold has none."""
    config = config or ProbeConfig()
    X = H.detach().double().cpu().numpy()
    y = np.asarray(labels)
    groups = np.asarray(groups)
    if not 1 <= rank <= X.shape[1]:
        raise UserError(f"subspace rank must be in 1..{X.shape[1]}, got {rank}")
    cv = StratifiedGroupKFold(n_splits=config.n_splits, shuffle=True, random_state=config.random_state)
    out = []
    for tr, te in cv.split(X, y, groups):
        scored = te
        if fit_mask is not None:
            keep = np.asarray(fit_mask, dtype=bool)
            tr, scored = tr[keep[tr]], te[keep[te]]
        if len(np.unique(y[tr])) < 2:
            raise UserError("a training fold has a single class: too few groups per label for grouped CV")
        dirs, Xtr, acc = [], X[tr].copy(), None
        for k in range(rank):
            probe = LinearProbe(config).fit(Xtr, y[tr], groups[tr])
            if k == 0:
                acc = probe.score(X[scored], y[scored]) if len(scored) else float("nan")
            u = _probe_direction(probe)
            if dirs:  # keep exact orthogonality to the earlier directions
                B = np.stack(dirs, 1)
                u = u - B @ (B.T @ u)
            nu = np.linalg.norm(u)
            if nu < 1e-12:
                break
            u = u / nu
            dirs.append(u)
            Xtr = Xtr - np.outer(Xtr @ u, u)
        if not dirs:
            raise NoDirection(f"the probe on {what} found no direction on a training fold: it does not "
                            "separate the labels there (constant within each class pair, or constant), so the subspace "
                            "swaps are undefined; a state without label information is itself the answer (the probes: "
                            "python -m probes.run)")
        U = torch.from_numpy(np.stack(dirs, 1)).to(H.dtype)
        out.append(FoldSubspace(te, U, float(acc)))
    return out


def fold_ranks(folds: list[FoldSubspace]) -> list[int]:
    """The rank each fold's subspace has (fewer than asked where its training rows gave out)."""
    return [int(f.U.shape[1]) for f in folds]


def class_mean_subspaces(H: torch.Tensor, labels, folds: list[FoldSubspace]) -> list[FoldSubspace]:
    """Per fold of `folds` (the probe subspaces' folds): the span of the class-mean differences of the TRAINING
    rows' H (each class's mean minus the first class's, orthonormalized: rank K - 1), the plainest direction the
    label is decodable along. The probe's direction is its standardized coefficient over each coordinate's
    spread, which coordinates that barely vary dominate; this one is not (docs/results.md: on tiny-fbt-track's
    parity the model reads the class-mean difference, 0.99, and not the probe's direction, 0.00)."""
    X = H.detach().double().cpu().numpy()
    y = np.asarray(labels)
    out = []
    for f in folds:
        tr = np.setdiff1d(np.arange(len(y)), f.test)
        classes = np.unique(y[tr])
        means = np.stack([X[tr][y[tr] == c].mean(0) for c in classes])
        q, r = np.linalg.qr((means[1:] - means[0]).T)
        keep = np.abs(np.diag(r)) > 1e-12 * max(1.0, float(np.abs(r).max()))  # drop a degenerate difference
        if not keep.any():
            raise NoDirection("the class means of h_{T-1} coincide on a training fold: no direction to swap")
        out.append(FoldSubspace(f.test, torch.from_numpy(q[:, keep]).to(H.dtype), f.probe_accuracy))
    return out


def _probe_direction(probe) -> np.ndarray:
    if len(probe.classes_) == 2:
        return probe.direction
    W = probe.clf_.coef_ / probe.scaler_.scale_  # [K, D] effective weights on the raw input
    W = W - W.mean(0, keepdims=True)
    if not np.any(W):
        return np.zeros(W.shape[1])
    return np.linalg.svd(W, full_matrices=False)[2][0]


def swap_part(own: torch.Tensor, donor: torch.Tensor, U: torch.Tensor, part: str) -> torch.Tensor:
    """Swap only the `part` ('subspace' or 'complement') of own [.., D] towards donor."""
    delta = donor - own
    inside = (delta @ U) @ U.T
    if part == "subspace":
        return own + inside
    if part == "complement":
        return own + (delta - inside)
    raise UserError(f"unknown subspace part {part!r} (subspace or complement)")


def per_fold_states(own: torch.Tensor, donor: torch.Tensor, folds: list[FoldSubspace], part: str,
                    random_rank_seed: int | None = None) -> torch.Tensor:
    """States [B, D] where each held-out row gets its fold's subspace swap (or a random one of equal rank)."""
    out = own.clone()
    # the random bases come from one stream, one after another: a seed per fold (seed + i) gave --seed s + 1 four
    # of --seed s's five bases, so a sweep over seeds drew overlapping baselines
    g = None if random_rank_seed is None else torch.Generator().manual_seed(int(random_rank_seed))
    for f in folds:
        U = f.U if g is None else random_subspace(own.shape[1], f.U.shape[1], None, own.dtype, generator=g)
        idx = torch.as_tensor(f.test, dtype=torch.long)
        out[idx] = swap_part(own[idx], donor[idx], U, part)
    return out


def energy_fraction(own: torch.Tensor, donor: torch.Tensor, folds: list[FoldSubspace]) -> float:
    """Share of ||donor - own||^2 (summed over held-out rows) that lies in the probe subspace."""
    num = den = 0.0
    for f in folds:
        idx = torch.as_tensor(f.test, dtype=torch.long)
        delta = (donor[idx] - own[idx]).double()
        num += float(((delta @ f.U.double()) ** 2).sum())
        den += float((delta ** 2).sum())
    return num / den if den > 0 else float("nan")
