"""Mutation-testing gaps in probes/{collect,depth_curves}.py and stats/{linear,estimator}.py: each test checks
behaviour against a hand-written reference or an invariant taken from the documented definitions (docstrings,
docs/), and names in its docstring the mutant it was written to kill (a one-line change of the code that the rest of
the suite let pass)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from common.errors import UserError
from test_depth_curves import fake_doc


# ---------------------------------------------------------------------------------------------------- depth_curves

def _panel_titles(fig):
    return [a.text for a in fig.layout.annotations if a.text.endswith(" prefill")]


def test_panels_put_the_known_modes_first_in_their_order_then_the_others_by_name():
    """MODE_ORDER's modes first, in that order, any other mode after them by name.
    Mutant killed: `_mode_key` giving a known mode (1, index, m) (every mode sorted by name)."""
    from probes.depth_curves import depth_curve_figure

    fig = depth_curve_figure(fake_doc(modes=("fused-2", "recurrent-1", "standard", "abc"), ns=(0,)))
    assert _panel_titles(fig) == ["standard prefill", "recurrent-1 prefill", "abc prefill", "fused-2 prefill"]


def test_chance_reads_probe_chance_first_and_only_a_share_strictly_between_0_and_1():
    """chance_level: `meta.labels.probe_chance`, else `meta.labels.chance`, each only when 0 < value < 1; else 1/K of
    the built-in task's label words, else 0.5. Mutants killed: the two keys read in the other order, `< 1` -> `<= 1`."""
    from probes.depth_curves import chance_level

    doc = {"meta": {"labels": {"probe_chance": 0.25, "chance": 0.5}}}
    assert chance_level(doc, "completion") == 0.25
    assert chance_level({"meta": {"labels": {"chance": 1}}}, "shell_game") == pytest.approx(1 / 3)
    assert chance_level({"meta": {"labels": {"chance": 1.0}}}, "my_custom_task") == 0.5
    assert chance_level({"meta": {}}, "s5") == pytest.approx(1 / 5)


def test_the_chance_annotation_names_one_over_k():
    """The chance line's label reads `chance 1/K` off a chance of 1/K. Mutant killed: `round(1 / chance)` ->
    `round(chance)` (`chance 1/0`)."""
    from probes.depth_curves import depth_curve_figure

    doc = fake_doc(task="shell_game", ns=(0,))
    texts = [a.text for a in depth_curve_figure(doc).layout.annotations]
    assert "chance 1/3" in texts
    assert "chance" in [a.text for a in depth_curve_figure(fake_doc(ns=(0,))).layout.annotations]


def test_a_line_runs_through_its_depths_in_order_whatever_the_row_order():
    """_lines: every line's rows sorted by depth. Mutant killed: the rows kept in the document's order."""
    from probes.depth_curves import depth_curve_figure

    doc = fake_doc(modes=("standard",), ns=(0,), L=4)
    doc["results"] = doc["results"][::-1]
    line = [t for t in depth_curve_figure(doc).data if t.name == "N=0"][0]
    assert list(line.x) == [0, 1, 2, 3, 4]
    by_depth = {r["depth"]: r["accuracy"] for r in doc["results"]}
    assert list(line.y) == [by_depth[d] for d in range(5)]


def test_each_line_is_in_the_legend_once():
    """A line drawn in every panel shows in the legend from the first panel only. Mutant killed: the accuracy
    trace's `showlegend=col == 1` -> `showlegend=True`."""
    from probes.depth_curves import depth_curve_figure

    fig = depth_curve_figure(fake_doc(modes=("standard", "recurrent-1", "recurrent-2"), ns=(0, 8)))
    shown = [t.name for t in fig.data if t.showlegend]
    assert sorted(shown) == ["N=0", "N=8"]


def _with_lens(doc, ld, fed=None):
    for r in doc["results"]:
        r["logit_lens_ld"] = ld(r)
    if fed is not None:
        doc["fed_state_lens"] = [dict(mode=m, n_distractors=0, logit_lens_ld=v) for m, v in fed.items()]
    return doc


def test_the_fed_state_point_widens_the_depth_axis_to_minus_one():
    """With fed-state lens rows the x axes run from -1.3 and tick -1 (the fed state) then every depth 0..L; without,
    from -0.3. Mutants killed: `lo_x = -1.3 if fed else -0.3` -> `-0.3`; `range(0, max_depth + 1, ...)` ->
    `range(0, max_depth, ...)` (the deepest tick dropped)."""
    from probes.depth_curves import depth_curve_figure

    L = 3
    plain = depth_curve_figure(fake_doc(modes=("standard",), ns=(0,), L=L))
    assert list(plain.layout.xaxis.range) == pytest.approx([-0.3, L + 0.3])
    assert list(plain.layout.xaxis.tickvals) == [0, 1, 2, 3]
    doc = _with_lens(fake_doc(modes=("recurrent-1",), ns=(0,), L=L), lambda r: 1.0 + r["depth"],
                     fed={"recurrent-1": 0.5})
    fig = depth_curve_figure(doc)
    for ax in (fig.layout.xaxis, fig.layout.xaxis2):  # accuracy row, lens row
        assert list(ax.range) == pytest.approx([-1.3, L + 0.3])
        assert list(ax.tickvals) == [-1, 0, 1, 2, 3]


def test_the_lens_row_range_holds_the_zero_line_and_is_never_empty():
    """The lens row's y range covers every value and its reference line at 0, padded by 8% of the span, or by 0.5
    when the span is 0. Mutants killed: `+ [base]` dropped from the values; `or 0.5` dropped (an empty range)."""
    from probes.depth_curves import depth_curve_figure

    doc = _with_lens(fake_doc(modes=("standard",), ns=(0,), L=3), lambda r: 2.0 + r["depth"] / 3)
    lo, hi = depth_curve_figure(doc).layout.yaxis2.range  # values 2..3 and the base 0: span 3
    assert (lo, hi) == pytest.approx((0 - 0.24, 3 + 0.24))
    flat = _with_lens(fake_doc(modes=("standard",), ns=(0,), L=3), lambda r: 0.0)
    assert list(depth_curve_figure(flat).layout.yaxis2.range) == pytest.approx([-0.5, 0.5])


def test_loop_grid_is_accuracy_per_block_then_iteration_by_hand():
    """loop_grid: (iterations, blocks, accuracy[block][iteration]), a missing cell None. Mutant killed: the grid
    transposed (accuracy[iteration][block])."""
    from probes.depth_curves import loop_grid

    rows = [dict(loop=dict(part="core", block=b, iteration=i), accuracy=b + i / 10)
            for b in (0, 1) for i in (1, 2, 3) if (b, i) != (1, 3)]
    its, blocks, z = loop_grid(rows)
    assert its == [1, 2, 3] and blocks == [0, 1]
    assert z == [[0.1, 0.2, 0.3], [1.1, 1.2, None]]


# ---------------------------------------------------------------------------------------------------------- collect

def _batcher(batch_size, max_batch_tokens):
    from probes.collect import Collector

    c = Collector.__new__(Collector)  # _batches reads these two only: no model needed
    c.batch_size, c.max_batch_tokens = batch_size, max_batch_tokens
    return c


def test_batches_are_formed_by_length_up_to_batch_size_rows_and_max_batch_tokens_padded_tokens():
    """Collector._batches: samples sorted by (length, index), a batch closed before it would exceed `batch_size`
    rows or `max_batch_tokens` padded tokens (rows x its longest, the new row), a sample longer than
    `max_batch_tokens` alone in its own batch. References by hand. Mutants killed: `len(cur) >= batch_size` ->
    `>`; `(len(cur) + 1) * lengths[i]` -> `len(cur) * lengths[i]`; the `cur and` guard dropped (an empty batch)."""
    assert _batcher(2, 10_000)._batches([5, 3, 3, 8, 1]) == [[4, 1], [2, 0], [3]]
    assert _batcher(10, 8)._batches([4, 4, 4]) == [[0, 1], [2]]  # 2 x 4 = 8 fits, 3 x 4 = 12 does not
    assert _batcher(10, 8)._batches([10, 2]) == [[1], [0]]  # 10 tokens > 8: alone
    assert _batcher(10, 8)._batches([12, 10]) == [[1], [0]]  # even the shortest: no empty batch before it


def test_collected_rows_come_back_in_the_given_order_under_a_cyclic_length_order(tiny_model):
    """collect returns the rows in the samples' order. Lengths 3, 1, 2 put the batches in the order 1, 2, 0, a
    permutation that is not its own inverse (the suite's SEQS give an involution). Reference: each row collected
    alone. Mutant killed: `order = np.argsort(rows_mine)` -> `np.array(rows_mine)`."""
    from probes.collect import Collector

    seqs = [[7, 3, 41], [4], [11, 12]]
    col = Collector(tiny_model, batch_size=1, progress=False)
    got = col.collect(seqs, ["standard"])["standard"]
    alone = np.concatenate([col.collect([s], ["standard"])["standard"] for s in seqs])
    np.testing.assert_allclose(got, alone, atol=1e-6, rtol=0)
    assert np.abs(got[0] - got[1]).max() > 1e-3  # rows differ, so a misplaced row is seen


def test_a_model_call_count_the_schedule_does_not_expect_is_refused(tiny_model, monkeypatch):
    """Module doc: after every trace a call counter checks that the engine made exactly the calls the schedule
    expects, so a change in the engine fails loudly. A schedule expecting one call more must raise, though the
    trace read every step it asked for. Mutant killed: `counter.n != n_calls or len(got) != len(steps)` with
    `and`."""
    import probes.collect as pc
    from engine.prefill import call_schedule, pad_left

    def one_more(modes, T, L):
        where, n = call_schedule(modes, T, L)
        return where, n + 1

    monkeypatch.setattr(pc, "call_schedule", one_more)
    ids, mask = pad_left([[5, 6, 7, 8]])
    with pytest.raises(RuntimeError, match="model calls on 4 columns"):
        pc.Collector(tiny_model, progress=False).collect_batch(ids, mask, ["recurrent-1"])

def test_a_cached_entry_of_another_depth_or_width_is_a_miss(tmp_path):
    """ActivationCache.get(key, shape): an entry whose shape differs from `shape` in any axis is a miss (each axis
    alone here). Mutant killed: only the depth and width compared (`arr.shape[1:]`)."""
    from probes.collect import ActivationCache

    cache = ActivationCache(tmp_path)
    cache.put("k", np.ones((2, 3, 4), dtype=np.float32))
    assert cache.get("k", (2, 3, 4)).shape == (2, 3, 4)
    for shape in ((3, 3, 4), (2, 4, 4), (2, 3, 5)):
        assert cache.get("k", shape) is None, shape


def _samples(n=3):
    from tasks import make_dataset

    return make_dataset("completion", 2, n, seed=0)[:n]


def test_export_writes_minus_one_for_an_unknown_token_count(tmp_path):
    """save_activations: `n_tokens` is -1 where a sample's n_tokens is None (module doc). Mutant killed: 0 written."""
    from probes.collect import save_activations

    samples = [dataclasses.replace(s, n_tokens=None if i == 1 else 7) for i, s in enumerate(_samples())]
    npz, _ = save_activations(tmp_path, "x", np.zeros((3, 2, 4), dtype=np.float32), samples, {})
    with np.load(npz) as z:
        assert z["n_tokens"].tolist() == [7, -1, 7]


def test_export_refuses_fewer_activation_rows_than_samples(tmp_path):
    """save_activations: one activation row per sample, refused either way. Mutant killed: `!=` -> `>` (fewer rows
    than samples written silently, misaligned)."""
    from probes.collect import save_activations

    samples = _samples()
    for rows in (2, 4):
        with pytest.raises(UserError, match=f"{rows} activation rows for 3 samples"):
            save_activations(tmp_path, "x", np.zeros((rows, 2, 4), dtype=np.float32), samples, {})
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------------- stats/linear.py

def test_inner_cv_folds_shrink_to_the_groups_and_the_largest_class_with_groups_else_the_smallest_class():
    """_inner_splits: with groups, min(inner_splits, #groups, largest class count) StratifiedGroupKFold folds (that
    splitter refuses more than the largest class has); without, min(inner_splits, smallest class count)
    StratifiedKFold folds. Mutants killed: `.max()` -> `.min()` in the grouped rule, `.min()` -> `.max()` in the
    ungrouped one."""
    import warnings

    from stats.linear import ProbeConfig, _inner_splits

    y = np.array([0] * 2 + [1] * 10)
    config = ProbeConfig(inner_splits=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # scikit-learn: a class smaller than the fold count
        grouped = _inner_splits(y, np.arange(12), config)
        assert len(grouped) == 3
        assert len(_inner_splits(y, np.arange(12) // 6, config)) == 2  # two groups: two folds
        assert len(_inner_splits(y, None, config)) == 2  # the smallest class has 2 samples


def test_c_ties_go_to_the_smallest_c_whatever_the_order_of_cs():
    """LinearProbe: C ties go to the smallest (strongest regularization). Here every C classifies every inner fold
    perfectly (two far-apart classes), so all tie. Mutant killed: the last best (the largest tied C) taken."""
    from stats.linear import LinearProbe, ProbeConfig

    rng = np.random.default_rng(0)
    y = np.tile([0, 1], 12)
    X = 8.0 * (y[:, None] - 0.5) + 0.1 * rng.normal(size=(24, 3))
    probe = LinearProbe(ProbeConfig(Cs=(10.0, 0.01, 1.0, 0.1))).fit(X, y, groups=np.arange(24) // 2)
    assert probe.chosen_C_ == 0.01


def test_direction_is_the_raw_input_gradient_of_the_logit():
    """LinearProbe.direction: the unit vector of the effective weight on the raw (unstandardized) input, i.e. of
    d logit / d x, which finite differences of the fitted pipeline's decision function give exactly (it is affine).
    Features of very different scales make the standardization matter. Mutant killed: `coef / scale` ->
    `coef * scale`."""
    from stats.linear import LinearProbe, ProbeConfig

    rng = np.random.default_rng(1)
    y = np.tile([0, 1], 20)
    X = rng.normal(size=(40, 3)) * [100.0, 1.0, 0.01] + np.outer(y, [50.0, 0.5, 0.005])
    probe = LinearProbe(ProbeConfig(Cs=(1.0,))).fit(X, y)
    x0 = X[:1]
    grad = np.array([probe.pipeline_.decision_function(x0 + np.eye(3)[j])[0] - probe.pipeline_.decision_function(x0)[0]
                     for j in range(3)])
    np.testing.assert_allclose(probe.direction, grad / np.linalg.norm(grad), rtol=1e-6, atol=1e-9)


def test_an_odd_number_of_balanced_groups_flips_half_rounded_at_random():
    """permute_labels_by_group: exactly half of the internally balanced groups are flipped, an odd count rounded
    at random (so either way over seeds). Three pairs [0, 1]: 1 or 2 flipped, and both happen. Mutant killed: the
    half always rounded down."""
    from stats.linear import permute_labels_by_group

    y, groups = np.tile([0, 1], 3), np.repeat([0, 1, 2], 2)
    flipped = set()
    for seed in range(40):
        out = permute_labels_by_group(y, groups, seed)
        flipped.add(sum(bool((out[groups == g] != y[groups == g]).any()) for g in range(3)))
    assert flipped == {1, 2}


def test_a_single_class_control_training_fold_predicts_the_class_it_saw():
    """_outer_predictions: a (control) training fold of one class predicts that class for its test fold, as a probe
    trained on labels that say nothing would. Mutant killed: the test fold's own first label predicted."""
    from stats.linear import ProbeConfig, _outer_predictions, _Plan

    y = np.array([0, 0, 0, 0, 1, 1])
    groups = np.arange(6)
    config = ProbeConfig()
    tr, te = np.arange(4), np.array([4, 5])
    plan = _Plan(y, groups, config, outer=[(tr, te)], single_class_ok=True)
    pred, folds = _outer_predictions(np.ones((6, 2)), y, groups, config, plan)
    assert pred[te].tolist() == [0, 0] and folds == [0.0]


def test_grouped_cv_needs_every_class_in_n_splits_groups():
    """check_groups: every class in at least n_splits groups, else a UserError naming the label. Here label 1 sits
    in 2 of 6 groups for 3 folds. Mutant killed: `n_c < n_splits` -> `n_c < n_splits - 1`."""
    from stats.linear import check_groups

    y = np.array([0, 0, 0, 0, 1, 1])
    with pytest.raises(UserError, match="label 1 occurs in 2 group"):
        check_groups(y, np.arange(6), 3)
    assert check_groups(y, np.arange(6), 2) == 6

@pytest.mark.parametrize("Cs", [(0.01, 10.0, 0.1, 1.0), (10.0, 0.01, 1.0), (1.0, 0.1, 0.01, 10.0)])
def test_without_an_inner_cv_the_c_is_the_middle_of_the_sorted_cs_as_the_mdl_probe_takes_it(Cs):
    """LinearProbe: when the inner CV cannot run (here one group) C falls back to the middle of Cs, a strength
    between the candidates whatever order they were listed in: the middle of the sorted Cs, as probes.mdl._best_c
    takes it for the same config. The listed order's middle was taken (BUG, fixed: 0.1 for the first Cs, 0.01
    for the third, while the MDL probe took 1.0). Mutants killed: `Cs[len(Cs) // 2]` -> `Cs[(len(Cs) - 1) // 2]`
    and the same on the unsorted Cs."""
    from probes.mdl import _best_c
    from stats.linear import LinearProbe, ProbeConfig

    rng = np.random.default_rng(2)
    y = np.tile([0, 1], 8)
    X = rng.normal(size=(16, 3)) + y[:, None]
    groups = np.zeros(16, dtype=int)
    config = ProbeConfig(Cs=Cs)
    probe = LinearProbe(config).fit(X, y, groups)
    assert probe.chosen_C_ == 1.0 == _best_c(X, y, groups, config, splits=None)

# ---------------------------------------------------------------------------------------------- stats/estimator.py

def test_a_zero_decision_predicts_the_first_class():
    """RowSpaceLogisticRegression: a positive decision value means classes_[1] (decision_function doc), so a value
    of exactly 0 means classes_[0], scikit-learn's rule. Constant inputs with balanced labels: w = 0 and b = 0
    exactly (the Newton start is the optimum). Mutant killed: `dec > 0` -> `dec >= 0`."""
    from stats.estimator import RowSpaceLogisticRegression

    m = RowSpaceLogisticRegression().fit(np.zeros((4, 2)), ["a", "a", "b", "b"])
    assert m.decision_function(np.zeros((3, 2))).tolist() == [0.0, 0.0, 0.0]
    assert m.predict(np.zeros((3, 2))).tolist() == ["a", "a", "a"]


# -------------------------------------------------------------------------------------------------- probes/options

def test_distractors_come_back_sorted_and_memory_refuses_n_0():
    """_parse_distractors: --distractors -> sorted N values; memory with N=0 refused (a single CV group). Mutant
    killed: the values returned in the order given."""
    from probes.options import _parse_distractors

    assert _parse_distractors("32,8,16", "completion") == [8, 16, 32]
    with pytest.raises(UserError, match="memory with N=0"):
        _parse_distractors("8,0", "memory")


def test_newton_binary_stops_at_the_objectives_stationary_point():
    """stats.estimator._newton_binary: at its result the gradient of 0.5 ||w||^2 + C sum log(1 + exp(-t (w.x + b)))
    (written here with scipy's expit; the intercept unpenalized) is ~0, reached in a few Newton steps: a
    wrong sigmoid inside the solver (e.g. sigmoid(2 t z)) leaves the true gradient large and runs to max_iter."""
    from scipy.special import expit

    from stats.estimator import _newton_binary

    rng = np.random.default_rng(3)
    X = rng.normal(size=(60, 3))
    t = np.where(X @ np.array([1.0, -0.5, 0.25]) + 0.3 * rng.normal(size=60) > 0, 1.0, -1.0)
    C = 0.7
    beta, it = _newton_binary(X, t, C, 50, 1e-12)
    Xb = np.hstack([X, np.ones((60, 1))])
    grad = -C * Xb.T @ (t * expit(-t * (Xb @ beta))) + np.r_[beta[:3], 0.0]
    assert np.abs(grad).max() < 1e-6
    assert it < 50
