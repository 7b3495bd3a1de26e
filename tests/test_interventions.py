"""Interventions (docs/design.md, Interventions): exactness, a hand-built model with a known answer, metric formulas, subspace
composition, and the CLI's bad-input behaviour.

The hand-built model (`state_only_model`): a 2-layer Qwen3-style FullBandwidthLM whose logits at T depend
only on the state fed to the fusion.
    * every block's attention output projection (o_proj) and MLP down projection are zero, so each block is
      the identity on the residual stream: the top residual equals the input of block 0;
    * fusion: W_G = 0 (the gate is sigmoid(0) = 1/2 for every token: the embedding e_T has no influence),
      W_U = I, norm weight 1, so u_T = RMSNorm(h_{T-1} / 2) = RMSNorm(h_{T-1});
    * embeddings (tied with the LM head): token A = 3 -> C * e_0, token B = 4 -> C * e_1, all others 0.
      A prompt [.., A|B, F] with the label token at T-1 gives h_{T-1} = final_norm(E[A|B]) = sqrt(D) e_k, hence
      logits(T) = E RMSNorm(RMSNorm(sqrt(D) e_k)) and LD = C sqrt(D) * D / (D + eps') ~= C sqrt(D) for the
      label of the token at T-1 (label 0 <-> A, 1 <-> B).
    * documented values: clean LD = C sqrt(D) (here 2 * sqrt(32) = 11.31) and accuracy 1; the paired swap
      gives LD = -C sqrt(D), flip rate 1 and normalized effect 1; zero ablation gives u = RMSNorm(0) = 0, a zero
      residual, zero logits, hence LD = 0 exactly, accuracy 1/2 (an exact tie counts 1/2), normalized effect
      exactly 1/2.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from interventions.core import Batch, CausalContext
from interventions.metrics import label_ld, summarize
from interventions.subspace import fold_subspaces, per_fold_states, random_subspace, swap_part
from interventions.suite import Suite

from hand_built import C, make_state_only_model, state_batch


def _random_batch(model, n_pairs=4, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    ids = torch.randint(2, V, (2 * n_pairs, T), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # some left padding (pair 0 shares it)
    mask[1, :2] = 0
    labels = torch.tensor([0, 1] * n_pairs)
    pair = torch.arange(2 * n_pairs) ^ 1
    return Batch(ids, mask, labels, pair, np.repeat(np.arange(n_pairs), 2), (10, 11))


def test_donor_self_changes_nothing_exactly(tiny_model):
    batch = _random_batch(tiny_model)
    ctx = CausalContext(tiny_model, batch)  # also checks clean logits == the prefill engine's, bit for bit
    me = torch.arange(batch.size)
    clean = ctx.clean["recurrent-1"].logits
    assert torch.equal(ctx.swap_state(me), clean)
    h = ctx.h_prev
    assert torch.equal(ctx.patch_state((1 - 0.0) * h + 0.0 * h[batch.pair]), clean)
    for mode in ("standard", "recurrent-1"):
        for pos in (-2, -1):
            for d in range(tiny_model.n_layers + 1):
                assert torch.equal(ctx.patch_resid(mode, d, pos, me), ctx.clean[mode].logits), (mode, pos, d)
    # the swap does change something, and the shared prefix is restored after every run
    assert (ctx.swap_state(batch.pair) - clean).abs().max() > 1e-3
    assert torch.equal(ctx.run("recurrent-1").logits, clean)


def test_a_residual_patch_keeps_unchanged_rows_exactly_and_needs_no_cache_of_earlier_runs(tiny_model):
    """Standard prefill, a residual patch after column 0 (the cached-suffix path): rows whose value is their own
    keep the clean logits bit for bit, the others get what the all-donor patch gives them; and a run's result
    does not depend on which runs came before it (no suffix cached across runs)."""
    batch = _random_batch(tiny_model)
    ctx = CausalContext(tiny_model, batch)
    clean = ctx.clean["standard"].logits
    me, donor = torch.arange(batch.size), batch.pair
    mixed = torch.where(me % 2 == 0, me, donor)  # even rows patched with their own value
    for d, pos in ((1, -3), (tiny_model.n_layers, -1)):
        cold = ctx.patch_resid("standard", d, pos, mixed)
        swapped = ctx.patch_resid("standard", d, pos, donor)
        again = ctx.patch_resid("standard", d, pos, mixed)
        assert torch.equal(cold[::2], clean[::2]) and torch.equal(cold[1::2], swapped[1::2])
        assert torch.equal(again, cold)
        assert (cold[1::2] - clean[1::2]).abs().max() > 1e-4  # the donor rows did move


def test_top_depth_patch_gives_the_donor_logits(tiny_model):
    batch = _random_batch(tiny_model)
    ctx = CausalContext(tiny_model, batch)
    L = tiny_model.n_layers
    for mode in ("standard", "recurrent-1"):
        out = ctx.patch_resid(mode, L, -1, batch.pair)
        assert torch.allclose(out, ctx.clean[mode].logits[batch.pair], atol=1e-6)


@pytest.fixture
def state_only_model(make_tiny_config):
    return make_state_only_model(make_tiny_config("qwen3"))


def _state_batch(n_pairs=6):
    return state_batch(n_pairs)


def test_hand_built_model_swap_flips_all_and_zero_gives_documented_value(state_only_model):
    batch = _state_batch()
    ctx = CausalContext(state_only_model, batch)
    D = state_only_model.d_model
    y, ids = batch.labels, batch.label_ids
    ld_clean = label_ld(ctx.clean["recurrent-1"].logits, y, ids)
    assert np.allclose(ld_clean, C * math.sqrt(D), rtol=1e-4)
    s = Suite(ctx, n_boot=200)
    swap = s.metrics(ctx.swap_state(batch.pair))
    assert swap["follows_donor_rate"] == 1.0 and swap["accuracy"] == 0.0
    assert swap["normalized_effect"] == pytest.approx(1.0, abs=1e-6)
    zero_logits = ctx.patch_state(torch.zeros_like(ctx.h_prev))
    assert np.array_equal(label_ld(zero_logits, y, ids), np.zeros(batch.size))
    zero = s.metrics(zero_logits)
    assert zero["ld_mean"] == 0.0 and zero["accuracy"] == 0.5 and zero["normalized_effect"] == 0.5
    # the embedding at T has no influence: the gate bypass feeds e_T = E[F] = 0 -> zero logits too
    assert np.array_equal(label_ld(ctx.gate_bypass(), y, ids), np.zeros(batch.size))


def test_metric_formulas_match_a_hand_computation():
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 2.0, 2.0], [5.0, 0.0, 4.0], [0.0, -1.0, 1.0]])
    y = np.array([0, 1, 1, 0])
    ld = label_ld(logits, y, (1, 2))
    assert ld.tolist() == [2.0, 0.0, 4.0, -2.0]
    ld_clean = np.array([3.0, 1.0, 2.0, 1.0])
    ld_ref = np.array([-3.0, -1.0, 2.0, -1.0])  # row 2: a same-label donor
    ref_labels = np.array([1, 0, 1, 1])
    groups = np.array([0, 0, 1, 1])
    m = summarize(ld, ld_clean, ld_ref, y, ref_labels, groups, n_boot=500, seed=0)
    assert m["n"] == 4 and m["n_groups"] == 2 and m["n_donor_rows"] == 3
    assert m["follows_donor"] == pytest.approx(0 + 0.5 + 1)  # rows 0, 1, 3 below
    assert m["ld_mean"] == pytest.approx(1.0)
    assert m["accuracy"] == pytest.approx((1 + 0.5 + 1 + 0) / 4)
    # flip over rows 0, 1, 3 (donor label differs): 0, 0.5, 1
    assert m["follows_donor_rate"] == pytest.approx(1.5 / 3)
    # ((2-3)+(0-1)+(4-2)+(-2-1)) / ((-3-3)+(-1-1)+(2-2)+(-1-1)) = -3 / -10
    assert m["normalized_effect"] == pytest.approx(0.3)
    for k in ("ld_mean", "accuracy", "follows_donor_rate", "normalized_effect"):
        lo, hi = m[k + "_ci"]
        assert lo <= m[k] + 1e-12 and m[k] <= hi + 1e-12


def test_subspace_and_complement_compose_to_the_full_swap(tiny_model):
    batch = _random_batch(tiny_model, n_pairs=6)
    ctx = CausalContext(tiny_model, batch)
    h, donor = ctx.h_prev, ctx.h_prev[batch.pair]
    U = random_subspace(h.shape[1], 3, seed=0)
    sub = swap_part(h, donor, U, "subspace")
    both = swap_part(sub, donor, U, "complement")
    assert torch.allclose(both, donor, atol=1e-6)
    assert torch.allclose(swap_part(h, donor, U, "complement") - h + sub - h, donor - h, atol=1e-6)
    assert torch.allclose(ctx.patch_state(both), ctx.swap_state(batch.pair), atol=1e-5)


def test_probe_subspaces_are_fitted_on_training_folds_only():
    rng = np.random.default_rng(0)
    n_pairs, D = 30, 8
    y = np.tile([0, 1], n_pairs)
    groups = np.repeat(np.arange(n_pairs) % 15, 2)
    H = torch.tensor(rng.normal(size=(2 * n_pairs, D)) + 4.0 * y[:, None] * np.eye(D)[0], dtype=torch.float32)
    folds = fold_subspaces(H, y, groups, rank=2)
    held = np.concatenate([f.test for f in folds])
    assert sorted(held.tolist()) == list(range(2 * n_pairs))  # each row held out exactly once
    for f in folds:
        train_groups = set(groups[np.setdiff1d(np.arange(2 * n_pairs), f.test)].tolist())
        assert not train_groups & set(groups[f.test].tolist())
        assert torch.allclose(f.U.T @ f.U, torch.eye(2), atol=1e-5)
        assert float(f.U[0].norm()) > 0.95  # the planted direction lies in the rank-2 subspace
    own, donor = H, H[torch.arange(2 * n_pairs) ^ 1]
    full = per_fold_states(per_fold_states(own, donor, folds, "subspace"), donor, folds, "complement")
    assert torch.allclose(full, donor, atol=1e-5)


def test_random_subspace_baselines_of_nearby_seeds_share_no_basis():
    """The random-subspace swap draws every fold's basis anew for each --seed: no basis of --seed s is one of
    --seed s + 1's (a seed per fold, seed + i, gave s + 1 four of s's five)."""
    from interventions.subspace import FoldSubspace

    D, n_folds = 8, 5
    own = torch.randn(1, D, generator=torch.Generator().manual_seed(0)).expand(n_folds, D)  # one delta for every row
    donor = own + torch.randn(1, D, generator=torch.Generator().manual_seed(1))
    folds = [FoldSubspace(np.array([i]), torch.zeros(D, 1), 1.0) for i in range(n_folds)]  # row i: fold i's basis
    rows = {s: per_fold_states(own, donor, folds, "subspace", random_rank_seed=s) for s in range(1000, 1003)}
    for s in rows:
        for t in rows:
            for i in range(n_folds):
                for j in range(n_folds):
                    if (s, i) != (t, j):
                        assert not torch.allclose(rows[s][i], rows[t][j], atol=1e-6), (s, i, t, j)
    # each row is its fold's random rank-1 swap: own + (delta . u) u for a unit u
    delta = (donor - own)[0]
    for i in range(n_folds):
        step = rows[1000][i] - own[i]
        u = step / step.norm()
        assert torch.allclose(step, (delta @ u) * u, atol=1e-5)


def test_class_mean_subspaces_are_the_training_folds_class_means():
    """Per fold: an orthonormal basis of the training rows' class-mean differences (rank K - 1), the held-out rows
    left out of it; a coordinate that barely varies (where a standardized probe leans) does not pull it."""
    from interventions.subspace import class_mean_subspaces

    rng = np.random.default_rng(2)
    n, D = 90, 6
    y = np.arange(n) % 3
    groups = np.arange(n) // 3
    H = rng.normal(size=(n, D))
    H[:, 0] += 3.0 * (y == 1) - 3.0 * (y == 2)
    H[:, 5] = 1e-3 * rng.normal(size=n) + 1e-3 * y  # tiny spread, perfectly separable after standardizing
    H = torch.tensor(H)
    folds = fold_subspaces(H.float(), y, groups, rank=2)
    means = class_mean_subspaces(H, y, folds)
    for f, m in zip(folds, means):
        assert np.array_equal(m.test, f.test) and m.U.shape == (D, 2)
        assert torch.allclose(m.U.T @ m.U, torch.eye(2, dtype=m.U.dtype), atol=1e-10)
        tr = np.setdiff1d(np.arange(n), f.test)
        for c in (1, 2):
            d = torch.tensor(H.numpy()[tr][y[tr] == c].mean(0) - H.numpy()[tr][y[tr] == 0].mean(0))
            assert torch.allclose(m.U @ (m.U.T @ d), d, atol=1e-10)  # spans each difference
        assert float(m.U[5].norm()) < 0.01  # the near-constant coordinate carries no weight here
        moved = H.clone()
        moved[f.test] += 100.0  # the held-out rows do not enter
        assert torch.allclose(class_mean_subspaces(moved, y, [f])[0].U, m.U)


def test_rank_k_minus_1_spans_a_three_way_label():
    """Three class means in the plane of axes 0 and 1 (an equilateral triangle, isotropic unit noise, so the
    discriminative directions are that plane): the rank-2 multinomial probe subspace (the CLI's default for
    K = 3) holds the plane; rank 1 holds one line of it only, so its swap cannot move every class to every
    other. (Separable toy data would not do: an overfit probe's raw-space weights lean on the noise axes.)"""
    rng = np.random.default_rng(1)
    n, D = 300, 8
    y = np.arange(n) % 3
    groups = np.arange(n) // 3
    ang = 2 * np.pi * y / 3
    H = rng.normal(size=(n, D))
    H[:, 0] += 2 * np.cos(ang)
    H[:, 1] += 2 * np.sin(ang)
    H = torch.tensor(H, dtype=torch.float32)
    for f in fold_subspaces(H, y, groups, rank=2):
        P = f.U @ f.U.T
        assert torch.linalg.matrix_norm(P[:2, :2] - torch.eye(2)) < 0.2  # the plane of the class means
    for f in fold_subspaces(H, y, groups, rank=1):
        assert 0.85 < float((f.U @ f.U.T)[:2, :2].trace()) < 1.05  # one line of it


# ----- CLI ---------------------------------------------------------------------------------------------------
def _cli(argv, capsys):
    from interventions.run import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    return e.value.code, err


@pytest.mark.parametrize("argv, needle", [
    (["--task", "nope"], "unknown task"),
    (["--mode", "fused-5000"], "at most 1000 fused passes"),
    (["--max-positions", "-1"], "--max-positions: must be an integer in 0..100000"),
    (["--mode", "bogus"], "unknown prefill mode"),
    (["--model", "no-such-model-xyz"], "unknown model"),
    (["--n-pairs", "3"], "--n-pairs: must be an integer in 10..5000"),
    (["--n-pairs", "100000"], "--n-pairs: must be an integer in 10..5000"),
    (["--n-pairs", "many"], "--n-pairs: must be an integer"),
    (["--seed", "4294967296"], "--seed: must be an integer in 0..4294967295"),  # common.cli.MAX_SEED
    (["--subspace-rank", "0"], "--subspace-rank: must be an integer in 1..64"),
    (["--max-depths", "1"], "--max-depths 1 cannot keep both depth 0 and L"),
    (["--distractors", "-1"], "--distractors: must be an integer in 0..1024"),
    (["--out", ""], "--out is empty"),
    (["--out", "/proc/x/y"], "--out /proc/x/y"),
    (["--no-such-flag"], "unrecognized arguments"),
])
def test_cli_bad_input_is_one_line_exit_2(argv, needle, capsys):
    code, err = _cli(argv, capsys)
    assert code == 2
    assert err.startswith("error: ") and needle in err and err.strip().count("\n") == 0


def test_cli_refuses_to_overwrite_another_runs_results(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "causal_report.json").write_text('{"previous": true}')
    (out / "probe_results.json").write_text("keep")
    code, err = _cli(["--model", "tiny-fbt", "--out", str(out)], capsys)  # refused before it loads
    assert code == 2 and "--overwrite" in err and err.strip().count("\n") == 0
    assert json.loads((out / "causal_report.json").read_text()) == {"previous": True}
    assert (out / "probe_results.json").read_text() == "keep"
    assert sorted(p.name for p in out.iterdir()) == ["causal_report.json", "probe_results.json"]


TRACK = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-fbt-track"


def _metric_rows(res):
    """Every row of the report that carries the intervention metrics, with where it comes from."""
    rows = [(f"clean/{m}", r) for m, r in res["clean"].items()]
    rows += [(f"intervention/{r['name']}", r) for r in res["interventions"]]
    rows += [(f"subspace/{r['name']}", r) for r in res["subspace"]["rows"]]
    rows += [(f"dose/{r['alpha']}", r) for r in res["dose"]["rows"]]
    rows += [(f"sweep/{r['position']}", r) for r in res["position_sweep"]["rows"]]
    rows += [(f"ablation/{r['name']}", r) for r in res["resid_mean_ablation"]["rows"]]
    for mode, cells in res["layer_patching"]["cells"].items():
        rows += [(f"layers/{mode}/{c['depth']}/{c['position']}", c) for c in cells]
    return rows


@pytest.mark.skipif(not (TRACK / "model.safetensors").is_file(), reason="tiny-fbt-track is not shipped here")
def test_cli_end_to_end_fast_on_the_shipped_tracking_model(tmp_path):
    """interventions.run on the shipped tiny-fbt-track (parity, recurrent-full, 10 pairs, N = 4, last 4
    positions, no control): the written causal_report.json against values computed here, independently of the
    suite, from the task generator, the tokenizer and the prefill engine. A few seconds."""
    import hashlib

    from engine.prefill import pad_left, prefill_many
    from interventions.report import SCHEMA
    from interventions.run import main
    from models.loading import load_model
    from tasks import copies_across_groups, dataset_fingerprint, label_token_ids, make_dataset, tokenize_samples

    out = tmp_path / "o"
    argv = ["--model", str(TRACK), "--task", "parity", "--mode", "recurrent-full", "--n-pairs", "10",
            "--distractors", "4", "--max-positions", "4", "--control-model", "none", "--out", str(out),
            "--no-progress", "--n-boot", "300"]
    assert main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == ["causal_report.html", "causal_report.json",
                                                     "causal_report.md", "plotly.min.js"]
    rep = json.loads((out / "causal_report.json").read_text())
    res = rep["results"]

    # --- the dataset and the clean runs, recomputed here
    model, tok, _ = load_model(str(TRACK))
    model = model.float().eval()
    samples = make_dataset("parity", n_pairs=10, n_distractors=4, seed=0)
    ids, samples = tokenize_samples(samples, tok)
    x, mask = pad_left(ids, tok.pad_token_id or 0)
    y = torch.tensor([s.label for s in samples])
    lab = label_token_ids(tok, "parity")
    with torch.no_grad():
        clean = prefill_many(model, x, mask, ("standard", "recurrent-full"), positions=(-1,), collect=False)
    want = {}
    for mode, r in clean.items():
        z = r.logits[:, 0, lab].double()
        ld = (z.gather(1, y[:, None]) - z.gather(1, (1 - y)[:, None]))[:, 0].numpy()
        want[mode] = (float(np.mean(np.where(ld > 0, 1.0, np.where(ld == 0, 0.5, 0.0)))), float(ld.mean()))

    # --- identity of the run
    assert rep["schema"] == SCHEMA and SCHEMA["name"] == "causal-report" and SCHEMA["version"] >= 2  # v2 fields below
    assert rep["model"]["file_sha256"] == hashlib.sha256((TRACK / "model.safetensors").read_bytes()).hexdigest()
    from models.fingerprint import config_hash, weights_hash
    from models.loading import load_model

    assert rep["model"]["weights_sha256"] == weights_hash(load_model(str(TRACK))[0])  # probes.json's definition
    assert rep["model"]["config_sha256"] == config_hash(load_model(str(TRACK))[0])
    assert (rep["model"]["n_layers"], rep["model"]["d_model"]) == (model.n_layers, model.d_model)
    cfg = rep["config"]
    assert (cfg["task"], cfg["mode"], cfg["distractors"], cfg["n_pairs"], cfg["max_positions"], cfg["n_classes"],
            cfg["n_boot"]) == ("parity", "recurrent-full", 4, 10, 4, 2, 300)  # the values in force
    assert rep["dataset"] == {"fingerprint": dataset_fingerprint(samples), "n_samples": 20, "n_pairs": 10,
                              "n_groups": len({s.group_id for s in samples}),
                              "tokens_min": min(map(len, ids)), "tokens_max": max(map(len, ids)),
                              "copies_across_groups": copies_across_groups(samples)}
    assert rep["dataset"]["copies_across_groups"] > 0  # parity at N = 4: 16 texts, recurring across groups
    assert rep["control"] == {"skipped": "disabled with --control-model none"}

    # --- the clean runs equal the engine's, per mode (this model: standard at chance, its recurrence solves it)
    assert set(res["clean"]) == {"standard", "recurrent-full"}
    for mode, (acc, ld_mean) in want.items():
        c = res["clean"][mode]
        assert c["n"] == 20 and c["accuracy"] == pytest.approx(acc, abs=1e-12), mode
        assert c["ld_mean"] == pytest.approx(ld_mean, rel=1e-9, abs=1e-12), mode
        assert c["ld_clean_mean"] == pytest.approx(ld_mean, rel=1e-9, abs=1e-12), mode
    assert want["recurrent-full"][0] > want["standard"][0]  # the two modes really differ: the check is not 0.5 = 0.5

    # --- every metric row: its n, and a 95% CI around each finite point estimate
    names = [r["name"] for r in res["interventions"] + res["subspace"]["rows"]]
    assert names == ["gate_bypass", "state_swap", "resample", "mean", "zero", "random_state", "gate_bypass_all",
                     "subspace_swap", "complement_swap", "random_subspace_swap", "class_means_swap"]
    rows = _metric_rows(res)
    # the quick budget (the default): at most 4 heatmap depths, evenly spaced, 0 and L kept
    assert res["layer_patching"]["depths"] == [0, 2, 4, 6] and cfg["budget"] == "quick"
    assert len(rows) == 2 + 11 + 11 + 4 + (model.n_layers + 1) + 2 * 4 * 4
    # the fed state's read direction (docs/results.md): the class-mean difference moves the answers, the
    # standardized probe's direction does not
    sub = {r["name"]: r for r in res["subspace"]["rows"]}
    assert sub["class_means_swap"]["follows_donor_rate"] >= 0.9 and sub["subspace_swap"]["follows_donor_rate"] <= 0.1
    assert res["subspace"]["class_means_rank"] == 1 and res["subspace"]["class_means_energy_fraction"] > 0.9
    for where, r in rows:
        assert 0 < r["n"] <= 20 and 0 < r["n_groups"] <= rep["dataset"]["n_groups"], where
        for k in ("ld_mean", "accuracy", "follows_donor_rate", "normalized_effect"):
            if r[k] is None:
                assert r[k + "_ci"] is None, (where, k)
                continue
            lo, hi = r[k + "_ci"]
            assert lo <= r[k] + 1e-9 and r[k] <= hi + 1e-9, (where, k, lo, r[k], hi)
            if k in ("accuracy", "follows_donor_rate"):
                assert 0 <= lo <= hi <= 1, (where, k)

    # --- invariants of the interventions
    by = {r["name"]: r for r in res["interventions"]}
    dose = res["dose"]["rows"]
    assert [d["alpha"] for d in dose] == [a / 10 for a in range(11)]
    # a = 0 feeds the model its own state (the clean run, bit for bit), a = 1 the donor's (= the state swap)
    assert dose[0]["normalized_effect"] == 0 and dose[0]["ld_mean"] == res["clean"]["recurrent-full"]["ld_mean"]
    assert dose[0]["changed_rate"] == 0 and dose[0]["changed"] == 0  # the identity patch changes no answer
    same = [k for k in dose[-1] if k not in ("alpha", "position")]
    assert len(same) == 17 and {k: dose[-1][k] for k in same} == {k: by["state_swap"][k] for k in same}
    # e_t fed at every position instead of the fused input is the standard prefill
    assert by["gate_bypass_all"]["accuracy"] == pytest.approx(want["standard"][0], abs=1e-12)
    assert by["gate_bypass_all"]["ld_mean"] == pytest.approx(want["standard"][1], abs=1e-4)
    sweep = res["position_sweep"]
    assert sweep["positions"] == [-4, -3, -2, -1] and len(sweep["first_diff"]) == 20
    # at or before the pair's first differing token the two states are equal: exactly no effect
    before = sweep["at_or_before_first_diff"]
    assert before["n"] == sum(r["n_at_or_before_first_diff"] for r in sweep["rows"]) > 0
    assert sweep["max_abs_ld_change_at_or_before_first_diff"] == 0.0 and before["follows_donor_rate"] == 0.0
    lp = res["layer_patching"]
    assert lp["offsets"] == [-4, -3, -2, -1] and lp["depths"] == [0, 2, 4, 6]
    # the donor's top residual at T gives the donor's logits: normalized effect 1 in both modes
    for mode in ("standard", "recurrent-full"):
        assert lp[mode]["normalized_effect"][-1][-1] == pytest.approx(1.0, abs=1e-4), mode

    assert rep["verdict"]["label"] and "parity" in rep["verdict"]["sentence"]
    assert "**Verdict.**" in (out / "causal_report.md").read_text()
    srcs = re.findall(r"<script[^>]*\bsrc=\"([^\"]+)\"", (out / "causal_report.html").read_text())
    assert srcs == ["plotly.min.js"] and (out / "plotly.min.js").is_file()  # offline: plotly.js beside the page


@pytest.mark.slow  # ~1 min on a loaded 2-core box; the default run keeps the fast CLI tests above
def test_cli_end_to_end_on_a_tiny_checkpoint(tmp_path, capsys):
    from interventions.run import main
    from models.configs import qwen3_config
    from models.full_bandwidth import FullBandwidthLM
    from tasks import build_tokenizer

    tok = build_tokenizer()
    cfg = qwen3_config(len(tok.get_vocab()), n_layers=2, d_model=32, initializer_range=0.1)
    ckpt = tmp_path / "tiny"
    FullBandwidthLM.from_config(cfg, seed=0).save_pretrained(ckpt, tok)
    ctrl = tmp_path / "ctrl"  # another model: the model under study is refused as its own control
    FullBandwidthLM.from_config(cfg, seed=1).save_pretrained(ctrl, tok)
    out = tmp_path / "fig"
    argv = ["--model", str(ckpt), "--task", "memory", "--n-pairs", "10", "--distractors", "4", "--out", str(out),
            "--control-model", str(ctrl), "--no-progress"]
    assert main(argv) == 0
    rep = json.loads((out / "causal_report.json").read_text())
    names = [r["name"] for r in rep["results"]["interventions"] + rep["results"]["subspace"]["rows"]]
    assert names == ["gate_bypass", "state_swap", "resample", "mean", "zero", "random_state", "gate_bypass_all",
                     "subspace_swap", "complement_swap", "random_subspace_swap", "class_means_swap"]
    assert len(rep["results"]["dose"]["rows"]) == 11 and rep["results"]["dose"]["rows"][0]["normalized_effect"] == 0
    lp = rep["results"]["layer_patching"]
    # every position of these short prompts (schema 2; schema 1 had T-1 and T only)
    assert len(lp["recurrent-1"]["normalized_effect"]) == 3 and lp["offsets"][-2:] == [-2, -1]
    assert len(lp["standard"]["normalized_effect"][0]) == len(lp["offsets"]) == rep["dataset"]["tokens_max"]
    assert rep["control"]["interventions"][0]["name"] == "state_swap"
    assert (rep["control"]["role"], rep["control"]["about"]) == ("control", None)  # no training log: no claim
    assert "memory" in rep["verdict"]["sentence"]
    html = (out / "causal_report.html").read_text()
    # offline: the page loads the one plotly.min.js of its folder, written with the report
    assert re.findall(r"<script[^>]*\bsrc=\"([^\"]+)\"", html) == ["plotly.min.js"]
    assert (out / "plotly.min.js").stat().st_size > 1_000_000
    assert "**Verdict.**" in (out / "causal_report.md").read_text()
    before = (out / "causal_report.json").read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and (out / "causal_report.json").read_text() == before


def _verdict_report(swap_ne_ci, bypass_acc_ci, clean_acc_ci=(1.0, 1.0)):
    row = lambda name, ne=0.0, ci=(0.0, 0.0), acc=1.0, acc_ci=(1.0, 1.0): {
        "name": name, "normalized_effect": ne, "normalized_effect_ci": list(ci), "follows_donor_rate": ne,
        "follows_donor_rate_ci": list(ci), "changed_rate": ne, "changed_rate_ci": list(ci), "n": 100, "n_groups": 50, "accuracy": acc, "accuracy_ci": list(acc_ci)}
    return {"config": {"task": "parity", "mode": "recurrent-full", "distractors": 64}, "model": {"name": "m"},
            "results": {"clean": {"recurrent-full": {"accuracy": clean_acc_ci[0], "accuracy_ci": list(clean_acc_ci),
                                                     "n": 100}},
                        "interventions": [row("state_swap", swap_ne_ci[0], swap_ne_ci),
                                          row("gate_bypass_all", acc=bypass_acc_ci[0], acc_ci=bypass_acc_ci)],
                        "subspace": {"rank": 1, "probe_heldout_accuracy": 1.0,
                                     "rows": [row(n) for n in ("subspace_swap", "complement_swap",
                                                               "random_subspace_swap")]}}}


def test_verdict_names_a_necessary_path_behind_an_unused_state():
    """A swap at T that decides nothing (or little) beside a bypass that drops accuracy to chance: the verdict
    keeps its label for the swap and says that the model depends on its fused inputs; a bypass within 0.1 of the
    clean accuracy adds nothing, and a used state needs no such clause."""
    from interventions.report import verdict

    label, s = verdict(_verdict_report((0.0, 0.0), (0.5, 0.5)))
    assert label == "not detectably used" and "depends on its fused inputs" in s
    label, s = verdict(_verdict_report((0.0, 0.0), (1.0, 1.0)))
    assert label == "not detectably used" and "depends" not in s
    label, s = verdict(_verdict_report((0.3, 0.4), (0.5, 0.5)))
    assert label == "partly used" and "depends on its fused inputs" in s
    label, s = verdict(_verdict_report((0.0, 0.0), (0.85, 0.91), clean_acc_ci=(0.95, 1.0)))  # within the margin
    assert "depends" not in s
    label, s = verdict(_verdict_report((0.9, 0.95), (0.5, 0.5)))
    assert label == "causally used" and "depends" not in s


def test_line_bins_double_and_cover_every_line():
    from interventions.suite import line_bins

    assert line_bins(1) == [0] and line_bins(2) == [0, 1] and line_bins(5) == [0, 1, 2, 4]
    for n in range(1, 70):
        lows = line_bins(n)
        spans = [range(lo, max(1, 2 * lo)) for lo in lows]
        assert sorted(i for s in spans for i in s if i < n) == list(range(n))


def test_an_empty_summary_has_the_keys_of_a_full_one():
    """Splits of a report can select no rows; their <metrics> keep every key (n = 0, flips 0, the rest None)."""
    from interventions.suite import Suite

    s = Suite.__new__(Suite)  # summary() needs only the bootstrap settings
    s.n_boot, s.seed = 20, 0
    a = {"ld": np.array([1.0, -2.0, 0.5, -1.0, 2.0, -0.5]), "ldc": np.full(6, 2.0), "ref": np.full(6, -2.0),
         "y": np.array([0, 1] * 3), "r": np.array([1, 0] * 3), "groups": np.repeat(np.arange(3), 2)}
    full, empty = s.summary(a), s.summary(a, np.zeros(6, bool))
    assert full["n"] == 6 and empty["n"] == 0 and empty["follows_donor"] == 0.0
    assert empty.keys() == full.keys()
