"""probes.run's command line: the flags, their bounds and defaults, and the per-task default modes and N
(what `python -m probes.run --help` shows; the run itself is probes/run.py)."""
from __future__ import annotations

from pathlib import Path

from common.cli import (Parser, add_device_flags, add_model_flag, add_output_flags, add_progress_flag,
                        add_seed_flag, add_task_flags, add_tokenizer_flag, int_in, int_list)
from common.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "tiny-fbt"
DEFAULT_MODES = {
    "completion": ("standard", "recurrent-1"),
    "memory": ("standard", "recurrent-1"),
    "multi_register": ("standard", "recurrent-1", "recurrent-2", "recurrent-4", "recurrent-full"),
    "parity": ("standard", "recurrent-1", "recurrent-full"),
    "shell_game": ("standard", "recurrent-1", "recurrent-full"),
    "s5": ("standard", "recurrent-1", "recurrent-full"),
    "a5": ("standard", "recurrent-1", "recurrent-full"),
}
CUSTOM_MODES = ("standard", "recurrent-1", "recurrent-full")  # default modes of a custom task
# Paper-like lengths that keep the default command within a few minutes on 2 CPU cores. memory N=0 has a
# single CV group (every scratch context is empty), so it cannot be probed with grouped CV.
DEFAULT_DISTRACTORS = {"completion": (0, 32, 128), "memory": (8, 32, 128), "multi_register": (0,),
                       "parity": (8, 32, 64), "shell_game": (8, 32, 64), "s5": (8, 32, 64),
                       "a5": (8, 32, 64)}
DEFAULT_N_PAIRS = 96
MAX_DISTRACTORS = 256
MIN_PAIRS, MAX_PAIRS = 5, 5000
MAX_BATCH = 4096
MIN_BOOT = 20  # fewer resamples give no 95% interval: its ends are the extreme draws, or one draw
MAX_BOOT = 100_000
MAX_ERASE_DEPTH = 10_000  # checked against the model's depth once it is loaded
OUTPUTS = ("probes.json", "depth_curves.html", "activations")  # every file a probes run owns in --out
SCHEMA = "fbprobe.probes/2"  # 2: logit lens, MDL, fed_state_lens, erased (docs/methods.md)


def parse_args(argv):
    import importlib

    from tasks import ALL_TASKS

    p = Parser(prog="python -m probes.run", description=importlib.import_module("probes.run").__doc__)
    add_task_flags(p, ALL_TASKS, required=True)
    add_model_flag(p, DEFAULT_MODEL)
    add_tokenizer_flag(p)
    p.add_argument("--modes", "--mode", dest="modes",
                   help="comma-separated prefill modes (standard, recurrent-K, recurrent-full, fused-N, loop-R); "
                        "default: the paper's for the task (a looped checkpoint: standard, its trained iterations)")
    p.add_argument("--recirculate", action="append", default=[], metavar="S:D:ALPHA[:convex|residual][:rampN]",
                   help="also probe the model under training-free recirculation (engine.recirculation, exact "
                        "sequential prefill): depth S mixed into depth D with weight ALPHA (rampN: alpha grows over the first N positions); repeatable. Adds a mode "
                        "named recirc-S:D:ALPHA:MODE[:rampN] beside --modes")
    p.add_argument("--distractors",
                   help=f"comma-separated distractor counts N (0..{MAX_DISTRACTORS}; >= 1 for parity and "
                        "shell_game); default per task (a JSONL file: the N values it holds)")
    p.add_argument("--n-pairs", type=int_in(MIN_PAIRS, MAX_PAIRS), default=None,
                   help=f"pairs per N, {MIN_PAIRS}..{MAX_PAIRS} (default {DEFAULT_N_PAIRS}; a JSONL file: all its "
                        "pairs, or its first --n-pairs pairs per N)")
    add_seed_flag(p, "the datasets and the probes")
    add_output_flags(p, "./figures/<model>/<task>/ of the current directory",
                     overwrite_extra="; the run's own are probes.json, depth_curves.html and activations/, never "
                                     "another tool's files")
    p.add_argument("--save-activations", action="store_true", help="export activations to <out>/activations/")
    p.add_argument("--cache-dir", default=None,
                   help="activation cache dir (default $FBPROBE_CACHE/activations, else ./.cache/activations of the "
                        "current directory)")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the activation cache (not with --cache-dir)")
    p.add_argument("--batch-size", type=int_in(1, MAX_BATCH), default=32,
                   help=f"rows per nnsight trace, 1..{MAX_BATCH} (default 32)")
    p.add_argument("--n-boot", type=int_in(MIN_BOOT, MAX_BOOT), default=1000,
                   help=f"bootstrap resamples for the 95%% CI, {MIN_BOOT}..{MAX_BOOT} (default 1000)")
    p.add_argument("--erase", type=int_in(0, MAX_ERASE_DEPTH), default=None, metavar="DEPTH",
                   help="also probe every depth >= DEPTH after erasing the label (LEACE, fitted on each fold's "
                        "training groups) from the residual stream at (DEPTH, T) and running the model on from "
                        "there: does the label come back at later depths? Rows in probes.json 'erased' (every "
                        "mode but recirc-*; 0 <= DEPTH <= L)")
    p.add_argument("--no-mdl", action="store_true",
                   help="skip the online-code description length per depth (mdl_* fields null; saves its probe "
                        "fits)")
    p.add_argument("--fed-lens", action="store_true",
                   help="also the logit lens of the state h_{T-1} fed into T under each feedback mode "
                        "(fed_state_lens rows; off by default: it runs the model once more per feedback mode, "
                        "about the cost of collecting that mode again; refused when no mode feeds a state)")
    add_progress_flag(p)
    add_device_flags(p)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------------------
def _parse_modes(s) -> list[str] | None:
    """--modes -> canonical, de-duplicated mode names in the order given (None: the task's default)."""
    from engine.modes import canonical_modes

    if s is None:
        return None
    items = [x.strip() for x in s.split(",") if x.strip()]
    if not items:
        raise UserError("--modes is empty")
    modes = canonical_modes(items)  # UserError on an unknown mode or an out-of-range fused-n / recurrent-k
    from engine.modes import parse_mode

    adaptive = [m for m in modes if parse_mode(m).adaptive_exit is not None]
    if adaptive:  # before any loading (the collector refuses it too, at its first batch)
        raise UserError(f"--modes {adaptive[0]}: it runs every prompt to its own exit (a different stack per "
                        "prompt), an evaluation mode; probe a fixed loop-R instead")
    return modes


def _default_modes(task, fusion=True) -> list[str]:
    # Without a fusion module only standard prefill exists (recurrent modes need a trained fusion).
    return list(DEFAULT_MODES.get(task, CUSTOM_MODES)) if fusion else ["standard"]


def _parse_distractors(s, task):
    """--distractors -> sorted N values; ``task`` is a task name or a tasks.custom.TaskSource."""
    from tasks.custom import TaskSource

    source = task if isinstance(task, TaskSource) else None
    name = source.name if source is not None else task
    if s is None:
        base = source.task if source is not None and source.builtin else name  # parity@hold: parity's N values
        if base in DEFAULT_DISTRACTORS:
            return list(DEFAULT_DISTRACTORS[base])
        if source is not None and source.default_distractors:  # a JSONL file's N values, f.distractors
            return list(source.default_distractors)
        raise UserError(f"task {source.spec if source else name} has no default distractor counts: "
                        "give --distractors")
    out = int_list(s, "--distractors", 0, MAX_DISTRACTORS)
    if name == "memory" and 0 in out:
        raise UserError("memory with N=0 has a single CV group (every scratch context is empty), so grouped "
                        "cross-validation cannot run; use N >= 8")
    if source is not None and source.min_distractors and min(out) < source.min_distractors:
        raise UserError(f"task {name} needs N >= {source.min_distractors} update line(s) (a pair differs in one "
                        f"of them); --distractors has {min(out)}")
    return sorted(out)
