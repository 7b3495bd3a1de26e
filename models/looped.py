"""LoopedLM: feedback in depth. A prelude of P blocks, a core of R blocks iterated r times, a coda of C blocks, on one
HF decoder (Huginn-0125's prelude / recurrent core / coda; Ouro's plain iteration is `inject=False`).

    e     = prelude(embed(x))                                   # depth P: the prelude's output
    s_0   = e
    s_i   = core(adapter([s_{i-1}; e]))   i = 1..r              # input injection (Huginn): concat, then Linear(2D, D)
            core(s_{i-1})                 (inject=False)        # plain iteration (Ouro)
    top   = final_norm(coda(s_r)); logits = head(top)

s_0 = e, not Huginn's random draw: a deterministic model (every clean run, patch and probe is reproducible).

Address space: the HF model's block list (`lm.model.layers`, what engine.hooks and every recorder address) holds
the UNROLLED stack, P + R r + C `Occurrence`s, each calling one shared physical block (`blocks.j`, j < P + R + C) with
its own KV-cache slot. So depth d of the suite's residual stream (0 = the embedding, d = the output of unrolled block
d) is a site of one iteration: depth P + R i is the loop state s_i, depth P + R (i - 1) + j + 1 the output of core
block j (0-based) of iteration i (`site_of(depth)`). Every existing recorder, probe, lens and patch addresses
iterations this way. `set_iterations(r)` / `looping(r)` re-unroll (test-time iteration scaling); the parameters
do not change.

Training (`truncate=k`): r is drawn per step by the trainer; iterations before the last k run without gradient
(Huginn's truncated backpropagation), the prelude still learns through the injection of e into every iteration.

Checkpoint: the full-bandwidth format with format_version 2: config.json adds "loop": {"prelude", "core", "coda",
"iterations" (the trained r), "inject"}; base_config holds the P + R + C physical blocks; model.safetensors holds
"lm.*" without the blocks, "blocks.{j}.*" (the physical blocks) and "adapter.weight" [D, 2D] when injecting.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass

import torch
from torch import nn

from common.errors import UserError
from models.full_bandwidth import FullBandwidthLM

MAX_ITERATIONS = 256


@dataclass(frozen=True)
class LoopSpec:
    prelude: int
    core: int
    coda: int
    iterations: int  # the trained r (the default of every run)
    inject: bool = True

    def __post_init__(self):
        for k in ("prelude", "core", "coda", "iterations"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise UserError(f"loop {k} must be a non-negative integer, got {v!r}")
        if self.core < 1 or not 1 <= self.iterations <= MAX_ITERATIONS:
            raise UserError(f"a loop needs a core of >= 1 block and 1..{MAX_ITERATIONS} iterations "
                            f"(got core {self.core}, iterations {self.iterations})")

    @property
    def n_blocks(self) -> int:
        return self.prelude + self.core + self.coda

    def depth(self, r: int) -> int:
        """L of the stack unrolled r times (residual depths 0..L)."""
        return self.prelude + self.core * r + self.coda

    def to_dict(self) -> dict:
        return asdict(self)


class Occurrence(nn.Module):
    """One position of the unrolled stack: calls a shared physical block (not registered here: its parameters live
    in LoopedLM.blocks) with this position's KV-cache slot; the first core block of an iteration injects e."""

    def __init__(self, owner: "LoopedLM", block_index: int, slot: int, iteration: int | None, core_j: int | None):
        super().__init__()
        object.__setattr__(self, "_owner", owner)  # a back reference, not a submodule (no parameter cycle)
        self.block_index, self.slot, self.iteration, self.core_j = block_index, slot, iteration, core_j

    def extra_repr(self) -> str:
        where = "prelude/coda" if self.iteration is None else f"iteration {self.iteration}, core block {self.core_j}"
        return f"block={self.block_index}, slot={self.slot}, {where}"

    def forward(self, hidden_states, *args, **kwargs):
        owner = self._owner
        block = owner.blocks[self.block_index]
        frozen = owner.training and self.iteration is not None and self.iteration <= owner.frozen_iterations
        with torch.no_grad() if frozen else nullcontext():
            if self.core_j == 0:  # entering iteration i with the state s_{i-1}
                if self.iteration == 1:
                    # s_0 = e: what enters the first iteration, after every hook on the prelude's output (a patch
                    # or a recorder at depth P) has run, so a patch of e reaches every injection too
                    owner._e = hidden_states
                if owner.training and self.iteration == owner.frozen_iterations + 1 and owner.frozen_iterations:
                    hidden_states = hidden_states.detach()  # truncated backpropagation: the last k iterations
                if owner.adapter is not None:
                    hidden_states = owner.adapter(torch.cat([hidden_states, owner._e.to(hidden_states.dtype)], -1))
            attn = block.self_attn
            saved, attn.layer_idx = attn.layer_idx, self.slot
            try:
                out = block(hidden_states, *args, **kwargs)
            finally:
                attn.layer_idx = saved
        return out


def base_model(lm):
    """The HF decoder whose block list is unrolled (Llama / Qwen style: lm.model.layers with self_attn)."""
    base = getattr(lm, "model", None)
    if base is None or not hasattr(base, "layers") or not all(hasattr(b, "self_attn") for b in base.layers):
        raise UserError("a looped model needs a Llama / Qwen-style decoder (blocks at lm.model.layers with self_attn)")
    return base


def unroll(model: "LoopedLM", r: int) -> nn.ModuleList:
    """The unrolled Occurrence list for r iterations (prelude, core x r, coda)."""
    s = model.spec
    occ = [Occurrence(model, j, j, None, None) for j in range(s.prelude)]
    for i in range(1, r + 1):
        occ += [Occurrence(model, s.prelude + j, len(occ) + j, i, j) for j in range(s.core)]
    occ += [Occurrence(model, s.prelude + s.core + j, len(occ) + j, None, None) for j in range(s.coda)]
    return nn.ModuleList(occ)


class LoopedLM(FullBandwidthLM):
    """A FullBandwidthLM without fusion whose block list is the unrolled loop (module doc)."""

    def __init__(self, lm, spec: LoopSpec):
        base = base_model(lm)
        physical = list(base.layers)
        if len(physical) != spec.n_blocks:
            raise UserError(f"a loop of prelude {spec.prelude} + core {spec.core} + coda {spec.coda} blocks needs a "
                            f"base model of {spec.n_blocks} blocks, got {len(physical)}")
        super().__init__(lm, fusion=False)
        self.spec = spec
        types = getattr(lm.config, "layer_types", None)
        self._physical_types = list(types) if types is not None else None
        self.blocks = nn.ModuleList(physical)
        D = self.d_model
        self.adapter = nn.Linear(2 * D, D, bias=False) if spec.inject else None
        if self.adapter is not None:  # start as the mean of state and e: at s_0 = e the first iteration reads e
            with torch.no_grad():
                self.adapter.weight.copy_(0.5 * torch.cat([torch.eye(D), torch.eye(D)], 1))
        self._unrolled: dict[int, nn.ModuleList] = {}
        self.frozen_iterations = 0  # training: iterations 1..this run without gradient (truncation)
        self._e = None
        self.iterations = 0
        self.set_iterations(spec.iterations)

    def set_iterations(self, r: int) -> None:
        """Unroll the core r times (1..MAX_ITERATIONS); the config's layer count and types follow."""
        if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= MAX_ITERATIONS:
            raise UserError(f"loop iterations must be an integer in 1..{MAX_ITERATIONS}, got {r!r}")
        base = base_model_of(self)
        if r not in self._unrolled:  # one list per r, kept: hooks registered on an unrolling stay valid
            self._unrolled[r] = unroll(self, r)
        base.layers = self._unrolled[r]
        occ = list(base.layers)
        self.lm.config.num_hidden_layers = len(occ)
        if self._physical_types is not None:
            self.lm.config.layer_types = [self._physical_types[o.block_index] for o in occ]
        self.iterations = r

    def forward(self, *args, **kwargs):
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._e = None  # the injected e belongs to one call (and, training, to its graph)

    def site_of(self, depth: int) -> dict:
        """Where residual depth `depth` of the unrolled stack lives (module function site_of)."""
        return site_of(self.spec, self.iterations, depth)

    def state_depth(self, i: int) -> int:
        """The residual depth of the loop state s_i (i = 0: the prelude's output e)."""
        if not 0 <= i <= self.iterations:
            raise UserError(f"loop state s_{i} does not exist: iterations 0..{self.iterations}")
        return self.spec.prelude + self.spec.core * i

    # ----- persistence --------------------------------------------------------------------------------
    @classmethod
    def _from_parts(cls, lm, cfg: dict, path) -> "LoopedLM":
        if "loop" not in cfg:
            raise UserError(f"{path} is not a looped model (no \"loop\" in its config.json)")
        try:
            spec = LoopSpec(**cfg["loop"])
        except TypeError as e:
            raise UserError(f"corrupt checkpoint config {path}/config.json: loop {e}") from None
        return cls(lm, spec)

    def physical_config(self) -> dict:
        cfg = self.lm.config.to_dict()
        cfg["num_hidden_layers"] = self.spec.n_blocks
        if self._physical_types is not None:
            cfg["layer_types"] = list(self._physical_types)
        return cfg

    def save_pretrained(self, path, tokenizer=None) -> None:
        import json
        from pathlib import Path

        from safetensors.torch import save_model

        from common.io import atomic_write
        from models.full_bandwidth import FORMAT, LOOP_FORMAT_VERSION, save_tokenizer

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        cfg = {"format": FORMAT, "format_version": LOOP_FORMAT_VERSION, "base_config": self.physical_config(),
               "fusion": self.fusion_settings(), "loop": self.spec.to_dict()}
        atomic_write(path / "model.safetensors", lambda tmp: save_model(self, tmp))
        atomic_write(path / "config.json", json.dumps(cfg, indent=2, sort_keys=True, default=str))
        if tokenizer is not None:
            save_tokenizer(tokenizer, path)


def site_of(spec: LoopSpec, r: int, depth: int) -> dict:
    """Where residual depth `depth` of the stack unrolled r times lives: {part, iteration, block}. part: embedding
    (depth 0), prelude (iteration 0, block j), core (iteration i = 1..r, core block j: depth P + R (i-1) + j + 1; its
    last block's output is the loop state s_i) or coda (iteration r, block j)."""
    if depth <= spec.prelude:
        return {"part": "embedding" if depth == 0 else "prelude", "iteration": 0, "block": depth - 1}
    k = depth - spec.prelude
    if k <= spec.core * r:
        return {"part": "core", "iteration": (k - 1) // spec.core + 1, "block": (k - 1) % spec.core}
    return {"part": "coda", "iteration": r, "block": k - spec.core * r - 1}


def require_looped(model, what: str) -> LoopedLM:
    """`model` if it is a LoopedLM, else a one-line UserError naming `what` (a loop-R mode)."""
    if not isinstance(model, LoopedLM):
        raise UserError(f"{what} runs a looped model's core R times: this model has no loop (models.looped)")
    return model


def base_model_of(model: LoopedLM):
    return model.lm.model


@contextmanager
def looping(model, r: int | None):
    """Run a LoopedLM with r iterations inside the block (None or a plain model: as it is), then restore."""
    if r is None or not isinstance(model, LoopedLM) or r == model.iterations:
        yield model
        return
    old = model.iterations
    model.set_iterations(r)
    try:
        yield model
    finally:
        model.set_iterations(old)
