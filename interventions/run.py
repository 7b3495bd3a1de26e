"""python -m interventions.run --task completion [--model tiny-fbt] [--mode recurrent-1] [--budget quick|full]

Runs the causal battery of docs/design.md (Interventions) in any prefill mode (standard, recurrent-K,
recurrent-full, fused-N; parsed once by engine.modes.parse_mode, reported under its canonical name), on a
feedback model or on any HF causal LM (standard mode: what needs no fed state). With a fed state: the
interventions on the state entering the fusion at T, the subspace swaps, the dose, the state-swap sweep over
the fused positions (and each row's first position after its differing line), LEACE erasure of the label
(--erase-depths, --erase-positions; docs/methods.md). In every mode: mean ablation of the residual at T by depth
and the depth x position layer patching (the mode under study and standard side by side); under standard the
sweep swaps the residual stream at --sweep-depth instead, and the fed-state analyses read "not applicable (no
feedback)". --budget quick (the default) bounds positions, depths, LEACE rows and resamples for a first look;
--budget full runs everything at full size; explicit flags override either. Progress: a bar over every patched
run on a terminal (count, rate, ETA), one line per stage otherwise.
It writes ./figures/<model>/<task>/causal_report.{json,md,html} (beside probes.run's probes.json) or --out. The
output directory is locked for the run; the files replace an earlier run's only once all are complete; no other
file in the folder is touched.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

from common.cli import (Parser, ascii_int, add_device_flags, add_model_flag, add_output_flags, add_plotly_flag,
                        add_progress_flag, add_seed_flag, add_task_flags, add_tokenizer_flag, command_text, float_in,
                        int_in, output_dir, safe_name)
from common.errors import UserError, cli_entry
from common.paths import default_output

N_PAIRS_RANGE = (10, 5000)
MAX_DISTRACTORS = 1024
MAX_RANK = 64
MIN_BOOT = 20  # fewer resamples give no 95% interval: its ends are the extreme draws, or one draw
MAX_BOOT = 100_000
MAX_POSITIONS = 100_000
MAX_ERASE_DEPTH = 10_000  # checked against the model's depth once it is loaded
DEFAULT_DISTRACTORS = 8
# What a budget sets where its flag is not given. quick: a first look (the sweep over the last 8 positions,
# at most 4 heatmap depths, LEACE on the fed state only, 500 resamples: CIs printed to the percent); full: the
# whole battery as the documented results were run.
BUDGETS = {
    "quick": {"n_pairs": 100, "max_positions": 8, "max_depths": 4, "erase_depths": "none", "leace_all": False,
              "n_boot": 500},
    "full": {"n_pairs": 200, "max_positions": 64, "max_depths": 0, "erase_depths": "all", "leace_all": True,
             "n_boot": 1000},
}


def _budget_text(name: str) -> str:
    b = BUDGETS[name]
    return (f"{b['n_pairs']} pairs, --max-positions {b['max_positions']}, --max-depths {b['max_depths']}, "
            f"--erase-depths {b['erase_depths']}, {'--leace-all' if b['leace_all'] else '--no-leace-all'}, "
            f"--n-boot {b['n_boot']}")


def build_parser() -> argparse.ArgumentParser:
    from tasks import ALL_TASKS as TASKS

    p = Parser(prog="python -m interventions.run",
               description="The causal battery: interventions on the fed-back state at the probed position T "
                           "(gate bypass, state swap, resample/mean/zero/random state, probe-subspace swaps, dose, "
                           "LEACE, the swap at every fed position), and on the residual stream of any model (mean "
                           "ablation by depth, depth x position layer patching; under --mode standard the position "
                           "sweep too), with bootstrap CIs and a negative-control model. Works on any HF causal LM "
                           "in standard mode (the fed-state analyses then read 'not applicable (no feedback)'). "
                           "Writes causal_report.{json,md,html}.")
    add_task_flags(p, TASKS, "completion")
    add_model_flag(p, "tiny-fbt", " with its tokenizer")
    p.add_argument("--mode", default=None,
                   help="prefill mode intervened on: standard, recurrent-K, recurrent-full, fused-N, loop-R (default "
                        "recurrent-1; on a looped checkpoint standard, its trained iterations; fused-N patches its "
                        "last pass) or recirc-S:D:ALPHA[:convex|residual][:rampN] "
                        "(training-free recirculation; its fed state is z_{t-1,s}, the source-depth state "
                        "recirculated from the position before). A model without a fusion module (any HF causal "
                        "LM) takes standard or recirc-*. Layer patching also runs standard.")
    p.add_argument("--budget", choices=tuple(BUDGETS), default="quick",
                   help="how much of the battery runs: quick (default: the analyses a first look needs, "
                        f"{_budget_text('quick')}) or full (every analysis at full size: {_budget_text('full')}); "
                        "an explicit flag below overrides its budget value")
    p.add_argument("--max-positions", type=int_in(0, MAX_POSITIONS), default=None,
                   help="position sweep and layer-patching heatmap over the last P positions (0 = all; default "
                        "from --budget)")
    p.add_argument("--max-depths", type=int_in(0, MAX_ERASE_DEPTH), default=None,
                   help="layer-patching heatmap at most this many depths, evenly spaced, 0 and L kept (0 = all, "
                        "else 2 and up; default from --budget)")
    p.add_argument("--sweep-depth", type=int_in(0, MAX_ERASE_DEPTH), default=None,
                   help="standard prefill (no fed state): the residual depth the position sweep swaps at "
                        "(default the middle of the stack, L // 2)")
    p.add_argument("--distractors", type=int_in(0, MAX_DISTRACTORS), default=None,
                   help=f"number N of distractor lines per prompt, 0..{MAX_DISTRACTORS} (default: a task file's "
                        "or generator's own N, a language task's first (tasks.language), else 8)")
    p.add_argument("--n-pairs", type=int_in(*N_PAIRS_RANGE), default=None,
                   help=f"number of sample pairs (2 samples each), {N_PAIRS_RANGE[0]}..{N_PAIRS_RANGE[1]}; for a "
                        "task file the first this many pairs of its N (default: every pair of a file, else from "
                        "--budget)")
    p.add_argument("--n-boot", type=int_in(MIN_BOOT, MAX_BOOT), default=None,
                   help=f"cluster-bootstrap resamples (over groups) for every 95%% CI, {MIN_BOOT}..{MAX_BOOT} (default from "
                        "--budget)")
    add_seed_flag(p, "the dataset, the resampled states and the bootstrap")
    p.add_argument("--subspace-rank", type=int_in(1, MAX_RANK), default=None,
                   help=f"rank of the probe subspace, 1..min({MAX_RANK}, d_model) (default K - 1 for a K-class "
                        "label, the span of a K-class linear read-out: 1 for binary tasks, 2 for the shell game; "
                        f"at most {MAX_RANK} and d_model)")
    p.add_argument("--erase-depths", default=None,
                   help="LEACE rows: erase the label from the residual stream at T at these depths, one row each "
                        "(comma-separated 0..L; 'all' = every depth; 'none' = no residual rows; default from "
                        "--budget). "
                        "The fed state at T, with a dose, is always erased (recurrent and fused modes); at every fused "
                        "position at once with --leace-all")
    p.add_argument("--leace-all", action=argparse.BooleanOptionalAction, default=None,
                   help="LEACE row leace_state_all: erase the label from the fed state at every fused position at "
                        "once (one eraser fitted per position: the battery's costliest row; default from --budget)")
    p.add_argument("--erase-positions", default=None,
                   help="LEACE rows: also erase the label from the fed state at each of these positions alone "
                        "(comma-separated T, T-1, T-2, ..., or negative offsets -1 = T, -2 = T-1 written "
                        "--erase-positions=-2,-5; must be fused positions of --mode; default none beyond T)")
    p.add_argument("--das", default=None, metavar="RANKS",
                   help="distributed alignment search at --das-site: comma-separated subspace ranks k (e.g. 1,2,4,8,128; "
                        "'D' = the site's width). Per grouped fold and k an orthogonal rank-k subspace is trained on "
                        "the training groups so that interchanging it with the paired sample's makes the answer follow "
                        "the paired sample's label; its interchange-intervention accuracy (IIA) is scored on the "
                        "held-out groups, beside the probe's and LEACE's subspaces and a random one (default: off)")
    p.add_argument("--das-site", default=None, metavar="SITE",
                   help="where DAS searches: 'state' (the fed state entering the fusion at T; the default in feedback "
                        "modes), 'state@T-3' (at another fused position), 'resid:D' (the residual stream at depth D, "
                        "position T; the default under standard is resid:L//2) or 'resid:D@T-3'")
    p.add_argument("--das-steps", type=int_in(1, 100_000), default=None,
                   help="full-batch Adam steps per fitted rotation (default 100; with --das only)")
    p.add_argument("--das-lr", type=float_in(0, 10, lo_open=True), default=None,
                   help="Adam learning rate of the rotation, in (0, 10] (default 0.01; with --das only)")
    p.add_argument("--attribution", action="store_true",
                   help="attribution patching: the first-order estimate (donor - own) . dLD/d(site) of every patch "
                        "of the fed state (recurrent modes), of the residual stream at every (depth, position) and of "
                        "every block's attention and MLP outputs, "
                        "from one forward and one backward, as a heatmap with CIs, checked against the exact position "
                        "sweep and layer patching of the same run (standard, loop-R and recurrent-K modes)")
    p.add_argument("--attribution-ig", type=int_in(0, 256), default=0, metavar="M",
                   help="with --attribution: integrated gradients (EAP-IG) over M points of the path from each row's "
                        "token embeddings to its paired sample's, M forwards and backwards (pairs of equal length; "
                        "default 0 = the plain gradient at the clean run)")
    p.add_argument("--control-model", default=None,
                   help="control model for the same swap, another model than the one under study (default: "
                        "tiny-std when its checkpoint exists and shares the model's tokenizer, except under "
                        "recirculation, which trains nothing; 'none' to skip). The report calls it a negative "
                        "control only where its training log shows a fusion that was never trained")
    add_tokenizer_flag(p)
    add_device_flags(p)
    add_output_flags(p, "./figures/<model>/<task>/ of the current directory, beside probes.run's probes.json",
                     overwrite_extra="; the run's own are causal_report.*")
    add_plotly_flag(p)
    add_progress_flag(p, " (by default a bar over every patched run on a terminal, one line per stage otherwise)")
    return p


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _model_path(name_or_path: str) -> Path:
    from models.checkpoints import PRESET_NAMES, checkpoint_dir

    p = Path(name_or_path)
    return checkpoint_dir(name_or_path) if not p.exists() and name_or_path in PRESET_NAMES else p


def _load(name_or_path: str, placement=None, tokenizer=None):
    from models.tokenizers import resolve_tokenizer
    from models.loading import load_model

    model, tok, name = load_model(name_or_path, placement)  # refuses NaN/inf weights (load_weights)
    tok = resolve_tokenizer(model, tok, name_or_path, tokenizer)  # its own or --tokenizer's; none: one line
    return model.eval(), tok, name


def _resolve_control(arg, main_path: Path):
    if arg is not None and not arg.strip():  # not the current directory
        raise UserError("--control-model is empty: give a model, or 'none' to skip the control")
    if arg is not None and arg.lower() == "none":
        return None, "disabled with --control-model none"
    if arg is None:
        p = _model_path("tiny-std")
        if not p.exists():
            return None, f"no tiny-std checkpoint at {p}"
        if p.resolve() == main_path.resolve():
            return None, "the control is the model under study"
        return "tiny-std", None
    return arg, None


def _control_role(parsed, path: Path) -> dict:
    """What the control model is, as its training log says (models.checkpoints.fusion_trained): a negative
    control only where its fusion was never trained and the mode runs that fusion."""
    from models.checkpoints import fusion_trained

    if parsed.is_recirculation:
        return {"role": "control", "about": "the same training-free recirculation on another model"}
    trained = fusion_trained(path)
    if trained is False:
        return {"role": "negative control", "about": "fusion never trained: every training step ran its standard pass"}
    return {"role": "control", "about": {True: "its fusion was trained too", None: None}[trained]}


def _parse_erase_depths(spec):
    """'all' -> None (every depth), 'none' -> [], else the listed depths (checked against L after loading)."""
    from common.cli import int_list

    s = str(spec).strip().lower()
    if s == "all":
        return None
    if s == "none":
        return []
    return int_list(spec, "--erase-depths", 0, MAX_ERASE_DEPTH)


def _parse_erase_positions(spec):
    """--erase-positions 'T-1,T-4' or '-2,-5' -> [-2, -5]; None -> []."""
    from common.cli import position_list

    return [] if spec is None else position_list(spec, "--erase-positions", MAX_POSITIONS)


def _parse_das(spec, width: int) -> tuple[int, ...] | None:
    """--das '1,2,4,D' -> (1, 2, 4, width); None -> None."""
    if spec is None:
        return None
    out = []
    for part in str(spec).split(","):
        part = part.strip()
        if part.upper() == "D":
            out.append(width)
            continue
        try:
            k = ascii_int(part)
        except ValueError:
            raise UserError(f"--das: {part!r} is not a rank (positive integers or D, comma-separated)") from None
        if not 1 <= k <= width:
            raise UserError(f"--das rank {k} must be in 1..{width} (the site's width, d_model)")
        out.append(k)
    if not out:
        raise UserError("--das needs at least one rank")
    return tuple(sorted(set(out)))


def _parse_das_site(spec, mode, n_layers: int) -> tuple[str, int, int]:
    """--das-site 'state', 'state@T-3', 'resid:4', 'resid:4@T-2' -> (site, depth, position offset); `mode` (a
    parsed Mode) and `n_layers`, the depth of its stack, give the default."""
    from common.cli import position_list

    if spec is None:
        return ("state", 0, -1) if mode.feeds_state else ("resid", n_layers // 2, -1)
    where, sep, at = str(spec).partition("@")
    positions = position_list(at, "--das-site position", MAX_POSITIONS) if sep else [-1]  # 'state@': refused
    if len(positions) > 1:
        raise UserError(f"--das-site {spec!r}: DAS searches one site, at one position (got {len(positions)})")
    pos = positions[0]
    kind, _, depth = where.partition(":")
    if kind == "state" and not depth:
        if not mode.feeds_state:
            raise UserError(f"--das-site state: {mode.name} feeds no state (use resid:D)")
        return "state", 0, pos
    if kind == "resid" and depth:
        try:
            d = ascii_int(depth)
        except ValueError:
            raise UserError(f"--das-site {spec!r}: the depth must be an integer") from None
        if not 0 <= d <= MAX_ERASE_DEPTH:  # checked against the mode's own stack once it is built
            raise UserError(f"--das-site depth {d} must be in 0..{MAX_ERASE_DEPTH}")
        return "resid", d, pos
    raise UserError(f"--das-site {spec!r}: use state, state@T-k, resid:D or resid:D@T-k")


def _check_erase_positions(positions, mode: str, T: int) -> None:
    """UserError unless every position is one where `mode` feeds a state (core's fused positions) on T columns."""
    from engine.modes import parse_mode

    from .batch import pos_name

    if not positions:
        return
    fed = parse_mode(mode).fed_positions(T)
    if not fed:
        raise UserError(f"--erase-positions: {mode} prefill feeds no state")
    bad = [p for p in positions if p < fed[0]]
    if bad:
        raise UserError(f"--erase-positions {pos_name(bad[0])}: {mode} feeds a state only at {pos_name(fed[0])}..T "
                        f"(offsets {fed[0]}..-1) of these {T}-column prompts")


@cli_entry
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from common.distributed import env_place

    if env_place()[0] > 1:  # each process would run the whole battery and race for --out
        raise UserError("interventions.run runs in one process: start it with python, not torchrun")
    from common.placement import Placement
    from engine.modes import parse_mode
    from models.fingerprint import config_hash, weights_hash
    from stats.linear import ProbeConfig
    from tasks import copies_across_groups, dataset_fingerprint, probe_labels, prompt_prefix_tokens, resolve_task
    from tasks.samples import ANSWER_PROBE_LABEL

    from .progress import Progress

    t0 = time.perf_counter()
    budget = BUDGETS[args.budget]
    pick = lambda flag, key: budget[key] if flag is None else flag  # an explicit flag beats its budget value
    placement = Placement.from_args(args)
    source = resolve_task(args.task)  # a built-in name, a JSONL file or module:function; one-line errors
    mode = parse_mode("recurrent-1" if args.mode is None else args.mode).name  # checked now; a looped checkpoint's default after loading
    max_positions = pick(args.max_positions, "max_positions") or None
    max_depths = pick(args.max_depths, "max_depths") or None
    if max_depths == 1:  # evenly spaced with 0 and L kept needs two
        raise UserError("--max-depths 1 cannot keep both depth 0 and L: give 0 (every depth) or 2 and up")
    n_boot, seed, rank = pick(args.n_boot, "n_boot"), args.seed, args.subspace_rank
    # A task file is a fixed set: by default every pair of its N, else its first --n-pairs pairs (as probes.run).
    n_pairs = args.n_pairs if args.n_pairs is not None or source.fixed else budget["n_pairs"]
    n_dis = args.distractors
    out_arg = output_dir(args.out, "--out") if args.out is not None else None  # "" refused, never the default
    progress = Progress(enabled=not args.no_progress)
    say = progress.say

    erase_depths = _parse_erase_depths(pick(args.erase_depths, "erase_depths"))
    erase_positions = _parse_erase_positions(args.erase_positions)
    if args.tokenizer is not None:
        from models.tokenizers import tokenizer_source

        tokenizer_source(args.tokenizer)  # a name that names nothing: refused before any model loads
    from models.loading import model_dir

    model_dir(args.model)  # an unknown name, an untrained preset, no config.json: one line, nothing loaded
    main_path = _model_path(args.model)
    model_name = safe_name(main_path)  # a path ending in '..' names the folder it resolves to
    from common.io import DirLock

    from .report import SCHEMA, check_no_results, write_report

    if out_arg is not None:
        check_no_results(out_arg, args.overwrite)
    control_arg, control_skip = _resolve_control(args.control_model, main_path)
    source.load()  # a module:function task's code runs from here on, every other argument checked
    if n_dis is None:
        own = source.default_distractors or ()
        n_dis = own[0] if own else DEFAULT_DISTRACTORS
    # One default-output rule with probes.run (common.paths): ./figures/<model>/<task>/ of the current directory.
    out = out_arg if out_arg is not None else output_dir(default_output(model_name, source.name), "--out")
    check_no_results(out, args.overwrite)

    if n_dis < source.min_distractors:
        raise UserError(f"task {source.name!r} needs --distractors >= {source.min_distractors}")
    samples = source.make(n_pairs, n_dis, seed)
    if source.fixed and args.distractors is None and len(source.default_distractors or ()) > 1:
        say(f"task file {source.spec}: N = {n_dis} (the file also has N = "
            f"{', '.join(map(str, source.default_distractors[1:]))}; choose with --distractors)")
    probe_cfg = ProbeConfig(random_state=seed)
    # One class per word (the language tasks) is too many for grouped-CV probes: they fit each sample's role in
    # its pair instead (tasks.probe_labels); the metrics keep the answer.
    probe_y, probe_label = probe_labels(samples, probe_cfg.n_splits,  # a user's task: its labels, or refused
                                        roles=None if source.builtin else False)
    probe_labels_ = None if probe_label == ANSWER_PROBE_LABEL else probe_y
    if probe_labels_ is not None:
        say(f"{source.name}: {source.n_classes} answer classes are too many for grouped-CV probes; the probes fit "
            "each sample's role in its pair instead")

    say(f"loading {args.model}")
    model, tok, _ = _load(args.model, placement, args.tokenizer)
    if rank is None:  # K - 1 directions separate K class means; one would leave a 3-way label partly unswapped
        k_probe = len(set(probe_y))
        rank = min(max(1, k_probe - 1), MAX_RANK, model.d_model)
    if rank > model.d_model:
        raise UserError(f"--subspace-rank {rank} exceeds the model's d_model {model.d_model}")
    if args.mode is None and getattr(model, "spec", None) is not None and hasattr(model, "iterations"):
        mode = "standard"  # a looped model: its loop at the trained r, one parallel pass
        say(f"{args.model} is a looped model: mode standard ({model.iterations} iterations of its core)")
    parsed = parse_mode(mode, model.n_layers)  # recirculation depths checked against this model
    L = parsed.depth(model)  # the depths of the mode's own stack (loop-R: its unrolling)
    if erase_depths and max(erase_depths) > L:
        raise UserError(f"--erase-depths {max(erase_depths)} is beyond {parsed.name}'s depth 0..{L}")
    if args.sweep_depth is not None and args.sweep_depth > L:
        raise UserError(f"--sweep-depth {args.sweep_depth} is beyond {parsed.name}'s depth 0..{L}")
    if not model.has_fusion and parsed.has_feedback:
        raise UserError(f"model {args.model!r} has no fusion module, so it has no {mode} prefill: use --mode "
                        "standard (residual patching, the residual position sweep and mean ablation by depth), "
                        "recirc-S:D:ALPHA (training-free recirculation)"
                        + (", or loop-R (its core iterated R times)" if getattr(model, "spec", None) is not None
                           and hasattr(model, "iterations") else ""))
    feedback = parsed.feeds_state
    if args.sweep_depth is not None and feedback:  # a flag that would change nothing is refused, not dropped
        raise UserError(f"--sweep-depth sets the depth of standard prefill's residual position sweep; {mode} sweeps "
                        "its fed state: drop the flag")
    das_flags = [f for f, v in (("--das-site", args.das_site), ("--das-steps", args.das_steps),
                                ("--das-lr", args.das_lr)) if v is not None]
    if das_flags and args.das is None:
        raise UserError(f"{', '.join(das_flags)} set how --das searches: add --das RANKS")
    das_ranks = _parse_das(args.das, model.d_model)
    das_site = _parse_das_site(args.das_site, parsed, L)
    das_cfg = None
    if das_ranks is not None:
        from .das import DasConfig

        given = {"steps": args.das_steps, "lr": args.das_lr}  # the others: DasConfig's defaults
        das_cfg = DasConfig(ranks=das_ranks, seed=seed, **{k: v for k, v in given.items() if v is not None})
    if das_cfg is not None and not parsed.has_gradient:
        raise UserError(f"--das trains a rotation through the patched run, and {mode} runs without gradient (the "
                        "exact sequential recirculation engine): use its other analyses")
    if args.attribution_ig and not args.attribution:
        raise UserError("--attribution-ig sets how --attribution integrates: add --attribution")
    if args.attribution and not parsed.attributable:
        raise UserError(f"--attribution runs under standard, loop-R and recurrent-K prefill, not {mode}")
    if not feedback and erase_positions:
        raise UserError("--erase-positions: standard prefill feeds no state")
    if erase_positions and set(erase_positions) == {-1}:
        raise UserError("--erase-positions T: the fed state at T is always erased (row leace_state_T): drop it, or "
                        "name positions before T")
    if args.subspace_rank is not None and not feedback and das_cfg is None:
        raise UserError(f"--subspace-rank sets the fed state's subspace swap (and the probe subspace beside --das); "
                        f"{mode} prefill feeds no state: drop it, or add --das")
    if not feedback and args.leace_all is not None:
        raise UserError(f"--leace-all / --no-leace-all: the row erases the fed state at every fused position, and "
                        f"{mode} prefill feeds no state: drop it")
    if not feedback and args.control_model is not None and control_arg is not None:
        raise UserError(f"--control-model: a control model tests a fed state's swap; {mode} prefill feeds no state: "
                        "drop it")
    cmodel = None
    if control_arg is not None and not feedback:  # the default control, where there is nothing to control
        control_arg, control_skip = None, "a control model tests a fed state; standard prefill has none"
    if control_arg is not None and args.control_model is None and parsed.is_recirculation:
        control_arg, control_skip = None, ("recirculation trains nothing, so no model holds an untrained version of "
                                           "it; --control-model runs the same recirculation on another model")
    if control_arg is not None:  # loaded (and checked) before any work, used after the main suite
        cmodel, ctok, _ = _load(control_arg, placement)
        if ctok.get_vocab() != tok.get_vocab():
            if args.control_model is None:  # the default control only applies to the task tokenizer's models
                cmodel, control_arg, control_skip = None, None, "tiny-std uses another tokenizer than the model"
            else:
                raise UserError(f"control model {control_arg!r} uses another tokenizer than {args.model!r}")
    if cmodel is not None and weights_hash(cmodel) == weights_hash(model):  # the same weights by another path
        if args.control_model is not None:
            raise UserError(f"--control-model {control_arg!r} has the weights of the model under study: a control "
                            "is another model")
        cmodel, control_arg, control_skip = None, None, "the control is the model under study"
    with DirLock(out):
        check_no_results(out, args.overwrite)  # again under the lock: another run may just have written
        from common.io import remove_stale_tmp

        remove_stale_tmp(out)  # temporaries a killed earlier run left (this process holds the lock)
        import torch

        from .batch import pos_name
        from .core import Batch, CausalContext
        from .suite import evenly, run_control, run_suite

        batch = Batch.from_samples(samples, tok, source, probe_labels_)
        n_pairs_used = len({s.pair_id for s in samples})
        say(f"{n_pairs_used} pairs ({batch.size} samples), N = {n_dis}, T = {batch.input_ids.shape[1]} columns, "
            f"budget {args.budget}; clean runs")
        _check_erase_positions(erase_positions, mode, batch.input_ids.shape[1])  # before any model run
        T = batch.input_ids.shape[1]
        if das_cfg is not None:
            fed_at = parse_mode(mode).fed_positions(T)
            if das_site[0] == "state" and das_site[2] not in fed_at:
                raise UserError(f"--das-site state@{pos_name(das_site[2])}: {mode} feeds a state only at "
                                f"{pos_name(fed_at[0])}..T of these {T}-column prompts")
            if -das_site[2] > T:
                raise UserError(f"--das-site position {pos_name(das_site[2])} is beyond these {T}-column prompts")
        if args.attribution_ig and not torch.equal(batch.attention_mask, batch.attention_mask[batch.pair]):
            raise UserError("--attribution-ig interpolates each row's token embeddings towards its paired sample's: "
                            "the pairs must have equal lengths (this task's pairs differ)")
        t1 = time.perf_counter()
        # beside standard, except a loop-R mode: the looped model's standard pass is its trained r, another stack
        modes = (mode,) if parsed.loop_iterations is not None else ("standard", mode)
        ctx = CausalContext(model, batch, modes=modes)
        if das_cfg is not None and das_site[0] == "resid" and das_site[1] > ctx.n_layers:
            raise UserError(f"--das-site depth {das_site[1]} is beyond {mode}'s depth 0..{ctx.n_layers}")
        copies = copies_across_groups(samples, [row[m.bool()].tolist() for row, m in  # the inputs, not the texts
                                                 zip(batch.input_ids, batch.attention_mask)])
        if copies:  # every check passed; the probes' held-out accuracies (subspace, LEACE, DAS) see trained texts
            print(f"warning: {copies} of {len(samples)} samples have their exact text in another group: the probes' "
                  "held-out accuracies include texts they were trained on (too few distinct prompts at this N)",
                  file=sys.stderr)
        layer_depths = evenly(range(ctx.n_layers + 1), max_depths)  # the mode's own stack (loop-R: its unrolling)
        try:
            results = run_suite(ctx, rank=rank, n_boot=n_boot, seed=seed, probe_config=probe_cfg,
                                progress=progress, max_positions=max_positions, erase_depths=erase_depths,
                                erase_positions=erase_positions, layer_depths=layer_depths,
                                sweep_depth=args.sweep_depth, leace_all=pick(args.leace_all, "leace_all"),
                                das=das_cfg, das_site=das_site, attribution=args.attribution,
                                attribution_ig=args.attribution_ig)
            t_suite = time.perf_counter() - t1

            control = None
            if control_arg is not None:
                cname = safe_name(_model_path(control_arg))
                cctx = CausalContext(cmodel, batch, modes=modes, drop_unfused=True)  # runs what it has
                progress.plan(3 if cmodel.has_fusion else 0)
                progress.stage(f"negative control {control_arg}", 3 if cmodel.has_fusion else 0)
                cctx.on_run = progress.step
                control = {"model": cname, "path": str(_model_path(control_arg)),
                           **_control_role(parsed, _model_path(control_arg)),
                           **run_control(cctx, n_boot=n_boot, seed=seed)}
            else:
                control = {"skipped": control_skip}
        finally:
            progress.close()

        lengths = batch.attention_mask.sum(-1)
        report = {
            "schema": dict(SCHEMA),
            "model": {"name": model_name, "path": str(main_path),
                      # one definition with probes.json: a hash of the tensors (models.fingerprint.weights_hash);
                      # the checkpoint file's bytes are file_sha256
                      "weights_sha256": weights_hash(model), "config_sha256": config_hash(model),
                      "file_sha256": _weights_file_sha256(main_path),
                      "n_layers": model.n_layers, "d_model": model.d_model, "feedback": model.has_fusion},
            "config": {"task": args.task, "task_source": source.describe(), "mode": mode, "distractors": n_dis,
                       "n_pairs": n_pairs_used, "n_pairs_requested": n_pairs, "budget": args.budget, "seed": seed,
                       "subspace_rank": rank, "n_boot": n_boot, "probe": probe_cfg.to_dict(),
                       "probe_label": probe_label,
                       "max_positions": max_positions, "layer_depths": layer_depths, "n_classes": batch.n_classes,
                       "erase_depths": erase_depths, "erase_positions": erase_positions,
                       "leace_all": pick(args.leace_all, "leace_all"), "sweep_depth": (results.get("position_sweep") or {}).get("depth"),
                       "das": None if das_cfg is None else {**das_cfg.to_dict(), "site": list(das_site)},
                       "attribution": bool(args.attribution), "attribution_ig": args.attribution_ig,
                       "device": str(ctx.device), "dtype": placement.dtype,
                       "prompt_prefix": prompt_prefix_tokens(tok),
                       "command": command_text("python -m interventions.run", argv)},
            "dataset": {"fingerprint": dataset_fingerprint(samples), "n_samples": batch.size,
                        "n_pairs": n_pairs_used, "n_groups": int(len(set(batch.groups.tolist()))),
                        "tokens_min": int(lengths.min()), "tokens_max": int(lengths.max()),
                        "copies_across_groups": copies},
            "results": results,
            "control": control,
        }
        from .report import verdict
        label, sentence = verdict(report)
        report["verdict"] = {"label": label, "sentence": sentence}
        report["timings_s"] = {"suite": t_suite, "total": time.perf_counter() - t0}
        paths = write_report(report, out, args.overwrite, args.plotly)
        print(sentence)
        for p in paths:
            print(f"wrote {p}")
        return 0


def _weights_file_sha256(path: Path) -> str | None:
    """sha256 of the checkpoint's weights file (model.safetensors, or the first safetensors shard / .bin)."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).is_file():
            return _sha256(path / name)
    shards = sorted(path.glob("*.safetensors"))
    return _sha256(shards[0]) if shards else None


if __name__ == "__main__":
    sys.exit(main())
