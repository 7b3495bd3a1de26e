"""Multi-pass (Jacobi) training of a FullBandwidthLM on the synthetic task mixture.

    python -m training.train --preset tiny-fbt                     # trains into checkpoints/tiny-fbt
    python -m training.train --preset tiny-fbt --out runs/x --resume
    torchrun --nproc_per_node=2 -m training.train --preset smoke --out runs/ddp

Loss: L = NTP(pass 1) + lambda/(K-1) * sum_{k=2..K} NTP(pass k) (+ the state-consistency term, --consistency);
pass k>1 fuses pass k-1's top states shifted right by one, and gradients flow through every pass, except that a
batch started by warm passes or from the fixed point feeds pass 2 states computed without gradient, and the
consistency term's target (the standard pass's states) is detached. K is drawn per batch from the schedule.
Every batch is a pure function of (seed, step) and the trainer state keeps torch's generators (attention
dropout's masks), so `--resume` continues bit-identically; under torchrun the
processes split each step's batch (DistributedDataParallel), so their number does not change what is trained
(but for attention dropout's masks, training.loop).
Every flag is checked before any work; a run holds a lock on --out, stops at the first non-finite loss, gradient
or weight without saving it, and with --overwrite replaces an earlier run only once its own last checkpoint is
written (training.output.RunOutput). Every recipe flag overrides that value of the --preset; `--resume` without
--preset continues the recipe the run was saved with, and a flag given with it changes that value (printed).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, fields, replace


import torch

from common.cli import (Parser, add_device_flags, add_output_flags, add_progress_flag, add_seed_flag, add_task_flags,
                        add_threads_flag, int_in, output_dir, refuse_idle_flags)
from common.errors import UserError, cli_entry
from common.placement import Placement
from models.checkpoints import checkpoint_dir
from tasks import ALL_TASKS, TRACKING_TASKS
from training.config import CHOICES, FLOAT_LIMITS, INT_LIMITS, MAX_STEPS, TrainConfig, bounds_text, float_flag, int_flag
from training.checkpoint import saved_recipe
from training.loop import train
from training.output import check_output
from training.presets import PRESETS, get_preset

DEFAULT_PRESET = "tiny-fbt"  # --preset when none is given (and no --resume recipe)


def add_recipe_flags(p: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, derived from the field: --name-with-dashes, its help from the field's
    metadata, integer and float fields bounded by INT_LIMITS / FLOAT_LIMITS (the bound shown in the help), words
    from CHOICES, switches as --x / --no-x, and the text of any other field read by the field's `parse`. Every
    default is None: a flag that is not given leaves the preset's value (on --resume, the run's saved value)."""
    g = p.add_argument_group("recipe (each overrides the preset's value; on --resume the run's saved value)")
    for f in fields(TrainConfig):
        flag, help = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if f.name == "seed":  # the one --seed of every command (common.cli.MAX_SEED = INT_LIMITS' bound)
            add_seed_flag(g, "the data and the initial weights", None, default_text="the preset's")
        elif f.name == "tasks":  # the shared --tasks words (built-in tasks only: the training mixture)
            add_task_flags(g, ALL_TASKS, None, " to train on", several=True, custom=False,
                           default_text="the preset's")
        elif f.name in INT_LIMITS:
            g.add_argument(flag, type=int_flag(f.name), help=f"{help}; {bounds_text(f.name)}")
        elif f.name in FLOAT_LIMITS:
            g.add_argument(flag, type=float_flag(f.name), help=f"{help}; {bounds_text(f.name)}")
        elif f.name in CHOICES:
            g.add_argument(flag, choices=CHOICES[f.name], help=help)
        elif isinstance(f.default, bool):
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help)
        else:
            g.add_argument(flag, help=help)
    # The earlier spelling of --no-tie-embeddings, kept so that existing commands still run.
    g.add_argument("--untied", dest="tie_embeddings", action="store_const", const=False,
                   help="separate input and output embeddings (= --no-tie-embeddings)")


def build_parser() -> Parser:
    p = Parser(prog="python -m training.train", description=__doc__)
    # default None, not tiny-fbt: a --resume must tell a --preset the user gave from none (its saved recipe)
    p.add_argument("--preset", help=f"training recipe ({', '.join(PRESETS)}); default {DEFAULT_PRESET}, and with "
                                    "--resume the recipe the run was saved with (--preset: that preset's instead)")
    add_output_flags(p, "checkpoints/<preset>", out_extra=": the checkpoint",
                     overwrite_extra="; the new run is built beside it and swapped in whole once its last checkpoint "
                                     "is written (an error or interrupt leaves the earlier run as it was); an "
                                     "interrupted --overwrite run cannot be resumed: an error or Ctrl-C removes it, "
                                     "and a killed one's staging folder (.<name>.staging-* beside --out) is refused "
                                     "by --resume and discarded by the next --overwrite")
    p.add_argument("--resume", action="store_true",
                   help="continue from the trainer state in --out (on any number of processes) under the recipe it "
                        "was saved with; a recipe flag or --preset given with it changes the recipe (each change "
                        "is printed and kept in the log's config_changes)")
    p.add_argument("--stop-at", type=int_in(1, MAX_STEPS),
                   help="stop (with a checkpoint) after this step, keeping the learning-rate schedule of --steps; "
                        "continue later with --resume, possibly under another preset (a shared 1-pass phase); "
                        "1..the total steps")
    add_threads_flag(p, help_extra="; per process")
    add_device_flags(p, dtype=False, device_map=False,
                     device_extra="; training: gloo between torchrun's processes on cpu, one GPU per process "
                                  "(LOCAL_RANK) and nccl on cuda")
    add_progress_flag(p)
    add_recipe_flags(p)
    return p


def parse_args(argv):
    return build_parser().parse_args(argv)


def config_of(args, saved: TrainConfig | None = None) -> TrainConfig:
    """The recipe: the preset with the flags' overrides, validated (TrainConfig checks itself). `saved`: the recipe
    of the run a --resume continues, the base instead of a preset unless --preset is given (a bare --resume once
    trained the default preset's recipe, not the run's)."""
    cfg = saved if saved is not None and args.preset is None else get_preset(args.preset or DEFAULT_PRESET)
    over = {}
    for f in fields(TrainConfig):
        v = getattr(args, f.name)
        if v is not None and "parse" in f.metadata:
            v = f.metadata["parse"](v)
        if v is not None:
            over[f.name] = v
    if args.tasks is not None and args.task_weights is None and cfg.task_weights is not None and \
            tuple(over["tasks"]) != tuple(cfg.tasks):
        # The preset's token shares are per task of ITS task list, by name (a reordered list keeps each task's
        # share; by position it swapped them); a share only where the task stays.
        share = dict(zip(cfg.tasks, cfg.task_weights))
        over["task_weights"] = tuple(share.get(t, 1.0 / len(cfg.tasks)) for t in over["tasks"])
    if args.lr_legs is None and "steps" in over:
        # a shorter run of a legged preset keeps the legs that end before it (one leg of the chain)
        over["lr_legs"] = tuple(e for e in cfg.lr_legs if e < over["steps"])
    cfg = replace(cfg, **over)
    _refuse_no_op_flags(cfg, over)
    return cfg


# The options that shape the multi-pass objective's fused passes (pass k > 1: its noise, prefix, warm and
# fixed-point starts, its weight and the consistency term).
MULTIPASS_ONLY = ("lam", "noise", "prefix_mix", "warm_passes", "warm_prob", "fixed_point_prob", "fixed_point_tol",
                  "consistency", "consistency_window", "consistency_layers")
# What a resumed run's weights must match (training.checkpoint.load_resume checks the built model as well).
ARCHITECTURE = ("base", "arch", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "max_len", "attn_window",
                "tie_embeddings")
# The sizes and init of a model built from scratch: --base keeps the base's own.
FROM_SCRATCH = ("arch", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "max_len", "attn_window",
                "tie_embeddings", "depth_scale")
# (fields, when they do nothing, why): a flag given there would be read, recorded in the config and do nothing.
NO_OP_RULES = (
    (("schedule", *MULTIPASS_ONLY), lambda c: c.objective == "recurrent",
     lambda c: "the recurrent objective (--objective recurrent) runs no fused pass for them to shape"),
    (MULTIPASS_ONLY, lambda c: not any(c.probs[1:]),
     lambda c: f"a schedule of one pass (--schedule {c.schedule}) runs no fused pass"),
    (FROM_SCRATCH, lambda c: c.base, lambda c: f"--base {c.base} keeps its own architecture"),
    (("n_kv_heads", "d_ff"), lambda c: c.arch == "gpt2", lambda c: "gpt2 has neither (its MLP is 4 x d_model wide)"),
    (("gate_init", "gate_std", "init_offset"), lambda c: c.base_fusion,
     lambda c: "--base-fusion keeps the base's trained fusion: nothing is initialized"),
    (("gate_std",), lambda c: c.gate_init != "unit", lambda c: "it sets the spread of --gate-init unit"),
    (("warm_prob",), lambda c: c.warm_passes == 0, lambda c: "there are no warm passes (--warm-passes 0)"),
    (("fixed_point_tol",), lambda c: c.fixed_point_prob == 0,
     lambda c: "there is no fixed-point start (--fixed-point-prob 0)"),
    (("consistency_window", "consistency_layers"), lambda c: c.consistency == 0,
     lambda c: "there is no consistency term (--consistency 0)"),
    (("label_weight",), lambda c: c.targets == "labels", lambda c: "--targets labels weighs every label 1"),
    (("length_start",), lambda c: c.length_doubling == 0,
     lambda c: "there is no length curriculum (--length-doubling 0)"),
    (("register_curriculum",), lambda c: "multi_register" not in c.tasks, lambda c: "multi_register is not trained"),
    (("curriculum_max_n", "curriculum_seq_len"), lambda c: c.curriculum_steps == 0,
     lambda c: "there is no curriculum (--curriculum-steps 0)"),
    (("seq_len", "curriculum_seq_len"), lambda c: not c.packing,
     lambda c: "unpacked rows hold one sample each (--no-packing)"),
    (("curriculum_seq_len",), lambda c: c.curriculum_seq_len >= c.seq_len,
     lambda c: f"rows are at most --seq-len {c.seq_len} long, in the curriculum too"),
    (("curriculum_max_n",), lambda c: c.curriculum_max_n < min(c.distractors) or c.curriculum_max_n >= max(c.distractors),
     lambda c: f"it keeps {'none' if c.curriculum_max_n < min(c.distractors) else 'every one'} of the N in "
               f"--distractors ({', '.join(map(str, sorted(c.distractors)))}), so the curriculum draws them all"),
    (("task_weights",), lambda c: c.packing,
     lambda c: "packed rows draw every task alike (task weights are for unpacked batches, --no-packing)"),
    (("all_answers",), lambda c: "shell_game" not in c.tasks and not (
        (c.variants is not None or c.heldout_split) and any(t in TRACKING_TASKS for t in c.tasks)),
     lambda c: "the shell game is not trained and no tracking task draws variants (--variants, --heldout-split)"),
    (("depth_scale", "gate_init", "gate_std", "init_offset"), lambda c: c.loop_core > 0,
     lambda c: "a looped model has no fusion gate to initialize, and its blocks are not depth-scaled"),
)


def _refuse_no_op_flags(cfg: TrainConfig, given: dict) -> None:
    """A flag given where its option does nothing is refused, not silently ignored (a preset's own values of
    such fields stay: they are not the user's)."""
    refuse_idle_flags(set(given), [(names, idle(cfg), why(cfg)) for names, idle, why in NO_OP_RULES],
                      spelled={"tie_embeddings": "--tie-embeddings / --untied"})


def resumed_recipe(out, args) -> TrainConfig | dict:
    """The recipe the run in `out` was saved with (its trainer state's), checked as check_output checks a --resume.
    A TrainConfig; only under --preset (which replaces it) a saved recipe this version cannot rebuild is the raw
    dict, kept for recipe_changes."""
    check_output(out, True, args.overwrite)  # read-only; its refusals (no trainer state...) come first
    saved = saved_recipe(out)
    unknown = sorted(set(saved) - {f.name for f in fields(TrainConfig)})
    try:
        if unknown:
            raise UserError(f"it has fields this version does not know ({', '.join(unknown)})")
        return TrainConfig(**saved)
    except (UserError, TypeError, ValueError) as e:
        if args.preset is not None:
            return saved
        raise UserError(f"--resume: the recipe saved in {out} cannot be rebuilt ({e}); give --preset and the run's "
                        "flags") from None


def _shown(v) -> str:
    return ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


def recipe_changes(before: TrainConfig | dict, after: TrainConfig) -> list[str]:
    """'field old -> new' for each field in which `after` differs from the resumed run's recipe `before`: a
    --resume that changes the recipe says so (a different --seed changes the data from the resumed step on)."""
    # whole configs, not to_dict(): it leaves out the options that are off, which would read as None
    old = _full(before) if isinstance(before, TrainConfig) else before
    new = _full(after)
    return [f"{k} {_shown(old.get(k))} -> {_shown(new.get(k))}" for k in new if old.get(k) != new.get(k)]


def _full(cfg: TrainConfig) -> dict:
    """Every field of `cfg`, as train_log.json reads it back (tuples as lists, keys as text)."""
    return json.loads(json.dumps(asdict(cfg)))


@cli_entry
def main(argv=None):
    # Everything is checked before any work and before the output directory is touched.
    args = parse_args(argv)
    out = output_dir(args.out if args.out is not None else checkpoint_dir(args.preset or DEFAULT_PRESET),
                     model_dir=True)
    before = resumed_recipe(out, args) if args.resume else None
    cfg = config_of(args, before)
    stop = cfg.steps if args.stop_at is None else args.stop_at
    if not 0 < stop <= cfg.steps:
        raise UserError(f"--stop-at must be in 1..{cfg.steps} (the total steps), got {args.stop_at}")
    device = Placement.from_args(args).torch_device.type  # auto resolved; cuda refused without a GPU
    from common.distributed import env_place

    world, rank, _ = env_place()
    cfg.check_world(world)  # torchrun's environment checked before any work; train() checks it again
    staged = check_output(out, args.resume, args.overwrite)
    if isinstance(before, TrainConfig):  # refused now, not once the model is built (training.checkpoint.load_resume)
        moved = [f"{k} {_shown(getattr(before, k))} -> {_shown(getattr(cfg, k))}" for k in ARCHITECTURE
                 if getattr(before, k) != getattr(cfg, k)]
        if moved:
            raise UserError(f"--resume: the run in {out} has another architecture than this recipe "
                            f"({'; '.join(moved)}): the architecture cannot change on --resume; resume with the run's "
                            "own sizes, or start a new run in another --out")
    if before is not None and rank == 0:
        for line in recipe_changes(before, cfg):
            print(f"--resume: {line}")
    if args.threads:
        torch.set_num_threads(args.threads)
    train(cfg, out, staged, resume=args.resume, stop=stop, progress=not args.no_progress, device=device,
          overwrite=args.overwrite)


if __name__ == "__main__":  # `python -m training.cli` = `python -m training.train`
    main()
