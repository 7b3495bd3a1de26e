"""What the DAS / attribution reports say about their own reliability (adversarial review, 2026-12-07): integrated
gradients' path resolution, an agreement check that cannot fail at few cells, probe subspaces with fewer directions
than asked, and the site a refusal names."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from interventions.attribution import agreement, ig_path_resolution
from interventions.report import _rank_words, _subspace_clause
from interventions.subspace import NoDirection, fold_ranks, fold_subspaces


def test_ig_path_resolution_flags_a_flip_between_two_points():
    """Four rows, M = 4 points: a smooth ramp (each step a quarter), a flip between two points (one step carries it
    all), a flip at the path's end (the last point to the paired input), and a row that never moves."""
    start = torch.tensor([0.0, 18.0, 18.0, 5.0])
    end = torch.tensor([-4.0, -18.0, -18.0, 5.0])
    path = torch.tensor([[-0.5, -1.5, -2.5, -3.5],
                         [18.0, 18.0, -18.0, -18.0],
                         [18.0, 18.0, 18.0, 18.0],
                         [5.0, 5.0, 5.0, 5.0]])
    r = ig_path_resolution(path, start, end)
    assert r["n_rows"] == 4 and r["unresolved_rows"] == 2
    assert r["total_change_mean"] == pytest.approx((-4 - 36 - 36 + 0) / 4)
    # largest step shares of the rows that move: the ramp 1/4 (its inner steps; the half-steps at the ends 1/8), the
    # two flips 1.0 each
    assert r["largest_step_share_median"] == pytest.approx(1.0)
    assert ig_path_resolution(path[:1], start[:1], end[:1])["largest_step_share_median"] == pytest.approx(0.25)


def test_agreement_reports_no_top_overlap_where_every_cell_is_in_both_tops():
    few = agreement([1.0, 2.0, 3.0], [3.0, 2.0, 1.0], ["a", "b", "c"])
    assert few["top_overlap"] is None and few["spearman"] == pytest.approx(-1.0)
    many = agreement(list(range(8)), list(range(8)), list("abcdefgh"))
    assert many["top_overlap"] == 5 and many["top_k"] == 5


def test_fold_subspaces_report_the_ranks_they_found():
    """A 4-wide site and 10 pairs with rank 4 asked: once the label's direction is projected out the probe finds
    nothing more on some folds; each fold's rank is what it found, and the report prints both."""
    rng = np.random.default_rng(0)
    y = np.tile([0, 1], 10)
    groups = np.repeat(np.arange(10), 2)
    H = torch.tensor(np.c_[3.0 * y, np.zeros((20, 3))] + 1e-3 * rng.normal(size=(20, 4)), dtype=torch.float64)
    H[:, 1:] = 0.0  # nothing but the label's coordinate varies
    folds = fold_subspaces(H, y, groups, rank=4)
    ranks = fold_ranks(folds)
    assert all(r == f.U.shape[1] for r, f in zip(ranks, folds)) and max(ranks) < 4
    sub = {"rank": 4, "fold_ranks": ranks}
    assert _rank_words(sub).startswith(f"4 asked, {min(ranks)}-{max(ranks)} found per fold")
    assert _rank_words({"rank": 2, "fold_ranks": [2, 2]}) == "2"


def test_no_direction_names_the_site():
    y = np.tile([0, 1], 10)
    groups = np.repeat(np.arange(10), 2)
    with pytest.raises(NoDirection, match="the residual at depth 3"):
        fold_subspaces(torch.zeros(20, 4), y, groups, rank=1, what="the residual at depth 3")
