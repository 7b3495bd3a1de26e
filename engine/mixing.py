"""Recirculation's configuration and its one formula: the spec (source s, target d, alpha, convex/residual,
ramp, optional transform / subspace), its CLI parser, and the norm-matched mix z' of z_d and z_s
(engine/recirculation.py runs it)."""
from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field

import torch

from common.errors import UserError

MODES = ("convex", "residual")
_SPEC_RE = re.compile(r"^\s*(-?\d+)\s*:\s*(-?\d+)\s*:\s*([^:]+?)\s*(?::\s*(\w+)\s*)?(?::\s*(?i:ramp)(\d+)\s*)?$")
SPEC_FORM = "s:d:alpha[:convex|residual][:rampN]"


# ----- configuration ----------------------------------------------------------------------------------------
def exact_g(x: float) -> str:
    """`x` as `:g` writes it (0.1, 1, 1e-05) where that reads back as the same float, else its shortest exact
    form (0.1000004): a mode name is a cache key and a row key, so two values never share one."""
    x = float(x)
    short = f"{x:g}"
    return short if float(short) == x else repr(x)


@dataclass(frozen=True, eq=False)
class RecircSpec:
    source: int  # depth s (1..L)
    target: int  # depth d (0..s-1)
    alpha: float
    mode: str = "convex"
    ramp: int = 0  # early-token ramp length (0 = none): alpha_t = alpha * min(1, (pos+1)/ramp)
    transform: torch.Tensor | None = field(default=None, repr=False)  # [D, D] applied to z_s: z_s @ transform.T
    subspace: torch.Tensor | None = field(default=None, repr=False)  # [D, k] orthonormal columns
    subspace_complement: bool = False  # apply the change only in the orthogonal complement of `subspace`

    def __post_init__(self):
        for name in ("source", "target"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):  # numpy's integers too
                raise UserError(f"recirculation {name} depth must be an integer, got {v!r}")
        a = self.alpha
        if not isinstance(a, (int, float)) or isinstance(a, bool) or not (0.0 <= float(a) <= 1.0):
            raise UserError(f"recirculation alpha must be a number in [0, 1], got {a!r}")
        if self.mode not in MODES:
            raise UserError(f"recirculation mode must be convex or residual, got {self.mode!r}")
        if not (isinstance(self.ramp, int) and self.ramp >= 0):
            raise UserError(f"recirculation ramp must be a non-negative integer, got {self.ramp!r}")
        if self.source <= self.target:
            raise UserError(f"recirculation source depth must be deeper than the target: got s={self.source} <= "
                            f"d={self.target}")
        if self.target < 0:
            raise UserError(f"recirculation target depth must be >= 0, got {self.target}")

    def same_run(self, other: "RecircSpec") -> bool:
        """Whether `other` runs exactly as this spec: its name and the same transform and subspace (a name leaves
        the tensors out)."""
        def same(a, b):
            return a is b or (a is not None and b is not None and a.shape == b.shape and bool(torch.equal(a, b)))

        return (self.name == other.name and same(self.transform, other.transform)
                and same(self.subspace, other.subspace) and self.subspace_complement == other.subspace_complement)

    @property
    def beta(self) -> float:
        return 1.0 - float(self.alpha) if self.mode == "convex" else 1.0

    @property
    def is_identity(self) -> bool:
        return float(self.alpha) == 0.0 and self.beta == 1.0 and self.transform is None and self.subspace is None

    @property
    def name(self) -> str:
        extra = f":ramp{self.ramp}" if self.ramp else ""
        return f"recirc-{self.source}:{self.target}:{exact_g(self.alpha)}:{self.mode}{extra}"

    def validate(self, n_layers: int) -> "RecircSpec":
        if not (1 <= self.source <= n_layers):
            raise UserError(f"recirculation source depth {self.source} out of range: this model has depths 0..{n_layers}"
                            f" (source must be 1..{n_layers})")
        if not (0 <= self.target < self.source):
            raise UserError(f"recirculation target depth {self.target} out of range 0..{self.source - 1}")
        return self


def parse_recirculate(value: str, n_layers: int | None = None) -> RecircSpec:
    """'s:d:alpha[:convex|residual][:rampN]' -> RecircSpec (validated against n_layers when given): the form
    `RecircSpec.name` writes, so every spec a run reports reads back as itself."""
    m = _SPEC_RE.match(str(value)) if str(value).isascii() else None  # one spelling: \d and float() take any digits
    if not m:
        raise UserError(f"bad recirculation spec {value!r}: use {SPEC_FORM}, e.g. 20:8:0.1:convex")
    try:
        alpha = float(m.group(3))
    except ValueError:
        raise UserError(f"bad recirculation spec {value!r}: alpha {m.group(3)!r} is not a number") from None
    if not math.isfinite(alpha):
        raise UserError(f"bad recirculation spec {value!r}: alpha must be in [0, 1]")
    mode, ramp = (m.group(4) or "convex").lower(), int(m.group(5) or 0)
    if mode.startswith("ramp") and mode[4:].isdigit():  # s:d:alpha:rampN (convex)
        if m.group(5) is not None:
            raise UserError(f"bad recirculation spec {value!r}: one ramp at most ({SPEC_FORM})")
        mode, ramp = "convex", int(mode[4:])
    spec = RecircSpec(int(m.group(1)), int(m.group(2)), alpha, mode, ramp)
    return spec.validate(n_layers) if n_layers is not None else spec


def mix(zd: torch.Tensor, zs: torch.Tensor, spec: RecircSpec, alpha_t: torch.Tensor | float | None = None,
        eps: float = 1e-12) -> torch.Tensor:
    """z' from z_d and z_s ([..., D]); alpha_t broadcastable to zd[..., :1] (default: spec.alpha). Float32 math at
    least (a float64 model keeps float64: float32 here would put a 1e-8 floor under its alpha > 0 comparisons)."""
    dtype = zd.dtype
    work = torch.promote_types(dtype, torch.float32)
    zd32, zs32 = zd.to(work), zs.to(work)
    if spec.transform is not None:
        zs32 = zs32 @ spec.transform.to(zs32).T
    a = torch.as_tensor(spec.alpha if alpha_t is None else alpha_t, dtype=work, device=zd.device)
    if a.dim() > 0:
        a = a[..., None]
    b = 1.0 - a if spec.mode == "convex" else torch.ones_like(a)
    scale = zd32.norm(dim=-1, keepdim=True) / zs32.norm(dim=-1, keepdim=True).clamp_min(eps)
    out = a * scale * zs32 + b * zd32
    if spec.subspace is not None:
        U = spec.subspace.to(zd32)  # [D, k]
        delta = out - zd32
        proj = (delta @ U) @ U.T
        out = zd32 + (delta - proj if spec.subspace_complement else proj)
    return out.to(dtype)
