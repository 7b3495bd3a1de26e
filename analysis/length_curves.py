"""Accuracy against the number of update lines N, per task, for several models and modes: the separation figure.

Input: eval.json documents written by ``python -m analysis.evaluate`` (rows: task, n_distractors, mode, accuracy,
n_samples, optional ci_low / ci_high). One panel per task, x = N (log2 axis), y = label accuracy, one line per
(model, mode) with its 95% CI as a band where the rows carry one, and the chance line at 1/K.

The page uses a fixed div id, so the same inputs always give the same page. plotly.js (``--plotly``): by default
``plotly.min.js`` is written once beside the page (replaced only when it differs from the installed plotly's) and
the page loads it from there (offline); ``inline`` embeds it (4.8 MB), ``cdn`` loads it from cdn.plot.ly.
``--png`` renders the figure with headless Chromium (probes.depth_curves.html_to_png) from a temporary
self-contained page. Default output: ./figures/length_curves.html under the current directory.

    python -m analysis.length_curves checkpoints/tiny-fbt-track/eval.json checkpoints/tiny-std-track/eval.json \\
        --modes std,fused-30,recurrent-full --model-modes tiny-std-track:std \\
        --out docs/length_curves.html --png docs/length_curves.png
"""
from __future__ import annotations

from pathlib import Path

from common.cli import Parser, add_output_flags, add_plotly_flag, page_outputs
from common.errors import UserError, cli_entry
from common.io import atomic_write
from common.paths import figures_dir

from common.plotlyjs import include_plotlyjs, write_plotly_js
from probes.depth_curves import PALETTE, load_results_doc, rgba

DIV_ID = "length-curves"
DASH = ("solid", "dash", "dot", "dashdot")
# Modes drawn by default: the decodings and the recurrences; every fused-k of a sweep would crowd the page.
DEFAULT_MODES = ("std", "soft", "fused", "recurrent-1", "recurrent-full", "fused-4", "fused-30")


def load_eval(path) -> tuple[str, list[dict]]:
    p = Path(path)
    doc = load_results_doc(p, "eval.json")
    name = Path(str(doc.get("meta", {}).get("model", p.parent.name))).name or p.parent.name
    return name, doc["results"]


def _chance(task: str) -> float:
    from tasks import LABEL_WORDS

    return 1.0 / len(LABEL_WORDS.get(task, (0, 1)))


TITLE = "State tracking past the depth: accuracy vs N (same weights, std vs recurrence; and the 1-pass twin)"


def length_figure(evals: list[tuple[str, list[dict]]], modes=DEFAULT_MODES, tasks=None, model_modes=None,
                  title: str = TITLE):
    """`model_modes` {model name: modes}: the modes drawn for that model instead of `modes` (a twin whose fusion
    is untrained is read under std only)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = [(name, r) for name, rs in evals for r in rs]
    tasks = tasks or list(dict.fromkeys(r["task"] for _, r in rows))
    if not tasks:
        raise UserError("no rows to plot")
    fig = make_subplots(rows=1, cols=len(tasks), subplot_titles=[f"{t} (chance {_chance(t):.2f})" for t in tasks],
                        shared_yaxes=True)
    models = list(dict.fromkeys(name for name, _ in rows))
    for ti, task in enumerate(tasks):
        for mi, model in enumerate(models):
            wanted = (model_modes or {}).get(model, modes)
            present = [m for m in dict.fromkeys(r["mode"] for n, r in rows if n == model and r["task"] == task)
                       if m in wanted]
            for ki, mode in enumerate(present):
                pts = sorted((r for n, r in rows if n == model and r["task"] == task and r["mode"] == mode),
                             key=lambda r: r["n_distractors"])
                x = [r["n_distractors"] for r in pts]
                y = [r["accuracy"] for r in pts]
                color = PALETTE[(modes.index(mode) if mode in modes else ki) % len(PALETTE)]
                label = f"{model} {mode}"
                if all("ci_low" in r and "ci_high" in r for r in pts):
                    fig.add_trace(go.Scatter(x=x + x[::-1], y=[r["ci_high"] for r in pts] + [r["ci_low"] for r in pts][::-1],
                                             mode="lines", fill="toself", line=dict(width=0), fillcolor=rgba(color, 0.12),
                                             hoverinfo="skip", showlegend=False, legendgroup=label),
                                  row=1, col=ti + 1)
                fig.add_trace(go.Scatter(
                    x=x, y=y, mode="lines+markers", name=label, legendgroup=label, showlegend=ti == 0,
                    line=dict(color=color, dash=DASH[mi % len(DASH)]),
                    customdata=[[r.get("n_samples"), r.get("ci_low"), r.get("ci_high")] for r in pts],
                    hovertemplate=f"{label}<br>N=%{{x}}<br>accuracy %{{y:.3f}} [%{{customdata[1]:.3f}}, "
                                  "%{customdata[2]:.3f}]<br>n=%{customdata[0]}<extra></extra>"),
                    row=1, col=ti + 1)
        fig.add_hline(y=_chance(task), line=dict(color="gray", dash="dot", width=1), row=1, col=ti + 1)
        fig.update_xaxes(type="log", title_text="N update lines", row=1, col=ti + 1, dtick=0.30103)
    fig.update_yaxes(range=[0, 1.02], title_text="label accuracy", row=1, col=1)
    fig.update_layout(template="plotly_white", width=560 * len(tasks) + 240, height=460,
                      title=title, legend=dict(font=dict(size=10)))
    return fig


def markdown_tables(evals, modes=DEFAULT_MODES, model_modes=None, tasks=None) -> str:
    """The figure's numbers as markdown, one table per task: a row per (model, mode) drawn, a column per N, the
    accuracy to 3 decimals (the CIs stay in the eval.json files); an empty cell where a model was not run at N."""
    rows = [(name, r) for name, rs in evals for r in rs]
    tasks = tasks or list(dict.fromkeys(r["task"] for _, r in rows))
    out = []
    for task in tasks:
        ns = sorted({r["n_distractors"] for _, r in rows if r["task"] == task})
        lines = [f"| {task} (chance {_chance(task):.2f}), N update lines | " + " | ".join(map(str, ns)) + " |",
                 "|---" * (len(ns) + 1) + "|"]
        for model in dict.fromkeys(name for name, _ in rows):
            wanted = (model_modes or {}).get(model, modes)
            for mode in [m for m in wanted if any(n == model and r["task"] == task and r["mode"] == m
                                                  for n, r in rows)]:
                acc = {r["n_distractors"]: r["accuracy"] for n, r in rows
                       if n == model and r["task"] == task and r["mode"] == mode}
                lines.append(f"| {model}, {mode} | " + " | ".join(f"{acc[n]:.3f}" if n in acc else "" for n in ns)
                             + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def render_html(evals, modes=DEFAULT_MODES, model_modes=None, plotly: str = "directory", title: str = TITLE) -> str:
    """The page; plotly.js as `plotly` says (common.plotlyjs.PLOTLY_CHOICES; directory: plotly.min.js beside
    the page, written by `write_plotly_js`)."""
    return length_figure(evals, modes, model_modes=model_modes, title=title).to_html(
        include_plotlyjs=include_plotlyjs(plotly), full_html=True, div_id=DIV_ID, config={"displayModeBar": False})


@cli_entry
def main(argv=None):
    p = Parser(prog="python -m analysis.length_curves", description=__doc__)
    p.add_argument("evals", nargs="+", help="eval.json files (analysis.evaluate), one per model")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"modes to draw (default {','.join(DEFAULT_MODES)})")
    p.add_argument("--model-modes", action="append", default=[], metavar="MODEL:MODES",
                   help="modes drawn for one model instead of --modes, e.g. tiny-std-track:std (repeatable; MODEL "
                        "is the model name in its eval.json)")
    add_output_flags(p, "./figures/length_curves.html", kind="file", out_extra=": the HTML page")
    p.add_argument("--png", help="also write a PNG here (needs headless Chromium)")
    p.add_argument("--title", default=TITLE, help="the figure's title (default: the headline's)")
    p.add_argument("--markdown", action="store_true",
                   help="also print the drawn numbers as markdown tables (one per task, a row per model and mode, "
                        "a column per N)")
    add_plotly_flag(p)
    a = p.parse_args(argv)
    out, png = page_outputs(a.out if a.out is not None else figures_dir("length_curves.html"), a.png, a.overwrite)
    modes = tuple(m.strip() for m in a.modes.split(",") if m.strip())
    evals = [load_eval(e) for e in a.evals]
    names = [n for n, _ in evals]
    model_modes = {}
    for spec in a.model_modes:
        name, sep, ms = spec.partition(":")
        wanted = tuple(m.strip() for m in ms.split(",") if m.strip())
        if not sep or not wanted:
            raise UserError(f"--model-modes {spec!r}: expected MODEL:MODE[,MODE...], e.g. tiny-std-track:std")
        if name not in names:
            raise UserError(f"--model-modes {spec!r}: no model {name!r} among the inputs ({', '.join(names)})")
        model_modes[name] = wanted
    html = render_html(evals, modes, model_modes, a.plotly, a.title)
    write_plotly_js(out.parent, a.plotly)  # first: the page never references a missing plotly.min.js
    atomic_write(out, html)
    print(f"wrote {out}")
    if a.markdown:
        print(markdown_tables(evals, modes, model_modes))
    if png:
        write_png(evals, png, modes, model_modes, a.title)
        print(f"wrote {png}")
    return 0


def write_png(evals, png, modes=DEFAULT_MODES, model_modes=None, title: str = TITLE) -> Path:
    """The figure as a PNG (headless Chromium, probes.depth_curves.figure_png)."""
    from probes.depth_curves import figure_png

    return figure_png(length_figure(evals, modes, model_modes=model_modes, title=title), png, DIV_ID)


if __name__ == "__main__":
    main()
