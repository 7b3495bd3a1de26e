"""The probe's solver as a scikit-learn classifier: L2 logistic regression solved in the row space of X.

:class:`RowSpaceLogisticRegression` minimizes scikit-learn's ``LogisticRegression(C=C)`` objective (intercept not
penalized). Probe problems are wide (a 576-d residual stream, ~100 samples): the penalty only touches ``w``, so
the optimum lies in the row space of X (a component orthogonal to it adds penalty and changes no prediction).
With ``X = U S V^T``, ``w = V c`` and ``X w = (U S) c``: the same objective in ``rank(X) <= n`` coordinates,
solved exactly and mapped back. ``benchmarks/probes.py`` measures it against scikit-learn's own solvers.

* two classes: damped Newton (one [r+1, r+1] solve per step), unweighted, exactly deterministic;
* K > 2 classes: multinomial, ``class_weight="balanced"``, scikit-learn's lbfgs on the row-space coordinates.
  The weights matter for grouped CV: folds of pairs cannot be exactly balanced over K > 2 classes, and an
  unweighted probe with uninformative inputs predicts the training fold's majority class, which is the
  held-out fold's minority, so it lands *below* chance (e.g. ~0.2 instead of 1/3 at standard-prefill depth 0).
  Balanced, all classes tie and the first wins, whatever the fold: chance exactly. (Two classes need no
  weights: every pair, so every group and fold, holds both labels equally.)

It is a regular estimator (``get_params``/``set_params``, ``clone``, ``Pipeline``, ``GridSearchCV``; checked by
scikit-learn's conformance suite in tests/test_probe_estimator.py). There is no randomness, so no
``random_state``. Standardization is not built in: :class:`stats.linear.LinearProbe` puts a ``StandardScaler``
in front of it.
"""
from __future__ import annotations

import numbers
import warnings

import numpy as np
from scipy.special import expit, softmax
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted, validate_data

__all__ = ["RowSpaceLogisticRegression"]


def _row_space(X):
    """(coordinates [n, r], V^T [r, d]) of X in its row space; r = numerical rank (np.linalg.matrix_rank's rule)."""
    n, d = X.shape
    U, S, Vt = np.linalg.svd(X, full_matrices=False)
    r = int((S > S[0] * max(n, d) * np.finfo(np.float64).eps).sum()) if len(S) and S[0] > 0 else 0
    return U[:, :r] * S[:r], Vt[:r]


def _newton_binary(X, t, C, max_iter, tol):
    """Minimize ``0.5 ||w||^2 + C sum_i log(1 + exp(-t_i (w.x_i + b)))``, t in {-1, +1}: (beta = [w, b], #iters)."""
    n, d = X.shape
    Xb = np.hstack([X, np.ones((n, 1))])
    reg = np.ones(d + 1)
    reg[-1] = 0.0  # intercept not penalized

    def loss(beta):
        return C * np.sum(np.logaddexp(0.0, -t * (Xb @ beta))) + 0.5 * np.dot(reg * beta, beta)

    beta = np.zeros(d + 1)
    f = loss(beta)
    it = 0
    for it in range(1, max_iter + 1):
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
        if dec / 2 <= tol * max(1.0, abs(f)):
            break
        a = 1.0
        while True:  # backtracking (Armijo)
            cand = beta - a * step
            f_new = loss(cand)
            if f_new <= f - 1e-4 * a * dec or a < 1e-8:
                break
            a *= 0.5
        beta, f = cand, f_new
    return beta, it


class RowSpaceLogisticRegression(ClassifierMixin, BaseEstimator):
    """L2-regularized logistic regression (binary: exact Newton; K > 2: balanced multinomial), see the module doc.

    Parameters
    ----------
    C : float > 0, inverse regularization strength (scikit-learn's ``C``).
    max_iter : int >= 1, Newton (binary) or lbfgs (K > 2) iterations.
    tol : float >= 0, stopping tolerance (binary: Newton decrement relative to the loss; K > 2: lbfgs ``tol``).
    row_space : ``"auto"`` (solve in the row space of X when it has more features than samples), True (always)
        or False (never: the full d-dimensional solve). All three reach the same optimum.

    Attributes: ``classes_``, ``coef_`` [1, d] (binary) or [K, d], ``intercept_`` [1] or [K], ``n_iter_`` [1],
    ``n_features_in_`` (and ``feature_names_in_`` for a DataFrame).
    """

    def __init__(self, C: float = 1.0, max_iter: int = 1000, tol: float = 1e-8, row_space="auto"):
        self.C = C
        self.max_iter = max_iter
        self.tol = tol
        self.row_space = row_space

    def _check_params(self):
        # Plain ValueErrors, the scikit-learn convention (no private _parameter_constraints machinery).
        if isinstance(self.C, bool) or not isinstance(self.C, numbers.Real) or not np.isfinite(self.C) or self.C <= 0:
            raise ValueError(f"C must be a positive finite number (got {self.C!r})")
        if isinstance(self.max_iter, bool) or not isinstance(self.max_iter, numbers.Integral) or self.max_iter < 1:
            raise ValueError(f"max_iter must be an integer >= 1 (got {self.max_iter!r})")
        if isinstance(self.tol, bool) or not isinstance(self.tol, numbers.Real) or not self.tol >= 0:
            raise ValueError(f"tol must be a number >= 0 (got {self.tol!r})")
        if not (self.row_space == "auto" or self.row_space is True or self.row_space is False):
            raise ValueError(f"row_space must be 'auto', True or False (got {self.row_space!r})")

    def fit(self, X, y):
        return self._fit_path(X, y, [self])[0]

    def fit_path(self, X, y, Cs, _validated: bool = False) -> list["RowSpaceLogisticRegression"]:
        """One fitted copy of this estimator per C in ``Cs``, sharing the input checks and the row-space SVD:
        each equals ``clone(self).set_params(C=C).fit(X, y)`` exactly (the C search of stats.linear and
        probes.mdl fits every candidate C on the same standardized fold). ``_validated`` (internal): X is a finite
        float64 [n, d] array and y a 1-D label array already (stats.linear checked them): scikit-learn's checks,
        which cost more than a small fit, are skipped."""
        return self._fit_path(X, y, [RowSpaceLogisticRegression(C, self.max_iter, self.tol, self.row_space)
                                     for C in Cs], _validated)

    @staticmethod
    def _fit_path(X, y, estimators, validated=False):
        """Fit every estimator (same max_iter, tol, row_space; its own C) on X, y; the first one validates."""
        for est in estimators:
            est._check_params()
        first = estimators[0]
        if validated:
            first.n_features_in_ = X.shape[1]
        else:
            X, y = validate_data(first, X, y, dtype=np.float64)
            check_classification_targets(y)
        classes = np.unique(y)
        k = len(classes)
        if k < 2:
            raise ValueError(f"logistic regression needs samples of at least 2 classes; got {k} class")
        n, d = X.shape
        Vt = None
        if first.row_space is True or (first.row_space == "auto" and d > n):
            X, Vt = _row_space(X)
        t = np.where(y == classes[1], 1.0, -1.0) if k == 2 else None
        for est in estimators:
            est.classes_ = classes
            est.n_features_in_ = first.n_features_in_
            if hasattr(first, "feature_names_in_"):
                est.feature_names_in_ = first.feature_names_in_
            if k == 2:
                beta, it = _newton_binary(X, t, float(est.C), int(est.max_iter), float(est.tol))
                coef, intercept = beta[None, :-1].copy(), beta[-1:].copy()
            else:
                coef, intercept, it = est._fit_multinomial(X, y, Vt is not None and Vt.shape[0] == 0)
            est.coef_ = coef @ Vt if Vt is not None else coef
            est.intercept_ = intercept
            est.n_iter_ = np.array([it])
        return estimators

    def _fit_multinomial(self, X, y, rank0):
        from sklearn.exceptions import ConvergenceWarning
        from sklearn.linear_model import LogisticRegression

        if rank0:  # X is zero: only the intercepts can fit; lbfgs needs at least one column
            X = np.zeros((len(X), 1))
        clf = LogisticRegression(C=float(self.C), solver="lbfgs", max_iter=int(self.max_iter), tol=float(self.tol),
                                 class_weight="balanced")
        with warnings.catch_warnings():
            # lbfgs rarely meets tol=1e-8 before max_iter on separable folds; the fit is used as it stands.
            warnings.simplefilter("ignore", ConvergenceWarning)
            clf.fit(X, y)
        coef = np.zeros((clf.coef_.shape[0], 0)) if rank0 else clf.coef_.copy()
        return coef, clf.intercept_.copy(), int(np.max(clf.n_iter_))

    def decision_function(self, X):
        """Logits: [n] (binary, positive = ``classes_[1]``) or [n, K]."""
        check_is_fitted(self)
        return self._decision(validate_data(self, X, dtype=np.float64, reset=False))

    def _decision(self, X):
        """decision_function of an already validated float64 array (stats.linear.fold_fits' inner folds)."""
        if len(self.classes_) == 2:
            return X @ self.coef_[0] + self.intercept_[0]
        return X @ self.coef_.T + self.intercept_

    def _predict_from(self, dec):
        """predict's labels from decision_function's values."""
        if dec.ndim == 1:
            return np.where(dec > 0, self.classes_[1], self.classes_[0])
        return self.classes_[np.argmax(dec, axis=1)]

    def predict(self, X):
        return self._predict_from(self.decision_function(X))

    def predict_proba(self, X):
        """Class probabilities [n, K] of the fitted model (binary: sigmoid; K > 2: softmax of the logits)."""
        dec = self.decision_function(X)
        if dec.ndim == 1:
            p = expit(dec)
            return np.column_stack([1.0 - p, p])
        return softmax(dec, axis=1)

    def predict_log_proba(self, X):
        return np.log(self.predict_proba(X))
