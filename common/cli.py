"""The CLI toolkit every command shares: one-line-error parser, shared flag groups, bounded numeric arguments,
output paths.

Every entry point (the packages' `python -m ...` commands, benchmarks/ and scripts/) builds its parser on `Parser`
and declares the flags it shares with others through the groups below, declared once here, so that every
`--help` lists them in the same words and with the same bounds:

    add_model_flag      --model (or a positional MODEL)       add_tokenizer_flag  --tokenizer
    add_task_flags      --task / --tasks (or a positional)    add_seed_flag       --seed, 0..MAX_SEED
    add_output_flags    --out, --overwrite                    add_device_flags    --device, --dtype, --device-map
    add_threads_flag    --threads, 0..MAX_THREADS             add_progress_flag   --no-progress
    add_plotly_flag     --plotly

A malformed invocation must end in exactly one stderr line and exit code 2 *before any heavy work and before
any file is touched*: parse with `Parser` inside a `common.errors.cli_entry` main, give every size flag a range
with `int_in` / `float_in`, and check output locations with `output_dir` / `output_file` before loading a model.
No module outside this one builds an `argparse.ArgumentParser` itself or reads `sys.argv` (tests/test_cli_toolkit.py).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path

from common.errors import UserError
from common.placement import DEVICE_MAPS, DEVICES, DTYPES
from common.plotlyjs import PLOTLY_CHOICES


class Parser(argparse.ArgumentParser):
    """argparse without the usage block: an error is one line (via `common.errors.cli_entry`), exit 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UserError(message)


class DefaultsFormatter(argparse.RawDescriptionHelpFormatter):
    """`--help` with every flag's default appended, as ``(default: X)`` (argparse.ArgumentDefaultsHelpFormatter),
    except the shared flags, whose help states its default in the shared words, and flags without a value."""

    def _get_help_string(self, action):
        text = action.help or ""
        if getattr(action, "shared", None) or "%(default)" in text or not action.option_strings or \
                any(action.default is x for x in (None, False, argparse.SUPPRESS)):
            return text
        return text + " (default: %(default)s)"


def given_flags(parser: argparse.ArgumentParser, argv=None) -> set[str]:
    """The dests of the options the command line names, whatever their values (a default's own value included):
    the line parsed once more with every default replaced by a marker (abbreviations and --x=v forms as argparse
    reads them)."""
    unset = object()
    saved = [(a, a.default) for a in parser._actions]
    try:
        for a, _ in saved:
            a.default = unset
        parsed = vars(parser.parse_args(argv))
    finally:
        for a, d in saved:
            a.default = d
    return {k for k, v in parsed.items() if v is not unset}


def refuse_idle_flags(given: set[str], rules, spelled: dict | None = None) -> None:
    """One-line refusal of a flag given where its option does nothing. `rules`: (dests, idle, why) with `idle` a
    bool; the first rule a given flag breaks is named, with every given flag of that rule (`spelled`: how to name a
    dest whose flag has several spellings)."""
    spelled = spelled or {}
    for names, idle, why in rules:
        bad = [spelled.get(n, "--" + n.replace("_", "-")) for n in names if n in given]
        if bad and idle:
            raise UserError(f"{', '.join(bad)} would have no effect: {why}; drop {'it' if len(bad) == 1 else 'them'}")


def say(*texts: str) -> None:
    """Print to stdout; a reader that stopped reading (`| head`) ends the output quietly, not in a traceback."""
    try:
        for t in texts:
            print(t)
        sys.stdout.flush()
    except BrokenPipeError:
        try:  # the interpreter's own flush at exit would fail again: point stdout at /dev/null
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass


def command_text(prog: str, argv=None) -> str:
    """The command as it was run, for a results file: `prog` and its arguments (the process's own when `argv` is
    None)."""
    return prog + " " + " ".join(sys.argv[1:] if argv is None else argv)


def _range_text(lo, hi) -> str:
    if hi is None:
        return f">= {lo}"
    return f"in {lo}..{hi}"


_ASCII_INT = re.compile(r"[+-]?[0-9]+")


def ascii_int(s) -> int:
    """A base-10 integer written in ASCII digits (Python's int() takes '1_000' and full-width digits too); ValueError
    otherwise."""
    s = str(s).strip()
    if not _ASCII_INT.fullmatch(s):
        raise ValueError(s)
    return int(s, 10)


def int_in(lo: int, hi: int | None = None):
    """argparse `type=`: a base-10 integer in [lo, hi] (hi None = unbounded above)."""

    def parse(s: str) -> int:
        try:
            v = ascii_int(s)
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
            v = ascii_int(x)
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
            v = -1 if x == "T" else (-1 - ascii_int(x[2:]) if x.startswith("T-") else ascii_int(x))
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
    if path.exists() and not path.is_file():  # an atomic write would replace a device or FIFO with a file
        raise UserError(f"{flag} {path} exists and is not a regular file (a device, FIFO or socket)")
    if path.exists() and not os.access(path, os.W_OK):
        raise UserError(f"{flag} {path} is not writable")
    if not path.exists():
        _check_creatable(path, flag)
    return path


def page_outputs(out: str | Path, png: str | None, overwrite: bool) -> tuple[Path, Path | None]:
    """A figure CLI's page (`--out`) and optional PNG (`--png`), checked as output_file, each refused when it exists
    without `overwrite`."""
    paths = (output_file(out), output_file(png, "--png") if png is not None else None)  # '': refused
    for f in paths:
        if f is not None and f.exists() and not overwrite:
            raise UserError(f"{f} exists; pass --overwrite to replace it")
    return paths


def safe_name(name_or_path: str | Path) -> str:
    """A name for a model given by preset or path, safe as one folder name (no '', '.', '..', no separator)."""
    s = str(name_or_path).strip()
    p = Path(s)
    name = p.name if p.name not in ("", ".", "..") else Path(os.path.abspath(s)).name
    if name in ("", ".", "..") or os.sep in name:
        raise UserError(f"cannot derive a model name from {str(name_or_path)!r}: give --out explicitly")
    return name


# ----- shared flag groups -----------------------------------------------------------------------------------------
# One bound for every --seed. The seeds reach random.Random, numpy's default_rng, torch generators (any size) and
# scikit-learn's random_state (a numpy RandomState: 0..2**32-1), so --seed takes numpy's whole range; a second
# stream derived from it (seed + 1000 for the random subspace of interventions.suite, seed + 1..3 in
# analysis.recirculation) goes through `derived_seed`, which wraps into the same range.
MAX_SEED = 2**32 - 1
MAX_THREADS = 1024

# The shared flags' help, word for word the same in every --help (a command adds its own default and, where it
# needs one, a clause after these words). tests/test_cli_toolkit.py checks every entry point against them.
SHARED_HELP = {
    "--model": "the model: a preset name (tiny-fbt, smollm2-135m, ...), a full-bandwidth checkpoint directory or "
               "any HF causal LM directory (save_pretrained)",
    "--tokenizer": "tokenize the prompts with this tokenizer: a folder holding tokenizer.json (or "
                   "tokenizer_config.json with its vocabulary files) or a preset name (tiny-fbt, smollm2-135m, "
                   "...); default each model's own, and a model folder without one is refused",
    "--task": "the task: a built-in task",
    "--tasks": "comma-separated tasks, each a built-in task",
    "--seed": f"random seed, 0..{MAX_SEED}, of",
    "--out": "output",
    "--overwrite": "replace an earlier run's results (never done without it)",
    "--device": "where the model runs: cpu, cuda, or auto (cuda when available)",
    "--dtype": "weights and activations: float32, bfloat16, or float16 (cuda only)",
    "--device-map": "'auto': let accelerate spread a plain HF model over the available devices (for models that "
                    "do not fit one); none keeps it on --device",
    "--threads": f"torch CPU threads, 0..{MAX_THREADS} (0 = torch's own default)",
    "--no-progress": "no progress bars or stage lines on stderr",
    "--plotly": "plotly.js for the pages: directory (one plotly.min.js written beside them; offline), inline "
                "(embedded in each page, 4.8 MB) or cdn (loaded from cdn.plot.ly, needs a network)",
}


def derived_seed(seed: int, offset: int) -> int:
    """The seed of a second random stream drawn from --seed: (seed + offset) mod 2**32, inside 0..MAX_SEED for
    every seed --seed accepts (and equal to seed + offset wherever that already fits)."""
    return (int(seed) + int(offset)) % (MAX_SEED + 1)


def _shared(action, flag: str):
    action.shared = flag  # DefaultsFormatter leaves it alone; the toolkit's tests find the shared flags by it
    return action


def _with_default(stem: str, extra: str | None, default_text: str | None) -> str:
    text = stem + (extra or "")
    return text if default_text is None else f"{text} (default {default_text})"


def add_model_flag(p, default: str | None = "tiny-fbt", help_extra: str | None = None, *,
                   default_text: str | None = None, positional: bool = False, required: bool = False):
    """--model NAME_OR_DIR (or a positional MODEL): `help_extra` is a clause after the shared words (', with a
    fusion module'); `default_text` describes a default that is not a plain name (default None: 'default X')."""
    text = _with_default(SHARED_HELP["--model"], help_extra,
                         None if positional or required else (default_text or str(default)))
    if positional:
        return _shared(p.add_argument("model", metavar="MODEL", type=_model_name, help=text), "--model")
    return _shared(p.add_argument("--model", default=None if required else default, required=required,
                                  metavar="NAME_OR_DIR", type=_model_name, help=text), "--model")


def _model_name(s: str) -> str:
    """A model's name or folder as typed; an empty one named as such (not as the folder '.' it would resolve to)."""
    if not str(s).strip():
        raise argparse.ArgumentTypeError("is empty: give a shipped preset's name or a model directory")
    return s


def add_tokenizer_flag(p):
    """--tokenizer DIR_OR_PRESET (default None: each model's own tokenizer)."""
    return _shared(p.add_argument("--tokenizer", default=None, metavar="DIR_OR_PRESET",
                                  help=SHARED_HELP["--tokenizer"]), "--tokenizer")


def add_task_flags(p, names, default: str | None = "completion", help_extra: str | None = None, *,
                   several: bool = False, custom: bool = True, required: bool = False, positional: bool = False,
                   default_text: str | None = None):
    """--task TASK (`several`: --tasks TASKS, comma-separated; `positional`: a positional TASK). `names`: the
    built-in tasks (tasks.ALL_TASKS; common sits below tasks, so the caller names them). `custom`: it also takes a
    samples file or a generator (tasks.custom), not only a built-in task."""
    flag = "--tasks" if several else "--task"
    text = f"{SHARED_HELP[flag]} ({', '.join(names)})"
    if custom:
        text += ", a samples file path/to/x.jsonl or a generator package.module:function (docs/tasks.md)"
    shown = None if positional or required else (default_text or str(default))
    text = _with_default(text, help_extra, shown)
    if positional:
        return _shared(p.add_argument("task", metavar="TASK", help=text), flag)
    return _shared(p.add_argument(flag, default=None if required else default, required=required,
                                  help=text), flag)


def add_seed_flag(p, what: str, default: int | None = 0, *, default_text: str | None = None):
    """--seed SEED in 0..MAX_SEED, the one bound of every command. `what`: what it seeds ('the datasets and the
    probes'). default None (training: the preset's) needs `default_text`."""
    text = _with_default(f"{SHARED_HELP['--seed']} {what}", None,
                         default_text or (None if default is None else str(default)))
    return _shared(p.add_argument("--seed", type=int_in(0, MAX_SEED), default=default, help=text), "--seed")


def add_output_flags(p, default_text: str | None, *, kind: str = "directory", out_extra: str | None = None,
                     overwrite_extra: str | None = None, overwrite: bool = True):
    """--out (an output `kind`: 'directory' or 'file'; default None, the command picks `default_text`) and
    --overwrite (`overwrite=False`: --out alone). Check the value with `output_dir` / `output_file`."""
    if kind not in ("directory", "file"):
        raise ValueError(f"kind must be directory or file, got {kind!r}")
    out = _shared(p.add_argument("--out", default=None,
                                 help=_with_default(f"{SHARED_HELP['--out']} {kind}", out_extra, default_text)),
                  "--out")
    if overwrite:
        add_overwrite_flag(p, overwrite_extra)
    return out


def add_overwrite_flag(p, help_extra: str | None = None):
    """--overwrite, in the shared words (add_output_flags declares it beside --out)."""
    return _shared(p.add_argument("--overwrite", action="store_true",
                                  help=SHARED_HELP["--overwrite"] + (help_extra or "")), "--overwrite")


def add_device_flags(p, *, device: bool = True, dtype: bool = True, device_map: bool = True,
                     device_extra: str | None = None, dtype_extra: str | None = None):
    """--device (cpu, cuda, auto; default cpu), --dtype (float32, bfloat16, float16; default float32) and
    --device-map (none, auto; default none): read them with `common.placement.Placement.from_args` (a command
    without one of them gets its default there)."""
    if device:
        _shared(p.add_argument("--device", choices=DEVICES, default="cpu",
                               help=_with_default(SHARED_HELP["--device"], device_extra, "cpu")), "--device")
    if dtype:
        _shared(p.add_argument("--dtype", choices=DTYPES, default="float32",
                               help=_with_default(SHARED_HELP["--dtype"], dtype_extra, "float32")), "--dtype")
    if device_map:
        _shared(p.add_argument("--device-map", choices=DEVICE_MAPS, default="none",
                               help=_with_default(SHARED_HELP["--device-map"], None, "none")), "--device-map")


def add_threads_flag(p, default: int = 0, help_extra: str | None = None, *, default_text: str | None = None):
    """--threads N in 0..MAX_THREADS, 0 = torch's own default; apply it with `set_threads`."""
    text = _with_default(SHARED_HELP["--threads"], help_extra, default_text or str(default))
    return _shared(p.add_argument("--threads", type=int_in(0, MAX_THREADS), default=default, help=text),
                   "--threads")


def set_threads(n: int) -> int:
    """Apply --threads (0: leave torch's default) and return the number of threads torch now uses."""
    import torch

    if n:
        torch.set_num_threads(int(n))
    return torch.get_num_threads()


class _NoProgress(argparse._StoreTrueAction):
    """--no-progress, for Hugging Face's bars too (transformers 5 draws one while it loads weights): its switch is
    set when the flag is parsed, before any model loads."""

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read where huggingface_hub is first imported
        if "transformers" in sys.modules:  # imported already: its own switch
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()


def add_progress_flag(p, help_extra: str | None = None):
    """--no-progress (args.no_progress)."""
    return _shared(p.add_argument("--no-progress", action=_NoProgress,
                                  help=SHARED_HELP["--no-progress"] + (help_extra or "")), "--no-progress")


def add_plotly_flag(p):
    """--plotly directory | inline | cdn (default directory; common.plotlyjs)."""
    return _shared(p.add_argument("--plotly", choices=PLOTLY_CHOICES, default="directory",
                                  help=_with_default(SHARED_HELP["--plotly"], None, "directory")), "--plotly")
