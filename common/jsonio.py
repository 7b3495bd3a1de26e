"""JSON a user hands us (task files, checkpoint configs, training logs), read as one `UserError` line or a plain value.

`json.loads` alone turns some inputs into tracebacks (an integer of thousands of digits: ValueError from Python's
int-size limit; an array nested 100,000 deep: RecursionError) and others into values no file should hold
(`NaN`, `Infinity`, `1e999` -> inf, a lone surrogate `"\\ud800"` that no tokenizer or writer accepts).
`loads_user` refuses all of them, naming `where` (the file, and line for JSONL).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from common.errors import UserError

MAX_DEPTH = 100  # nesting levels; real configs and task lines use < 10
MAX_INT_DIGITS = 100  # no count, size or id in these files comes near it; Python's own limit is 4300


class _Refused(ValueError):
    """A value json.loads would accept but we do not (raised from its parse hooks)."""


def _parse_int(s: str) -> int:
    if len(s.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(s.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(s)


def _parse_float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise _Refused(f"the number {s[:30]} is out of range for a float")
    return v


def _parse_constant(s: str):
    raise _Refused(f"{s} is not a JSON number")


def _check_tree(obj) -> None:
    """Depth <= MAX_DEPTH and every string valid Unicode (iterative: the depth is what is being checked)."""
    stack = [(obj, 1)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, (dict, list)):
            if depth > MAX_DEPTH:
                raise _Refused(f"nested deeper than {MAX_DEPTH} levels")
            items = list(x.keys()) + list(x.values()) if isinstance(x, dict) else x
            stack.extend((v, depth + 1) for v in items)
        elif isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                raise _Refused(f"a string holds a lone surrogate escape ({x[:20]!r}), which is not text") from None


def _unique_keys(pairs) -> dict:
    """An object whose keys are all distinct: Python's json keeps the last of a repeated key silently, so
    `{"label": 0, "label": 1}` would be read as 1; a typo must not pass as data."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise _Refused(f"key {k[:40]!r} appears twice in one object")
        out[k] = v
    return out


def loads_user(text: str | bytes, where: str):
    """Parse `text` (bytes are decoded as UTF-8) or raise UserError `"{where}: ..."` (one line)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        obj = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant,
                         object_pairs_hook=_unique_keys)
        _check_tree(obj)
    except _Refused as e:
        raise UserError(f"{where}: {e}") from None
    except json.JSONDecodeError as e:
        at = f" at line {e.lineno} column {e.colno}" if "\n" in text.strip() else ""
        raise UserError(f"{where}: not valid JSON ({e.msg}{at})") from None
    except RecursionError:  # the C scanner's own depth limit, reached before _check_tree's
        raise UserError(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
    return obj


def read_user_json(path: str | Path, what: str = ""):
    """`loads_user` of a file's contents; an unreadable file is one UserError line too."""
    path = Path(path)
    where = f"{what} {path}".strip()
    if path.exists() and not path.is_file():  # a FIFO waits forever, /dev/zero reads until memory runs out
        raise UserError(f"{where} is not a regular file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {where}: {e.strerror or e}") from None
    return loads_user(data, where)


def split_jsonl(text: str) -> list[tuple[int, str]]:
    """(line number, line) of each non-blank line: split on "\\n" only (a "\\r" before it dropped), never on the
    Unicode separators str.splitlines() also splits on (U+2028 may stand raw inside a JSON string)."""
    lines = [(i, ln[:-1] if ln.endswith("\r") else ln) for i, ln in enumerate(text.split("\n"), start=1)]
    return [(i, ln) for i, ln in lines if ln.strip(" \t\r")]
