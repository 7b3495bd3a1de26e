"""Probe every depth of a model under several prefill modes: `python -m probes.run --task completion`.

--task is a built-in task (completion, memory, multi_register, and the state-tracking parity and shell_game),
a samples file `path/to/samples.jsonl` or a generator `package.module:function` (docs/tasks.md,
tasks.custom.resolve_task). Probes are binary or, with K > 2 label classes (shell_game), multinomial; chance
is 1/K.

For each distractor count N the task's dataset is generated (seeded), tokenized, the residual stream at the
final token is collected through nnsight for every depth and mode (probes.collect, cached on disk), and a
linear probe is scored per depth with group-held-out CV (stats.linear). Writes to --out
(default ./figures/<model>/<task>/ under the current directory, beside interventions.run's causal_report.*):

    probes.json         {"meta": {...}, "results": [...]}  (schema below)
    depth_curves.html   interactive depth curves (probes.depth_curves), loading plotly.min.js beside it
    plotly.min.js       plotly.js, once per folder (replaced only when it differs; causal_report.html uses it too)
    activations/        only with --save-activations: N<N>_<mode>.npz + .json (layout in probes.collect)

Modes are canonicalised and de-duplicated once (fused-0 and recurrent-0 are standard; recirc modes by their
canonical name); rows, activations and meta.run.modes use the canonical names. The output directory is locked
for the run (a second run into it is refused); new files are written to temporaries and replace the old ones
only when all are complete; a run that is refused or fails leaves an earlier run's results untouched. A
successful run leaves exactly its own files (activations/ only with --save-activations); other tools' files
in the folder (causal_report.*) are never touched.

probes.json
    meta     schema, run (the settings that define this run: task, model, weights hash, config hash, modes,
             distractors, n_pairs, seed, probe config), model (name, path, n_layers, d_model, fusion), datasets
             (per N: fingerprint, n_samples, n_groups, token lengths), tokenizer hash, versions, seed,
             warnings (leakage: standard-prefill depth 0 not at chance, what the probe scores without
             information: 1/K on balanced labels), wall_time_s (the only field that
             differs between two runs with the same settings); for every task but the three original ones also
             labels ({"words", "n_classes", "chance"}), and for custom tasks run.task_source (kind, spec,
             name, label_words, sha256 of a JSONL file)
    results  one row per (mode, N, depth[, writes]): task, model, mode, n_distractors, writes (multi_register:
             2/4/8 per writes-per-register subset, null = all samples), depth, accuracy, accuracy_std, ci_low,
             ci_high, control_accuracy, selectivity, n_samples, n_groups, fold_accuracies; schema 2 adds
             the logit lens (probes.lens: logit_lens_ld, logit_lens_ld_ci, logit_lens_accuracy, logit_lens_rank)
             and the online code (probes.mdl: mdl_online_bits, mdl_uniform_bits, mdl_compression; null with
             --no-mdl) to every row
    fed_state_lens  (schema 2) only with --fed-lens (else []): one row per (feedback mode, N), the logit lens of
             the state h_{T-1} fed into T (task, model, mode, n_distractors, writes null, state "h_{T-1}", the
             four logit_lens_* fields, n_samples); meta.lens.fed_state_enabled says which
    erased   (schema 2, only with --erase DEPTH) one row per (mode, N, depth >= DEPTH): the probe and the lens
             after the label was erased by LEACE from the residual at (DEPTH, T) and the model run on
             (probes.erase): task, model, mode, n_distractors, writes null, erased_at, depth, accuracy,
             accuracy_std, ci_low, ci_high, fold_accuracies, n_samples, n_groups, logit_lens_*; meta.erase
             describes it
    meta.lens, meta.mdl  (schema 2) what the lens and the online code computed (docs/methods.md)
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from common.cli import int_list, output_dir, safe_name
from common.errors import UserError, cli_entry
from common.paths import default_output
from common.placement import Placement
from probes.methods import MethodFields

from probes.options import (DEFAULT_N_PAIRS, MAX_DISTRACTORS, OUTPUTS, SCHEMA, _default_modes,
                            _parse_distractors, _parse_modes, parse_args)


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("fbprobe", "torch", "transformers", "nnsight", "scikit-learn", "numpy"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _json_dumps(doc) -> str:
    return json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n"


def _check_out_dir(out: Path, run_sig: dict, overwrite: bool, save_activations: bool = False) -> None:
    """Refuse (UserError) to overwrite results of a different run unless --overwrite; or to remove the exported
    activations/ of an earlier run (a run without --save-activations replaces the folder's outputs without it)."""
    pj = out / "probes.json"
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    if not pj.exists():
        others = [p.name for p in (out / "depth_curves.html", out / "activations") if p.exists()]
        if others and not overwrite:
            raise UserError(f"{out} holds {', '.join(others)} but no probes.json (a different or interrupted "
                            f"run); use --overwrite to replace them or choose another --out")
        return
    if overwrite:
        return
    try:
        old = json.loads(pj.read_text())
        old_sig = old["meta"]["run"]
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise UserError(f"{pj} is not a readable probes.json of this tool; use --overwrite to replace it") from None
    if old_sig != run_sig:
        diff = sorted(k for k in set(old_sig) | set(run_sig) if old_sig.get(k) != run_sig.get(k))
        raise UserError(f"{out} holds results of a different run (differs in {', '.join(diff)}); "
                        f"use --overwrite to replace them or choose another --out")
    if (out / "activations").exists() and not save_activations:
        raise UserError(f"{out} holds activations/ (an earlier --save-activations), which this run would remove: "
                        "pass --save-activations to write them again, --overwrite to drop them, or choose another "
                        "--out")


def _result_rows(task, model_name, mode, n, scores, writes=None):
    rows = []
    for depth, sc in enumerate(scores):
        rows.append({
            "task": task, "model": model_name, "mode": mode, "n_distractors": n, "writes": writes,
            "depth": depth, "accuracy": sc.accuracy, "accuracy_std": sc.accuracy_std,
            "ci_low": sc.ci_low, "ci_high": sc.ci_high, "control_accuracy": sc.control_accuracy,
            "selectivity": sc.accuracy - sc.control_accuracy, "n_samples": sc.n_samples, "n_groups": sc.n_groups,
            "fold_accuracies": sc.fold_accuracies,
        })
    return rows


def _score_depths(acts, y, groups, config, what):
    from threadpoolctl import threadpool_limits

    from stats.linear import grouped_cv_scores

    try:
        # Probe-sized linear algebra is fastest (and exactly repeatable) on one BLAS thread.
        with threadpool_limits(limits=1, user_api="blas"):
            return grouped_cv_scores([acts[:, d] for d in range(acts.shape[1])], y, groups, config)
    except UserError as e:
        raise UserError(f"{what}: {e}") from None


def _null_accuracy(y, groups, config) -> float:
    """What the probe scores on the same folds without information (one constant feature): the chance the
    depth-0 leakage check compares with. 1/K on balanced labels (every built-in task); on a K > 2 file with
    unbalanced classes the balanced probe's tie goes to the first class, which scores that class's share."""
    return _score_depths(np.zeros((len(y), 1, 1)), y, groups, config, "chance")[0].accuracy


@cli_entry
def main(argv=None):
    args = parse_args(argv)
    t0 = time.perf_counter()
    from common.distributed import env_place

    env_place()  # torchrun's environment, checked before any loading
    from tasks.custom import resolve_task

    # built-in name, .jsonl file or module:function (its code is imported by source.load(), after every other
    # check); UserError if bad
    source = resolve_task(args.task)
    # A JSONL file is used whole unless --n-pairs is given; generated tasks default to DEFAULT_N_PAIRS.
    n_pairs = args.n_pairs if args.n_pairs is not None else (None if source.fixed else DEFAULT_N_PAIRS)
    requested = _parse_modes(args.modes)  # canonical once, here; the default depends on the model
    from engine.modes import RECIRC_PREFIX, canonical_modes, parse_mode

    # syntax and alpha checked before any loading; depths once the model is known
    recirc = canonical_modes([RECIRC_PREFIX + r for r in args.recirculate]) if args.recirculate else []
    if args.distractors is not None:  # the syntax now; the task's own bounds once it is loaded
        int_list(args.distractors, "--distractors", 0, MAX_DISTRACTORS)
    # Output locations are checked before any work (an explicit --out now; the default once the model is named).
    out_arg = output_dir(args.out, "--out") if args.out is not None else None
    if args.cache_dir is not None and str(args.cache_dir).strip() == "":
        raise UserError("--cache-dir is empty: give a directory")
    # like every output, under the current directory (or $FBPROBE_CACHE), never inside the installed package
    env = os.environ.get("FBPROBE_CACHE")
    if env is not None and env.strip() == "":  # Path("") is the current directory: ./activations
        raise UserError("FBPROBE_CACHE is set but empty: unset it or give a directory")
    default_cache = Path(env if env is not None else Path.cwd() / ".cache") / "activations"
    cache_dir = default_cache if args.cache_dir is None else Path(args.cache_dir)
    if not args.no_cache:
        output_dir(cache_dir, "--cache-dir")
    elif args.cache_dir is not None:
        raise UserError("--cache-dir names the activation cache, which --no-cache turns off: drop one of them")

    from stats.linear import ProbeConfig, check_groups
    from tasks import probe_labels, probe_target

    config = ProbeConfig(n_boot=args.n_boot, random_state=args.seed)
    placement = Placement.from_args(args)
    from models.tokenizers import resolve_tokenizer, tokenizer_source

    if args.tokenizer is not None:  # the name now (a folder or a preset); its files once the model is loaded
        tokenizer_source(args.tokenizer)
    from models.loading import load_model, model_dir

    model_dir(args.model)  # an unknown model is refused before a task's own code runs
    source.load()  # a module:function task's code runs from here on, every other argument checked
    task = source.name
    distractors = _parse_distractors(args.distractors, source)

    # Everything cheap is validated before the model is loaded or anything is written.
    datasets = {n: source.make(n_pairs, n, args.seed) for n in distractors}
    try:  # one target for every N (the pair roles where one N needs them); a user's task: its labels or refused
        roles = probe_target(datasets.values(), config.n_splits, roles_allowed=source.builtin)
    except UserError:
        roles = None if source.builtin else False  # the loop below refuses, naming the N
    for n in distractors:
        samples = datasets[n]
        groups = np.array([s.group_id for s in samples])
        n_groups = len(np.unique(groups))
        if n_groups < config.n_splits and n_pairs is not None:  # more pairs help, unless the task caps the groups
            more = source.make(4 * n_pairs, n, args.seed)  # at this N (its prompts repeat): then say so
            if len({s.group_id for s in more}) == n_groups:
                raise UserError(f"{task} N={n}: only {n_groups} distinct group(s) however many pairs (its prompts "
                                f"at this N repeat), and grouped cross-validation needs {config.n_splits}: use a "
                                "larger N")
        try:
            y = np.array(probe_labels(samples, config.n_splits, roles)[0])  # the labels, or the pair roles
            if task == "multi_register":
                for w in sorted({s.writes for s in samples}):
                    sel = np.array([s.writes == w for s in samples])
                    check_groups(y[sel], groups[sel], config.n_splits)
        except UserError as e:
            size = f"--n-pairs {n_pairs}" if n_pairs is not None else f"{len(samples) // 2} pairs"
            raise UserError(f"{task} N={n} with {size}: {e}") from None

    from models.fingerprint import config_hash, weights_hash
    from probes.collect import tokenization_hash

    model, tok, loaded_name = load_model(args.model, placement)
    # A path ending in '..' (or '.') names no folder: derive the name from the resolved path instead.
    model_name = safe_name(args.model if loaded_name in ("", ".", "..") else loaded_name)
    modes = requested if requested is not None else _default_modes(task, model.has_fusion)
    if not model.has_fusion:
        bad = [m for m in modes if parse_mode(m).has_feedback]
        if bad:
            raise UserError(f"model {model_name!r} has no fusion module, which {', '.join(bad)} need(s): its modes "
                            "are standard, recirculation (--recirculate S:D:A) and, for a looped model, loop-R")
    modes = canonical_modes(modes + recirc, model.n_layers)  # the canonical names every row is keyed by
    if args.fed_lens and not any(parse_mode(m).fed_top_source for m in modes):
        raise UserError(f"--fed-lens reads the state fed into T, and none of {', '.join(modes)} feeds one: add a "
                        "feedback mode or drop it")
    # the model's own tokenizer or --tokenizer's; a model without one is refused (models.tokenizers)
    tok = resolve_tokenizer(model, tok, args.model, args.tokenizer)
    # Tokenize every dataset now (shared final token, known words) and, for a custom task, check its label
    # words are single tokens of this tokenizer, before anything is collected or written.
    tokenized = {n: source.tokenize(datasets[n], tok) for n in distractors}
    try:
        # the lens reads these: after every N's prompts (a custom file's may end differently from one N to another)
        by_n = {n: source.label_token_ids(tok, prompt=datasets[n][0].text) for n in distractors}
        label_ids = by_n[distractors[0]]
        other = next((n for n in distractors if by_n[n] != label_ids), None)
        if other is not None:
            raise UserError(f"the label words are other tokens after the prompts of N={other} than after those of "
                            f"N={distractors[0]}")
        no_lens = None
    except UserError as e:
        if not source.builtin:  # a custom task's label words must be single tokens: refused as before
            raise
        label_ids, no_lens = None, str(e)  # e.g. a plain HF tokenizer that merges the label words: no lens
    if args.erase is not None:  # against each erased mode's own stack (loop-R: its unrolling)
        erased = [m for m in map(parse_mode, modes) if not m.is_recirculation]
        if not erased:  # a flag that would change nothing is refused, not dropped
            raise UserError("--erase runs the patching engine, which recirculation modes are not on: add a mode "
                            "such as standard, or drop the flag")
        for m in erased:
            if args.erase > m.depth(model):
                raise UserError(f"--erase {args.erase}: {m.name}'s depths are 0..{m.depth(model)}")
    w_hash = weights_hash(model)
    out = out_arg if out_arg is not None else output_dir(default_output(model_name, task), "--out")
    run_sig = {"task": task, "model": model_name, "weights": w_hash, "config": config_hash(model), "modes": modes,
               "distractors": distractors, "n_pairs": n_pairs, "seed": args.seed, "probe": config.to_dict(),
               "tokenizer": tokenization_hash(tok)}
    if not source.builtin:
        run_sig["task_source"] = source.describe()
    if not source.builtin and not source.fixed:  # a generator's code can change under its name: its data decides
        from tasks import dataset_fingerprint

        run_sig["datasets"] = {str(n): dataset_fingerprint(datasets[n]) for n in distractors}
    if args.erase is not None:  # only when used: a plain run keeps the signature of earlier plain runs
        run_sig["erase"] = args.erase
    if args.no_mdl:
        run_sig["mdl"] = False
    if args.fed_lens:  # only when used: a plain run keeps the signature of earlier plain runs
        run_sig["fed_lens"] = True
    if placement.dtype != "float32":  # only when used: a float32 run keeps the signature of earlier runs
        run_sig["dtype"] = placement.dtype
    from common.distributed import Processes

    # Every process checks the output (the same files, the same answer); under torchrun only rank 0 locks it,
    # scores and writes; the others collect their share of the batches and stop (common.distributed).
    _check_out_dir(out, run_sig, args.overwrite, args.save_activations)  # refuse early, before taking the lock ...
    procs = Processes.start(placement.torch_device.type)
    try:
        return _run(args, procs, out, run_sig, t0, task, source, model, tok, model_name, modes, distractors,
                    datasets, tokenized, label_ids, no_lens, config, cache_dir, w_hash, n_pairs, roles)
    finally:
        procs.end()


def _run(args, procs, out, run_sig, t0, task, source, model, tok, model_name, modes, distractors, datasets,
         tokenized, label_ids, no_lens, config, cache_dir, w_hash, n_pairs, roles):
    import contextlib

    import torch

    from common.io import DirLock
    from probes.collect import ActivationCache, Collector, collect_with_cache, save_activations
    from tasks import TASKS, probe_labels, prompt_prefix_tokens
    from tasks.samples import ANSWER_PROBE_LABEL, ROLE_PROBE_LABEL

    main_rank = procs.is_main
    with contextlib.ExitStack() as held:
        from common.io import remove_stale_tmp
        from common.staged import Staged

        def take_out():  # rank 0 alone; a refusal here is every process's (Processes.together)
            held.enter_context(DirLock(out))
            _check_out_dir(out, run_sig, args.overwrite, args.save_activations)  # again under the lock: another run may just have written
            remove_stale_tmp(out)  # temporaries of a killed earlier run (this process holds the lock)

        procs.together(take_out)
        torch.manual_seed(args.seed)
        collector = Collector(model, batch_size=args.batch_size, pad_id=tok.pad_token_id or 0,
                              progress=not args.no_progress and main_rank)
        cache = None if args.no_cache else ActivationCache(cache_dir)
        from tasks import copies_across_groups, dataset_fingerprint

        results, warnings, ds_meta, exports, fed_lens, erased = [], [], {}, [], [], []
        extra = MethodFields(model, label_ids, config, not args.no_mdl, no_lens)
        for n in distractors:
            ids, samples = tokenized[n]
            y = np.array(probe_labels(samples, config.n_splits, roles)[0])  # as main() checked: labels or pair roles
            answers = np.array([s.label for s in samples])  # what the logit lens reads (the label words' index)
            groups = np.array([s.group_id for s in samples])
            lengths = [len(r) for r in ids]
            copies = copies_across_groups(samples, ids)  # the inputs the model reads, not the texts
            ds_meta[str(n)] = {"fingerprint": dataset_fingerprint(samples), "n_samples": len(samples),
                               "n_pairs": len({s.pair_id for s in samples}),  # used (meta.run.n_pairs: asked)
                               "n_groups": int(len(np.unique(groups))), "min_tokens": min(lengths),
                               "max_tokens": max(lengths), "copies_across_groups": copies}
            acts, status = collect_with_cache(collector, ids, samples, modes, tok, cache, weights=w_hash,
                                              desc=f"{task} N={n}", procs=procs)
            if acts is None:  # not rank 0: its share is with rank 0 now
                continue
            if copies:
                msg = (f"{task} N={n}: {copies} of {len(samples)} samples have their exact text in another group, so "
                       "held-out scores include texts the probe was trained on (too few distinct prompts at this N)")
                warnings.append({"kind": "copies_across_groups", "task": task, "n_distractors": n,
                                 "count": copies, "message": msg})
                print(f"warning: {msg}", file=sys.stderr)
            if not args.no_progress:
                print(f"[{task} N={n}] activations: " + ", ".join(f"{m} {s}" for m, s in status.items()),
                      file=sys.stderr)

            for mode in modes:  # canonical names: acts, rows and exports are keyed by the same name
                a = acts[mode]
                scores = _score_depths(a, y, groups, config, f"{task} N={n} {mode}")
                results += extra.add(_result_rows(task, model_name, mode, n, scores), a, y, groups, answers)
                if args.fed_lens:  # one more prefill of this mode: opt-in
                    fed_lens += extra.fed_state(task, model_name, mode, n, ids, answers, groups,
                                                tok.pad_token_id or 0, args.batch_size)
                if args.erase is not None:
                    erased += extra.erased(task, model_name, mode, n, ids, samples, a, args.erase,
                                           args.batch_size, tok.pad_token_id or 0, y=y)
                if mode == "standard":
                    s0, null = scores[0], _null_accuracy(y, groups, config)
                    # the estimate itself equal to the no-information probe's: nothing leaked, whatever the CI
                    if s0.accuracy != null and not s0.ci_low <= null <= s0.ci_high:
                        msg = (f"LEAKAGE: standard-prefill depth-0 accuracy {s0.accuracy:.3f} "
                               f"(95% CI {s0.ci_low:.3f}..{s0.ci_high:.3f}) is not at chance ({null:.3f}) "
                               f"for {task} N={n}: all prompts end with the same token, so this is a bug")
                        warnings.append({"kind": "leakage", "task": task, "mode": mode, "n_distractors": n,
                                         "depth": 0, "accuracy": s0.accuracy, "ci_low": s0.ci_low,
                                         "ci_high": s0.ci_high, "chance": null, "message": msg})
                        bar = "!" * 100
                        print(f"{bar}\n{msg}\n{bar}", file=sys.stderr)
                if task == "multi_register":
                    for w in sorted({s.writes for s in samples}):
                        sel = np.array([s.writes == w for s in samples])
                        sc_w = _score_depths(a[sel], y[sel], groups[sel], config, f"{task} N={n} {mode} writes={w}")
                        results += extra.add(_result_rows(task, model_name, mode, n, sc_w, writes=w), a[sel],
                                             y[sel], groups[sel], answers[sel])
                if args.save_activations:
                    exports.append((f"N{n}_{mode}", a, samples, {"model": model_name, "task": task, "mode": mode,
                                                                 "n_distractors": n, "seed": args.seed}))

        meta = {
            "schema": SCHEMA,
            "run": run_sig,
            "model": {"name": model_name, "path": str(args.model), "n_layers": model.n_layers,
                      "d_model": model.d_model, "fusion": model.has_fusion, "weights_sha256": w_hash},
            "datasets": ds_meta,
            "tokenizer_sha256": run_sig["tokenizer"],
            "prompt_prefix": prompt_prefix_tokens(tok),
            "versions": _versions(),
            "seed": args.seed,
            "probe": config.to_dict(),
            "depths": "0 = input of block 0 (embedding or fused input); "
                      "l = output of 0-based block l - 1, the input of block l (L before the final norm)",
            "warnings": warnings,
            "wall_time_s": None,
        }
        probe_label = ROLE_PROBE_LABEL if roles else ANSWER_PROBE_LABEL  # what the probes fit, at every N
        if task not in TASKS:  # the three original tasks' probes.json keep their exact earlier form
            meta["labels"] = {"words": list(source.label_words), "n_classes": source.n_classes,
                              "chance": source.chance}
            if probe_label != ANSWER_PROBE_LABEL:  # the probes fit the pair role (tasks.probe_labels): binary
                meta["labels"].update(probe_label=probe_label, probe_chance=0.5)
        meta.update(extra.meta(args.erase))
        if args.erase is not None:  # the erased curve runs the patching engine, which recirculation modes are not on
            from engine.modes import parse_mode

            meta["erase"]["skipped_modes"] = [m for m in modes if parse_mode(m).is_recirculation]
        meta["lens"] = {**meta["lens"], "fed_state_enabled": bool(args.fed_lens and no_lens is None)}  # a copy
        spec = getattr(model, "spec", None)
        if spec is not None and hasattr(model, "iterations"):  # a looped model: the iteration axis of every depth
            from engine.modes import parse_mode
            from models.looped import site_of

            meta["loop"] = spec.to_dict()
            for row in results:
                m = parse_mode(row["mode"])
                row["loop"] = site_of(spec, m.loop_iterations or spec.iterations, row["depth"])
        doc = {"meta": meta, "results": results, "fed_state_lens": fed_lens}
        if args.erase is not None:
            doc["erased"] = erased
        if not main_rank:
            return 0
        if procs.world > 1:
            meta["processes"] = procs.world  # the results are those of one process (the same batches)

        from common.plotlyjs import stage_plotly_js
        from probes.depth_curves import render_html

        # Every new file goes to a temporary first; the old run's files are replaced (and an old activations/ of a
        # run without --save-activations removed) only once all new ones are complete. probes.json goes last.
        with Staged(out) as st:
            if exports:
                adir = st.dir("activations")
                for stem, a, samples, m in exports:
                    save_activations(adir, stem, a, samples, m)
            stage_plotly_js(st)  # one plotly.min.js per folder (shared with causal_report.html), before the page
            st.file("depth_curves.html", render_html(doc))
            meta["wall_time_s"] = round(time.perf_counter() - t0, 3)
            st.file("probes.json", _json_dumps(doc))
            st.commit(remove=OUTPUTS)
        _print_summary(doc, out)
        return 0


def _print_summary(doc, out):
    rows = [r for r in doc["results"] if r["depth"] == 0 and r["writes"] is None]
    print(f"depth-0 accuracy ({doc['meta']['run']['task']}, {doc['meta']['model']['name']}):")
    for r in rows:
        print(f"  {r['mode']:>15s} N={r['n_distractors']:<4d} acc {r['accuracy']:.3f} "
              f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}] control {r['control_accuracy']:.3f}")
    if doc["meta"]["warnings"]:
        kinds = sorted({w["kind"] for w in doc["meta"]["warnings"]})
        print(f"WARNING: {len(doc['meta']['warnings'])} warning(s) ({', '.join(kinds)}), see meta.warnings")
    print(f"wrote {out / 'probes.json'} and {out / 'depth_curves.html'} in {doc['meta']['wall_time_s']:.1f}s")


if __name__ == "__main__":
    main()
