"""Tests written against mutants of the code that computes numbers users read, each of which the rest of the
suite let through (a hand mutation-testing review): every test here fails on its mutant (named in its docstring)
and checks behaviour against a hand-written reference or an invariant, never against the code's own output."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from interventions.core import CausalContext
from tests.test_interventions_modes import _batch, _naive_recurrence


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ----- the recurrence ------------------------------------------------------------------------------------------
def test_recurrent_start_is_column_one_once_k_reaches_t_minus_1():
    """recurrent-k with k >= T-1 recomputes every column after the first, as recurrent-full does (mutant: the
    first recomputed column clamped with T-2, so k >= T-1 started at column 2)."""
    from engine.prefill import recurrent_start

    T = 7
    assert [recurrent_start(T, k) for k in (1, 3, 5, 6, 7, 100)] == [6, 4, 2, 1, 1, 1]
    assert recurrent_start(T, None) == 1
    assert recurrent_start(1, None) == recurrent_start(1, 4) == 1


def test_a_patch_under_recurrent_k_with_k_at_least_t_minus_1_matches_the_naive_recurrence(tiny_model):
    """The patcher of recurrent-k, k >= T-1, fuses every column from 1 on, as its clean run does: a residual patch
    at column 0 then propagates through a fused column 1 (mutant: recurrent_start clamped with T-2, so the
    patcher reran column 1 unfused and gave the wrong logits)."""
    batch = _batch(tiny_model, pad=False)
    T = batch.input_ids.shape[1]
    mode = f"recurrent-{T - 1}"
    ctx = CausalContext(tiny_model, batch, modes=("standard", mode))
    assert ctx.fused_positions(mode) == list(range(1 - T, 0))
    ids, mask = batch.input_ids, batch.attention_mask
    for depth in (0, tiny_model.n_layers):
        value = ctx.resid(mode)[:, 0, depth][batch.pair]
        got = ctx.patch_resid(mode, depth, -T, batch.pair)
        ref = _naive_recurrence(tiny_model, ids, mask, resid_patch=(depth, 0, value))
        assert torch.allclose(got, ref, atol=1e-5), depth


# ----- looped models: the adaptive exit --------------------------------------------------------------------------
def test_exit_iterations_divides_by_the_new_state():
    """|s_i - s_(i-1)| / |s_i| (mutant: divided by |s_(i-1)|). Hand values: s = 1, 2, 4 on one axis: each change is
    1/2 of the new state (but 1 of the old), so a tolerance of 0.6 exits at i = 1."""
    from engine.loops import exit_iterations

    states = torch.tensor([[[1.0, 0.0], [2.0, 0.0], [4.0, 0.0]],
                           [[0.0, 3.0], [0.0, 4.0], [0.0, 4.0]]])  # change 1/4 (of 4) or 1/3 (of 3), then 0
    assert exit_iterations(states, 0.6).tolist() == [1, 1]
    assert exit_iterations(states, 0.3).tolist() == [2, 1]
    assert exit_iterations(states, 0.2).tolist() == [2, 2]


def test_adaptive_exit_reads_the_loop_states_the_hand_written_loop_computes():
    """loop-R:TOL exits each prompt at the first i whose loop state s_i at T moved by less than TOL of its norm,
    with s_i taken from the hand-written loop (mutant: the states read one depth too shallow)."""
    from engine.prefill import prefill_many
    from tests.test_looped import hand_loop, ids_of, make

    model = make()
    ids, mask = ids_of(B=6, T=9, seed=3)
    R = 6
    with torch.no_grad():
        _, states = hand_loop(model, ids, R)
    s = torch.stack([x[:, -1] for x in states], 1).double()  # [B, R+1, D]
    change = ((s[:, 1:] - s[:, :-1]).norm(dim=-1) / s[:, 1:].norm(dim=-1)).numpy()  # [B, R]
    exits = set()
    for q in (0.2, 0.4, 0.5, 0.6, 0.8):  # tolerances between the changes: rows exit at different iterations
        tol = float(np.quantile(change, q))
        hand = [next((i + 1 for i in range(R) if change[b, i] < tol), R) for b in range(len(change))]
        exits |= set(hand)
        got = prefill_many(model, ids, mask, [f"loop-{R}:{tol!r}"])[f"loop-{R}:{tol!r}"].iterations
        assert got.tolist() == hand, q
    assert len(exits) > 2


# ----- recirculation's mix ----------------------------------------------------------------------------------------
def test_mix_applies_the_transform_as_zs_times_its_transpose():
    """RecircSpec.transform T is applied as z_s @ T.T (a row vector times T^T, i.e. T z_s), before the norm match
    (mutant: z_s @ T). T a cyclic shift, (T z)_i = z_(i+1): by hand, z_d = (0, 0, 5), z_s = (1, 2, 2) (norm 3),
    T z_s = (2, 2, 1), residual alpha 0.6: 0.6 * 5/3 * (2, 2, 1) + z_d = (2, 2, 6)."""
    from engine.mixing import RecircSpec, mix

    P = torch.tensor([[0.0, 1, 0], [0, 0, 1], [1, 0, 0]])  # P @ z = (z_1, z_2, z_0)
    zd, zs = torch.tensor([[0.0, 0.0, 5.0]]), torch.tensor([[1.0, 2.0, 2.0]])
    got = mix(zd, zs, RecircSpec(2, 0, 0.6, "residual", transform=P))
    assert torch.allclose(got, torch.tensor([[2.0, 2.0, 6.0]]), atol=1e-6)


@pytest.mark.parametrize("spec", ["3:1:0.5:residual:ramp6", "3:0:0.4:convex:ramp4"])
def test_recirculated_generation_logits_equal_the_exact_prefill_with_a_ramp(spec):
    """Each generated token's logits are the exact sequential prefill's at that column, ramped alpha included
    (r_(t-1) is mixed with alpha at t-1's position; mutant: with n_t's, one position later). The logits of every
    step are compared, not only their argmax (a small model's argmax rarely moves)."""
    from engine.mixing import parse_recirculate
    from engine.recirculation import RecirculatedLM
    from models.configs import qwen3_config
    from models.full_bandwidth import FullBandwidthLM

    cfg = qwen3_config(50, n_layers=3, d_model=32, initializer_range=0.1)
    base = FullBandwidthLM.from_config(cfg, fusion=False, seed=0).eval().float()
    r = RecirculatedLM(base, parse_recirculate(spec, 3))
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, 50, (2, 3), generator=g)
    mask = torch.ones_like(ids)
    seen = []
    head = r._head
    r._head = lambda top: seen.append(head(top)) or seen[-1]  # every logits the generation computes, in order
    new = r.generate(ids, mask, 5)
    r._head = head
    full = torch.cat([ids, new[:, :-1]], 1)
    ref = r.prefill(full, torch.ones_like(full)).logits  # [B, 3 + 4, V]
    steps = torch.stack([s.reshape(2, -1) for s in seen[-4:]], 1)  # the 4 one-token steps after the prefill
    assert torch.allclose(steps, ref[:, 3:], atol=1e-5)
    assert torch.equal(ref[:, 2:].argmax(-1), new)


def test_mix_subspace_keeps_the_projection_of_the_change_by_hand():
    """With a subspace U only the projection of the change z' - z_d onto span(U) is applied (its complement: the
    rest of the change), not the projection of z' itself (mutant). By hand, D = 2, U = e_0: z_d = (3, 4),
    z_s = (0, 10), convex alpha 0.2: z' = 0.2 * 5/10 * (0, 10) + 0.8 * (3, 4) = (2.4, 4.2), change (-0.6, 0.2);
    subspace: (3 - 0.6, 4) = (2.4, 4); complement: (3, 4 + 0.2) = (3, 4.2)."""
    from engine.mixing import RecircSpec, mix

    zd, zs, U = torch.tensor([[3.0, 4.0]]), torch.tensor([[0.0, 10.0]]), torch.tensor([[1.0], [0.0]])
    assert torch.allclose(mix(zd, zs, RecircSpec(2, 0, 0.2)), torch.tensor([[2.4, 4.2]]))
    assert torch.allclose(mix(zd, zs, RecircSpec(2, 0, 0.2, subspace=U)), torch.tensor([[2.4, 4.0]]))
    assert torch.allclose(mix(zd, zs, RecircSpec(2, 0, 0.2, subspace=U, subspace_complement=True)),
                          torch.tensor([[3.0, 4.2]]))


# ----- intervention metrics -------------------------------------------------------------------------------------
def test_binary_changed_rate_counts_both_sides_of_a_tie_by_hand():
    """Binary "changed": 1 - P(the patched and the clean decision agree), an exact tie (LD = 0) a coin flip
    (mutant: only the patched-right / clean-wrong term). By hand, LD patched / clean per row:
    (0, 1): the tie picks the clean label half the time, 0.5; (1, 1): 0; (-1, 1): 1; (2, 0): 0.5; (0, 0): the same
    tie, 0 (the module doc: the same tied set is no change). Sum 2.0 over 5 rows."""
    from interventions.metrics import summarize

    ld_p = np.array([0.0, 1.0, -1.0, 2.0, 0.0])
    ld_c = np.array([1.0, 1.0, 1.0, 0.0, 0.0])
    y = np.array([0, 1, 0, 1, 0])
    m = summarize(ld_p, ld_c, -ld_c, y, 1 - y, np.arange(5), n_boot=50, seed=0)
    assert m["changed"] == pytest.approx(2.0)
    assert m["changed_rate"] == pytest.approx(0.4)


def test_k_class_changed_by_hand():
    """K > 2: 1 - P(two uniform picks from the tied argmax sets agree) (`changed`), 0 for the same tied set
    (mutant: the same tie of two counted as a half change). Clean argmax sets {0, 1}; patched {0, 1} -> 0,
    {0} -> 1 - 1/2, {1, 2} -> 1 - 1/4, {2} -> 1."""
    from interventions.metrics import changed

    clean = torch.tensor([[2.0, 2.0, 0.0]]).repeat(4, 1)
    patched = torch.tensor([[3.0, 3.0, 1.0], [3.0, 1.0, 1.0], [0.0, 3.0, 3.0], [0.0, 0.0, 1.0]])
    assert changed(patched, clean, (0, 1, 2)).tolist() == pytest.approx([0.0, 0.5, 0.75, 1.0])


def test_k_class_decisions_weigh_a_tie_by_its_size_by_hand():
    """K > 2 correct / follows: 1/m where the label is among the m tied argmax label words (mutant: the own label's
    score not divided by m, a tie counted as right)."""
    from interventions.metrics import decisions

    logits = torch.tensor([[2.0, 2.0, 0.0], [1.0, 3.0, 3.0], [5.0, 1.0, 1.0], [4.0, 4.0, 4.0]])
    own, ref = decisions(logits, [0, 0, 0, 2], [1, 2, 1, 1], (0, 1, 2))
    assert own.tolist() == pytest.approx([0.5, 0.0, 1.0, 1 / 3])
    assert ref.tolist() == pytest.approx([0.5, 0.5, 0.0, 1 / 3])


# ----- the cluster bootstrap ---------------------------------------------------------------------------------------
def test_group_bootstrap_ci_is_the_mean_of_the_resampled_rows_with_unequal_groups():
    """The CI of a mean over groups of unequal sizes: each replicate is the mean of the rows of the drawn groups,
    rebuilt here draw by draw from the same seeded draws (mutant: the resampled sums divided by the original row
    count, which only equal-sized groups hide)."""
    from stats.bootstrap import ClusterBootstrap, group_bootstrap_ci

    groups = np.array([0, 1, 1, 1, 1, 1, 2, 3, 3, 4])
    v = np.array([9.0, 0.0, 1.0, 0.0, 1.0, 0.0, 5.0, 2.0, 3.0, -4.0])
    boot = ClusterBootstrap(groups, 400, 3)
    reps = []
    for draw in boot.draws:
        rows = np.concatenate([np.flatnonzero(groups == boot.groups_[j]) for j in draw])
        reps.append(v[rows].mean())
    lo, hi = np.percentile(reps, [2.5, 97.5])
    assert group_bootstrap_ci(v, groups, 400, 3) == pytest.approx([lo, hi])


# ----- the intervention battery --------------------------------------------------------------------------------------
def test_dose_runs_from_the_clean_state_to_the_donors(tiny_model):
    """The dose feeds (1 - a) h + a h_donor: a = 0 is the clean run (LD of the clean run, effect 0), a = 1 the state
    swap (mutant: the two ends exchanged)."""
    from interventions.suite import Suite

    batch = _batch(tiny_model)
    ctx = CausalContext(tiny_model, batch, modes=("standard", "recurrent-1"))
    s = Suite(ctx, n_boot=20)
    rows = s.dose(grid=(0.0, 1.0))["rows"]
    clean = s.metrics(ctx.clean["recurrent-1"].logits)
    swap = s.metrics(ctx.swap_state(batch.pair, "recurrent-1"))
    assert rows[0]["ld_mean"] == pytest.approx(clean["ld_mean"]) and rows[0]["normalized_effect"] == pytest.approx(0.0)
    assert rows[1]["ld_mean"] == pytest.approx(swap["ld_mean"], abs=1e-5)
    assert abs(swap["ld_mean"] - clean["ld_mean"]) > 1e-3  # the two ends differ


def _state_interventions_feeding(tiny_model, monkeypatch):
    """(context, the state interventions' rows, every state they fed through `patch_state`, in order)."""
    from interventions.suite import Suite

    ctx = CausalContext(tiny_model, _batch(tiny_model), modes=("standard", "recurrent-1"))
    fed = []
    real = ctx.patch_state
    monkeypatch.setattr(ctx, "patch_state", lambda states, *a, **k: fed.append(states.clone()) or real(states, *a, **k))
    return ctx, Suite(ctx, n_boot=20).state_interventions(), fed


def test_the_random_state_has_the_norm_of_the_state_it_replaces(tiny_model, monkeypatch):
    """The random-state ablation feeds a random direction at each row's own norm ||h_{T-1}|| (mutant: a raw
    Gaussian, whose norm is ~sqrt(D) whatever the state's)."""
    ctx, rows, fed = _state_interventions_feeding(tiny_model, monkeypatch)
    # state_swap, resample, mean, zero, random_state feed states (the bypasses feed none), in this order
    assert [r["name"] for r in rows][-2:] == ["random_state", "gate_bypass_all"] and len(fed) == 5
    h = ctx.h_prev
    assert torch.allclose(fed[-1].norm(dim=-1), h.norm(dim=-1), rtol=1e-5)
    assert not torch.allclose(fed[-1], h)


def test_mean_resid_ablation_at_depth_0_of_a_shared_final_token_changes_nothing(tiny_model):
    """The residual at (depth, T) replaced by its batch mean *at T*: where every row ends with the same token, the
    depth-0 residual at T under standard prefill is one embedding, its own mean, so the ablation is the clean run
    (mutant: the mean taken at column T-1)."""
    from interventions.suite import Suite

    batch = _batch(tiny_model, pad=False)
    batch.input_ids[:, -1] = 7  # one final token, as every task's ":"
    ctx = CausalContext(tiny_model, batch, modes=("standard",))
    rows = Suite(ctx, n_boot=20).resid_mean_ablation()["rows"]
    clean = Suite(ctx, n_boot=20).metrics(ctx.clean["standard"].logits)
    assert rows[0]["depth"] == 0 and rows[0]["changed_rate"] == 0.0
    assert rows[0]["ld_mean"] == pytest.approx(clean["ld_mean"], abs=1e-6)
    assert rows[1]["ld_mean"] != pytest.approx(clean["ld_mean"], abs=1e-4)  # depth 1 mixes the other columns in


# ----- MDL, erasure diagnostics ----------------------------------------------------------------------------------
@pytest.mark.parametrize("K", [2, 3])
def test_mdl_codes_each_row_with_a_probe_that_never_saw_it(K):
    """The probe that codes a block is fitted on the rows before it only: with a last block of ONE row, coding that
    row under each of the K labels uses the same probe, so the K code lengths are -log2 of one probability
    distribution and 2^-bits sums to 1 (mutant: the probe trained on the block it codes, so each relabelled row
    taught the probe its own label and every label looked likely: the sum exceeds 1)."""
    from probes.mdl import BlockPlan, online_code
    from stats.linear import ProbeConfig

    rng = np.random.default_rng(0)
    n = 13 * K
    y = np.arange(n) % K
    X = rng.normal(size=(n, 3)) + 0.7 * np.eye(K, 3)[y]  # a weak signal: the probe is unsure of the last row
    groups = np.arange(n)
    plan = BlockPlan(np.arange(n), (6 * K, n - 1, n), 3)
    probs = []
    for label in range(K):
        yy = y.copy()
        yy[-1] = label
        bits = online_code(X, yy, groups, ProbeConfig(), plan).block_bits
        assert len(bits) == 3 and bits[0] == pytest.approx(6 * K * np.log2(K))
        probs.append(2.0 ** -bits[-1])
    assert sum(probs) == pytest.approx(1.0, abs=1e-9)
    assert all(0.02 < p < 0.98 for p in probs)  # an unsure probe: a leak would move these


def test_clean_on_erased_scores_the_clean_probe_on_the_erased_held_out_rows():
    """clean_on_erased: a probe fitted on the CLEAN training rows, scored on the ERASED held-out rows. An 'eraser'
    that sign-flips only the training rows of its fold leaves every held-out row as it was, so clean_on_erased is
    exactly `before` (mutant: train and test swapped, the probe fitted on the flipped rows reads every clean held-out
    row backwards: accuracy near 0)."""
    from stats.erasure import FoldErasers, grouped_folds, probe_check
    from stats.linear import ProbeConfig

    class FlipTraining(FoldErasers):
        def __init__(self, folds):
            self.folds, self.n_classes, self.erasers = folds, 2, [None] * len(folds)

        def by_fold(self, X, f, alpha=1.0):
            out = X.detach().clone()
            tr = torch.as_tensor(self.folds[f][0])
            out[tr] = -out[tr]
            return out

    rng = np.random.default_rng(1)
    y = np.tile([0, 1], 20)
    groups = np.repeat(np.arange(20), 2)
    X = torch.as_tensor(rng.normal(size=(40, 4)) + 2.0 * np.outer(2 * y - 1, [1, 0, 0, 0]))
    cfg = ProbeConfig(n_boot=20)
    out = probe_check(X, y, groups, FlipTraining(grouped_folds(y, groups, cfg)), cfg)
    assert out["before"]["accuracy"] > 0.9
    assert out["clean_on_erased"]["accuracy"] == out["before"]["accuracy"]
    assert out["clean_on_erased"]["fold_accuracies"] == out["before"]["fold_accuracies"]
    assert out["after"]["accuracy"] < 0.1  # fitted on flipped rows, scored on (unflipped) held-out rows


# ----- stability ---------------------------------------------------------------------------------------------------
def test_stability_of_a_padded_batch_pools_the_real_positions_of_each_row_run_alone(tiny_model):
    """analysis.stability's state change and validation loss are means over REAL positions (targets whose input and
    target are both real): on a left-padded batch they are the position-weighted pool of each row run alone,
    unpadded (mutants: the state change averaged over padding too; the loss charged for predicting the first real
    token from a pad)."""
    from analysis.stability import stability_curve

    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(2, 50, (n,), generator=g) for n in (5, 8, 8)]
    ids = torch.zeros(3, 8, dtype=torch.long)
    mask = torch.zeros(3, 8, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, 8 - len(r):], mask[i, 8 - len(r):] = r, 1
    keep = {0, 1, 2}
    batched = stability_curve(tiny_model, ids, mask, "t", 0, 2, keep)
    alone = [stability_curve(tiny_model, r[None], torch.ones(1, len(r), dtype=torch.long), "t", 0, 2, keep)
             for r in rows]
    n = np.array([len(r) for r in rows], float)
    for k in (1, 2):
        change = sum(a[k]["state_change"] * m for a, m in zip(alone, n)) / n.sum()
        loss = sum(a[k]["val_loss"] * (m - 1) for a, m in zip(alone, n)) / (n - 1).sum()
        assert batched[k]["state_change"] == pytest.approx(change, rel=1e-4)
        assert batched[k]["val_loss"] == pytest.approx(loss, rel=1e-4)
    assert batched[1]["state_change"] > 1e-3  # the passes move the state


# ----- the probe's confidence interval ---------------------------------------------------------------------------
def test_probe_ci_of_a_perfect_probe_is_exactly_one_with_unequal_groups():
    """Each bootstrap replicate of the probe's accuracy is the accuracy over the resampled rows (their correct count
    over their own row count): a probe right on every row reads 1.0 on every resample, so its CI is exactly
    [1, 1] even when the groups differ in size (mutant: every replicate divided by the original row count, so a
    resample of large groups read above 1 and one of small groups below)."""
    from stats.linear import ProbeConfig, grouped_cv_score

    sizes = [1, 2, 3, 6] * 6  # 24 single-label groups of unequal size, 12 per class
    groups = np.repeat(np.arange(len(sizes)), sizes)
    y = np.repeat(np.arange(len(sizes)) % 2, sizes)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(len(y), 3)) + 6.0 * np.outer(2 * y - 1, [1, 0, 0])
    s = grouped_cv_score(X, y, groups, ProbeConfig(n_boot=200))
    assert s.accuracy == 1.0 and s.fold_accuracies == [1.0] * len(s.fold_accuracies)
    assert (s.ci_low, s.ci_high) == (1.0, 1.0)


def _unequal_groups_data(seed=0, signal=0.5):
    sizes = [1, 2, 3, 5] * 8  # 32 single-label groups of unequal size, 16 per class
    groups = np.repeat(np.arange(len(sizes)), sizes)
    y = np.repeat(np.arange(len(sizes)) % 2, sizes)
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(len(y), 4))
    X[:, 0] += signal * (2 * y - 1)
    X += np.repeat(rng.normal(size=(len(sizes), 4)), sizes, axis=0)  # a shared offset per group
    return X, y, groups


def test_grouped_cv_score_is_the_pooled_held_out_accuracy_over_grouped_folds_by_hand():
    """grouped_cv_score written out from its module doc: outer StratifiedGroupKFold(n_splits, shuffle=True,
    random_state) over the groups, a LinearProbe fitted on each training fold, accuracy = all held-out predictions
    pooled, accuracy_std = population std (ddof 0) of the fold accuracies. Unequal groups make unequal folds, so
    pooled != mean of folds (mutants: accuracy = mean of fold accuracies; outer folds ignoring the groups;
    fold std with ddof=1)."""
    from sklearn.model_selection import StratifiedGroupKFold

    from stats.linear import LinearProbe, ProbeConfig, grouped_cv_score

    cfg = ProbeConfig(n_boot=20)
    X, y, groups = _unequal_groups_data()
    cv = StratifiedGroupKFold(n_splits=cfg.n_splits, shuffle=True, random_state=cfg.random_state)
    correct, folds, sizes = np.zeros(len(y), bool), [], []
    for tr, te in cv.split(np.zeros(len(y)), y, groups):
        assert not set(groups[tr]) & set(groups[te])
        correct[te] = LinearProbe(cfg).fit(X[tr], y[tr], groups[tr]).predict(X[te]) == y[te]
        folds.append(float(correct[te].mean()))
        sizes.append(len(te))
    assert len(set(sizes)) > 1
    assert correct.mean() != pytest.approx(np.mean(folds), abs=1e-6)  # the data tell the two apart
    s = grouped_cv_score(X, y, groups, cfg)
    assert s.fold_accuracies == pytest.approx(folds, abs=1e-12)
    assert s.accuracy == pytest.approx(correct.mean(), abs=1e-12)
    assert s.accuracy_std == pytest.approx(np.sqrt(np.mean((np.array(folds) - np.mean(folds)) ** 2)), abs=1e-12)


def test_the_inner_cv_choosing_c_never_splits_a_group():
    """The inner CV that chooses a probe's C holds out whole groups (a pair's members on both sides of an inner
    split would reward memorizing): no group has rows on both sides of any inner split, and a group's rows all
    land in one inner test fold (mutant: the inner StratifiedGroupKFold given one group per row)."""
    from stats.linear import ProbeConfig, _inner_splits

    X, y, groups = _unequal_groups_data()
    splits = _inner_splits(y, groups, ProbeConfig())
    assert splits and len(splits) >= 2
    for tr, te in splits:
        assert not set(groups[tr]) & set(groups[te])
        assert sorted(np.concatenate([tr, te]).tolist()) == list(range(len(y)))


# ----- patching ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["recurrent-1", "recurrent-full", "fused-2", "recirc-2:0:0.4"])
def test_a_state_patch_on_some_rows_patches_those_rows_and_leaves_the_others_clean(tiny_model, mode):
    """Patch(rows=mask) on the fed state: the masked rows read exactly what the all-rows patch gives them, the others
    their clean logits (rows of a batch do not interact). Mutant: the mask inverted in the recurrent patcher's
    state edit (the unmasked rows patched)."""
    from engine.modes import parse_mode
    from engine.patching import Patch, patcher

    batch = _batch(tiny_model, pad=False)
    B = batch.input_ids.shape[0]
    g = torch.Generator().manual_seed(5)
    value = torch.randn(B, tiny_model.config.hidden_size, generator=g) * 3
    rows = torch.tensor([True, False] * (B // 2))
    with torch.no_grad():
        r = patcher(parse_mode(mode, tiny_model.config.num_hidden_layers), tiny_model, batch.input_ids,
                    batch.attention_mask)
        clean = r.run([Patch("state", value.clone(), pos=-1, rows=torch.zeros(B, dtype=torch.bool))])
        full = r.run([Patch("state", value.clone(), pos=-1)])
        part = r.run([Patch("state", value.clone(), pos=-1, rows=rows)])
    assert (full - clean).abs().amax(-1).min() > 1e-3  # the patch moves every row
    torch.testing.assert_close(part[rows], full[rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(part[~rows], clean[~rows], rtol=1e-5, atol=1e-5)


def test_the_mean_state_ablation_feeds_every_row_the_batch_mean_state(tiny_model, monkeypatch):
    """The 'mean' state ablation feeds every row the mean over the batch's rows of the fed state h_{T-1}, one
    D-vector (mutant: the mean over each row's own D coordinates, a constant vector per row)."""
    ctx, rows, fed = _state_interventions_feeding(tiny_model, monkeypatch)
    names = [r["name"] for r in rows]
    assert names.index("mean") == 3 and len(fed) == 5  # state_swap, resample, mean, zero, random_state
    h = ctx.h_prev.double()
    want = (sum(h[i] for i in range(len(h))) / len(h)).expand_as(h)
    torch.testing.assert_close(fed[2].double(), want, rtol=1e-6, atol=1e-6)
    assert h[:, 0].std() > 1e-3  # rows differ: the mean is not any row's own state


# ----- recirculation -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("s,d", [(3, 1), (2, 1)])
def test_a_residual_patch_at_the_source_depth_is_the_state_fed_back(s, d):
    """A residual patch at the source depth s of a column before T changes z_s, which the next tokens read through
    their recirculation branch: the patched run matches the hand-written recirculation with the patch applied
    before z_s is kept (mutant: _Injector._at recording z_s from the residual as it came in, before the patch's
    edit, so the patch never reached the fed state and later tokens saw the clean z_s)."""
    from engine.patching import Patch
    from interventions.core import CausalContext as Ctx
    from models.full_bandwidth import FullBandwidthLM
    from tests.test_site_patching import B as SB, D as SD, _batch as site_batch, _lm, _ref_recirc

    model = FullBandwidthLM(_lm(7), fusion=False).eval()
    batch = site_batch(2)
    mode = f"recirc-{s}:{d}:0.4:convex"
    ctx = Ctx(model, batch, modes=[mode])
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        ref_clean = _ref_recirc(model.lm, batch.input_ids, s, d, 0.4)
        for pos in (-4, -2):
            p = Patch("resid", torch.randn(SB, SD, generator=g) * 3, depth=s, pos=pos)
            got = ctx.run(mode, [p]).logits
            ref = _ref_recirc(model.lm, batch.input_ids, s, d, 0.4, [p])
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
            assert (got - ref_clean).abs().max() > 1e-3


@pytest.mark.parametrize("spec_args", [(3, 1, 0.5, "convex"), (2, 0, 0.7, "residual")])
def test_the_step_record_keeps_z_d_before_mixing_and_z_prime_after(spec_args):
    """sequential(record=True).steps: column t's z'_t = mix(z_{t,d}, z_{t,s}) written out (convex: a |z_d|/|z_s| z_s
    + (1-a) z_d; residual: a |z_d|/|z_s| z_s + z_d), from the record's own zd and zs (mutant: the record's zd and
    mixed swapped)."""
    from engine.recirculation import RecircSpec, RecirculatedLM
    from models.configs import qwen3_config
    from models.full_bandwidth import FullBandwidthLM

    base = FullBandwidthLM.from_config(qwen3_config(50, n_layers=3, d_model=32, initializer_range=0.1),
                                       fusion=False, seed=0).eval().float()
    s, d, a, kind = spec_args
    ids = torch.randint(2, 50, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        rec = RecirculatedLM(base, RecircSpec(s, d, a, kind)).sequential(ids, torch.ones_like(ids), record=True).steps
    T = ids.shape[1]
    assert torch.isnan(rec.zd[:, T - 1]).all() and torch.isnan(rec.mixed[:, T - 1]).all()
    for t in range(T - 1):
        zd, zs = rec.zd[:, t].double(), rec.zs[:, t].double()
        scale = zd.norm(dim=-1, keepdim=True) / zs.norm(dim=-1, keepdim=True)
        want = a * scale * zs + ((1 - a) if kind == "convex" else 1.0) * zd
        torch.testing.assert_close(rec.mixed[:, t].double(), want, atol=1e-5, rtol=1e-5)
        assert (rec.mixed[:, t] - rec.zd[:, t]).abs().max() > 1e-3


def test_resample_draws_each_row_a_donor_from_another_pair(tiny_model, monkeypatch):
    """The resample ablation's donor of row i is a row of ANOTHER pair, uniform over the B - 2 of them: never i, never
    its pair partner, and every other row reachable (mutant: the second shift past the pair dropped, so a row could
    draw itself or its partner, a swap that is no ablation)."""
    from interventions.suite import Suite

    batch = _batch(tiny_model, n_pairs=3)
    ctx = CausalContext(tiny_model, batch, modes=("standard", "recurrent-1"))
    donors = []
    real = ctx.swap_state
    monkeypatch.setattr(ctx, "swap_state", lambda donor, *a, **k: donors.append(donor.clone()) or real(donor, *a, **k))
    monkeypatch.setattr(ctx, "patch_state", lambda states, *a, **k: ctx.clean[ctx.mode].logits)  # no model runs
    monkeypatch.setattr(ctx, "gate_bypass", lambda *a, **k: ctx.clean[ctx.mode].logits)
    B = batch.input_ids.shape[0]
    seen = [set() for _ in range(B)]
    for seed in range(12):
        donors.clear()
        Suite(ctx, n_boot=2, seed=seed).state_interventions()
        assert len(donors) == 2 and torch.equal(donors[0], batch.pair)  # state_swap, then resample
        rs = donors[1]
        for i in range(B):
            assert int(rs[i]) not in (i, int(batch.pair[i])), (seed, i)
            seen[i].add(int(rs[i]))
    assert all(s == set(range(B)) - {i, int(batch.pair[i])} for i, s in enumerate(seen))


def test_the_ld_of_a_row_whose_donor_shares_its_label_is_against_its_pairs_label(tiny_model):
    """Suite.arrays' LD is logit(own label word) - logit(other), other = the donor's label where it differs from the
    row's own, else the pair partner's (binary: always 1 - y), written out on known logits (mutant: the two cases
    swapped, so a same-label donor gave LD against the row's own label, 0, and a donor of a third class was read
    against the partner's label)."""
    from interventions.batch import Batch
    from interventions.suite import Suite

    base = _batch(tiny_model, n_pairs=3)
    for label_ids, labels in (((10, 11), [0, 1, 0, 1, 1, 0]), ((10, 11, 12), [0, 1, 0, 2, 1, 2])):
        b = Batch(base.input_ids, base.attention_mask, torch.tensor(labels), base.pair, base.groups, label_ids)
        s = Suite(CausalContext(tiny_model, b, modes=("standard",)), n_boot=2)
        logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        donor = torch.tensor([2, 3, 4, 5, 0, 1])
        a = s.arrays(logits.float(), donor=donor)
        y, pair = b.labels.tolist(), b.pair.tolist()
        want = []
        for i in range(6):
            other = y[donor[i]] if y[donor[i]] != y[i] else y[pair[i]]
            want.append(float(logits[i, label_ids[y[i]]]) - float(logits[i, label_ids[other]]))
        assert any(y[donor[i]] == y[i] for i in range(6))  # the same-label case occurs
        np.testing.assert_allclose(a["ld"], want, rtol=1e-6, atol=1e-6)
        assert np.all(a["ld"] != 0)


def test_energy_fraction_is_the_share_of_squared_swap_length_in_the_subspace_by_hand():
    """energy_fraction = sum over held-out rows of |U^T (donor - own)|^2 / sum of |donor - own|^2, each row in its
    fold's subspace, on numbers small enough to do by hand (mutant: the numerator summed |U^T delta| unsquared)."""
    from interventions.subspace import FoldSubspace, energy_fraction

    own = torch.zeros(3, 3)
    donor = torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, 2.0], [1.0, 1.0, 1.0]])
    e = torch.eye(3)
    folds = [FoldSubspace(np.array([0, 1]), e[:, :1], 1.0),  # rows 0, 1 in span(e0)
             FoldSubspace(np.array([2]), e[:, 1:], 1.0)]  # row 2 in span(e1, e2)
    # inside: 3^2 + 0 + (1 + 1) = 11; total: 25 + 4 + 3 = 32
    assert energy_fraction(own, donor, folds) == pytest.approx(11 / 32, abs=1e-12)
    assert energy_fraction(own + 1, donor + 1, folds) == pytest.approx(11 / 32, abs=1e-12)  # differences only


def test_the_state_sweep_counts_only_rows_whose_fed_state_comes_from_a_real_token(tiny_model):
    """The fed state at column c is the top state of column c-1: a row (or its partner) whose column c-1 is padding
    has no real state there, and the sweep leaves it out even where column c itself is real. _batch pads rows 0
    and 1 (a pair) at columns 0 and 1: at column 2 four rows count, at column 3 all six (mutant: the fused site
    checked only column c, counting the two rows fed from a pad at column 2)."""
    from interventions.suite import Suite

    batch = _batch(tiny_model)  # 6 rows, T = 7, rows 0, 1 padded at columns 0, 1
    T = batch.input_ids.shape[1]
    assert batch.attention_mask[:2, :2].sum() == 0 and batch.attention_mask[:, 2:].all()
    ctx = CausalContext(tiny_model, batch, modes=("standard", "recurrent-full"))
    rows = {r["position"]: r["n"] for r in Suite(ctx, n_boot=2).position_sweep()["rows"]}
    assert rows[2 - T] == 4 and rows[3 - T] == 6 and rows[-1] == 6
