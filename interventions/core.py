"""The one generic patching routine and its thin wrappers, TransformerLens style, in every prefill mode.

Every intervention of the suite is a list of `Patch`es handed to `CausalContext.run(mode, patches)`, which runs
the mode's computation over the whole batch with the patched values substituted and returns the logits at the
probed position T. A patch at column t (or at Jacobi pass k of fused-n) is followed by the rest of the
computation RECOMPUTED from the patched value: it propagates.

Sites (positions are negative column offsets of the left-padded batch: -1 = T, -2 = T-1, ..., -T = column 0;
columns are aligned from the end)
    state   the state entering the fusion at position t (h_{t-1} of the mode's own run)
    fused   the fusion's output at t (the fused input u_t of block 0)
    resid   the residual stream at (depth, t): depth 0 = the vector entering block 0 (embedding or fused
            input), depth l = output of block l (raw, before the final norm)
A state/fused patch matters only where the mode fuses (the fuse mask: previous and current column real tokens
of the row); a patch at a padding column of a row has no effect on that row.

Modes (engine.modes.parse_mode; canonical names)
    standard        one parallel forward; resid sites only (no fusion runs)
    recurrent-k     standard prefill of all T columns with a KV cache, then columns r0 = T - min(k, T-1) .. T-1
                    recomputed one token at a time, each fused with the previous column's top state.
                    recurrent-full = recurrent-(T-1). state/fused sites exist at columns >= r0.
    fused-n         n parallel Jacobi passes after the standard pass 0; pass k fuses pass k-1's top states
                    shifted right. `Patch.pass_` names the pass (default: the last, n); state/fused sites exist
                    at passes 1..n, resid at 0..n.
Cost and sharing
    recurrent: the clean run's final KV cache holds every column's keys/values (they never change once
        computed), so the prefix of a patch at column t >= r0 is a copy of the clean cache cropped to t columns
        plus the clean top state of t-1 (engine.prefill.cache_prefix): computed once per batch, shared by every
        condition. The run is then the patched step at t and plain cached steps t+1..T-1 (T - t steps, at most
        one recurrent-full run). A resid patch at a column < r0 reruns the standard prefill patched (one
        parallel forward) and then the k steps.
    fused-n: the clean passes' top states are kept; a patch at pass k reuses pass k-1's and reruns passes
        k..n (n - k + 1 parallel forwards).
    State patches need no hook: the state is an explicit argument of the step / pass. fused and resid patches
    use the engine's one hook helper (engine.hooks.patched) for the forward where they apply; every forward is
    an engine primitive (the standard pass, engine.prefill.recurrent_step / recurrent_run / jacobi_pass).
`CausalContext` checks at construction that every mode's clean run equals the engine's (engine.prefill.
prefill_many: logits and top states at every position) bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from common.cpus import sequential_threads
from common.errors import UserError
from engine.hooks import ResidualRecorder, patched
from engine.modes import Mode, parse_mode
from engine.prefill import (cache_prefix, iter_fused, jacobi_pass, recurrent_run, recurrent_start, recurrent_step,
                            shift_state)
from models.full_bandwidth import FullBandwidthLM, decoder_layers

SITES = ("state", "fused", "resid")
MODES = ("standard", "recurrent-1")  # the default modes of a CausalContext
POSITIONS = (-2, -1)  # T-1, T (kept for callers of the first version)


def pos_name(pos: int) -> str:
    """-1 -> 'T', -3 -> 'T-2'."""
    return "T" if pos == -1 else f"T{pos + 1}"


POS_NAMES = {-2: "T-1", -1: "T"}


@dataclass
class Batch:
    """One evaluation set, left-padded so that T is the last column of every row.

    Labels are indices into `label_ids` (K >= 2 label words); every row's pair has a DIFFERENT label (not
    necessarily the "opposite" one when K > 2). `diff_line` (optional, tracking tasks): the update line where
    the pair members differ.
    """

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    labels: torch.Tensor  # [B] long, 0..K-1
    pair: torch.Tensor  # [B] long: row index of the paired sample (different label)
    groups: np.ndarray  # [B] cross-validation / bootstrap cluster ids
    label_ids: tuple  # (token id of the label-0 word, ..., label-(K-1) word)
    diff_line: np.ndarray | None = None  # [B] or None
    line_index: np.ndarray | None = None  # [B, T] line (0-based, newlines counted before the column); -1 = pad

    def __post_init__(self):
        B = self.input_ids.shape[0]
        if self.input_ids.ndim != 2 or self.input_ids.shape != self.attention_mask.shape:
            raise UserError("input_ids and attention_mask must both be [batch, T]")
        if B < 2 or self.input_ids.shape[1] < 2:
            raise UserError("interventions need at least 2 samples of at least 2 tokens")
        if not bool(self.attention_mask[:, -2:].all()):
            raise UserError("prompts must be left-padded with at least 2 real tokens (T-1 and T) per row")
        self.labels = torch.as_tensor(self.labels, dtype=torch.long)
        self.pair = torch.as_tensor(self.pair, dtype=torch.long)
        self.groups = np.asarray(self.groups)
        if self.labels.shape != (B,) or self.pair.shape != (B,) or self.groups.shape != (B,):
            raise UserError("labels, pair and groups need one entry per row")
        self.label_ids = tuple(int(i) for i in self.label_ids)
        K = len(self.label_ids)
        if K < 2 or len(set(self.label_ids)) != K:
            raise UserError("label_ids must be at least two distinct token ids")
        if bool((self.labels < 0).any()) or bool((self.labels >= K).any()):
            raise UserError(f"labels must be in 0..{K - 1} (one per label word)")
        if bool((self.pair < 0).any()) or bool((self.pair >= B).any()):
            raise UserError("pair indices out of range")
        if not bool((self.labels[self.pair] != self.labels).all()):
            raise UserError("every row's pair must have a different label")
        if self.diff_line is not None:
            self.diff_line = np.asarray(self.diff_line)
            if self.diff_line.shape != (B,):
                raise UserError("diff_line needs one entry per row")
        if self.line_index is not None:
            self.line_index = np.asarray(self.line_index)
            if self.line_index.shape != tuple(self.input_ids.shape):
                raise UserError("line_index needs one entry per column of every row")

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_classes(self) -> int:
        return len(self.label_ids)

    @property
    def first_diff(self) -> np.ndarray:
        """[B] column offset from the end (-1 = T) of the first column where the row and its pair differ (token
        or padding). The states entering the fusion at every column <= it are identical in the two rows."""
        ids, mask, p = self.input_ids, self.attention_mask, self.pair
        diff = (ids != ids[p]) | (mask != mask[p])  # [B, T]
        T = ids.shape[1]
        first = torch.where(diff.any(1), diff.float().argmax(1), torch.full_like(p, T))
        return (first - T).numpy()

    @classmethod
    def from_samples(cls, samples, tokenizer, task) -> "Batch":
        """Tokenize `tasks` samples (pairs share a pair_id and have different labels) into a Batch.

        `task`: a built-in task name or a `tasks.custom.TaskSource` (a researcher's own task)."""
        from engine.prefill import pad_left
        from tasks import resolve_task

        src = task if hasattr(task, "label_token_ids") else resolve_task(task)
        ids, samples = src.tokenize(samples, tokenizer)
        input_ids, mask = pad_left(ids, tokenizer.pad_token_id or 0)
        members: dict = {}
        for i, s in enumerate(samples):
            members.setdefault(s.pair_id, []).append(i)
        pair = [-1] * len(samples)
        for m in members.values():
            if len(m) != 2 or samples[m[0]].label == samples[m[1]].label:
                raise UserError("every sample needs its pair (same pair_id, different label) in the dataset")
            pair[m[0]], pair[m[1]] = m[1], m[0]
        dl = [s.diff_line for s in samples]
        newline = {int(i): "\n" in tokenizer.decode([int(i)]) for i in torch.unique(input_ids).tolist()}
        nl = torch.tensor([[newline[int(i)] for i in row] for row in input_ids.tolist()]) & mask.bool()
        line = (torch.cumsum(nl.long(), 1) - nl.long()).masked_fill(~mask.bool(), -1)  # newlines before col
        return cls(input_ids, mask, torch.tensor([s.label for s in samples]), torch.tensor(pair),
                   np.array([s.group_id for s in samples]), tuple(src.label_token_ids(tokenizer, samples[0].text)),
                   None if any(d is None for d in dl) else np.array(dl), line.numpy())


@dataclass(frozen=True)
class Patch:
    """Replace the activation at `site` (and `depth` for resid), column `pos`, by `value` [B, D], row by row.

    `pass_`: fused-n only, the Jacobi pass (None = the last); ignored by the other modes."""

    site: str
    value: torch.Tensor
    depth: int = 0
    pos: int = -1
    pass_: int | None = None

    def __post_init__(self):
        if self.site not in SITES:
            raise UserError(f"unknown patch site {self.site!r} (use one of {', '.join(SITES)})")
        if isinstance(self.pos, bool) or not isinstance(self.pos, int) or self.pos >= 0:
            raise UserError(f"patch position must be a negative column offset (-1 = T), got {self.pos!r}")
        if self.pass_ is not None and (not isinstance(self.pass_, int) or self.pass_ < 0):
            raise UserError(f"patch pass must be a non-negative integer, got {self.pass_!r}")


@dataclass
class RunOut:
    logits: torch.Tensor  # [B, V] at T
    top: torch.Tensor | None = None  # clean runs: [B, T, D] top state at every column (last pass for fused-n)
    resid: torch.Tensor | None = None  # clean runs: [B, T, L+1, D] residual stream (last pass for fused-n)
    reads: dict = field(default_factory=dict)


def _hooks(model: FullBandwidthLM, patches, col_of):
    """The engine's hook helper substituting the fused/resid `patches` at column col_of(p) of the current call."""
    fused = [(col_of(p), p.value) for p in patches if p.site == "fused"]
    resid: dict[int, list] = {}
    for p in patches:
        if p.site == "resid":
            resid.setdefault(p.depth, []).append((col_of(p), p.value))
    return patched(model, fused, resid)


# ----- one runner per mode ------------------------------------------------------------------------------------
class _Runner:
    kind = ""

    def __init__(self, model: FullBandwidthLM, ids, mask, mode: Mode):
        self.model, self.ids, self.mask, self.mode = model, ids, mask, mode
        self.T = ids.shape[1]
        self.layers = decoder_layers(model.lm)
        self.L = len(self.layers)

    def col(self, p: Patch) -> int:
        c = self.T + p.pos
        if c < 0:
            raise UserError(f"patch position {p.pos} out of range for prompts of {self.T} columns")
        return c

    def check(self, p: Patch) -> None:
        self.col(p)
        if p.site == "resid" and not 0 <= p.depth <= self.L:
            raise UserError(f"patch depth {p.depth} out of range 0..{self.L}")

    def fused_positions(self) -> list[int]:
        return []


class _Standard(_Runner):
    kind = "standard"

    def __init__(self, model, ids, mask, mode):
        super().__init__(model, ids, mask, mode)
        with ResidualRecorder(model) as rec:
            rec.cols = torch.arange(self.T)
            out = model(ids, mask)
            resid = rec.take()
        self.clean = RunOut(out.logits[:, -1], out.top, resid)

    def check(self, p):
        super().check(p)
        if p.site != "resid":
            raise UserError("standard prefill has no fused state: only resid patches apply")

    def run(self, patches) -> torch.Tensor:
        with _hooks(self.model, patches, self.col):
            return self.model(self.ids, self.mask).logits[:, -1]

    def resid(self, pass_=None):
        return self.clean.resid


class _Recurrent(_Runner):
    kind = "recurrent"

    def __init__(self, model, ids, mask, mode):
        super().__init__(model, ids, mask, mode)
        T = self.T
        self.r0 = recurrent_start(T, mode.n)
        with ResidualRecorder(model) as rec:
            run = recurrent_run(model, ids, mask, mode.n, torch.arange(T), rec)
        self.cache = run.cache  # every column's keys/values: the shared prefix of every patched run
        self.std_logits = run.std.logits[:, -1]
        self.clean = RunOut(run.logits[:, -1], run.top, run.resid)

    def fused_positions(self):
        return list(range(self.r0 - self.T, 0))

    def check(self, p):
        super().check(p)
        if p.site != "resid" and self.col(p) < self.r0:
            raise UserError(f"{self.mode.name} fuses only positions {pos_name(self.r0 - self.T)}..T: no "
                            f"{p.site} site at {pos_name(p.pos)}")

    def state(self, pos: int, pass_=None) -> torch.Tensor:
        c = self.T + pos
        if not self.r0 <= c < self.T:
            raise UserError(f"{self.mode.name} has no fed state at {pos_name(pos)}")
        return self.clean.top[:, c - 1]

    def resid(self, pass_=None):
        return self.clean.resid

    def run(self, patches) -> torch.Tensor:
        model, ids, mask, T = self.model, self.ids, self.mask, self.T
        cols = [self.col(p) for p in patches]
        t0 = min(cols)
        if t0 >= self.r0:  # shared clean prefix
            cache = cache_prefix(self.cache, t0, model.config)
            prev, start = self.clean.top[:, t0 - 1], t0
        else:  # a patch in the standard part: rerun the standard prefill patched, then every step
            pre = [p for p, c in zip(patches, cols) if c < self.r0]
            cache = DynamicCache(config=model.config)
            with _hooks(model, pre, self.col):
                std = model(ids, mask, cache=cache, use_cache=True)
            cache.crop(-(T - self.r0))
            prev, start = std.top[:, self.r0 - 1], self.r0
            if start == T:
                return std.logits[:, -1]
        with sequential_threads():  # the engine's thread policy for one-token steps (common.cpus)
            for t in range(start, T):
                here = [p for p, c in zip(patches, cols) if c == t]
                for p in here:
                    if p.site == "state":
                        prev = p.value.to(prev.dtype)
                with _hooks(model, [p for p in here if p.site != "state"], lambda p: 0):
                    out = recurrent_step(model, ids, mask, t, prev, cache)
                prev = out.top[:, 0]
        return out.logits[:, 0]


class _Fused(_Runner):
    kind = "fused"

    def __init__(self, model, ids, mask, mode):
        super().__init__(model, ids, mask, mode)
        self.n = mode.n
        self.tops = []
        for _, out in iter_fused(model, ids, mask, self.n):
            self.tops.append(out.top)
        self._resid: dict[int, torch.Tensor] = {}
        self.clean = RunOut(out.logits[:, -1], out.top, None)
        self.clean.resid = self.resid(self.n)

    def fused_positions(self):
        return list(range(1 - self.T, 0))

    def pass_of(self, p: Patch) -> int:
        return self.n if p.pass_ is None else p.pass_

    def check(self, p):
        super().check(p)
        k = self.pass_of(p)
        if not 0 <= k <= self.n:
            raise UserError(f"{self.mode.name} has passes 0..{self.n}, not {k}")
        if p.site != "resid" and k == 0:
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
                return model(ids, mask)
            sp = [p for p in patches if p.site == "state"]
            state = None
            if sp:
                state = shift_state(top_prev, mask)[0]
                for p in sp:
                    state[:, self.col(p)] = p.value.to(state.dtype)
            return jacobi_pass(model, ids, mask, top_prev, state=state)

    def resid(self, pass_=None) -> torch.Tensor:
        k = self.n if pass_ is None else pass_
        if k not in self._resid:
            with ResidualRecorder(self.model) as rec:
                rec.cols = torch.arange(self.T)
                self._pass(k, self.tops[k - 1] if k else None, [])
                self._resid[k] = rec.take()
        return self._resid[k]

    def run(self, patches) -> torch.Tensor:
        by_pass: dict[int, list] = {}
        for p in patches:
            by_pass.setdefault(self.pass_of(p), []).append(p)
        k0 = min(by_pass)
        top = self.tops[k0 - 1] if k0 else None
        for k in range(k0, self.n + 1):
            out = self._pass(k, top, by_pass.get(k, []))
            top = out.top
        return out.logits[:, -1]


_RUNNERS = {"standard": _Standard, "recurrent": _Recurrent, "fused": _Fused}


class CausalContext:
    """A model, a batch, and each mode's clean run (the shared prefix of every patched run of that mode).

    `modes`: the modes to prepare (canonical names or aliases; default standard and recurrent-1). `mode`: the
    mode under study (default: the first non-standard one), the default of the thin wrappers below."""

    def __init__(self, model: FullBandwidthLM, batch: Batch, check_engine: bool = True, modes=MODES):
        self.model = model.eval()
        self.batch = batch
        self.n_layers = model.n_layers
        ids, mask = batch.input_ids, batch.attention_mask
        ctx = getattr(model.config, "max_position_embeddings", None)
        if ctx is not None and int(mask.sum(-1).max()) > ctx:
            raise UserError(f"prompts of {int(mask.sum(-1).max())} tokens exceed the model's context ({ctx})")
        parsed = []
        for m in modes:
            p = parse_mode(m)
            if p.kind == "recirc":
                raise UserError(f"interventions under {p.name} are not available: recirculation has no fed state "
                                "(probe it with probes.run --recirculate)")
            if p not in parsed:
                parsed.append(p)
        if not model.has_fusion:
            parsed = [p for p in parsed if p.kind == "standard"] or [Mode("standard")]
        self.modes = [p.name for p in parsed]
        self.mode = next((m for m in self.modes if m != "standard"), "standard")
        with torch.no_grad():
            self.e = model.embed(ids)  # [B, T, D] token embeddings
            self.e_T = self.e[:, -1]
            self.runners = {p.name: _RUNNERS[p.kind](model, ids, mask, p) for p in parsed}
        self.clean = {m: r.clean for m, r in self.runners.items()}
        if check_engine:
            self._check_engine()

    @property
    def h_prev(self) -> torch.Tensor:
        """The state entering the fusion at T in the mode under study (h_{T-1})."""
        return self.state(self.mode, -1)

    def _check_engine(self):
        from engine.prefill import prefill_many

        T = self.batch.input_ids.shape[1]
        # "standard" beside the modes: the engine's recurrent modes then share one full standard pass, the
        # computation the runners keep (their patched runs restart from it)
        ref = prefill_many(self.model, self.batch.input_ids, self.batch.attention_mask, ["standard", *self.modes],
                           positions=tuple(range(-T, 0)), collect=False)
        for m in self.modes:
            r = self.runners[m]
            if not torch.equal(ref[m].logits[:, -1], self.clean[m].logits):
                diff = (ref[m].logits[:, -1] - self.clean[m].logits).abs().max().item()
                raise RuntimeError(f"clean {m} logits differ from the prefill engine's by {diff:.3g}")
            if not torch.equal(ref[m].top, r.clean.top):
                diff = (ref[m].top - r.clean.top).abs().max().item()
                raise RuntimeError(f"clean {m} top states differ from the prefill engine's by {diff:.3g}")

    def _runner(self, mode):
        name = parse_mode(mode).name if mode is not None else self.mode
        if name not in self.runners:
            raise UserError(f"mode {name!r} was not prepared for patching (prepared: {', '.join(self.runners)})")
        return self.runners[name]

    # -- the generic routine ------------------------------------------------------------------------------
    def run(self, mode: str, patches=()) -> RunOut:
        """Run `mode` on the whole batch with `patches`; logits at T."""
        r = self._runner(mode)
        patches = list(patches)
        for p in patches:
            if tuple(p.value.shape) != (self.batch.size, self.model.d_model):
                raise UserError(f"patch value must be [batch={self.batch.size}, d_model={self.model.d_model}], "
                                f"got {tuple(p.value.shape)}")
            r.check(p)
        if not patches:
            return RunOut(r.clean.logits)
        with torch.no_grad():
            return RunOut(r.run(patches))

    # -- thin wrappers ------------------------------------------------------------------------------------
    def fused_positions(self, mode=None) -> list[int]:
        """Positions (negative offsets) where `mode` has a state/fused site."""
        return self._runner(mode).fused_positions()

    def state(self, mode=None, pos: int = -1, pass_=None) -> torch.Tensor:
        """Clean state [B, D] entering the fusion at `pos` (the top state of pos-1 in the mode's own run)."""
        r = self._runner(mode)
        if r.kind == "standard":
            raise UserError("standard prefill has no fed state")
        return r.state(pos, pass_)

    def resid(self, mode=None, pass_=None) -> torch.Tensor:
        """Clean residual stream [B, T, L+1, D] of `mode` (fused-n: pass `pass_`, default the last)."""
        return self._runner(mode).resid(pass_)

    def patch_state(self, states: torch.Tensor, mode=None, pos: int = -1, pass_=None) -> torch.Tensor:
        """Logits at T with the state entering the fusion at `pos` replaced by `states` [B, D]."""
        return self.run(mode or self.mode, [Patch("state", states, pos=pos, pass_=pass_)]).logits

    def swap_state(self, donor: torch.Tensor, mode=None, pos: int = -1, pass_=None) -> torch.Tensor:
        """Interchange: the state at `pos` of row donor[i] into row i."""
        return self.patch_state(self.state(mode, pos, pass_)[donor], mode, pos, pass_)

    def gate_bypass(self, mode=None, pos: int | str = -1) -> torch.Tensor:
        """Feed e_t instead of the fused input at `pos` (trained with feedback, decoded without); pos="all":
        at every fused position (fused-n: in the last pass), which is the standard prefill."""
        mode = mode or self.mode
        positions = self.fused_positions(mode) if pos == "all" else [pos]
        T = self.batch.input_ids.shape[1]
        return self.run(mode, [Patch("fused", self.e[:, T + p], pos=p) for p in positions]).logits

    def patch_resid(self, mode: str, depth: int, pos: int, donor: torch.Tensor, pass_=None) -> torch.Tensor:
        """Residual stream at (depth, pos) from row donor[i]'s clean run of the same mode (and pass)."""
        T = self.batch.input_ids.shape[1]
        value = self.resid(mode, pass_)[:, T + pos, depth][donor]
        return self.run(mode, [Patch("resid", value, depth, pos, pass_)]).logits
