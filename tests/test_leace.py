"""LEACE concept erasure (stats.erasure, interventions.erasure): the guarantee held out, the folds, the patch
runner, a hand-built model with a known answer, the suite rows, the CLIs' flags and their bad input.

Hand-built model (as tests/test_interventions.py's `state_only_model`): every block is the identity, the fusion
reads only the state (W_G = 0, W_U = I) and the label words' embeddings are C e_0 / C e_1, so the answer at T
depends only on h_{T-1} = sqrt(D) e_label. LEACE of the label from those states maps every row to their mean
sqrt(D) (e_0 + e_1) / 2 (the class means must coincide and there is no within-class spread), so the erased
run's LD is 0 exactly up to rounding: normalized effect 1/2 against the paired sample.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from interventions.core import Batch, CausalContext, Patch
from interventions.erasure import run_recording
from interventions.metrics import label_ld
from interventions.subspace import fold_subspaces
from interventions.suite import Suite
from stats.erasure import FoldErasers, apply, cross_covariance, fit_eraser, grouped_folds, probe_check
from stats.linear import ProbeConfig

from hand_built import C, make_state_only_model, state_batch


def planted(n_pairs=60, d=12, k=2, shift=3.0, seed=0):
    """Pairs (one group each) with a label direction per class along the first k coordinates."""
    rng = np.random.default_rng(seed)
    y = np.concatenate([[i % k, (i + 1) % k] for i in range(n_pairs)])
    groups = np.repeat(np.arange(n_pairs), 2)
    X = rng.normal(size=(len(y), d))
    X[np.arange(len(y)), y] += shift
    return torch.from_numpy(X).float(), y, groups


def test_folds_are_the_subspace_swaps_folds():
    X, y, groups = planted()
    cfg = ProbeConfig(random_state=3)
    mine = grouped_folds(y, groups, cfg)
    theirs = fold_subspaces(X, y, groups, 1, cfg)
    assert [sorted(te.tolist()) for _, te in mine] == [sorted(f.test.tolist()) for f in theirs]
    for tr, te in mine:  # whole groups held out
        assert not set(groups[tr]) & set(groups[te])


@pytest.mark.parametrize("k", [2, 3])
def test_guarantee_probe_at_chance_after_erasure(k):
    X, y, groups = planted(k=k)
    cfg = ProbeConfig(n_boot=200)
    folds = grouped_folds(y, groups, cfg)
    fe = FoldErasers(X, y, folds, k)
    for f, (tr, _) in enumerate(folds):  # in sample: zero cross-covariance with the one-hot label
        before = cross_covariance(X[tr], y[tr], k)
        after = cross_covariance(fe.by_fold(X, f)[tr], y[tr], k)
        assert before > 0.5 and after < 1e-5 * before
    chk = probe_check(X, y, groups, fe, cfg)
    chance = 1 / k
    assert chk["chance"] == pytest.approx(chance)
    assert chk["before"]["accuracy"] > 0.9  # the planted label is linearly there ...
    lo, hi = chk["after"]["ci"]
    assert lo <= chance + 0.02 and chk["after"]["accuracy"] < chance + 0.12  # ... and gone, for a refitted probe
    assert chk["clean_on_erased"]["accuracy"] < chance + 0.15  # and for the clean probe on erased held-out rows
    assert chk["after"]["n"] == len(y)


def test_dose_and_identity():
    X, y, _ = planted()
    e = fit_eraser(X, y, 2)
    assert torch.equal(apply(e, X, 0.0), X)
    full = apply(e, X, 1.0)
    assert torch.allclose(full, e(X.double()).float(), atol=1e-6)
    assert torch.allclose(apply(e, X, 0.5), (X + full) / 2, atol=1e-5)
    assert fit_eraser(X[:1], y[:1], 2) is None  # nothing to fit on
    assert torch.equal(apply(None, X), X)


# ----- the hand-built model -----------------------------------------------------------------------------------
@pytest.fixture
def state_only_model(make_tiny_config):
    return make_state_only_model(make_tiny_config("qwen3"))


def _state_batch(n_pairs=10):
    return state_batch(n_pairs)


def test_hand_built_model_erasure_gives_the_known_answer(state_only_model):
    batch = _state_batch()
    ctx = CausalContext(state_only_model, batch)
    D = state_only_model.d_model
    s = Suite(ctx, n_boot=200)
    out = s.leace(ProbeConfig(n_boot=200), depths=None)
    rows = {r["name"]: r for r in out["rows"]}
    assert set(rows) == {"leace_state", "leace_state_all"} | {
        f"leace_resid_d{d}" for d in range(state_only_model.n_layers + 1)}
    st = rows["leace_state"]
    assert st["probe"]["before"]["accuracy"] == 1.0 and st["probe"]["after"]["accuracy"] == pytest.approx(0.5)
    # the erased state is the class mean: LD 0 up to rounding, halfway to the paired sample
    assert abs(st["ld_mean"]) < 1e-4 * C * math.sqrt(D)
    assert st["normalized_effect"] == pytest.approx(0.5, abs=1e-4)
    assert st["ld_clean_mean"] == pytest.approx(C * math.sqrt(D), rel=1e-4)
    assert st["relative_change"] == pytest.approx(math.sqrt(0.5), rel=1e-3)  # |e_k - (e_0 + e_1) / 2| / |e_k|
    # the blocks are the identity and attention is off: every depth at T holds the same information
    for d in range(state_only_model.n_layers + 1):
        assert rows[f"leace_resid_d{d}"]["normalized_effect"] == pytest.approx(0.5, abs=1e-3), d
    assert rows["leace_state_all"]["normalized_effect"] == pytest.approx(0.5, abs=1e-3)  # recurrent-1: T only
    dose = out["dose"]["rows"]
    assert [r["alpha"] for r in dose] == [a / 10 for a in range(11)]
    ne = [r["normalized_effect"] for r in dose]
    assert ne[0] == pytest.approx(0.0, abs=1e-9) and ne[-1] == pytest.approx(0.5, abs=1e-4)
    assert all(b >= a - 1e-9 for a, b in zip(ne, ne[1:]))  # monotone towards the erased state


def test_suite_row_is_the_measured_patched_run(tiny_model):
    """The leace_state row is computed from the patched run: recompute it by hand with concept_erasure."""
    from concept_erasure import LeaceFitter

    g = torch.Generator().manual_seed(0)
    n_pairs, T = 12, 6
    ids = torch.randint(2, tiny_model.config.vocab_size, (2 * n_pairs, T), generator=g)
    batch = Batch(ids, torch.ones_like(ids), torch.tensor([0, 1] * n_pairs), torch.arange(2 * n_pairs) ^ 1,
                  np.repeat(np.arange(n_pairs), 2), (10, 11))
    ctx = CausalContext(tiny_model, batch, modes=("standard", "recurrent-full"))
    cfg = ProbeConfig(n_boot=100)
    s = Suite(ctx, n_boot=100)
    out = s.leace(cfg, depths=[1])
    row = next(r for r in out["rows"] if r["name"] == "leace_state")
    h = ctx.h_prev
    y = batch.labels
    erased = h.clone()
    for tr, te in grouped_folds(y.numpy(), batch.groups, cfg):
        z = torch.nn.functional.one_hot(y[tr], 2).double()
        e = LeaceFitter.fit(h[tr].double(), z, constrain_cov_trace=False).eraser
        erased[te] = e(h[te].double()).float()
    logits = ctx.patch_state(erased)
    assert row["ld_mean"] == pytest.approx(float(label_ld(logits, y, batch.label_ids).mean()), rel=1e-5)
    assert row["ld_mean"] != pytest.approx(row["ld_clean_mean"])  # the patch did change the run
    for key in ("follows_donor_rate", "normalized_effect", "accuracy", "ld_mean"):
        assert row[key + "_ci"] is not None  # (a ratio of means on a random model: no containment check)
    assert row["ld_mean_ci"][0] <= row["ld_mean"] <= row["ld_mean_ci"][1]
    assert row["mode"] == "recurrent-full" and row["position"] == -1 and row["reference"] == "paired sample"
    assert row["probe"]["after"]["accuracy"] <= 0.5 + 0.2
    allrow = next(r for r in out["rows"] if r["name"] == "leace_state_all")
    assert allrow["position"] == "all" and allrow["n_positions"] == T - 1
    assert [r["name"] for r in out["rows"] if r["site"] == "resid"] == ["leace_resid_d1"]


@pytest.mark.parametrize("mode", ["standard", "recurrent-2", "fused-2"])
def test_run_recording_reads_T(tiny_model, mode):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, tiny_model.config.vocab_size, (4, 5), generator=g)
    batch = Batch(ids, torch.ones_like(ids), torch.tensor([0, 1, 0, 1]), torch.tensor([1, 0, 3, 2]),
                  np.array([0, 0, 1, 1]), (10, 11))
    ctx = CausalContext(tiny_model, batch, modes=("standard", mode))
    clean = ctx.resid(mode)[:, -1]  # [B, L+1, D]
    for d in range(tiny_model.n_layers + 1):
        value = clean[:, d] * 0.5
        logits, resid = run_recording(ctx, mode, [Patch("resid", value, depth=d, pos=-1)])
        assert torch.equal(logits, ctx.run(mode, [Patch("resid", value, depth=d, pos=-1)]).logits)
        assert torch.allclose(resid[:, :d], clean[:, :d], atol=1e-5)  # below the patch: untouched
        assert torch.equal(resid[:, d], value)
        if d < tiny_model.n_layers:
            assert not torch.allclose(resid[:, d + 1], clean[:, d + 1])  # recomputed from the patched value
    # an identity patch (an eraser a fold could not fit leaves its rows as they are): the standard patcher
    # answers with the clean result and calls no model, so the clean residual is the record
    logits, resid = run_recording(ctx, mode, [Patch("resid", clean[:, 1].clone(), depth=1, pos=-1)])
    assert torch.allclose(logits, ctx.clean[mode].logits, atol=1e-5) and torch.allclose(resid, clean, atol=1e-5)


def test_run_recording_takes_patches_as_any_iterable(tiny_model):
    """`patches` may be any iterable (a generator included): the run and its recording see the same patches.
    Mutant killed: run_recording without its `list(patches)` (a generator consumed by the recorder, the run then
    unpatched)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, tiny_model.config.vocab_size, (4, 5), generator=g)
    batch = Batch(ids, torch.ones_like(ids), torch.tensor([0, 1, 0, 1]), torch.tensor([1, 0, 3, 2]),
                  np.array([0, 0, 1, 1]), (10, 11))
    ctx = CausalContext(tiny_model, batch, modes=("standard", "recurrent-2"))
    value = ctx.resid("recurrent-2")[:, -1, 1] * 0.5
    as_list = run_recording(ctx, "recurrent-2", [Patch("resid", value, depth=1, pos=-1)])
    as_gen = run_recording(ctx, "recurrent-2", (p for p in [Patch("resid", value, depth=1, pos=-1)]))
    assert not torch.equal(as_list[0], ctx.clean["recurrent-2"].logits)  # the patch changes the logits
    assert torch.equal(as_gen[0], as_list[0]) and torch.equal(as_gen[1], as_list[1])


# ----- CLIs ---------------------------------------------------------------------------------------------------
def test_interventions_cli_reports_leace_rows(tiny_ckpt, tmp_path):
    from interventions.run import main

    out = tmp_path / "fig"
    assert main(["--model", str(tiny_ckpt), "--task", "completion", "--mode", "recurrent-full", "--n-pairs", "10",
                 "--distractors", "0", "--out", str(out), "--control-model", "none", "--no-progress",
                 "--max-positions", "3", "--erase-depths", "0,2", "--erase-positions", "T-1,T-2", "--leace-all"]) == 0
    rep = json.loads((out / "causal_report.json").read_text())
    assert rep["schema"]["version"] == 8
    assert rep["config"]["erase_depths"] == [0, 2] and rep["config"]["erase_positions"] == [-2, -3]
    le = rep["results"]["leace"]
    names = [r["name"] for r in le["rows"]]
    assert names == ["leace_state", "leace_state@T-1", "leace_state@T-2", "leace_state_all", "leace_resid_d0",
                     "leace_resid_d2"]
    for r in le["rows"]:
        assert "leace" in r["name"] and r["mode"] == "recurrent-full" and "position" in r
        assert r["n"] > 0 and r["follows_donor_rate_ci"] is not None and r["normalized_effect_ci"] is not None
    assert len(le["dose"]["rows"]) == 11
    md = (out / "causal_report.md").read_text()
    assert "## Concept erasure (LEACE)" in md and "leace_resid_d2" in md
    assert "LEACE dose" in (out / "causal_report.html").read_text()


@pytest.mark.parametrize("flags, msg", [
    (["--erase-positions", "3"], "negative offsets"),
    (["--erase-positions=-1,x"], "negative offsets"),
    (["--erase-positions", "T+1"], "negative offsets"),
    (["--erase-depths", "9"], "beyond recurrent-1's depth 0.."),
    (["--erase-positions=-2,-400"], "--erase-positions T-1: recurrent-1 feeds a state only at T..T"),
    (["--mode", "standard", "--erase-positions", "-1"], "feeds no state"),
    (["--mode", "standard", "--leace-all"], "--leace-all / --no-leace-all: the row erases the fed state"),
    (["--mode", "standard", "--no-leace-all"], "--leace-all / --no-leace-all: the row erases the fed state"),
    (["--mode", ""], "unknown prefill mode ''"),
    (["--mode", "recurrent-full", "--erase-positions", "T"], "the fed state at T is always erased"),
    (["--mode", "standard", "--subspace-rank", "3"], "--subspace-rank sets the fed state's subspace swap"),
])
def test_interventions_cli_bad_erase_flags(tiny_ckpt, tmp_path, capsys, flags, msg):
    from interventions.run import main

    args = ["--model", str(tiny_ckpt), "--task", "completion", "--n-pairs", "10", "--distractors", "0",
            "--out", str(tmp_path / "o"), "--control-model", "none", "--no-progress"]
    with pytest.raises(SystemExit) as e:
        main(args + flags)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and msg in err[0]
    assert not (tmp_path / "o").exists()  # refused before anything, or inside the lock: no folder left either


def test_an_explicit_control_model_under_standard_is_refused(tiny_ckpt, tmp_path, capsys):
    """A control model tests the swap of a fed state: asked for under standard prefill it would be dropped."""
    from interventions.run import main

    with pytest.raises(SystemExit) as e:
        main(["--model", str(tiny_ckpt), "--task", "completion", "--n-pairs", "10", "--distractors", "0", "--mode",
              "standard", "--control-model", str(tiny_ckpt), "--out", str(tmp_path / "o"), "--no-progress"])
    assert e.value.code == 2 and "--control-model: a control model tests" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_probes_cli_erase_refused_where_no_mode_would_erase(tiny_ckpt, tmp_path, capsys):
    """Recirculation modes are not on the patching engine: --erase with only those would be dropped."""
    from probes.run import main

    with pytest.raises(SystemExit) as e:
        main(["--task", "completion", "--model", str(tiny_ckpt), "--out", str(tmp_path / "p"), "--n-pairs", "20",
              "--distractors", "8", "--no-progress", "--modes", "recirc-2:1:0.3", "--erase", "1"])
    assert e.value.code == 2 and "--erase runs the patching engine" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_probes_cli_erase_depth_curve(tiny_ckpt, tmp_path):
    from probes.run import main

    out = tmp_path / "p"
    assert main(["--task", "completion", "--model", str(tiny_ckpt), "--out", str(out), "--n-pairs", "20",
                 "--distractors", "8", "--n-boot", "100", "--no-progress", "--no-cache", "--erase", "1",
                 "--no-mdl"]) == 0
    doc = json.loads((out / "probes.json").read_text())
    assert doc["meta"]["run"]["erase"] == 1 and doc["meta"]["erase"]["depth"] == 1
    assert doc["meta"]["erase"]["skipped_modes"] == []  # no recirculation mode here
    er = doc["erased"]
    assert {(r["mode"], r["depth"]) for r in er} == {(m, d) for m in ("standard", "recurrent-1") for d in (1, 2)}
    for r in er:
        assert r["erased_at"] == 1 and r["ci_low"] <= r["accuracy"] <= r["ci_high"]
        if r["depth"] == 1:  # the erased depth itself: a probe refitted there is at chance (the guarantee)
            assert r["accuracy"] == pytest.approx(0.5, abs=0.1)
    assert all(r["mdl_compression"] is None for r in doc["results"])  # --no-mdl
    assert "erased at 1" in (out / "depth_curves.html").read_text()


def test_probes_cli_erase_beyond_depth_is_one_line(tiny_ckpt, tmp_path, capsys):
    from probes.run import main

    with pytest.raises(SystemExit) as e:
        main(["--task", "completion", "--model", str(tiny_ckpt), "--out", str(tmp_path / "p"), "--n-pairs", "20",
              "--distractors", "8", "--no-progress", "--no-cache", "--erase", "3"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--erase 3" in err[0]
    assert not (tmp_path / "p").exists()


SHIPPED = __import__("pathlib").Path(__file__).resolve().parent.parent / "checkpoints" / "tiny-fbt" / "model.safetensors"


@pytest.mark.skipif(not SHIPPED.is_file(), reason="tiny-fbt is not shipped in this checkout")
def test_shipped_tiny_fbt_memory_erasure(tmp_path):
    """On the shipped model the fed state carries the label (probe 1.0) and erasing it is measured, not assumed:
    the held-out probe after LEACE is at chance, and the answer survives the erasure of the fed state but not
    of the label from the top residual."""
    from interventions.run import main

    out = tmp_path / "m"
    assert main(["--task", "memory", "--n-pairs", "20", "--control-model", "none", "--out", str(out),
                 "--max-positions", "2", "--erase-depths", "6", "--no-progress"]) == 0
    rows = {r["name"]: r for r in json.loads((out / "causal_report.json").read_text())["results"]["leace"]["rows"]}
    st = rows["leace_state"]
    assert st["probe"]["before"]["accuracy"] >= 0.95
    assert st["probe"]["after"]["ci"][0] <= 0.5 <= st["probe"]["after"]["ci"][1]
    assert st["normalized_effect"] < 0.1 and st["follows_donor_rate"] == 0.0
    assert rows["leace_resid_d6"]["follows_donor_rate"] > 0.3


def test_probes_cli_erase_fits_the_labels_the_clean_curve_fits(tiny_ckpt, tmp_path, monkeypatch):
    """Ten answers are too many classes for grouped CV: the clean probes fit the pair role (tasks.probe_labels),
    and so must --erase (it erased and probed the 10-way answer: 0.10 at the erased depth, ~1.0 above, drawn on
    the role curve's axes). Erased at depth 1, the role reads at chance there. (The built-in language tasks take
    the roles; a user's file is refused instead since 2026-12-07, so the file here is let through as one.)"""
    import random

    import tasks
    from probes.run import main

    real = tasks.probe_target
    monkeypatch.setattr(tasks, "probe_target", lambda sets, k, roles_allowed=True: real(sets, k, True))

    rng = random.Random(0)
    lines = [{"label_words": [str(d) for d in range(10)], "name": "many"}]
    for p in range(30):
        for a in rng.sample(range(10), 2):
            lines.append({"text": f"A = {a}\nB = {rng.randrange(10)}\nget A\nvalue:", "label": a, "pair": p, "group": p})
    task = tmp_path / "many.jsonl"
    task.write_text("\n".join(json.dumps(x) for x in lines))
    out = tmp_path / "p"
    assert main(["--task", str(task), "--model", str(tiny_ckpt), "--modes", "recurrent-1", "--erase", "1", "--out",
                 str(out), "--n-boot", "100", "--no-progress", "--no-cache", "--no-mdl"]) == 0
    doc = json.loads((out / "probes.json").read_text())
    assert doc["meta"]["labels"]["probe_label"] != "the answer (the label)"  # the pair role
    er = {r["depth"]: r for r in doc["erased"]}
    assert er[1]["accuracy"] == pytest.approx(0.5, abs=0.1)  # binary role at chance where it was erased
    assert all(r["accuracy"] <= max(c["accuracy"] for c in doc["results"]) + 0.15 for r in er.values())


def test_a_perfect_erasure_leaves_no_round_off_for_the_probe_to_read():
    """The label in one coordinate, the others constant: LEACE leaves that coordinate at float64 round-off
    (~3e-16) whose sign still follows the label, and the standardized probe read it at 1.00 'after'. Round-off
    below 1e-10 of a row's largest component is 0 now, so the check reads chance, as the guarantee says."""
    from stats.erasure import FoldErasers, grouped_folds, probe_check

    cfg = ProbeConfig(n_boot=50)
    y = np.array([0, 1] * 20)
    g = np.repeat(np.arange(20), 2)
    for dtype in (torch.float32, torch.float64):
        X = torch.tensor(np.c_[2.0 * y - 1, np.ones((len(y), 15))], dtype=dtype)
        fe = FoldErasers(X, y, grouped_folds(y, g, cfg), 2)
        pc = probe_check(X, y, g, fe, cfg)
        assert pc["before"]["accuracy"] == 1.0 and pc["after"]["accuracy"] == 0.5
        assert pc["clean_on_erased"]["accuracy"] == 0.5


@pytest.mark.parametrize("offset", [0.0, 1e-3, 0.37, 7.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_perfect_erasure_around_a_shared_value_reads_chance(dtype, offset):
    """Rows that the label fully determines, offset from 0: the erasure maps every row to the class means' common
    point, up to rounding. The float32 cast's rounding around that point followed the label and the refitted
    standardized probe scaled it up ('after' read 1.00); the clean probe's decisions there were round-off whose
    sign picked the label ('clean_on_erased' read 1.00 or 0.00). A perfect erasure reads chance on all of them."""
    cfg = ProbeConfig(n_boot=50)
    y = np.tile([0, 1], 40)
    g = np.repeat(np.arange(40), 2)
    X = np.zeros((len(y), 3))
    X[np.arange(len(y)), y] = 3.0
    X += offset
    X[:, 2] = 1.0 + offset
    X = torch.from_numpy(X).to(dtype)
    fe = FoldErasers(X, y, grouped_folds(y, g, cfg), 2)
    pc = probe_check(X, y, g, fe, cfg)
    assert pc["before"]["accuracy"] == 1.0
    assert pc["after"]["accuracy"] == 0.5 and pc["clean_on_erased"]["accuracy"] == 0.5


def test_fit_eraser_refuses_non_finite_values_and_labels_outside_the_classes():
    from common.errors import UserError

    X = torch.randn(8, 3, dtype=torch.float64)
    with pytest.raises(UserError, match="NaN or infinite"):
        fit_eraser(torch.where(torch.arange(3) == 1, torch.nan, X), [0, 1] * 4, 2)
    for labels in ([1, 2] * 4, [-1, 1] * 4):
        with pytest.raises(UserError, match="class indices 0..1"):
            fit_eraser(X, labels, 2)


def test_a_held_out_class_the_training_fold_lacks_scores_zero_not_a_traceback():
    """The tie-aware scoring indexed the decision columns by the test label's place among the training classes: a
    label sorting after all of them was an IndexError (the old `predict == y` scored it 0)."""
    from stats.erasure import heldout_accuracy

    X = np.random.default_rng(0).normal(size=(40, 5))
    y = np.array([0, 1] * 18 + [2] * 4)
    g = np.arange(40) // 2
    r = heldout_accuracy(lambda f: X, lambda f: X, y, g, [(np.arange(36), np.arange(30, 40))], ProbeConfig(n_boot=20))
    assert r["n"] == 10 and 0.0 <= r["accuracy"] <= 0.6  # the four class-2 rows score 0
