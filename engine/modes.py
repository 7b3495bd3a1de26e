"""A mode is parsed once, here: the one spelling of every way the engine can run a prompt.

    standard          one parallel pass on token embeddings (aliases: std, fused-0, recurrent-0)
    recurrent-K       the last K columns recomputed one token at a time, each fused with the previous top state
                      (alias: soft = recurrent-1)
    recurrent-full    every position after the first fused: O(T) cached one-token steps
    fused-N           N parallel Jacobi feedback passes after the standard one (alias: fused = fused-1)
    recirc-S:D:A[:convex|residual][:rampN]
                      training-free recirculation of depth S into depth D with weight A (engine.recirculation)
    loop-R            a looped model (models.looped) run with R iterations of its core: one parallel pass, feedback
                      in depth, none across positions (on a looped model, standard runs its trained R)
    loop-R:TOL        adaptive exit (Huginn): per prompt, the fewest iterations r <= R after which the loop state at
                      T changes by less than TOL (relative), and the answer of the model run r times

CLIs call :func:`parse_mode` / :func:`canonical_modes` at their boundary and pass :class:`Mode` values (or
their canonical ``.name``) down; every error for a bad mode is the one message below.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from common.errors import UserError

DECODINGS = ("std", "soft", "fused")  # generation: token only, fed-back state, fused-1 prefill then fed back
ALIASES = {"std": "standard", "soft": "recurrent-1", "fused": "fused-1"}
RECIRC_PREFIX = "recirc-"
# Bounds checked when a mode is parsed, before any work: fused-n keeps n passes' states, recurrent-k is cropped
# to the prompt anyway. Larger values are typos (fused-99999 grew memory until killed).
MAX_FUSED_PASSES = 1000
MAX_RECURRENT_K = 100_000
MAX_LOOP_ITERATIONS = 256  # models.looped.MAX_ITERATIONS
# Named groups: a new kind's alternative adds a group without renumbering the others.
_MODE_RE = re.compile(r"^(?:(?P<standard>standard)|recurrent-(?P<recurrent>\d+|full)|fused-(?P<fused>\d+)"
                      r"|loop-(?P<loop>\d+)(?::(?P<tol>[0-9.eE+-]+))?)$")
HELP = "standard, recurrent-K, recurrent-full, fused-N, loop-R, loop-R:TOL or recirc-S:D:ALPHA[:convex|residual][:rampN]"
# analysis.evaluate's default --modes (here, below both, so that training.card can tell a default run apart)
EVAL_MODES = "std,soft,fused,recurrent-full,fused-1..30"


@dataclass(frozen=True, eq=False)
class Mode:
    kind: str  # "standard" | "recurrent" | "fused" | "recirc" | "loop"
    n: int | None = None  # k for recurrent (None = full), passes for fused, iterations for loop
    recirc: object | None = None  # engine.recirculation.RecircSpec for kind "recirc"
    tol: float | None = None  # loop-R:TOL, the adaptive exit's threshold (kind "loop")

    @property
    def name(self) -> str:
        if self.kind == "standard":
            return "standard"
        if self.kind == "recurrent":
            return "recurrent-full" if self.n is None else f"recurrent-{self.n}"
        if self.kind == "fused":
            return f"fused-{self.n}"
        if self.kind == "loop":
            if self.tol is None:
                return f"loop-{self.n}"
            from engine.mixing import exact_g

            return f"loop-{self.n}:{exact_g(self.tol)}"
        return self.recirc.name

    @property
    def has_feedback(self) -> bool:
        """Needs the model's fusion module (recirculation runs on models without one)."""
        return self.kind in ("recurrent", "fused")

    @property
    def feeds_state(self) -> bool:
        """Carries a state from earlier positions into later ones beside the tokens (the fused h_{t-1}, or
        recirculation's z_{t-1,s}): what the causal battery's fed-state analyses patch."""
        return self.kind not in ("standard", "loop")

    @property
    def is_recirculation(self) -> bool:
        return self.kind == "recirc"

    @property
    def loop_iterations(self) -> int | None:
        """R of a loop-R mode (a looped model's core iterated R times), else None; None too for the adaptive exit
        (loop-R:TOL, whose iterations vary per prompt)."""
        return self.n if self.kind == "loop" and self.tol is None else None

    def depth(self, model) -> int:
        """L of the stack this mode runs on `model` (residual depths 0..L): a loop mode unrolls a looped model's
        core R times (loop-R:TOL at most R), every other mode runs the model's own blocks."""
        if self.kind == "loop":
            from models.looped import require_looped

            return require_looped(model, self.name).spec.depth(self.n)
        return model.n_layers

    @property
    def adaptive_exit(self) -> tuple[int, float] | None:
        """(R, TOL) of loop-R:TOL, else None."""
        return (self.n, self.tol) if self.kind == "loop" and self.tol is not None else None

    @property
    def has_gradient(self) -> bool:
        """Whether the engine's runs of this mode are differentiable (recirculation runs without gradient)."""
        return self.kind != "recirc"

    @property
    def attributable(self) -> bool:
        """Whether engine.attribution computes every site's gradient in one run of this mode."""
        return self.kind in ("standard", "recurrent") or self.loop_iterations is not None

    @property
    def fed_top_source(self) -> str | None:
        """The mode whose top state at T-1 is the state fed into T (None: no top state is fed).

        recurrent-k: its own run (the recurrence feeds the previous column's top state of the same run);
        fused-n: pass n fuses pass n-1's top states, i.e. fused-(n-1) (fused-0 = standard); recirculation feeds
        a source-depth state, not a top state."""
        if self.kind == "recurrent":
            return self.name
        if self.kind == "fused":
            return "standard" if self.n == 1 else f"fused-{self.n - 1}"
        return None

    def fed_positions(self, T: int) -> list[int]:
        """Negative offsets (-1 = T) of the positions that take a fed state in prompts of T columns."""
        if self.kind in ("standard", "loop"):
            return []
        if self.kind == "recurrent":
            k = T - 1 if self.n is None else min(self.n, T - 1)
            return list(range(-k, 0))
        return list(range(1 - T, 0))  # fused-n and recirculation: every position after the first

    def __eq__(self, other):
        return isinstance(other, Mode) and other.name == self.name

    def __hash__(self):
        return hash(self.name)

    def __str__(self):
        return self.name


def parse_mode(mode, n_layers: int | None = None) -> Mode:
    """A mode name, alias or Mode -> Mode (recirc depths checked against `n_layers` when given)."""
    if isinstance(mode, Mode):
        if mode.kind == "recirc" and n_layers is not None:
            mode.recirc.validate(n_layers)
        return mode
    s = ALIASES.get(str(mode).strip(), str(mode).strip())
    if s.startswith(RECIRC_PREFIX):
        from engine.mixing import parse_recirculate

        try:
            return Mode("recirc", recirc=parse_recirculate(s[len(RECIRC_PREFIX):], n_layers))
        except UserError as e:  # name what the user typed (the spec parser also serves probes.run's --recirculate)
            raise UserError(f"mode {s!r}: {e}") from None
    m = _MODE_RE.match(s)
    if not m:
        raise UserError(f"unknown prefill mode {mode!r} (use {HELP})")
    if m.group("standard"):
        return Mode("standard")
    if m.group("recurrent") is not None:
        if m.group("recurrent") == "full":
            return Mode("recurrent", None)
        k = int(m.group("recurrent"))
        if k > MAX_RECURRENT_K:
            raise UserError(f"mode {mode!r}: k must be <= {MAX_RECURRENT_K} (recurrent-full recomputes every "
                            "position)")
        return Mode("standard") if k == 0 else Mode("recurrent", k)
    if m.group("loop") is not None:
        r = int(m.group("loop"))
        if not 1 <= r <= MAX_LOOP_ITERATIONS:
            raise UserError(f"mode {mode!r}: a loop runs 1..{MAX_LOOP_ITERATIONS} iterations")
        if m.group("tol") is None:
            return Mode("loop", r)
        try:
            tol = float(m.group("tol"))
        except ValueError:
            tol = float("nan")
        if not 0 < tol < 1:  # NaN fails too
            raise UserError(f"mode {mode!r}: the exit threshold TOL must be a number in (0, 1) (a relative change)")
        return Mode("loop", r, tol=tol)
    n = int(m.group("fused"))
    if n > MAX_FUSED_PASSES:
        raise UserError(f"mode {mode!r}: at most {MAX_FUSED_PASSES} fused passes")
    return Mode("standard") if n == 0 else Mode("fused", n)


def canonical_modes(modes, n_layers: int | None = None) -> list[str]:
    """Parse and de-duplicate modes (aliases become one canonical name), keep order. A comma-separated string
    or a list of names / Modes."""
    if isinstance(modes, str):
        modes = [m for m in modes.split(",") if m.strip()]
    out: list[str] = []
    for m in modes:
        name = parse_mode(m, n_layers).name
        if name not in out:
            out.append(name)
    if not out:
        raise UserError("no modes given")
    return out


def is_recirc(mode) -> bool:
    return (mode.kind == "recirc") if isinstance(mode, Mode) else str(mode).startswith(RECIRC_PREFIX)
