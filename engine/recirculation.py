"""Recirculation: training-free deep-to-shallow feedback for any HF causal LM (docs/design.md, Two kinds of feedback).

For a source depth s and a shallower target depth d of the same token t (depth 0 = input of block 0, depth l =
raw output of block l, as in engine/prefill.py):

    z'_{t,d} = alpha_t * (||z_{t,d}|| / ||z_{t,s}||) * z_{t,s} + beta_t * z_{t,d}
    beta_t = 1 - alpha_t (convex) or 1 (residual);  alpha_t = alpha * min(1, (pos_t + 1) / ramp) with a ramp

Semantics (exact): every token has two streams. The *normal* branch n_t runs all blocks on the token and gives
token t's output. The *recirculation* branch r_t is identical below depth d, enters block d+1 with z'_{t,d}
instead of z_{t,d}, and runs the remaining blocks; its keys/values (at every block) are what later tokens
attend to. So n_t attends to {r_u : u < t} and itself; r_t attends to {r_u : u < t} and itself. One
recirculation per position.

Engines
    sequential  exact, O(T) cached steps. Step t feeds the 2-token chunk [r_{t-1}, n_t]: ordinary causal
                attention over the cache (r_{<t-1}) gives exactly the dependencies above, so the two stacks run
                side by side ("pipelined"); after the step the n_t column is cropped from the cache.
    blockwise   the Jacobi approximation for long prefill. The prompt is cut into blocks of `block` tokens
                (default: the whole prompt); per block, pass 0 is a standard parallel forward (z_s from it), and
                each further pass runs [r-half | n-half] of the block in one parallel forward with a custom 4D
                mask, the r-half injected with z' built from the previous pass's z_s. z_{t,d} is exact in every
                pass (the streams agree below d). After k passes positions c0..c0+k of a block are exact
                (a triangular system), so passes >= block gives the sequential result; fewer passes is an
                approximation whose error is only small when alpha is small.
    Identity mixing (alpha = 0, beta = 1, no transform/subspace) short-circuits to the base model: prefill is the
    base model's parallel forward and generation its own cached decoding, bit for bit
    (`bypass_identity=False` runs the machinery anyway; then it matches to float rounding).

Targeted recirculation (`mix_mask`, [batch, T] bool, every engine and `recirculated_prefill`): mixing happens
only at the columns where the mask is True (alpha is zeroed elsewhere, and alpha = 0 makes z' = z_d bit for bit
in both modes), as in Racing Thoughts' targeted patching: with only a key token's column set, only that token's
recirculation branch enters block d+1 with z'; every later token still attends to the recirculation branches, so
it reads the key token's recirculated keys/values (and the knock-on changes of the branches in between). None (the
default) mixes at every column; a mask with no real (non-padding) column set is the identity, short-circuited to
the base model by `prefill` like alpha = 0.

Extras for the analysis: `transform` (a D x D orthogonal matrix applied to z_s before mixing: the basis test) and
`subspace` / `subspace_complement` (only the projection of the change z' - z_d onto span(U), or onto its
orthogonal complement, is applied: the mediation experiment).

Hooking into probes.run: `recirculated_prefill(model, spec, input_ids, attention_mask, positions, collect)`
returns a engine.prefill.PrefillResult (mode name `spec.name`, last-position logits, post-final-norm top state
and the residual stream of the *normal* branch at every depth 0..L); `parse_recirculate("s:d:alpha[:mode][:rampN]",
n_layers)` validates the CLI value.
"""
from __future__ import annotations

import functools
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
from torch import nn
from transformers import PreTrainedModel

from common.errors import UserError
from common.cpus import sequential_threads
from engine.cache import new_cache
from engine.hooks import Hooks, ResidualRecorder, maybe_record, on_depth
from engine.inputs import check_inputs, check_stepwise, eval_mode
from models.full_bandwidth import FullBandwidthLM, decoder_layers, positions_from_mask

from engine.mixing import MODES, RecircSpec, mix, parse_recirculate  # noqa: F401  (the spec is part of this engine's API)


def _on(like: torch.Tensor, pattern: torch.Tensor) -> torch.Tensor:
    """A column pattern built on the host, on `like`'s device (a bool tensor of another device fails to combine)."""
    return pattern.to(like.device)


def _columns(cols, T: int, distinct: bool = True) -> torch.Tensor:
    """`cols` (None = all) as a 1-D long tensor of columns in 0..T-1, distinct unless told: the runs fill their
    outputs column by column, so a column outside them (or the first of a repeat) would come back unfilled."""
    if cols is None:
        return torch.arange(T)
    cols = torch.as_tensor(cols).reshape(-1)
    if cols.is_floating_point() or cols.dtype == torch.bool:
        raise UserError(f"columns must be integers in 0..{T - 1}, got {cols.dtype}")
    cols = cols.long().cpu()
    if cols.numel() and not (0 <= int(cols.min()) and int(cols.max()) < T):
        raise UserError(f"columns must be in 0..{T - 1} (from the left, not offsets from the end), got "
                        f"{cols.tolist()}")
    if distinct and len(set(cols.tolist())) < cols.numel():
        raise UserError(f"columns must be distinct, got {cols.tolist()}")
    return cols


# ----- the wrapper ------------------------------------------------------------------------------------------
@dataclass
class RecircOutput:
    logits: torch.Tensor  # [batch, n_cols, vocab] normal-branch logits at the requested columns
    top: torch.Tensor  # [batch, n_cols, d_model] normal-branch post-final-norm state
    resid: torch.Tensor | None = None  # [batch, n_cols, L+1, d_model] normal-branch residual stream
    cache: object | None = None  # sequential only: holds r_{<T-1} and n_{T-1}
    last_zs: torch.Tensor | None = None  # sequential only: z_{T-1,s} [batch, d_model], to continue generating
    steps: "StepRecord | None" = None  # sequential with record=True: z_s, z_d, z' of every column


class _Injector(Hooks):
    """Mixing at depth d (chosen columns of the residual entering block d+1 replaced by z') and a record of
    z_s at depth s, both on the engine's one hook helper (engine.hooks.on_depth).

    `edit(depth, h) -> h | None` (optional, a patched run's residual edits) runs first at every depth in
    `edit_depths`, so the mixing at d reads an edited z_d and the record at s an edited z_s. `zs_edit(zs) -> zs`
    and `mixed_edit(z') -> z'` rewrite the fed z_s and the mixed vector of the current step (interventions on
    the recirculated state); `keep_mixed` keeps z_d and z' of the injected columns (the clean run's record)."""

    def __init__(self, layers: nn.ModuleList, spec: RecircSpec, edit=None, edit_depths=()):
        super().__init__()
        self.spec = spec
        self.inject_cols: torch.Tensor | None = None  # columns of the current call to replace
        self.inject_zs: torch.Tensor | None = None  # [batch, n_inject, D] z_s for them
        self.inject_alpha: torch.Tensor | None = None  # [batch, n_inject]
        self.record_cols: torch.Tensor | None = None  # columns whose z_s to keep
        self.zs: torch.Tensor | None = None
        self.edit = edit
        self.zs_edit = None
        self.mixed_edit = None
        self.keep_mixed = False
        self.zd = self.mixed = None  # with keep_mixed: z_d and z' of the injected columns
        for depth in sorted({spec.target, spec.source, *edit_depths}):
            self.add(on_depth(layers, depth, lambda h, depth=depth: self._at(depth, h)))

    def _at(self, depth, h):
        out = None
        if self.edit is not None:
            out = self.edit(depth, h)
            h = h if out is None else out
        if depth == self.spec.target:
            out = self._inject(h) if self.inject_cols is not None else out
        if depth == self.spec.source:
            self._record(h if out is None else out)
        return out

    def _inject(self, h):
        zs = self.inject_zs if self.zs_edit is None else self.zs_edit(self.inject_zs)
        zd = h[:, self.inject_cols]
        mixed = mix(zd, zs, self.spec, self.inject_alpha)
        # alpha = 0 (padding, a column outside a targeted mix_mask) is z_d itself, bit for bit: `mix` gives that
        # already for finite z_s (0 * x + 1 * z_d); this also holds where a broken z_s is not finite.
        mixed = torch.where(self.inject_alpha.to(mixed.device)[..., None] == 0, zd, mixed)
        if self.mixed_edit is not None:
            mixed = self.mixed_edit(mixed)
        if self.keep_mixed:
            self.zd, self.mixed = zd.detach(), mixed.detach()
        h = h.clone()
        h[:, self.inject_cols] = mixed
        return h

    def _record(self, h):
        if self.record_cols is not None:
            self.zs = h[:, self.record_cols].detach()


@dataclass
class StepRecord:
    """The recirculated state of every column, kept by a sequential run with `record=True` ([batch, T, D] each;
    column T-1 of zd / mixed is never computed: no later token reads r_{T-1}, so it is NaN)."""
    zs: torch.Tensor  # z_{t,s}: the source-depth state of the normal branch, fed back
    zd: torch.Tensor  # z_{t,d} of the recirculation branch before mixing
    mixed: torch.Tensor  # z'_{t,d}: what enters the recirculation branch's block d+1


def _runs_in_eval(method):
    """A run of a RecirculatedLM built on a plain HF model or a fused model's LM (`_wrapped`) happens in eval mode,
    the caller's modes put back afterwards: such a wrapper was `.eval()`ed, deterministic whatever mode the caller's
    model was in (AutoModelForCausalLM.from_config gives a training one: dropout on)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if not getattr(self.base, "_eval_runs", False):
            return method(self, *args, **kwargs)
        with eval_mode(self.base):
            return method(self, *args, **kwargs)

    return run


class RecirculatedLM(nn.Module):
    """A recirculated view of a base LM (a FullBandwidthLM without fusion, or any HF causal LM)."""

    def __init__(self, model: FullBandwidthLM | PreTrainedModel, spec: RecircSpec, bypass_identity: bool = True):
        super().__init__()
        if isinstance(model, PreTrainedModel):
            model = _wrapped(model)
        if getattr(model, "has_fusion", False):
            raise UserError("recirculation is for off-the-shelf models: this model has a fusion module")
        self.base = model
        self.layers = decoder_layers(model.lm)
        self.spec = spec.validate(len(self.layers))
        self.bypass_identity = bypass_identity

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def config(self):
        return self.base.config

    @property
    def name(self) -> str:
        return self.spec.name

    def with_spec(self, spec: RecircSpec) -> "RecirculatedLM":
        return RecirculatedLM(self.base, spec, self.bypass_identity)

    # ----- primitives -------------------------------------------------------------------------------------
    def _alpha(self, pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Per-(row, column) alpha: ramped by position, 0 on padding."""
        work = torch.promote_types(self.base.lm.dtype, torch.float32)  # float64 models: float64 alpha (mixing.mix)
        a = torch.full(pos.shape, float(self.spec.alpha), dtype=work, device=pos.device)
        if self.spec.ramp:
            a = a * ((pos.to(work) + 1) / self.spec.ramp).clamp(max=1.0)
        return a * valid.to(work)

    def _run(self, ids, attention_mask, position_ids, cache):
        """Base-model forward (no LM head): last hidden state after the final norm."""
        out = self.base.lm.base_model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids,
                                      cache=cache, use_cache=cache is not None)
        return out.last_hidden_state

    def _head(self, top):
        return self.base.head(top)  # the family's head (and logit soft-cap, if any)

    def _mask(self, allowed, q_cols, k_cols):
        """The additive mask of a custom attention pattern, each layer's window applied (models.families)."""
        return self.base.family.attention_masks(self.base.config, allowed, q_cols, k_cols, self.base.lm.dtype)

    def _check(self, input_ids, attention_mask):
        check_inputs(self.base, input_ids, attention_mask)
        check_stepwise(self.base, attention_mask, "recirculation")  # its steps run one column (or block) a call

    @staticmethod
    def _check_mix_mask(mix_mask, input_ids) -> torch.Tensor | None:
        """`mix_mask` validated: None, or a bool tensor of the inputs' shape [batch, T] (one-line UserError)."""
        if mix_mask is None:
            return None
        if not isinstance(mix_mask, torch.Tensor) or mix_mask.dtype != torch.bool \
                or tuple(mix_mask.shape) != tuple(input_ids.shape):
            got = (f"{mix_mask.dtype} {list(mix_mask.shape)}" if isinstance(mix_mask, torch.Tensor)
                   else type(mix_mask).__name__)
            raise UserError(f"mix_mask must be a bool tensor of the inputs' shape {list(input_ids.shape)} "
                            f"([batch, T]), got {got}")
        return mix_mask.to(input_ids.device)

    def _masked_alpha(self, pos, valid, mix_mask) -> torch.Tensor:
        """`_alpha`, zeroed where `mix_mask` is False (no mask: unchanged, bit for bit)."""
        a = self._alpha(pos, valid)
        return a if mix_mask is None else a * mix_mask.to(a.device)

    # ----- sequential (exact) -----------------------------------------------------------------------------
    @_runs_in_eval
    @torch.no_grad()
    def sequential(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cols: torch.Tensor | None = None,
                   collect: bool = False, keep_cache: bool = False, *, start: int = 0, cache=None,
                   zs_prev: torch.Tensor | None = None, step_edit=None, edit=None, edit_depths=(),
                   record: bool = False, mix_mask: torch.Tensor | None = None,
                   skip_unmixed: bool = True) -> RecircOutput:
        """Exact recirculated prefill; outputs of the normal branch at `cols` (default: every column).

        `mix_mask` [batch, T] bool: mix only where True (targeted recirculation, module doc); None = every column.
        The machinery always runs here (an all-False mask matches the base model to float rounding).

        A patched run (interventions) starts at step `start` from the clean run's `cache` cropped to r_{<start-1}
        and `zs_prev` = z_{start-1,s}; `edit(depth, h)` rewrites the residual at `edit_depths` (before mixing and
        recording), and `step_edit(t, inj, c_r, c_n)` is called before step t (chunk column c_r = r_{t-1}, None at
        t = 0; c_n = n_t) to set that step's edits; it may return a context manager held for the step (hooks on
        modules inside the blocks). `record`: keep z_s, z_d and z' of every column (StepRecord).

        `skip_unmixed` (with a `mix_mask` only, so that an unmasked run makes T calls, as recirc_calls counts):
        columns before the first one mixed in any row (alpha = 0 there: before a targeted mask's key column, or
        padding) run as one parallel forward of the base model instead of one step each. Where nothing
        was mixed yet each recirculation branch is the normal branch (z' = z_d bit for bit), so this is the same
        computation up to float rounding of a batched forward (tested); it makes targeted recirculation at a key
        token near the end cost a prefill, not T steps. Only on a fresh run (start = 0, no edits, no record)."""
        self._check(input_ids, attention_mask)
        mix_mask = self._check_mix_mask(mix_mask, input_ids)
        B, T = input_ids.shape
        cols = _columns(cols, T)
        want = {int(c): j for j, c in enumerate(cols.tolist())}
        pos_all = positions_from_mask(attention_mask, T)
        valid = attention_mask.bool()
        alpha_all = self._masked_alpha(pos_all, valid, mix_mask)
        fresh = start == 0 and cache is None and zs_prev is None
        cache = new_cache() if cache is None else cache
        inj = _Injector(self.layers, self.spec, edit, edit_depths)
        inj.keep_mixed = record
        rec = ResidualRecorder(self.base) if collect else None
        logits = top = resid = None
        steps = None
        if record:
            D = self.base.d_model
            nan = lambda: torch.full((B, T, D), float("nan"), dtype=self.base.lm.dtype, device=input_ids.device)
            steps = StepRecord(nan(), nan(), nan())
        with sequential_threads():  # one-token steps: 1 thread (common.cpus)
            try:
                if rec is not None:
                    rec.__enter__()
                if skip_unmixed and mix_mask is not None and fresh and not record and step_edit is None \
                        and edit is None:
                    start, zs_prev, (logits, top, resid) = self._unmixed_prefix(
                        input_ids, pos_all, valid, alpha_all, cache, inj, rec, want, len(cols))
                for t in range(start, T):
                    if t == 0:
                        chunk, c_r, c_n = input_ids[:, :1], None, 0
                        inj.inject_cols = None
                    else:
                        chunk, c_r, c_n = input_ids[:, t - 1:t + 1], 0, 1
                        inj.inject_cols, inj.inject_zs = torch.tensor([0]), zs_prev[:, None]
                        inj.inject_alpha = alpha_all[:, t - 1:t]
                    inj.record_cols = torch.tensor([c_n])
                    inj.zs_edit = inj.mixed_edit = None
                    held = step_edit(t, inj, c_r, c_n) if step_edit is not None else None
                    j = want.get(t)
                    if rec is not None:
                        rec.cols = torch.tensor([c_n]) if j is not None else None
                    k = t + 1
                    q = chunk.shape[1]
                    allowed = valid[:, None, :k] & _on(valid, torch.arange(k)[None, :] <= torch.arange(k - q, k)[:, None])[None]
                    fmask = self._mask(allowed, torch.arange(k - q, k), torch.arange(k))
                    with held if held is not None else nullcontext():
                        h = self._run(chunk, fmask, pos_all[:, t + 1 - q:t + 1], cache)
                    zs_prev = inj.zs[:, 0]
                    if steps is not None:
                        steps.zs[:, t] = zs_prev
                        if t > 0:
                            steps.zd[:, t - 1], steps.mixed[:, t - 1] = inj.zd[:, 0], inj.mixed[:, 0]
                    cache.crop(-1)  # drop n_t's keys/values; r_t replaces them at the next step
                    if j is not None:
                        hn = h[:, c_n]
                        if logits is None:
                            like = dict(dtype=hn.dtype, device=hn.device)  # the model's device, not the host
                            logits = torch.empty(B, len(cols), self.config.vocab_size, **like)
                            top = torch.empty(B, len(cols), hn.shape[-1], **like)
                            if collect:
                                resid = torch.empty(B, len(cols), self.n_layers + 1, hn.shape[-1], **like)
                        logits[:, j] = self._head(hn)
                        top[:, j] = hn
                        if rec is not None:
                            resid[:, j] = rec.take()[:, 0]
            finally:
                inj.remove()
                if rec is not None:
                    rec.__exit__(None, None, None)
        # The cache now holds r_{<T-1} only (n_{T-1} was cropped): `generate` feeds [r_{T-1}, n_T] next.
        return RecircOutput(logits, top, resid, cache if keep_cache else None, zs_prev, steps)

    def _unmixed_prefix(self, input_ids, pos_all, valid, alpha_all, cache, inj, rec, want, n_cols):
        """`sequential`'s skip_unmixed: columns 0..p (p = the first column mixed in any row, or T-1) in one
        causal forward; the cache keeps columns < p (= r_{<p}: nothing was mixed there) and z_{p,s} is fed at
        step p + 1. Returns (first step to run, z_{p,s}, (logits, top, resid) with the wanted columns <= p filled,
        allocated as the loop allocates them, or Nones); (0, None, (None,) * 3) where there is nothing to skip."""
        B, T = input_ids.shape
        mixed_cols = (alpha_all != 0).any(0).nonzero()
        p = min(int(mixed_cols[0]), T - 1) if len(mixed_cols) else T - 1
        if p < 1:
            return 0, None, (None, None, None)
        k = p + 1
        allowed = valid[:, None, :k] & _on(valid, torch.arange(k)[None, :] <= torch.arange(k)[:, None])[None]
        fmask = self._mask(allowed, torch.arange(k), torch.arange(k))
        inj.inject_cols, inj.record_cols = None, torch.tensor([p])
        here = [(t, j) for t, j in want.items() if t <= p]
        if rec is not None:
            rec.cols = torch.tensor([t for t, _ in here]) if here else None
        h = self._run(input_ids[:, :k], fmask, pos_all[:, :k], cache)  # [batch, p+1, d_model]
        cache.crop(-1)  # n_p's keys/values; r_p (mixed) replaces them at step p + 1
        logits = top = resid = None
        if here:
            hn = h[:, [t for t, _ in here]]
            like = dict(dtype=hn.dtype, device=hn.device)
            logits = torch.empty(B, n_cols, self.config.vocab_size, **like)
            top = torch.empty(B, n_cols, hn.shape[-1], **like)
            jj = [j for _, j in here]
            logits[:, jj], top[:, jj] = self._head(hn), hn
            if rec is not None:
                resid = torch.empty(B, n_cols, self.n_layers + 1, hn.shape[-1], **like)
                resid[:, jj] = rec.take()
        return k, inj.zs[:, 0], (logits, top, resid)

    # ----- blockwise / Jacobi -----------------------------------------------------------------------------
    @_runs_in_eval
    @torch.no_grad()
    def blockwise(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, passes: int = 2,
                  block: int | None = None, cols: torch.Tensor | None = None, collect: bool = False,
                  mix_mask: torch.Tensor | None = None) -> RecircOutput:
        """Jacobi approximation: per block, pass 0 standard, then `passes` parallel [r | n] passes.

        `mix_mask` [batch, T] bool: mix only where True (targeted recirculation, module doc); None = every column.
        """
        self._check(input_ids, attention_mask)
        if self.base.family.own_causal_bias:  # each column's two branches are queries at once (models.families)
            raise UserError(f"blockwise recirculation on {self.base.config.model_type}: its attention applies a causal "
                            "mask of its own that the blockwise passes' pattern cannot pass; use sequential")
        mix_mask = self._check_mix_mask(mix_mask, input_ids)
        if not (isinstance(passes, int) and passes >= 1):
            raise UserError(f"blockwise recirculation needs passes >= 1, got {passes!r}")
        B, T = input_ids.shape
        block = T if block is None else int(block)
        if block < 1:
            raise UserError(f"block size must be >= 1, got {block}")
        cols = _columns(cols, T)
        pos_all = positions_from_mask(attention_mask, T)
        valid = attention_mask.bool()
        alpha_all = self._masked_alpha(pos_all, valid, mix_mask)
        dtype = self.base.lm.dtype
        cache = new_cache()
        inj = _Injector(self.layers, self.spec)
        rec = ResidualRecorder(self.base) if collect else None
        like = dict(dtype=dtype, device=input_ids.device)
        logits = torch.empty(B, len(cols), self.config.vocab_size, **like)
        top = torch.empty(B, len(cols), self.base.d_model, **like)
        resid = torch.empty(B, len(cols), self.n_layers + 1, self.base.d_model, **like) if collect else None
        try:
            if rec is not None:
                rec.__enter__()
            for c0 in range(0, T, block):
                c1 = min(T, c0 + block)
                b = c1 - c0
                ids = input_ids[:, c0:c1]
                pos = pos_all[:, c0:c1]
                kv = valid[:, :c1]
                causal = _on(valid, torch.arange(c1)[None, :] <= torch.arange(c0, c1)[:, None])  # [b, c1]
                # pass 0: standard forward of the block (n attends to n within the block: the first guess)
                inj.inject_cols, inj.record_cols = None, torch.arange(b)
                if rec is not None:
                    rec.cols = None  # pass 0 is never recorded (the previous block's last pass left its columns)
                self._run(ids, self._mask(kv[:, None] & causal[None], torch.arange(c0, c1), torch.arange(c1)), pos,
                          cache)
                zs = inj.zs
                cache.crop(-b)
                # [r-half | n-half] mask: keys = past r (c0 columns) + r-half (b) + n-half (b)
                past = kv[:, None, :c0].expand(B, b, c0)
                r_self = causal[None, :, c0:] & kv[:, None, c0:c1]  # r_i -> r_j, j <= i
                strict = _on(valid, torch.arange(b)[None, :] < torch.arange(b)[:, None])
                n_r = strict[None] & kv[:, None, c0:c1]  # n_i -> r_j, j < i
                eye = torch.eye(b, dtype=torch.bool, device=valid.device)[None].expand(B, b, b)  # n_i -> n_i
                none = torch.zeros(B, b, b, dtype=torch.bool, device=valid.device)
                allowed = torch.cat([torch.cat([past, r_self, none], -1), torch.cat([past, n_r, eye], -1)], 1)
                fmask = self._mask(allowed, torch.arange(c0, c1).repeat(2),
                                   torch.cat([torch.arange(c1), torch.arange(c0, c1)]))
                ids2 = torch.cat([ids, ids], 1)
                pos2 = torch.cat([pos, pos], 1)
                for k in range(passes):
                    last = k == passes - 1
                    inj.inject_cols, inj.inject_zs = torch.arange(b), zs
                    inj.inject_alpha = alpha_all[:, c0:c1]
                    inj.record_cols = torch.arange(b, 2 * b)
                    sel = [(j, int(c) - c0) for j, c in enumerate(cols.tolist()) if c0 <= int(c) < c1]
                    if rec is not None:
                        rec.cols = torch.tensor([b + i for _, i in sel]) if (last and sel) else None
                    h = self._run(ids2, fmask, pos2, cache)
                    zs = inj.zs
                    cache.crop(-b if last else -2 * b)  # keep r-half only after the final pass
                    if last and sel:
                        js = torch.tensor([j for j, _ in sel])
                        hs = h[:, torch.tensor([b + i for _, i in sel])]
                        top[:, js] = hs
                        logits[:, js] = self._head(hs)
                        if rec is not None:
                            resid[:, js] = rec.take()
        finally:
            inj.remove()
            if rec is not None:
                rec.__exit__(None, None, None)
        return RecircOutput(logits, top, resid)

    # ----- base model (identity) --------------------------------------------------------------------------
    @torch.no_grad()
    def _base(self, input_ids, attention_mask, cols, collect) -> RecircOutput:
        with maybe_record(self.base, collect) as rec:
            if rec is not None:
                rec.cols = cols
            out = self.base(input_ids, attention_mask)
            resid = rec.take() if rec is not None else None
        return RecircOutput(out.logits[:, cols], out.top[:, cols], resid)

    @_runs_in_eval
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, method: str = "sequential",
                cols: torch.Tensor | None = None, collect: bool = False, passes: int = 2,
                block: int | None = None, mix_mask: torch.Tensor | None = None) -> RecircOutput:
        """Normal-branch outputs at `cols` (default all). method: sequential (exact) | blockwise (Jacobi).

        `mix_mask` [batch, T] bool: mix only where True (targeted recirculation: e.g. only the key token's column,
        whose recirculated keys/values every later token attends to); None = every column. A mask with no real
        column set is the identity: like alpha = 0, the base model's forward (bit for bit) unless
        bypass_identity=False."""
        if method not in ("sequential", "blockwise"):
            raise UserError(f"unknown recirculation method {method!r} (sequential or blockwise)")
        self._check(input_ids, attention_mask)
        mix_mask = self._check_mix_mask(mix_mask, input_ids)
        cols = _columns(cols, input_ids.shape[1], distinct=False)
        uniq, back = torch.unique(cols, return_inverse=True)
        if len(uniq) < len(cols):  # a column asked for twice: computed once (the runs fill distinct columns)
            out = self.prefill(input_ids, attention_mask, method, uniq, collect, passes, block, mix_mask)
            return replace(out, logits=out.logits[:, back], top=out.top[:, back],
                           resid=None if out.resid is None else out.resid[:, back])
        no_mixing = mix_mask is not None and not bool((mix_mask & attention_mask.bool()).any())
        if (self.spec.is_identity or no_mixing) and self.bypass_identity:
            return self._base(input_ids, attention_mask, cols, collect)
        if method == "sequential":
            return self.sequential(input_ids, attention_mask, cols, collect, mix_mask=mix_mask)
        return self.blockwise(input_ids, attention_mask, passes, block, cols, collect, mix_mask=mix_mask)

    # ----- generation -------------------------------------------------------------------------------------
    @_runs_in_eval
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy generation under recirculation (exact sequential prefill, then one [r_{t-1}, n_t] step per token).

        Returns new token ids [batch, max_new_tokens]. Identity mixing = the base model's cached greedy decoding.
        """
        from engine.decode import check_finite_steps, check_generation, next_token

        self._check(input_ids, attention_mask)
        input_ids, attention_mask = check_generation(self.base, input_ids, attention_mask, max_new_tokens)
        check_stepwise(self.base, attention_mask, "recirculated generation", new_tokens=max(max_new_tokens - 1, 0))
        B, T = input_ids.shape
        if max_new_tokens == 0:
            return input_ids.new_zeros((B, 0))
        if self.spec.is_identity and self.bypass_identity:
            from engine.decode import greedy

            return greedy(self.base, input_ids, attention_mask, max_new_tokens)
        out = self.sequential(input_ids, attention_mask, cols=torch.tensor([T - 1]), keep_cache=True)
        cache, zs, logits = out.cache, out.last_zs, out.logits[:, 0]
        mask = attention_mask
        prev = input_ids[:, -1]
        inj = _Injector(self.layers, self.spec)
        new, ok = [], torch.ones(B, dtype=torch.bool, device=logits.device)
        with sequential_threads():  # one-token steps: 1 thread (common.cpus)
            try:
                for step in range(max_new_tokens):
                    tok, finite = next_token(logits)
                    new.append(tok)
                    ok = ok & finite
                    if step == max_new_tokens - 1:
                        break
                    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
                    pos = positions_from_mask(mask, 2)
                    inj.inject_cols, inj.inject_zs = torch.tensor([0]), zs[:, None]
                    inj.inject_alpha = self._alpha(pos[:, :1], mask[:, -2:-1].bool())
                    inj.record_cols = torch.tensor([1])
                    chunk = torch.stack([prev, tok], 1)
                    h = self._run(chunk, mask, pos, cache)
                    cache.crop(-1)
                    zs, prev = inj.zs[:, 0], tok
                    logits = self._head(h[:, 1])
            finally:
                inj.remove()
        check_finite_steps(ok, logits.dtype)
        return torch.stack(new, 1)


def lm_only(model: FullBandwidthLM | PreTrainedModel) -> FullBandwidthLM:
    """The model recirculation runs: the LM alone (a fusion module, if any, is left out, never run)."""
    if isinstance(model, FullBandwidthLM) and not model.has_fusion:
        return model
    return _wrapped(model.lm if isinstance(model, FullBandwidthLM) else model)


def _wrapped(lm: PreTrainedModel) -> FullBandwidthLM:
    """`lm` in a FullBandwidthLM without fusion, the caller's modules untouched: the wrapper takes the LM's mode
    as its own flag only (`.eval()` on it would set the caller's whole model to eval mode for good, also when the
    call is then refused); RecirculatedLM's runs on it happen in eval mode, the caller's modes put back afterwards
    (`_runs_in_eval`: deterministic as they were when the wrapper was `.eval()`ed)."""
    w = FullBandwidthLM(lm, fusion=False)
    w.training = lm.training
    w._eval_runs = True  # its runs happen in eval mode, as they did when it was `.eval()`ed (_runs_in_eval)
    return w


def recirc_calls(spec: RecircSpec, T: int) -> int:
    """Model calls (calls of block 0) of the exact sequential prefill on T columns: identity mixing is the base
    model's one parallel forward, anything else one 2-token step per column."""
    return 1 if spec.is_identity else T


# ----- the probes.run hook ----------------------------------------------------------------------------------
def recirculated_prefill(model: FullBandwidthLM | PreTrainedModel, spec: RecircSpec | str,
                         input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: tuple[int, ...] = (-1,),
                         collect: bool = True, method: str = "sequential", passes: int = 2,
                         block: int | None = None, mix_mask: torch.Tensor | None = None):
    """Like engine.prefill.prefill for a recirculated model: a PrefillResult (normal branch) for a left-padded batch.

    `spec` may be the --recirculate string 's:d:alpha[:convex|residual][:rampN]'. positions: negative offsets from the end.
    `mix_mask` [batch, T] bool (columns of the padded batch): targeted recirculation, mixing only where True
    (e.g. the key token's column only: every later token attends to its recirculated keys/values); None = every
    column (RecirculatedLM.prefill).
    """
    from engine.result import PrefillResult

    base = lm_only(model)
    if isinstance(spec, str):
        spec = parse_recirculate(spec, base.n_layers)
    rlm = RecirculatedLM(base, spec)
    T = input_ids.shape[1]
    positions = tuple(int(p) for p in positions)
    if any(not (-T <= p <= -1) for p in positions):
        raise UserError(f"positions must be negative offsets in -{T}..-1, got {positions}")
    cols = torch.tensor([T + p for p in positions])
    out = rlm.prefill(input_ids, attention_mask, method=method, cols=cols, collect=collect, passes=passes,
                      block=block, mix_mask=mix_mask)
    return PrefillResult(spec.name, positions, out.logits, out.top, out.resid)


__all__ = ["RecircSpec", "RecirculatedLM", "RecircOutput", "parse_recirculate", "mix", "recirculated_prefill",
           "recirc_calls", "lm_only", "MODES"]
