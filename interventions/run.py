"""python -m interventions.run --task completion [--model tiny-fbt] [--mode recurrent-1] [--max-positions P]

Runs the causal-ablation battery of docs/design.md (Interventions) in any prefill mode (standard, recurrent-K, recurrent-full,
fused-N; parsed once by engine.modes.parse_mode, reported under its canonical name): the interventions on the
state entering the fusion at T, the state-swap sweep over every fused position t and the depth x position layer
patching (mode under study and standard side by side), and LEACE erasure of the label from the fed state and
the residual stream (--erase-depths, --erase-positions; docs/methods.md). Sweeps and heatmaps cover every position of prompts up
to DEFAULT_MAX_POSITIONS columns and the last DEFAULT_MAX_POSITIONS otherwise (--max-positions P: the last P;
0 = all). It writes
<project root>/figures/<model>/<task>/causal_report.{json,md,html} (beside probes.run's probes.json, from any
working directory) or --out. The output directory is locked for the run; the three files replace an earlier
run's only once all are complete; no other file in the folder is touched.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

from common.cli import Parser, int_in, output_dir, safe_name
from common.errors import UserError, cli_entry

ROOT = Path(__file__).resolve().parent.parent
N_PAIRS_RANGE = (10, 5000)
MAX_DISTRACTORS = 1024
MAX_SEED = 2**31 - 1  # the suite also seeds with seed + 1000
MAX_RANK = 64
MAX_BOOT = 100_000
DEFAULT_MAX_POSITIONS = 64
MAX_POSITIONS = 100_000
MAX_ERASE_DEPTH = 10_000  # checked against the model's depth once it is loaded


def build_parser() -> argparse.ArgumentParser:
    from tasks import ALL_TASKS as TASKS

    p = Parser(prog="python -m interventions.run",
               description="Causal interventions on the fed-back state at the probed position T: gate bypass, "
                           "state swap, resample/mean/zero/random state, probe-subspace swaps, dose-response and "
                           "layer patching, with a negative control model. Writes causal_report.{json,md,html}.")
    p.add_argument("--task", default="completion", help=f"probing task: {', '.join(TASKS)} (default completion)")
    p.add_argument("--model", default="tiny-fbt",
                   help="shipped preset name (e.g. tiny-fbt) or a checkpoint directory (default tiny-fbt)")
    p.add_argument("--mode", default="recurrent-1",
                   help="prefill mode intervened on: standard, recurrent-K, recurrent-full or fused-N (default "
                        "recurrent-1; fused-N patches its last pass). Layer patching also runs standard.")
    p.add_argument("--max-positions", type=int_in(0, MAX_POSITIONS), default=DEFAULT_MAX_POSITIONS,
                   help="position sweep and layer-patching heatmap over the last P positions (0 = all; default "
                        f"{DEFAULT_MAX_POSITIONS}: every position of prompts up to that length)")
    p.add_argument("--distractors", type=int_in(0, MAX_DISTRACTORS), default=8,
                   help=f"number N of distractor lines per prompt, 0..{MAX_DISTRACTORS} (default 8)")
    p.add_argument("--n-pairs", type=int_in(*N_PAIRS_RANGE), default=200,
                   help=f"number of sample pairs (2 samples each), {N_PAIRS_RANGE[0]}..{N_PAIRS_RANGE[1]} "
                        "(default 200)")
    p.add_argument("--n-boot", type=int_in(1, MAX_BOOT), default=1000,
                   help=f"cluster-bootstrap resamples (over groups) for every 95%% CI, 1..{MAX_BOOT} (default 1000)")
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0,
                   help=f"dataset / resampling / bootstrap seed, 0..{MAX_SEED} (default 0)")
    p.add_argument("--subspace-rank", type=int_in(1, MAX_RANK), default=None,
                   help=f"rank of the probe subspace, 1..min({MAX_RANK}, d_model) (default K - 1 for a K-class "
                        "label, the span of a K-class linear read-out: 1 for binary tasks, 2 for the shell game; "
                        f"at most {MAX_RANK} and d_model)")
    p.add_argument("--erase-depths", default="all",
                   help="LEACE rows: erase the label from the residual stream at T at these depths, one row each "
                        "(comma-separated 0..L; 'all' = every depth, the default; 'none' = no residual rows). "
                        "The fed state at T, with a dose, and at every fused position at once are always erased "
                        "(recurrent and fused modes)")
    p.add_argument("--erase-positions", default=None,
                   help="LEACE rows: also erase the label from the fed state at each of these positions alone "
                        "(comma-separated T, T-1, T-2, ..., or negative offsets -1 = T, -2 = T-1 written "
                        "--erase-positions=-2,-5; must be fused positions of --mode; default none beyond T)")
    p.add_argument("--control-model", default=None,
                   help="negative-control model for the same swap (default: tiny-std when its checkpoint exists; "
                        "'none' to skip)")
    p.add_argument("--out", default=None,
                   help="output directory (default <project root>/figures/<model>/<task>/, beside probes.json)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier run's causal_report.* in the output directory (never done silently)")
    p.add_argument("--no-progress", action="store_true", help="do not print progress lines on stderr")
    return p


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _model_path(name_or_path: str) -> Path:
    from training.presets import PRESETS, checkpoint_dir

    p = Path(name_or_path)
    return checkpoint_dir(name_or_path) if not p.exists() and name_or_path in PRESETS else p


def _load(name_or_path: str, role: str):
    from training.presets import load_model

    model, tok, name = load_model(name_or_path)  # refuses NaN/inf weights (models.full_bandwidth.load_weights)
    if tok is None:
        raise UserError(f"{role} model {name_or_path!r} has no tokenizer.json next to its weights")
    return model.float().eval(), tok, name


def _resolve_control(arg, main_path: Path):
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


def _check_erase_positions(positions, mode: str, T: int) -> None:
    """UserError unless every position is one where `mode` feeds a state (core's fused positions) on T columns."""
    from engine.modes import parse_mode
    from engine.prefill import recurrent_start

    if not positions:
        return
    m = parse_mode(mode)
    if m.kind == "standard":
        raise UserError(f"--erase-positions: {mode} prefill feeds no state")
    first = 1 - T if m.kind == "fused" else recurrent_start(T, m.n) - T
    bad = [p for p in positions if p < first]
    if bad:
        raise UserError(f"--erase-positions {bad[0]}: {mode} feeds a state only at offsets {first}..-1 of these "
                        f"{T}-column prompts")


@cli_entry
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from engine.modes import parse_mode
    from probes.collect import weights_hash
    from probes.linear import ProbeConfig, check_groups
    from tasks import dataset_fingerprint, resolve_task

    t0 = time.perf_counter()
    source = resolve_task(args.task)  # a built-in name, a JSONL file or module:function; one-line errors
    mode = parse_mode(args.mode).name
    max_positions = args.max_positions or None
    n_pairs, n_dis, seed, rank = args.n_pairs, args.distractors, args.seed, args.subspace_rank
    out_arg = output_dir(args.out, "--out") if args.out is not None else None  # "" refused, never the default
    say = (lambda *a: None) if args.no_progress else (lambda msg: print(f"[interventions] {msg}", file=sys.stderr))

    main_path = _model_path(args.model)
    if not main_path.exists():
        from training.presets import load_model
        load_model(args.model)  # raises the loader's UserError (unknown name / untrained preset)
    model_name = safe_name(main_path)  # a path ending in '..' names the folder it resolves to
    # One default-output rule with probes.run: the project root's figures/<model>/<task>/, whatever the cwd.
    out = out_arg if out_arg is not None else output_dir(ROOT / "figures" / model_name / source.name, "--out")
    from common.io import DirLock

    from .report import SCHEMA, check_no_results, write_report

    check_no_results(out, args.overwrite)
    control_arg, control_skip = _resolve_control(args.control_model, main_path)
    erase_depths = _parse_erase_depths(args.erase_depths)
    erase_positions = _parse_erase_positions(args.erase_positions)

    if n_dis < source.min_distractors:
        raise UserError(f"task {source.name!r} needs --distractors >= {source.min_distractors}")
    samples = source.make(None if source.fixed else n_pairs, n_dis, seed)
    probe_cfg = ProbeConfig(random_state=seed)
    check_groups([s.label for s in samples], [s.group_id for s in samples], probe_cfg.n_splits)

    say(f"loading {args.model}")
    model, tok, _ = _load(args.model, "the")
    if not model.has_fusion:
        raise UserError(f"model {args.model!r} has no fusion module: there is no fed state to intervene on")
    if rank is None:  # K - 1 directions separate K class means; one would leave a 3-way label partly unswapped
        rank = min(max(1, source.n_classes - 1), MAX_RANK, model.d_model)
    if rank > model.d_model:
        raise UserError(f"--subspace-rank {rank} exceeds the model's d_model {model.d_model}")
    if erase_depths and max(erase_depths) > model.n_layers:
        raise UserError(f"--erase-depths {max(erase_depths)} is beyond the model's depth 0..{model.n_layers}")
    cmodel = None
    if control_arg is not None:  # loaded (and checked) before any work, used after the main suite
        cmodel, ctok, _ = _load(control_arg, "control")
        if ctok.get_vocab() != tok.get_vocab():
            raise UserError(f"control model {control_arg!r} uses another tokenizer than {args.model!r}")
    with DirLock(out):
        check_no_results(out, args.overwrite)  # again under the lock: another run may just have written
        from common.io import remove_stale_tmp

        remove_stale_tmp(out)  # temporaries a killed earlier run left (this process holds the lock)
        from .core import Batch, CausalContext
        from .suite import run_control, run_suite

        batch = Batch.from_samples(samples, tok, source)
        say(f"{batch.size} samples, T = {batch.input_ids.shape[1]} columns; clean runs")
        _check_erase_positions(erase_positions, mode, batch.input_ids.shape[1])  # before any model run
        t1 = time.perf_counter()
        modes = ("standard", mode)
        ctx = CausalContext(model, batch, modes=modes)
        results = run_suite(ctx, rank=rank, n_boot=args.n_boot, seed=seed, probe_config=probe_cfg, progress=say,
                            max_positions=max_positions, erase_depths=erase_depths,
                            erase_positions=erase_positions)
        t_suite = time.perf_counter() - t1

        control = None
        if control_arg is not None:
            say(f"negative control {control_arg}")
            cname = safe_name(_model_path(control_arg))
            control = {"model": cname, "path": str(_model_path(control_arg)),
                       **run_control(CausalContext(cmodel, batch, modes=modes), n_boot=args.n_boot, seed=seed)}
        else:
            control = {"skipped": control_skip}

        lengths = batch.attention_mask.sum(-1)
        report = {
            "schema": dict(SCHEMA),
            "model": {"name": model_name, "path": str(main_path),
                      # one definition with probes.json: a hash of the tensors (probes.collect.weights_hash);
                      # the checkpoint file's bytes are file_sha256
                      "weights_sha256": weights_hash(model), "file_sha256": _sha256(main_path / "model.safetensors"),
                      "n_layers": model.n_layers, "d_model": model.d_model},
            "config": {"task": args.task, "task_source": source.describe(), "mode": mode, "distractors": n_dis, "n_pairs": n_pairs, "seed": seed,
                       "subspace_rank": rank, "n_boot": args.n_boot, "probe": probe_cfg.to_dict(),
                       "max_positions": max_positions, "n_classes": batch.n_classes,
                       "erase_depths": erase_depths, "erase_positions": erase_positions,
                       "command": "python -m interventions.run " + " ".join(sys.argv[1:] if argv is None else argv)},
            "dataset": {"fingerprint": dataset_fingerprint(samples), "n_samples": batch.size,
                        "n_groups": int(len(set(batch.groups.tolist()))),
                        "tokens_min": int(lengths.min()), "tokens_max": int(lengths.max())},
            "results": results,
            "control": control,
        }
        from .report import verdict
        label, sentence = verdict(report)
        report["verdict"] = {"label": label, "sentence": sentence}
        report["timings_s"] = {"suite": t_suite, "total": time.perf_counter() - t0}
        paths = write_report(report, out, args.overwrite)
        print(sentence)
        for p in paths:
            print(f"wrote {p}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
