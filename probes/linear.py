"""Linear probes with group-held-out cross-validation (SPEC section 4).

Everything is sklearn-style and deterministic: every source of randomness comes from an explicit
``random_state`` in :class:`ProbeConfig`; nothing global is touched.

Protocol of :func:`grouped_cv_score`
    * outer ``StratifiedGroupKFold(n_splits, shuffle=True, random_state)``: whole groups are held out;
    * inside every outer training fold a :class:`LinearProbe` (standardize -> logistic regression) picks its
      inverse regularization ``C`` from ``config.Cs`` by an inner grouped CV on that training fold only;
    * ``accuracy`` = accuracy of all held-out predictions pooled (every sample is predicted exactly once);
      ``accuracy_std`` = standard deviation of the per-fold accuracies (``fold_accuracies``);
    * 95% CI: percentile bootstrap over **groups** (cluster bootstrap): groups are resampled with
      replacement together with all their held-out predictions, because samples of one group (a pair and its
      siblings) are not independent. ``n_boot`` resamples, seeded by ``random_state``;
    * ``control_accuracy``: the same protocol with the labels permuted at the group level
      (:func:`permute_labels_by_group`): the control task of Hewitt & Liang (2019). Selectivity =
      accuracy - control_accuracy.

K classes: two classes use the exact binary solver below (``_BinaryLogReg``); K > 2 classes (e.g. shell_game)
use multinomial (softmax) logistic regression (``_SoftmaxLogReg``: scikit-learn's lbfgs, solved in the row
space of X as the binary one), with the same grouped CV, C selection, control and bootstrap; chance is 1/K
(``ProbeScore.chance``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
from sklearn.model_selection import StratifiedGroupKFold, StratifiedKFold

from common.errors import UserError

__all__ = ["ProbeConfig", "LinearProbe", "ProbeScore", "grouped_cv_score", "grouped_cv_scores", "check_groups", "permute_labels_by_group"]


@dataclass(frozen=True)
class ProbeConfig:
    """Probe hyper-parameters. Validates itself on construction (``UserError`` on a bad value)."""

    n_splits: int = 5  # outer folds (groups held out)
    inner_splits: int = 3  # inner folds choosing C on the training data only
    Cs: tuple = (0.01, 0.1, 1.0, 10.0)  # candidate inverse regularization strengths
    n_boot: int = 1000  # bootstrap resamples (over groups) for the 95% CI
    random_state: int = 0
    max_iter: int = 1000  # logistic regression iterations

    def __post_init__(self):
        for name, lo in (("n_splits", 2), ("inner_splits", 2), ("n_boot", 1), ("max_iter", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise UserError(f"ProbeConfig.{name} must be an integer >= {lo} (got {v!r})")
        if isinstance(self.random_state, bool) or not isinstance(self.random_state, (int, np.integer)) \
                or self.random_state < 0:
            raise UserError(f"ProbeConfig.random_state must be a non-negative integer (got {self.random_state!r})")
        try:
            cs = tuple(float(c) for c in self.Cs)
        except (TypeError, ValueError):
            raise UserError(f"ProbeConfig.Cs must be a sequence of positive numbers (got {self.Cs!r})") from None
        if not cs or any(not np.isfinite(c) or c <= 0 for c in cs):
            raise UserError(f"ProbeConfig.Cs must be a non-empty sequence of positive numbers (got {self.Cs!r})")
        object.__setattr__(self, "Cs", cs)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["Cs"] = list(self.Cs)
        return d


def _as_xy(X, y, groups=None):
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y)
    if X.ndim != 2:
        raise UserError(f"X must be 2-D [samples, features] (got shape {X.shape})")
    if y.ndim != 1 or len(y) != len(X):
        raise UserError(f"y must be 1-D with one label per row of X ({len(X)}), got shape {y.shape}")
    if not np.isfinite(X).all():
        raise UserError("X contains NaN or infinite values")
    if groups is not None:
        groups = np.asarray(groups)
        if groups.shape != y.shape:
            raise UserError(f"groups must have one entry per sample ({len(y)}), got shape {groups.shape}")
    return X, y, groups


class _Scaler:
    """StandardScaler without sklearn's per-call validation overhead (zero-variance features: scale 1)."""

    def fit(self, X):
        self.mean_ = X.mean(0)
        scale = X.std(0)
        scale[scale < 10 * np.finfo(np.float64).eps * np.maximum(1.0, np.abs(self.mean_))] = 1.0
        self.scale_ = scale
        return self

    def transform(self, X):
        return (X - self.mean_) / self.scale_


class _BinaryLogReg:
    """L2-regularized binary logistic regression, sklearn's objective, solved by damped Newton.

    Minimizes ``0.5 ||w||^2 + C * sum_i log(1 + exp(-s_i (w.x_i + b)))`` (intercept not penalized), the same
    objective as ``sklearn.linear_model.LogisticRegression(C=C)``. A dense Newton step costs one
    [d+1, d+1] solve, which for probe-sized problems (d <= a few hundred) is far faster than lbfgs, and it is
    exactly deterministic. Exposes ``coef_`` [1, d], ``intercept_`` [1], ``classes_``, ``predict``,
    ``decision_function``.
    """

    def __init__(self, C: float = 1.0, max_iter: int = 100, tol: float = 1e-8):
        self.C, self.max_iter, self.tol = float(C), int(max_iter), tol

    @staticmethod
    def _loss(Xb, t, beta, C, reg):
        z = Xb @ beta
        return C * np.sum(np.logaddexp(0.0, -t * z)) + 0.5 * np.dot(reg * beta, beta)

    def fit(self, X, y):
        self.classes_ = np.unique(y)
        if len(self.classes_) != 2:
            raise UserError(f"binary logistic regression needs 2 classes (got {len(self.classes_)})")
        n, d = X.shape
        if d > n:
            # Wide problem (e.g. 576-d states, ~100 samples): the penalty only touches w, so the optimum lies in
            # the row space of X (any component orthogonal to it adds penalty and changes no prediction). With
            # X = U S V^T, w = V c and X w = (U S) c: the same objective in rank(X) <= n coordinates, solved
            # exactly, then mapped back. Newton then solves [n, n] instead of [d, d] systems.
            U, S, Vt = np.linalg.svd(X, full_matrices=False)
            r = int((S > S[0] * max(n, d) * np.finfo(np.float64).eps).sum()) if len(S) and S[0] > 0 else 0
            self._fit(U[:, :r] * S[:r], y)
            self.coef_ = self.coef_ @ Vt[:r]
            return self
        return self._fit(X, y)

    def _fit(self, X, y):
        t = np.where(y == self.classes_[1], 1.0, -1.0)
        n, d = X.shape
        Xb = np.hstack([X, np.ones((n, 1))])
        reg = np.ones(d + 1)
        reg[-1] = 0.0  # intercept not penalized
        beta = np.zeros(d + 1)
        C = self.C
        f = self._loss(Xb, t, beta, C, reg)
        for _ in range(self.max_iter):
            z = Xb @ beta
            p = 0.5 * (1.0 + np.tanh(0.5 * t * z))  # sigmoid(t z), stable
            grad = -C * (Xb.T @ (t * (1.0 - p))) + reg * beta
            W = C * p * (1.0 - p)
            H = (Xb.T * W) @ Xb + np.diag(reg) + 1e-10 * np.eye(d + 1)
            try:
                step = np.linalg.solve(H, grad)
            except np.linalg.LinAlgError:
                step = np.linalg.lstsq(H, grad, rcond=None)[0]
            dec = float(grad @ step)  # Newton decrement^2
            if dec / 2 <= self.tol * max(1.0, abs(f)):
                break
            a = 1.0
            while True:  # backtracking (Armijo)
                cand = beta - a * step
                f_new = self._loss(Xb, t, cand, C, reg)
                if f_new <= f - 1e-4 * a * dec or a < 1e-8:
                    break
                a *= 0.5
            beta, f = cand, f_new
        self.coef_ = beta[None, :d].copy()
        self.intercept_ = beta[d:].copy()
        return self

    def decision_function(self, X):
        return X @ self.coef_[0] + self.intercept_[0]

    def predict(self, X):
        return np.where(self.decision_function(X) > 0, self.classes_[1], self.classes_[0])


class _SoftmaxLogReg:
    """L2-regularized multinomial (softmax) logistic regression for K > 2 classes, sklearn's objective.

    Minimizes ``0.5 ||W||_F^2 + C * sum_i w_{y_i} * -log softmax(W x_i + b)[y_i]`` (intercepts not penalized)
    with class weights ``w_c = n / (K n_c)``: ``sklearn.linear_model.LogisticRegression(C=C,
    class_weight="balanced")``, which it calls (lbfgs, deterministic for fixed inputs). The weights matter
    for grouped CV: folds of pairs cannot be exactly balanced over K > 2 classes, and an unweighted probe
    with uninformative inputs predicts the training fold's majority class, which is the held-out fold's
    minority, so it lands *below* chance (e.g. ~0.2 instead of 1/3 at standard-prefill depth 0). Balanced,
    all classes tie and the first wins, whatever the fold: chance exactly. (Two classes need no weights:
    every pair, so every group and fold, holds both labels equally.) Wide problems (d > n) are solved in the
    row space of X, exactly as in ``_BinaryLogReg`` (the penalty is invariant under that orthonormal change
    of coordinates). Exposes ``coef_`` [K, d], ``intercept_`` [K], ``classes_``, ``predict``,
    ``decision_function`` [n, K].
    """

    def __init__(self, C: float = 1.0, max_iter: int = 1000, tol: float = 1e-8):
        self.C, self.max_iter, self.tol = float(C), int(max_iter), tol

    def fit(self, X, y):
        import warnings

        from sklearn.exceptions import ConvergenceWarning
        from sklearn.linear_model import LogisticRegression

        self.classes_ = np.unique(y)
        if len(self.classes_) < 3:
            raise UserError(f"multinomial logistic regression needs 3 or more classes (got {len(self.classes_)})")
        n, d = X.shape
        Vt = None
        if d > n:
            U, S, Vt = np.linalg.svd(X, full_matrices=False)
            r = int((S > S[0] * max(n, d) * np.finfo(np.float64).eps).sum()) if len(S) and S[0] > 0 else 0
            if r == 0:  # constant (zero) inputs: only the intercepts can fit
                X, Vt = np.zeros((n, 1)), np.zeros((1, d))
            else:
                X, Vt = U[:, :r] * S[:r], Vt[:r]
        clf = LogisticRegression(C=self.C, solver="lbfgs", max_iter=self.max_iter, tol=self.tol,
                                 class_weight="balanced")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            clf.fit(X, y)
        coef = clf.coef_
        self.coef_ = coef @ Vt if Vt is not None else coef.copy()
        self.intercept_ = clf.intercept_.copy()
        return self

    def decision_function(self, X):
        return X @ self.coef_.T + self.intercept_

    def predict(self, X):
        return self.classes_[np.argmax(self.decision_function(X), axis=1)]


class LinearProbe:
    """Standardized logistic regression (binary, or multinomial for K > 2 classes); ``C`` chosen by inner
    (grouped) CV on the training data only.

    With ``groups`` the inner CV is a ``StratifiedGroupKFold`` (fewer folds if there are fewer groups than
    ``inner_splits``); without, a ``StratifiedKFold``. If the inner CV cannot run (fewer than 2 groups, or a
    class too small), ``C`` falls back to the middle of ``Cs`` (``chosen_C_`` records what was used).
    """

    def __init__(self, config: ProbeConfig = ProbeConfig()):
        if not isinstance(config, ProbeConfig):
            raise UserError("LinearProbe needs a ProbeConfig")
        self.config = config

    # -- internals ---------------------------------------------------------------------------------
    def _fit_fixed(self, X, y, C):
        scaler = _Scaler().fit(X)
        solver = _BinaryLogReg if len(np.unique(y)) == 2 else _SoftmaxLogReg
        clf = solver(C=C, max_iter=self.config.max_iter).fit(scaler.transform(X), y)
        return scaler, clf

    def _inner_splits(self, y, groups):
        k = self.config.inner_splits
        _, counts = np.unique(y, return_counts=True)
        if groups is not None:
            n_groups = len(np.unique(groups))
            k = min(k, n_groups)
            if k < 2:
                return None
            cv = StratifiedGroupKFold(n_splits=k, shuffle=True, random_state=self.config.random_state)
            return list(cv.split(np.zeros(len(y)), y, groups))
        k = min(k, int(counts.min()))
        if k < 2:
            return None
        cv = StratifiedKFold(n_splits=k, shuffle=True, random_state=self.config.random_state)
        return list(cv.split(np.zeros(len(y)), y))

    def _choose_C(self, X, y, groups, splits=None):
        Cs = self.config.Cs
        if len(Cs) == 1:
            return Cs[0]
        if splits is None:
            splits = self._inner_splits(y, groups)
        if splits is None:
            return Cs[len(Cs) // 2]
        scores = np.zeros(len(Cs))
        for tr, te in splits:
            if len(np.unique(y[tr])) < 2:
                continue
            for i, C in enumerate(Cs):
                scaler, clf = self._fit_fixed(X[tr], y[tr], C)
                scores[i] += (clf.predict(scaler.transform(X[te])) == y[te]).sum()
        # ties -> the strongest regularization (smallest C), deterministic
        order = np.argsort(Cs, kind="stable")
        best = max(order, key=lambda i: (scores[i], -Cs[i]))
        return Cs[best]

    # -- public API ----------------------------------------------------------------------------------
    def fit(self, X, y, groups=None, _inner=None) -> "LinearProbe":
        """Fit; ``_inner`` (internal) = precomputed inner splits, so many depths share one split computation."""
        X, y, groups = _as_xy(X, y, groups)
        self.classes_ = np.unique(y)
        if len(self.classes_) < 2:
            raise UserError(f"cannot fit a probe: the training labels have a single class ({self.classes_.tolist()})")
        self.chosen_C_ = float(self._choose_C(X, y, groups, _inner))
        self.scaler_, self.clf_ = self._fit_fixed(X, y, self.chosen_C_)
        return self

    def _check_fitted(self):
        if not hasattr(self, "clf_"):
            raise UserError("this LinearProbe is not fitted yet: call fit(X, y, groups) first")

    def decision_function(self, X) -> np.ndarray:
        self._check_fitted()
        return self.clf_.decision_function(self.scaler_.transform(np.asarray(X, dtype=np.float64)))

    def predict(self, X) -> np.ndarray:
        self._check_fitted()
        return self.clf_.predict(self.scaler_.transform(np.asarray(X, dtype=np.float64)))

    def score(self, X, y) -> float:
        return float(np.mean(self.predict(X) == np.asarray(y)))

    @property
    def direction(self) -> np.ndarray:
        """Unit vector [d_model] in the original (unstandardized) input space: (w / scale), normalized.

        For binary labels the logit is ``w . (x - mean) / scale + b``, so ``w / scale`` is the effective
        weight on the raw input; it points towards the class ``classes_[1]``. Zero vector if the probe has
        no weight at all (e.g. constant inputs).
        """
        self._check_fitted()
        if len(self.classes_) != 2:
            raise UserError("direction is defined for binary probes only")
        w = self.clf_.coef_[0] / self.scaler_.scale_
        norm = np.linalg.norm(w)
        return w / norm if norm > 0 else w


@dataclass
class ProbeScore:
    accuracy: float  # pooled held-out accuracy
    accuracy_std: float  # std of the per-fold held-out accuracies
    ci_low: float  # 95% percentile bootstrap CI over groups
    ci_high: float
    control_accuracy: float  # same protocol, labels permuted at the group level
    n_samples: int
    n_groups: int
    fold_accuracies: list = field(default_factory=list)
    n_classes: int = 2  # K label classes; chance = 1/K

    @property
    def chance(self) -> float:
        return 1.0 / self.n_classes

    @property
    def selectivity(self) -> float:
        return self.accuracy - self.control_accuracy

    def ci_contains(self, value: float) -> bool:
        return self.ci_low <= value <= self.ci_high

    def to_dict(self) -> dict:
        return asdict(self)


def permute_labels_by_group(y, groups, rng) -> np.ndarray:
    """Control labels (Hewitt & Liang 2019) that keep the group structure but break any input -> label rule.

    Groups of equal size swap their label vectors under a random permutation; then exactly half (rounded
    at random) of the groups whose labels are internally balanced (e.g. a pair with opposite labels) are
    flipped (a flip keeps the global balance). Samples of one group therefore still share one "control identity", but what a
    held-out group's label is cannot be predicted from the inputs. K > 2 classes: instead of the flip, every
    group's labels are shifted cyclically (class index c -> c + s mod K) by its own s, the shifts 0..K-1 dealt
    out as evenly as the number of groups allows in a random order; members that shared a label still share
    one and members that differed still differ. ``rng``: a ``numpy.random.Generator`` (or an int seed).
    """
    rng = np.random.default_rng(rng)
    y = np.asarray(y)
    groups = np.asarray(groups)
    if y.shape != groups.shape:
        raise UserError("y and groups must have the same shape")
    classes = np.unique(y)
    out = y.copy()
    uniq = np.unique(groups)
    members = {g: np.flatnonzero(groups == g) for g in uniq}
    by_size: dict[int, list] = {}
    for g in uniq:
        by_size.setdefault(len(members[g]), []).append(g)
    for size in sorted(by_size):
        gs = by_size[size]
        perm = rng.permutation(len(gs))
        for g, src in zip(gs, perm):
            out[members[g]] = y[members[gs[src]]]
    if len(classes) == 2:
        flip = {classes[0]: classes[1], classes[1]: classes[0]}
        balanced = [g for g in uniq
                    if np.sum(out[members[g]] == classes[0]) == np.sum(out[members[g]] == classes[1])]
        n_flip = len(balanced) // 2 + (int(rng.random() < 0.5) if len(balanced) % 2 else 0)
        for j in rng.permutation(len(balanced))[:n_flip]:
            idx = members[balanced[j]]
            out[idx] = np.array([flip[v] for v in out[idx]], dtype=out.dtype)
    elif len(classes) > 2:
        k = len(classes)
        index = np.searchsorted(classes, out)
        shifts = rng.permutation(np.arange(len(uniq)) % k)
        for g, sh in zip(uniq, shifts):
            idx = members[g]
            out[idx] = classes[(index[idx] + sh) % k]
    return out


class _Plan:
    """Outer and inner splits for one (labels, groups), computed once and shared by every depth."""

    def __init__(self, y, groups, config, outer=None):
        if outer is None:
            cv = StratifiedGroupKFold(n_splits=config.n_splits, shuffle=True, random_state=config.random_state)
            outer = list(cv.split(np.zeros(len(y)), y, groups))
        self.outer = []
        helper = LinearProbe(config)
        for tr, te in outer:
            if len(np.unique(y[tr])) < 2:
                raise UserError("a training fold has a single class: too few groups per label for grouped CV")
            self.outer.append((tr, te, helper._inner_splits(y[tr], groups[tr])))


def _outer_predictions(X, y, groups, config, plan):
    pred = np.empty_like(y)
    folds = []
    for tr, te, inner in plan.outer:
        probe = LinearProbe(config).fit(X[tr], y[tr], groups[tr], _inner=inner)
        pred[te] = probe.predict(X[te])
        folds.append(float(np.mean(pred[te] == y[te])))
    return pred, folds


def _bootstrap_ci(correct, groups, config) -> tuple[float, float]:
    uniq, inv = np.unique(groups, return_inverse=True)
    n_ok = np.bincount(inv, weights=correct.astype(np.float64), minlength=len(uniq))
    n_all = np.bincount(inv, minlength=len(uniq)).astype(np.float64)
    rng = np.random.default_rng(config.random_state)
    draws = rng.integers(0, len(uniq), size=(config.n_boot, len(uniq)))
    accs = n_ok[draws].sum(1) / n_all[draws].sum(1)
    lo, hi = np.percentile(accs, [2.5, 97.5])
    return float(lo), float(hi)


def check_groups(y, groups, n_splits: int) -> int:
    """Raise UserError unless there are >= 2 classes and enough groups for ``n_splits`` grouped folds (every
    class in at least ``n_splits`` groups); return #groups."""
    y = np.asarray(y)
    groups = np.asarray(groups)
    n_groups = len(np.unique(groups))
    if n_groups < n_splits:
        raise UserError(f"too few groups for grouped cross-validation: {n_groups} group(s), "
                        f"need at least {n_splits} (one per fold; use more pairs, another N, or fewer folds)")
    classes = np.unique(y)
    if len(classes) < 2:
        raise UserError(f"grouped CV probes need at least 2 label classes (got {len(classes)})")
    for c in classes:
        n_c = len(np.unique(groups[y == c]))
        if n_c < n_splits:
            raise UserError(f"too few groups for grouped cross-validation: label {c} occurs in {n_c} group(s), "
                            f"need at least {n_splits}")
    return n_groups


def grouped_cv_score(X, y, groups, config: ProbeConfig = ProbeConfig()) -> ProbeScore:
    """Held-out accuracy of a :class:`LinearProbe` under outer StratifiedGroupKFold; see the module doc."""
    return grouped_cv_scores([X], y, groups, config)[0]


def grouped_cv_scores(Xs, y, groups, config: ProbeConfig = ProbeConfig()) -> list[ProbeScore]:
    """:func:`grouped_cv_score` for several feature matrices (e.g. one per depth) with the same labels and
    groups: the folds are computed once and shared, so the results equal separate calls."""
    if not isinstance(config, ProbeConfig):
        raise UserError("grouped_cv_score needs a ProbeConfig")
    if groups is None:
        raise UserError("grouped_cv_score needs groups (one group id per sample)")
    Xs = [_as_xy(X, y, groups)[0] for X in Xs]
    _, y, groups = _as_xy(np.zeros((len(np.asarray(y)), 1)), y, groups)
    n_groups = check_groups(y, groups, config.n_splits)
    plan = _Plan(y, groups, config)
    # Control labels are permuted within each outer test fold, on the same folds: every training fold then
    # holds the same share of permuted groups as its test fold. (A permutation over the whole dataset makes
    # a fold's training share and test share anti-correlated, which pushes the control *below* chance.)
    rng = np.random.default_rng(config.random_state + 1)
    y_ctrl = y.copy()
    for _, te, _ in plan.outer:
        y_ctrl[te] = permute_labels_by_group(y[te], groups[te], rng)
    plan_c = _Plan(y_ctrl, groups, config, outer=[(tr, te) for tr, te, _ in plan.outer])
    out = []
    for X in Xs:
        pred, folds = _outer_predictions(X, y, groups, config, plan)
        correct = pred == y
        lo, hi = _bootstrap_ci(correct, groups, config)
        pred_c, _ = _outer_predictions(X, y_ctrl, groups, config, plan_c)
        out.append(ProbeScore(
            accuracy=float(np.mean(correct)),
            accuracy_std=float(np.std(folds)),
            ci_low=lo,
            ci_high=hi,
            control_accuracy=float(np.mean(pred_c == y_ctrl)),
            n_samples=int(len(y)),
            n_groups=int(n_groups),
            fold_accuracies=folds,
            n_classes=int(len(np.unique(y))),
        ))
    return out
