"""Label accuracy (and label loss, -log p(label)) of a model per task x decoding/prefill mode x N.

    python -m analysis.evaluate --model tiny-fbt
    python -m analysis.evaluate --model checkpoints/tiny-std --modes std --distractors 0,8

Accuracy = greedy (full-vocabulary argmax) next token at the final prompt position equals the label word (any
number K of label words); ``ci_low`` / ``ci_high`` = its 95% Wilson score interval over the cell's samples
(treated as independent draws; the interval never collapses at 0 or 1).
--tasks takes built-in tasks (default the three probing tasks; also parity and shell_game, whose default
N are 4..256: they need N >= 1 update lines; and the language tasks induction, ioi, lookup and binding for
pretrained LMs, each with its own N: tasks.language), JSONL samples files and package.module:function
generators (docs/tasks.md).
Decoding modes reduce to a prefill for the first generated token: std = standard prefill, soft = recurrent-1
(the last prompt token is fed like a decoding step, fused with h_{T-1}), fused = fused-1.
`fused-1..K` evaluates every fused-k for k = 1..K in one Jacobi run and reports each k.
"""
from __future__ import annotations

import math
import re
import time

import torch
from tqdm import tqdm

from common.cli import (Parser, add_device_flags, add_model_flag, add_output_flags, add_progress_flag, add_seed_flag,
                        add_task_flags, add_tokenizer_flag, int_in, int_list, output_dir, output_file, safe_name)
from common.errors import UserError, cli_entry
from common.io import DirLock, atomic_write, json_text
from common.paths import figures_dir
from engine.modes import DECODINGS, EVAL_MODES, MAX_FUSED_PASSES, MAX_LOOP_ITERATIONS, parse_mode
from engine.inputs import model_context
from engine.prefill import fused_trajectory, pad_left, prefill_many
from engine.result import require_finite
from common.placement import Placement
from models.loading import load_model, model_dir
from tasks import ALL_TASKS, DISTRACTOR_COUNTS, TASKS, TRACKING_TASKS
from tasks.language import LANGUAGE_DISTRACTORS
from tasks.custom import TaskSource, resolve_task

DEFAULT_MODES = EVAL_MODES
EVAL_SEED = 424242  # disjoint from the training seeds' streams
TRACKING_DISTRACTORS = (4, 8, 16, 32, 64, 128, 256)  # default N of parity / shell_game (N = 0 is invalid)
DEFAULT_N_PAIRS = 50
Z95 = 1.959963984540054  # two-sided 95% normal quantile


# Size bounds shared by the evaluation CLIs (checked when the arguments are parsed, before any model loads).
MAX_PAIRS = 5000  # --n-pairs: 2 samples per pair
# --distractors: lines per prompt. A windowed model runs 64x its trained N in linear time under standard, loop-R and
# recurrent modes (chunked over a window cache); fused-n, the fused-1..K sweep and loop-R:TOL run full-width passes,
# whose memory grows with N^2 (1.2 GB at N = 2048, 3.0 GB at 4096 for tiny-fbt-track at batch 2).
MAX_DISTRACTORS = 16384
MAX_BATCH = 4096  # --batch-size
_SWEEP_RE = re.compile(r"^fused-1\.\.(\d+)$")


def mode_key(mode: str) -> str:
    """The canonical prefill mode of a decoding or prefill mode name (std = standard = fused-0 = recurrent-0)."""
    return parse_mode(mode).name


def _display(mode: str) -> str:
    """Row name of a mode: a decoding keeps its name (std / soft / fused), a prefill mode its canonical one."""
    return mode if mode in DECODINGS else mode_key(mode)


def _plan(modes, sweep: int) -> dict[str, str]:
    """canonical prefill mode -> row name, one per distinct computation (first spelling wins); a single
    fused-k that the fused-1..K sweep already reports under the same row name is left to the sweep."""
    swept = {f"fused-{k}" for k in range(1, sweep + 1)}
    plan: dict[str, str] = {}
    for m in modes:
        name = _display(m)
        if name not in swept:
            plan.setdefault(mode_key(m), name)
    return plan


def parse_modes(spec: str, has_fusion: bool = True) -> tuple[list[str], int]:
    """-> (distinct single modes by row name, K of a fused-1..K sweep or 0).

    Aliases of one computation (std, standard, fused-0, recurrent-0; soft, recurrent-1; fused, fused-1) are one
    mode: the first spelling names its rows. Several sweeps: the longest (it reports every shorter one).
    """
    modes, sweep = [], 0
    for m in [x.strip() for x in str(spec).split(",") if x.strip()]:
        if m.startswith("fused-1.."):
            hit = _SWEEP_RE.match(m)
            if not hit:
                raise UserError(f"bad sweep {m!r}: use fused-1..K")
            k = int(hit.group(1))
            if not 1 <= k <= MAX_FUSED_PASSES:
                raise UserError(f"bad sweep {m!r}: K must be in 1..{MAX_FUSED_PASSES}")
            sweep = max(sweep, k)
            continue
        modes.append(m)
    modes = list(_plan(modes, sweep).values())  # validates every mode name
    if not has_fusion:
        dropped = [m for m in modes if parse_mode(m).has_feedback]
        if dropped or sweep:
            print(f"note: model has no fusion module; skipping {', '.join(dropped + (['fused sweep'] if sweep else []))}")
        modes, sweep = [m for m in modes if m not in dropped], 0
    if not modes and not sweep:
        raise UserError("no modes to evaluate")
    return modes, sweep


def parse_tasks(spec: str, ns=()) -> list[str]:
    """'completion,parity' -> list of built-in task names (UserError on an unknown one, or on N = 0 in `ns`
    for a tracking task: a pair differs in one of its update lines)."""
    tasks = [t.strip() for t in spec.split(",") if t.strip()]
    for t in tasks:
        if t not in ALL_TASKS:
            raise UserError(f"unknown task {t!r} (known: {', '.join(ALL_TASKS)})")
        if t in TRACKING_TASKS and any(n < 1 for n in ns):
            raise UserError(f"task {t} needs N >= 1 update line (a pair differs in one of them); got N = 0")
    if not tasks:
        raise UserError("no tasks given")
    return list(dict.fromkeys(tasks))


def resolve_tasks(spec: str, load: bool = True) -> list[TaskSource]:
    """'completion,parity,my.jsonl,pkg.mod:f' -> TaskSources (tasks.custom.resolve_task; UserError if bad).

    ``load=False``: a module:function task's code is not imported yet; ``load_tasks`` does it, and checks names."""
    items = list(dict.fromkeys(t.strip() for t in str(spec).split(",") if t.strip()))
    if not items:
        raise UserError("no tasks given")
    out = []
    for t in items:
        try:
            out.append(resolve_task(t))
        except UserError as e:
            if t in ALL_TASKS or "unknown task" not in str(e):
                raise
            raise UserError(f"unknown task {t!r} (known: {', '.join(ALL_TASKS)}, a .jsonl samples file or "
                            "package.module:function)") from None
    return load_tasks(out) if load else out


def load_tasks(sources: list[TaskSource]) -> list[TaskSource]:
    """Load every task (a module:function task's code runs here) and refuse two of the same name."""
    for s in sources:
        s.load()
    names = [s.name for s in sources]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UserError(f"two --tasks have the same name {dup[0]!r}")
    return sources


def default_distractors(source: TaskSource) -> list[int]:
    """N values a task is evaluated at by default: 0,8,32,128,256; tracking tasks 4..256; the language tasks their
    own (tasks.language.LANGUAGE_DISTRACTORS); a JSONL file's own."""
    if source.builtin:
        if source.default_distractors:
            return list(source.default_distractors)
        return list(TRACKING_DISTRACTORS if source.task in TRACKING_TASKS else DISTRACTOR_COUNTS)
    return list(source.default_distractors or DISTRACTOR_COUNTS)


def distractors_for(sources, spec: str | None) -> dict[str, list[int]]:
    """--distractors (None: each task's default) -> {task name: N values}; a tracking task asked N = 0 is refused."""
    if spec is None:
        return {s.name: default_distractors(s) for s in sources}
    ns = int_list(spec, "--distractors", 0, MAX_DISTRACTORS)
    for s in sources:
        low = [n for n in ns if n < s.min_distractors]
        if low:
            why = ("" if s.name in LANGUAGE_DISTRACTORS else  # the language tasks' N is their own (tasks.language)
                   " update line(s) (a pair differs in one of them)")
            raise UserError(f"task {s.name} needs N >= {s.min_distractors}{why}, but --distractors has {low[0]}; drop "
                            f"it or evaluate {s.name} separately (its default: "
                            f"{','.join(map(str, default_distractors(s)))})")
    return {s.name: list(ns) for s in sources}


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of k successes in n trials (95% by default)."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    lo, hi = max(0.0, mid - half), min(1.0, mid + half)
    return (0.0 if k == 0 else lo), (1.0 if k == n else hi)  # exact ends (no 0.9999999999999999)


def make_jobs(sources, ns, n_pairs, tok=None, seed: int = EVAL_SEED) -> list[tuple]:
    """Every (task, N) dataset, made (and with ``tok`` tokenized, label words checked) before any forward.

    -> [(source, n, samples)] or, with ``tok``, [(source, n, token ids, samples, label token ids)].
    ``ns``: one list for every task or {task name: list}; ``n_pairs`` None = a JSONL file whole (generated
    tasks: DEFAULT_N_PAIRS); ``seed``: the datasets' seed (default the fixed evaluation seed).
    """
    jobs = []
    for src in sources:
        for n in (ns[src.name] if isinstance(ns, dict) else ns):
            k = n_pairs if n_pairs is not None or src.fixed else DEFAULT_N_PAIRS
            samples = src.make(k, n, seed)
            if tok is None:
                jobs.append((src, n, samples))
                continue
            seqs, samples = src.tokenize(samples, tok)
            words = src.label_token_ids(tok) if src.builtin else src.label_token_ids(tok, prompt=samples[0].text)
            jobs.append((src, n, seqs, samples, words))
    return jobs


@torch.no_grad()
def evaluate(model, tok, tasks, ns, modes, sweep, n_pairs, batch_size=64, progress=True,
             seed: int = EVAL_SEED) -> list[dict]:
    """Rows per task x N x mode; aliases of one mode are computed once, under the first spelling's name.

    ``tasks``: names or tasks.custom.TaskSource; ``ns``: N values for every task or {task name: N values};
    ``seed``: the datasets' seed (default the fixed evaluation seed EVAL_SEED).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    plan = _plan(modes, sweep)  # canonical prefill mode -> row name
    modes = list(plan.values())
    rows = []
    sources = [t if isinstance(t, TaskSource) else resolve_task(t) for t in tasks]
    jobs = make_jobs(sources, ns, n_pairs, tok, seed)  # every dataset validated before the first forward
    ctx = model_context(model)  # a prompt past it is refused now, not after the shorter N's forwards
    for src, n, seqs, _, _ in jobs:
        longest = max(map(len, seqs), default=0)
        if ctx is not None and longest > ctx:
            raise UserError(f"{src.name} N={n}: prompt of {longest} tokens is longer than the model's context ({ctx})")
    for src, n, seqs, samples, words in tqdm(jobs, disable=not progress, desc="evaluate"):
        task = src.name
        labels = torch.tensor([words[s.label] for s in samples])
        correct = {m: 0 for m in modes}
        nll = {m: 0.0 for m in modes}
        iters: dict[str, list] = {}  # loop-R:TOL: the iterations each prompt ran
        sweep_correct, sweep_nll = torch.zeros(sweep + 1), torch.zeros(sweep + 1)
        for i in range(0, len(seqs), batch_size):
            ids, mask = pad_left(seqs[i:i + batch_size], tok.pad_token_id)
            y = labels[i:i + batch_size]
            res = prefill_many(model, ids, mask, list(plan), collect=False, chunked=True)  # keyed by canonical mode
            for key, m in plan.items():
                logits = res[key].logits[:, 0].float().cpu()  # [batch, vocab]
                require_finite(logits, f"{task} N={n} {m}")
                correct[m] += int((logits.argmax(-1) == y).sum())
                nll[m] += float(-logits.log_softmax(-1).gather(1, y[:, None]).sum())
                if res[key].iterations is not None:
                    iters.setdefault(m, []).extend(res[key].iterations.tolist())
            if sweep:
                lg = fused_trajectory(model, ids, mask, sweep).logits[:, :, 0].float().cpu()  # [passes+1, batch, vocab]
                require_finite(lg.transpose(0, 1), f"{task} N={n} fused passes 0..{sweep}")
                sweep_correct += (lg.argmax(-1) == y[None]).sum(-1).float()
                sweep_nll += -lg.log_softmax(-1).gather(2, y[None, :, None].expand(lg.shape[0], -1, 1)).sum((1, 2))
        total = len(samples)
        base = {"task": task, "n_distractors": n, "n_samples": total,
                "mean_tokens": sum(s.n_tokens for s in samples) / total}
        ci = lambda k: dict(zip(("ci_low", "ci_high"), wilson_interval(int(k), total)))  # noqa: E731
        rows += [{**base, "mode": m, "accuracy": correct[m] / total, **ci(correct[m]), "label_loss": nll[m] / total,
                  **({"mean_iterations": sum(iters[m]) / len(iters[m]), "max_iterations": max(iters[m])}
                     if m in iters else {})}
                 for m in modes]
        rows += [{**base, "mode": f"fused-{k}", "accuracy": float(sweep_correct[k]) / total,
                  **ci(round(float(sweep_correct[k]))), "label_loss": float(sweep_nll[k]) / total}
                 for k in range(1, sweep + 1)]
    return rows


def table(rows, sweep) -> str:
    show = lambda m: not (m.startswith("fused-") and m != "fused-1" and sweep)  # noqa: E731
    modes = list(dict.fromkeys(r["mode"] for r in rows if show(r["mode"])))
    head = f"{'task':15s} {'N':>4s} " + " ".join(f"{m:>14s}" for m in modes)
    if sweep:
        head += f" {'min fused-1..' + str(sweep):>16s}"
    lines = [head]
    keys = list(dict.fromkeys((r["task"], r["n_distractors"]) for r in rows))
    for t, n in keys:
        rs = {r["mode"]: r["accuracy"] for r in rows if r["task"] == t and r["n_distractors"] == n}
        line = f"{t:15s} {n:4d} " + " ".join(f"{rs[m]:14.3f}" for m in modes)
        if sweep:
            line += f" {min(rs[f'fused-{k}'] for k in range(1, sweep + 1)):16.3f}"
        lines.append(line)
    return "\n".join(lines)


@cli_entry
def main(argv=None):
    p = Parser(prog="python -m analysis.evaluate", description=__doc__)
    add_model_flag(p, "tiny-fbt")
    add_task_flags(p, ALL_TASKS, ",".join(TASKS), several=True,
                   default_text=f"{','.join(TASKS)}, the three probing tasks")
    p.add_argument("--distractors", default=None,
                   help=f"comma-separated N, each in 0..{MAX_DISTRACTORS} (standard, loop-R and recurrent modes run "
                        "long prompts in linear time on a windowed model; fused-n, the fused sweep and loop-R:TOL in "
                        "full-width passes, whose memory grows with N^2) (default 0,8,32,128,256; parity and "
                        f"shell_game {','.join(map(str, TRACKING_DISTRACTORS))}; "
                        + "; ".join(f"{t} {','.join(map(str, ns))}" for t, ns in LANGUAGE_DISTRACTORS.items())
                        + "; a JSONL file: its own N values)")
    p.add_argument("--modes", "--mode", dest="modes", default=DEFAULT_MODES,
                   help=f"decoding (std, soft, fused) and prefill modes (recurrent-K, fused-N, loop-R, "
                        f"loop-R:TOL, recirc-S:D:ALPHA); fused-1..K sweeps k, K in 1..{MAX_FUSED_PASSES}; aliases "
                        f"(std = standard = fused-0) are evaluated once (default {DEFAULT_MODES}; a looped "
                        f"checkpoint: standard, its trained R iterations, and loop-2R, loop-4R)")
    p.add_argument("--n-pairs", type=int_in(1, MAX_PAIRS), default=None,
                   help=f"pairs per task and N, 1..{MAX_PAIRS} (default {DEFAULT_N_PAIRS} = {2 * DEFAULT_N_PAIRS} "
                        "samples; a JSONL file: all its pairs unless given)")
    p.add_argument("--batch-size", type=int_in(1, MAX_BATCH), default=64,
                   help=f"samples per forward batch, 1..{MAX_BATCH} (default 64)")
    add_seed_flag(p, "the evaluation datasets (another seed checks any number on fresh samples; recorded in "
                     "meta.seed, each dataset's fingerprint in meta.datasets)", EVAL_SEED,
                  default_text=f"{EVAL_SEED}, the fixed evaluation seed of the model cards")
    add_tokenizer_flag(p)
    add_output_flags(p, "./figures/<model name>/eval.json under the current directory; the shipped cards keep a "
                        "copy beside the checkpoint", kind="file", out_extra=": the JSON results")
    add_progress_flag(p)
    add_device_flags(p)
    a = p.parse_args(argv)
    # --- everything that can be refused is checked before the model loads
    placement = Placement.from_args(a)
    from models.tokenizers import resolve_tokenizer, tokenizer_source

    if a.tokenizer is not None:  # the name now (a folder or a preset); its files once the model is loaded
        tokenizer_source(a.tokenizer)
    tasks = resolve_tasks(a.tasks, load=False)  # a module:function task's code is imported below, after the checks
    if a.distractors is not None:  # the syntax now; each task's own bounds once it is loaded
        int_list(a.distractors, "--distractors", 0, MAX_DISTRACTORS)
    parse_modes(a.modes)  # syntax and bounds; the fusion check needs the model
    out = output_file(a.out if a.out is not None else figures_dir(safe_name(a.model), "eval.json"))
    if not out.exists():
        # output_file checks only the parent, which passes for a file directly under /proc: the creatable
        # check of the path itself (output_dir's) refuses it.
        output_dir(out)
    if out.exists() and not a.overwrite:
        raise UserError(f"{out} exists; pass --overwrite to replace it or --out elsewhere")
    # The output folder is locked for the whole run (common.io.DirLock): a second run into it is refused at once,
    # in one line, instead of computing for minutes and then replacing (with --overwrite) the first one's results.
    with DirLock(out.parent, "analysis.evaluate run"):
        model_dir(a.model)  # an unknown model is refused before a task's own code runs
        load_tasks(tasks)  # every other argument checked: a module:function task's code may run now
        ns = distractors_for(tasks, a.distractors)
        from tasks import dataset_fingerprint, prompt_prefix_tokens

        # every dataset can be made (the tokenizer checks need the model's); their fingerprints go into meta.datasets
        datasets = [{"task": src.name, "n_distractors": n, "n_samples": len(samples),
                     "n_pairs": len({s.pair_id for s in samples}), "fingerprint": dataset_fingerprint(samples)}
                    for src, n, samples in make_jobs(tasks, ns, a.n_pairs, seed=a.seed)]
        model, tok, name = load_model(a.model, placement)
        tok = resolve_tokenizer(model, tok, a.model, a.tokenizer)  # its own or --tokenizer's; none: refused
        spec = a.modes
        if spec == DEFAULT_MODES and getattr(model, "spec", None) is not None and hasattr(model, "iterations"):
            # a looped model (models.looped): its trained r (standard) and test-time scaling to 2r and 4r
            r = model.spec.iterations
            spec = ",".join(["standard"] + [f"loop-{k * r}" for k in (2, 4) if k * r <= MAX_LOOP_ITERATIONS])
            print(f"note: a looped model: modes {spec} (standard runs its trained {r} iterations)")
        modes, sweep = parse_modes(spec, model.has_fusion)
        t0 = time.time()
        rows = evaluate(model, tok, tasks, ns, modes, sweep, a.n_pairs, a.batch_size, not a.no_progress, seed=a.seed)
        wall = time.time() - t0
        print(table(rows, sweep))
        # the pairs asked of each generated task; a task file without --n-pairs is used whole (its datasets' n_pairs)
        asked = a.n_pairs if a.n_pairs is not None else (DEFAULT_N_PAIRS if any(not t.fixed for t in tasks) else None)
        from models.fingerprint import config_hash, weights_hash

        # which tensors under which config answered: one definition with probes.json and causal_report.json
        meta = {"model": a.model, "weights_sha256": weights_hash(model), "config_sha256": config_hash(model),
                "n_pairs": asked,
                "seed": a.seed, "modes": a.modes, "wall_s": round(wall, 1), "device": str(placement.torch_device),
                "dtype": placement.dtype, "prompt_prefix": prompt_prefix_tokens(tok),
                "ci": "ci_low/ci_high: 95% Wilson score interval of accuracy over the cell's n_samples, counted as "
                      "independent (a pair's two samples share their context: with pairs as the unit it is wider)"}
        meta["datasets"] = datasets
        if a.tokenizer is not None:
            meta["tokenizer"] = a.tokenizer
        custom = [s.describe() for s in tasks if not s.builtin]
        if custom:
            meta["custom_tasks"] = custom
        doc = {"meta": meta, "results": rows}
        text = json_text(doc)
        # The write is atomic; the exists check and the write are one step under the lock
        if out.exists() and not a.overwrite:
            raise UserError(f"{out} appeared while this run was working; pass --overwrite or --out elsewhere")
        for stale in out.parent.glob(f".{out.name}.*.tmp"):  # a killed earlier write's temporary
            stale.unlink(missing_ok=True)
        atomic_write(out, text)
        print(f"wrote {out} ({wall:.0f}s)")


if __name__ == "__main__":
    main()
