"""Gain decomposition: where does the full-bandwidth model's accuracy come from?

    python -m analysis.gains --fbt tiny-fbt --std tiny-std

Per task and N, accuracy and label loss (-log p(label)) of
    baseline        the standard model (trained 1-pass), standard decoding
    fbt / std       the full-bandwidth model decoded WITHOUT feedback (training effect alone)
    fbt / soft      with feedback during decoding (recurrent-1 at the final prompt token)
    fbt / fused     fused-1 prefill, then feedback
Writes gains.json and gains.html (grouped bars) under --out.
"""
from __future__ import annotations

import time

from common.cli import (Parser, add_output_flags, add_plotly_flag, add_progress_flag, add_task_flags,
                        add_tokenizer_flag, int_in, int_list, output_dir)
from common.errors import UserError, cli_entry
from common.io import fresh_output, json_text
from common.paths import figures_dir
from common.plotlyjs import include_plotlyjs, stage_plotly_js
from common.staged import Staged
from analysis.evaluate import EVAL_SEED, MAX_PAIRS, evaluate, parse_tasks
from models.loading import load_model
from probes.depth_curves import PALETTE
from tasks import ALL_TASKS, TASKS

MAX_DISTRACTORS = 1024  # gains runs the full-width modes too: quadratic in the prompt

ARMS = (("baseline", "std_model", "std"), ("fbt/std", "fbt_model", "std"), ("fbt/soft", "fbt_model", "soft"),
        ("fbt/fused", "fbt_model", "fused"))
ARM_COLORS = {arm: PALETTE[i] for i, (arm, *_) in enumerate(ARMS)}  # one colour per arm, on every panel


def figure(rows):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig = make_subplots(rows=2, cols=len(tasks), subplot_titles=[f"{t}: accuracy" for t in tasks] +
                        [f"{t}: label loss" for t in tasks], shared_yaxes=False)
    for arm, *_ in ARMS:  # an arm: one legend entry, one colour, one legend group on all 2 x len(tasks) panels
        for j, t in enumerate(tasks):
            rs = [r for r in rows if r["task"] == t and r["arm"] == arm]
            x = [f"N={r['n_distractors']}" for r in rs]
            for i, key in enumerate(("accuracy", "label_loss")):
                fig.add_trace(go.Bar(x=x, y=[r[key] for r in rs], name=arm, legendgroup=arm,
                                     marker=dict(color=ARM_COLORS[arm]), showlegend=(i == 0 and j == 0),
                                     hovertemplate=f"{arm}<br>%{{x}}<br>{key}=%{{y:.3f}}<br>n={rs[0]['n_samples'] if rs else 0}"),
                              row=i + 1, col=j + 1)
    fig.update_layout(barmode="group", title="Gain decomposition: training with feedback vs using it",
                      height=700, width=420 * len(tasks))
    return fig


OUTPUTS = ("gains.json", "gains.html")


@cli_entry
def main(argv=None):
    p = Parser(prog="python -m analysis.gains", description=__doc__)
    p.add_argument("--fbt", default="tiny-fbt", help="full-bandwidth model: a shipped preset's name or a checkpoint "
                                                     "directory (default tiny-fbt)")
    p.add_argument("--std", default="tiny-std", help="standard baseline model: a shipped preset's name or a "
                                                     "checkpoint directory (default tiny-std)")
    add_task_flags(p, ALL_TASKS, ",".join(TASKS), several=True, custom=False)
    p.add_argument("--distractors", default="0,8,32,128",
                   help=f"comma-separated N, each in 0..{MAX_DISTRACTORS} (default 0,8,32,128)")
    p.add_argument("--n-pairs", type=int_in(1, MAX_PAIRS), default=50,
                   help=f"pairs per task and N, 1..{MAX_PAIRS} (default 50)")
    add_output_flags(p, "./figures/gains under the current directory")
    add_plotly_flag(p)
    add_progress_flag(p)
    add_tokenizer_flag(p)
    a = p.parse_args(argv)
    from models.tokenizers import resolve_tokenizer, tokenizer_source

    if a.tokenizer is not None:
        tokenizer_source(a.tokenizer)
    # --- everything that can be refused is checked before any model loads
    for flag in ("fbt", "std"):
        if not getattr(a, flag).strip():
            raise UserError(f"--{flag} is empty")
    ns = int_list(a.distractors, "--distractors", 0, MAX_DISTRACTORS)
    try:
        tasks = parse_tasks(a.tasks, ns)
    except UserError as e:  # say where the N came from when the user never gave one
        if a.distractors == p.get_default("distractors") and "got N = 0" in str(e):
            raise UserError(f"{e} (from the default --distractors {a.distractors}: give N >= 1, e.g. "
                            "--distractors 8,32,128)") from None
        raise
    out = output_dir(a.out if a.out is not None else figures_dir("gains"))

    with fresh_output(out, OUTPUTS, a.overwrite, "analysis.gains run",
                      f"{out} already holds gains results; pass --overwrite or another --out"):
        t0 = time.time()
        fbt, fbt_tok, _ = load_model(a.fbt)
        if not fbt.has_fusion:
            raise UserError(f"--fbt {a.fbt} has no fusion module")
        std, std_tok, _ = load_model(a.std)
        fbt_tok = resolve_tokenizer(fbt, fbt_tok, a.fbt, a.tokenizer)  # its own or --tokenizer's; none: refused
        std_tok = resolve_tokenizer(std, std_tok, a.std, a.tokenizer)
        ev_fbt = evaluate(fbt, fbt_tok, tasks, ns, ["std", "soft", "fused"], 0, a.n_pairs,
                          progress=not a.no_progress)
        ev_std = evaluate(std, std_tok, tasks, ns, ["std"], 0, a.n_pairs, progress=not a.no_progress)
        rows = []
        for arm, which, mode in ARMS:
            src = ev_std if which == "std_model" else ev_fbt
            rows += [{**r, "arm": arm} for r in src if r["mode"] == mode]
        rows.sort(key=lambda r: (tasks.index(r["task"]), r["n_distractors"], [a_[0] for a_ in ARMS].index(r["arm"])))
        from models.fingerprint import weights_hash
        from tasks import prompt_prefix_tokens

        # which tensors answered, read through which tokenizer (null: each model's own), starting how
        doc = {"meta": {"fbt": a.fbt, "std": a.std, "tasks": tasks, "n_distractors": ns, "n_pairs": a.n_pairs,
                        "seed": EVAL_SEED, "wall_s": round(time.time() - t0, 1), "tokenizer": a.tokenizer,
                        "weights_sha256": {"fbt": weights_hash(fbt), "std": weights_hash(std)},
                        "prompt_prefix": {"fbt": prompt_prefix_tokens(fbt_tok), "std": prompt_prefix_tokens(std_tok)}},
               "results": rows}
        text = json_text(doc)
        fig = figure(rows)
        with Staged(out) as st:  # the page and its JSON replace an earlier run's together, once both are whole
            stage_plotly_js(st, a.plotly)  # before the page: it never references a missing plotly.min.js
            st.file("gains.html", fig.to_html(include_plotlyjs=include_plotlyjs(a.plotly), full_html=True))
            st.file("gains.json", text)
            st.commit()
    print(f"{'task':15s} {'N':>4s} " + " ".join(f"{arm:>20s}" for arm, *_ in ARMS))
    for t in tasks:
        for n in ns:
            rs = {r["arm"]: r for r in rows if r["task"] == t and r["n_distractors"] == n}
            print(f"{t:15s} {n:4d} " + " ".join(
                f"{rs[arm]['accuracy']:8.3f} / {rs[arm]['label_loss']:8.3f}  " for arm, *_ in ARMS))
    print("(accuracy / label loss)")
    print(f"wrote {out}/gains.json and gains.html")


if __name__ == "__main__":
    main()
