"""Patched runs of every mechanism: the one patching routine the engine offers (interventions.core is its client).

A patched run takes a list of `Patch`es (a site, a position, a tensor or an engine.edits object), runs
the mode's computation over the whole batch with the patched values substituted and returns the logits at the
probed position T. A patch at column t (or at Jacobi pass k of fused-n) is followed by the rest of the
computation RECOMPUTED from the patched value: it propagates.

Sites (positions are negative column offsets of the left-padded batch: -1 = T, -2 = T-1, ..., -T = column 0;
columns are aligned from the end)
    state   the state entering the fusion at position t (h_{t-1} of the mode's own run)
    fused   the fusion's output at t (the fused input u_t of block 0)
    resid   the residual stream at (depth, t): depth 0 = the vector entering block 0 (embedding or fused
            input), depth l = output of 0-based block l - 1, the input of block l (raw, before the final norm)
    attn_out, mlp_out (layer), head (layer, head)
            inside block `layer` (0-based): what the attention and the MLP add to the residual stream (after
            the branch's post-norm in sandwich-norm models), one head's output before the output projection
            (value [B, head_dim]); TransformerLens' hook_attn_out / hook_mlp_out / hook_z
    Under recirculation `state` is z_{t-1,s} (the source-depth state recirculated from t-1), `fused` is
    z'_{t-1,d} (the mixed vector entering t-1's recirculation branch) and `resid` / block sites the token's own
    normal branch, both branches at and below the target depth d (RecircPatcher); `rresid` (depth d+1..L, a
    column before T) is the recirculation branch's own residual, the one later tokens read.
A state/fused patch matters only where the mode fuses (the fuse mask: previous and current column real tokens
of the row); a patch at a padding column of a row has no effect on that row.

Modes (engine.modes.parse_mode; canonical names)
    standard        one parallel forward; resid and block sites (no fusion runs)
    recurrent-k     standard prefill of all T columns with a KV cache, then columns r0 = T - min(k, T-1) .. T-1
                    recomputed one token at a time, each fused with the previous column's top state.
                    recurrent-full = recurrent-(T-1). state/fused sites exist at columns >= r0.
    fused-n         n parallel Jacobi passes after the standard pass 0; pass k fuses pass k-1's top states
                    shifted right. `Patch.pass_` names the pass (default: the last, n); state/fused sites exist
                    at passes 1..n, resid at 0..n.
    recirc-S:D:A    the exact sequential recirculation engine (engine.recirculation), on the model's LM.
Cost and sharing
    recurrent: the clean run's final KV cache holds every column's keys/values (they never change once
        computed), so the prefix of a patch at column t >= r0 is a copy of the clean cache cropped to t columns
        plus the clean top state of t-1 (engine.prefill.cache_prefix): computed once per batch, shared by every
        condition. The run is then the patched step at t and plain cached steps t+1..T-1 (T - t steps, at most
        one recurrent-full run). A resid patch at a column < r0 reruns the standard prefill patched (one
        parallel forward) and then the k steps.
    fused-n: the clean passes' top states are kept; a patch at pass k reuses pass k-1's and reruns passes
        k..n (n - k + 1 parallel forwards).
    recirculation: the clean run's final cache holds r_0..r_{T-2}; a patch whose first step is t0 starts from its
        first t0-1 columns and z_{t0-1,s} and runs steps t0..T-1. At alpha = 0 state / fused edits change
        nothing (the clean logits are returned) and resid / block patches are the base model's standard patch.
    standard: the columns from the first patched one on the clean cache (a shift by value - clean value).
    State patches need no hook: the state is an explicit argument of the step / pass. fused and resid patches
    use the engine's one hook helper (engine.hooks.patched) for the forward where they apply; every forward is
    an engine primitive (the standard pass, engine.prefill.recurrent_step / recurrent_run / jacobi_pass).
`patcher(mode, model, ids, mask)` builds the mechanism's patcher; interventions.core.CausalContext
checks that every clean run equals the engine's prefill (engine.prefill.prefill_many) bit for bit.
"""
from __future__ import annotations

import functools
import numbers
from abc import ABC, abstractmethod
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from common.errors import UserError
from engine.cache import new_cache
from engine.edits import Edit, Lambda, apply
from engine.hooks import Hooks, ResidualRecorder, blocks_addressable, on_depth, patched, put_columns
from engine.inputs import check_inputs, check_stepwise
from engine.modes import Mode
from engine.prefill import (cache_prefix, iter_fused, jacobi_pass, positions_from_mask, recurrent_run, recurrent_start,
                            recurrent_steps, shift_state)
from engine.recirculation import RecirculatedLM, lm_only
from models.families import family_of
from models.full_bandwidth import FullBandwidthLM, decoder_layers

SITES = ("state", "fused", "resid", "rresid", "attn_out", "mlp_out", "head")
BLOCK_SITES = ("attn_out", "mlp_out", "head")  # inside block `layer` (engine.hooks.on_block)


def pos_name(pos: int) -> str:
    """-1 -> 'T', -3 -> 'T-2'."""
    return "T" if pos == -1 else f"T{pos + 1}"


@dataclass(frozen=True)
class Patch:
    """Replace the activation at `site` (and `depth` for resid), column `pos`, by `value` [B, D], row by row.

    Block sites (`attn_out`, `mlp_out`, `head`) name block `layer` (0-based, TransformerLens' blocks.{layer});
    `head` the head whose output (value [B, head_dim], before the output projection) is replaced.
    `pass_`: fused-n only, the Jacobi pass (None = the last); ignored by the other modes. `rows` (state patches
    only): a bool [B] mask of the rows patched, the others left as the run has them (several patches at
    different positions then patch each row at its own position in one run)."""

    site: str
    value: torch.Tensor | Edit  # a tensor (= Replace), or an engine.edits object applied to the run's own value
    depth: int = 0
    pos: int = -1
    pass_: int | None = None
    rows: torch.Tensor | None = None
    layer: int | None = None
    head: int | None = None

    def __post_init__(self):
        if self.site not in SITES:
            raise UserError(f"unknown patch site {self.site!r} (use one of {', '.join(SITES)})")
        if not isinstance(self.value, (torch.Tensor, Edit)):
            raise UserError(f"a patch value is a torch tensor [batch, width] or an engine.edits object, got "
                            f"{type(self.value).__name__}")
        if isinstance(self.value, torch.Tensor) and self.value.ndim != 2:
            raise UserError(f"a patch value tensor must be [batch, width], got shape {tuple(self.value.shape)}")
        if isinstance(self.pos, bool) or not isinstance(self.pos, int) or self.pos >= 0:
            raise UserError(f"patch position must be a negative column offset (-1 = T), got {self.pos!r}")
        for name in ("depth", "layer", "head", "pass_"):  # an int (numpy's too), not a float or a bool (True = 1)
            v = getattr(self, name)
            if v is not None and (isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral) or v < 0):
                raise UserError(f"patch {name.rstrip('_')} must be a non-negative integer, got {v!r}")
            if v is not None:
                object.__setattr__(self, name, int(v))
        if (self.site in BLOCK_SITES) != (self.layer is not None) or (self.site == "head") != (self.head is not None):
            raise UserError("attn_out / mlp_out / head patches need `layer` (head patches also `head`); other "
                            "sites take neither")
        if self.rows is not None and (self.site != "state" or not isinstance(self.rows, torch.Tensor)
                                      or self.rows.dtype != torch.bool
                                      or (isinstance(self.value, torch.Tensor)
                                          and tuple(self.rows.shape) != (self.value.shape[0],))):
            raise UserError("patch rows must be a bool [batch] mask, and only on state patches")


@dataclass
class RunOut:
    logits: torch.Tensor  # [B, V] at T
    top: torch.Tensor | None = None  # clean runs: [B, T, D] top state at every column (last pass for fused-n)
    resid: torch.Tensor | None = None  # clean runs: [B, T, L+1, D] residual stream (last pass for fused-n)
    reads: dict = field(default_factory=dict)


# ----- the one hook helper, as the runners use it ---------------------------------------------------------
def _hooks(model: FullBandwidthLM, patches, col_of):
    """The engine's hook helper substituting the fused/resid/block `patches` at column col_of(p) of the current
    call."""
    fused = [(col_of(p), p.value) for p in patches if p.site == "fused"]
    resid: dict[int, list] = {}
    blocks: dict[tuple, list] = {}
    for p in patches:
        if p.site == "resid":
            resid.setdefault(p.depth, []).append((col_of(p), p.value))
        elif p.site in BLOCK_SITES:
            blocks.setdefault((p.site, p.layer, p.head), []).append((col_of(p), p.value))
    return patched(model, fused, resid, blocks)


# ----- one runner per mode ------------------------------------------------------------------------------------
class Patcher(ABC):
    kind = ""

    def __init__(self, model: FullBandwidthLM, ids, mask, mode: Mode):
        self.model, self.ids, self.mask, self.mode = model, ids, mask, mode
        self.T = ids.shape[1]
        self.layers = decoder_layers(model.lm)
        self.L = len(self.layers)

    def stack(self):
        """A context in which the model's block list is the one this patcher's runs use (hooks registered inside
        it reach them; loop-R: the unrolling of R iterations)."""
        return nullcontext()

    def col(self, p: Patch) -> int:
        c = self.T + p.pos
        if c < 0:
            raise UserError(f"patch position {p.pos} out of range for prompts of {self.T} columns")
        return c

    def run(self, patches) -> torch.Tensor:
        """Logits at T [B, V] of the run with `patches` applied, each checked first (`check`): a patch this
        mechanism cannot apply is one UserError, never dropped or misplaced silently."""
        patches = list(patches)
        for p in patches:
            self.check(p)
        return self._run(patches)

    @abstractmethod
    def _run(self, patches) -> torch.Tensor:
        """The mechanism's patched run of checked `patches` (each subclass's own)."""

    def check(self, p: Patch) -> None:
        """Refuse (UserError) a patch this mechanism cannot apply: its own `check_site`, then a fed site the run
        never reaches (the patch would be dropped and the clean logits returned as its effect: a new mechanism's
        patcher gets this guard whatever its `check_site` says), then a value or row mask not of this batch."""
        self.check_site(p)
        if p.site in ("state", "fused") and p.pos not in self._fed_offsets:
            raise UserError(f"{self.mode.name} takes no fed state at {pos_name(p.pos)}: no {p.site} site there")
        B, width = self.ids.shape[0], self.value_width(p)
        if isinstance(p.value, torch.Tensor) and tuple(p.value.shape) != (B, width):
            raise UserError(f"patch value must be [batch={B}, {width}], got {tuple(p.value.shape)}")
        if p.rows is not None and tuple(p.rows.shape) != (B,):
            raise UserError(f"patch rows must be a bool mask [batch={B}], got shape {tuple(p.rows.shape)}")

    @functools.cached_property
    def _fed_offsets(self) -> frozenset:
        """fused_positions() as a set, once: a sweep checks a patch per position."""
        return frozenset(self.fused_positions())

    def check_site(self, p: Patch) -> None:
        """The checks every mechanism shares (positions, depths, layers, heads); a subclass adds its own."""
        self.col(p)
        if p.site == "rresid":
            raise UserError(f"{self.mode.name} has no recirculation branch: the rresid site exists under "
                            "recirc-S:D:A modes only")
        if p.site == "resid" and not 0 <= p.depth <= self.L:
            raise UserError(f"patch depth {p.depth} out of range 0..{self.L}")
        if p.site in BLOCK_SITES and not blocks_addressable(self.model):
            raise UserError(f"a looped model's unrolled blocks share their modules: no {p.site} site of one "
                            "iteration's block to patch (its resid sites are addressable)")
        if p.site in BLOCK_SITES and not 0 <= p.layer < self.L:
            raise UserError(f"patch layer {p.layer} out of range 0..{self.L - 1}")
        if p.site == "head":
            n_heads = family_of(self.model.lm).heads(self.model.config)
            if not 0 <= p.head < n_heads:
                raise UserError(f"patch head {p.head} out of range 0..{n_heads - 1}")

    def value_width(self, p: Patch) -> int:
        """The width a patch value must have: d_model, or head_dim for a head's output."""
        if p.site == "head":
            return family_of(self.model.lm).head_dim(self.model.config)
        return self.model.d_model

    def fused_positions(self) -> list[int]:
        return []

    # how the report names this mechanism's fed state and its bypass (interventions.suite.describe)
    words = {"state": "h_{T-1}", "noun": "the fused state", "site": "the state entering the fusion at T",
             "site_t": "the state entering the fusion at t",
             "gate_bypass": "e_T fed to block 0 instead of the fused input",
             "gate_bypass_all": "e_t fed to block 0 instead of the fused input at every position (= standard "
                                "prefill)"}

    def is_clean_pass(self, pass_) -> bool:
        """Whether `pass_` names the pass of the clean run's record (every mode has one but fused-n)."""
        return True

    def bypass_value(self, pos: int) -> torch.Tensor:
        """What the fused site holds at `pos` without feedback: the token embedding e_t."""
        return self.model.embed(self.ids[:, self.T + pos])


class StandardPatcher(Patcher):
    kind = "standard"

    def __init__(self, model, ids, mask, mode):
        super().__init__(model, ids, mask, mode)
        self.cache = new_cache()  # every column's keys/values: a patch at column c reruns only columns c..T-1
        with ResidualRecorder(model) as rec:
            rec.cols = torch.arange(self.T)
            out = model(ids, mask, cache=self.cache, use_cache=True)
            resid = rec.take()
        self.positions = positions_from_mask(mask, self.T)
        self.clean = RunOut(out.logits[:, -1], out.top, resid)

    def check_site(self, p):
        super().check_site(p)
        if p.site in ("state", "fused"):
            raise UserError("standard prefill has no fused state: only resid and block-site patches apply")

    def _suffix(self, c0: int, patches) -> torch.Tensor:
        """Logits at T of columns c0..T-1 run on the clean cache of columns 0..c0-1, each resid patch applied
        as a shift by (value - the clean full pass's value there)."""
        with Hooks() as hooks:
            for p in patches:
                delta = p.value - self.clean.resid[:, self.col(p), p.depth]  # [B, D]; 0 where nothing changes
                hooks.add(on_depth(self.layers, p.depth, lambda h, c=self.col(p) - c0, delta=delta:
                                   put_columns(h, [(c, h[:, c] + delta.to(h.dtype))])))
            return self.model(self.ids[:, c0:], self.mask, cache=cache_prefix(self.cache, c0), use_cache=True,
                              last_logits=True,
                              position_ids=self.positions[:, c0:]).logits[:, -1]

    def _run(self, patches) -> torch.Tensor:
        # Columns before the first patched one are the clean run's (causal attention): start from its cache
        # there, as the recurrent runner does, so a patch near T costs a few columns, not a whole forward. Each
        # patch enters the suffix as a shift by (value - clean value). The suffix is the patched forward up to float
        # rounding (a shorter call rounds differently from the clean full pass, ~1e-6), so a row whose every patch
        # changes nothing (an identity, or a donor value equal to its own) takes the clean logits instead, exactly;
        # rows are independent, so the others are untouched by that choice (tests/test_interventions.py holds
        # both). One suffix a patch: an earlier version subtracted an unpatched suffix, cached per start column,
        # which a benchmark repeating one column measured at half a sweep's real cost. Patches this path cannot
        # take (column 0, block sites, several depths) run the full patched forward, whose head over one column
        # rounds differently from the clean pass's over all: an identity there matches the clean logits to ~1e-7.
        c0 = min(self.col(p) for p in patches)
        # A shift equals a replacement only where no other patch of the run changed the site first: patches at
        # one depth cannot reach each other (a residual at depth d reads depths < d only), patches at two can.
        one_depth = (all(p.site == "resid" and isinstance(p.value, torch.Tensor) for p in patches)
                     and len({p.depth for p in patches}) == 1
                     and len({self.col(p) for p in patches}) == len(patches))
        if c0 == 0 or not one_depth:
            with _hooks(self.model, patches, self.col):
                return self.model(self.ids, self.mask, last_logits=True).logits[:, -1]
        unchanged = torch.ones(self.ids.shape[0], dtype=torch.bool, device=self.clean.logits.device)
        for p in patches:
            clean = self.clean.resid[:, self.col(p), p.depth]
            unchanged &= (p.value.to(clean.device, clean.dtype) == clean).all(-1).to(unchanged.device)
        if bool(unchanged.all()):
            return self.clean.logits.clone()
        return torch.where(unchanged[:, None], self.clean.logits, self._suffix(c0, patches))

    def resid(self, pass_=None):
        return self.clean.resid


def _state_patches(patches, prev: torch.Tensor) -> torch.Tensor:
    """The fed state after `patches` (state site, one column), each on its rows (all rows when rows is None)."""
    for p in patches:
        v = apply(p.value, prev)
        prev = v if p.rows is None else torch.where(p.rows.to(v.device)[:, None], v, prev)
    return prev


class RecurrentPatcher(Patcher):
    kind = "recurrent"

    def __init__(self, model, ids, mask, mode):
        super().__init__(model, ids, mask, mode)
        check_stepwise(model, mask, mode.name, steps=mode.n)  # before its clean run, whoever builds it
        T = self.T
        self.r0 = recurrent_start(T, mode.n)
        with ResidualRecorder(model) as rec:
            run = recurrent_run(model, ids, mask, mode.n, torch.arange(T), rec, full_cache=True)
        self.cache = run.cache  # every column's keys/values: the shared prefix of every patched run
        self.std_logits = run.std.logits[:, -1]
        self.clean = RunOut(run.logits[:, -1], run.top, run.resid)

    def fused_positions(self):
        return list(range(self.r0 - self.T, 0))

    def check_site(self, p):
        super().check_site(p)
        if p.site in ("state", "fused") and self.col(p) < self.r0:
            raise UserError(f"{self.mode.name} fuses only positions {pos_name(self.r0 - self.T)}..T: no "
                            f"{p.site} site at {pos_name(p.pos)}")

    def state(self, pos: int, pass_=None) -> torch.Tensor:
        c = self.T + pos
        if not self.r0 <= c < self.T:
            raise UserError(f"{self.mode.name} has no fed state at {pos_name(pos)}")
        return self.clean.top[:, c - 1]

    def resid(self, pass_=None):
        return self.clean.resid

    def _run(self, patches) -> torch.Tensor:
        model, ids, mask, T = self.model, self.ids, self.mask, self.T
        cols = [self.col(p) for p in patches]
        t0 = min(cols)
        if t0 >= self.r0:  # shared clean prefix
            cache = cache_prefix(self.cache, t0)
            prev, start = self.clean.top[:, t0 - 1], t0
        else:  # a patch in the standard part: rerun the standard prefill patched, then every step
            pre = [p for p, c in zip(patches, cols) if c < self.r0]
            cache = new_cache()
            with _hooks(model, pre, self.col):
                std = model(ids, mask, cache=cache, use_cache=True, last_logits=True)
            cache.crop(-(T - self.r0))
            prev, start = std.top[:, self.r0 - 1], self.r0
            if start == T:
                return std.logits[:, -1]
        at = {}
        for p, c in zip(patches, cols):
            at.setdefault(c, []).append(p)
        edits = {t: Lambda(lambda prev, ps=[p for p in ps if p.site == "state"]: _state_patches(ps, prev))
                 for t, ps in at.items() if any(p.site == "state" for p in ps)}

        def step_hooks(t):
            other = [p for p in at.get(t, ()) if p.site != "state"]
            return _hooks(model, other, lambda p: 0) if other else None

        for _, out in recurrent_steps(model, ids, mask, start, prev, cache, state_edits=edits,
                                      step_hooks=step_hooks, logits_at=(T - 1,)):  # the head at T alone
            pass
        return out.logits[:, 0].clone()  # made in inference mode (engine.decode.step_loop): an ordinary copy


class FusedPatcher(Patcher):
    kind = "fused"

    def __init__(self, model, ids, mask, mode):
        super().__init__(model, ids, mask, mode)
        self.n = mode.n
        self.tops = []
        for _, out in iter_fused(model, ids, mask, self.n, heads="last"):  # the clean logits at T: the last pass
            self.tops.append(out.top)
        self._resid: dict[int, torch.Tensor] = {}
        self.clean = RunOut(out.logits[:, -1], out.top, None)
        self.clean.resid = self.resid(self.n)

    def fused_positions(self):
        return list(range(1 - self.T, 0))

    def is_clean_pass(self, pass_) -> bool:
        return pass_ is None or pass_ == self.n

    def pass_of(self, p: Patch) -> int:
        return self.n if p.pass_ is None else p.pass_

    def check_site(self, p):
        super().check_site(p)
        k = self.pass_of(p)
        if not 0 <= k <= self.n:
            raise UserError(f"{self.mode.name} has passes 0..{self.n}, not {k}")
        if p.site in ("state", "fused") and k == 0:
            raise UserError("pass 0 of fused-n is the standard pass: no fused state")

    def state(self, pos: int, pass_=None) -> torch.Tensor:
        k = self.n if pass_ is None else pass_
        c = self.T + pos
        if not (1 <= k <= self.n and 1 <= c < self.T):
            raise UserError(f"{self.mode.name} has no fed state at {pos_name(pos)} of pass {k}")
        return self.tops[k - 1][:, c - 1]

    def _pass(self, k, top_prev, patches):
        model, ids, mask = self.model, self.ids, self.mask
        with _hooks(model, [p for p in patches if p.site != "state"], self.col):
            if k == 0:
                return model(ids, mask, last_logits=True)
            sp = [p for p in patches if p.site == "state"]
            state = None
            if sp:
                state = shift_state(top_prev, mask)[0]
                for p in sp:
                    c = self.col(p)
                    v = apply(p.value, state[:, c])
                    state[:, c] = v if p.rows is None else torch.where(p.rows.to(v.device)[:, None], v, state[:, c])
            return jacobi_pass(model, ids, mask, top_prev, state=state, last_logits=True)

    def resid(self, pass_=None) -> torch.Tensor:
        k = self.n if pass_ is None else pass_
        if k not in self._resid:
            with ResidualRecorder(self.model) as rec:
                rec.cols = torch.arange(self.T)
                self._pass(k, self.tops[k - 1] if k else None, [])
                self._resid[k] = rec.take()
        return self._resid[k]

    def _run(self, patches) -> torch.Tensor:
        by_pass: dict[int, list] = {}
        for p in patches:
            by_pass.setdefault(self.pass_of(p), []).append(p)
        k0 = min(by_pass)
        top = self.tops[k0 - 1] if k0 else None
        for k in range(k0, self.n + 1):
            out = self._pass(k, top, by_pass.get(k, []))
            top = out.top
        return out.logits[:, -1]


class RecircPatcher(Patcher):
    """Recirculation (engine.recirculation, the exact sequential engine), on the model's LM (a fusion module,
    if any, is never run).

    Sites: `state` at t = z_{t-1,s}, the source-depth state of position t-1 that is fed back (mixed into t-1's
    recirculation branch, whose keys and values t and every later token read): the analogue of the fed h_{t-1};
    `fused` at t = z'_{t-1,d}, the mixed vector entering that branch (its bypass, alpha = 0 there, is z_{t-1,d});
    `resid` at (depth, t) = the token's own (normal-branch) residual, in both branches at depth <= d where they
    are one; block sites alike (both branches for blocks whose output depth is <= d).
    Sharing: the clean run's final cache holds r_0..r_{T-2}; a patched run whose first patched step is t0
    starts from its first t0-1 columns and z_{t0-1,s}, and runs steps t0..T-1."""

    words = {"state": "z_{T-1,s} (the recirculated source-depth state of T-1)", "noun": "the recirculated state",
             "site": "the source-depth state z_{T-1,s} recirculated from T-1 (read by T through T-1's recirculation "
                     "branch)",
             "site_t": "the source-depth state recirculated from t-1 (z_{t-1,s})",
             "gate_bypass": "alpha = 0 at T-1: T-1's recirculation branch gets z_{T-1,d} unmixed",
             "gate_bypass_all": "alpha = 0 at every position (the base model's standard pass, to float rounding)"}

    def __init__(self, model, ids, mask, mode):
        super().__init__(model, ids, mask, mode)
        check_stepwise(model, mask, "recirculation")  # before its clean run, whoever builds it
        self.spec = mode.recirc.validate(self.L)
        self.rlm = RecirculatedLM(lm_only(model), self.spec)
        T, s, d = self.T, self.spec.source, self.spec.target
        if self.spec.is_identity:  # the base model's one parallel forward, as the engine's prefill runs it
            with ResidualRecorder(self.rlm.base) as rec:
                rec.cols = torch.arange(T)
                out = self.rlm.base(ids, mask)
                resid = rec.take()
            self.zs, self.zd = resid[:, :, s], resid[:, :, d]
            self.mixed, self.cache = self.zd, None
        else:
            out = self.rlm.sequential(ids, mask, torch.arange(T), collect=True, keep_cache=True, record=True)
            resid, self.cache = out.resid, out.cache
            self.zs, self.zd, self.mixed = out.steps.zs, out.steps.zd, out.steps.mixed
        self.clean = RunOut(out.logits[:, -1], out.top, resid)
        self._standard: StandardPatcher | None = None  # identity mixing's resid / block patches (built on use)
        self._rresid: torch.Tensor | None = None

    def fused_positions(self):
        return list(range(1 - self.T, 0))

    def check_site(self, p):
        if p.site == "rresid":  # the recirculation branch above d (at and below d it is `resid`: one stream)
            d = self.spec.target
            if not d < p.depth <= self.L:
                raise UserError(f"rresid depth {p.depth}: the recirculation branch has its own residual at depths "
                                f"{d + 1}..{self.L} (at and below {d} it is the token's `resid`)")
            if self.col(p) == self.T - 1:
                raise UserError("rresid at T: no later token reads T's recirculation branch, so it is never run")
            return
        super().check_site(p)
        if p.site in ("state", "fused") and self.col(p) < 1:
            raise UserError(f"{self.mode.name}: column 0 has no earlier position, so no recirculated state")

    def state(self, pos: int, pass_=None) -> torch.Tensor:
        c = self.T + pos
        if not 1 <= c < self.T:
            raise UserError(f"{self.mode.name} has no fed state at {pos_name(pos)}")
        return self.zs[:, c - 1]

    def bypass_value(self, pos: int) -> torch.Tensor:
        return self.zd[:, self.T + pos - 1]

    def resid(self, pass_=None):
        return self.clean.resid

    def rresid(self) -> torch.Tensor:
        """The clean recirculation branch's residual [B, T, L+1, D] (column T-1: NaN, never run; at and below d
        it equals the normal branch's). Recorded on first use by one more clean sequential run."""
        if self._rresid is None:
            if self.spec.is_identity:  # one stream
                r = self.clean.resid.clone()
            else:
                r = torch.full_like(self.clean.resid, float("nan"))
                now = {"t": 0, "c_r": None}

                def step_edit(t, inj, c_r, c_n):
                    now.update(t=t, c_r=c_r)

                def keep(depth, h):
                    if now["c_r"] is not None:
                        r[:, now["t"] - 1, depth] = h[:, now["c_r"]]
                    return None

                self.rlm.sequential(self.ids, self.mask, torch.tensor([self.T - 1]), step_edit=step_edit,
                                    edit=keep, edit_depths=tuple(range(self.L + 1)))
            r[:, -1] = float("nan")
            self._rresid = r
        return self._rresid

    def _no_op(self, p) -> bool:
        """A patch that provably changes nothing: any state patch under identity mixing (alpha = 0 weighs z_s
        by 0), or a value equal to the clean one at a state / fused site."""
        if p.site == "state":
            return self.spec.is_identity or (isinstance(p.value, torch.Tensor)
                                             and torch.equal(p.value, self.zs[:, self.col(p) - 1]))
        if p.site == "fused":
            return isinstance(p.value, torch.Tensor) and torch.equal(p.value, self.mixed[:, self.col(p) - 1])
        return False

    def _reaches_T(self, p) -> bool:
        """Under identity mixing: whether a resid / block patch can reach T. Later tokens read a column's
        recirculation branch, which a normal-branch patch above d does not touch (and z_s is weighted by 0)."""
        if p.site == "rresid":  # what later tokens read (never at T: refused by check)
            return True
        limit = p.depth if p.site == "resid" else p.layer + 1
        return limit <= self.spec.target or self.col(p) == self.T - 1

    def _run(self, patches) -> torch.Tensor:
        if all(self._no_op(p) for p in patches):  # the clean logits, bit for bit (the identity invariant)
            return self.clean.logits
        if self.spec.is_identity and all(p.site not in ("state", "fused") for p in patches):
            # alpha = 0: the two branches are the base model's one stream wherever a patch can reach T, so the
            # standard patcher (the base model's cached suffix) runs it exactly, without T sequential steps.
            live = [p for p in patches if self._reaches_T(p)]
            if not live:
                return self.clean.logits
            if self._standard is None:
                self._standard = StandardPatcher(self.rlm.base, self.ids, self.mask, Mode("standard"))
            # the recirculation branch of a column before T is the one stream there
            return self._standard._run([replace(p, site="resid") if p.site == "rresid" else p for p in live])
        T, d = self.T, self.spec.target
        cols = [self.col(p) for p in patches]
        t0 = min(cols) if self.cache is not None else 0
        cache = new_cache() if t0 <= 1 else cache_prefix(self.cache, t0 - 1)
        zs_prev = self.zs[:, t0 - 1] if t0 >= 1 else None
        resid_at: dict[int, list] = {}
        for p, c in zip(patches, cols):
            if p.site in ("resid", "rresid"):
                resid_at.setdefault(p.depth, []).append((p, c))
        now = {"t": -1, "c_r": None, "c_n": 0}

        def rowwise(p, v, old):
            v = apply(v, old)
            return v if p.rows is None else torch.where(p.rows.to(v.device)[:, None], v, old)

        def _in_order(ps, x):
            for p in ps:
                x = rowwise(p, p.value, x)
            return x

        def edit(depth, h):
            items = []
            for p, c in resid_at.get(depth, ()):
                if c == now["t"] and p.site == "resid":
                    items.append((now["c_n"], rowwise(p, p.value, h[:, now["c_n"]])))
                elif c == now["t"] - 1 and now["c_r"] is not None and (depth <= d or p.site == "rresid"):
                    items.append((now["c_r"], rowwise(p, p.value, h[:, now["c_r"]])))
            return put_columns(h, items) if items else None

        def step_edit(t, inj, c_r, c_n):
            now.update(t=t, c_r=c_r, c_n=c_n)
            # every state (fused) patch at t, applied in order, each to what the previous one left (as the
            # recurrent patcher's): a single assignment per patch kept only the last
            zs_at = [p for p, c in zip(patches, cols) if c == t and p.site == "state"]
            mixed_at = [p for p, c in zip(patches, cols) if c == t and p.site == "fused"]
            if zs_at:
                inj.zs_edit = lambda zs, ps=zs_at: _in_order(ps, zs[:, 0])[:, None]
            if mixed_at:
                inj.mixed_edit = lambda m, ps=mixed_at: _in_order(ps, m[:, 0])[:, None]
            here = [(p, c_n) for p, c in zip(patches, cols) if p.site in BLOCK_SITES and c == t]
            here += [(p, c_r) for p, c in zip(patches, cols)
                     if p.site in BLOCK_SITES and c == t - 1 and c_r is not None and p.layer + 1 <= d]
            if not here:
                return None
            col_of = {id(p): col for p, col in here}
            return _hooks(self.model, [p for p, _ in here], lambda q: col_of[id(q)])

        out = self.rlm.sequential(self.ids, self.mask, torch.tensor([T - 1]), start=t0, cache=cache,
                                  zs_prev=zs_prev, step_edit=step_edit, edit=edit if resid_at else None,
                                  edit_depths=tuple(resid_at))
        return out.logits[:, 0]


class LoopPatcher(StandardPatcher):
    """A looped model (models.looped) at R iterations: the standard patcher on the model re-unrolled to R, every
    call inside looping(R); depth d addresses the unrolled stack (LoopedLM.site_of: an iteration's block)."""
    kind = "loop"

    def __init__(self, model, ids, mask, mode):
        from models.looped import require_looped

        if mode.adaptive_exit is not None:
            raise UserError(f"{mode.name} runs every prompt to its own exit: an evaluation mode (analysis.evaluate); "
                            f"patch a fixed loop-{mode.n} instead")
        self._looped, self._r = require_looped(model, mode.name), mode.n
        with self.stack():
            super().__init__(model, ids, mask, mode)

    def stack(self):
        from models.looped import looping

        return looping(self._looped, self._r)

    def _run(self, patches) -> torch.Tensor:
        with self.stack():
            return super()._run(patches)


PATCHERS = {"standard": StandardPatcher, "loop": LoopPatcher, "recurrent": RecurrentPatcher, "fused": FusedPatcher, "recirc": RecircPatcher}


def patcher(mode: Mode, model: FullBandwidthLM, ids: torch.Tensor, mask: torch.Tensor) -> Patcher:
    """The patcher of `mode` on a batch: its clean run (kept) and `run(patches)`, the logits at T. The batch is
    checked first (left-padded [batch, T] ids within the vocabulary and the context: engine.inputs.check_inputs):
    a right-padded row would be read at a padding column."""
    check_inputs(model, ids, mask)
    return PATCHERS[mode.kind](model, ids, mask, mode)


def record_at_T(runner: Patcher, run, patches) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits at T [B, V], residual stream at T [B, L+1, D]) of `run()`, a patched run of `patches` through
    `runner` (its `run`, or a caller's wrapper of it).

    The recorder keeps the last column of every model call; the last call of every mechanism computes T
    (recurrent: the one-token step at T; standard / fused-n: the full-width pass or the cached suffix), so what
    remains is T. It is registered on the runner's own stack (loop-R: its unrolling, not the trained r's). A run
    whose every patch changes nothing returns the clean result without a model call (the standard patcher), so
    nothing is recorded and the clean residual is it. Recorder hooks run before the patch hooks (registered
    first), so a patched depth itself shows the unpatched value; the patch is applied to it here."""
    patches = list(patches)
    with runner.stack(), ResidualRecorder(runner.model) as rec:
        rec.cols = torch.tensor([-1])
        logits = run()
        resid = rec.take()[:, 0] if rec.recorded else runner.resid()[:, -1].to(logits.device).clone()
    for p in patches:  # fused-n: only the recorded (last) pass's own patches; an earlier pass's was recomputed over
        if p.site == "resid" and p.pos == -1 and runner.is_clean_pass(p.pass_):
            resid[:, p.depth] = apply(p.value, resid[:, p.depth])
    return logits, resid
