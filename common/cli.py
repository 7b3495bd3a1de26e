"""The CLI toolkit every command shares: one-line-error parser, bounded numeric arguments, output paths.

A malformed invocation must end in exactly one stderr line and exit code 2 *before any heavy work and before
any file is touched*: parse with `Parser`, give every size flag a range with `int_in` / `float_in`, and check
output locations with `output_dir` / `output_file` before loading a model.
"""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from common.errors import UserError


class Parser(argparse.ArgumentParser):
    """argparse without the usage block: an error is one line (via `common.errors.cli_entry`), exit 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UserError(message)


def _range_text(lo, hi) -> str:
    if hi is None:
        return f">= {lo}"
    return f"in {lo}..{hi}"


def int_in(lo: int, hi: int | None = None):
    """argparse `type=`: a base-10 integer in [lo, hi] (hi None = unbounded above)."""

    def parse(s: str) -> int:
        try:
            v = int(str(s).strip(), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer {_range_text(lo, hi)}, got {s!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be an integer {_range_text(lo, hi)}, got {v}")
        return v

    parse.__name__ = "int"
    return parse


def float_in(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False):
    """argparse `type=`: a finite float in the range (open ends with lo_open / hi_open); nan and inf refused."""

    def text() -> str:
        a = "-inf" if lo is None else str(lo)
        b = "inf" if hi is None else str(hi)
        return f"{'(' if lo_open or lo is None else '['}{a}, {b}{')' if hi_open or hi is None else ']'}"

    def parse(s: str) -> float:
        try:
            v = float(str(s).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a finite number in {text()}, got {s!r}") from None
        bad = not math.isfinite(v) or (lo is not None and (v < lo or (lo_open and v == lo))) or \
            (hi is not None and (v > hi or (hi_open and v == hi)))
        if bad:
            raise argparse.ArgumentTypeError(f"must be a finite number in {text()}, got {s}")
        return v

    parse.__name__ = "float"
    return parse


def int_list(spec: str, what: str, lo: int = 0, hi: int | None = None) -> list[int]:
    """'0,8,32' -> [0, 8, 32]: integers in [lo, hi], duplicates dropped (first kept); one message on error."""
    out: list[int] = []
    for x in str(spec).split(","):
        if not x.strip():
            continue
        try:
            v = int(x.strip(), 10)
        except ValueError:
            raise UserError(f"{what} must be comma-separated integers {_range_text(lo, hi)}, got {spec!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise UserError(f"{what} must be comma-separated integers {_range_text(lo, hi)}, got {v}")
        if v not in out:
            out.append(v)
    if not out:
        raise UserError(f"{what} is empty")
    return out


def position_list(spec: str, what: str, max_back: int) -> list[int]:
    """'T,T-1,-5' -> [-1, -2, -5]: positions as T, T-k or negative column offsets (-1 = T), at most `max_back`
    columns back; duplicates dropped (first kept); one message on error."""
    msg = (f"{what} must be comma-separated positions T, T-1, T-2, ... or negative offsets -1, -2, ... "
           f"(at most {max_back} back), got {spec!r}")
    out: list[int] = []
    for x in str(spec).split(","):
        x = x.strip().upper()
        if not x:
            continue
        try:
            v = -1 if x == "T" else (-1 - int(x[2:], 10) if x.startswith("T-") else int(x, 10))
        except ValueError:
            raise UserError(msg) from None
        if not -max_back <= v <= -1:
            raise UserError(msg)
        if v not in out:
            out.append(v)
    if not out:
        raise UserError(f"{what} is empty")
    return out


def float_list(spec: str, what: str, lo: float | None = None, hi: float | None = None) -> list[float]:
    """'0.1,0.2' -> [0.1, 0.2]: finite floats in [lo, hi]; one message on error."""
    check = float_in(lo, hi)
    out: list[float] = []
    for x in str(spec).split(","):
        if not x.strip():
            continue
        try:
            out.append(check(x))
        except argparse.ArgumentTypeError as e:
            raise UserError(f"{what}: {e}") from None
    if not out:
        raise UserError(f"{what} is empty")
    return out


# ----- output locations ----------------------------------------------------------------------------------------
def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists():
        if p.parent == p:
            break
        p = p.parent
    return p


def _check_creatable(path: Path, flag: str) -> None:
    anc = _nearest_existing(path.absolute())
    if not anc.is_dir():
        raise UserError(f"{flag} {path}: {anc} is not a directory")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: {anc} is not writable")
    # /proc, /sys and similar pseudo file systems report as writable to root but refuse new files.
    try:
        st = os.statvfs(anc)
    except OSError:
        return
    if st.f_blocks == 0 and not path.exists():
        raise UserError(f"{flag} {path}: {anc} is not on a file system that can hold results")


# A model directory: its config.json beside weights (full-bandwidth checkpoints and plain HF models alike).
MODEL_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                 "pytorch_model.bin.index.json")


def _is_model_dir(p: Path) -> bool:
    return (p / "config.json").is_file() and any((p / w).is_file() for w in MODEL_WEIGHTS)


def _refuse_model_dir(path: Path, flag: str, allow_self: bool = False) -> None:
    """Results never go into a model's folder (`--out CKPT/config.json` once overwrote the checkpoint's own config):
    refuse a path that is, or lies inside, a model directory (symlinks resolved). `allow_self`: the path may be
    a model directory itself (training writes its checkpoint there), never lie inside one."""
    try:
        real = path.resolve()
    except (OSError, RuntimeError):  # a symlink loop: judged by the path as written
        real = Path(os.path.abspath(path))
    for p in [real, *real.parents]:
        if p == real and allow_self:
            continue
        if _is_model_dir(p):
            where = "is" if p == real else f"is inside {p}, which is"
            raise UserError(f"{flag} {path} {where} a model directory (config.json and weights); results are "
                            "never written into a model's folder: choose another path")


def output_dir(value: str | Path | None, flag: str = "--out", model_dir: bool = False) -> Path:
    """A results directory given on the command line: refused when empty, an existing file, not creatable, or in a
    model's folder (`model_dir=True`: it may be a model folder itself, for training's checkpoints)."""
    if value is None:
        raise UserError(f"{flag} is required")
    if str(value).strip() == "":
        raise UserError(f"{flag} is empty: give a directory")
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} exists and is not a directory")
    if path.exists() and not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path} is not writable")
    _refuse_model_dir(path, flag, allow_self=model_dir)
    _check_creatable(path, flag)
    return path


def output_file(value: str | Path | None, flag: str = "--out") -> Path:
    """A results file given on the command line: refused when empty, a directory, not creatable, or in a model's
    folder."""
    if value is None:
        raise UserError(f"{flag} is required")
    if str(value).strip() == "":
        raise UserError(f"{flag} is empty: give a file path")
    path = Path(value)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a directory, not a file")
    _refuse_model_dir(path, flag)  # a model's own files (config.json, weights) above all
    if path.exists() and not os.access(path, os.W_OK):
        raise UserError(f"{flag} {path} is not writable")
    if not path.exists():
        _check_creatable(path, flag)
    return path


def safe_name(name_or_path: str | Path) -> str:
    """A name for a model given by preset or path, safe as one folder name (no '', '.', '..', no separator)."""
    s = str(name_or_path).strip()
    p = Path(s)
    name = p.name if p.name not in ("", ".", "..") else Path(os.path.abspath(s)).name
    if name in ("", ".", "..") or os.sep in name:
        raise UserError(f"cannot derive a model name from {str(name_or_path)!r}: give --out explicitly")
    return name
