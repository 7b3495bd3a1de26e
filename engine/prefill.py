"""The prefill engine: every prefill and decoding mode, in one place.

Prompts are left-padded so that every row's last token (the probed position T) is the last column.
Positions are given as negative offsets from the end (-1 = T, -2 = T-1).

Modes
    standard        one parallel pass on token embeddings
    recurrent-k     standard prefill of all T columns (its KV cache is reused), crop the last k columns and
                    recompute them one token at a time, each fused with the previous position's top state
    recurrent-full  recurrent-k with k = T-1: every position after the first fused, O(T) cached steps
    fused-n         n extra parallel feedback passes over the whole prompt; fused-0 = standard
Depths: 0 = vector entering block 0 (embedding or fused input), l = output of block l (L = raw output of the
last block, *before* the final norm; HF's hidden_states[-1] is after it).
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from common.errors import UserError
from models.full_bandwidth import FullBandwidthLM, LMOutput, decoder_layers

MODE_RE = re.compile(r"^(standard|recurrent-(\d+|full)|fused-(\d+))$")
DECODINGS = ("std", "soft", "fused")
# Bounds checked when a mode is parsed, before any work: fused-n keeps n passes' states, recurrent-k is cropped
# to the prompt anyway. Larger values are typos (fused-99999 grew memory until killed).
MAX_FUSED_PASSES = 1000
MAX_RECURRENT_K = 100_000


@dataclass(frozen=True)
class Mode:
    kind: str  # "standard" | "recurrent" | "fused"
    n: int | None = None  # k for recurrent (None = full), passes for fused

    @property
    def name(self) -> str:
        if self.kind == "standard":
            return "standard"
        if self.kind == "recurrent":
            return "recurrent-full" if self.n is None else f"recurrent-{self.n}"
        return f"fused-{self.n}"


def parse_mode(mode: str | Mode) -> Mode:
    if isinstance(mode, Mode):
        return mode
    m = MODE_RE.match(str(mode))
    if not m:
        raise UserError(f"unknown prefill mode {mode!r} (use standard, recurrent-K, recurrent-full or fused-N)")
    if m.group(1) == "standard":
        return Mode("standard")
    if m.group(2) is not None:
        if m.group(2) == "full":
            return Mode("recurrent", None)
        k = int(m.group(2))
        if k > MAX_RECURRENT_K:
            raise UserError(f"prefill mode {mode!r}: k must be <= {MAX_RECURRENT_K} (recurrent-full recomputes "
                            "every position)")
        return Mode("standard") if k == 0 else Mode("recurrent", k)
    n = int(m.group(3))
    if n > MAX_FUSED_PASSES:
        raise UserError(f"prefill mode {mode!r}: at most {MAX_FUSED_PASSES} fused passes")
    return Mode("standard") if n == 0 else Mode("fused", n)


@dataclass
class PrefillResult:
    mode: str
    positions: tuple[int, ...]  # negative offsets from the end
    logits: torch.Tensor  # [batch, n_pos, vocab]
    top: torch.Tensor  # [batch, n_pos, d_model] post-final-norm state (fed back at the next position)
    resid: torch.Tensor | None = None  # [batch, n_pos, L+1, d_model] residual stream at every depth


def pad_left(seqs: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists -> (input_ids [batch, T], attention_mask [batch, T])."""
    if not seqs:
        raise UserError("empty dataset: nothing to run")
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s) == 0:
            raise UserError(f"sample {i} is empty")
        ids[i, T - len(s):] = torch.as_tensor(s, dtype=torch.long)
        mask[i, T - len(s):] = 1
    return ids, mask


class ResidualRecorder:
    """Forward hooks on the blocks; records the residual stream at chosen columns of the current call."""

    def __init__(self, model: FullBandwidthLM):
        self.layers = decoder_layers(model.lm)
        self.cols: torch.Tensor | None = None  # columns of the current call to keep; None = record nothing
        self.buf: list[torch.Tensor | None] = [None] * (len(self.layers) + 1)
        self.handles = []

    def _keep(self, depth: int, h: torch.Tensor) -> None:
        if self.cols is not None:
            self.buf[depth] = h[:, self.cols].detach()

    def __enter__(self):
        def pre_hook(mod, args, kwargs):
            self._keep(0, args[0] if args else kwargs["hidden_states"])

        self.handles.append(self.layers[0].register_forward_pre_hook(pre_hook, with_kwargs=True))
        for i, layer in enumerate(self.layers):
            def hook(mod, args, out, depth=i + 1):
                self._keep(depth, out[0] if isinstance(out, tuple) else out)

            self.handles.append(layer.register_forward_hook(hook))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def take(self) -> torch.Tensor:
        out = torch.stack(self.buf, dim=2)  # [batch, n_cols, L+1, d_model]
        self.buf = [None] * len(self.buf)
        return out


@contextmanager
def _maybe_record(model, collect: bool):
    if collect:
        with ResidualRecorder(model) as rec:
            yield rec
    else:
        yield None


def _check_inputs(model: FullBandwidthLM, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  positions: tuple[int, ...]) -> None:
    if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
        raise UserError("input_ids and attention_mask must both be [batch, T]")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise UserError("empty dataset: nothing to run")
    if not bool(attention_mask[:, -1].all()):
        raise UserError("prompts must be left-padded (the last column must be a real token in every row)")
    T = input_ids.shape[1]
    ctx = getattr(model.config, "max_position_embeddings", None)
    longest = int(attention_mask.sum(-1).max())
    if ctx is not None and longest > ctx:
        raise UserError(f"prompt of {longest} tokens is longer than the model's context ({ctx})")
    for p in positions:
        if not (-T <= p < 0):
            raise UserError(f"position {p} out of range for prompts of {T} columns (use -1 .. -{T})")


def _shift_state(top: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """state[:, t] = top[:, t-1]; fuse only where the previous column is a real token of the same row."""
    state = torch.zeros_like(top)
    state[:, 1:] = top[:, :-1]
    fuse = torch.zeros_like(attention_mask, dtype=torch.bool)
    fuse[:, 1:] = attention_mask[:, :-1].bool() & attention_mask[:, 1:].bool()
    return state, fuse


def _standard(model, ids, mask, cols, rec, use_cache=False) -> LMOutput:
    if rec is not None:
        rec.cols = cols
    cache = DynamicCache(config=model.config) if use_cache else None
    return model(ids, mask, cache=cache, use_cache=use_cache)


def _jacobi_pass(model, ids, mask, top, fuse_mask=None, gate=None, cache=None, use_cache=False) -> LMOutput:
    """One Jacobi pass: every position fuses the previous pass's top state of the position before it
    (`fuse_mask` default: wherever that position is a real token of the same row)."""
    state, fuse = _shift_state(top, mask)
    return model(ids, mask, state=state, fuse_mask=fuse if fuse_mask is None else fuse_mask, gate=gate,
                 cache=cache, use_cache=use_cache)


def _iter_fused(model, ids, mask, n, cols=None, rec=None, use_cache=False):
    """Yield (k, output) for k = 0..n Jacobi passes; pass k fuses pass k-1's top states shifted right."""
    out = model(ids, mask)  # pass 0 (standard)
    yield 0, out
    for i in range(n):
        last = i == n - 1
        if rec is not None and last:
            rec.cols = cols
        cache = DynamicCache(config=model.config) if (use_cache and last) else None
        out = _jacobi_pass(model, ids, mask, out.top, cache=cache, use_cache=use_cache and last)
        yield i + 1, out


iter_fused = _iter_fused  # public name for analyses that need every pass's full output


def _fused(model, ids, mask, n, cols, rec, use_cache=False) -> LMOutput:
    for _, out in _iter_fused(model, ids, mask, n, cols, rec, use_cache):
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
    _check_inputs(model, input_ids, attention_mask, positions)
    T = input_ids.shape[1]
    cols = torch.tensor([T + p for p in positions])
    real = attention_mask.bool()
    logits, change, norm, prev = [], [], [], None
    for k, out in _iter_fused(model, input_ids, attention_mask, n_passes):
        logits.append(out.logits[:, cols])
        norm.append(out.top.norm(dim=-1)[real].mean())
        change.append(torch.tensor(float("nan")) if prev is None else (out.top - prev).norm(dim=-1)[real].mean())
        prev = out.top
    return FusedTrajectory(torch.stack(logits), torch.stack(change), torch.stack(norm))


JACOBI_MAX_ROWS = 16  # fixed_point_top(tol=...) tries Jacobi passes only for batches with fewer rows


@torch.no_grad()
def fixed_point_top(model: FullBandwidthLM, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    fuse_mask: torch.Tensor, gate: torch.Tensor | None = None, tol: float | None = None,
                    max_jacobi: int = 16, start: torch.Tensor | None = None) -> torch.Tensor:
    """Top states [batch, pos, d_model] at the fixed point of the Jacobi passes for this fuse mask.

    Position t's input is fused (where fuse_mask[:, t]) with the top state of position t-1 *of the same run*:
    the limit of fused-n, reached exactly at n = T, computed by the recurrent engine in cached one-token steps
    from the first fused column on. With every position after the first fused, this is recurrent-full.

    `tol` (batches of fewer than JACOBI_MAX_ROWS rows): first run up to `max_jacobi` Jacobi passes from `start`
    (default: the standard pass's top states) and return as soon as the largest relative state change at any real position, ||h^(k) - h^(k-1)|| / ||h^(k-1)||,
    is below tol (for a map contracting at rate r that is within tol * r / (1 - r) of the fixed point); if they
    have not got there, the exact recurrence above. A pass is one parallel forward, a few dozen of the
    recurrence's one-token steps, so this is cheaper wherever the map contracts (the trained models: 1e-3 in
    ~10 passes) and costs max_jacobi passes more where it does not.
    """
    # Many short rows: the recurrence's one-token steps are cheap and a Jacobi pass is not (measured, 2 threads:
    # 31 x 47 tokens 0.23 s exact vs 0.38 s Jacobi; 3 x 326 tokens 1.00 s vs 0.25 s).
    if tol is not None and input_ids.shape[0] < JACOBI_MAX_ROWS:
        real = attention_mask.bool()
        top = model(input_ids, attention_mask).top if start is None else start
        for _ in range(max_jacobi):
            new = _jacobi_pass(model, input_ids, attention_mask, top, fuse_mask, gate).top
            change = (new - top).norm(dim=-1) / top.norm(dim=-1).clamp_min(1e-12)  # [batch, pos]
            top = new
            if float(change[real].max()) < tol:
                return top
    T = input_ids.shape[1]
    fused_cols = fuse_mask.any(0).nonzero()
    k = T - int(fused_cols[0]) if len(fused_cols) else 0  # columns before the first fused one: standard pass
    return _recurrent(model, input_ids, attention_mask, k, torch.arange(T), None, fuse_mask, gate)[3]


def recurrent_logits(model: FullBandwidthLM, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Logits [batch, T, vocab] of recurrent-full at every position, differentiable: the trainer's recurrent
    objective backpropagates through the whole recurrence (every cached one-token step), not a Jacobi horizon."""
    T = input_ids.shape[1]
    return _recurrent(model, input_ids, attention_mask, None, torch.arange(T), None)[2]


def _recurrent(model, ids, mask, k, cols, rec, fuse_mask=None, gate=None):
    """Standard prefill with cache, crop the last k columns, recompute them sequentially with feedback.

    `fuse_mask` [B, T] (default: every real position after a real one) says where the recomputed columns are
    fused; `gate`: the model's token_gate(ids), when the caller has it.
    Returns (standard_out, standard_resid, logits [B, cols, V], top, resid) for columns `cols`.
    """
    T = ids.shape[1]
    k = T - 1 if k is None else min(k, T - 1)
    if rec is not None:
        rec.cols = cols
    cache = DynamicCache(config=model.config)
    std = model(ids, mask, cache=cache, use_cache=True)
    std_resid = rec.take() if rec is not None else None
    logits, top = std.logits[:, cols].clone(), std.top[:, cols].clone()
    resid = std_resid.clone() if std_resid is not None else None
    if k == 0:
        return std, std_resid, logits, top, resid
    cache.crop(-k)
    prev = std.top[:, T - k - 1]  # [batch, d_model]
    col_pos = {int(c): j for j, c in enumerate(cols.tolist())}
    for t in range(T - k, T):
        fuse = (mask[:, t - 1].bool() & mask[:, t].bool())[:, None] if fuse_mask is None else fuse_mask[:, t:t + 1]
        j = col_pos.get(t)
        if rec is not None:
            rec.cols = torch.tensor([0]) if j is not None else None
        out = model(ids[:, t:t + 1], mask[:, :t + 1], state=prev[:, None], fuse_mask=fuse, cache=cache,
                    use_cache=True, gate=None if gate is None else gate[:, t:t + 1])
        prev = out.top[:, 0]
        if j is not None:
            logits[:, j], top[:, j] = out.logits[:, 0], out.top[:, 0]
            if rec is not None:
                resid[:, j] = rec.take()[:, 0]
    return std, std_resid, logits, top, resid


@torch.no_grad()
def prefill_many(model: FullBandwidthLM, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 modes=("standard",), positions: tuple[int, ...] = (-1,), collect: bool = True
                 ) -> dict[str, PrefillResult]:
    """Run several prefill modes on one left-padded batch, sharing work where modes allow.

    The standard result comes for free with any recurrent mode (same prefill, same KV cache).
    """
    modes = list(modes)
    parsed = [parse_mode(m) for m in modes]
    if not model.has_fusion and any(m.kind != "standard" for m in parsed):
        raise UserError("this model has no fusion module: only the standard prefill mode is available")
    positions = tuple(int(p) for p in positions)
    _check_inputs(model, input_ids, attention_mask, positions)
    T = input_ids.shape[1]
    cols = torch.tensor([T + p for p in positions])
    results: dict[str, PrefillResult] = {}
    want_std = any(m.kind == "standard" for m in parsed)
    with _maybe_record(model, collect) as rec:
        for m in parsed:
            if m.kind == "recurrent":
                std, std_resid, logits, top, resid = _recurrent(model, input_ids, attention_mask, m.n, cols, rec)
                results[m.name] = PrefillResult(m.name, positions, logits, top, resid)
                if want_std and "standard" not in results:
                    results["standard"] = PrefillResult("standard", positions, std.logits[:, cols],
                                                        std.top[:, cols], std_resid)
        for m in parsed:
            if m.name in results:
                continue
            if m.kind == "standard":
                out = _standard(model, input_ids, attention_mask, cols, rec)
            else:
                out = _fused(model, input_ids, attention_mask, m.n, cols, rec)
            results[m.name] = PrefillResult(m.name, positions, out.logits[:, cols], out.top[:, cols],
                                            rec.take() if rec is not None else None)
    # Keyed by the name the caller asked for: aliases of standard (fused-0, recurrent-0) keep their names.
    return {(m if isinstance(m, str) else p.name): results[p.name] for m, p in zip(modes, parsed)}


def prefill(model: FullBandwidthLM, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            mode: str = "standard", positions: tuple[int, ...] = (-1,), collect: bool = True) -> PrefillResult:
    """One prefill mode; see `prefill_many`."""
    return next(iter(prefill_many(model, input_ids, attention_mask, (mode,), positions, collect).values()))


@torch.no_grad()
def generate(model: FullBandwidthLM, input_ids: torch.Tensor, attention_mask: torch.Tensor,
             max_new_tokens: int, decoding: str = "std") -> torch.Tensor:
    """Greedy generation. Returns new token ids [batch, max_new_tokens].

    std    token embeddings only
    soft   recurrent-1 prefill (the last prompt token is fed like a decoding step, fused with h_{T-1}),
           then every generated token fused with the previous top state
    fused  fused-1 prefill, then as soft
    """
    if decoding not in DECODINGS:
        raise UserError(f"unknown decoding {decoding!r} (use one of {', '.join(DECODINGS)})")
    if decoding != "std" and not model.has_fusion:
        raise UserError(f"decoding {decoding!r} needs a model with a fusion module")
    _check_inputs(model, input_ids, attention_mask, (-1,))
    ctx = getattr(model.config, "max_position_embeddings", None)
    longest = int(attention_mask.sum(-1).max())
    if ctx is not None and longest + max_new_tokens - 1 > ctx:  # the last new token is never fed back in
        raise UserError(f"{longest} prompt tokens + {max_new_tokens} new tokens exceed the model's context ({ctx})")
    T = input_ids.shape[1]
    cols = torch.tensor([T - 1])
    if decoding == "std":
        out = _standard(model, input_ids, attention_mask, cols, None, use_cache=True)
        cache, prev = out.cache, out.top[:, -1]
        logits = out.logits[:, -1]
    elif decoding == "fused":
        out = _fused(model, input_ids, attention_mask, 1, cols, None, use_cache=True)
        cache, prev, logits = out.cache, out.top[:, -1], out.logits[:, -1]
    elif T == 1:  # no previous state to feed: recurrent-1 of one token is the standard prefill
        out = _standard(model, input_ids, attention_mask, cols, None, use_cache=True)
        cache, prev, logits = out.cache, out.top[:, -1], out.logits[:, -1]
    else:
        cache = DynamicCache(config=model.config)
        out = model(input_ids, attention_mask, cache=cache, use_cache=True)
        cache.crop(-1)
        fuse = (attention_mask[:, -2].bool() if T > 1 else torch.zeros_like(attention_mask[:, -1]).bool())[:, None]
        out = model(input_ids[:, -1:], attention_mask, state=out.top[:, -2:-1], fuse_mask=fuse, cache=cache,
                    use_cache=True)
        prev, logits = out.top[:, -1], out.logits[:, -1]
    mask = attention_mask
    new = []
    for step in range(max_new_tokens):
        tok = logits.argmax(-1)  # [batch]
        new.append(tok)
        if step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        state = None if decoding == "std" else prev[:, None]
        out = model(tok[:, None], mask, state=state, cache=cache, use_cache=True)
        prev, logits = out.top[:, -1], out.logits[:, -1]
    return torch.stack(new, dim=1) if new else input_ids.new_zeros((input_ids.shape[0], 0))


# ===== Intervention primitives (interventions/*): new public functions only; the engine above is unchanged =====
shift_state = _shift_state  # state[:, t] = top[:, t-1] and the default fuse mask, as every Jacobi pass uses them
jacobi_pass = _jacobi_pass  # one parallel feedback pass (fused-n is n of them after the standard pass)


def recurrent_start(T: int, k: int | None) -> int:
    """First recomputed (fused) column of recurrent-k on T columns (k None = recurrent-full): T - min(k, T-1)."""
    return T - (T - 1 if k is None else min(k, T - 1))


def recurrent_fuse(attention_mask: torch.Tensor, t: int) -> torch.Tensor:
    """The fuse mask [batch, 1] of the one-token step at column t: previous and current column are real tokens."""
    return (attention_mask[:, t - 1].bool() & attention_mask[:, t].bool())[:, None]


def recurrent_step(model: FullBandwidthLM, input_ids: torch.Tensor, attention_mask: torch.Tensor, t: int,
                   state: torch.Tensor, cache, fuse_mask: torch.Tensor | None = None) -> LMOutput:
    """The recurrence's cached one-token step at column t fed `state` [batch, d_model] (the top state of t-1);
    `cache` holds columns 0..t-1 and gains column t. Exactly the step `_recurrent` takes."""
    fuse = recurrent_fuse(attention_mask, t) if fuse_mask is None else fuse_mask
    return model(input_ids[:, t:t + 1], attention_mask[:, :t + 1], state=state[:, None], fuse_mask=fuse,
                 cache=cache, use_cache=True)


def cache_prefix(cache, t: int, config) -> DynamicCache:
    """A new DynamicCache holding the first t columns of `cache` (left untouched). The keys/values of a column
    never change once computed, so the final cache of a clean recurrent run cropped to t columns is the cache
    its step at column t started from."""
    return DynamicCache(ddp_cache_data=[(layer.keys[..., :t, :], layer.values[..., :t, :])
                                        for layer in cache.layers], config=config)
