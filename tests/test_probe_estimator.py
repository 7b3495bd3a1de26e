"""stats.estimator.RowSpaceLogisticRegression: a conforming scikit-learn classifier that finds sklearn's optimum,
and composes with Pipeline / GridSearchCV over grouped folds into what LinearProbe fits; LinearProbe itself is a
conforming scikit-learn classifier too (clone, get_params, cross_val_score, Pipeline)."""
from __future__ import annotations

import numpy as np
import pytest
import sklearn
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import GridSearchCV, GroupKFold
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils.estimator_checks import parametrize_with_checks

from stats.estimator import RowSpaceLogisticRegression
from stats.linear import LinearProbe, ProbeConfig


# Every check passes, so nothing is listed as expected to fail. row_space=True sends the checks' (narrow) data
# through the SVD path as well. Skipped by scikit-learn itself here: the pandas and array-API checks (neither
# pandas nor SCIPY_ARRAY_API is installed / set in this environment).
@parametrize_with_checks([RowSpaceLogisticRegression(), RowSpaceLogisticRegression(row_space=True), LinearProbe(),
                          LinearProbe(ProbeConfig(Cs=(1.0,)))],
                         expected_failed_checks=lambda est: {}, xfail_strict=True)
def test_sklearn_conformance(estimator, check):
    check(estimator)


def _data(n, d, k, seed):
    rng = np.random.default_rng(seed)
    y = np.arange(n) % k
    X = rng.normal(size=(n, d))
    X[:, 0] += y
    return X, y


@pytest.mark.parametrize("n,d,k", [(80, 6, 2), (30, 90, 2), (90, 8, 3), (30, 60, 3)])
def test_same_optimum_as_sklearn_in_every_row_space_mode(n, d, k):
    X, y = _data(n, d, k, seed=n + d + k)
    for C in (0.05, 3.0):
        # sklearn's objective: unweighted for 2 classes, class-balanced for K > 2 (see the module doc)
        ref = LogisticRegression(C=C, tol=1e-12, max_iter=100000, class_weight=None if k == 2 else "balanced")
        ref.fit(X, y)
        for mode in ("auto", True, False):
            m = RowSpaceLogisticRegression(C, row_space=mode).fit(X, y)
            assert m.coef_.shape == ref.coef_.shape and m.intercept_.shape == ref.intercept_.shape
            assert np.allclose(m.coef_, ref.coef_, atol=1e-4), (mode, C)
            assert np.allclose(m.intercept_, ref.intercept_, atol=1e-4), (mode, C)
            assert np.allclose(m.predict_proba(X), ref.predict_proba(X), atol=1e-5)
            assert np.array_equal(m.predict(X), ref.predict(X))
            assert m.n_features_in_ == d and m.n_iter_.shape == (1,)


def test_zero_inputs_fit_only_the_intercepts():
    # rank 0 in the row space: no weights; the intercepts give the class shares (binary, unweighted) or equal
    # probabilities (K > 2, balanced weights)
    y2 = (np.arange(12) % 3 == 2).astype(int)  # 8 zeros, 4 ones
    y3 = np.repeat([0, 1, 2], [6, 3, 3])
    for y, proba in ((y2, [2 / 3, 1 / 3]), (y3, [1 / 3] * 3)):
        m = RowSpaceLogisticRegression(row_space=True).fit(np.zeros((12, 5)), y)
        assert m.coef_.shape == (len(proba) if len(proba) > 2 else 1, 5) and not m.coef_.any()
        assert np.allclose(m.predict_proba(np.ones((2, 5))), proba, atol=1e-4)


@pytest.mark.parametrize("kw", [dict(C=0), dict(C=-1.0), dict(C=np.inf), dict(C="1"), dict(max_iter=0),
                                dict(max_iter=2.5), dict(tol=-1e-3), dict(row_space="yes")])
def test_bad_parameters_raise_at_fit(kw):
    X, y = _data(20, 3, 2, 0)
    est = RowSpaceLogisticRegression(**kw)  # scikit-learn convention: __init__ stores, fit validates
    with pytest.raises(ValueError):
        est.fit(X, y)


def test_pipeline_and_grid_search_over_groups_reproduce_linear_probe():
    # The library composition LinearProbe is built from: StandardScaler -> solver, C by GridSearchCV over grouped
    # folds, scored by correct predictions per fold. Given the same folds it must fit the same model.
    from stats.linear import _n_correct

    rng = np.random.default_rng(4)
    groups = np.repeat(np.arange(30), 2)
    y = np.tile([0, 1], 30)
    X = rng.normal(size=(60, 40))
    X[:, :2] += 0.5 * y[:, None]
    cfg = ProbeConfig(Cs=(0.01, 0.1, 1.0, 10.0))
    pipe = Pipeline([("scale", StandardScaler()), ("logreg", RowSpaceLogisticRegression(max_iter=cfg.max_iter))])
    cv = GroupKFold(n_splits=3)
    search = GridSearchCV(pipe, {"logreg__C": list(cfg.Cs)}, scoring=_n_correct, cv=cv).fit(X, y, groups=groups)
    probe = LinearProbe(cfg).fit(X, y, groups, _inner=list(cv.split(X, y, groups)))
    assert probe.chosen_C_ == search.best_params_["logreg__C"]
    assert np.array_equal(probe.decision_function(X), search.decision_function(X))
    assert np.array_equal(probe.clf_.coef_, search.best_estimator_[-1].coef_)


def test_linear_probe_clones_and_cross_validates_as_a_scikit_learn_estimator():
    from sklearn.base import clone
    from sklearn.model_selection import cross_val_score

    X, y = _data(60, 5, 2, 0)
    groups = np.arange(60) // 2
    config = ProbeConfig(Cs=(0.1, 1.0), random_state=3)
    probe = LinearProbe(config)
    assert clone(probe).get_params() == {"config": config}
    assert LinearProbe().set_params(config=config).get_params()["config"] is config
    folds = list(GroupKFold(5).split(X, y, groups))
    # scikit-learn hands `groups` to the splitter only: the probe's inner CV is then ungrouped ...
    scores = cross_val_score(probe, X, y, groups=groups, cv=GroupKFold(5))
    assert np.allclose(scores, [LinearProbe(config).fit(X[tr], y[tr]).score(X[te], y[te]) for tr, te in folds])
    # ... and grouped where metadata routing passes them to fit as well
    with sklearn.config_context(enable_metadata_routing=True):
        routed = cross_val_score(LinearProbe(config).set_fit_request(groups=True), X, y, cv=GroupKFold(5),
                                 params={"groups": groups})
    assert np.allclose(routed, [LinearProbe(config).fit(X[tr], y[tr], groups[tr]).score(X[te], y[te])
                                for tr, te in folds])
    assert not np.allclose(routed, scores)  # the inner CV's grouping shows
    piped = Pipeline([("s", StandardScaler()), ("p", LinearProbe(config))]).fit(X, y)
    assert np.allclose(piped.decision_function(X), LinearProbe(config).fit(X, y).decision_function(X))  # scaled twice


def test_inner_cv_with_fewer_samples_per_class_than_folds_falls_back_to_fewer_folds():
    # four classes of two samples each, in two groups each: three inner folds cannot hold every class; scikit-learn
    # refused them (a traceback) where the docstring promises fewer folds
    rng = np.random.default_rng(0)
    y = np.array([0, 1, 2, 0, 1, 2, 3, 3])
    groups = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    X = rng.normal(size=(8, 4)) + 3 * np.eye(4)[y]
    probe = LinearProbe().fit(X, y, groups)
    assert probe.chosen_C_ in ProbeConfig().Cs
    assert (probe.predict(X) == y).mean() == 1.0
