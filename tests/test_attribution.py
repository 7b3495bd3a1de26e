"""Attribution patching (engine.attribution, interventions.attribution): the gradients against finite differences of
the exact patching routine, integrated gradients against their completeness, and the report against the sweep."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from common.errors import UserError
from engine.attribution import site_gradients
from engine.modes import parse_mode
from interventions.attribution import agreement, cell_means_ci
from interventions.core import CausalContext, Patch
from interventions.metrics import label_ld
from interventions.suite import Suite

from test_interventions import _random_batch


def _ld_metric(batch):
    lab = torch.as_tensor(batch.label_ids)
    y, other = batch.labels, batch.labels[batch.pair]

    def metric(logits, rows):
        z = logits[:, lab]
        return z.gather(1, y[rows][:, None])[:, 0] - z.gather(1, other[rows][:, None])[:, 0]

    return metric


@pytest.mark.parametrize("mode", ["standard", "recurrent-1", "recurrent-full"])
def test_gradients_match_finite_differences_of_the_exact_patches(tiny_model, mode):
    """dLD/dx . v equals (LD(x + v) - LD(x - v)) / 2 of the exact patched run, at every site kind: the residual
    stream, the fed state, and the attention and MLP outputs inside blocks."""
    batch = _random_batch(tiny_model, n_pairs=3, T=7, seed=2)
    batch.attention_mask[:] = 1  # float64 (exact enough for finite differences): no padding, whose -inf rows NaN there
    ctx = CausalContext(tiny_model.double(), batch, modes=("standard", mode))
    g = site_gradients(ctx.model, batch.input_ids, batch.attention_mask, parse_mode(mode), _ld_metric(batch), chunk=4)
    other = batch.labels[batch.pair]
    gen = torch.Generator().manual_seed(0)
    L = tiny_model.n_layers
    sites = [("resid", d, pos) for d in (0, 1, L) for pos in (-1, -3)]
    sites += [(b, layer, pos) for b in ("attn_out", "mlp_out") for layer in (0, L - 1) for pos in (-1, -2)]
    if mode != "standard":
        sites += [("state", 0, pos) for pos in ctx.fused_positions(mode)[-2:]]
    resid = ctx.resid(mode).double()
    T = batch.input_ids.shape[1]
    for site, d, pos in sites:
        if site in ("attn_out", "mlp_out"):
            own, at, grad = g.block_values[site][:, T + pos, d].double(), dict(layer=d), g.blocks[site][:, T + pos, d]
        elif site == "state":
            own, at, grad = ctx.state(mode, pos).double(), {}, g.state[:, T + pos]
        else:
            own, at, grad = resid[:, T + pos, d], dict(depth=d), g.resid[:, T + pos, d]
        # a step of 1e-3 of the site's norm (HF norms compute in float32 even for float64 inputs)
        v = torch.randn(own.shape, generator=gen, dtype=torch.float64)
        v = 1e-3 * v * (own.norm(dim=-1, keepdim=True) / v.norm(dim=-1, keepdim=True))
        lds = []
        for sign in (1, -1):
            with torch.no_grad():
                logits = ctx.runner(mode).run([Patch(site, own + sign * v, pos=pos, **at)])
            lds.append(label_ld(logits, batch.labels, batch.label_ids, other))
        fd = (lds[0] - lds[1]) / 2
        est = (grad.double() * v).sum(-1).numpy()
        assert np.allclose(est, fd, rtol=1e-2, atol=1e-5), (site, d, pos)
    tiny_model.float()


def test_integrated_gradients_are_complete_along_the_input_path(tiny_model):
    """EAP-IG's completeness: summed over every column, the depth-0 attribution (depth 0 = the token embeddings
    under standard prefill) equals LD at the donor's input minus LD at the row's own, as the path steps shrink."""
    batch = _random_batch(tiny_model, n_pairs=3, T=6, seed=5)
    batch.attention_mask[:] = 1  # equal lengths within each pair: the path moves token embeddings only
    model = tiny_model.double()
    ids, mask = batch.input_ids, batch.attention_mask
    with torch.no_grad():
        e = model.embed(ids)
        delta = e[batch.pair] - e
    metric = _ld_metric(batch)
    g = site_gradients(model, ids, mask, parse_mode("standard"), metric, interpolate=(delta, tuple(
        (i + 0.5) / 64 for i in range(64))))
    ig = (g.resid[:, :, 0] * delta).sum((-1, -2))
    rows = torch.arange(batch.size)
    with torch.no_grad():
        own = metric(model(ids, mask).logits[:, -1], rows)
        donor = metric(model(ids[batch.pair], mask).logits[:, -1], rows)  # own labels, the donor's tokens
    assert torch.allclose(ig, donor - own, rtol=2e-3, atol=2e-3)
    tiny_model.float()


def test_report_heatmap_and_agreement_with_the_sweep(tiny_model):
    batch = _random_batch(tiny_model, n_pairs=6, T=7, seed=1)
    ctx = CausalContext(tiny_model, batch, modes=("standard", "recurrent-full"))
    s = Suite(ctx, n_boot=50)
    sweep = s.position_sweep()
    out = s.attribution(sweep=sweep)
    T, L = batch.input_ids.shape[1], tiny_model.n_layers
    assert out["sites"] == (["state"] + [f"d{d}" for d in range(L + 1)] + [f"attn{l}" for l in range(L)]
                            + [f"mlp{l}" for l in range(L)])
    assert len(out["mean_estimate"]) == 3 * L + 2 and all(len(r) == T for r in out["mean_estimate"])
    assert out["mean_estimate"][0][0] is None  # column 0 is never fed
    v = out["vs_position_sweep"]
    assert v["n"] == len(v["estimate"]) == len(v["exact"]) and v["top_k"] == min(5, v["n"])
    # exact effects agree with the sweep's own rows
    assert v["exact"][-1] == pytest.approx(sweep["rows"][-1]["ld_mean"] - sweep["rows"][-1]["ld_clean_mean"])
    with pytest.raises(UserError, match="standard, loop-R and recurrent"):
        site_gradients(tiny_model, batch.input_ids, batch.attention_mask, parse_mode("fused-2"), _ld_metric(batch))


def test_integrated_gradients_keep_the_attention_and_mlp_rows(tiny_model):
    """Under --attribution-ig the blocks' Delta is still the clean run's (the path's runs move the inputs): the
    attention and MLP rows were dropped from the heatmap without a word."""
    batch = _random_batch(tiny_model, n_pairs=3, T=6, seed=4)
    batch.attention_mask[:] = 1
    ids, mask = batch.input_ids, batch.attention_mask
    with torch.no_grad():
        e = tiny_model.embed(ids)
    plain = site_gradients(tiny_model, ids, mask, parse_mode("recurrent-1"), _ld_metric(batch), chunk=4)
    ig = site_gradients(tiny_model, ids, mask, parse_mode("recurrent-1"), _ld_metric(batch), chunk=4,
                        interpolate=(e[batch.pair] - e, (0.25, 0.75)))
    assert set(ig.block_values) == {"attn_out", "mlp_out"}
    for k in ig.block_values:
        assert torch.equal(ig.block_values[k], plain.block_values[k])
        assert not torch.allclose(ig.blocks[k], plain.blocks[k])  # the gradients are the path's
    s = Suite(CausalContext(tiny_model, batch, modes=("standard", "recurrent-1")), n_boot=20)
    assert s.attribution(ig_steps=2)["sites"] == s.attribution()["sites"]


def test_the_clean_metric_is_the_clean_runs_with_or_without_integrated_gradients(tiny_model):
    """metric_clean_mean is LD at the clean run; under --attribution-ig it once was the path's mean, where a pair's
    mirror-image rows cancel (~1e-7 against a clean LD of 18 on parity)."""
    batch = _random_batch(tiny_model, n_pairs=4, T=6, seed=2)
    batch.attention_mask[:] = 1  # equal lengths within each pair, as integrated gradients need
    ctx = CausalContext(tiny_model, batch, modes=("standard", "recurrent-full"))
    rows = torch.arange(batch.size)
    with torch.no_grad():
        want = float(_ld_metric(batch)(ctx.clean["recurrent-full"].logits, rows).double().mean())
    s = Suite(ctx, n_boot=20)
    assert abs(want) > 1e-3  # a clean LD the path's mean would miss
    for ig in (0, 4):
        assert s.attribution(ig_steps=ig)["metric_clean_mean"] == pytest.approx(want, rel=1e-6, abs=1e-9)


def test_under_standard_the_estimate_meets_the_residual_sweep(tiny_model):
    """Standard prefill's sweep patches the residual at its depth: the estimate is checked against it there too."""
    batch = _random_batch(tiny_model, n_pairs=6, T=7, seed=3)
    ctx = CausalContext(tiny_model, batch, modes=("standard",))
    s = Suite(ctx, n_boot=50)
    sweep = s.position_sweep()
    out = s.attribution(sweep=sweep)
    v, d = out["vs_position_sweep"], sweep["depth"]
    assert (v["site"], v["depth"]) == ("resid", d) and v["n"] == len(v["exact"]) > 0
    row = out["sites"].index(f"d{d}")
    by_name = dict(zip(out["position_names"], out["mean_estimate"][row]))
    assert v["estimate"] == pytest.approx([by_name[p] for p in v["positions"]])
    assert v["exact"][-1] == pytest.approx(sweep["rows"][-1]["ld_mean"] - sweep["rows"][-1]["ld_clean_mean"])


def test_a_row_whose_donor_is_itself_gets_zero_everywhere(tiny_model):
    batch = _random_batch(tiny_model, n_pairs=4, T=6, seed=4)
    batch.input_ids[batch.pair[0]] = batch.input_ids[0]  # pair 0: identical prompts (labels still differ)
    batch.attention_mask[batch.pair[0]] = batch.attention_mask[0]
    ctx = CausalContext(tiny_model, batch, modes=("standard", "recurrent-1"))
    out = Suite(ctx, n_boot=20).attribution()
    assert out["n_rows"][1][-1] == batch.size


def test_cell_means_and_agreement_helpers():
    vals = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    masks = np.array([[1, 1], [1, 0], [1, 1], [1, 1]], bool)
    means, cis = cell_means_ci(vals, masks, [0, 0, 1, 1], 200, 0)
    assert means[0] == pytest.approx(4.0) and means[1] == pytest.approx(16 / 3)
    assert cis[0][0] <= 4.0 <= cis[0][1]
    a = agreement([1, 2, 3, 4, 5, 6], [10, 20, 30, 40, 50, 60], list("abcdef"))
    assert a["spearman"] == pytest.approx(1.0) and a["top_overlap"] == 5 and a["sign_agreement"] == 1.0
    b = agreement([0, 0, 0], [1, 2, 3], list("abc"))
    assert b["spearman"] is None  # a constant estimate has no rank order
