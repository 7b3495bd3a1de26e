"""Cluster bootstrap: percentile CIs that resample whole groups (one helper for probes and interventions).

Rows of one group (a pair and its siblings) are not independent, so a resample draws G groups with replacement
(G = number of distinct groups) and takes all rows of every drawn group. A statistic that is a ratio of sums
(an accuracy, a mean, a rate) is evaluated on each resample from per-group sums, so nothing per row is copied.
The draws come from ``numpy.random.default_rng(seed)`` only: one seed, one set of resamples. A statistic whose
rows lie in fewer than two groups has no interval (None): every resample that holds its rows is the same group
again, and an interval of width 0 would read as certainty.
"""
from __future__ import annotations

import numpy as np

__all__ = ["ClusterBootstrap", "percentile_ci", "group_bootstrap_ci", "PERCENTILES"]

PERCENTILES = (2.5, 97.5)  # the 95% percentile interval (written out: 100 * (1 - 0.95) / 2 is not exactly 2.5)


class ClusterBootstrap:
    """``n_boot`` resamples of the groups in ``groups`` [rows], seeded by ``seed``.

    ``draws`` [n_boot, G]: group indices (into ``groups_``, the sorted distinct groups) of every resample.
    """

    def __init__(self, groups, n_boot: int, seed: int):
        self.groups_, self.inverse_ = np.unique(np.asarray(groups), return_inverse=True)
        g = len(self.groups_)
        self.draws = np.random.default_rng(seed).integers(0, g, size=(int(n_boot), g))

    @property
    def n_groups(self) -> int:
        return len(self.groups_)

    def group_sums(self, values) -> np.ndarray:
        """Per-group sums [G] of per-row ``values`` (float64)."""
        values = np.asarray(values, dtype=np.float64)
        if values.shape != self.inverse_.shape:
            raise ValueError(f"values must have one entry per row ({len(self.inverse_)}), got shape {values.shape}")
        return np.bincount(self.inverse_, weights=values, minlength=self.n_groups)

    def sums(self, values) -> tuple[float, np.ndarray]:
        """(sum over all groups, sum over each resample's groups [n_boot]) of per-row ``values``."""
        s = self.group_sums(values)
        return s.sum(), s[self.draws].sum(1)


def percentile_ci(replicates) -> tuple[float, float] | None:
    """95% percentile interval of the finite bootstrap replicates (a ratio can be undefined on some resamples);
    None if none is finite."""
    r = np.asarray(replicates, dtype=np.float64)
    r = r[np.isfinite(r)]
    if not len(r):
        return None
    lo, hi = np.percentile(r, PERCENTILES)
    return float(lo), float(hi)


def group_bootstrap_ci(values, groups, n_boot: int = 1000, seed: int = 0) -> list[float] | None:
    """Percentile 95% CI of the mean of per-row `values`, resampling whole groups."""
    v = np.asarray(values, dtype=np.float64)
    if len(v) == 0 or not np.isfinite(v).all():  # an undefined mean has no interval (not that of the draws
        return None  # that happen to miss the non-finite rows)
    boot = ClusterBootstrap(groups, n_boot, seed)
    if boot.n_groups < 2:
        return None
    _, total = boot.sums(v)
    _, count = boot.sums(np.ones_like(v))
    ci = percentile_ci(total / count)
    return None if ci is None else [ci[0], ci[1]]
