"""Interventions in every prefill mode at every position, against hand-written golden references on tiny models.

    * recurrent-full: a patch at position t against a naive recurrence (the whole prefix recomputed from scratch
      for every position, the patched state / residual substituted at t);
    * fused-n: a patch at pass k, position t against a hand-written Jacobi loop;
    * identity patches give the clean logits bit for bit in every mode; the full-prompt gate bypass is the
      standard prefill;
    * a state swap at or before the pair's first differing token changes nothing, exactly;
    * K-class labels (3 label words): LD against the donor's label, flips = argmax follows the donor;
    * the CLI end to end in recurrent-full, fused-4 and recurrent-4 (and shell_game, 3 classes).
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from interventions.core import Batch, CausalContext, Patch
from interventions.metrics import decisions, label_ld
from interventions.suite import Suite
from models.full_bandwidth import decoder_layers


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread for these many small forwards: on a busy 2-core box two threads contend with the other
    processes (measured 10 s vs 0.2 s for one recurrent-full prefill); restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _batch(model, n_pairs=3, T=7, seed=0, pad=True, shared_prefix=None, label_ids=(10, 11)):
    g = torch.Generator().manual_seed(seed)
    V = model.config.vocab_size
    ids = torch.randint(2, V, (2 * n_pairs, T), generator=g)
    mask = torch.ones_like(ids)
    if pad:
        mask[0, :2] = 0
        mask[1, :2] = 0
    if shared_prefix is not None:  # pair members identical up to column shared_prefix - 1
        ids[1::2, :shared_prefix] = ids[0::2, :shared_prefix]
        ids[1::2, shared_prefix] = (ids[0::2, shared_prefix] - 2 + 1) % (V - 2) + 2
    labels = torch.tensor([0, 1] * n_pairs)
    return Batch(ids, mask, labels, torch.arange(2 * n_pairs) ^ 1, np.repeat(np.arange(n_pairs), 2), label_ids)


def _resid_hook(model, depth, col, value):
    """A hand-written hook putting `value` [B, D] into the residual stream at (depth, col) of every call."""
    layers = decoder_layers(model.lm)

    def put(h):
        if h.shape[1] <= col:
            return h
        h = h.clone()
        h[:, col] = value
        return h

    if depth == 0:
        return layers[0].register_forward_pre_hook(
            lambda m, a, kw: ((put(a[0]),) + tuple(a[1:]), kw) if a else
            (a, {**kw, "hidden_states": put(kw["hidden_states"])}), with_kwargs=True)
    return layers[depth - 1].register_forward_hook(
        lambda m, a, o: (put(o[0]),) + tuple(o[1:]) if isinstance(o, tuple) else put(o))


@torch.no_grad()
def _naive_recurrence(model, ids, mask, state_patch=None, resid_patch=None, unfuse=None):
    """recurrent-full by brute force: for every column t, recompute the whole prefix 0..t (no cache) with the
    states found so far; column t is fused with the top state of t-1 where t-1 and t are real tokens.
    state_patch = (col, value): the state entering the fusion at col. resid_patch = (depth, col, value).
    unfuse = col: the plain embedding enters block 0 at col (the gate bypass there)."""
    B, T = ids.shape
    states = torch.zeros(B, T, model.d_model)
    fuse = torch.zeros(B, T, dtype=torch.bool)
    fuse[:, 1:] = mask[:, :-1].bool() & mask[:, 1:].bool()
    if unfuse is not None:
        fuse[:, unfuse] = False
    handle = _resid_hook(model, *resid_patch) if resid_patch else None
    try:
        for t in range(T):
            out = model(ids[:, :t + 1], mask[:, :t + 1], state=states[:, :t + 1], fuse_mask=fuse[:, :t + 1])
            if t + 1 < T:
                states[:, t + 1] = out.top[:, t]
                if state_patch is not None and state_patch[0] == t + 1:
                    states[:, t + 1] = state_patch[1]
    finally:
        if handle is not None:
            handle.remove()
    return out.logits[:, -1]


def test_recurrent_full_patch_matches_a_naive_recurrence(tiny_model):
    batch = _batch(tiny_model)
    ctx = CausalContext(tiny_model, batch, modes=("standard", "recurrent-full"))
    ids, mask, T = batch.input_ids, batch.attention_mask, batch.input_ids.shape[1]
    clean = _naive_recurrence(tiny_model, ids, mask)
    assert torch.allclose(ctx.clean["recurrent-full"].logits, clean, atol=1e-5)
    for pos in (-T + 3, -3, -1):
        donor = ctx.state("recurrent-full", pos)[batch.pair]
        got = ctx.patch_state(donor, "recurrent-full", pos)
        ref = _naive_recurrence(tiny_model, ids, mask, state_patch=(T + pos, donor))
        assert torch.allclose(got, ref, atol=1e-5), pos
        assert (got - ctx.clean["recurrent-full"].logits).abs().max() > 1e-4  # the patch propagates to T
    for depth in (0, tiny_model.n_layers):
        pos = -4
        value = ctx.resid("recurrent-full")[:, T + pos, depth][batch.pair]
        got = ctx.patch_resid("recurrent-full", depth, pos, batch.pair)
        ref = _naive_recurrence(tiny_model, ids, mask, resid_patch=(depth, T + pos, value))
        assert torch.allclose(got, ref, atol=1e-5), depth
    for pos in (-5, -1):  # fused site: e_t instead of the fusion output at t
        got = ctx.gate_bypass("recurrent-full", pos)
        ref = _naive_recurrence(tiny_model, ids, mask, unfuse=T + pos)
        assert torch.allclose(got, ref, atol=1e-5), pos


def test_fused_patch_at_pass_k_matches_a_hand_written_jacobi_loop(tiny_model):
    batch = _batch(tiny_model)
    n = 3
    ctx = CausalContext(tiny_model, batch, modes=("standard", f"fused-{n}"))
    ids, mask, T = batch.input_ids, batch.attention_mask, batch.input_ids.shape[1]
    fuse = torch.zeros_like(mask, dtype=torch.bool)
    fuse[:, 1:] = mask[:, :-1].bool() & mask[:, 1:].bool()

    @torch.no_grad()
    def jacobi(k_patch=None, t_patch=None, value=None):
        top = tiny_model(ids, mask).top
        tops = [top]
        for k in range(1, n + 1):
            state = torch.zeros_like(top)
            state[:, 1:] = top[:, :-1]
            if k == k_patch:
                state[:, t_patch] = value
            out = tiny_model(ids, mask, state=state, fuse_mask=fuse)
            top = out.top
            tops.append(top)
        return out.logits[:, -1], tops

    clean, tops = jacobi()
    assert torch.equal(ctx.clean[f"fused-{n}"].logits, clean)
    for k in (1, 2, n):
        for pos in (-5, -1):
            donor = tops[k - 1][:, T + pos - 1][batch.pair]
            assert torch.equal(ctx.state(f"fused-{n}", pos, k)[batch.pair], donor)
            got = ctx.run(f"fused-{n}", [Patch("state", donor, pos=pos, pass_=k)]).logits
            ref, _ = jacobi(k, T + pos, donor)
            assert torch.allclose(got, ref, atol=1e-6), (k, pos)
            # pass k's top state at T is read by no later pass (they fuse the state of t-1): no effect
            assert ((got - clean).abs().max() > 1e-4) == (pos != -1 or k == n), (k, pos)


@pytest.mark.parametrize("mode", ["standard", "recurrent-1", "recurrent-3", "recurrent-full", "fused-1", "fused-3"])
def test_identity_patches_are_clean_bit_for_bit_in_every_mode(tiny_model, mode):
    batch = _batch(tiny_model)
    ctx = CausalContext(tiny_model, batch, modes=("standard", mode))  # also checks clean == the engine
    me = torch.arange(batch.size)
    clean = ctx.clean[mode].logits
    T = batch.input_ids.shape[1]
    for pos in range(-T, 0):
        for d in range(tiny_model.n_layers + 1):
            assert torch.equal(ctx.patch_resid(mode, d, pos, me), clean), (pos, d)
    for pos in ctx.fused_positions(mode):
        assert torch.equal(ctx.swap_state(me, mode, pos), clean), pos
    if mode != "standard":
        assert ctx.fused_positions(mode)[-1] == -1
        assert (ctx.swap_state(batch.pair, mode, -1) - clean).abs().max() > 1e-4


@pytest.mark.parametrize("mode", ["recurrent-full", "fused-2"])
def test_full_prompt_gate_bypass_is_the_standard_prefill(tiny_model, mode):
    batch = _batch(tiny_model)
    ctx = CausalContext(tiny_model, batch, modes=("standard", mode))
    std = ctx.clean["standard"].logits
    assert torch.allclose(ctx.gate_bypass(mode, "all"), std, atol=1e-5)
    assert (ctx.clean[mode].logits - std).abs().max() > 1e-3  # the mode itself does differ from standard


def test_recurrent_k_fuses_only_its_last_k_positions(tiny_model):
    from common.errors import UserError

    batch = _batch(tiny_model)
    ctx = CausalContext(tiny_model, batch, modes=("standard", "recurrent-3"))
    assert ctx.fused_positions("recurrent-3") == [-3, -2, -1]
    with pytest.raises(UserError, match="no fed state at T-3"):
        ctx.swap_state(batch.pair, "recurrent-3", -4)
    with pytest.raises(UserError, match="fuses only"):
        ctx.patch_state(ctx.h_prev, "recurrent-3", -4)
    with pytest.raises(UserError, match="only resid"):
        ctx.run("standard", [Patch("state", ctx.h_prev)])


def test_state_swap_before_the_first_differing_token_has_exactly_zero_effect(tiny_model):
    c = 4  # pairs share columns 0..3 and differ from column 4 on
    batch = _batch(tiny_model, T=9, pad=False, shared_prefix=c)
    T = batch.input_ids.shape[1]
    assert (batch.first_diff == c - T).all()
    ctx = CausalContext(tiny_model, batch, modes=("standard", "recurrent-full"))
    clean = ctx.clean["recurrent-full"].logits
    for pos in range(1 - T, c - T + 1):  # the state at t is top(t-1): identical in both rows for t <= c
        assert torch.equal(ctx.swap_state(batch.pair, "recurrent-full", pos), clean), pos
    assert (ctx.swap_state(batch.pair, "recurrent-full", c - T + 1) - clean).abs().max() > 1e-4
    sweep = Suite(ctx, n_boot=50).position_sweep()
    assert sweep["max_abs_ld_change_at_or_before_first_diff"] == 0.0
    assert sweep["positions"] == list(range(1 - T, 0))
    by = {r["relative"]: r for r in sweep["by_first_diff"]}
    assert all(by[r]["normalized_effect"] == 0.0 for r in by if r <= 0)
    assert sweep["at_or_before_first_diff"]["normalized_effect"] == 0.0
    assert [r["n_at_or_before_first_diff"] for r in sweep["rows"]] == [batch.size if p <= c - T else 0
                                                                      for p in sweep["positions"]]


def test_k_class_labels_ld_against_the_donor_and_argmax_flips(tiny_model):
    from common.errors import UserError

    logits = torch.zeros(3, 20)
    logits[:, [10, 11, 12]] = torch.tensor([[3.0, 1.0, 2.0], [0.0, 5.0, 5.0], [1.0, 0.0, 4.0]])
    y, other = torch.tensor([0, 1, 2]), torch.tensor([2, 0, 1])
    assert label_ld(logits, y, (10, 11, 12), other).tolist() == [1.0, 5.0, 4.0]
    correct, follow = decisions(logits, y, other, (10, 11, 12))
    assert correct.tolist() == [1.0, 0.5, 1.0] and follow.tolist() == [0.0, 0.0, 0.0]
    # a 3-class batch: pairs need different (not opposite) labels
    ids = torch.randint(2, 50, (4, 6), generator=torch.Generator().manual_seed(0))
    b = Batch(ids, torch.ones_like(ids), torch.tensor([0, 2, 1, 2]), torch.tensor([1, 0, 3, 2]),
              np.array([0, 0, 1, 1]), (10, 11, 12))
    assert b.n_classes == 3
    with pytest.raises(UserError, match="different label"):
        Batch(ids, torch.ones_like(ids), torch.tensor([0, 0, 1, 2]), torch.tensor([1, 0, 3, 2]),
              np.array([0, 0, 1, 1]), (10, 11, 12))
    ctx = CausalContext(tiny_model, b, modes=("standard", "recurrent-1"))
    s = Suite(ctx, n_boot=50)
    m = s.metrics(ctx.swap_state(b.pair))
    logits = ctx.swap_state(b.pair)
    z = logits[:, [10, 11, 12]]
    follow = (z.argmax(1) == b.labels[b.pair]).double().mean().item()  # no ties with random weights
    assert m["follows_donor_rate"] == pytest.approx(follow)


# ----- CLI end to end ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from models.configs import qwen3_config
    from models.full_bandwidth import FullBandwidthLM
    from tasks import build_tokenizer

    tok = build_tokenizer()
    cfg = qwen3_config(len(tok.get_vocab()), n_layers=2, d_model=32, initializer_range=0.1)
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    FullBandwidthLM.from_config(cfg, seed=0).save_pretrained(path, tok)
    return path


@pytest.mark.parametrize("mode, task, n", [("recurrent-full", "completion", "0"), ("fused-4", "completion", "0"),
                                           ("recurrent-4", "completion", "0"), ("recurrent-full", "shell_game", "3")])
def test_cli_end_to_end_in_every_mode(tiny_ckpt, tmp_path, mode, task, n):
    from interventions.run import main

    out = tmp_path / "fig"
    cap = ["--max-positions", "6"] if task == "shell_game" else []  # the capped sweep / heatmap, and faster
    assert main(["--model", str(tiny_ckpt), "--task", task, "--mode", mode, "--n-pairs", "10",
                 "--distractors", n, "--out", str(out), "--control-model", "none", "--no-progress", "--budget", "full",
                 *cap]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["causal_report.html", "causal_report.json",
                                                     "causal_report.md", "plotly.min.js"]
    rep = json.loads((out / "causal_report.json").read_text())
    assert rep["schema"] == {"name": "causal-report", "version": 8}  # interventions.report.SCHEMA
    assert rep["config"]["mode"] == mode and rep["config"]["n_classes"] == (3 if task == "shell_game" else 2)
    res = rep["results"]
    # default subspace rank K - 1: two orthonormal directions for the 3-way label, one for binary tasks
    K = rep["config"]["n_classes"]
    assert rep["config"]["subspace_rank"] == res["subspace"]["rank"] == K - 1
    T = rep["dataset"]["tokens_max"]
    P = 6 if cap else T  # default: every position of these short prompts
    assert res["layer_patching"]["offsets"] == list(range(-P, 0))
    for m in ("standard", mode):
        grid = res["layer_patching"][m]["normalized_effect"]
        assert len(grid) == 3 and all(len(row) == P for row in grid)
    sw = res["position_sweep"]
    k = {"recurrent-4": 4}.get(mode, min(P, T - 1))
    assert sw["positions"] == list(range(-k, 0)) and len(sw["rows"]) == k
    assert sw["max_abs_ld_change_at_or_before_first_diff"] in (0.0, None)
    assert {r["name"] for r in res["interventions"]} >= {"state_swap", "gate_bypass", "gate_bypass_all"}
    assert all(r["mode"] == mode for r in res["interventions"])
    if task == "shell_game":
        assert len(sw["diff_line"]) == 20
        # every swap before the differing line has exactly zero effect
        assert all(r["normalized_effect"] in (0.0, None) for r in sw["by_line"] if r["relative_line"] < 0)
        assert any(r["relative_line"] == 0 for r in sw["by_line"])
        fl = sw["first_line_after"]  # every row, although the sweep covers only the last 6 positions
        assert fl["n"] == 20 and fl["n_positions"] >= 1 and 0.0 <= fl["follows_donor_rate"] <= 1.0
        # both splits partition the rows and their flips; each pair's answers differ
        for split in ("by_diff_line", "by_answers"):
            assert sum(r["n"] for r in fl[split]) == fl["n"]
            assert sum(r["follows_donor"] or 0 for r in fl[split]) == fl["follows_donor"]
        assert all(r["own"] != r["donor"] for r in fl["by_answers"])
        # every row's differing line (the prompt's line 0 holds the start, so line = diff_line + 1) in its bin
        counts = {tuple(r["lines"]): r["n"] for r in fl["by_diff_line"]}
        want = {b: sum(b[0] <= d + 1 <= b[1] for d in sw["diff_line"]) for b in counts}
        assert counts == want
    md = (out / "causal_report.md").read_text()
    assert "## Position sweep" in md and "## Layer patching" in md
    html = (out / "causal_report.html").read_text()
    assert "State swap at position t" in html and "depth x position" in html


def test_first_line_after_does_not_depend_on_the_sweep_window(tiny_ckpt, tmp_path):
    """The per-row swap after the differing line reuses the sweep's runs where it has them and runs the rest:
    the same numbers whether the sweep covers every position or only the last two."""
    from interventions.run import main

    got = []
    for cap in ("0", "2"):
        out = tmp_path / cap
        assert main(["--model", str(tiny_ckpt), "--task", "shell_game", "--mode", "recurrent-full", "--n-pairs", "10",
                     "--distractors", "3", "--out", str(out), "--control-model", "none", "--no-progress",
                     "--max-positions", cap, "--n-boot", "50"]) == 0
        got.append(json.loads((out / "causal_report.json").read_text())["results"]["position_sweep"]["first_line_after"])
    assert got[0] == got[1] and got[0]["n"] == 20
    md = (tmp_path / "2" / "causal_report.md").read_text()
    assert "line after its first differing token's line" in md
    # K = 3: accuracy is the argmax over the label words, not the sign of one logit difference
    assert "accuracy = the true word is the argmax of the 3 label words" in md and "accuracy = LD > 0" not in md


def test_cli_standard_mode_has_no_state_interventions(tiny_ckpt, tmp_path):
    from interventions.run import main

    out = tmp_path / "fig"
    assert main(["--model", str(tiny_ckpt), "--task", "completion", "--mode", "fused-0", "--n-pairs", "10",
                 "--distractors", "0", "--out", str(out), "--control-model", "none", "--no-progress",
                 "--max-positions", "0"]) == 0
    rep = json.loads((out / "causal_report.json").read_text())
    res = rep["results"]
    assert rep["config"]["mode"] == "standard" and res["interventions"] == [] and res["subspace"] is None
    assert res["fed_state"] == "not applicable (no feedback): standard prefill feeds no state"
    assert res["layer_patching"]["modes"] == ["standard"]
    # what needs no fed state runs: the residual sweep at the middle depth, exactly zero before the first
    # differing token (the pair's residuals are equal there), and mean ablation at every depth
    sw = res["position_sweep"]
    assert sw["site"] == "resid" and sw["depth"] == 1 == rep["config"]["sweep_depth"]
    assert sw["max_abs_ld_change_at_or_before_first_diff"] == 0.0 and sw["at_or_before_first_diff"]["n"] > 0
    assert [r["depth"] for r in res["resid_mean_ablation"]["rows"]] == [0, 1, 2]
    assert rep["verdict"]["label"] == "not applicable (no feedback)"


@pytest.mark.parametrize("task", ["parity", "shell_game"])
def test_first_differing_token_lies_in_the_samples_diff_line(task):
    from tasks import build_tokenizer, make_dataset

    n = 5
    batch = Batch.from_samples(make_dataset(task, 12, n, 0), build_tokenizer(), task)
    T = batch.input_ids.shape[1]
    rows = np.arange(batch.size)
    assert (batch.line_index[:, -1] == n + 1).all()  # header line 0, update lines 1..N, the query line N+1
    # the pair's first differing token is in update line diff_line (line diff_line + 1)
    assert (batch.line_index[rows, batch.first_diff + T] == batch.diff_line + 1).all()


def test_probes_fit_probe_labels_and_metrics_keep_the_answer(tiny_model):
    # A many-class task (one class per word): the probes fit the pair role, the metrics score the answer.
    import dataclasses

    b = _batch(tiny_model, n_pairs=12, label_ids=tuple(range(10, 22)))
    labels = torch.tensor([(i // 2) % 12 if i % 2 == 0 else ((i // 2) + 5) % 12 for i in range(24)])
    roles = torch.tensor([0, 1] * 12)
    many = dataclasses.replace(b, labels=labels, probe_labels=roles)
    assert torch.equal(many.probe_labels, roles) and many.n_classes == 12
    assert dataclasses.replace(b, labels=labels).probe_labels is not None  # default: the labels themselves
    s = Suite(CausalContext(tiny_model, many, modes=("standard", "recurrent-1")), n_boot=20)
    sub = s.subspace(rank=1)
    assert sub["rank"] == 1 and len(sub["rows"]) == 4
    with pytest.raises(Exception, match="probe_labels"):
        dataclasses.replace(b, probe_labels=torch.zeros(24, dtype=torch.long))  # one class: nothing to probe


def test_a_fed_state_without_the_label_skips_the_subspace_swaps_and_keeps_the_battery(tiny_ckpt, tmp_path):
    # A final norm of weight 0 makes every top state (what is fed back) the zero vector: no probe direction exists.
    # The subspace swaps are recorded as not run, with the reason; the rest of the run, its verdict and page stand.
    from interventions.run import main
    from models.full_bandwidth import FullBandwidthLM
    from tasks import build_tokenizer

    model = FullBandwidthLM.from_pretrained(tiny_ckpt)
    model.family.final_norm(model.lm).weight.data.zero_()
    flat = tmp_path / "flat"
    model.save_pretrained(flat, build_tokenizer())
    out = tmp_path / "fig"
    assert main(["--model", str(flat), "--task", "completion", "--distractors", "0", "--n-pairs", "10",
                 "--mode", "recurrent-1", "--out", str(out), "--control-model", "none", "--no-progress",
                 "--n-boot", "20"]) == 0
    rep = json.loads((out / "causal_report.json").read_text())
    sub = rep["results"]["subspace"]
    assert sub["rows"] == [] and "found no direction" in sub["skipped"] and sub["rank"] == 1
    names = [r["name"] for r in rep["results"]["interventions"]]
    assert names[:2] == ["gate_bypass", "state_swap"] and len(rep["results"]["dose"]["rows"]) == 11
    assert "probe subspace swaps were not run: the probe on the fed state found no direction" in rep["verdict"]["sentence"]
    md = (out / "causal_report.md").read_text()
    assert "Probe subspace (rank 1): not run: the probe on the fed state found no direction" in md
    assert "## Dose-response" in md and "not run" in (out / "causal_report.html").read_text()
