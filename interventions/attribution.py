"""Attribution patching over every (site, position) of the mode under study, checked against the exact patches.

For row i with its paired sample p(i) as the donor (the position sweep's and layer patching's donor), the estimated
effect of patching site s at column c on LD_i (interventions.metrics.label_ld: own label word minus the donor's) is

    est[i, s, c] = (x_s,c[p(i)] - x_s,c[i]) . dLD_i / dx_s,c            (engine.attribution.site_gradients)

with x the clean run's value: the residual stream at (depth, c) and, in recurrent modes, the fed state entering the
fusion at c (the top state of c - 1). Every estimate comes from ONE forward and ONE backward per batch chunk; the
exact patch of the fed state at c costs T - c one-token steps (engine.patching).

The report: a heatmap over position x site (rows `state`, `d0` .. `dL`, `attn0` .. , `mlp0` .. ) of the mean estimate over the rows whose
own and paired columns are real (for the state, columns c - 1 and c too: the sweep's rows), with cluster-bootstrap
95% CIs over groups; and its agreement with the exact patches where they were run: per position against the state
sweep (Spearman over positions, the overlap of the 5 largest |effects|, sign agreement) and per cell against the
layer-patching heatmap of the same mode. A first-order estimate is wrong where the metric is not linear between the
two values (a saturated softmax or a flip of a discrete state: the tangent at the clean value says little about the
far side): the agreement numbers say how wrong, and the report says so.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from engine.attribution import site_gradients
from engine.modes import parse_mode
from stats.bootstrap import ClusterBootstrap, percentile_ci

from .batch import pos_name

TOP_K = 5


def cell_means_ci(values: np.ndarray, masks: np.ndarray, groups, n_boot: int, seed: int):
    """Mean of values[:, j] over rows masks[:, j] for every column j ([B, J] each), with cluster-bootstrap 95% CIs:
    (means [J], cis [J] of (lo, hi) or None: no rows, or rows of one group alone). One draw of groups for every
    cell (a resample is a set of groups)."""
    boot = ClusterBootstrap(groups, n_boot, seed)
    G = boot.n_groups
    counts = np.zeros((len(boot.draws), G))
    np.add.at(counts, (np.repeat(np.arange(len(boot.draws)), G), boot.draws.ravel()), 1.0)  # [n_boot, G]
    v = np.where(masks, values, 0.0)
    vs = np.stack([np.bincount(boot.inverse_, weights=v[:, j], minlength=G) for j in range(v.shape[1])])  # [J, G]
    ns = np.stack([np.bincount(boot.inverse_, weights=masks[:, j].astype(float), minlength=G)
                   for j in range(v.shape[1])])
    with np.errstate(invalid="ignore", divide="ignore"):
        means = vs.sum(1) / ns.sum(1)
        reps = (vs @ counts.T) / (ns @ counts.T)  # [J, n_boot]
    n_groups = (ns > 0).sum(1)  # [J]: groups holding a row of the cell (one alone has no interval)
    cis = [percentile_ci(r) if np.isfinite(m) and k >= 2 else None for m, r, k in zip(means, reps, n_groups)]
    return means, [None if c is None else [c[0], c[1]] for c in cis]


def _spearman(a, b) -> float | None:
    from scipy.stats import spearmanr

    a, b = np.asarray(a, float), np.asarray(b, float)
    ok = np.isfinite(a) & np.isfinite(b)
    if ok.sum() < 3 or np.ptp(a[ok]) == 0 or np.ptp(b[ok]) == 0:
        return None
    return float(spearmanr(a[ok], b[ok]).statistic)


def agreement(estimate, exact, keys) -> dict:
    """How an estimate per key agrees with the exact effect per key: Spearman, top-5 |effect| overlap (None where
    there are no more than 5 cells: every cell is in both tops, so the overlap would say nothing), signs."""
    est, ex = np.asarray(estimate, float), np.asarray(exact, float)
    ok = np.isfinite(est) & np.isfinite(ex)
    keys = [k for k, o in zip(keys, ok) if o]
    est, ex = est[ok], ex[ok]
    k = min(TOP_K, len(keys))
    top_est = [keys[i] for i in np.argsort(-np.abs(est), kind="stable")[:k]]
    top_ex = [keys[i] for i in np.argsort(-np.abs(ex), kind="stable")[:k]]
    big = np.abs(ex) > 1e-6 * max(1.0, float(np.abs(ex).max(initial=0.0)))
    return {"n": int(len(keys)), "spearman": _spearman(est, ex), "top_k": k,
            "top_overlap": len(set(top_est) & set(top_ex)) if len(keys) > TOP_K else None, "top_estimate": top_est, "top_exact": top_ex,
            "sign_agreement": float((np.sign(est[big]) == np.sign(ex[big])).mean()) if big.any() else None,
            "abs_error_mean": float(np.abs(est - ex).mean()) if len(est) else None,
            "exact_abs_mean": float(np.abs(ex).mean()) if len(ex) else None}


# A row's path is unresolved where one step between adjacent points (the ends included) carries more than this
# share of the metric's total variation along it: a flip in a sliver the midpoints miss, whose gradient no point
# sees (tiny-fbt-track's parity answer flips within 2.5e-5 of the path: 128 points gave the same ~0 estimate as 8).
UNRESOLVED_STEP_SHARE = 0.5


def ig_path_resolution(path_metric, start, end) -> dict:
    """How well integrated gradients' M points resolve each row's path: the metric at the row's own input (`start`
    [B]), at the path's points (`path_metric` [B, M]) and at the paired input (`end` [B]). A row is unresolved where
    one step carries more than UNRESOLVED_STEP_SHARE of the total variation: its estimates miss that step."""
    seq = torch.cat([start[:, None], path_metric.to(start), end[:, None]], 1).double()  # [B, M + 2]
    steps = seq.diff(dim=1).abs()
    total = steps.sum(1)
    moved = total > 1e-6 * seq.abs().amax(1).clamp(min=1.0)
    share = torch.where(moved, steps.amax(1) / total.clamp(min=1e-300), torch.zeros_like(total))
    unresolved = moved & (share > UNRESOLVED_STEP_SHARE)
    return {"n_rows": int(len(seq)), "unresolved_rows": int(unresolved.sum()),
            "largest_step_share_median": float(share[moved].median()) if moved.any() else None,
            "total_change_mean": float((end - start).double().mean()),
            "rule": f"a row is unresolved where one step between adjacent path points (the ends included) carries "
                    f"more than {UNRESOLVED_STEP_SHARE:g} of the metric's total variation along the path"}


def attribution(ctx, n_boot: int = 1000, seed: int = 0, max_positions: int | None = None, sweep: dict | None = None,
                layers: dict | None = None, chunk: int = 32, ig_steps: int = 0) -> dict:
    """The attribution heatmap and its agreement with the exact sweep / layer patching (module doc). `ig_steps` > 0:
    the gradients are averaged over that many points of the straight path from the row's input embeddings to its
    paired sample's (midpoints of equal steps; EAP-IG), one forward and backward each."""
    from common.errors import UserError

    b, mode = ctx.batch, ctx.mode
    parsed = parse_mode(mode, ctx.n_layers)
    y, pair = b.labels, b.pair
    lab = torch.as_tensor(b.label_ids)
    other = y[pair]  # the donor's label (the sweep's reference: always != y)

    def metric(logits, rows):
        rows = rows.to(logits.device)
        z = logits[:, lab.to(logits.device)]
        return z.gather(1, y.to(logits.device)[rows][:, None])[:, 0] - z.gather(1, other.to(logits.device)[rows][:, None])[:, 0]

    ids, mask = b.input_ids.to(ctx.device), b.attention_mask.to(ctx.device)
    t0 = time.perf_counter()
    interpolate = None
    if ig_steps:
        if not torch.equal(b.attention_mask, b.attention_mask[pair]):
            raise UserError("--attribution-ig interpolates each row's token embeddings towards its paired sample's: "
                            "the pairs must have equal lengths (this task's pairs differ)")
        with torch.no_grad():
            e = ctx.model.embed(ids)
            delta_e = (e[pair.to(e.device)] - e).detach()  # [B, T, D]
        interpolate = (delta_e, tuple((i + 0.5) / ig_steps for i in range(ig_steps)))
    g = site_gradients(ctx.model, ids, mask, parsed, metric, chunk, interpolate)
    t_grad = time.perf_counter() - t0
    # The metric at the clean run. With integrated gradients `g.metric` is its mean over the path, where a pair's
    # two rows meet halfway (mirror images: a batch mean near 0), so the clean run's own logits give it instead.
    clean_logits = ctx.clean[mode].logits  # [B, V] at T
    clean_mean = float(metric(clean_logits, torch.arange(len(y))).double().mean())
    T, L = ids.shape[1], ctx.n_layers
    m = b.attention_mask.bool()
    real = (m & m[pair]).numpy()  # [B, T]: own and paired column real
    resid = ctx.resid(mode)  # [B, T, L+1, D] clean
    est_resid = ((resid[pair] - resid).double() * g.resid.cpu().double()).sum(-1).numpy()  # [B, T, L+1]
    sites, values, masks = [], [], []
    positions = list(range(-T, 0)) if not max_positions else list(range(-T, 0))[-max_positions:]
    cols = [T + p for p in positions]
    est_state = None
    if g.state is not None:
        top = ctx.clean[mode].top  # [B, T, D] clean top states; the state fed at c is top[:, c - 1]
        prev = torch.zeros_like(top)
        prev[:, 1:] = top[:, :-1]
        est_state = ((prev[pair] - prev).double() * g.state.cpu().double()).sum(-1).numpy()  # [B, T]
        fed = np.zeros_like(real)
        fed[:, max(1, g.fed_from):] = real[:, max(1, g.fed_from):] & real[:, max(1, g.fed_from) - 1:-1]
        sites.append("state")
        values.append(est_state[:, cols])
        masks.append(fed[:, cols])
    for d in range(L + 1):
        sites.append(f"d{d}")
        values.append(est_resid[:, cols, d])
        masks.append(real[:, cols])
    if g.block_values is not None:  # inside every block: Delta from this run's own values (the pair is in the batch)
        for site, short in (("attn_out", "attn"), ("mlp_out", "mlp")):
            v = g.block_values[site].double()  # [B, T, L, D]
            est = ((v[pair] - v) * g.blocks[site].cpu().double()).sum(-1).numpy()  # [B, T, L]
            for layer in range(L):
                sites.append(f"{short}{layer}")
                values.append(est[:, cols, layer])
                masks.append(real[:, cols])
    V, M = np.concatenate(values, 1), np.concatenate(masks, 1)
    means, cis = cell_means_ci(V, M, b.groups, n_boot, seed)
    P = len(positions)
    grid = [[None if not np.isfinite(means[i * P + j]) else float(means[i * P + j]) for j in range(P)]
            for i in range(len(sites))]
    ci_grid = [[cis[i * P + j] for j in range(P)] for i in range(len(sites))]
    method = ("attribution patching: (donor value - own value) . dLD/dvalue at the clean run" if not ig_steps else
              f"attribution patching with integrated gradients (EAP-IG): (donor value - own value) . the mean of dLD/dvalue "
              f"over {ig_steps} points of the path from the row's token embeddings to its paired sample's")
    out = {"mode": mode, "method": method, "ig_steps": int(ig_steps),
           "metric": "LD = logit(own label word) - logit(donor's label word) at T", "reference": "donor",
           "sites": sites, "positions": positions, "position_names": [pos_name(p) for p in positions],
           "mean_estimate": grid, "ci": ci_grid, "n_rows": [[int(M[:, i * P + j].sum()) for j in range(P)]
                                                            for i in range(len(sites))],
           "metric_clean_mean": clean_mean, "chunk": chunk,
           "timings_s": {"gradients": t_grad, "total": time.perf_counter() - t0}}
    if ig_steps:
        out["ig_path"] = ig_path_resolution(g.path_metric, metric(clean_logits, torch.arange(len(y))),
                                            metric(clean_logits[pair], torch.arange(len(y))))
    # the sweep's site: the fed state (feedback modes), or the residual stream at its depth (standard, loop-R)
    by_site = None
    if sweep is not None and sweep.get("site") == "state" and est_state is not None:
        by_site = (est_state, fed)
    elif sweep is not None and sweep.get("site") == "resid" and sweep.get("depth") is not None:
        by_site = (est_resid[:, :, sweep["depth"]], real)
    if by_site is not None:
        site_est, site_ok = by_site
        keys, est, ex = [], [], []
        for r in sweep["rows"]:
            if r["n"] == 0 or r["ld_mean"] is None:
                continue
            c = T + r["position"]
            rows_ok = site_ok[:, c]
            keys.append(r["position_name"])
            est.append(float(site_est[rows_ok, c].mean()) if rows_ok.any() else float("nan"))
            ex.append(r["ld_mean"] - r["ld_clean_mean"])
        out["vs_position_sweep"] = {**agreement(est, ex, keys), "site": sweep["site"], "depth": sweep.get("depth"),
                                    "positions": keys, "estimate": est, "exact": ex,
                                    "exact_s": sweep.get("seconds")}
    if layers is not None and mode in layers.get("cells", {}):
        keys, est, ex = [], [], []
        for cell in layers["cells"][mode]:
            if cell["n"] == 0 or cell["ld_mean"] is None:
                continue
            c, d = T + cell["position"], cell["depth"]
            rows_ok = real[:, c]
            keys.append(f"d{d}@{cell['position_name']}")
            est.append(float(est_resid[rows_ok, c, d].mean()))
            ex.append(cell["ld_mean"] - cell["ld_clean_mean"])
        out["vs_layer_patching"] = agreement(est, ex, keys)
    return out
