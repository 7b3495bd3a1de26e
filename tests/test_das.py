"""Distributed alignment search (interventions.das): a planted subspace it must recover, a random direction that must
not move the answer, and the consistency of k = d with the whole swap through the real patching routine."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from common.errors import UserError
from interventions.core import CausalContext
from interventions.das import DasConfig, RotatedSubspace, das_battery, exact_interchange, fit_rotation
from interventions.subspace import fold_subspaces
from interventions.suite import Suite
from stats.erasure import grouped_folds
from stats.linear import ProbeConfig

from hand_built import make_state_only_model, state_batch

D = 16


def planted(n_pairs=60, seed=0):
    """States whose label lives along u only (label-independent noise that a pair shares, as a pair shares its
    context, in every other direction and much larger than the label's gap) and a 'model' that reads u . h. Returns (H [B, D], labels, pair, groups, u, run_of)."""
    g = torch.Generator().manual_seed(seed)
    Q = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))[0]
    u = Q[:, 0]
    y = torch.tensor([0, 1] * n_pairs)
    s = 2.0 * y.double() - 1.0  # [-1, +1]
    noise = torch.randn(n_pairs, D, generator=g, dtype=torch.float64).repeat_interleave(2, 0)  # shared by a pair
    noise = noise - (noise @ u)[:, None] * u  # the noise (the context a pair shares) lies outside span(u)
    H = (s[:, None] * 0.5 * u + 2.0 * noise).float()
    pair = torch.arange(2 * n_pairs) ^ 1
    groups = np.repeat(np.arange(n_pairs), 2)
    W = torch.zeros(8, D)  # a vocabulary of 8 words, label words 2 and 5
    W[5] = 4.0 * u.float()
    W[2] = -4.0 * u.float()

    def run_of(base):
        return lambda edit: edit(base) @ W.T  # logits [B, 8]: the answer is the sign of u . h

    return H, y, pair, groups, u, run_of


def test_the_probe_subspace_is_fitted_on_the_real_rows_alone():
    """At a position some prompts do not reach, the site's rows there are padding: the probe (as LEACE) is fitted
    on the real rows only. Padding rows whose label reads the other way along u left the probe no direction."""
    H, y, pair, groups, u, _ = planted()
    real = np.ones(len(y), bool)
    real[: len(y) // 2] = False  # the first half: padding
    pad = ~torch.as_tensor(real)
    Hp = H.clone()
    Hp[pad] = H[pad] - 2 * ((H[pad].double() @ u)[:, None] * u).float()  # the label reversed along u
    masked = fold_subspaces(Hp, y.numpy(), groups, 1, ProbeConfig(), fit_mask=real)
    assert all(abs(float(f.U[:, 0].double() @ u)) >= 0.95 for f in masked)
    with pytest.raises(UserError, match="found no direction"):  # what fitting on every row did
        fold_subspaces(Hp, y.numpy(), groups, 1, ProbeConfig())


def test_das_recovers_a_planted_direction_and_a_random_one_moves_nothing():
    H, y, pair, groups, u, run_of = planted()
    run = run_of(H)
    cfg = DasConfig(ranks=(1,), steps=200, lr=0.05, seed=0)
    folds = grouped_folds(y.numpy(), groups, ProbeConfig())
    probe = fold_subspaces(H, y.numpy(), groups, 1, ProbeConfig())
    out = das_battery(run, H, H[pair], y[pair], (2, 5), groups, folds, np.ones(len(y), bool), cfg, probe_folds=probe,
                      n_boot=200)
    row = out["rows"][0]
    assert row["iia"] == 1.0 and row["train_iia"] == 1.0
    assert row["random_iia"] == 0.0  # a random direction moves u . h by cos^2 ~ 1/D of the gap: no answer follows
    assert out["probe"]["iia"] == 1.0 and out["rows"][0]["cos_probe"][0] >= 0.9  # the probe finds u here too
    # the recovered direction is u (each fold's rotation)
    for f, (tr, _) in enumerate(folds):
        rot, _ = fit_rotation(run, H[pair], y[pair], tr, (2, 5), 1, cfg, seed=f)
        assert abs(float(rot.exact_basis()[:, 0] @ u)) >= 0.99


def test_rotation_stays_orthonormal_and_the_interchange_is_pyvenes_formula():
    rot = RotatedSubspace(D, 3, seed=1)
    R = rot.basis.detach()
    assert torch.allclose(R.T @ R, torch.eye(3), atol=1e-5)
    g = torch.Generator().manual_seed(0)
    base, src = torch.randn(5, D, generator=g), torch.randn(5, D, generator=g)
    want = base + ((src - base) @ R) @ R.T  # golden: base + (source - base) R R^T
    assert torch.allclose(rot(base, src), want, atol=1e-5)
    full = RotatedSubspace(D, D, seed=2)
    assert torch.equal(exact_interchange(src, full.exact_basis())(base), src) or \
        (exact_interchange(src, full.exact_basis())(base) - src).abs().max() <= 1e-6
    with pytest.raises(UserError):
        RotatedSubspace(D, D + 1)
    with pytest.raises(UserError):
        DasConfig(ranks=(0,))


def test_k_equal_d_is_the_whole_state_swap_on_the_same_rows(tiny_model):
    from test_interventions import _random_batch

    batch = _random_batch(tiny_model, n_pairs=10, T=7, seed=3)
    ctx = CausalContext(tiny_model, batch, modes=("standard", "recurrent-1"))
    s = Suite(ctx, n_boot=50)
    out = s.das(DasConfig(ranks=(1, tiny_model.d_model), steps=5), rank=1)
    full = out["rows"][-1]
    assert full["k"] == tiny_model.d_model
    assert full["iia"] == out["full_swap"]["iia"]  # the span of every direction is the whole swap
    assert full["random_iia"] == out["full_swap"]["iia"]
    swap = ctx.swap_state(batch.pair)
    from interventions.metrics import decisions

    _, follow = decisions(swap, batch.labels[batch.pair], batch.labels[batch.pair], batch.label_ids)
    assert out["full_swap"]["iia"] == pytest.approx(float(follow.mean()))
    assert out["site"]["description"] == "h_{T-1}"  # the state entering at T
    ctx_full = CausalContext(tiny_model, batch, modes=("standard", "recurrent-full"))
    at = Suite(ctx_full, n_boot=20).das(DasConfig(ranks=(1,), steps=2), pos=-3, rank=1)
    assert at["site"]["description"] == "h_{T-3}" and at["site"]["position_name"] == "T-2"


def test_das_on_the_hand_built_state_model_finds_the_label_plane(make_tiny_config):
    model = make_state_only_model(make_tiny_config("qwen3"))
    batch = state_batch(20)
    ctx = CausalContext(model, batch, modes=("standard", "recurrent-1"))
    out = Suite(ctx, n_boot=50).das(DasConfig(ranks=(1,), steps=60, lr=0.05), rank=1)
    assert out["rows"][0]["iia"] == 1.0 and out["full_swap"]["iia"] == 1.0
    assert out["rows"][0]["random_iia"] == 0.0  # the label plane span(e_0, e_1) is 2 of D dimensions
    assert out["site"]["position_name"] == "T"


def test_das_cli_flags_are_refused_with_one_line(tmp_path):
    from interventions.run import _parse_das, _parse_das_site

    from engine.modes import parse_mode

    rec, std, loop2 = parse_mode("recurrent-1"), parse_mode("standard"), parse_mode("loop-2")
    assert _parse_das("1,2,D", 8) == (1, 2, 8)
    for bad in ("0", "x", "9", "", "1_0"):  # '1_0': Python's int() reads 10
        with pytest.raises(UserError) as e:
            _parse_das(bad, 8)
        assert "\n" not in str(e.value)
    assert _parse_das_site(None, rec, 6) == ("state", 0, -1)
    assert _parse_das_site(None, std, 6) == ("resid", 3, -1)
    assert _parse_das_site(None, loop2, 8) == ("resid", 4, -1)  # L of the mode's own stack, as given
    assert _parse_das_site("resid:2@T-3", rec, 6) == ("resid", 2, -4)
    # '@' and no position: not T; two positions: DAS searches one (the second was dropped silently)
    for bad in ("resid:-1", "state:1", "foo", "resid:x", "state@", "resid:2@", "state@T-3,T-5", "resid:1_0"):
        with pytest.raises(UserError):
            _parse_das_site(bad, rec, 6)
    from interventions.run import build_parser

    for lr in ("nan", "0", "-1", "11"):  # refused while parsing, before any model loads
        with pytest.raises(UserError, match="--das-lr"):
            build_parser().parse_args(["--das", "1", "--das-lr", lr])
    with pytest.raises(UserError, match="standard feeds no state"):
        _parse_das_site("state", std, 6)
    with pytest.raises(UserError, match="loop-2 feeds no state"):  # the mode by its name (it said "standard")
        _parse_das_site("state", loop2, 6)


def test_cli_writes_the_iia_table_and_the_attribution_heatmap(tiny_ckpt, tmp_path, capsys):
    import json

    from interventions.run import main

    out = tmp_path / "fig"
    args = ["--model", str(tiny_ckpt), "--task", "parity", "--mode", "recurrent-full", "--n-pairs", "10",
            "--distractors", "6", "--out", str(out), "--control-model", "none", "--no-progress", "--max-positions", "3",
            "--das", "1,D", "--das-steps", "3", "--attribution"]
    assert main(args) == 0
    rep = json.loads((out / "causal_report.json").read_text())
    das, at = rep["results"]["das"], rep["results"]["attribution"]
    d = rep["model"]["d_model"]
    assert [r["k"] for r in das["rows"]] == [1, d] and das["rows"][-1]["iia"] == das["full_swap"]["iia"]
    assert rep["config"]["das"]["site"] == ["state", 0, -1] and rep["config"]["attribution"] is True
    assert at["sites"][0] == "state" and len(at["positions"]) == 3 and "vs_position_sweep" in at
    md = (out / "causal_report.md").read_text()
    assert "## Distributed alignment search" in md and "## Attribution patching" in md
    page = (out / "causal_report.html").read_text()
    assert "DAS: IIA vs rank k" in page and "Attribution patching" in page
    capsys.readouterr()  # the run's own lines (a warning among them: parity N = 8 has texts in two groups)
    # bad combinations: one line each, nothing written
    # (a flag that would change nothing is refused, not dropped: DAS settings without --das, a residual sweep depth
    # under a mode that sweeps its fed state)
    for bad, msg in ((["--attribution-ig", "4"], "add --attribution"), (["--das", "0"], "must be in 1.."),
                     (["--mode", "fused-2", "--attribution"], "standard, loop-R and recurrent-K"),
                     (["--das-steps", "3", "--das-lr", "0.1"], "--das-steps, --das-lr set how --das searches"),
                     (["--das-site", "resid:1"], "add --das RANKS"), (["--sweep-depth", "1"], "sweeps its fed state")):
        rest, skip = [], 0
        for a in args:  # the arguments without --das RANKS, --das-steps N and --attribution
            if skip or a in ("--das", "--das-steps", "--attribution"):
                skip = 0 if skip else int(a != "--attribution")
                continue
            rest.append(a)
        with pytest.raises(SystemExit) as e:
            main(rest[:rest.index("--out") + 1] + [str(tmp_path / "bad")] + rest[rest.index("--out") + 2:] + bad)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and msg in err and len(err.splitlines()) == 1, (bad, err)
        assert not (tmp_path / "bad" / "causal_report.json").exists()


def test_a_fit_depends_on_its_seed_only_and_leaves_the_model_without_gradients(tiny_model):
    from test_interventions import _random_batch

    H, y, pair, groups, u, run_of = planted(n_pairs=20)
    cfg = DasConfig(ranks=(2,), steps=15, lr=0.05)
    bases = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)  # the parametrization completes W from the global generator: not used here
        rot, _ = fit_rotation(run_of(H), H[pair], y[pair], np.arange(20), (2, 5), 2, cfg, seed=7)
        bases.append(rot.exact_basis())
    assert torch.equal(bases[0], bases[1])
    batch = _random_batch(tiny_model, n_pairs=10, T=7, seed=3)
    ctx = CausalContext(tiny_model, batch, modes=("standard", "recurrent-1"))
    tiny_model.zero_grad(set_to_none=True)
    Suite(ctx, n_boot=20).das(DasConfig(ranks=(1,), steps=3), rank=1)
    assert all(p.grad is None for p in tiny_model.parameters())


def test_das_is_refused_where_the_run_has_no_gradient(tiny_ckpt, tmp_path, capsys):
    from interventions.run import main

    with pytest.raises(SystemExit):
        main(["--model", str(tiny_ckpt), "--task", "parity", "--mode", "recirc-1:0:0.5", "--n-pairs", "10",
              "--distractors", "6", "--out", str(tmp_path / "r"), "--control-model", "none", "--no-progress",
              "--das", "1"])
    err = capsys.readouterr().err.strip()
    assert "without gradient" in err and len(err.splitlines()) == 1


def test_a_fit_that_is_still_learning_says_so():
    """At a few steps the rotation has not converged: the row counts its folds as still falling and the report
    warns that the IIA is a lower bound; a converged fit does not."""
    from interventions.report import _das_markdown

    H, y, pair, groups, u, run_of = planted()
    folds = grouped_folds(y.numpy(), groups, ProbeConfig())
    ok = np.ones(len(y), bool)
    short = das_battery(run_of(H), H, H[pair], y[pair], (2, 5), groups, folds, ok,
                        DasConfig(ranks=(1,), steps=10, lr=0.005, seed=0), n_boot=50)
    long = das_battery(run_of(H), H, H[pair], y[pair], (2, 5), groups, folds, ok,
                       DasConfig(ranks=(1,), steps=300, lr=0.05, seed=0), n_boot=50)
    assert short["rows"][0]["still_falling"] >= len(folds) - 1 and long["rows"][0]["still_falling"] == 0
    doc = {"site": {"description": "h_{T-1}", "position_name": "T"}, "mode": "recurrent-1", "n_folds": len(folds),
           "target": "the donor's label", "settings": {"parametrization": "orthogonal", "steps": 10, "lr": 0.005}}
    assert "**Not converged** at k = 1" in "\n".join(_das_markdown({"das": {**doc, **short}}))
    assert "Not converged" not in "\n".join(_das_markdown({"das": {**doc, **long}}))
