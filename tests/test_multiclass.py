"""K label classes: multinomial probes (chance 1/K), the K-class control, probes.run / depth curves /
analysis.evaluate on the tracking tasks (parity, shell_game); binary numbers pinned to their pre-K values."""
from __future__ import annotations

import json

import numpy as np
import pytest

from common.errors import UserError
from stats.linear import ProbeConfig, check_groups, grouped_cv_score, permute_labels_by_group

FAST = ProbeConfig(n_boot=200, Cs=(0.1, 1.0))


def three_class_pairs(n_pairs=90, d=16, seed=0):
    """shell_game-like design: pairs of two different classes (cycling (0,1), (1,2), (2,0)), one group each."""
    rng = np.random.default_rng(seed)
    cyc = [(0, 1), (1, 2), (2, 0)]
    y = np.array([c for p in range(n_pairs) for c in cyc[p % 3]])
    groups = np.repeat(np.arange(n_pairs), 2)
    return rng.normal(size=(len(y), d)), y, groups, rng


def test_softmax_solver_matches_sklearn_narrow_and_wide():
    from sklearn.linear_model import LogisticRegression

    from stats.estimator import RowSpaceLogisticRegression

    rng = np.random.default_rng(1)
    for n, d in ((90, 8), (30, 60)):  # d > n: solved in the row space
        X = rng.normal(size=(n, d))
        y = np.arange(n) % 3
        X[:, 0] += y
        for C in (0.1, 10.0):
            m = RowSpaceLogisticRegression(C=C).fit(X, y)
            ref = LogisticRegression(C=C, tol=1e-12, max_iter=100000, class_weight="balanced").fit(X, y)
            assert m.coef_.shape == (3, d) and m.intercept_.shape == (3,)
            assert np.allclose(m.coef_, ref.coef_, atol=1e-4) and np.allclose(m.intercept_, ref.intercept_, atol=1e-4)
            assert np.array_equal(m.predict(X), ref.predict(X))


def test_planted_three_class_signal_and_control_at_one_third():
    X, y, groups, _ = three_class_pairs(n_pairs=150)
    X[np.arange(len(y)), y] += 2.0
    s = grouped_cv_score(X, y, groups, FAST)
    assert s.n_classes == 3 and s.chance == pytest.approx(1 / 3)
    assert s.accuracy > 0.75 and s.ci_low > 1 / 3
    assert abs(s.control_accuracy - 1 / 3) < 0.12 and s.selectivity > 0.35


def test_uninformative_inputs_are_exactly_at_chance():
    # Constant inputs (standard-prefill depth 0): folds of pairs cannot be balanced over 3 classes; the
    # class-balanced probe still predicts no fold-dependent prior, so accuracy is the class share, 1/3.
    _, y, groups, _ = three_class_pairs(n_pairs=60)
    s = grouped_cv_score(np.ones((len(y), 5)), y, groups, FAST)
    assert s.accuracy == pytest.approx(1 / 3) and s.ci_low <= 1 / 3 <= s.ci_high
    X, y, groups, _ = three_class_pairs(n_pairs=90, seed=2)
    s = grouped_cv_score(X, y, groups, FAST)
    assert s.ci_low <= 1 / 3 <= s.ci_high


def test_permute_labels_k_classes_keeps_group_structure():
    _, y, groups, _ = three_class_pairs(n_pairs=60)
    yc = permute_labels_by_group(y, groups, 0)
    assert np.array_equal(yc, permute_labels_by_group(y, groups, 0)) and (yc != y).any()
    for g in np.unique(groups):  # the members of a pair still differ
        a, b = yc[groups == g]
        assert a != b
    counts = np.bincount(yc, minlength=3)
    assert counts.sum() == len(y) and counts.min() >= 30  # 40 each before; shifts dealt out evenly
    # single-label groups: every member of a group keeps one label
    g2 = np.repeat(np.arange(30), 3)
    y2 = (np.arange(30) % 3)[g2]
    y2c = permute_labels_by_group(y2, g2, 1)
    assert all(len(set(y2c[g2 == g])) == 1 for g in range(30))


@pytest.mark.parametrize("task", ["shell_game", "s5", "a5"])
@pytest.mark.parametrize("seed", [0, 2, 7])
def test_control_labels_keep_the_class_counts_so_no_information_has_no_selectivity(task, seed):
    """A probe that learns nothing scores the share of the class its tie goes to, on the true labels and on the
    control ones alike: the control labels must keep the class counts (shell_game seed 0 read selectivity -0.042
    on constant features, s5 seed 2 -0.073), while still breaking the rule (about 1/K of them the true label)."""
    from tasks import make_dataset

    samples = make_dataset(task, 96, 8, seed=seed)
    y, groups = np.array([s.label for s in samples]), np.array([s.group_id for s in samples])
    k = len(np.unique(y))
    s = grouped_cv_score(np.zeros((len(y), 1)), y, groups, ProbeConfig(n_boot=20, random_state=seed))
    assert s.selectivity == 0.0
    yc = permute_labels_by_group(y, groups, seed)
    assert np.array_equal(np.bincount(yc, minlength=k), np.bincount(y, minlength=k))
    assert np.mean(yc == y) < 1 / k + 0.15


def test_check_groups_k_classes():
    _, y, groups, _ = three_class_pairs(n_pairs=15)
    assert check_groups(y, groups, 5) == 15
    with pytest.raises(UserError, match="at least 2 label classes"):
        check_groups(np.zeros(10, int), np.arange(10), 5)
    y2 = y.copy()
    y2[y2 == 2] = 0
    y2[:2] = [2, 1]  # class 2 in a single group
    with pytest.raises(UserError, match="label 2 occurs in 1 group"):
        check_groups(y2, groups, 5)


def test_binary_numbers_unchanged():
    # Values computed with stats.linear before K-class support (the binary path must give them exactly).
    rng = np.random.default_rng(11)
    groups = np.repeat(np.arange(40), 2)
    y = np.tile([0, 1], 40)
    X = rng.normal(size=(80, 50))
    X[:, 0] += 0.8 * y
    s = grouped_cv_score(X, y, groups, FAST)
    assert (s.accuracy, s.accuracy_std, s.ci_low, s.ci_high, s.control_accuracy) == (
        0.5125, 0.1, 0.4246875, 0.625, 0.5625)
    assert s.fold_accuracies == [0.4375, 0.625, 0.625, 0.5, 0.375] and s.n_classes == 2
    assert permute_labels_by_group(y, groups, 3)[:12].tolist() == [1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 1, 0]


# ----- CLIs on the tracking tasks -------------------------------------------------------------------------


def test_probes_run_shell_game_k3(tiny_ckpt, tmp_path):
    from probes.depth_curves import depth_curve_figure
    from probes.run import main

    out = tmp_path / "sg"
    assert main(["--task", "shell_game", "--model", str(tiny_ckpt), "--out", str(out), "--n-pairs", "15",
                 "--distractors", "2", "--modes", "standard,recurrent-1", "--n-boot", "50", "--no-cache",
                 "--no-progress"]) == 0
    doc = json.loads((out / "probes.json").read_text())
    assert doc["meta"]["labels"] == {"words": ["A", "B", "C"], "n_classes": 3, "chance": 1 / 3}
    assert [w for w in doc["meta"]["warnings"] if w["kind"] == "leakage"] == []  # depth 0 at 1/3, not flagged
    rows = doc["results"]
    assert {(r["mode"], r["n_distractors"]) for r in rows} == {("standard", 2), ("recurrent-1", 2)}
    std0 = next(r for r in rows if r["mode"] == "standard" and r["depth"] == 0)
    assert std0["accuracy"] == pytest.approx(1 / 3) and std0["ci_low"] <= 1 / 3 <= std0["ci_high"]
    fig = depth_curve_figure(doc)
    assert {round(sh.y0, 6) for sh in fig.layout.shapes} == {round(1 / 3, 6)}  # chance line at 1/K
    assert fig.layout.yaxis.range[0] < 1 / 3


def test_probes_run_tracking_defaults_and_n0_refused(capsys):
    from probes.options import DEFAULT_DISTRACTORS, _default_modes, _parse_distractors
    from probes.run import main
    from tasks import resolve_task

    assert DEFAULT_DISTRACTORS["parity"] == (8, 32, 64)
    assert _default_modes("shell_game") == ["standard", "recurrent-1", "recurrent-full"]
    assert _parse_distractors(None, resolve_task("parity")) == [8, 32, 64]
    for variant in ("parity@hold", "parity@uniform", "s5@heldout"):  # a variant takes its task's N values
        assert _parse_distractors(None, resolve_task(variant)) == [8, 32, 64]
    with pytest.raises(SystemExit) as e:
        main(["--task", "parity", "--distractors", "0,8", "--model", "tiny-fbt-track"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "parity needs N >= 1" in err and err.count("\n") == 1


def test_depth_curves_chance_fallbacks():
    from probes.depth_curves import chance_level

    assert chance_level({"meta": {}}, "completion") == 0.5
    assert chance_level({"meta": {}}, "shell_game") == pytest.approx(1 / 3)
    assert chance_level({"meta": {"labels": {"chance": 0.25}}}, "mine") == 0.25
    assert chance_level({}, "unknown") == 0.5


def test_evaluate_k_labels_by_hand_and_ci(tiny_ckpt):
    import torch

    from analysis.evaluate import EVAL_SEED, evaluate, wilson_interval
    from models.full_bandwidth import FullBandwidthLM
    from engine.prefill import pad_left
    from tasks import build_tokenizer, label_token_ids, make_dataset

    model, tok = FullBandwidthLM.from_pretrained(tiny_ckpt).eval(), build_tokenizer()
    rows = evaluate(model, tok, ["shell_game"], [3], ["std"], 0, 6, progress=False)
    assert len(rows) == 1 and rows[0]["n_samples"] == 12
    samples = make_dataset("shell_game", n_pairs=6, n_distractors=3, seed=EVAL_SEED)
    words = torch.tensor(label_token_ids(tok, "shell_game"))
    ids, mask = pad_left([tok(s.text, add_special_tokens=False)["input_ids"] for s in samples], tok.pad_token_id)
    with torch.no_grad():
        pred = model(ids, mask).logits[:, -1].argmax(-1)  # full-vocabulary argmax
    target = words[torch.tensor([s.label for s in samples])]
    k = int((pred == target).sum())
    assert rows[0]["accuracy"] == k / 12
    assert (rows[0]["ci_low"], rows[0]["ci_high"]) == pytest.approx(wilson_interval(k, 12))


def test_wilson_interval():
    from analysis.evaluate import wilson_interval

    lo, hi = wilson_interval(0, 10)
    assert lo == 0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson_interval(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-4) and hi == pytest.approx(0.5962, abs=1e-4)
    assert wilson_interval(10, 10)[1] == 1.0 and wilson_interval(10, 10)[0] < 1


def test_evaluate_cli_tracking_defaults_and_n0(tmp_path, capsys):
    from analysis.evaluate import distractors_for, main, resolve_tasks

    srcs = resolve_tasks("completion,parity,shell_game")
    assert distractors_for(srcs, None) == {"completion": [0, 8, 32, 128, 256],
                                           "parity": [4, 8, 16, 32, 64, 128, 256],
                                           "shell_game": [4, 8, 16, 32, 64, 128, 256]}
    assert distractors_for(srcs[:1], "0,8") == {"completion": [0, 8]}
    with pytest.raises(SystemExit) as e:
        main(["--tasks", "completion,shell_game", "--distractors", "0,8", "--out", str(tmp_path / "e.json")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "shell_game needs N >= 1" in err and err.count("\n") == 1
    assert not (tmp_path / "e.json").exists()
