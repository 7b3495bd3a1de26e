"""Mutation-testing gaps in training/, interventions/ and engine/{cache,edits}: each test checks behaviour against a
hand-written reference or an invariant taken from the documented definitions (docstrings, docs/), and names in its
docstring the mutant it was written to kill (a one-line change of the code that the rest of the suite let pass)."""
from __future__ import annotations

import math

import numpy as np
from dataclasses import replace

import pytest
import torch

from common.errors import UserError


# ---------------------------------------------------------------------------------------------------------- edits

def test_scale_by_zero_and_minus_one_are_zero_and_negation():
    """Scale(factor) is factor * base for every real factor, 0 and negatives included (engine/edits.py module doc).
    Mutant killed: `Scale.forward` returning the base unchanged when factor == 0 (a zero-ablation by Scale(0) that
    ablates nothing)."""
    from engine.edits import Scale

    base = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(Scale(0.0)(base), torch.zeros_like(base))
    assert torch.equal(Scale(0)(base), torch.zeros_like(base))
    assert torch.equal(Scale(-1.0)(base), -base)


def test_a_basis_off_orthonormal_by_one_percent_is_refused():
    """_check_basis accepts |U^T U - I| within max(1e-3, 4 eps of U's dtype) and refuses more (docstring): a float32
    basis whose columns are 1% too long is not a projection basis. Mutant killed: the tolerance 1e-3 -> 1e-1."""
    from engine.edits import KeepSubspace, ProjectOut, SubspaceInterchange

    U = torch.linalg.qr(torch.randn(8, 2, generator=torch.Generator().manual_seed(1)))[0]
    off = U * 1.005  # U^T U = 1.010025 I: 1e-2 off, ten times the float32 tolerance
    src = torch.zeros(4, 8)
    for make in (KeepSubspace, ProjectOut, lambda W: SubspaceInterchange(src, W)):
        with pytest.raises(UserError, match="orthonormal columns"):
            make(off)
        make(U * (1 + 2e-4))  # 4e-4 off: within 1e-3, accepted


def test_row_swap_refuses_a_donor_one_past_the_last_row():
    """RowSwap's donor rows must lie in 0..B-1 (one UserError line, not an IndexError from inside a hook). Mutant
    killed: the range check `max >= B` -> `max > B` (donor == B slips through)."""
    from engine.edits import RowSwap

    base = torch.randn(4, 3)
    with pytest.raises(UserError, match="donor rows must lie in 0..3"):
        RowSwap(torch.ones(4, dtype=torch.bool), torch.tensor([1, 2, 3, 4]))(base)
    want = base[[1, 0, 3, 2]]
    assert torch.equal(RowSwap(torch.ones(4, dtype=torch.bool), torch.tensor([1, 0, 3, 2]))(base), want)


@pytest.mark.parametrize("rows", [2, 3])
def test_add_takes_one_vector_per_row_at_any_batch_size(rows):
    """Add(vector) with vector [batch, width] adds row r's vector to row r (module doc: `Add(vector)  base + vector`,
    [width] or [batch, width]); a batch of 2 rows is no special case. Mutant killed: the per-row branch taken only
    for `vector.shape[0] > 2` (a [2, width] vector then refused as not one vector)."""
    from engine.edits import Add

    g = torch.Generator().manual_seed(2)
    base, v = torch.randn(rows, 5, generator=g), torch.randn(rows, 5, generator=g)
    torch.testing.assert_close(Add(v)(base), base + v)


# ------------------------------------------------------------------------------------------- training.quick_eval

@pytest.fixture(scope="module")
def lm_and_tok():
    """The shipped tiny-std (a trained 1-pass model, so its answers vary from prompt to prompt: a random tiny model
    answers every prompt alike, 0.5 whatever is counted) and its tokenizer."""
    from models.loading import load_model

    model, tok, _ = load_model("checkpoints/tiny-std")
    return model.eval(), tok


def _hand_label_accuracy(model, tok, task, n, n_pairs, seed=10_000):
    """Each prompt alone (no padding), one standard forward, argmax over the task's label words at its last token."""
    from tasks import label_token_ids, make_dataset, prompt_ids, prompt_prefix

    words = label_token_ids(tok, task)
    right = []
    with torch.no_grad():
        for s in make_dataset(task, n_pairs=n_pairs, n_distractors=n, seed=seed):
            ids = torch.tensor([prompt_ids(tok, s.text, prompt_prefix(tok))])
            logits = model(ids, torch.ones_like(ids)).logits[0, -1]
            right.append(int(logits[list(words)].argmax()) == s.label)
    return sum(right) / len(right)


def test_quick_eval_label_accuracy_is_the_argmax_over_the_label_words_at_the_prompts_end(lm_and_tok):
    """label_accuracy: label accuracy at the final prompt position, argmax over the label words (docstring), on the
    prompt without its answer. Checked against one unpadded forward per prompt. Mutants killed: argmax over the whole
    vocabulary; argmin; the prompt's full_text (answer included) read instead of its text."""
    from training.quick_eval import label_accuracy

    model, tok = lm_and_tok
    for task in ("completion", "parity"):
        want = _hand_label_accuracy(model, tok, task, 8, n_pairs=8)
        assert task == "completion" or want not in (0.0, 0.5, 1.0), want  # parity: not vacuous
        got = label_accuracy(model, tok, task, 8, ["standard"], n_pairs=8)["standard"]
        assert got == pytest.approx(want), task


def test_quick_eval_scores_tracking_tasks_at_n_64(lm_and_tok):
    """quick_eval: N = 8 for every task and N = 64 for the tracking tasks, logged as `<task>` and `<task> N=64`
    (docstring). Mutant killed: the N = 64 entry evaluated at N = 8."""
    from training.config import TrainConfig
    from training.quick_eval import quick_eval

    model, tok = lm_and_tok
    got = quick_eval(model, tok, TrainConfig(tasks=("parity",), distractors={8: 1.0}))
    assert set(got) == {"parity", "parity N=64"}
    assert got["parity N=64"]["standard"] == pytest.approx(_hand_label_accuracy(model, tok, "parity", 64, 16))
    assert got["parity"]["standard"] == pytest.approx(_hand_label_accuracy(model, tok, "parity", 8, 16))


# --------------------------------------------------------------------------------------------- interventions.das

def test_leace_interchange_takes_from_the_source_what_the_eraser_erases():
    """das._leace_edit(eraser, source)(base) = base + Q (source - base) with erase(x) = x - Q (x - b) (column
    convention, das.py): the same as source + erase(base) - erase(source), whatever Q (LEACE's Q is not symmetric
    where the covariance is not isotropic). Checked against the eraser's own map. Mutant killed: `delta @ Q.T` ->
    `delta @ Q` (row-vector transpose dropped)."""
    from interventions.das import _leace_edit
    from stats.erasure import fit_eraser

    g = torch.Generator().manual_seed(4)
    D = 6
    A = torch.randn(D, D, generator=g, dtype=torch.float64)  # a correlated, anisotropic covariance
    y = torch.tensor([0, 1] * 40)
    X = torch.randn(80, D, generator=g, dtype=torch.float64) @ A + 1.5 * y[:, None].double() * A[0]
    eraser = fit_eraser(X, y, 2)
    Q = (eraser.proj_left @ eraser.proj_right).double()
    assert not torch.allclose(Q, Q.T, atol=1e-6)  # not vacuous: Q vs Q^T differ
    base, source = X[:5], X[40:45]
    want = source + eraser(base) - eraser(source)
    torch.testing.assert_close(_leace_edit(eraser, source)(base).double(), want, atol=1e-9, rtol=1e-9)


def test_das_fit_reads_only_its_training_rows():
    """fit_rotation trains R "on the `train` rows" only (docstring; das_battery then scores held-out rows with it,
    "so no row is ever scored with a subspace fitted on it"): what the other rows' targets say cannot change the
    fitted rotation. Mutant killed: the cross-entropy taken over every row instead of z[train]."""
    from interventions.das import DasConfig, fit_rotation

    g = torch.Generator().manual_seed(5)
    B, d = 12, 6
    base, source = torch.randn(B, d, generator=g), torch.randn(B, d, generator=g)
    W = torch.randn(4, d, generator=g)

    def run(edit):
        return edit(base) @ W.T  # logits [B, 4], differentiable in the edit's basis

    train = np.arange(0, 8)
    target = torch.tensor([0, 1] * 6)
    other = target.clone()
    other[8:] = 1 - other[8:]  # the held-out rows' targets flipped
    cfg = DasConfig(ranks=(2,), steps=15, lr=0.05)
    r1, _ = fit_rotation(run, source, target, train, (0, 3), 2, cfg, seed=1)
    r2, _ = fit_rotation(run, source, other, train, (0, 3), 2, cfg, seed=1)
    torch.testing.assert_close(r1.basis.detach(), r2.basis.detach(), atol=0, rtol=0)


def _scripted_fit(losses_wanted):
    """fit_rotation on a 'model' whose cross-entropy at step i is losses_wanted[i] exactly (one run per step; the
    edit enters with weight 0, so the logits stay differentiable in R)."""
    from interventions.das import DasConfig, fit_rotation

    calls = []
    B, d = 4, 3
    base, source = torch.zeros(B, d), torch.ones(B, d)

    def run(edit):
        L = losses_wanted[len(calls)]
        calls.append(1)
        a = math.log(1.0 / (math.exp(L) - 1.0))  # CE of logits [a, 0] at target 0 is log(1 + e^-a) = L
        z = torch.tensor([[a, 0.0]] * B)
        return z + 0.0 * edit(base)[:, :2]

    target = torch.zeros(B, dtype=torch.long)
    cfg = DasConfig(ranks=(1,), steps=len(losses_wanted), lr=0.01)
    _, info = fit_rotation(run, source, target, np.arange(B), (0, 1), 1, cfg, seed=0)
    assert info["loss_first"] == pytest.approx(losses_wanted[0], rel=1e-5)
    assert info["loss_last"] == pytest.approx(losses_wanted[-1], rel=1e-5)
    return info["still_falling"]


def test_das_still_falling_is_a_fall_over_the_last_tenth_above_the_floor():
    """still_falling: "the loss still fell by more than 5% over the last tenth of the steps, above 0.05" (das.py,
    docs/formats.md). Scripted loss curves of 40 steps: flat -> no; fell early and flat over the last tenth -> no;
    fell 20% over the last tenth -> yes; the same fall ending under 0.05 -> no. Mutants killed: `and` -> `or`
    between the two conditions; the fall measured from the first step instead of the last tenth."""
    flat = [0.69] * 40
    early = [2.0 - 0.05 * i for i in range(34)] + [0.3] * 6
    late = [1.0] * 36 + [1.0, 0.95, 0.9, 0.8]
    late_low = [0.05] * 36 + [0.05, 0.045, 0.04, 0.04]
    assert _scripted_fit(flat) is False
    assert _scripted_fit(early) is False
    assert _scripted_fit(late) is True
    assert _scripted_fit(late_low) is False


def test_das_cosines_of_principal_angles_are_listed_largest_first():
    """cos_probe / cos_leace: "cosines of the principal angles ... largest first" (das.py, docs/formats.md). Two
    planes sharing e1 and at angle 60 degrees otherwise: [1, 0.5]. Mutant killed: the sort left ascending."""
    from interventions.das import _cosines, _mean_cos

    A = np.zeros((4, 2))
    A[0, 0] = A[1, 1] = 1.0
    B = np.zeros((4, 2))
    B[0, 0] = 1.0
    B[1, 1], B[2, 1] = 0.5, math.sqrt(3) / 2
    assert _cosines(A, B) == pytest.approx([1.0, 0.5])
    assert _mean_cos([[1.0, 0.5], None, [0.8, 0.3, 0.1]]) == pytest.approx([0.9, 0.4])  # folds' means, shortest list


@pytest.mark.parametrize("K", [2, 3])
def test_leace_basis_spans_the_column_space_of_the_erasers_perturbation(K):
    """leace_basis: an orthonormal basis [d, r] of the column space of Q = proj_left proj_right (das.py), r = rank Q
    = K - 1 for a K-class eraser: Q's columns lie in its span (B B^T Q = Q). Mutants killed: r - 1 columns; the
    last r singular vectors (of the null space) instead of the first r."""
    from interventions.das import leace_basis
    from stats.erasure import fit_eraser

    g = torch.Generator().manual_seed(6)
    D = 7
    A = torch.randn(D, D, generator=g, dtype=torch.float64)
    y = torch.arange(90) % K
    means = torch.randn(K, D, generator=g, dtype=torch.float64) * 2
    X = torch.randn(90, D, generator=g, dtype=torch.float64) @ A + means[y]
    eraser = fit_eraser(X, y, K)
    Q = (eraser.proj_left @ eraser.proj_right).double()
    B = leace_basis(eraser)
    assert B is not None and B.shape == (D, K - 1)
    torch.testing.assert_close(B.T @ B, torch.eye(K - 1, dtype=torch.float64), atol=1e-9, rtol=0)
    torch.testing.assert_close(B @ (B.T @ Q), Q, atol=1e-8, rtol=1e-8)


def test_das_battery_fits_on_each_folds_real_training_rows_and_scores_its_real_held_out_rows(monkeypatch):
    """das_battery (module doc and docstring): per fold, a rotation "fitted on the fold's training rows and applied
    to its held-out rows", training and scoring only the rows where the site is real (`rows`); the probe's rank is
    "the smallest over folds" and LEACE's "the largest over folds" of its basis's columns (docs/formats.md). The fit
    is replaced by a spy that records its rows and tags each fold's rotation. Mutants killed: test / train sets not
    restricted to `rows`; the training set taken from the fold's held-out rows; every fold scored with fold 0's
    rotation; the probe's rank the largest over folds; LEACE's rank the basis's row count (d)."""
    from types import SimpleNamespace

    import interventions.das as das
    from engine.edits import Lambda
    from interventions.subspace import FoldSubspace
    from stats.erasure import fit_eraser

    g = torch.Generator().manual_seed(7)
    B, d = 24, 4
    base = torch.randn(B, d, generator=g)
    pair = torch.arange(B) ^ 1
    source = base[pair]
    target = torch.tensor([1, 0] * (B // 2))  # the donor's label
    groups = np.repeat(np.arange(B // 2), 2)
    folds = [(np.flatnonzero(groups % 3 != f), np.flatnonzero(groups % 3 == f)) for f in range(3)]
    rows = np.ones(B, bool)
    rows[[0, 7, 13]] = False  # padding at the site
    W = torch.randn(3, d, generator=g)
    seen_train, seen_runs = [], []

    class Spy:
        def __init__(self, i):
            self.i = i

        def edit(self, source, exact=False):
            return Lambda(lambda b, i=self.i: (seen_runs.append(i), b)[1])

        def exact_basis(self):
            return torch.eye(d, dtype=torch.float64)[:, :1]

    def fit(run, source, target, train, label_ids, k, config, seed):
        seen_train.append(np.asarray(train).copy())
        return Spy(len(seen_train) - 1), {"loss_first": 1.0, "loss_last": 0.5, "still_falling": False}

    monkeypatch.setattr(das, "fit_rotation", fit)
    probe_folds = [FoldSubspace(te, torch.linalg.qr(torch.randn(d, r, generator=g))[0], 0.9)
                   for (_, te), r in zip(folds, (2, 1, 2))]
    erasers = SimpleNamespace(erasers=[fit_eraser(base[tr].double(), target[tr], 2) for tr, _ in folds])
    out = das.das_battery(lambda edit: edit(base) @ W.T, base, source, target, (0, 2), groups, folds, rows,
                          das.DasConfig(ranks=(1,), steps=1), probe_folds=probe_folds, leace=erasers, n_boot=20)
    for f, (tr, te) in enumerate(folds):
        assert sorted(seen_train[f]) == sorted(tr[rows[tr]])  # the fold's real training rows, none held out
    assert seen_runs == [0, 1, 2]  # fold f's held-out rows scored with fold f's rotation
    assert out["rows"][0]["n"] == int(rows.sum())  # every real row scored once, no padding row
    assert out["probe"]["rank"] == 1 and out["probe"]["fold_ranks"] == [2, 1, 2]
    assert out["leace"]["rank"] == 1


# ------------------------------------------------------------------------------------------ interventions.report

def _report(ne, ci, acc=1.0, acc_ci=(0.9, 1.0), bypass_ci=None):
    """A minimal report verdict() reads (tests/test_report_text.py's shape), with a gate-bypass row if asked."""
    row = {"name": "state_swap", "normalized_effect": ne, "normalized_effect_ci": ci, "follows_donor_rate": 0.5,
           "follows_donor_rate_ci": [0.4, 0.6], "changed_rate": 0.5, "changed_rate_ci": [0.4, 0.6], "n": 32,
           "n_groups": 16}
    rows = [row]
    if bypass_ci is not None:
        rows.append({"name": "gate_bypass_all", "accuracy": sum(bypass_ci) / 2, "accuracy_ci": list(bypass_ci)})
    return {"config": {"task": "parity", "mode": "recurrent-full", "distractors": 8}, "model": {"name": "m"},
            "results": {"clean": {"recurrent-full": {"accuracy": acc, "accuracy_ci": list(acc_ci), "n": 32}},
                        "interventions": rows, "subspace": {"rank": 1, "skipped": "test", "rows": []}}}


@pytest.mark.parametrize("ne, ci, acc, want", [
    (0.9, [0.5, 1.0], 1.0, "partly used"),  # lower end 0.5 does not exceed 0.5
    (0.9, [0.51, 1.0], 1.0, "causally used"),
    (0.3, [0.1, 0.6], 1.0, "partly used"),  # judged by the lower end, not the upper
    (0.2, [0.04, 0.5], 1.0, "not detectably used"),  # lower end 0.04: not above 0.05
    (0.2, [0.05, 0.5], 1.0, "not detectably used"),  # 0.05 does not exceed 0.05
    (-0.2, [-0.5, 0.1], 1.0, "not detectably used"),  # upper end 0.1: not below -0.05
    (-0.2, [-0.5, -0.05], 1.0, "not detectably used"),  # -0.05 is not below -0.05
    (-0.2, [-0.5, -0.06], 1.0, "used in reverse"),
    (0.9, [0.1, 0.5], 1.0, "inconclusive (the effect's bootstrap CI does not contain its estimate)"),  # above it
    (0.0, [0.1, 0.5], 1.0, "inconclusive (the effect's bootstrap CI does not contain its estimate)"),  # below it
    (0.9, [0.8, 1.0], 0.6, "causally used"),  # a clean accuracy of 0.6 is not under 0.6
    (0.9, [0.8, 1.0], 0.599, "inconclusive (the model does not solve the task)"),
])
def test_the_verdict_follows_its_printed_rule_at_every_bar(ne, ci, acc, want):
    """verdict's rule as its sentence prints it: "causally used where its lower end exceeds 0.5, partly used above
    0.05, used in reverse where its upper end is below -0.05, not detectably used otherwise; inconclusive at a
    clean accuracy under 0.6 or a CI that misses its estimate" (strict inequalities: a bar itself is not past it).
    Mutants killed: `<= 0.6`; `lo >= 0.5`; the partial bar halved; reverse judged by the lower end; `lo = ci[1]`;
    the CI-contains-estimate check reduced to its lower side."""
    from interventions.report import verdict

    assert verdict(_report(ne, ci, acc))[0] == want


def test_the_verdict_prints_the_effect_and_its_ci_in_order():
    """The sentence reads "normalized effect X [lo, hi]" (lo first). Mutant killed: _ci printing [hi, lo]."""
    from interventions.report import verdict

    assert "normalized effect 0.30 [0.10, 0.60]" in verdict(_report(0.3, [0.1, 0.6]))[1]


def test_the_path_clause_compares_the_bypass_upper_end_with_the_clean_lower_end():
    """_path_clause: a "partly used" / "not detectably used" verdict says the model depends on its fused inputs
    where the gate bypass's accuracy CI lies wholly more than 0.1 below the clean one (its upper end under the clean
    lower end - 0.1). Mutants killed: the bypass's lower end compared instead; the clause only for "not detectably
    used"."""
    from interventions.report import verdict

    overlap = verdict(_report(0.3, [0.1, 0.6], acc_ci=(0.9, 1.0), bypass_ci=(0.3, 0.85)))[1]
    assert "depends on its fused inputs" not in overlap  # 0.85 is not under 0.9 - 0.1
    for ne, ci in ((0.3, [0.1, 0.6]), (0.0, [-0.1, 0.1])):  # partly used, not detectably used
        below = verdict(_report(ne, ci, acc_ci=(0.9, 1.0), bypass_ci=(0.3, 0.75)))[1]
        assert "depends on its fused inputs" in below, ne
    assert "depends on its fused inputs" not in verdict(_report(0.9, [0.6, 1.0], bypass_ci=(0.3, 0.5)))[1]


def test_report_clauses_at_their_bars():
    """The smaller rules the report prints by: a loop state "makes most predictions follow the donor" above 0.5
    (0.5 itself is not most), the all-position swap counted from iteration 1 (s_0 is the prelude's output); a
    model under 0.6 gets no layer-patching summary; fewer than 4 logit steps of clean |LD| is "mostly rounding";
    a probe subspace with fewer directions on some fold says how many; a CI list prints [lo, hi]. Mutants killed:
    `> 0.5` -> `>= 0.5`; iteration 0 counted for every position; the unsolved bar 0.6 -> 0.5; the precision test
    flipped; `all` -> `any` in _rank_words; _cis printing lo twice."""
    from interventions.report import _cis, _loop_clause, _precision_clause, _rank_words, _resid_clause

    def loop(t, every):
        rows = [{"iteration": i, "swap_T": {"follows_donor_rate": a, "follows_donor_rate_ci": None},
                 "swap_all_positions": {"follows_donor_rate": b, "follows_donor_rate_ci": None}}
                for i, (a, b) in enumerate(zip(t, every))]
        return {"loop_iterations": {"rows": rows, "mode": "loop-3", "iterations": 3}}

    text = _loop_clause(loop([0.5, 0.5, 0.5], [0.9, 0.1, 0.2]))
    assert "swapped at T at no iteration (at most 0.50)" in text
    assert "at every position at no iteration (at most 0.20)" in text
    lp = {"modes": ["standard"], "depths": [0, 1], "positions": ["T"], "top_depth": {"standard": 1},
          "standard": {"normalized_effect": [[0.4], [1.0]]}}
    assert "not summarized" in _resid_clause({"layer_patching": lp}, {"accuracy": 0.55})
    p = {"dtype": "bfloat16", "logit_step": 0.06, "max_abs_label_logit": 8.0, "clean_abs_ld_mean": 0.2}
    assert "mostly rounding" in _precision_clause({"precision": {**p, "clean_abs_ld_in_steps": 3.3}})
    assert "mostly rounding" not in _precision_clause({"precision": {**p, "clean_abs_ld_in_steps": 12.0}})
    assert _rank_words({"rank": 2, "fold_ranks": [2, 1, 2]}) == "2 asked, 1-2 found per fold (2, 1, 2)"
    assert _cis([0.1, 0.2]) == "[0.10, 0.20]"


# ------------------------------------------------------------------------------------------------ training.loss

def test_ntp_loss_skips_the_targets_at_skip_pos_by_hand():
    """ntp_loss: "targets at `skip_pos` get weight 0" (the token AT a skip position is not predicted: the random
    value symbols, training.data._value_targets). By hand: mean cross-entropy of logits[j - 1] against ids[j] over
    the targets j not skipped, the label (last token) weighted `label_weight`. Mutant killed: skip_pos[:, :-1]
    (the weight of the target one column later zeroed)."""
    import torch.nn.functional as F

    from training.loss import ntp_loss

    g = torch.Generator().manual_seed(8)
    B, T, V = 2, 7, 11
    logits = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    skip = torch.zeros(B, T, dtype=torch.bool)
    skip[0, 3] = skip[1, 5] = True
    num = den = 0.0
    for b in range(B):
        for j in range(1, T):
            if skip[b, j]:
                continue
            w = 3.0 if j == T - 1 else 1.0
            num += w * float(F.cross_entropy(logits[b, j - 1][None], ids[b, j][None]))
            den += w
    assert float(ntp_loss(logits, ids, mask, 3.0, skip_pos=skip)) == pytest.approx(num / den, rel=1e-5)


# ------------------------------------------------------------------------------------- interventions.attribution

def test_agreement_by_hand():
    """attribution.agreement: Spearman (None under 3 finite cells), the overlap of the 5 largest |effects| (None at
    5 cells or fewer: every cell is in both tops), the sign agreement over the cells whose exact effect is not ~0
    (|ex| > 1e-6 of the largest), the mean |error|. Mutants killed: top-5 chosen by signed value; the overlap given
    at exactly 5 cells; signs compared over every cell; Spearman over 2 cells; the ~0 bar 1e-6 -> 1e-1."""
    from interventions.attribution import agreement

    keys = list("abcdefg")
    est = [5.0, -4.0, 3.0, 0.1, -0.2, 2.0, 0.05]
    ex = [4.0, -5.0, 1.0, 0.3, 0.05, 3.0, -0.01]
    a = agreement(est, ex, keys)
    assert a["top_estimate"] == ["a", "b", "c", "f", "e"] and a["top_exact"] == ["b", "a", "f", "c", "d"]
    assert a["top_overlap"] == 4 and a["n"] == 7 and a["top_k"] == 5
    assert a["sign_agreement"] == pytest.approx(5 / 7)  # e and g differ in sign; every exact effect is above the bar
    assert a["abs_error_mean"] == pytest.approx(sum(abs(x - y) for x, y in zip(est, ex)) / 7)
    five = agreement(est[:5], ex[:5], keys[:5])
    assert five["top_overlap"] is None and five["top_k"] == 5
    assert agreement([1.0, 2.0], [1.0, 3.0], ["a", "b"])["spearman"] is None
    # an exact effect at 1e-3 of the largest is an effect, and its sign counts
    assert agreement([1.0, -1.0, 1.0], [1.0, 1e-3, 2.0], ["a", "b", "c"])["sign_agreement"] == pytest.approx(2 / 3)
    # exact zeros are left out of the signs (np.sign(0) matches nothing)
    assert agreement([1.0, -1.0, 1.0], [1.0, 0.0, 2.0], ["a", "b", "c"])["sign_agreement"] == 1.0


def test_ig_path_resolution_by_hand():
    """ig_path_resolution: per row, the steps between start, the path's points and end; unresolved where one step
    carries MORE than 0.5 of the total variation (sum of |steps|); total_change_mean = mean(end - start). Mutants
    killed: `>` -> `>=` at the 0.5 bar; signed steps (variation that cancels); end and start swapped."""
    from interventions.attribution import ig_path_resolution

    start = torch.tensor([0.0, 0.0, 0.0, 0.0])
    end = torch.tensor([1.0, 2.0, 0.0, 1.0])
    path = torch.tensor([[0.5, 0.5],  # steps 0.5, 0, 0.5: largest share exactly 0.5 -> resolved
                         [0.2, 1.9],  # steps 0.2, 1.7, 0.1: 0.85 -> unresolved
                         [1.0, 1.0],  # steps 1, 0, -1 (total 2, net 0): largest share 0.5 -> resolved
                         [0.6, 0.1]])  # steps 0.6, -0.5, 0.9 (total 2, net 1): 0.45 -> resolved
    r = ig_path_resolution(path, start, end)
    assert r["n_rows"] == 4 and r["unresolved_rows"] == 1
    assert r["largest_step_share_median"] == pytest.approx(0.5)
    assert r["total_change_mean"] == pytest.approx(1.0)


def test_consistency_window_holds_only_fused_columns_before_a_label():
    """window_positions: "the fused columns whose states predict a label target or sit < `width` before one"
    (column c predicts token c + 1: c is in the window where a label sits at c + 1 .. c + width, and c is fused).
    By hand, with an unfused column (prefix mixin) inside the window. Mutant killed: `& fuse_mask` dropped (the
    consistency window's mean then divides by unfused columns too)."""
    from training.loss import window_positions

    mask = torch.ones(1, 8, dtype=torch.long)
    label = torch.zeros(1, 8, dtype=torch.bool)
    label[0, 6] = True
    fuse = torch.ones(1, 8, dtype=torch.bool)
    fuse[0, :5] = False  # fused from column 5 on
    got = window_positions(label, mask, fuse, 3)  # columns 3, 4, 5 predict / sit before the label: only 5 is fused
    assert got[0].tolist() == [False] * 5 + [True, False, False]


# ----------------------------------------------------------------------------------- training: warm passes, decoy

def test_warm_passes_are_that_many_extra_jacobi_passes_before_pass_2(tiny_model):
    """`warm` = w runs w extra no-grad Jacobi passes from pass 1's states before pass 2 (training/loss.py,
    multipass_loss), so pass 2 of a K = 2 objective with warm w is pass w + 2 of the plain Jacobi chain, written
    out by hand in tests/test_train.py (`_ref_multipass`). Mutant killed: `range(warm)` -> `range(warm - 1)`, one
    warm pass too few (nothing counted them)."""
    import training.loss as tloss
    from test_train import _batch, _cfg, _close, _ref_multipass

    ids, mask = _batch(seed=5)
    cfg = _cfg()
    with torch.no_grad():
        chain = _ref_multipass(tiny_model, ids, mask, 5, cfg)[1]  # the NTP loss of Jacobi passes 1..5
        for w in (1, 2, 3):
            parts = tloss.multipass_loss(tiny_model, ids, mask, 2, cfg, warm=w)[1]
            assert _close(parts[0], chain[0])
            assert _close(parts[1], chain[w + 1]), w
            assert not _close(parts[1], chain[w]), w  # the chain has not converged: one pass more or less shows


def test_the_recurrent_objective_trains_on_the_decoy_columns_it_is_given(tiny_model):
    """training.loss.StepLoss under the recurrent objective computes its logits with the micro-batch's decoy columns
    (their cached keys / values from the partner row's fed state, docs/recipe.md), equal to the hand-written
    no-cache recurrence of tests/test_decoy.py and the hand-written NTP loss of tests/test_train.py. Mutant killed:
    StepLoss passing no decoy to the recurrence (decoy training that trained on the clean recurrence)."""
    from test_decoy import naive_decoy_both
    from test_train import _cfg, _ref_ntp
    from training.data import Batch
    from training.loss import StepLoss

    A, B = [7, 3, 41, 12, 5, 29, 33, 8, 19, 4], [7, 22, 9, 30, 44, 1, 17, 38, 26, 4]  # apart from column 1 on
    ids = torch.tensor([A, B])
    mask = torch.ones_like(ids)
    at = torch.zeros_like(ids, dtype=torch.bool)
    cols = list(range(4, ids.shape[1] - 1))  # every column after the rows differ but the label's: a sizeable effect
    at[:, cols] = True
    T = ids.shape[1]
    label_pos = torch.zeros_like(ids, dtype=torch.bool)
    label_pos[:, T - 1] = True
    cfg = _cfg(objective="recurrent")
    mb = Batch(ids, mask, 1, 0, torch.zeros(2, dtype=torch.long), "decoy", label_pos, decoy=at,
               decoy_donor=torch.tensor([1, 0]))
    with torch.no_grad():
        loss = StepLoss(tiny_model, cfg)(mb)[0]
        clean = StepLoss(tiny_model, cfg)(mb._replace(decoy=None, decoy_donor=None))[0]
        ref = _ref_ntp(naive_decoy_both(tiny_model, [A, B], cols), ids, mask, cfg.label_weight)
    # float32 rounding leaves ~1e-7 between the engine and the reference; the decoy moves the loss by ~3e-4
    assert abs(float(loss - ref)) < 0.05 * abs(float(clean - ref))
