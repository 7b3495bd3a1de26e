"""Gradients of a metric at T with respect to every site, from one forward and one backward (attribution patching).

Attribution patching (Nanda 2023; Syed, Rager and Conmy 2023) estimates the effect of every patch at once to first
order: patching site s from x to x' changes a metric m by about (x' - x) . dm/dx. The exact patch at column t of a
recurrence recomputes every later column (engine.patching: T - t one-token steps per position); the estimate needs
the gradient at every site of the clean run, which one backward through the recurrence gives.

`site_gradients(model, ids, mask, mode, metric)` runs the mode's computation ONCE with a zero tensor added at every
site (each a leaf that requires grad), so d metric / d leaf is the gradient at the site:
    resid   [B, T, L+1, D]  the residual stream at (column, depth), depth 0 = the vector entering block 0
    state   [B, T, D]       the fed state entering the fusion at column t (recurrent modes; zero where t is not fed)
    blocks  {"attn_out" | "mlp_out": [B, T, L, D]}  inside block l: its attention and MLP outputs (engine.hooks.on_block),
            with their values in the run (`block_values`: a donor row's value there is the donor's clean one)
`interpolate` = (delta_e [B, T, D], alphas): integrated gradients along the inputs instead (EAP-IG, Hanna, Pezzelle and
Belinkov 2024): the token embeddings are moved to e + alpha * delta_e (delta_e = the donor's embeddings minus the
row's own) and the gradients at every site averaged over the alphas, one forward and backward each. Where the metric
flips between the two inputs (a discrete state) the tangent at the clean run is flat; the path through the flip is not.
Modes: standard and loop-R (one parallel forward; loop-R on the looped model re-unrolled to R) and recurrent-k (the
standard prefill of the first T - k columns, then the engine's one loop of cached one-token steps,
engine.prefill.recurrent_steps). A windowed model keeps its window only
(engine.cache.new_cache), so the backward holds O(T * W) keys, not O(T^2); rows are independent, so `chunk` rows at a
time give the same gradients with bounded memory. Other mechanisms (fused-n, recirculation) are refused with a
one-line error: their exact patches remain available (engine.patching).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from common.errors import UserError
from engine.cache import new_cache
from engine.edits import Lambda
from engine.hooks import Hooks, blocks_addressable, on_block, on_depth, on_output

BLOCK_SITES = ("attn_out", "mlp_out")  # inside every block (engine.hooks.on_block; TransformerLens' hook_attn_out /
#                                        hook_mlp_out)
from engine.modes import Mode
from engine.prefill import positions_from_mask, recurrent_start, recurrent_steps
from models.looped import looping
from models.full_bandwidth import FullBandwidthLM, decoder_layers


@dataclass
class SiteGradients:
    metric: torch.Tensor  # [B] the metric of the clean run (as this run computed it)
    resid: torch.Tensor  # [B, T, L+1, D] d metric / d residual stream at (column, depth)
    state: torch.Tensor | None  # [B, T, D] d metric / d fed state at column t (recurrent modes), else None
    fed_from: int | None  # first fed column (recurrent modes: T - k), else None
    blocks: dict | None = None  # {"attn_out" | "mlp_out": [B, T, L, D]} d metric / d block output
    block_values: dict | None = None  # the same sites' values in this run (the clean run, or the path's mean)
    path_metric: torch.Tensor | None = None  # [B, M] with `interpolate`: the metric at each of the path's M points


def site_gradients(model: FullBandwidthLM, ids: torch.Tensor, mask: torch.Tensor, mode: Mode, metric,
                   chunk: int = 32, interpolate: tuple[torch.Tensor, tuple[float, ...]] | None = None) -> SiteGradients:
    """Gradients of `metric(logits_T [b, V], rows [b] long) -> [b]` at every site (module doc), `chunk` rows at a time;
    with `interpolate`, their mean over the input path (module doc; `metric` is then the mean over the path)."""
    if not mode.attributable:
        raise UserError(f"attribution patching runs under standard, loop-R and recurrent-k prefill, not {mode.name} (its "
                        "exact patches are in the position sweep and layer patching)")
    B = ids.shape[0]
    chunk = max(1, int(chunk))
    alphas = (None,) if interpolate is None else tuple(interpolate[1])
    parts = []
    with looping(model, mode.loop_iterations):  # a loop-R mode: every site of the stack unrolled R times
        for i in range(0, B, chunk):
            rows = torch.arange(i, min(B, i + chunk))
            runs = [_one_chunk(model, ids[rows], mask[rows], mode, metric, rows,
                               None if a is None else (interpolate[0][rows], float(a))) for a in alphas]
            mean = lambda xs: xs[0] if len(xs) == 1 else torch.stack(xs).mean(0)  # noqa: E731
            # the blocks' values of the clean run (the path's runs move the inputs): one more forward, no backward
            clean = runs[0] if interpolate is None or not runs[0].blocks else \
                _one_chunk(model, ids[rows], mask[rows], mode, metric, rows, grad=False)
            parts.append(SiteGradients(
                mean([r.metric for r in runs]), mean([r.resid for r in runs]),
                None if runs[0].state is None else mean([r.state for r in runs]), runs[0].fed_from,
                {k: mean([r.blocks[k] for r in runs]) for k in runs[0].blocks}, clean.block_values,
                None if interpolate is None else torch.stack([r.metric.detach() for r in runs], 1)))
    state = None if parts[0].state is None else torch.cat([p.state for p in parts])
    blocks = {k: torch.cat([p.blocks[k] for p in parts]) for k in parts[0].blocks}
    values = None if parts[0].block_values is None else \
        {k: torch.cat([p.block_values[k] for p in parts]) for k in parts[0].block_values}
    path = None if interpolate is None else torch.cat([p.path_metric for p in parts])
    return SiteGradients(torch.cat([p.metric for p in parts]), torch.cat([p.resid for p in parts]), state,
                         parts[0].fed_from, blocks, values, path)


def _one_chunk(model, ids, mask, mode: Mode, metric, rows, shift=None, grad: bool = True) -> SiteGradients:
    """One chunk's run (inputs moved by `shift` = (delta_e, alpha)); `grad` False: the block values alone, no
    backward (resid and state None)."""
    B, T = ids.shape
    layers = decoder_layers(model.lm)
    L, D = len(layers), model.d_model
    w = next(model.parameters())
    leaves = [torch.zeros(B, T, D, device=w.device, dtype=w.dtype, requires_grad=True) for _ in range(L + 1)]
    block_leaves = {k: [torch.zeros(B, T, D, device=w.device, dtype=w.dtype, requires_grad=True) for _ in range(L)]
                    for k in BLOCK_SITES}
    values = {k: torch.zeros(B, T, L, D, dtype=torch.float32) for k in BLOCK_SITES}
    now = {"cols": slice(0, T)}  # the columns of the current model call

    def add(d):
        return lambda h: h + leaves[d][:, now["cols"]]

    def add_block(site, layer):
        def fn(x):
            values[site][:, now["cols"], layer] = x.detach().float().cpu()
            return x + block_leaves[site][layer][:, now["cols"]]

        return fn

    with torch.enable_grad() if grad else torch.no_grad(), Hooks() as hooks:
        for d in range(L + 1):
            hooks.add(on_depth(layers, d, add(d)))
        for site in BLOCK_SITES if blocks_addressable(model) else ():
            for layer in range(L):
                hooks.add(on_block(model.lm, layer, site, add_block(site, layer)))
        if shift is not None:  # the inputs moved along the path: every embedding call of the run
            delta_e, a = shift
            hooks.add(on_output(model.lm.get_input_embeddings(),
                                lambda e: e + a * delta_e[:, now["cols"]].to(e.device, e.dtype)))
        if mode.kind in ("standard", "loop"):  # one parallel pass (loop-R: site_gradients re-unrolled the model)
            logits = model(ids, mask, last_logits=True).logits[:, -1]
            state_leaf, s = None, None
        else:
            s = recurrent_start(T, mode.n)
            cache = new_cache(model, slack=0)
            now["cols"] = slice(0, s)
            std = model(ids[:, :s], mask[:, :s], cache=cache, use_cache=True)
            state_leaf = torch.zeros(B, T, D, device=w.device, dtype=w.dtype, requires_grad=True)
            fuse = torch.zeros_like(mask, dtype=torch.bool)
            fuse[:, 1:] = mask[:, :-1].bool() & mask[:, 1:].bool()
            edits = {t: Lambda(lambda prev, t=t: prev + state_leaf[:, t]) for t in range(s, T)}

            def before(t):
                now["cols"] = slice(t, t + 1)

            out = None
            for _, out in recurrent_steps(model, ids, mask, s, std.top[:, s - 1], cache, fuse,
                                          position_ids=positions_from_mask(mask, T), state_edits=edits, before=before,
                                          logits_at=(T - 1,)):
                pass
            logits = out.logits[:, 0] if out is not None else std.logits[:, -1]
        m = metric(logits.float(), rows)
        if not grad:
            return SiteGradients(m.detach(), None, None, s, {}, values if blocks_addressable(model) else None)
        flat = [x for k in BLOCK_SITES for x in block_leaves[k]]
        grads = torch.autograd.grad(m.sum(), leaves + flat + ([state_leaf] if state_leaf is not None else []),
                                    allow_unused=True)
    grads = [torch.zeros(B, T, D, device=w.device, dtype=w.dtype) if g is None else g.detach() for g in grads]
    resid = torch.stack(grads[:L + 1], 2)
    blocks = {k: torch.stack(grads[L + 1 + j * L: L + 1 + (j + 1) * L], 2) for j, k in enumerate(BLOCK_SITES)}
    state = grads[-1] if state_leaf is not None else None
    if not blocks_addressable(model):
        blocks, values = {}, None
    return SiteGradients(m.detach(), resid, state, s, blocks, values)
