"""stats.linear: the grouped-CV linear probe recovers planted signals, stays at chance on noise."""
from __future__ import annotations

import numpy as np
import pytest

from common.errors import UserError
from stats.linear import LinearProbe, ProbeConfig, grouped_cv_score, grouped_cv_scores, permute_labels_by_group

FAST = ProbeConfig(n_boot=200, Cs=(0.1, 1.0))


def pairs(n_groups=40, per_group=2, d=16, seed=0):
    rng = np.random.default_rng(seed)
    groups = np.repeat(np.arange(n_groups), per_group)
    y = np.tile(np.arange(per_group) % 2, n_groups)
    X = rng.normal(size=(len(y), d))
    return X, y, groups, rng


def test_planted_signal_recovered_and_direction():
    X, y, groups, rng = pairs(n_groups=150)
    w = rng.normal(size=X.shape[1])
    scale = rng.uniform(0.1, 10, size=X.shape[1])  # unequal feature scales: direction must undo them
    Xs = (X + np.outer(2 * y - 1, w / np.linalg.norm(w)) * 1.5) * scale
    s = grouped_cv_score(Xs, y, groups, FAST)
    assert s.accuracy >= 0.9 and s.ci_low > 0.5
    assert abs(s.control_accuracy - 0.5) < 0.2
    assert s.n_samples == 300 and s.n_groups == 150 and len(s.fold_accuracies) == 5
    d = LinearProbe(FAST).fit(Xs, y, groups).direction
    assert d.shape == (16,) and abs(np.linalg.norm(d) - 1) < 1e-9
    true = w / scale  # effective direction in the raw space
    assert np.dot(d, true / np.linalg.norm(true)) > 0.8


def test_noise_at_chance_with_grouped_folds():
    X, y, groups, _ = pairs(n_groups=60, d=32, seed=1)
    s = grouped_cv_score(X, y, groups, FAST)
    assert s.ci_low <= 0.5 <= s.ci_high
    assert abs(s.accuracy - 0.5) < 0.15


def test_group_identity_leak_is_not_rewarded():
    # Features identify the group and every group has one label: a sample-level CV would memorise groups
    # (accuracy ~1); grouped CV holds whole groups out, so nothing is learnt (it can even land below chance:
    # holding out a fold tilts the training balance against it).
    rng = np.random.default_rng(2)
    n_groups = 40
    groups = np.repeat(np.arange(n_groups), 4)
    g_label = rng.permutation(np.arange(n_groups) % 2)
    y = g_label[groups]
    X = rng.normal(size=(n_groups, 8))[groups] + 0.01 * rng.normal(size=(len(y), 8))
    s = grouped_cv_score(X, y, groups, FAST)
    assert s.accuracy < 0.65


def test_control_is_at_chance_even_for_a_perfect_probe():
    X, y, groups, rng = pairs(n_groups=50, seed=3)
    X[:, 0] += 4 * (2 * y - 1)
    s = grouped_cv_score(X, y, groups, FAST)
    assert s.accuracy == 1.0
    assert abs(s.control_accuracy - 0.5) < 0.15


def test_constant_features_at_chance():
    _, y, groups, _ = pairs()
    s = grouped_cv_score(np.ones((len(y), 8)), y, groups, FAST)
    assert s.accuracy == 0.5 and s.ci_low <= 0.5 <= s.ci_high


def test_permute_labels_by_group_keeps_structure():
    _, y, groups, _ = pairs(n_groups=30)
    yc = permute_labels_by_group(y, groups, np.random.default_rng(0))
    assert yc.shape == y.shape and sorted(yc) == sorted(y)
    for g in np.unique(groups):  # a balanced pair stays a balanced pair
        assert sorted(yc[groups == g]) == [0, 1]
    assert (yc != y).any()
    assert np.array_equal(yc, permute_labels_by_group(y, groups, np.random.default_rng(0)))
    # single-label groups: labels move with whole groups; half of them flipped, so each group's control label is
    # its true one or not with even odds (the balance kept on average, not exactly)
    g2 = np.repeat(np.arange(20), 3)
    y2 = (np.arange(20) % 2)[g2]
    y2c = permute_labels_by_group(y2, g2, 1)
    for g in range(20):
        assert len(set(y2c[g2 == g])) == 1
    same = np.mean([np.mean(permute_labels_by_group(y2, g2, seed)[::3] == y2[::3]) for seed in range(400)])
    assert abs(same - 0.5) < 0.02
    assert abs(np.mean([permute_labels_by_group(y2, g2, seed).sum() for seed in range(400)]) - y2.sum()) < 1.0
    # groups no partner can swap with (every size different, labels unbalanced inside): half of them flipped, as
    # the balanced ones, else the control would keep their true labels and read them (control accuracy 1.0)
    g3 = np.repeat(np.arange(20), np.arange(1, 21))
    y3 = np.tile([0, 1], 10)[g3]
    for seed in range(5):
        y3c = permute_labels_by_group(y3, g3, seed)
        moved = [bool((y3c[g3 == g] != y3[g3 == g]).all()) for g in range(20)]
        assert sum(moved) == 10 and all(len(set(y3c[g3 == g])) == 1 for g in range(20))
    mixed = np.repeat(np.arange(8), 3)  # triples, all [0, 0, 1]: a swap between them changes nothing
    y4 = np.tile([0, 0, 1], 8)
    assert (permute_labels_by_group(y4, mixed, 0) != y4).sum() == 4 * 3


def test_unbalanced_groups_flip_the_half_that_keeps_the_class_counts_closest():
    """Binary groups that are not internally balanced (singletons, single-label groups) at 80/20: half of them are
    flipped, as before, but the half whose flips keep the class counts closest. A random half pulled the control to
    ~50/50, and a probe that learns nothing (the majority class) read selectivity +0.34; now +0.13, about what
    flipping half of them must cost (50 flips among 20 minority groups move at least 10 labels)."""
    rng = np.random.default_rng(0)
    y = (rng.random(100) < 0.2).astype(int)
    groups = np.arange(100)
    gaps = []
    for seed in range(10):
        yc = permute_labels_by_group(y, groups, seed)
        gaps.append(abs(yc.mean() - y.mean()))
    assert np.mean(gaps) < 0.15, gaps  # a random half: ~0.28
    sel = [grouped_cv_score(np.random.default_rng(s).normal(size=(100, 3)), y, groups,
                            ProbeConfig(n_boot=20, random_state=s)).selectivity for s in range(4)]
    assert np.mean(sel) < 0.25, sel  # a random half: ~+0.34
    g2 = np.repeat(np.arange(20), 3)  # still half of them flipped: the others would keep their true labels
    y2 = (np.arange(20) % 2)[g2]
    moved = [permute_labels_by_group(y2, g2, s)[::3] != y2[::3] for s in range(200)]
    assert abs(np.mean(moved) - 0.5) < 0.03


def test_deterministic_and_batched_equals_single():
    X, y, groups, _ = pairs(seed=4)
    X[:, 1] += 0.7 * y
    a = grouped_cv_score(X, y, groups, FAST)
    b = grouped_cv_score(X, y, groups, FAST)
    assert a == b
    many = grouped_cv_scores([X, X[:, :4]], y, groups, FAST)
    assert many[0] == a and many[1] == grouped_cv_score(X[:, :4], y, groups, FAST)


def test_matches_sklearn_logistic_regression():
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    X, y, groups, _ = pairs(seed=5)
    X[:, 0] += y
    p = LinearProbe(ProbeConfig(Cs=(0.3,))).fit(X, y)
    ref = LogisticRegression(C=0.3, tol=1e-10, max_iter=10000).fit(StandardScaler().fit_transform(X), y)
    assert np.allclose(p.clf_.coef_, ref.coef_, atol=1e-4)
    assert np.allclose(p.clf_.intercept_, ref.intercept_, atol=1e-4)


def test_too_few_groups_is_a_user_error():
    X, y, groups, _ = pairs(n_groups=4)
    with pytest.raises(UserError, match="4 group.*at least 5"):
        grouped_cv_score(X, y, groups, FAST)
    with pytest.raises(UserError, match="1 group"):
        grouped_cv_score(X, y, np.zeros_like(groups), FAST)


@pytest.mark.parametrize("kw", [dict(n_splits=1), dict(inner_splits=0), dict(Cs=()), dict(Cs=(0.0,)),
                                dict(n_boot=0), dict(random_state=-1), dict(n_splits=2.5)])
def test_config_validates(kw):
    with pytest.raises(UserError):
        ProbeConfig(**kw)


def test_predict_before_fit_and_bad_shapes():
    with pytest.raises(UserError):
        LinearProbe().predict(np.zeros((2, 3)))
    with pytest.raises(UserError):
        LinearProbe().fit(np.zeros((4, 3)), np.array([0, 1, 0]))


def test_control_unbiased_on_task_groups():
    # completion-style groups (several pairs share a group); a feature that encodes the label perfectly.
    # A control permuted over the whole dataset lands below chance (training and test shares of flipped
    # groups are anti-correlated); permuting within each outer fold keeps it at chance on average.
    from tasks import make_dataset

    s = make_dataset("completion", 96, 0, seed=0)
    y = np.array([x.label for x in s])
    groups = np.array([x.group_id for x in s])
    X = np.random.default_rng(0).normal(size=(len(y), 8))
    X[:, 0] += 3 * (2 * y - 1)
    ctrl = [grouped_cv_score(X, y, groups, ProbeConfig(n_boot=50, Cs=(1.0,), random_state=k)).control_accuracy
            for k in range(4)]
    assert abs(np.mean(ctrl) - 0.5) < 0.06


def test_wide_problem_solved_in_the_row_space_matches_the_full_newton_and_sklearn():
    # d > n (a 576-d model with ~100 probe samples): the fit runs in rank(X) coordinates; the optimum must be
    # the same one the full d-dimensional Newton solve and sklearn find.
    from sklearn.linear_model import LogisticRegression

    from stats.estimator import RowSpaceLogisticRegression

    rng = np.random.default_rng(3)
    n, d = 40, 120
    X = rng.normal(size=(n, d))
    y = (X[:, 0] + 0.5 * rng.normal(size=n) > 0).astype(int)
    X = (X - X.mean(0)) / X.std(0)
    for C in (0.01, 1.0):
        wide = RowSpaceLogisticRegression(C).fit(X, y)  # "auto": row space, as d > n
        full = RowSpaceLogisticRegression(C, row_space=False).fit(X, y)
        ref = LogisticRegression(C=C, tol=1e-12, max_iter=100000).fit(X, y)
        assert wide.coef_.shape == (1, d)
        assert np.allclose(wide.coef_, full.coef_, atol=1e-10)
        assert np.allclose(wide.intercept_, full.intercept_, atol=1e-10)
        assert np.allclose(wide.coef_, ref.coef_, atol=1e-4)


def test_c_choice_is_pooled_inner_accuracy_with_ties_to_the_smallest_c():
    # The choice LinearProbe delegates to GridSearchCV, written out as it was before: total correct inner-fold
    # predictions per C (folds of unequal size: completion groups), ties -> smallest C, folds whose training
    # part has one class skipped.
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from stats.estimator import RowSpaceLogisticRegression
    from stats.linear import _inner_splits
    from tasks import make_dataset

    s = make_dataset("completion", 40, 0, seed=1)
    y = np.array([x.label for x in s])
    groups = np.array([x.group_id for x in s])
    cfg = ProbeConfig(Cs=(1.0, 0.01, 0.1, 10.0))
    chosen = []
    for seed in range(6):
        X = np.random.default_rng(seed).normal(size=(len(y), 12))
        X[:, 0] += 0.4 * seed * y
        splits = _inner_splits(y, groups, cfg)
        assert len({len(te) for _, te in splits}) > 1  # unequal folds: pooled accuracy != mean fold accuracy
        scores = np.zeros(len(cfg.Cs))
        for tr, te in splits:
            for i, C in enumerate(cfg.Cs):
                m = make_pipeline(StandardScaler(), RowSpaceLogisticRegression(C)).fit(X[tr], y[tr])
                scores[i] += np.sum(m.predict(X[te]) == y[te])
        best = min(range(len(cfg.Cs)), key=lambda i: (-scores[i], cfg.Cs[i]))
        p = LinearProbe(cfg).fit(X, y, groups)
        assert p.chosen_C_ == cfg.Cs[best]
        chosen.append(p.chosen_C_)
    assert len(set(chosen)) > 1  # the data really move the choice
    # constant inputs: every C ties, the smallest wins (not the first listed)
    assert LinearProbe(cfg).fit(np.ones((len(y), 3)), y, groups).chosen_C_ == 0.01


def test_numbers_unchanged_by_the_library_pipeline():
    # Values computed with stats.linear before it used Pipeline / GridSearchCV / stats.bootstrap (K = 3 and a
    # wide binary problem; the binary narrow case is pinned in tests/test_multiclass.py).
    rng = np.random.default_rng(0)
    cyc = [(0, 1), (1, 2), (2, 0)]
    y = np.array([c for p in range(90) for c in cyc[p % 3]])
    groups = np.repeat(np.arange(90), 2)
    X = rng.normal(size=(len(y), 16))
    X[np.arange(len(y)), y] += 1.0
    s = grouped_cv_score(X, y, groups, FAST)
    assert (s.accuracy, s.ci_low, s.ci_high, s.control_accuracy) == (
        0.5833333333333334, 0.5165277777777778, 0.6445833333333334, 0.3055555555555556)
    assert s.fold_accuracies == [0.5833333333333334, 0.6388888888888888, 0.5833333333333334, 0.6111111111111112, 0.5]
    X, y, groups, rng = pairs(n_groups=48, d=576, seed=7)
    X[:, 0] += 0.6 * y
    s = grouped_cv_score(X, y, groups, FAST)
    assert (s.accuracy, s.ci_low, s.ci_high, s.control_accuracy) == (
        0.5416666666666666, 0.4270833333333333, 0.6356770833333334, 0.4791666666666667)
    assert LinearProbe(FAST).fit(X, y, groups).chosen_C_ == 0.1 and LinearProbe(FAST).fit(X, y).chosen_C_ == 1.0


def test_probe_exposes_its_library_pipeline():
    from sklearn.exceptions import NotFittedError
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    from stats.estimator import RowSpaceLogisticRegression

    X, y, groups, _ = pairs(seed=6)
    X[:, 0] += y
    with pytest.raises(NotFittedError):  # also a UserError (test_predict_before_fit_and_bad_shapes)
        LinearProbe(FAST).decision_function(X)
    p = LinearProbe(FAST).fit(X, y, groups)
    assert isinstance(p.pipeline_, Pipeline) and isinstance(p.scaler_, StandardScaler)
    assert isinstance(p.clf_, RowSpaceLogisticRegression) and p.clf_.C == p.chosen_C_
    assert p.n_features_in_ == X.shape[1] and p.classes_.tolist() == [0, 1]
    assert np.array_equal(p.decision_function(X), p.pipeline_.decision_function(X))
    assert np.array_equal(p.predict(X.astype(np.float32)), p.predict(X.astype(np.float32).astype(np.float64)))


def test_control_training_fold_of_one_class_predicts_it():
    """Ten one-label groups of unique sizes (no swaps; a test fold of two groups flips one, so its control labels
    are one class): a control training fold may hold a single class. Its probe predicts that class (a probe
    trained on labels that say nothing), instead of refusing valid input (54 of 300 such draws were refused)."""
    import stats.linear as lin

    refused_before = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        sizes = rng.permutation(np.arange(1, 11))
        groups = np.repeat(np.arange(10), sizes)
        y = np.repeat(rng.permutation([0] * 5 + [1] * 5), sizes)
        X = rng.normal(size=(len(y), 4)) + 2.0 * y[:, None]
        cfg = ProbeConfig(n_boot=50)
        score = grouped_cv_score(X, y, groups, cfg)
        # the control as the module draws it, scored by hand: a one-class training fold predicts its class
        plan = lin._Plan(y, groups, cfg)
        ctrl_rng = np.random.default_rng(cfg.random_state + 1)
        y_ctrl = y.copy()
        for _, te, _ in plan.outer:
            y_ctrl[te] = permute_labels_by_group(y[te], groups[te], ctrl_rng)
        hits = 0
        single = False
        for tr, te, _ in plan.outer:
            seen = np.unique(y_ctrl[tr])
            if len(seen) == 1:
                single = True
                hits += int(np.sum(y_ctrl[te] == seen[0]))
            else:
                probe = LinearProbe(cfg).fit(X[tr], y_ctrl[tr], groups[tr])
                hits += int(np.sum(probe.predict(X[te]) == y_ctrl[te]))
        refused_before += single
        assert score.control_accuracy == pytest.approx(hits / len(y))
        assert score.accuracy > 0.8  # the true labels' probe is untouched by this
    assert refused_before >= 3  # the case is exercised
