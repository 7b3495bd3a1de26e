"""stats.bootstrap: the one cluster bootstrap behind probe CIs and intervention CIs."""
from __future__ import annotations

import numpy as np
import pytest

from stats.bootstrap import ClusterBootstrap, percentile_ci


def _rows(seed, n_groups=25, string_ids=False):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 5, n_groups)  # unequal groups
    groups = rng.permutation(np.repeat(np.arange(n_groups) * 7 + 3, sizes))  # unsorted, non-contiguous ids
    if string_ids:
        groups = np.array([f"g{g}" for g in groups])
    return groups, rng.random(len(groups)) < 0.6, rng.normal(size=len(groups))


def _former_probe_ci(correct, groups, n_boot, seed):
    # stats.linear._bootstrap_ci as it was before stats.bootstrap (reference for bit-identity)
    uniq, inv = np.unique(groups, return_inverse=True)
    n_ok = np.bincount(inv, weights=correct.astype(np.float64), minlength=len(uniq))
    n_all = np.bincount(inv, minlength=len(uniq)).astype(np.float64)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(uniq), size=(n_boot, len(uniq)))
    accs = n_ok[draws].sum(1) / n_all[draws].sum(1)
    lo, hi = np.percentile(accs, [2.5, 97.5])
    return float(lo), float(hi)


def _former_summarize_ci(v, groups, n_boot, seed):
    # the CI of a per-row mean inside interventions.metrics.summarize before stats.bootstrap
    uniq, inv = np.unique(groups, return_inverse=True)
    G = len(uniq)
    s, n = np.bincount(inv, weights=v, minlength=G), np.bincount(inv, minlength=G).astype(np.float64)
    draws = np.random.default_rng(seed).integers(0, G, size=(n_boot, G))
    b = s[draws].sum(1) / n[draws].sum(1)
    lo, hi = np.percentile(b[np.isfinite(b)], [2.5, 97.5])
    return s.sum() / n.sum(), [float(lo), float(hi)]


@pytest.mark.parametrize("seed,string_ids", [(0, False), (1, True), (2, False)])
def test_identical_to_the_two_former_copies(seed, string_ids):
    groups, correct, v = _rows(seed, string_ids=string_ids)
    n_boot = 500 + seed
    boot = ClusterBootstrap(groups, n_boot, seed)
    ok = boot.sums(correct)[1]
    n = boot.sums(np.ones(len(groups)))[1]
    assert percentile_ci(ok / n) == _former_probe_ci(correct, groups, n_boot, seed)

    from interventions.metrics import summarize

    y = np.zeros(len(groups), int)
    out = summarize(v, np.zeros_like(v), np.ones_like(v), y, 1 - y, groups, n_boot=n_boot, seed=seed)
    point, ci = _former_summarize_ci(v, groups, n_boot, seed)
    assert out["ld_mean"] == point and out["ld_mean_ci"] == ci
    assert out["n_groups"] == boot.n_groups == len(np.unique(groups))


def test_matches_explicit_group_resampling():
    # Resampling whole groups row by row, draw by draw, gives the same replicates as the per-group sums.
    groups, _, v = _rows(3, n_groups=12)
    boot = ClusterBootstrap(groups, 200, 5)
    total, reps = boot.sums(v)
    n = boot.sums(np.ones(len(v)))[1]
    assert total == pytest.approx(v.sum())
    for b in range(200):
        rows = np.concatenate([np.flatnonzero(groups == boot.groups_[j]) for j in boot.draws[b]])
        assert reps[b] == pytest.approx(v[rows].sum()) and n[b] == len(rows)
    assert boot.draws.shape == (200, 12)


def test_seeded_and_group_level():
    groups, correct, _ = _rows(4)
    a, b, c = (ClusterBootstrap(groups, 300, s).draws for s in (7, 7, 8))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    # groups whose rows all agree: every replicate is a mean of whole-group values, so with 0/1 groups it is a
    # share of drawn groups, k/G
    g = np.repeat(np.arange(10), 3)
    boot = ClusterBootstrap(g, 100, 0)
    val = np.repeat(np.arange(10) % 2, 3).astype(float)
    share = boot.sums(val)[1] / boot.sums(np.ones(30))[1]
    assert np.allclose(share * 10, np.round(share * 10))


def test_percentile_ci_drops_undefined_replicates():
    assert percentile_ci([np.nan, np.inf]) is None
    assert percentile_ci([1.0, np.nan, 3.0]) == percentile_ci([1.0, 3.0])
    lo, hi = percentile_ci(np.arange(1001.0))
    assert (lo, hi) == (25.0, 975.0)
    with pytest.raises(ValueError):
        ClusterBootstrap([0, 1], 10, 0).sums([1.0, 2.0, 3.0])


def test_a_nan_row_leaves_the_statistic_undefined_not_scored():
    """A NaN logit difference is no decision: the binary metrics are undefined (None), as the K > 2 path's are,
    not a wrong answer that 'follows the donor'; a mean with a NaN row has no interval (the resamples that miss
    that row would give one)."""
    from interventions.metrics import summarize
    from stats.bootstrap import group_bootstrap_ci

    ld = np.array([np.nan, 1.0, 1.0, 1.0])
    y, g = np.array([0, 1, 0, 1]), np.array([0, 0, 1, 1])
    s = summarize(ld, np.ones(4), -np.ones(4), y, 1 - y, g, n_boot=200)
    for k in ("ld_mean", "accuracy", "follows_donor_rate", "changed_rate"):
        assert s[k] is None and s[k + "_ci"] is None, k
    assert group_bootstrap_ci([0.0, 1.0, np.nan, 5.0], [0, 0, 1, 1], 500, 0) is None
    assert group_bootstrap_ci([0.0, 1.0, 2.0, 5.0], [0, 0, 1, 1], 500, 0) is not None


def test_rows_of_one_group_have_no_interval():
    """Every resample holding the rows of a single group is that group again: an interval of width 0 would read as
    certainty. The one bootstrap gives None there, in each of its callers."""
    from interventions.attribution import cell_means_ci
    from interventions.metrics import summarize
    from stats.bootstrap import group_bootstrap_ci

    assert group_bootstrap_ci([1.0, 2.0, 4.0], [7, 7, 7], 100, 0) is None
    assert group_bootstrap_ci([1.0, 2.0, 4.0, 3.0], [7, 7, 7, 8], 100, 0) is not None
    vals = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    masks = np.array([[1, 1], [1, 1], [1, 0], [1, 0]], bool)  # cell 1: the rows of group 0 alone
    means, cis = cell_means_ci(vals, masks, [0, 0, 1, 1], 200, 0)
    assert means[1] == pytest.approx(3.0) and cis[1] is None and cis[0] is not None
    ld = np.array([1.0, -2.0, 0.5, 3.0])
    one = summarize(ld, ld + 1, ld - 1, np.array([0, 1, 0, 1]), np.array([1, 0, 1, 0]), groups=[3, 3, 3, 3],
                    n_boot=100, seed=0)
    assert one["n_groups"] == 1 and one["ld_mean_ci"] is None and one["accuracy_ci"] is None
    # a rate whose own rows lie in one group (the follows-donor rate: only rows whose donor has another label), in
    # a batch of several groups: no interval for it, the others keep theirs
    ref = np.array([0, 1, 1, 0, 0, 1])  # rows 1 and 2 (group 1) alone have another label than their own
    two = summarize(np.array([1.0, -2.0, 0.5, 3.0, 2.0, -1.0]), np.ones(6), -np.ones(6), np.array([0, 0, 0, 0, 0, 1]),
                    ref, groups=[0, 1, 1, 2, 2, 3], n_boot=100, seed=0)
    assert two["n_donor_rows"] == 2 and two["follows_donor_rate_ci"] is None and two["accuracy_ci"] is not None
