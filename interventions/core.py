"""The one patching routine of the suite and its thin wrappers, TransformerLens style, in every mechanism.

Every intervention is a list of `Patch`es handed to `CausalContext.run(mode, patches)`, which hands them to the
mode's patcher (engine/patching.py: the sites, what each mechanism recomputes, the shared clean prefix) and
returns the logits at the probed position T, as float32 on the CPU. The context holds the paired batch and every
prepared mode's patcher, and checks at construction that each clean run equals the engine's prefill
(engine.prefill.prefill_many: logits and top states at every position) bit for bit.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from common.errors import UserError
from engine.modes import Mode, parse_mode
from engine.inputs import check_inputs
from engine.patching import Patch, RunOut, patcher, pos_name
from engine.result import require_finite
from models.full_bandwidth import FullBandwidthLM

from interventions.batch import MODES, Batch  # Batch and Patch: the routine's arguments


def _host(x: torch.Tensor | None) -> torch.Tensor | None:
    """float32 on the CPU (what the metrics read); the tensor itself when it already is."""
    return None if x is None else x.to("cpu", torch.float32)


class CausalContext:
    """A model, a batch, and each mode's clean run (the shared prefix of every patched run of that mode).

    `modes`: the modes to prepare (canonical names or aliases; default standard and recurrent-1). `mode`: the
    mode under study (default: the first non-standard one), the default of the thin wrappers below. On a model
    without a fusion module, a recurrent or fused mode asked for by name is refused (UserError), unless
    `drop_unfused` (a negative control run on whatever modes it has); the default modes drop it silently.

    It sets the model to eval mode and leaves it so: every patched run, DAS fit and attribution it serves later must
    run as its clean runs did (put a model you go on training back with `.train()`)."""

    def __init__(self, model: FullBandwidthLM, batch: Batch, check_engine: bool = True, modes=MODES,
                 drop_unfused: bool = False):
        self.model = model.eval()
        self.batch = batch
        self.n_layers = model.n_layers
        self.on_run = None  # called after every patched run (a progress bar's step)
        # The model may sit on an accelerator or in a low-precision dtype: runs happen there, and what callers
        # read (logits, states, residuals) comes back as float32 on the CPU, where the metrics are computed.
        w = next(model.parameters())
        self.device, self.dtype = w.device, w.dtype
        ids, mask = batch.input_ids.to(self.device), batch.attention_mask.to(self.device)
        check_inputs(model, ids, mask)  # before anything runs on them (an id past the vocabulary, a hole in the mask)
        ctx = getattr(model.config, "max_position_embeddings", None)
        if ctx is not None and int(mask.sum(-1).max()) > ctx:
            raise UserError(f"prompts of {int(mask.sum(-1).max())} tokens exceed the model's context ({ctx})")
        parsed = []
        for m in modes:
            p = parse_mode(m, self.n_layers)
            if p not in parsed:
                parsed.append(p)
        if not model.has_fusion:  # recurrence and fused passes need the fusion module; recirculation does not
            unfused = [p.name for p in parsed if p.has_feedback]
            if unfused and modes is not MODES and not drop_unfused:  # asked for by name: not dropped silently
                raise UserError(f"{', '.join(unfused)} need{'s' if len(unfused) == 1 else ''} a fusion module, and "
                                "this model has none (FullBandwidthLM(lm, fusion=False), or a plain HF model): use "
                                "standard or a recirc-S:D:A mode")
            parsed = [p for p in parsed if not p.has_feedback] or [Mode("standard")]
        self.modes = [p.name for p in parsed]
        self.mode = next((m for m in self.modes if m != "standard"), "standard")
        with torch.no_grad():
            self.e = model.embed(ids)  # [B, T, D] token embeddings
            self.e_T = self.e[:, -1]
            self.runners = {p.name: patcher(p, model, ids, mask) for p in parsed}
        self.clean = {m: RunOut(_host(r.clean.logits), _host(r.clean.top), _host(r.clean.resid))
                      for m, r in self.runners.items()}
        for m, r in self.clean.items():  # an overflowing model: no metric is defined (and no engine check)
            require_finite(r.logits, f"clean {m} run", self._non_finite_cause())
        # the depth of the mode under study's stack (a loop-R mode unrolls a looped model's core R times)
        self.n_layers = self.runners[self.mode].L
        if check_engine:
            self._check_engine()

    def _non_finite_cause(self) -> str:
        """What a NaN / inf in this model's logits means (the logits come back as float32: name the model's dtype)."""
        cause = f"its forward overflows or diverges in {self.dtype}"
        if self.dtype == torch.float64 and not bool(self.batch.attention_mask.all()):
            cause += ("; in float64, eager attention turns a left-padded row's masked queries into NaN: run the "
                      "model in float32")
        return cause

    @property
    def h_prev(self) -> torch.Tensor:
        """The state entering the fusion at T in the mode under study (h_{T-1})."""
        return self.state(self.mode, -1)

    def _check_engine(self):
        from engine.prefill import prefill_many

        T = self.batch.input_ids.shape[1]
        # "standard" beside the modes: the engine's recurrent modes then share one full standard pass, the
        # computation the runners keep (their patched runs restart from it)
        ids, mask = self.batch.input_ids.to(self.device), self.batch.attention_mask.to(self.device)
        # full_cache: the runners keep every column (their patched runs copy prefixes of the clean cache), so the
        # engine is asked for the same computation, bit for bit (its window cache agrees to float rounding)
        ref = prefill_many(self.model, ids, mask, ["standard", *self.modes], positions=tuple(range(-T, 0)),
                           collect=False, full_cache=True)
        for m in self.modes:
            r = self.runners[m]
            if not torch.equal(ref[m].logits[:, -1], r.clean.logits):
                diff = (ref[m].logits[:, -1] - r.clean.logits).abs().max().item()
                raise RuntimeError(f"clean {m} logits differ from the prefill engine's by {diff:.3g}")
            real = mask.bool()  # padding columns' states are never read (the engine may skip computing them)
            if not torch.equal(ref[m].top[real], r.clean.top[real]):
                diff = (ref[m].top[real] - r.clean.top[real]).abs().max().item()
                raise RuntimeError(f"clean {m} top states differ from the prefill engine's by {diff:.3g}")

    def runner(self, mode):
        """The engine's patcher of `mode` (None: the mode under study) on this batch."""
        name = parse_mode(mode).name if mode is not None else self.mode
        if name not in self.runners:
            raise UserError(f"mode {name!r} was not prepared for patching (prepared: {', '.join(self.runners)})")
        return self.runners[name]

    # -- the generic routine ------------------------------------------------------------------------------
    def run(self, mode: str, patches=()) -> RunOut:
        """Run `mode` on the whole batch with `patches`; logits at T."""
        r = self.runner(mode)
        patches = list(patches)  # each checked by the patcher's run (Patcher.run)
        if not patches:
            return RunOut(self.clean[r.mode.name].logits)
        patches = [replace(p, value=p.value.to(self.device, self.dtype)) for p in patches]
        with torch.no_grad():
            out = RunOut(_host(r.run(patches)))
        # a NaN / inf the patch brought in (a mean of no rows, an infinite steering vector) has no metric: one line
        # naming it, not a report of None effects
        require_finite(out.logits, f"the {r.mode.name} run patched at "
                       + ", ".join(f"{p.site} {pos_name(p.pos)}" for p in patches),
                       f"a patch value holds NaN or inf, or {self._non_finite_cause()}")
        if self.on_run is not None:
            self.on_run()
        return out

    def run_grad(self, mode: str, patches) -> torch.Tensor:
        """`run` without its no_grad and without the host copy: logits at T [B, V] on the model's device, differentiable
        in the patches' tensors where the caller enables grad (an edit's parameters: interventions.das trains a
        rotation through it; its evaluation runs call this under no_grad)."""
        r = self.runner(mode)
        patches = [replace(p, value=p.value.to(self.device, self.dtype)) for p in patches]  # checked by r.run
        return r.run(patches)  # not a progress step (CausalContext.on_run): a training loop makes many

    # -- thin wrappers ------------------------------------------------------------------------------------
    def words(self, mode=None) -> dict:
        """How the report names `mode`'s fed state and bypass."""
        return self.runner(mode).words

    def fused_positions(self, mode=None) -> list[int]:
        """Positions (negative offsets) where `mode` has a state/fused site."""
        return self.runner(mode).fused_positions()

    def state(self, mode=None, pos: int = -1, pass_=None) -> torch.Tensor:
        """Clean state [B, D] entering the fusion at `pos` (the top state of pos-1 in the mode's own run)."""
        r = self.runner(mode)
        if not r.fused_positions():
            raise UserError(f"{r.mode.name} prefill has no fed state")
        return _host(r.state(pos, pass_))

    def resid(self, mode=None, pass_=None) -> torch.Tensor:
        """Clean residual stream [B, T, L+1, D] of `mode` (fused-n: pass `pass_`, default the last)."""
        r = self.runner(mode)
        if r.is_clean_pass(pass_):
            return self.clean[r.mode.name].resid
        return _host(r.resid(pass_))

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
        r = self.runner(mode)
        positions = r.fused_positions() if pos == "all" else [pos]
        return self.run(mode, [Patch("fused", _host(r.bypass_value(p)), pos=p) for p in positions]).logits

    def patch_resid(self, mode: str, depth: int, pos: int, donor: torch.Tensor, pass_=None) -> torch.Tensor:
        """Residual stream at (depth, pos) from row donor[i]'s clean run of the same mode (and pass)."""
        T = self.batch.input_ids.shape[1]
        value = self.resid(mode, pass_)[:, T + pos, depth][donor]
        return self.run(mode, [Patch("resid", value, depth, pos, pass_)]).logits
