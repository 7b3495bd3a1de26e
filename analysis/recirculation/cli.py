"""`python -m analysis.recirculation`: the arguments, the run folder, and the experiments (a)-(g) in order.
The experiments and their outputs are described in analysis/recirculation/__init__.py."""
from __future__ import annotations

import dataclasses

import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from analysis.recirculation.basis import basis_test
from analysis.recirculation.cost import cost
from analysis.recirculation.dose import dose_response, heatmap, temperature
from analysis.recirculation.figures import mediation_figure, targeted_figure, write_figures
from analysis.recirculation.mediation import mediation, mediation_inputs
from analysis.recirculation.targeted import (DEFAULT_ALPHAS as TARGETED_ALPHAS, default_sd, parse_sd, targeted,
                                              targeted_inputs)
from analysis.recirculation.perplexity import TINY, Evaluator, load
from analysis.recirculation.study import Study
from analysis.recirculation.text import ByteTokenizer, builtin_documents, file_documents, make_splits
from common.cli import (DefaultsFormatter, Parser, ascii_int, add_device_flags, add_model_flag, add_output_flags,
                        add_plotly_flag, add_seed_flag, add_threads_flag, command_text, float_in, float_list,
                        given_flags, int_in, int_list, output_dir, refuse_idle_flags, safe_name)
from common.errors import UserError, cli_entry
from common.io import fresh_output, json_text
from common.paths import default_output
from common.placement import Placement
from common.plotlyjs import PLOTLY_JS, plotly_js_missing
from common.staged import Staged
from engine.recirculation import RecircSpec, parse_recirculate
from models.loading import model_dir

_PACKAGE_DOC = sys.modules["analysis.recirculation"].__doc__


def _pairs(s: str) -> list[tuple[int, int]]:
    out = []
    for part in s.split(","):
        try:
            a, b = part.split(":")
            pair = (ascii_int(a), ascii_int(b))
        except ValueError:
            raise UserError(f"--pairs: expected s:d[,s:d...], got {part!r}") from None
        RecircSpec(pair[0], pair[1], 0.1)  # s > d, d >= 0
        if pair not in out:  # a repeated pair is one heatmap cell
            out.append(pair)
    return out


def default_pairs(L: int) -> list[tuple[int, int]]:
    srcs = sorted({L, round(2 * L / 3), round(L / 3)})
    tgts = sorted({max(1, round(L / 15)), round(L / 4), round(L / 2)})
    return [(s, d) for s in srcs for d in tgts if s > d]


# Size bounds of the numeric flags, checked when the arguments are parsed (before anything loads).
MAX_SEQ_LEN = 4096
MAX_CHUNKS = 1000  # --n-tune / --n-test
MAX_BATCH = 1024
MAX_PASSES = 1000  # blockwise Jacobi passes of (e); passes >= the block size is already exact
MAX_PAIRS = 5000  # --mediation-pairs, --targeted-pairs
TEXT_BATCH, TASK_BATCH = 4, 50  # --batch defaults
MAX_DISTRACTORS = 1024
MAX_TEMP = 100.0
OUTPUTS = ("results.json", "heatmap.html", "dose.html", "temperature.html", "basis.html", "cost.html",
           "mediation.html", "targeted.html")


def parse_args(argv=None):
    p = Parser(prog="python -m analysis.recirculation", description=_PACKAGE_DOC.split("\n\n")[0],
               formatter_class=DefaultsFormatter)
    add_model_flag(p, "smollm2-135m", ", or tiny-random-qwen3 / tiny-random-gpt2 (random weights, smoke tests)")
    p.add_argument("--text", nargs="+", metavar="FILE",
                   help="English text files to use instead of the built-in CPython pydoc topics (one document "
                        "per file; with one file its first half tunes and the second half is held out)")
    add_output_flags(p, "./figures/<model>/recirculation under the current directory; with --mediation-only "
                        "./figures/<model>/mediation-<task>, with --targeted-only ./figures/<model>/targeted-<task>")
    add_plotly_flag(p)
    p.add_argument("--seq-len", type=int_in(3, MAX_SEQ_LEN), default=64,
                   help=f"tokens per chunk (one chunk = one sequence), 3..{MAX_SEQ_LEN}; perplexity scores the "
                        "prediction of every token after the first (column 0's prediction too, which no "
                        "recirculation reaches: at 2 tokens nothing could change)")
    p.add_argument("--n-tune", type=int_in(1, MAX_CHUNKS), default=4,
                   help=f"chunks in the tuning split, 1..{MAX_CHUNKS}")
    p.add_argument("--n-test", type=int_in(1, MAX_CHUNKS), default=4,
                   help=f"chunks in the held-out split, 1..{MAX_CHUNKS}")
    p.add_argument("--batch", type=int_in(1, MAX_BATCH), default=None,
                   help=f"chunks (text) or prompts (tasks: (f), (g)) per forward batch, 1..{MAX_BATCH} (default 4 "
                        f"chunks of text, {TASK_BATCH} task prompts: the prompts are short)")
    p.add_argument("--pairs", help="source:target depth pairs for the heatmap, comma-separated "
                                   "(default: a coarse 3x3 grid over L/3, 2L/3, L and ~L/15, L/4, L/2)")
    p.add_argument("--alpha", type=float_in(0, 1, lo_open=True), default=0.1,
                   help="alpha of the heatmap and of the mediation's tuned candidates, in (0, 1] (at 0 every cell "
                        "and candidate is the base model: a tie, nothing to pick)")
    p.add_argument("--alphas", default="0.05,0.1,0.2,0.4,1.0",
                   help="dose-response alphas, each in [0, 1] (0 is added); tuning picks the best on the tuning "
                        "split")
    p.add_argument("--fail", type=float_in(0), default=5.0,
                   help="failure point: the first alpha whose held-out perplexity change exceeds this many percent "
                        "(a finite number >= 0)")
    p.add_argument("--temps", default="0.8,0.9,0.95,1.0,1.05,1.1,1.2",
                   help=f"temperatures tried for (c), each in (0, {MAX_TEMP:g}]")
    p.add_argument("--small-angle", type=float_in(0, math.pi), default=0.1,
                   help="radians a typical vector is turned by the 'small rotation' of (d), in [0, pi]")
    p.add_argument("--passes", default="1,2", help=f"blockwise Jacobi passes compared in (e), each in 1..{MAX_PASSES}")
    p.add_argument("--cost-block", type=int_in(0, MAX_SEQ_LEN), default=0,
                   help=f"block size for blockwise in (e), 0..{MAX_SEQ_LEN}; 0 = whole chunk")
    p.add_argument("--ramp", type=int_in(0, MAX_SEQ_LEN), default=0,
                   help=f"early-token ramp length for every recirculated run, 0..{MAX_SEQ_LEN}")
    p.add_argument("--mediation", action="store_true", help="run the mediation experiment (f) as well")
    p.add_argument("--mediation-only", action="store_true",
                   help="run only (f), without the text experiments (for models trained on the tasks, e.g. "
                        "tiny-base, which solve them; results go to figures/<model>/mediation-<task>)")
    p.add_argument("--mediation-spec", metavar="S:D:ALPHA[:MODE]",
                   help="recirculation of (f); default: the text-tuned best, or with --mediation-only the pair and "
                        "mode (--pairs x convex/residual, at --alpha) whose full recirculation moves the label logit "
                        "difference most on the TRAINING groups")
    p.add_argument("--mediation-task", default="memory",
                   help="task of (f): a built-in task, a JSONL file or package.module:function (docs/tasks.md; K > 2 "
                        "label words, e.g. shell_game, use the span of the multiclass probe's class weights, rank "
                        "K - 1)")
    p.add_argument("--mediation-pairs", type=int_in(1, MAX_PAIRS), default=16,
                   help=f"sample pairs of (f) (half the groups held out), 1..{MAX_PAIRS}")
    p.add_argument("--mediation-distractors", type=int_in(0, MAX_DISTRACTORS), default=None,
                   help=f"distractor lines per prompt in (f), 0..{MAX_DISTRACTORS} (default 8; a task file: its "
                        "first N)")
    p.add_argument("--targeted", action="store_true",
                   help="run the targeted-vs-uniform experiment (g) as well: at each --targeted-alphas, "
                        "recirculation at every real column (uniform) vs at the key token's column only (targeted: "
                        "later tokens attend to its recirculated keys/values) vs none, on a task with key tokens")
    p.add_argument("--targeted-only", action="store_true",
                   help="run only (g), without the text experiments (results go to figures/<model>/targeted-<task>; "
                        "with --mediation, (f) runs too)")
    p.add_argument("--targeted-task", default="ioi",
                   help="task of (g): one with key tokens (tasks.key_token_positions): induction, ioi, lookup or "
                        "binding")
    p.add_argument("--targeted-pairs", type=int_in(1, MAX_PAIRS), default=100,
                   help=f"sample pairs of (g), 1..{MAX_PAIRS} (every sample is scored; CIs resample its groups)")
    p.add_argument("--targeted-distractors", type=int_in(0, MAX_DISTRACTORS), default=0,
                   help=f"distractors (the task's N) per prompt in (g), 0..{MAX_DISTRACTORS} (the task may bound "
                        "it further)")
    p.add_argument("--targeted-spec", metavar="S:D[:MODE]",
                   help="source and target depths (and mode, default residual) of (g); default 20:2:residual on "
                        "a model with >= 20 layers, else source round(2L/3) (at least 2, at most L) and target "
                        "max(1, round(L/15)) below it, residual (e.g. L = 12: 8:1:residual)")
    p.add_argument("--targeted-alphas", default=TARGETED_ALPHAS,
                   help="alphas of (g), each in [0, 1]; failure point: the first whose accuracy falls more than "
                        "0.05 below base")
    add_device_flags(p, device=False, device_map=False,
                     dtype_extra="; float16 is refused here: recirculation runs on the CPU only (its engine builds "
                                 "CPU index tensors, so there is no --device yet). Perplexities and KL are computed "
                                 "in float32 either way")
    add_threads_flag(p)
    add_seed_flag(p, "the split, the random rotations, the mediation and targeted samples and the bootstrap")
    a = p.parse_args(argv)
    a.given = given_flags(p, argv)  # the flags the line names: one whose experiment does not run is refused
    return a


# The flags of the text study (a)-(e) alone; --pairs / --alpha also give the mediation's candidates.
TEXT_STUDY = ("text", "seq_len", "n_tune", "n_test", "alphas", "fail", "temps", "small_angle", "passes", "cost_block")
MEDIATION = ("mediation_spec", "mediation_task", "mediation_pairs", "mediation_distractors")
TARGETED = ("targeted_task", "targeted_pairs", "targeted_distractors", "targeted_spec", "targeted_alphas")


def _refuse_idle(a) -> None:
    """A flag of an experiment this run does not run is refused (it was read and ignored)."""
    only = "--mediation-only" if a.mediation_only else "--targeted-only" if a.targeted_only else None
    run_f, run_g = a.mediation or a.mediation_only, a.targeted or a.targeted_only
    refuse_idle_flags(a.given, [
        (("mediation",), a.mediation_only, "--mediation-only runs the mediation experiment already"),
        (("targeted",), a.targeted_only, "--targeted-only runs the targeted experiment already"),
        (TEXT_STUDY, only is not None, f"{only} skips the text study they configure"),
        (("pairs", "alpha"), only is not None and not (run_f and not a.mediation_spec),
         "they give the text study's heatmap and the mediation's candidates, and this run has neither"),
        (MEDIATION, not run_f, "the mediation experiment runs only with --mediation or --mediation-only"),
        (TARGETED, not run_g, "the targeted experiment runs only with --targeted or --targeted-only"),
    ])


def _results_text(res: dict) -> str:
    try:
        return json_text(res, indent=2, default=str)
    except ValueError:
        raise UserError("the results contain NaN or inf (a diverged run?); refusing to write invalid JSON") from None


def _write_results(res: dict, out: Path, write_figures_) -> None:
    """The figures and results.json replace an earlier run's together, once every one is whole (common.staged):
    the figures are drawn into a temporary folder, then staged with results.json last (it marks a complete run);
    an earlier run's files this run did not write are removed at the commit, so the folder holds one run. Invalid
    JSON is refused first."""
    text = _results_text(res)  # checked before any file is touched
    with tempfile.TemporaryDirectory(prefix=".figures.", suffix=".tmp", dir=out) as tmp, Staged(out) as st:
        write_figures_(Path(tmp))
        drawn = sorted(Path(tmp).iterdir(), key=lambda p: (p.name != PLOTLY_JS, p.name))  # plotly.js first
        for p in drawn:
            if p.name != PLOTLY_JS or plotly_js_missing(out):  # the folder's own copy, when it is already right
                st.file(p.name, lambda dst, src=p: os.replace(src, dst))
        st.file("results.json", text)
        st.commit(remove=OUTPUTS)


@cli_entry
def main(argv=None):
    a = parse_args(argv)
    # --- everything that can be refused is checked before anything loads or any file is touched
    alphas = sorted({0.0} | set(float_list(a.alphas, "--alphas", 0, 1)))
    if len(alphas) < 2:  # alpha 0 is the base model, always run beside them: the dose curve needs a dose
        raise UserError("--alphas needs at least one alpha above 0 (alpha 0, the base model, is always included)")
    temps = sorted(set(float_list(a.temps, "--temps", 0, MAX_TEMP)) | {1.0})
    if any(t <= 0 for t in temps):
        raise UserError("--temps must be positive")
    passes_list = int_list(a.passes, "--passes", 1, MAX_PASSES)
    pairs = _pairs(a.pairs) if a.pairs is not None else None  # '' is refused there, not read as the default
    from tasks import ALL_TASKS, resolve_task
    try:  # a built-in task, a JSONL file or module:function (its code runs only once every other check passed)
        a.mediation_source = resolve_task(a.mediation_task)
    except UserError as e:
        raise UserError(f"--mediation-task: {e}") from None
    src = a.mediation_source
    if src.fixed:  # a task file: its own N values (known without running anything), checked before a model loads
        if a.mediation_distractors is None:
            a.mediation_distractors = src.default_distractors[0]
        elif a.mediation_distractors not in src.default_distractors:
            raise UserError(f"--mediation-distractors {a.mediation_distractors}: task file {src.spec} has N = "
                            f"{', '.join(map(str, src.default_distractors))}")
    elif a.mediation_distractors is None:
        a.mediation_distractors = 8
    if a.mediation_spec:
        parse_recirculate(a.mediation_spec)  # syntax and alpha now; the depths once the model is known
    if a.mediation_only and a.targeted_only:
        raise UserError("--mediation-only and --targeted-only exclude each other: pass one of them and --mediation "
                        "or --targeted for the other")
    _refuse_idle(a)
    a.targeted_alpha_list = sorted(set(float_list(a.targeted_alphas, "--targeted-alphas", 0, 1)))
    if a.targeted_spec:
        parse_sd(a.targeted_spec)  # syntax now; the depths once the model is known
    if (a.targeted or a.targeted_only) and a.targeted_task not in ALL_TASKS:
        raise UserError(f"--targeted-task: unknown task {a.targeted_task!r} (known: {', '.join(ALL_TASKS)})")
    placement = _placement(a.dtype)
    docs = file_documents(a.text) if a.text else None
    if a.mediation_only and not a.mediation_source.builtin and a.model not in TINY:
        model_dir(a.model)  # an unknown model is refused before a module:function task's code runs (its name)
    sub = (f"mediation-{safe_name(a.mediation_source.name)}" if a.mediation_only else
           f"targeted-{a.targeted_task}" if a.targeted_only else "recirculation")
    out = output_dir(a.out if a.out is not None else default_output(safe_name(a.model), sub))

    with fresh_output(out, OUTPUTS, a.overwrite, "analysis.recirculation run",
                      f"{out} already holds results: pass --overwrite to replace them"):
        return _run(a, argv, out, alphas, temps, passes_list, pairs, docs, placement)


def _placement(dtype: str) -> Placement:
    """The CPU placement of --dtype; float16 is refused (CPU half matmuls are slow or missing, and recirculation
    has no GPU path yet)."""
    if dtype == "float16":
        raise UserError("--dtype float16 needs a GPU, and recirculation runs on the CPU only (use bfloat16)")
    return Placement("cpu", dtype)


def _run(a, argv, out: Path, alphas, temps, passes_list, pairs, docs, placement: Placement):
    if a.threads:
        torch.set_num_threads(a.threads)

    model, tok, mname = load(a.model, placement)
    L = model.n_layers
    pairs = pairs or default_pairs(L)
    for s, d in pairs:
        RecircSpec(s, d, a.alpha).validate(L)
    med_spec = parse_recirculate(a.mediation_spec, L) if a.mediation_spec else None
    if med_spec is not None and a.ramp:  # --ramp applies to every recirculated run, the given spec's too
        med_spec = dataclasses.replace(med_spec, ramp=a.ramp)
    run_f, run_g = a.mediation or a.mediation_only, a.targeted or a.targeted_only
    tg_sd = parse_sd(a.targeted_spec or default_sd(L), L)
    for flag, on in (("--mediation", run_f), ("--targeted", run_g)):
        if on and isinstance(tok, ByteTokenizer):  # refused now, not after the text experiments
            raise UserError(f"{flag} needs a real tokenizer (not the byte stand-in of the tiny random models)")

    # (f) and (g)'s datasets now: a task the tokenizer cannot serve is refused before the text study, not after it
    med_inputs = (mediation_inputs(tok, a.mediation_source, a.mediation_pairs, a.mediation_distractors, a.seed)
                  if run_f else None)
    tg_inputs = targeted_inputs(tok, a.targeted_task, a.targeted_pairs, a.targeted_distractors, a.seed) if run_g else None

    def run_targeted():
        return targeted(model, tok, tg_sd, a.targeted_task, a.targeted_pairs, a.targeted_distractors,
                        a.targeted_alpha_list, a.batch or TASK_BATCH, a.seed, ramp=a.ramp, inputs=tg_inputs)

    if model.family.own_causal_bias and not (a.mediation_only or a.targeted_only):  # refused now, not at (e)
        raise UserError(f"the text study's cost section (e) runs blockwise recirculation, which "
                        f"{model.config.model_type} refuses (models.families: its attention's own causal bias); run "
                        "--mediation-only / --targeted-only, or interventions.run --mode recirc-S:D:A")
    command = command_text("python -m analysis.recirculation", argv)
    if a.mediation_only or a.targeted_only:
        t_start = time.perf_counter()
        res = {"model": mname, "dtype": placement.dtype, "n_layers": L, "d_model": model.d_model}
        if run_f:
            # Tuned over pairs x modes at the one --alpha: tuning alpha by effect size would just pick the most
            # destructive dose (alpha = 1 convex replaces z_d outright).
            cands = [med_spec] if med_spec else [RecircSpec(s, d, a.alpha, mode, ramp=a.ramp) for s, d in pairs
                                                 for mode in ("convex", "residual")]
            res["mediation"] = mediation(model, tok, cands, a.mediation_source, a.mediation_pairs,
                                         a.mediation_distractors, a.batch or TASK_BATCH, a.seed, inputs=med_inputs)
        if run_g:  # (g)
            res["targeted"] = run_targeted()
        res["seconds_total"] = time.perf_counter() - t_start
        res["command"] = command
        figs = [("mediation", mediation_figure), ("targeted", targeted_figure)]
        _write_results(res, out, lambda into: [f(res[k], into, a.plotly) for k, f in figs if k in res])
        print(f"wrote {out}/results.json and " + " and ".join(f"{k}.html" for k, _ in figs if k in res)
              + f" ({res['seconds_total']:.0f}s)")
        return res
    docs = docs or builtin_documents()
    tune, test = make_splits(docs, tok, a.seq_len, a.n_tune, a.n_test, a.seed)
    print(f"model {mname} ({placement.dtype}): L={L}, D={model.d_model}; {len(tune)}+{len(test)} chunks x "
          f"{a.seq_len} tokens; pairs {pairs}", flush=True)
    t_start = time.perf_counter()
    text_batch = a.batch or TEXT_BATCH
    st = Study(a, model, Evaluator(model, tune, text_batch, temps), Evaluator(model, test, text_batch, temps), pairs,
               alphas, temps, passes_list)
    st.res.update({"model": mname, "dtype": placement.dtype, "n_layers": L, "d_model": model.d_model,
                   "seq_len": a.seq_len, "n_tune_chunks": len(tune), "n_test_chunks": len(test),
                   "text": a.text or "pydoc_data.topics", "ramp": a.ramp,
                   "base": {"tune_ppl": st.E_tune.base.ppl, "test_ppl": st.E_test.base.ppl},
                   "mediation": "not run (pass --mediation)", "targeted": "not run (pass --targeted)"})
    best_mode, best_s, best_d = heatmap(st)  # (a)
    best_test = dose_response(st, best_mode, best_s, best_d)  # (b)
    best_spec = st.spec(best_s, best_d, st.res["best"]["alpha"], best_mode)
    temperature(st, best_spec, best_test)  # (c)
    basis_test(st, best_spec, best_test)  # (d)
    cost(st, best_spec)  # (e)
    res = st.res
    if a.mediation:  # (f)
        res["mediation"] = mediation(model, tok, [med_spec or best_spec], a.mediation_source, a.mediation_pairs,
                                     a.mediation_distractors, a.batch or TASK_BATCH, a.seed, inputs=med_inputs)
    if a.targeted:  # (g)
        res["targeted"] = run_targeted()
    res["seconds_total"] = time.perf_counter() - t_start
    res["command"] = command
    _write_results(res, out, lambda into: write_figures(res, into, a.plotly))
    print(f"wrote {out}/results.json and {len(list(out.glob('*.html')))} HTML figures ({res['seconds_total']:.0f}s)")
    return res


if __name__ == "__main__":  # `python -m analysis.recirculation.cli` = `python -m analysis.recirculation`
    main()
