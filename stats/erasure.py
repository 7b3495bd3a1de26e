"""LEACE concept erasure of the label (Belrose et al. 2023, "LEACE: Perfect linear concept erasure in closed
form"), with EleutherAI's `concept-erasure` package, fitted on training groups only and applied to held-out ones.

LEACE is the affine map x -> x - P (x - mean) of least expected squared change after which the class means of
the erased representation coincide (zero cross-covariance with the one-hot label): no linear classifier can
then beat a constant predictor on the fitted distribution (the guarantee). Settings: `concept_erasure.
LeaceFitter` in float64 with its defaults (shrinkage covariance, affine) except `constrain_cov_trace=False`:
that option mixes in an orthogonal projection when the oblique one would raise the variance, which breaks the
zero cross-covariance; we keep the exact eraser and report its size instead (`relative_change`).

Folds: `grouped_folds` = the outer StratifiedGroupKFold of interventions.subspace.fold_subspaces and
stats.linear (same n_splits, shuffle, random_state): each fold's eraser is fitted on its training rows and
applied to its held-out rows, so no row is ever erased by a map fitted on it (`FoldErasers.heldout`). A dose
`alpha` moves a fraction of the way: x + alpha (erase(x) - x).

Diagnostics (`probe_check`, held-out accuracies of stats.linear.LinearProbe over the same folds):
    before           fitted on clean training rows, scored on clean held-out rows
    after            fitted on ERASED training rows, scored on erased held-out rows: chance by the guarantee
    clean_on_erased  the clean probe scored on the erased held-out rows: does the held-out erasure remove what
                     the original probe reads (the guarantee holds on the training rows; this checks it
                     carries over to the rows that are patched)?

This module is the statistics only (no model runs): shared by interventions (the LEACE battery, and
interventions.erasure, which runs the model on erased values) and probes (probes.erase, `probes.run --erase`).
"""
from __future__ import annotations

import numpy as np
import torch
from sklearn.model_selection import StratifiedGroupKFold

from common.errors import UserError
from stats.bootstrap import group_bootstrap_ci
from stats.linear import LinearProbe, ProbeConfig

MIN_FIT_ROWS = 4  # fewer real training rows at a position: that fold leaves the position unerased


def package_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("concept-erasure")
    except metadata.PackageNotFoundError:  # pragma: no cover - a declared dependency
        return None


def grouped_folds(labels, groups, config: ProbeConfig | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train, test) row indices of the outer grouped folds the subspace swaps and the probes use."""
    config = config or ProbeConfig()
    y, groups = np.asarray(labels), np.asarray(groups)
    cv = StratifiedGroupKFold(n_splits=config.n_splits, shuffle=True, random_state=config.random_state)
    folds = [(tr, te) for tr, te in cv.split(np.zeros(len(y)), y, groups)]
    if any(len(np.unique(y[tr])) < 2 for tr, _ in folds):
        raise UserError("a training fold has a single class: too few groups per label for grouped CV")
    return folds


def fit_eraser(X, labels, n_classes: int):
    """A LeaceEraser of the one-hot label from X [n, D] (float64), or None if X has no usable variation."""
    from concept_erasure import LeaceFitter

    x = torch.as_tensor(np.asarray(X) if not torch.is_tensor(X) else X).double()
    y = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    if not torch.isfinite(x).all():
        raise UserError("cannot fit an eraser: the values contain NaN or infinite entries")
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= n_classes):
        raise UserError(f"cannot fit an eraser: labels must be class indices 0..{n_classes - 1} "
                        f"(got {int(y.min())}..{int(y.max())})")
    if len(x) < 2 or len(torch.unique(y)) < 2:
        return None
    z = torch.nn.functional.one_hot(y, n_classes).double()  # [n, K]
    return LeaceFitter.fit(x, z, constrain_cov_trace=False).eraser


# Components of an erased row below this share of the row's largest are the projection's float64 round-off
# (~1e-16), not a value: set to 0. A standardized probe scales a coordinate that is round-off everywhere up to unit
# spread, and its sign still follows the erased label (a perfect erasure then read 1.00 after it).
ROUNDOFF = 1e-10


def apply(eraser, X: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """X [.., D] moved `alpha` of the way to its erased version (same dtype); eraser None = identity."""
    if eraser is None or alpha == 0:
        return X.clone()
    x = X.double()
    out = x + alpha * (eraser(x) - x)
    out = torch.where(out.abs() <= ROUNDOFF * x.abs().amax(-1, keepdim=True), torch.zeros_like(out), out)
    return out.to(X.dtype)


class FoldErasers:
    """One eraser per fold, fitted on the fold's training rows (optionally only those where `fit_mask`)."""

    def __init__(self, X: torch.Tensor, labels, folds, n_classes: int, fit_mask=None):
        self.folds, self.n_classes = folds, n_classes
        y = np.asarray(labels)
        X = X.detach()
        self.erasers = []
        for tr, _ in folds:
            rows = tr if fit_mask is None else tr[np.asarray(fit_mask)[tr]]
            ok = len(rows) >= MIN_FIT_ROWS and len(np.unique(y[rows])) >= 2
            self.erasers.append(fit_eraser(X[torch.as_tensor(rows)], y[rows], n_classes) if ok else None)

    def heldout(self, X: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        """X [B, D] with each held-out row erased by the eraser of the fold that held it out."""
        out = X.detach().clone()
        for (_, te), e in zip(self.folds, self.erasers):
            idx = torch.as_tensor(te, dtype=torch.long)
            out[idx] = apply(e, X[idx].detach(), alpha)
        return out

    def by_fold(self, X: torch.Tensor, f: int, alpha: float = 1.0) -> torch.Tensor:
        """X [B, D] with EVERY row erased by fold f's eraser (its training rows too: to fit probes after)."""
        return apply(self.erasers[f], X.detach(), alpha)


def relative_change(own: torch.Tensor, erased: torch.Tensor, rows=None) -> float:
    """mean ||erased - own|| / mean ||own|| over rows: how far the erasure moves the representation."""
    if rows is not None:
        own, erased = own[torch.as_tensor(rows)], erased[torch.as_tensor(rows)]
    den = float(own.double().norm(dim=-1).mean())
    return float((erased - own).double().norm(dim=-1).mean()) / den if den > 0 else float("nan")


def _ci(correct, groups, config):
    return group_bootstrap_ci(correct, groups, config.n_boot, config.random_state)


# A held-out decision within this share of the training decisions' scale of a tie is one: erased rows that all sit
# on the class means' common point get decisions of float round-off (~1e-16), whose sign followed the label (a
# perfect erasure read 1.00 where the probe cannot tell the rows apart). Scored as the expected accuracy of a random
# tie-break instead.
TIE = 1e-9


def _tie_aware_correct(probe, X_train, X_test, y_test) -> np.ndarray:
    """Per test row: 1 / 0 for a right / wrong prediction, 1/m where the m top classes tie (within TIE)."""
    classes = probe.classes_
    scale = float(np.abs(probe.decision_function(X_train)).max())
    dec = probe.decision_function(X_test)
    if dec.ndim == 1:  # binary: the logit of classes_[1]
        dec = np.stack([-dec, dec], axis=1) / 2
    tied = dec >= dec.max(1, keepdims=True) - TIE * max(scale, np.finfo(float).tiny)  # [n, K]
    known = np.isin(y_test, classes)  # a label this fold's training rows lack is never predicted: 0
    index = np.minimum(np.searchsorted(classes, y_test), len(classes) - 1)
    hit = known & tied[np.arange(len(y_test)), index]
    return np.where(hit, 1.0 / tied.sum(1), 0.0)


def heldout_accuracy(train_X, test_X, labels, groups, folds, config: ProbeConfig, rows=None) -> dict:
    """Pooled held-out accuracy of LinearProbe per fold f: fitted on train_X(f)[train rows], scored on
    test_X(f)[test rows] (callables giving [B, D] arrays); `rows`: boolean mask of the rows used."""
    y, groups = np.asarray(labels), np.asarray(groups)
    use = np.ones(len(y), bool) if rows is None else np.asarray(rows, bool)
    correct = np.full(len(y), np.nan)
    folds_acc = []
    for f, (tr, te) in enumerate(folds):
        tr, te = tr[use[tr]], te[use[te]]
        if len(te) == 0 or len(np.unique(y[tr])) < 2:
            continue
        Xtr, Xte = np.asarray(train_X(f), dtype=np.float64), np.asarray(test_X(f), dtype=np.float64)
        probe = LinearProbe(config).fit(Xtr[tr], y[tr], groups[tr])
        c = _tie_aware_correct(probe, Xtr[tr], Xte[te], y[te])
        correct[te] = c
        folds_acc.append(float(c.mean()))
    done = ~np.isnan(correct)
    if not done.any():
        return {"accuracy": None, "ci": None, "fold_accuracies": [], "n": 0}
    return {"accuracy": float(correct[done].mean()), "ci": _ci(correct[done], groups[done], config),
            "fold_accuracies": folds_acc, "n": int(done.sum())}


def probe_check(X: torch.Tensor, labels, groups, fe: FoldErasers, config: ProbeConfig, rows=None) -> dict:
    """Held-out probe accuracy before erasure, after it (refitted on erased rows) and of the clean probe on the
    erased rows (module doc); chance = 1/K."""
    Xn = X.detach().double().numpy()
    folds = fe.folds
    # erased in float64 (not cast back to X's dtype): the cast's rounding around a shared value follows the label,
    # and a standardized probe scales it up to unit spread (a perfect float32 erasure read 1.00 after it)
    erased = [fe.by_fold(X.double(), f).numpy() for f in range(len(folds))]
    out = {
        "before": heldout_accuracy(lambda f: Xn, lambda f: Xn, labels, groups, folds, config, rows),
        "after": heldout_accuracy(lambda f: erased[f], lambda f: erased[f], labels, groups, folds, config, rows),
        "clean_on_erased": heldout_accuracy(lambda f: Xn, lambda f: erased[f], labels, groups, folds, config, rows),
        "chance": 1.0 / fe.n_classes,
    }
    return out


def cross_covariance(X: torch.Tensor, labels, n_classes: int) -> float:
    """max |Cov(x_j, onehot(y)_k)| of rows X [n, D]: 0 after erasure on the rows the eraser was fitted on."""
    x = X.double()
    z = torch.nn.functional.one_hot(torch.as_tensor(np.asarray(labels), dtype=torch.long), n_classes).double()
    c = (x - x.mean(0)).T @ (z - z.mean(0)) / max(1, len(x) - 1)
    return float(c.abs().max())
