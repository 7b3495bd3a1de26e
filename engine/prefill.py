"""The prefill engine: every prefill and decoding mode, in one place; the only code that runs a model.

Prompts are left-padded so that every row's last token (the probed position T) is the last column.
Positions are given as negative offsets from the end (-1 = T, -2 = T-1). Modes are engine.modes.Mode values
(parsed once at the CLI boundary); recirc modes run through the second engine, engine.recirculation, behind the
same `prefill` / `prefill_many` / `generate` contract.

Modes
    standard        one parallel pass on token embeddings
    recurrent-k     standard prefill of all T columns (its KV cache is reused), crop the last k columns and
                    recompute them one token at a time (`recurrent_step`), each fused with the previous
                    position's top state
    recurrent-full  recurrent-k with k = T-1: every position after the first fused, O(T) cached steps
    fused-n         n extra parallel feedback passes (`jacobi_pass`) over the whole prompt; fused-0 = standard
Depths: 0 = vector entering block 0 (embedding or fused input), l = output of 0-based block l - 1 (L = raw output of the
last block, *before* the final norm; HF's hidden_states[-1] is after it). See docs/design.md.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from transformers import DynamicCache

from common.errors import UserError
from engine.cache import WindowCache, cache_prefix, new_cache
from engine.decode import check_generation, greedy, greedy_steps, step_loop
from engine.edits import RowSwap, apply
from engine.hooks import maybe_record
from engine.inputs import check_inputs, check_stepwise, pad_left, to_model
from engine.modes import DECODINGS, MAX_FUSED_PASSES, Mode, parse_mode
from engine.result import PrefillResult
from models.full_bandwidth import FullBandwidthLM, LMOutput, positions_from_mask

__all__ = ["PrefillResult", "prefill", "prefill_many", "generate", "call_schedule", "pad_left", "shift_state",
           "jacobi_pass", "iter_fused", "fused_trajectory", "fixed_point_top", "recurrent_logits", "recurrent_run",
           "recurrent_start", "recurrent_fuse", "recurrent_step", "cache_prefix", "DECODINGS", "MAX_FUSED_PASSES",
           "Mode", "parse_mode"]


def shift_state(top: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """state[:, t] = top[:, t-1]; fuse only where the previous column is a real token of the same row."""
    state = torch.zeros_like(top)
    state[:, 1:] = top[:, :-1]
    fuse = torch.zeros_like(attention_mask, dtype=torch.bool)
    fuse[:, 1:] = attention_mask[:, :-1].bool() & attention_mask[:, 1:].bool()
    return state, fuse


# A model whose every layer is windowed runs its standard pass in chunks of this many columns over a window cache
# (engine.cache.WindowLayer) once the prompt is longer than two chunks: each chunk attends to itself and the last
# W - 1 columns before it, O(T (C + W)) instead of the full pass's O(T^2) (a looped model at N = 1024 runs its
# 36 block calls over 4,102 columns). The logits agree with the full pass to float rounding
# (tests/test_window_cache.py). Only where the caller asks (`prefill_many(chunked=True)`: analysis.evaluate), on a
# plain run: a traced run counts one call per block (probes.collect) and the interventions compare bit for bit.
STANDARD_CHUNK = 512


def _standard(model, ids, mask, cols, rec, use_cache=False, chunked=False, head=True) -> LMOutput:
    if rec is not None:
        rec.cols = cols
    if (chunked and rec is None and not use_cache and ids.shape[1] > 2 * STANDARD_CHUNK
            and _every_layer_windowed(model)):
        return _standard_chunked(model, ids, mask, cols, head=head)
    cache = new_cache() if use_cache else None
    return model(ids, mask, cache=cache, use_cache=use_cache, head=head)


def _every_layer_windowed(model) -> bool:
    """Every layer windowed, and frequencies that do not depend on a call's length: a chunk then computes what the
    full pass does (LongRoPE's would switch factors between chunks)."""
    from engine.cache import model_windows
    from engine.inputs import PER_CALL_ROPE_TYPES, _rope_types

    windows = model_windows(model)
    return (bool(windows) and all(w is not None for w in windows)
            and not (_rope_types(model.config) & PER_CALL_ROPE_TYPES))


def _standard_chunked(model, ids, mask, cols, chunk: int | None = None, head: bool = True) -> LMOutput:
    """The standard pass as consecutive chunks over a window cache: logits and top state at `cols` only (the
    other columns of the returned [batch, T, ...] tensors are zero: callers read `cols`). `head=False`: no
    logits (None)."""
    B, T = ids.shape
    chunk = chunk or STANDARD_CHUNK
    cache, pos = new_cache(model), positions_from_mask(mask, T)
    logits = top = None
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        out = model(ids[:, s:e], mask[:, :e], cache=cache, use_cache=True, position_ids=pos[:, s:e], head=head)
        if top is None:
            logits = out.logits.new_zeros(B, T, out.logits.shape[-1]) if head else None
            top = out.top.new_zeros(B, T, out.top.shape[-1])
        here = [int(c) for c in cols if s <= int(c) < e]
        top[:, here] = out.top[:, [c - s for c in here]]
        if head:
            logits[:, here] = out.logits[:, [c - s for c in here]]
    return LMOutput(logits, top)


def jacobi_pass(model, ids, mask, top, fuse_mask=None, gate=None, cache=None, use_cache=False,
                state=None, hidden_states=False, last_logits=False, head=True) -> LMOutput:
    """One Jacobi pass: every position fuses the previous pass's top state of the position before it
    (`fuse_mask` default: wherever that position is a real token of the same row). `state` [B, T, D]: the
    shifted state to feed instead (the trainer's noised state, an intervention's patched one). `head=False`:
    no logits (None)."""
    shifted, fuse = shift_state(top, mask) if state is None else (state, shift_state(top, mask)[1])
    kw = {"hidden_states": True} if hidden_states else {}
    if last_logits:
        kw["last_logits"] = True
    if not head:
        kw["head"] = False
    return model(ids, mask, state=shifted, fuse_mask=fuse if fuse_mask is None else fuse_mask, gate=gate,
                 cache=cache, use_cache=use_cache, **kw)


def iter_fused(model, ids, mask, n, cols=None, rec=None, use_cache=False, heads: str = "all"):
    """Yield (k, output) for k = 0..n Jacobi passes; pass k fuses pass k-1's top states shifted right.
    A recorder `rec` records `cols` of the last pass only. `heads`: the passes that run the LM head, "all",
    "last" (pass n: a pass feeds the next its top states, not its logits) or "none"; the others' logits are None."""
    if heads not in ("all", "last", "none"):
        raise ValueError(f"iter_fused: heads must be 'all', 'last' or 'none', got {heads!r}")
    out = model(ids, mask, head=heads == "all" or (heads == "last" and n == 0))  # pass 0 (standard)
    yield 0, out
    for i in range(n):
        last = i == n - 1
        if rec is not None and last:
            rec.cols = cols
        cache = new_cache() if (use_cache and last) else None
        out = jacobi_pass(model, ids, mask, out.top, cache=cache, use_cache=use_cache and last,
                          head=heads == "all" or (heads == "last" and last))
        yield i + 1, out


def _fused(model, ids, mask, n, cols, rec, use_cache=False, head=True) -> LMOutput:
    for _, out in iter_fused(model, ids, mask, n, cols, rec, use_cache, heads="last" if head else "none"):
        pass
    return out


@dataclass
class FusedTrajectory:
    logits: torch.Tensor  # [passes+1, batch, n_pos, vocab]; entry k = fused-k (k = 0 is standard)
    state_change: torch.Tensor  # [passes+1]; mean over real positions of ||h^(k) - h^(k-1)||, entry 0 = nan
    state_norm: torch.Tensor  # [passes+1]; mean ||h^(k)|| over real positions


@torch.no_grad()
def fused_trajectory(model: FullBandwidthLM, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     n_passes: int, positions: tuple[int, ...] = (-1,)) -> FusedTrajectory:
    """Every fused-k for k = 0..n_passes in one run (the Jacobi iterates), with the state change per pass."""
    if not model.has_fusion:
        raise UserError("this model has no fusion module: fused prefill is not available")
    check_inputs(model, input_ids, attention_mask, positions)
    input_ids, attention_mask = to_model(model, input_ids, attention_mask)
    T = input_ids.shape[1]
    cols = torch.tensor([T + p for p in positions])
    real = attention_mask.bool()
    logits, change, norm, prev = [], [], [], None
    for k, out in iter_fused(model, input_ids, attention_mask, n_passes):
        logits.append(out.logits[:, cols])
        norm.append(out.top.norm(dim=-1)[real].mean())
        change.append(torch.tensor(float("nan")) if prev is None else (out.top - prev).norm(dim=-1)[real].mean())
        prev = out.top
    return FusedTrajectory(torch.stack(logits), torch.stack(change), torch.stack(norm))


JACOBI_MAX_ROWS = 16  # fixed_point_top(tol=...) tries Jacobi passes only for batches with fewer rows


@torch.no_grad()
def fixed_point_top(model: FullBandwidthLM, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    fuse_mask: torch.Tensor, gate: torch.Tensor | None = None, tol: float | None = None,
                    max_jacobi: int = 16, start: torch.Tensor | None = None, rows: int | None = None,
                    reduce_max=None) -> torch.Tensor:
    """Top states [batch, pos, d_model] at the fixed point of the Jacobi passes for this fuse mask.

    Position t's input is fused (where fuse_mask[:, t]) with the top state of position t-1 *of the same run*:
    the limit of fused-n, reached exactly at n = T, computed by the recurrent engine in cached one-token steps
    from the first fused column on. With every position after the first fused, this is recurrent-full.

    `tol` (batches of fewer than JACOBI_MAX_ROWS rows): first run up to `max_jacobi` Jacobi passes from `start`
    (default: the standard pass's top states) and return as soon as the largest relative state change at any
    real position, ||h^(k) - h^(k-1)|| / ||h^(k-1)||, is below tol (for a map contracting at rate r that is
    within tol * r / (1 - r) of the fixed point); if they have not got there, the exact recurrence above. A
    pass is one parallel forward, a few dozen of the recurrence's one-token steps, so this is cheaper wherever
    the map contracts (the trained models: 1e-3 in ~10 passes) and costs max_jacobi passes more where it does
    not.

    A process's share of a larger batch (the trainer under torchrun) passes the whole batch's `rows` and a
    `reduce_max` (float -> the largest over every process): each process then takes the branch and the number of
    passes that one process would take for the whole batch, so its rows come out as they would there (rows of a
    Jacobi pass are independent).
    """
    # Many short rows: the recurrence's one-token steps are cheap and a Jacobi pass is not (measured, 2 threads:
    # 31 x 47 tokens 0.23 s exact vs 0.38 s Jacobi; 3 x 326 tokens 1.00 s vs 0.25 s).
    if tol is not None and (input_ids.shape[0] if rows is None else rows) < JACOBI_MAX_ROWS:
        real = attention_mask.bool()
        top = model(input_ids, attention_mask).top if start is None else start
        for _ in range(max_jacobi):
            new = jacobi_pass(model, input_ids, attention_mask, top, fuse_mask, gate).top
            change = (new - top).norm(dim=-1) / top.norm(dim=-1).clamp_min(1e-12)  # [batch, pos]
            top = new
            worst = float(change[real].max()) if real.any() else 0.0
            if (worst if reduce_max is None else reduce_max(worst)) < tol:
                return top
    T = input_ids.shape[1]
    fused_cols = fuse_mask.any(0).nonzero()
    k = T - int(fused_cols[0]) if len(fused_cols) else 0  # columns before the first fused one: standard pass
    return recurrent_run(model, input_ids, attention_mask, k, torch.arange(T), fuse_mask=fuse_mask, gate=gate,
                         full_std=False).top


def recurrent_logits(model: FullBandwidthLM, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     swap: tuple[torch.Tensor, torch.Tensor] | None = None,
                     decoy: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Logits [batch, T, vocab] of recurrent-full at every position, differentiable: the trainer's recurrent
    objective backpropagates through the whole recurrence (every cached one-token step), not a Jacobi horizon.
    `swap`, `decoy`: see recurrent_run (interchange and decoy training)."""
    T = input_ids.shape[1]
    return recurrent_run(model, input_ids, attention_mask, None, torch.arange(T), full_std=False, swap=swap,
                         decoy=decoy).logits


# ----- the recurrence: one step, one loop ---------------------------------------------------------------------
def recurrent_start(T: int, k: int | None) -> int:
    """First recomputed (fused) column of recurrent-k on T columns (k None = recurrent-full): T - min(k, T-1)."""
    return T - (T - 1 if k is None else min(k, T - 1))


def recurrent_fuse(attention_mask: torch.Tensor, t: int) -> torch.Tensor:
    """The fuse mask [batch, 1] of the one-token step at column t: previous and current column are real tokens."""
    return (attention_mask[:, t - 1].bool() & attention_mask[:, t].bool())[:, None]


def recurrent_step(model: FullBandwidthLM, input_ids: torch.Tensor, attention_mask: torch.Tensor, t: int,
                   state: torch.Tensor, cache, fuse_mask: torch.Tensor | None = None,
                   gate: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                   head: bool = True) -> LMOutput:
    """The recurrence's cached one-token step at column t fed `state` [batch, d_model] (the top state of t-1);
    `cache` holds columns 0..t-1 and gains column t. `fuse_mask` [batch, T] (default: previous and current
    column real), `gate` [batch, T, D]: the model's token_gate(ids), when the caller has it; `position_ids`
    [batch, T]: positions_from_mask(attention_mask, T), when the caller has it (a loop computes them once);
    `head=False`: no logits (None), the top state only."""
    fuse = recurrent_fuse(attention_mask, t) if fuse_mask is None else fuse_mask[:, t:t + 1]
    return model(input_ids[:, t:t + 1], attention_mask[:, :t + 1], state=state[:, None], fuse_mask=fuse,
                 cache=cache, use_cache=True, gate=None if gate is None else gate[:, t:t + 1],
                 position_ids=None if position_ids is None else position_ids[:, t:t + 1], head=head)


def recurrent_steps(model, ids, mask, start: int, prev: torch.Tensor, cache, fuse_mask=None, gate=None,
                    position_ids=None, state_edits=None, step_hooks=None, decoy=None, before=None, logits_at=None):
    """The one loop of the recurrence: yields (t, step output) for the cached one-token steps t = start..T-1,
    starting from `prev` (the top state of start-1) and `cache` (columns 0..start-1).

    `state_edits` {t: engine.edits object}: the fed state of column t is edited before its step (an
    intervention's patch, the trainer's interchange: engine.edits.RowSwap); `step_hooks(t)` -> a context
    manager (or None) held during step t (hooks on sites inside the model); `decoy` (cols [B, T] bool, donor
    [B]): at a marked column the cached keys/values are recomputed from the donor row's state (recurrent_run);
    `before(t)`: called before each step (a recorder's columns); `logits_at`: the columns whose step runs the LM
    head (default every one; elsewhere the output's logits are None: a step's head is ~1/4 of a SmolLM2-sized
    step, 39 vs 52 ms a token in docs/benchmarks.md, and a patched run reads T alone). The loop runs in
    engine.decode.step_loop, and so does the caller's loop body between steps (a generator's context stays
    entered while it is suspended): without autograd, what the body makes is an inference tensor; it copies what
    it keeps into its own tensors."""
    T = ids.shape[1]
    decoy_cols = set() if decoy is None else set(decoy[0].any(0).nonzero()[:, 0].tolist())
    with step_loop():  # 1 thread, inference mode without autograd (engine.decode); a prefill keeps every thread
        for t in range(start, T):
            if before is not None:
                before(t)
            if state_edits and t in state_edits:
                prev = apply(state_edits[t], prev)
            held = step_hooks(t) if step_hooks is not None else None
            with held if held is not None else nullcontext():
                out = recurrent_step(model, ids, mask, t, prev, cache, fuse_mask, gate, position_ids,
                                     head=logits_at is None or t in logits_at)
            if t in decoy_cols:  # the chain's step stays in `out`; its column in the cache is replaced
                cache.crop(-1)  # drop column t again
                recurrent_step(model, ids, mask, t, RowSwap(decoy[0][:, t], decoy[1])(prev), cache, fuse_mask,
                               gate, position_ids, head=False)
            prev = out.top[:, 0]
            yield t, out


class RecurrentRun(NamedTuple):
    std: LMOutput  # the standard pass over all T columns (its logits/top serve mode "standard"); with
    #                full_std=False over the first T-k columns only (the ones the recurrence keeps)
    std_resid: torch.Tensor | None  # [batch, n_cols, L+1, D] standard residual at `cols` (recorder given);
    #                                 with full_std=False at the `cols` before T-k only
    logits: torch.Tensor  # [batch, n_cols, vocab] recurrent-k at `cols`
    top: torch.Tensor  # [batch, n_cols, D]
    resid: torch.Tensor | None  # [batch, n_cols, L+1, D]
    cache: DynamicCache  # engine.cache.new_cache: the keys/values after the last step (every column with
    #                      full_cache, else a windowed model's sliding layers keep their window only)


def recurrent_run(model, ids, mask, k, cols, rec=None, fuse_mask=None, gate=None, full_std=True,
                  swap: tuple[torch.Tensor, torch.Tensor] | None = None,
                  decoy: tuple[torch.Tensor, torch.Tensor] | None = None, full_cache: bool = False,
                  with_logits: bool = True) -> RecurrentRun:
    """Standard prefill with cache, crop the last k columns (None = T-1), recompute them with `recurrent_step`.

    `fuse_mask` [B, T] (default: every real position after a real one) says where the recomputed columns are
    fused; `gate`: the model's token_gate(ids), when the caller has it; `rec`: a ResidualRecorder.
    `full_std=False`: the standard prefill runs on the first T-k columns only, the ones the cache keeps (the
    others would be cropped and recomputed): recurrent-full then costs T one-token-sized calls, not a full
    parallel pass plus T-1 steps. The result is the same; only `std` and `std_resid` are shorter (see
    RecurrentRun).
    `swap` = (at [batch], donor [batch]): row r is fed row donor[r]'s state (the top state of at[r] - 1 of the
    donor row in this run, itself swapped if the donor was at an earlier column; in training partners share
    their column) at the recomputed column at[r] instead of its own, differentiably (interchange training; a
    column outside the recomputed ones, e.g. 0, swaps nothing): an engine.edits.RowSwap state edit, applied
    by the same loop (`recurrent_steps`) as the interventions' patches (engine.patching).
    `decoy` = (cols [batch, T] bool, donor [batch]): the complement of a swap. At a recomputed column t with
    cols[r, t], row r's *cached* keys and values of t are computed from row donor[r]'s fed state, while row r's
    recurrence goes on from its own top state of t (the step runs twice: once for the chain, once for the
    cache) and its logits at t are its own: later columns see a wrong copy of the state in the cache and the
    right one in the fed state (decoy training; no recorder). Differentiable, the donor's state included: row
    r's loss reaches the donor row's chain through the decoy as well.
    A windowed model's sliding layers keep only their window (engine.cache.WindowLayer: O(T * W), not O(T^2));
    `full_cache=True` keeps every column (the interventions copy prefixes of the returned cache).
    `with_logits=False`: no LM head anywhere (the returned logits, and std's, are None): top states and residuals
    only (probes.collect). Otherwise the head runs where logits are read: the prefill's columns when the
    standard result or a kept column is wanted, and the steps of the read columns.
    """
    if decoy is not None and rec is not None:
        raise ValueError("decoy columns are a training option: no residual recorder")
    T = ids.shape[1]
    k = T - 1 if k is None else min(k, T - 1)
    s = T - k  # first recomputed column
    # Prefill only the kept columns when that saves much (recurrent-full: one column instead of T); for a few
    # recomputed columns the full-width prefill is as cheap and keeps its matmul shapes (measured: recurrent-1
    # at T = 1024 was ~5% slower with a 1023-column prefill).
    short = not full_std and k > 0 and 2 * (T - k) <= T
    if rec is not None:
        rec.cols = cols[cols < s] if short else cols
    # slack: the columns a crop takes back (the k recomputed ones after a full-width prefill; a decoy's re-step);
    # reserve: the columns the steps add after a short prefill (engine.cache.GrowLayer allocates them with it)
    cache = new_cache(reserve=k if short else 0) if full_cache else \
        new_cache(model, slack=(0 if short else k) + (decoy is not None), reserve=k if short else 0)
    pre = cols < s
    # The prefill's logits serve the standard result and the read columns it keeps; with neither (recurrent-k
    # read at its recomputed columns only) the head is skipped: ~19% of a SmolLM2 pass, and no returned value
    # changes (a head over fewer columns would: its matmul takes another kernel, docs/benchmarks.md).
    head = with_logits and (full_std or bool(pre.any()) or not len(cols))
    std = model(ids[:, :s], mask[:, :s], cache=cache, use_cache=True, head=head) if short else \
        model(ids, mask, cache=cache, use_cache=True, head=head)
    std_resid = rec.take() if rec is not None else None
    # The read columns the prefill keeps come from it, the others from the steps. Without the prefill's head the
    # logits are made at the first read step, which knows the vocabulary (then every read column is a step's).
    top = std.top[:, cols].clone() if not short else std.top.new_empty((ids.shape[0], len(cols), std.top.shape[-1]))
    logits = std.logits[:, cols].clone() if head and not short else None
    resid = std_resid.clone() if std_resid is not None and not short else None
    if short:
        top[:, pre] = std.top[:, cols[pre]]
        if head:
            logits = std.logits.new_empty((ids.shape[0], len(cols), std.logits.shape[-1]))
            logits[:, pre] = std.logits[:, cols[pre]]
        if std_resid is not None:
            resid = std_resid.new_empty((ids.shape[0], len(cols)) + std_resid.shape[2:])
            resid[:, pre] = std_resid
    if k == 0:
        return RecurrentRun(std, std_resid, logits, top, resid, cache)
    if not short:
        cache.crop(-k)
        if isinstance(cache, WindowCache):
            cache.set_slack(int(decoy is not None))  # the steps keep the window only (the crop is done)
    prev = std.top[:, s - 1]  # [batch, d_model]
    # Computed once for the loop, not per step: the default fuse mask and the position ids.
    if fuse_mask is None:  # recurrent_fuse at every column
        fuse_mask = torch.zeros_like(mask, dtype=torch.bool)
        fuse_mask[:, 1:] = mask[:, :-1].bool() & mask[:, 1:].bool()
    position_ids = positions_from_mask(mask, T)
    col_pos = {int(c): j for j, c in enumerate(cols.tolist())}
    # The interchange as state edits at the columns it touches (one host read, not one per step)
    edits = {} if swap is None else {t: RowSwap(swap[0] == t, swap[1]) for t in set(swap[0].tolist())}

    def before(t):
        if rec is not None:
            rec.cols = torch.tensor([0]) if t in col_pos else None

    for t, out in recurrent_steps(model, ids, mask, s, prev, cache, fuse_mask, gate, position_ids, edits,
                                  decoy=decoy, before=before, logits_at=col_pos if with_logits else ()):
        j = col_pos.get(t)
        if j is not None:
            if with_logits:
                if logits is None:  # an ordinary tensor: the loop body runs in the steps' inference mode
                    with torch.inference_mode(False):
                        logits = out.logits.new_empty((ids.shape[0], len(cols), out.logits.shape[-1]))
                logits[:, j] = out.logits[:, 0]
            top[:, j] = out.top[:, 0]
            if rec is not None:
                resid[:, j] = rec.take()[:, 0]
    return RecurrentRun(std, std_resid, logits, top, resid, cache)


# ----- the prefill contract -----------------------------------------------------------------------------------
def _plan(modes) -> list[Mode]:
    """The order the engine runs distinct modes in: recurrent modes first (each one's standard pass also serves
    'standard'), then the rest. `call_schedule` and `prefill_many` both follow it."""
    return [m for m in modes if m.kind == "recurrent"] + [m for m in modes if m.kind != "recurrent"]


def call_schedule(modes, T: int, n_layers: int | None = None) -> tuple[dict[str, int], int]:
    """({mode name: index of the engine's model call (block-0 call) that computes position -1 for it}, total
    calls) for ``prefill_many(model, ids[:, :T], ..., modes)`` with distinct ``modes``: what a reader outside
    the engine (nnsight in probes.collect) needs to pick the right call."""
    from engine.recirculation import recirc_calls

    parsed = _distinct(modes, n_layers)
    want_std = any(m.kind == "standard" for m in parsed)
    where: dict[str, int] = {}
    idx = 0
    for m in _plan(parsed):
        if m.name in where:
            continue
        if m.kind == "recurrent":
            k = T - 1 if m.n is None else min(m.n, T - 1)
            if want_std and "standard" not in where:
                where["standard"] = idx
            where[m.name] = idx + k
            idx += k + 1
        elif m.kind in ("standard", "loop"):
            where[m.name] = idx
            idx += 1
        elif m.kind == "fused":
            idx += m.n + 1
            where[m.name] = idx - 1
        else:
            idx += recirc_calls(m.recirc, T)
            where[m.name] = idx - 1
    return where, idx


def _distinct(modes, n_layers=None) -> list[Mode]:
    out: list[Mode] = []
    for m in modes:
        p = parse_mode(m, n_layers)
        if p not in out:
            out.append(p)
        elif p.kind == "recirc" and not out[out.index(p)].recirc.same_run(p.recirc):
            # results are keyed by name, and a name leaves out a spec's transform and subspace: one would be lost
            raise UserError(f"two {p.name} modes differ in their transform or subspace: run them in separate calls")
    return out


@torch.no_grad()
def prefill_many(model: FullBandwidthLM, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 modes=("standard",), positions: tuple[int, ...] = (-1,), collect: bool = True,
                 full_cache: bool = False, chunked: bool = False, logits: bool = True) -> dict[str, PrefillResult]:
    """Run several modes on one left-padded batch, sharing work where modes allow.

    The standard result comes for free with any recurrent mode (same prefill, same KV cache). Recirc modes run
    on the model's LM without its fusion module (engine.recirculation). `full_cache`: the recurrent modes keep
    every column of a windowed model's caches (engine.cache), as the interventions' clean runs do, so the two
    agree bit for bit (the window cache agrees to float rounding). `chunked`: a model whose every layer is windowed
    runs standard (and loop-R) passes longer than 2 STANDARD_CHUNK columns in chunks over a window cache, O(T W)
    (to float rounding; without `collect`). `logits=False`: no LM head wherever the engine can leave it out (every
    result's logits are None): for a caller that reads residuals or top states only (probes.collect); a SmolLM2
    pass spends 21-28% of its time in the head over every column (docs/benchmarks.md).
    """
    from engine.recirculation import recirculated_prefill

    modes = list(modes)
    parsed = [parse_mode(m, model.n_layers) for m in modes]
    if not model.has_fusion and any(m.has_feedback for m in parsed):
        raise UserError("this model has no fusion module: only the standard and recirc modes are available")
    positions = tuple(int(p) for p in positions)
    check_inputs(model, input_ids, attention_mask, positions)
    once = tuple(dict.fromkeys(positions))
    if len(once) < len(positions):  # a position asked for twice: computed once (the runs fill each column once)
        out = prefill_many(model, input_ids, attention_mask, modes, once, collect, full_cache, chunked, logits)
        j = torch.tensor([once.index(p) for p in positions])
        pick = lambda x: None if x is None else x[:, j.to(x.device)]  # noqa: E731
        return {k: replace(r, positions=positions, logits=pick(r.logits), top=pick(r.top), resid=pick(r.resid))
                for k, r in out.items()}
    for m in parsed:  # one-token steps after a prefill (recirculation checks its own)
        if m.kind == "recurrent":
            check_stepwise(model, attention_mask, m.name, steps=m.n)
    input_ids, attention_mask = to_model(model, input_ids, attention_mask)
    T = input_ids.shape[1]
    cols = torch.tensor([T + p for p in positions])
    results: dict[str, PrefillResult] = {}
    want_std = any(m.kind == "standard" for m in parsed)
    with maybe_record(model, collect) as rec:
        for m in _plan(_distinct(parsed)):
            if m.name in results:
                continue
            if m.kind == "recurrent":
                run = recurrent_run(model, input_ids, attention_mask, m.n, cols, rec,
                                    full_std=want_std and "standard" not in results, full_cache=full_cache,
                                    with_logits=logits)
                results[m.name] = PrefillResult(m.name, positions, run.logits, run.top, run.resid)
                if want_std and "standard" not in results:
                    results["standard"] = PrefillResult("standard", positions,
                                                        run.std.logits[:, cols] if logits else None,
                                                        run.std.top[:, cols], run.std_resid)
                continue
            if m.kind == "recirc":
                if rec is not None:
                    rec.cols = None  # the recirculation engine records with its own recorder
                results[m.name] = recirculated_prefill(model, m.recirc, input_ids, attention_mask, positions,
                                                       collect)  # its head runs at the read columns only
                continue
            if m.adaptive_exit is not None:  # loop-R:TOL: each prompt exits where its state at T settles
                from engine.loops import adaptive_exit

                results[m.name] = adaptive_exit(model, input_ids, attention_mask, *m.adaptive_exit, positions, m.name)
                continue
            if m.kind == "loop":  # the looped model re-unrolled to R iterations: its own recorder, depths
                from models.looped import looping, require_looped

                with looping(require_looped(model, m.name), m.n):
                    sub = prefill_many(model, input_ids, attention_mask, ["standard"], positions, collect,
                                       chunked=chunked, logits=logits)["standard"]
                results[m.name] = PrefillResult(m.name, positions, sub.logits, sub.top, sub.resid)
                continue
            if m.kind == "standard":
                out = _standard(model, input_ids, attention_mask, cols, rec, chunked=chunked, head=logits)
            else:
                out = _fused(model, input_ids, attention_mask, m.n, cols, rec, head=logits)
            results[m.name] = PrefillResult(m.name, positions, out.logits[:, cols] if logits else None,
                                            out.top[:, cols], rec.take() if rec is not None else None)
    if not logits:  # recirc and loop-R:TOL compute theirs at the read columns anyway: one contract for all
        for r in results.values():
            r.logits = None
    # Keyed by the name the caller asked for: aliases of standard (fused-0, recurrent-0) keep their names.
    return {(m if isinstance(m, str) else p.name): results[p.name] for m, p in zip(modes, parsed)}


def prefill(model: FullBandwidthLM, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            mode: str | Mode = "standard", positions: tuple[int, ...] = (-1,), collect: bool = True
            ) -> PrefillResult:
    """One mode; see `prefill_many`."""
    return next(iter(prefill_many(model, input_ids, attention_mask, (mode,), positions, collect).values()))


@torch.no_grad()
def generate(model: FullBandwidthLM, input_ids: torch.Tensor, attention_mask: torch.Tensor,
             max_new_tokens: int, decoding: str = "std") -> torch.Tensor:
    """Greedy generation. Returns new token ids [batch, max_new_tokens].

    std    token embeddings only (the base model's cached greedy decoding)
    soft   recurrent-1 prefill (the last prompt token is fed like a decoding step, fused with h_{T-1}),
           then every generated token fused with the previous top state
    fused  fused-1 prefill, then as soft
    recirc-S:D:A[:mode]  recirculation's exact sequential prefill, then one [r_{t-1}, n_t] step per token
    """
    if str(decoding).startswith("recirc-"):
        from engine.recirculation import RecirculatedLM, lm_only

        return RecirculatedLM(lm_only(model), parse_mode(decoding, model.n_layers).recirc).generate(
            input_ids, attention_mask, max_new_tokens)
    if decoding not in DECODINGS:
        raise UserError(f"unknown decoding {decoding!r} (use one of {', '.join(DECODINGS)} or recirc-S:D:A)")
    if decoding != "std" and not model.has_fusion:
        raise UserError(f"decoding {decoding!r} needs a model with a fusion module")
    if decoding == "std":  # the base model's cached greedy decoding (engine.decode)
        return greedy(model, input_ids, attention_mask, max_new_tokens)
    input_ids, attention_mask = check_generation(model, input_ids, attention_mask, max_new_tokens)
    T = input_ids.shape[1]
    cols = torch.tensor([T - 1])
    if decoding == "fused":
        out = _fused(model, input_ids, attention_mask, 1, cols, None, use_cache=True)
        cache = out.cache
    else:  # soft: recurrent-1 (of one token: the standard prefill)
        run = recurrent_run(model, input_ids, attention_mask, 1, cols, full_std=False)  # no standard result
        out, cache = LMOutput(logits=run.logits, top=run.top), run.cache
    return greedy_steps(model, out, cache, input_ids, attention_mask, max_new_tokens, fed=True)
