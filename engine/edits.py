"""Interventions as small objects, independent of where they are applied (pyvene's `forward(base, source)`).

An edit maps the activation a patched run has at a site, `base` [batch, width], to its replacement. Whatever the
site (a fed state, a fused input, the residual at (depth, position), an attention / MLP / head output) and the
mechanism (engine.patching), the patcher calls `edit(base)` at the moment the run reaches the site, so an edit
reads the *patched* run's value there (an earlier patch has propagated into it). A plain tensor as a
`Patch.value` is `Replace(tensor)`.

    Replace(source)               source                       (interchange: source = the donor's clean value)
    Zero()                        0
    Mean(mean)                    mean, broadcast over rows
    Add(vector)                   base + vector                (steering)
    Scale(factor)                 factor * base
    KeepSubspace(U)               base U U^T                   (U [width, k] orthonormal columns, checked)
    ProjectOut(U)                 base - base U U^T
    SubspaceInterchange(source, U)  base + (source - base) U U^T  (only span(U) from the source; DAS-style)
    RowSwap(rows, donor)          row r (where rows[r]) takes row donor[r]'s base: a swap inside the run
    Lambda(fn)                    fn(base)

Each keeps its tensors on the CPU until the patcher moves it (`to(device, dtype)`) and returns the base's dtype;
the subspace edits compute in float32 (at least), the others in the base's dtype. Shapes are taken as written: a
per-row value is exactly [batch, width] (no broadcasting of a [1, width], [width] or [batch, 1] tensor into it);
only `Mean` and `Add` take one vector for every row, [width] or [1, width].
"""
from __future__ import annotations

import numbers
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from common.errors import UserError


# torch's words for operands of incompatible shapes (broadcast, expand, matmul, view, cat / gather ranks)
_SHAPE_ERROR = re.compile(r"size|shape|dimension", re.IGNORECASE)
_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)  # torch < 2.5: only the CUDA one


class Edit(ABC):
    """Base class: `forward(base) -> replacement`; `__call__` keeps the base's dtype."""

    @abstractmethod
    def forward(self, base: torch.Tensor) -> torch.Tensor:
        """The replacement of `base` [batch, width]."""

    def __call__(self, base: torch.Tensor) -> torch.Tensor:
        """The replacement in the base's dtype; an edit whose tensors (or whose function's result) do not fit the
        site's [batch, width] is one UserError line naming both shapes, not a torch error deep in a hook."""
        try:
            out = self.forward(base)
        except RuntimeError as e:  # a tensor of another batch or width: expand / matmul fail. Only those: out of
            # memory, a dtype or a device error is not a misfit of shapes, and stays what it is
            first = (str(e).splitlines() or [""])[0]
            if isinstance(e, _OUT_OF_MEMORY) or not _SHAPE_ERROR.search(first):
                raise
            raise UserError(f"{type(self).__name__} does not fit this site's value of shape {tuple(base.shape)}: "
                            f"{first}") from None
        if not isinstance(out, torch.Tensor) or out.shape != base.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise UserError(f"{type(self).__name__} returned {got} for this site's value of shape "
                            f"{tuple(base.shape)}: an edit must return the base's shape")
        return out.to(base.dtype)

    def to(self, device=None, dtype=None) -> "Edit":
        """A copy whose tensors sit on `device` (float tensors in `dtype`)."""
        moved = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                moved[f.name] = v.to(device, dtype) if v.is_floating_point() and dtype is not None else v.to(device)
        return replace(self, **moved) if moved else self


def _rows(v: torch.Tensor, base: torch.Tensor, what: str) -> torch.Tensor:
    """`v`, one row per row of `base` [batch, width], exactly: torch would broadcast a [1, width], [width], [batch, 1]
    or scalar tensor into every row, a silent misfit (a forgotten `[donor]` or `.mean(0)`)."""
    if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(base.shape):
        got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
        raise UserError(f"{what} must be one row per row of this site's value, shape {tuple(base.shape)} "
                        f"[batch, width] (got {got})")
    return v.to(base.device, base.dtype)


def _one_vector(v: torch.Tensor, base: torch.Tensor, what: str) -> torch.Tensor:
    """`v` [width] or [1, width] (one vector for every row) as [1, width]; [batch, width] where `per_row`."""
    width = base.shape[-1]
    if not isinstance(v, torch.Tensor) or v.ndim not in (1, 2) or v.shape[-1] != width \
            or (v.ndim == 2 and v.shape[0] != 1):
        got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
        raise UserError(f"{what} must be one vector [{width}] (or [1, {width}]) for this site, got {got}")
    return v.to(base.device, base.dtype).reshape(1, width)


@dataclass(frozen=True)
class Replace(Edit):
    source: torch.Tensor  # [batch, width]

    def forward(self, base):
        return _rows(self.source, base, "Replace's source")


@dataclass(frozen=True)
class Zero(Edit):
    def forward(self, base):
        return torch.zeros_like(base)


@dataclass(frozen=True)
class Mean(Edit):
    mean: torch.Tensor  # [width] or [1, width]

    def forward(self, base):
        return _one_vector(self.mean, base, "Mean's mean").expand_as(base)


@dataclass(frozen=True)
class Add(Edit):
    vector: torch.Tensor  # [width] or [batch, width]

    def forward(self, base):
        if isinstance(self.vector, torch.Tensor) and self.vector.ndim == 2 and self.vector.shape[0] != 1:
            return base + _rows(self.vector, base, "Add's vector")  # one per row
        return base + _one_vector(self.vector, base, "Add's vector (or one per row [batch, width])")


@dataclass(frozen=True)
class Scale(Edit):
    factor: float

    def __post_init__(self):
        f = self.factor
        if isinstance(f, torch.Tensor) and f.numel() == 1:
            f = f.item()
        if isinstance(f, (bool, np.bool_)) or not isinstance(f, numbers.Real):  # numpy scalars too
            raise UserError(f"Scale's factor must be one real number, got {type(self.factor).__name__}"
                            + (f" of shape {tuple(self.factor.shape)}" if isinstance(self.factor, torch.Tensor) else ""))
        object.__setattr__(self, "factor", float(f))

    def forward(self, base):
        return base * self.factor


def _check_basis(U: torch.Tensor) -> None:
    """U [width, k] must have orthonormal columns: x U U^T is then the projection onto span(U); with any other U it
    is not (ProjectOut twice would differ from once). Checked in float64 whatever U's dtype or autograd (a k x k
    product), within 1e-3 or 4 of U's dtype's epsilons (a bfloat16 cast of an orthonormal basis is off by ~1.5e-3);
    a NaN or inf entry fails."""
    if not isinstance(U, torch.Tensor) or not U.is_floating_point():
        raise UserError(f"a subspace basis U must be a float tensor [width, k], got {type(U).__name__}")
    if U.ndim != 2:
        raise UserError(f"a subspace basis U must be [width, k], got shape {tuple(U.shape)}")
    if U.shape[1] == 0:
        return
    with torch.no_grad():
        V = U.detach().double()
        err = float((V.T @ V - torch.eye(U.shape[1], dtype=torch.float64, device=U.device)).abs().max())
    tol = max(1e-3, 4 * torch.finfo(U.dtype).eps)
    if not err <= tol:  # NaN fails too
        raise UserError(f"a subspace basis U must have finite orthonormal columns (max |U^T U - I| = {err:.3g}): "
                        "orthonormalize it first, e.g. torch.linalg.qr(U).Q")


def _proj(x: torch.Tensor, U: torch.Tensor) -> torch.Tensor:
    U = U.to(x.device, torch.float32)
    return (x.float() @ U) @ U.T


@dataclass(frozen=True)
class KeepSubspace(Edit):
    U: torch.Tensor  # [width, k], orthonormal columns

    def __post_init__(self):
        _check_basis(self.U)

    def forward(self, base):
        return _proj(base, self.U)


@dataclass(frozen=True)
class ProjectOut(Edit):
    U: torch.Tensor  # [width, k], orthonormal columns

    def __post_init__(self):
        _check_basis(self.U)

    def forward(self, base):
        return base.float() - _proj(base, self.U)


@dataclass(frozen=True)
class SubspaceInterchange(Edit):
    source: torch.Tensor  # [batch, width]
    U: torch.Tensor  # [width, k], orthonormal columns

    def __post_init__(self):
        _check_basis(self.U)

    def forward(self, base):
        return base.float() + _proj(_rows(self.source, base, "SubspaceInterchange's source").float() - base.float(),
                                    self.U)


@dataclass(frozen=True)
class RowSwap(Edit):
    """Rows in `rows` [batch] bool take row donor[r]'s value *of this run* (differentiably): the trainer's
    interchange (engine.prefill.recurrent_run's swap and decoy) on the same footing as every other edit."""
    rows: torch.Tensor
    donor: torch.Tensor  # [batch] long

    def forward(self, base):
        B = base.shape[0]
        if not isinstance(self.rows, torch.Tensor) or self.rows.dtype != torch.bool or tuple(self.rows.shape) != (B,):
            raise UserError(f"RowSwap's rows must be a bool mask [batch={B}]")
        if not isinstance(self.donor, torch.Tensor) or self.donor.is_floating_point() or self.donor.is_complex() \
                or self.donor.dtype == torch.bool or tuple(self.donor.shape) != (B,):
            raise UserError(f"RowSwap's donor must be integer row indices [batch={B}]")
        # the range on the host only: on an accelerator it would cost a sync per call (the trainer swaps every step),
        # and an index out of range there is an error of its own, not a silent misfit
        if B and self.donor.device.type == "cpu" and (int(self.donor.min()) < 0 or int(self.donor.max()) >= B):
            raise UserError(f"RowSwap's donor rows must lie in 0..{B - 1} "
                            f"(got {int(self.donor.min())}..{int(self.donor.max())})")
        return torch.where(self.rows.to(base.device)[:, None], base[self.donor.to(base.device)], base)


@dataclass(frozen=True)
class Lambda(Edit):
    fn: object  # base -> replacement

    def forward(self, base):
        return self.fn(base)


def apply(value, base: torch.Tensor) -> torch.Tensor:
    """A patch value at a site whose current activation is `base`: an Edit's output, or the tensor itself."""
    return value(base) if isinstance(value, Edit) else value.to(base.dtype)
