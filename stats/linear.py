"""Linear probes with group-held-out cross-validation (docs/design.md, Probes).

Everything is sklearn-style and deterministic: every source of randomness comes from an explicit
``random_state`` in :class:`ProbeConfig`; nothing global is touched.

Protocol of :func:`grouped_cv_score`
    * outer ``StratifiedGroupKFold(n_splits, shuffle=True, random_state)``: whole groups are held out;
    * inside every outer training fold a :class:`LinearProbe` (``Pipeline``: ``StandardScaler`` ->
      :class:`stats.estimator.RowSpaceLogisticRegression`) picks its inverse regularization ``C`` from
      ``config.Cs`` by an inner grouped CV on that training fold only (the choice ``GridSearchCV`` with the
      :func:`_n_correct` scorer makes, computed directly: :func:`fold_fits`);
    * ``accuracy`` = accuracy of all held-out predictions pooled (every sample is predicted exactly once);
      ``accuracy_std`` = standard deviation of the per-fold accuracies (``fold_accuracies``);
    * 95% CI: percentile bootstrap over **groups** (cluster bootstrap): groups are resampled with
      replacement together with all their held-out predictions, because samples of one group (a pair and its
      siblings) are not independent. ``n_boot`` resamples, seeded by ``random_state``
      (:class:`stats.bootstrap.ClusterBootstrap`, shared with the intervention metrics);
    * ``control_accuracy``: the same protocol with the labels permuted at the group level
      (:func:`permute_labels_by_group`): the control task of Hewitt & Liang (2019). Selectivity =
      accuracy - control_accuracy.

K classes: two classes are fitted by exact Newton, K > 2 classes (e.g. shell_game) by class-balanced multinomial
(softmax) logistic regression (both in the row space of X when it is wide: stats/estimator.py), with the same
grouped CV, C selection, control and bootstrap; chance is 1/K (``ProbeScore.chance``).
"""
from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field

import numpy as np
from sklearn import config_context
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.exceptions import DataConversionWarning, NotFittedError
from sklearn.model_selection import StratifiedGroupKFold, StratifiedKFold
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils.multiclass import type_of_target

from stats.bootstrap import ClusterBootstrap, percentile_ci
from common.errors import UserError
from stats.estimator import RowSpaceLogisticRegression

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
                or not 0 <= self.random_state < 2 ** 32:  # numpy's seeds (the folds') are 32-bit
            raise UserError(f"ProbeConfig.random_state must be an integer in [0, 2**32) (got {self.random_state!r})")
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


class InputError(UserError, ValueError):
    """Bad X / y / groups: one line for this project's CLIs, the ValueError scikit-learn's tools expect."""


class _TypeInputError(InputError, TypeError):
    """X that is not numbers: scikit-learn raises a TypeError there."""


def _as_xy(X, y, groups=None):
    if hasattr(X, "tocsr") or hasattr(X, "toarray"):
        raise InputError("sparse input is not supported: pass a dense array X [samples, features]")
    try:
        X = np.asarray(X, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise _TypeInputError(f"X must be a 2-D array of numbers [samples, features]: {e}") from None
    if y is None:
        raise InputError("LinearProbe requires y to be passed, but the target y is None")
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:  # a column vector, as scikit-learn estimators take it
        warnings.warn("A column-vector y was passed when a 1d array was expected: used as [samples]", DataConversionWarning, stacklevel=3)
        y = y.ravel()
    if X.ndim != 2:
        raise InputError(f"X must be 2-D [samples, features] (got shape {X.shape})")
    if X.shape[0] == 0 or X.shape[1] == 0:
        raise InputError(f"X is empty: {X.shape[0]} sample(s) and {X.shape[1]} feature(s) (shape={X.shape}) "
                         f"while a minimum of 1 is required.")
    if y.ndim != 1 or len(y) != len(X):
        raise InputError(f"y must be 1-D with one label per row of X ({len(X)}), got shape {y.shape}")
    if not np.isfinite(X).all():
        raise InputError("X contains NaN or infinite values")
    try:
        kind = type_of_target(y, raise_unknown=True)
    except ValueError as e:
        raise InputError(f"y must hold class labels: {e}") from None
    if kind not in ("binary", "multiclass"):
        raise InputError(f"y must hold class labels (integers or strings), got {kind} values")
    if groups is not None:
        groups = np.asarray(groups)
        if groups.shape != y.shape:
            raise InputError(f"groups must have one entry per sample ({len(y)}), got shape {groups.shape}")
    return X, y, groups


def _inner_splits(y, groups, config):
    """The inner CV choosing C: StratifiedGroupKFold over ``groups`` (fewer folds if fewer groups), or
    StratifiedKFold without groups; None if it cannot run (fewer than 2 groups, or a class too small)."""
    k = config.inner_splits
    if groups is not None:
        # StratifiedGroupKFold refuses more folds than the largest class has samples (not one fold could hold
        # each class): fewer folds then, as with fewer groups
        k = min(k, len(np.unique(groups)), int(np.unique(y, return_counts=True)[1].max()))
        if k < 2:
            return None
        cv = StratifiedGroupKFold(n_splits=k, shuffle=True, random_state=config.random_state)
        return list(cv.split(np.zeros(len(y)), y, groups))
    k = min(k, int(np.unique(y, return_counts=True)[1].min()))
    if k < 2:
        return None
    cv = StratifiedKFold(n_splits=k, shuffle=True, random_state=config.random_state)
    return list(cv.split(np.zeros(len(y)), y))


def _n_correct(estimator, X, y) -> float:
    """Inner-CV scorer: correct predictions in the fold. Their mean over folds ranks C like the pooled inner
    accuracy (a mean of per-fold accuracies would weight the unequal grouped folds differently). A plain callable:
    ``make_scorer(accuracy_score, normalize=False)`` gives the same numbers but re-validates the labels per call."""
    return float(np.sum(estimator.predict(X) == y))


class _NotFitted(UserError, NotFittedError):
    """A UserError for this project's CLIs, a NotFittedError for scikit-learn."""


def fold_fits(X, y, splits, Cs, max_iter: int):
    """For each (train, test) split: (test rows, [(RowSpaceLogisticRegression, its decision_function on X[test])
    per C]), every C fitted on the training rows standardized once (StandardScaler) with one shared SVD: each
    classifier is the one ``Pipeline([StandardScaler(), RowSpaceLogisticRegression(C)]).fit(X[train], y[train])``
    holds, and its decision values are that pipeline's ``decision_function(X[test])``, exactly."""
    X, y, _ = _as_xy(X, y)
    for tr, te in splits:
        with config_context(assume_finite=True, skip_parameter_validation=True):  # X was checked above
            scaler = StandardScaler().fit(X[tr])
        # StandardScaler.transform, written out: the same two elementwise operations (so the same numbers)
        # without its input checks, which cost as much as the arithmetic here
        Xtr, Xte = (X[tr] - scaler.mean_) / scaler.scale_, (X[te] - scaler.mean_) / scaler.scale_
        clfs = RowSpaceLogisticRegression(max_iter=max_iter).fit_path(Xtr, y[tr], Cs, _validated=True)
        yield te, [(clf, clf._decision(Xte)) for clf in clfs]


class LinearProbe(ClassifierMixin, BaseEstimator):
    """``Pipeline([StandardScaler(), RowSpaceLogisticRegression()])`` (binary, or balanced multinomial for K > 2
    classes) whose ``C`` is chosen from ``config.Cs`` by an inner grouped CV on the training data only: the C that
    ``GridSearchCV`` over those folds with the :func:`_n_correct` scorer picks, computed without its per-fit
    machinery (every C of a fold fitted on one standardization and one SVD, :func:`fold_fits`).

    With ``groups`` the inner CV is a ``StratifiedGroupKFold`` (fewer folds if there are fewer groups than
    ``inner_splits``); without, a ``StratifiedKFold``. Inner folds whose training part has a single class are
    left out. ``C`` ties go to the smallest (strongest regularization). If the inner CV cannot run (fewer than 2
    groups, or a class too small), ``C`` falls back to the middle of the sorted ``Cs`` (whatever order they were
    listed in; as probes.mdl takes it). Fitted: ``pipeline_``, ``scaler_`` / ``clf_`` (its two steps),
    ``chosen_C_``, ``classes_``, ``n_features_in_``.

    A conforming scikit-learn classifier (``check_estimator``; clone, ``get_params``, Pipelines,
    ``cross_val_score``): its one parameter is ``config`` (None = ``ProbeConfig()``). scikit-learn's tools hand
    ``groups`` to the splitter only, so the inner CV is then ungrouped, unless metadata routing passes them to
    ``fit`` too (``set_fit_request(groups=True)``).
    """

    def __init__(self, config: ProbeConfig | None = None):
        self.config = config  # None = ProbeConfig(); checked by fit, as scikit-learn estimators do

    @staticmethod
    def _pipeline(C, max_iter):
        return Pipeline([("scale", StandardScaler()), ("logreg", RowSpaceLogisticRegression(C=C, max_iter=max_iter))])

    def fit(self, X, y, groups=None, _inner=None) -> "LinearProbe":
        """Fit; ``_inner`` (internal) = precomputed inner splits, so many depths share one split computation."""
        if self.config is not None and not isinstance(self.config, ProbeConfig):
            raise UserError(f"LinearProbe needs a ProbeConfig (got {type(self.config).__name__})")
        config = self.config if self.config is not None else ProbeConfig()
        X, y, groups = _as_xy(X, y, groups)
        classes = np.unique(y)
        if len(classes) < 2:
            raise InputError(f"cannot fit a probe: the training labels have one class ({classes.tolist()})")
        Cs = config.Cs
        splits = None if len(Cs) == 1 else (_inner if _inner is not None else _inner_splits(y, groups, config))
        # X was checked finite above: skip scikit-learn's repeated finiteness and parameter checks in the inner fits.
        with config_context(assume_finite=True, skip_parameter_validation=True):
            if len(Cs) == 1:
                C, pipe = Cs[0], None
            elif splits is None:
                C, pipe = sorted(Cs)[len(Cs) // 2], None
            else:
                usable = [(tr, te) for tr, te in splits if len(np.unique(y[tr])) >= 2]
                if usable:
                    # What GridSearchCV(self._pipeline, {"logreg__C": sorted(Cs)}, scoring=_n_correct, cv=usable)
                    # chooses (tests/test_probe_estimator.py), without its per-fit machinery: every C fitted on
                    # the fold's one standardization and SVD (fold_fits); the first best, i.e. the smallest tied C.
                    order = sorted(Cs)
                    correct = np.zeros(len(order))
                    for te, fits in fold_fits(X, y, usable, order, config.max_iter):
                        correct += [np.sum(clf._predict_from(dec) == y[te]) for clf, dec in fits]
                    C, pipe = order[int(np.argmax(correct))], None
                else:  # no inner fold can be scored: every C ties, the smallest wins
                    C, pipe = min(Cs), None
            if pipe is None:
                pipe = self._pipeline(C, config.max_iter).fit(X, y)
        self.chosen_C_ = float(C)
        self.pipeline_ = pipe
        self.scaler_, self.clf_ = pipe[0], pipe[-1]
        self.classes_ = self.clf_.classes_
        self.n_features_in_ = self.clf_.n_features_in_
        return self

    def _check_fitted(self):
        if not hasattr(self, "pipeline_"):
            raise _NotFitted("this LinearProbe is not fitted yet: call fit(X, y, groups) first")

    def decision_function(self, X) -> np.ndarray:
        self._check_fitted()
        return self.pipeline_.decision_function(np.asarray(X, dtype=np.float64))

    def predict(self, X) -> np.ndarray:
        self._check_fitted()
        return self.pipeline_.predict(np.asarray(X, dtype=np.float64))

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
    flipped (a flip keeps the global balance), and half of the other groups, the half whose flips keep the class
    counts closest. Samples of one group therefore
    still share one "control identity", but what a held-out group's label is cannot be predicted from the
    inputs. K > 2 classes: instead of the flip, every
    group's labels are shifted cyclically (class index c -> c + s mod K) by its own s, the shifts 0..K-1 dealt
    out as evenly as the number of groups allows in a random order, then moved (each shift still dealt within
    one of n / K times) while that brings the class counts closer to the true labels' (:func:`_count_keeping`); members that shared a label
    still share one and members that differed still differ. ``rng``: a ``numpy.random.Generator`` (or an int seed).
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
        # Then half of the other groups: a group with no partner of its size and unequal counts (or partners whose
        # label vectors are all alike, or a swap that drew its own vector, likely with few groups a size) would keep
        # its true labels, and the control would read them. A flip there moves the class counts, so which half is
        # chosen to keep them closest (trades only: a [0, 0, 0] group flipped beside a [1, 1, 1] one keeps them;
        # flipping a random half pulled an 80/20 control to ~50/50 and read selectivity +0.34 on noise). Drawn after
        # the balanced groups', so tasks whose groups are all balanced (every built-in task's pairs) get the same
        # control labels as before.
        in_balanced = set(balanced)
        unbalanced = [g for g in uniq if g not in in_balanced]
        for pool in (balanced, unbalanced):
            if not pool:
                continue
            n_flip = len(pool) // 2 + (int(rng.random() < 0.5) if len(pool) % 2 else 0)
            flipped = np.zeros(len(pool), dtype=int)
            flipped[rng.permutation(len(pool))[:n_flip]] = 1
            if pool is unbalanced:
                index = np.searchsorted(classes, out)
                counts = [np.bincount(index[members[g]], minlength=2) for g in pool]  # [2] each, before a flip
                fixed = np.bincount(index, minlength=2) - sum(counts)  # every other group's, which stay
                flipped = _count_keeping(flipped, counts, np.bincount(np.searchsorted(classes, y), minlength=2)
                                         - fixed, rng, trades_only=True)
            for g, f in zip(pool, flipped):
                if f:
                    idx = members[g]
                    out[idx] = np.array([flip[v] for v in out[idx]], dtype=out.dtype)
    elif len(classes) > 2:
        k = len(classes)
        index = np.searchsorted(classes, out)
        shifts = _count_keeping(rng.permutation(np.arange(len(uniq)) % k),
                                [np.bincount(index[members[g]], minlength=k) for g in uniq],
                                np.bincount(np.searchsorted(classes, y), minlength=k), rng)
        for g, sh in zip(uniq, shifts):
            idx = members[g]
            out[idx] = classes[(index[idx] + sh) % k]
    return out


def _count_keeping(shifts, counts, target, rng, tries_per_group: int = 50, trades_only: bool = False):
    """Move the groups' shifts (trade two groups' shifts, or give one group another shift while every shift is
    still dealt within one of n / K times) while that brings the control labels' class counts closer to the true
    labels' (`target`): a probe that learns nothing scores the share of the class its tie goes to, so unequal
    counts bias selectivity (-0.07 .. +0.02 on shell_game / s5 at 96 pairs, whose true labels are balanced).
    Random moves, accepted when the L1 distance falls; stops at 0 or after `tries_per_group` moves per group.
    `counts[g]` [k]: group g's label counts before its shift. `trades_only`: the deal stays exactly as given (the
    binary flips of groups the swaps cannot move: half of them flipped, only which half chosen)."""
    k, n = len(target), len(shifts)
    shifts = np.array(shifts)
    rolled = [np.stack([np.roll(c, s) for s in range(k)]) for c in counts]  # [k shifts, k classes] per group
    total = sum(r[s] for r, s in zip(rolled, shifts))
    dist = int(np.abs(total - target).sum())
    dealt = np.bincount(shifts, minlength=k)
    lo, hi = n // k - 1, -(-n // k) + 1  # how uneven the deal may grow
    for a, b, s in zip(*(rng.integers(0, m, size=tries_per_group * n) for m in (n, n, k))):
        if dist == 0:
            break
        sa, sb = shifts[a], shifts[b]
        if a != b and sa != sb:  # a trade: the deal as it was
            new = total - rolled[a][sa] - rolled[b][sb] + rolled[a][sb] + rolled[b][sa]
            moved = {a: sb, b: sa}
        elif not trades_only and s != sa and dealt[sa] > lo and dealt[s] < hi:  # one group's shift, near even
            new = total - rolled[a][sa] + rolled[a][s]
            moved = {a: s}
        else:
            continue
        d = int(np.abs(new - target).sum())
        if d < dist:
            for g, to in moved.items():
                dealt[shifts[g]] -= 1
                dealt[to] += 1
                shifts[g] = to
            total, dist = new, d
    return shifts


class _Plan:
    """Outer and inner splits for one (labels, groups), computed once and shared by every depth."""

    def __init__(self, y, groups, config, outer=None, single_class_ok: bool = False):
        if outer is None:
            cv = StratifiedGroupKFold(n_splits=config.n_splits, shuffle=True, random_state=config.random_state)
            outer = list(cv.split(np.zeros(len(y)), y, groups))
        self.outer = []
        for tr, te in outer:
            if len(np.unique(y[tr])) < 2:
                if not single_class_ok:
                    raise UserError("a training fold has a single class: too few groups per label for grouped CV")
                self.outer.append((tr, te, None))
                continue
            self.outer.append((tr, te, _inner_splits(y[tr], groups[tr], config)))


def _outer_predictions(X, y, groups, config, plan):
    pred = np.empty_like(y)
    folds = []
    for tr, te, inner in plan.outer:
        if len(np.unique(y[tr])) == 1:  # the control's only (see grouped_cv_scores): it predicts the one class seen
            pred[te] = y[tr][0]
        else:
            pred[te] = LinearProbe(config).fit(X[tr], y[tr], groups[tr], _inner=inner).predict(X[te])
        folds.append(float(np.mean(pred[te] == y[te])))
    return pred, folds


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
    # A control training fold may hold one class (few groups per fold, each of one label: a test fold of two such
    # groups flips one of them): its probe predicts that class, as a probe trained on labels that say nothing
    # would; refusing there refused valid input.
    plan_c = _Plan(y_ctrl, groups, config, outer=[(tr, te) for tr, te, _ in plan.outer], single_class_ok=True)
    boot = ClusterBootstrap(groups, config.n_boot, config.random_state)  # the same resamples for every X
    n_rep = boot.sums(np.ones(len(y)))[1]
    out = []
    for X in Xs:
        pred, folds = _outer_predictions(X, y, groups, config, plan)
        correct = pred == y
        lo, hi = percentile_ci(boot.sums(correct)[1] / n_rep)
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
