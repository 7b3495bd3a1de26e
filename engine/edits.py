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

Each keeps its tensors on the CPU until the patcher moves it (`to(device, dtype)`); the math runs in float32 and
returns the base's dtype.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields, replace

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


def _rows(v: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    return v.to(base.device, base.dtype).expand_as(base)


@dataclass(frozen=True)
class Replace(Edit):
    source: torch.Tensor  # [batch, width]

    def forward(self, base):
        return _rows(self.source, base)


@dataclass(frozen=True)
class Zero(Edit):
    def forward(self, base):
        return torch.zeros_like(base)


@dataclass(frozen=True)
class Mean(Edit):
    mean: torch.Tensor  # [width]

    def forward(self, base):
        if self.mean.ndim > 2 or (self.mean.ndim == 2 and self.mean.shape[0] != 1):
            raise UserError(f"Mean needs one vector [width] (or [1, width]), got {tuple(self.mean.shape)}")
        return _rows(self.mean.reshape(1, -1), base)


@dataclass(frozen=True)
class Add(Edit):
    vector: torch.Tensor  # [width] or [batch, width]

    def forward(self, base):
        if self.vector.ndim not in (1, 2):  # a flat [batch * width] is not one vector per row
            raise UserError(f"Add needs a vector [width] or one per row [batch, width], got {tuple(self.vector.shape)}")
        return base + _rows(self.vector.reshape(1, -1) if self.vector.ndim == 1 else self.vector, base)


@dataclass(frozen=True)
class Scale(Edit):
    factor: float

    def forward(self, base):
        return base * float(self.factor)


def _check_basis(U: torch.Tensor) -> None:
    """U [width, k] must have orthonormal columns: x U U^T is then the projection onto span(U); with any other U it
    is not (ProjectOut twice would differ from once). Checked where it is cheap to trust: a float32 / float64
    basis without autograd (a basis trained through an orthogonal parametrization, interventions.das, is
    orthonormal by construction; a lower-precision copy is a cast of a checked one, Edit.to)."""
    if U.ndim != 2:
        raise ValueError(f"a subspace basis U must be [width, k], got shape {tuple(U.shape)}")
    if U.requires_grad or U.dtype not in (torch.float32, torch.float64) or U.shape[1] == 0:
        return
    with torch.no_grad():
        err = float((U.T.double() @ U.double() - torch.eye(U.shape[1], dtype=torch.float64, device=U.device))
                    .abs().max())
    if err > 1e-3:
        raise ValueError(f"a subspace basis U must have orthonormal columns (max |U^T U - I| = {err:.3g}): "
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
        return base.float() + _proj(_rows(self.source, base).float() - base.float(), self.U)


@dataclass(frozen=True)
class RowSwap(Edit):
    """Rows in `rows` [batch] bool take row donor[r]'s value *of this run* (differentiably): the trainer's
    interchange (engine.prefill.recurrent_run's swap and decoy) on the same footing as every other edit."""
    rows: torch.Tensor
    donor: torch.Tensor  # [batch] long

    def forward(self, base):
        return torch.where(self.rows.to(base.device)[:, None], base[self.donor.to(base.device)], base)


@dataclass(frozen=True)
class Lambda(Edit):
    fn: object  # base -> replacement

    def forward(self, base):
        return self.fn(base)


def apply(value, base: torch.Tensor) -> torch.Tensor:
    """A patch value at a site whose current activation is `base`: an Edit's output, or the tensor itself."""
    return value(base) if isinstance(value, Edit) else value.to(base.dtype)
