"""Accuracy against the number of update lines N, per task, for several models and modes: the separation figure.

Input: eval.json documents written by ``python -m analysis.evaluate`` (rows: task, n_distractors, mode, accuracy,
n_samples, optional ci_low / ci_high, which must contain the accuracy). One panel per task, x = N (log2 axis),
y = label accuracy, one line per (model, mode) with its 95% CI as a band where the rows carry one, and the chance
line at 1/K (K: the built-in task's label words, or a custom task's from the file's meta.custom_tasks). A log axis
has no 0: a panel with N = 0 rows draws them as separate markers (95% CI as error bars) at the left edge, apart
from the lines, on a tick labelled 0 beyond a dotted break. Each (model, mode) has one legend entry and one colour
(by mode; the line's dash tells the models apart) on every panel.

Modes are read through the engine's one parser (engine.modes): ``--modes standard``, ``std`` and ``fused-0`` name
the same rows, whatever spelling the eval.json used (a file with both ``fused`` and ``fused-1`` rows draws the
spelling --modes names, else the first). Several files of one model are drawn as one; two files that give the
same point (model, task, mode, N) are refused, as are files that are not eval.json documents. A model is named by
the last part of its meta.model: two files of one name whose meta.weights_sha256 differ (a checkpoint retrained in
place) are refused; where a file predates that record, two whose meta.model are different paths with one name
(runs/x/m and runs/y/m) are (a bare name, m, is taken to be the same model as any path ending in it, as are two
paths one of which ends with the other).

The page uses a fixed div id, so the same inputs always give the same page. plotly.js (``--plotly``): by default
``plotly.min.js`` is written once beside the page (replaced only when it differs from the installed plotly's) and
the page loads it from there (offline); ``inline`` embeds it (4.8 MB), ``cdn`` loads it from cdn.plot.ly.
``--png`` renders the figure with headless Chromium (probes.depth_curves.html_to_png) from a temporary
self-contained page; without Chromium the run is refused before anything is written. The page (and PNG) never
replace an existing file without --overwrite, even one another run wrote meanwhile. Default output:
./figures/length_curves.html under the current directory.

    python -m analysis.length_curves checkpoints/tiny-fbt-track/eval.json checkpoints/tiny-std-track/eval.json \\
        --modes std,fused-30,recurrent-full --model-modes tiny-std-track:std \\
        --out docs/length_curves.html --png docs/length_curves.png
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

from common.cli import Parser, add_output_flags, add_plotly_flag, page_outputs, say
from common.errors import UserError, cli_entry
from common.io import commit_outputs, temp_beside
from common.jsonio import read_user_json
from common.paths import figures_dir
from common.plotlyjs import PLOTLY_JS, include_plotlyjs, write_plotly_js
from engine.modes import canonical_modes, parse_mode
from probes.depth_curves import PALETTE, rgba

DIV_ID = "length-curves"
DASH = ("solid", "dash", "dot", "dashdot")
SYMBOLS = ("circle", "square", "diamond", "triangle-up")  # the N = 0 markers, per model (a lone marker has no dash)
CI_SLACK = 1e-9  # a CI must contain its point up to float rounding
# Modes drawn by default: the decodings and the recurrences; every fused-k of a sweep would crowd the page.
DEFAULT_MODES = ("std", "soft", "fused", "recurrent-1", "recurrent-full", "fused-4", "fused-30")
ROW_KEYS = ("task", "n_distractors", "mode", "accuracy", "n_samples")  # every eval.json row has them


# ----- reading eval.json ------------------------------------------------------------------------------------------
class EvalDoc(tuple):
    """One eval.json: unpacks as (model name, rows); `path` names the file in messages, `label_words` holds the
    label words of its custom tasks (meta.custom_tasks), `model` its meta.model as written (None: not known),
    `weights` its meta.weights_sha256 (None in files written before evaluate recorded it)."""

    def __new__(cls, name, rows, path="", label_words=None, model=None, weights=None):
        self = super().__new__(cls, (name, rows))
        self.path = str(path) if path else name
        self.label_words = dict(label_words or {})
        self.model = model
        self.weights = weights
        return self

    @property
    def name(self) -> str:
        return self[0]

    @property
    def rows(self) -> list[dict]:
        return self[1]


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def what_it_is(doc, eval_json: bool = False) -> str:
    """What another of the suite's documents looks like, for a refusal (empty when unknown; `eval_json`: an
    eval.json is named too)."""
    if not isinstance(doc, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(doc), "a number")
        return f"the top level is {kind}, not an object"
    schema = doc.get("schema")
    if isinstance(schema, dict) and schema.get("name") == "causal-report":
        return "it is a causal_report.json (interventions.run)"
    meta = doc.get("meta")
    if isinstance(meta, dict) and isinstance(meta.get("schema"), str):
        if meta["schema"].startswith("fbprobe.probes/"):
            return f"it is a probes.json (meta.schema {meta['schema']}; probes.run)"
        return f"it is a {meta['schema'][:60]} document"
    if eval_json and isinstance(meta, dict) and isinstance(doc.get("results"), list) and "model" in meta:
        return "it is an eval.json (analysis.evaluate)"
    return ""


def _check_row(r, where: str) -> None:
    if not isinstance(r, dict):
        raise UserError(f"{where}: a row must be an object, got {type(r).__name__}")
    if "depth" in r:
        raise UserError(f"{where}: a row with a depth is a probe's (probes.json), not an eval.json row")
    missing = [k for k in ROW_KEYS if k not in r]
    if missing:
        raise UserError(f"{where}: missing {', '.join(missing)} (an eval.json row has {', '.join(ROW_KEYS)})")
    if not isinstance(r["task"], str) or not r["task"].strip():
        raise UserError(f"{where}: task must be a task name, got {r['task']!r}")
    if not is_int(r["n_distractors"]) or r["n_distractors"] < 0:
        raise UserError(f"{where}: n_distractors must be an integer >= 0, got {r['n_distractors']!r}")
    if not isinstance(r["mode"], str):
        raise UserError(f"{where}: mode must be a mode name, got {r['mode']!r}")
    try:
        parse_mode(r["mode"])
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    if not is_number(r["accuracy"]) or not 0 <= r["accuracy"] <= 1:
        raise UserError(f"{where}: accuracy must be a number in [0, 1], got {r['accuracy']!r}")
    if not is_int(r["n_samples"]) or r["n_samples"] < 1:
        raise UserError(f"{where}: n_samples must be an integer >= 1, got {r['n_samples']!r}")
    for k in ("ci_low", "ci_high"):
        if k in r and (not is_number(r[k]) or not 0 <= r[k] <= 1):
            raise UserError(f"{where}: {k} must be a number in [0, 1], got {r[k]!r}")
    if ("ci_low" in r) != ("ci_high" in r):
        raise UserError(f"{where}: ci_low and ci_high come together")
    if "ci_low" in r and r["ci_low"] > r["ci_high"]:
        raise UserError(f"{where}: ci_low {r['ci_low']} > ci_high {r['ci_high']}")
    if "ci_low" in r and not r["ci_low"] - CI_SLACK <= r["accuracy"] <= r["ci_high"] + CI_SLACK:
        raise UserError(f"{where}: the CI [{r['ci_low']}, {r['ci_high']}] does not contain its accuracy "
                        f"{r['accuracy']}")


def _custom_label_words(meta: dict, where: str) -> dict[str, list]:
    tasks = meta.get("custom_tasks", [])
    if not isinstance(tasks, list):
        raise UserError(f"{where}: meta.custom_tasks must be a list")
    out = {}
    for i, t in enumerate(tasks):
        words = t.get("label_words") if isinstance(t, dict) else None
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not isinstance(words, list) \
                or len(words) < 2:
            raise UserError(f"{where}: meta.custom_tasks[{i}] needs a name and its label_words (two or more)")
        out[t["name"]] = words
    return out


def load_eval(path) -> EvalDoc:
    """An eval.json (analysis.evaluate) checked whole, or one-line UserError naming the file and what is wrong."""
    p = Path(path)
    where = f"eval.json {p}"
    doc = read_user_json(p, "eval.json")
    other = what_it_is(doc)
    if other:
        raise UserError(f"{p} is not an eval.json (python -m analysis.evaluate): {other}")
    if not isinstance(doc.get("meta"), dict) or not isinstance(doc.get("results"), list):
        raise UserError(f"{p} is not an eval.json (python -m analysis.evaluate): it needs a meta object and a "
                        "results list")
    meta, rows = doc["meta"], doc["results"]
    model = meta.get("model")
    if not isinstance(model, str) or not model.strip():
        raise UserError(f"{where}: meta.model must be the model's name or path, got {model!r}")
    if not rows:
        raise UserError(f"{where}: no result rows")
    seen = {}
    for i, r in enumerate(rows):
        _check_row(r, f"{where}: results[{i}]")
        key = (r["task"], r["n_distractors"], r["mode"])
        if key in seen:
            raise UserError(f"{where}: results[{seen[key]}] and results[{i}] are both {r['task']} N = "
                            f"{r['n_distractors']} {r['mode']}")
        seen[key] = i
    name = Path(model.strip()).name or p.absolute().parent.name
    weights = meta.get("weights_sha256")
    return EvalDoc(name, rows, p, _custom_label_words(meta, where), model.strip(),
                   weights if isinstance(weights, str) and weights else None)


def _model_parts(model: str) -> tuple[str, ...]:
    return tuple(x for x in os.path.normpath(model.replace("\\", "/")).split("/") if x not in ("", "."))


def _may_be_one_model(a: str, b: str) -> bool:
    """Two meta.model values of one name that may name one model: equal as paths, or one ends with the other
    (a bare name is found on the checkpoint search path; a relative path is relative to where evaluate ran)."""
    pa, pb = _model_parts(a), _model_parts(b)
    k = min(len(pa), len(pb))
    return pa[len(pa) - k:] == pb[len(pb) - k:]


def check_one_model_per_name(docs: list[EvalDoc]) -> None:
    """Files drawn under one model name must be of one model: two files whose meta.weights_sha256 differ (a
    checkpoint retrained in place between two evaluations), or, where a file predates that record, two meta.model
    paths that differ but share their name (runs/x/tiny-fbt-track, runs/y/tiny-fbt-track), are refused in one line:
    one curve would join two models."""
    for i, a in enumerate(docs):
        for b in docs[i + 1:]:
            if a.name != b.name:
                continue
            if a.weights and b.weights:
                if a.weights != b.weights:
                    raise UserError(f"eval.json {a.path} and {b.path} are of two models named {a.name} (weights "
                                    f"sha256 {a.weights[:12]} and {b.weights[:12]}): one curve would join them; "
                                    "draw them on separate pages, or evaluate the model once")
            elif a.model is not None and b.model is not None and not _may_be_one_model(a.model, b.model):
                raise UserError(f"eval.json {a.path} is of model {a.model}, {b.path} of model {b.model}: two models "
                                f"named {a.name} would be drawn as one curve (a file without meta.weights_sha256 "
                                "cannot tell them apart otherwise); draw them on separate pages, or give one a "
                                "meta.model of another name")


# ----- what is drawn: one plan for the page and the tables ------------------------------------------------------
def _as_docs(evals) -> list[EvalDoc]:
    return [e if isinstance(e, EvalDoc) else EvalDoc(*e) for e in evals]


def _typed(modes) -> list[str]:
    """Mode names as given (a comma-separated string or a sequence), stripped; each checked by the engine."""
    names = [str(m).strip() for m in (modes.split(",") if isinstance(modes, str) else modes) if str(m).strip()]
    canonical_modes(names)  # one message for a bad or empty list
    return names


def _chance(task: str, docs: list[EvalDoc]) -> float:
    """1/K: K the custom task's label words in the files' meta.custom_tasks, else the built-in task's."""
    from tasks import LABEL_WORDS

    ks = {(d.path, len(d.label_words[task])) for d in docs if task in d.label_words}
    if len({k for _, k in ks}) > 1:
        raise UserError(f"task {task!r} has different label words in " + ", ".join(sorted(p for p, _ in ks))
                        + ": one panel takes one chance level")
    if ks:
        return 1.0 / next(iter(ks))[1]
    base = task.split("@", 1)[0]  # a tracking task's input variant (parity@hold) keeps its task's words
    if base in LABEL_WORDS:
        return 1.0 / len(LABEL_WORDS[base])
    files = ", ".join(dict.fromkeys(d.path for d in docs if any(r["task"] == task for r in d.rows)))
    raise UserError(f"task {task!r} ({files}) is neither a built-in task nor in meta.custom_tasks: its chance "
                    "level 1/K is unknown")


def plan_traces(evals, modes=DEFAULT_MODES, model_modes=None, tasks=None):
    """(tasks, {task: chance}, {task: [trace]}): what the page draws and the tables print, one curve per
    (model, task, canonical mode). A trace: dict(model, mode (its rows' spelling), color, dash, rows sorted by N).
    Refuses two rows for one point (files of one model that overlap)."""
    docs = _as_docs(evals)
    typed = _typed(modes)
    first_typed: dict[str, int] = {}
    for i, m in enumerate(typed):
        first_typed.setdefault(parse_mode(m).name, i)
    wanted_of = {}
    for model, ms in (model_modes or {}).items():
        t = _typed(ms)
        wanted_of[model] = (t, {parse_mode(m).name for m in t})
    default = (typed, set(first_typed))
    tasks = list(tasks or dict.fromkeys(r["task"] for d in docs for r in d.rows))
    if not tasks:
        raise UserError("no rows to plot")
    chance = {t: _chance(t, docs) for t in tasks}
    models = list(dict.fromkeys(d.name for d in docs))
    traces: dict[str, list[dict]] = {}
    color_of: dict[tuple[str, str], str] = {}  # (model, mode as labelled) -> its colour, the same on every panel
    for task in tasks:
        traces[task] = []
        for mi, model in enumerate(models):
            wanted, canon = wanted_of.get(model, default)
            curves: dict[str, list] = {}  # canonical mode -> [(doc, spelling)] in row order
            for d in docs:
                if d.name != model:
                    continue
                spellings: dict[str, list[str]] = {}
                for r in d.rows:
                    c = parse_mode(r["mode"]).name
                    if r["task"] == task and c in canon and r["mode"] not in spellings.setdefault(c, []):
                        spellings[c].append(r["mode"])
                for c, sp in spellings.items():
                    if sp:  # the spelling asked for, else the file's first (fused beside the sweep's fused-1)
                        curves.setdefault(c, []).append((d, next((s for s in wanted if s in sp), sp[0])))
            for ki, (c, picks) in enumerate(curves.items()):
                chosen = [s for _, s in picks]
                label_mode = next((s for s in wanted if s in chosen), chosen[0])
                by_n: dict[int, tuple] = {}
                for d, s in picks:
                    for r in d.rows:
                        if r["task"] == task and r["mode"] == s:
                            n = r["n_distractors"]
                            if n in by_n:
                                other = by_n[n][0].path
                                both = f"{d.path} is given twice" if other == d.path else \
                                    f"{other} and {d.path} both hold it"
                                raise UserError(f"{model} {task} {label_mode} at N = {n}: {both}; a point is drawn "
                                                "once: give each (model, task, mode, N) in one file")
                            by_n[n] = (d, r)
                # a mode --modes does not name: a colour after theirs (its place among the model's curves could be
                # a named mode's, and one model's curves share a dash)
                color = typed.index(label_mode) if label_mode in typed else first_typed.get(c, len(typed) + ki)
                color = color_of.setdefault((model, label_mode), PALETTE[color % len(PALETTE)])
                traces[task].append(dict(model=model, mode=label_mode, canonical=c, dash=DASH[mi % len(DASH)],
                                          symbol=SYMBOLS[mi % len(SYMBOLS)], color=color,
                                          rows=[by_n[n][1] for n in sorted(by_n)]))
    check_one_model_per_name(docs)  # after the points: a point given twice is named as such first
    if not any(traces.values()):
        raise UserError(f"nothing to draw: no rows of the modes {', '.join(typed)} in the inputs")
    return tasks, chance, traces


TITLE = "State tracking past the depth: accuracy vs N (same weights, std vs recurrence; and the 1-pass twin)"


def length_figure(evals: list[tuple[str, list[dict]]], modes=DEFAULT_MODES, tasks=None, model_modes=None,
                  title: str = TITLE):
    """`model_modes` {model name: modes}: the modes drawn for that model instead of `modes` (a twin whose fusion
    is untrained is read under std only)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    tasks, chance, traces = plan_traces(evals, modes, model_modes, tasks)
    fig = make_subplots(rows=1, cols=len(tasks), subplot_titles=[f"{t} (chance {chance[t]:.2f})" for t in tasks],
                        shared_yaxes=True)
    shown: set[str] = set()  # one legend entry per (model, mode): on its first trace, whichever panel that is
    for ti, task in enumerate(tasks):
        # N = 0 has no place on a log axis: its points are drawn apart, at x0 two octaves left of the panel's least
        # N > 0, on a tick labelled 0, beyond a dotted break.
        positive = sorted({r["n_distractors"] for t in traces[task] for r in t["rows"] if r["n_distractors"] > 0})
        zero = any(r["n_distractors"] == 0 for t in traces[task] for r in t["rows"])
        x0 = (positive[0] if positive else 1) / 4
        for t in traces[task]:
            color, label = t["color"], f"{t['model']} {t['mode']}"
            pts = [r for r in t["rows"] if r["n_distractors"] > 0]
            x = [r["n_distractors"] for r in pts]
            y = [r["accuracy"] for r in pts]
            if pts and all("ci_low" in r and "ci_high" in r for r in pts):
                fig.add_trace(go.Scatter(x=x + x[::-1], y=[r["ci_high"] for r in pts] + [r["ci_low"] for r in pts][::-1],
                                         mode="lines", fill="toself", line=dict(width=0), fillcolor=rgba(color, 0.12),
                                         hoverinfo="skip", showlegend=False, legendgroup=label),
                              row=1, col=ti + 1)
            if pts:
                fig.add_trace(go.Scatter(
                    x=x, y=y, mode="lines+markers", name=label, legendgroup=label, showlegend=label not in shown,
                    line=dict(color=color, dash=t["dash"]),
                    customdata=[[r.get("n_samples"), r.get("ci_low"), r.get("ci_high")] for r in pts],
                    hovertemplate=f"{label}<br>N=%{{x}}<br>accuracy %{{y:.3f}} [%{{customdata[1]:.3f}}, "
                                  "%{customdata[2]:.3f}]<br>n=%{customdata[0]}<extra></extra>"),
                    row=1, col=ti + 1)
                shown.add(label)
            for r in (r for r in t["rows"] if r["n_distractors"] == 0):
                ci = "ci_low" in r and "ci_high" in r
                fig.add_trace(go.Scatter(
                    x=[x0], y=[r["accuracy"]], mode="markers", name=label, legendgroup=label,
                    showlegend=label not in shown, marker=dict(color=color, symbol=t["symbol"], size=8),
                    error_y=dict(type="data", symmetric=False, array=[r["ci_high"] - r["accuracy"]],
                                 arrayminus=[r["accuracy"] - r["ci_low"]], color=color) if ci else None,
                    customdata=[[r.get("n_samples"), r.get("ci_low"), r.get("ci_high")]],
                    hovertemplate=f"{label}<br>N=0<br>accuracy %{{y:.3f}} [%{{customdata[1]:.3f}}, "
                                  "%{customdata[2]:.3f}]<br>n=%{customdata[0]}<extra></extra>"),
                    row=1, col=ti + 1)
                shown.add(label)
        fig.add_hline(y=chance[task], line=dict(color="gray", dash="dot", width=1), row=1, col=ti + 1)
        if not zero:
            fig.update_xaxes(type="log", title_text="N update lines", row=1, col=ti + 1, dtick=0.30103)
            continue
        fig.add_trace(go.Scatter(x=[2 * x0, 2 * x0], y=[0, 1.02], mode="lines", hoverinfo="skip", showlegend=False,
                                 line=dict(color="gray", dash="dot", width=1)), row=1, col=ti + 1)
        ticks = [2 ** k for k in range(int(math.log2(positive[0])), int(math.ceil(math.log2(positive[-1]))) + 1)] \
            if positive else []
        fig.update_xaxes(type="log", title_text="N update lines (N = 0: left of the dotted break)", row=1,
                         col=ti + 1, tickvals=[x0] + ticks, ticktext=["0"] + [str(v) for v in ticks])
    fig.update_yaxes(range=[0, 1.02], title_text="label accuracy", row=1, col=1)
    fig.update_layout(template="plotly_white", width=560 * len(tasks) + 240, height=460,
                      title=title, legend=dict(font=dict(size=10)))
    return fig


def markdown_tables(evals, modes=DEFAULT_MODES, model_modes=None, tasks=None) -> str:
    """The figure's numbers as markdown, one table per task: a row per (model, mode) drawn, a column per N, the
    accuracy to 3 decimals (the CIs stay in the eval.json files); an empty cell where a model was not run at N."""
    tasks, chance, traces = plan_traces(evals, modes, model_modes, tasks)
    out = []
    for task in tasks:
        ns = sorted({r["n_distractors"] for t in traces[task] for r in t["rows"]})
        lines = [f"| {task} (chance {chance[task]:.2f}), N update lines | " + " | ".join(map(str, ns)) + " |",
                 "|---" * (len(ns) + 1) + "|"]
        for t in traces[task]:
            acc = {r["n_distractors"]: r["accuracy"] for r in t["rows"]}
            lines.append(f"| {t['model']}, {t['mode']} | " + " | ".join(f"{acc[n]:.3f}" if n in acc else ""
                                                                       for n in ns) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def render_html(evals, modes=DEFAULT_MODES, model_modes=None, plotly: str = "directory", title: str = TITLE) -> str:
    """The page; plotly.js as `plotly` says (common.plotlyjs.PLOTLY_CHOICES; directory: plotly.min.js beside
    the page, written by `write_plotly_js`)."""
    return length_figure(evals, modes, model_modes=model_modes, title=title).to_html(
        include_plotlyjs=include_plotlyjs(plotly), full_html=True, div_id=DIV_ID, config={"displayModeBar": False})


# ----- writing: checked first, no clobbering, quiet on a closed pipe (shared with analysis.where_state) ----------
def _same_path(a: Path, b: Path) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_png(out: Path, png: Path | None, plotly: str) -> None:
    """--png refused before anything is written: the page's own path (or its plotly.min.js), or no Chromium."""
    if png is None:
        return
    if _same_path(png, out):
        raise UserError(f"--png {png} is the --out page itself: give the PNG another path")
    if plotly == "directory" and _same_path(png, out.parent / PLOTLY_JS):
        raise UserError(f"--png {png} is the page's {PLOTLY_JS}: give the PNG another path")
    from probes import depth_curves

    if depth_curves.find_chromium() is None:
        raise UserError("--png needs headless Chromium, which is not found (install Debian `chromium`, or `make "
                        "chromium`); nothing written")


def write_page(out: Path, html: str, png: Path | None, fig, div_id: str, plotly: str, overwrite: bool) -> None:
    """The page and its PNG: the PNG rendered first (a failed render writes nothing), then plotly.min.js (before
    any page references it), then both files put in place without clobbering (`commit_outputs`)."""
    items = []
    try:
        if png is not None:
            from probes import depth_curves

            tmp_png = temp_beside(png)
            items.append((png, tmp_png))
            depth_curves.figure_png(fig, tmp_png, div_id)
        write_plotly_js(out.parent, plotly)
        items.insert(0, (out, temp_beside(out, html)))
    except BaseException:
        for _, tmp in items:
            if os.path.exists(tmp):
                os.unlink(tmp)
        raise
    commit_outputs(items, overwrite)


@cli_entry
def main(argv=None):
    p = Parser(prog="python -m analysis.length_curves", description=__doc__)
    p.add_argument("evals", nargs="+", help="eval.json files (analysis.evaluate), one per model")
    p.add_argument("--modes", default=None,
                   help=f"modes to draw, any spelling the engine reads (std = standard = fused-0); each must be in "
                        f"some input (default {','.join(DEFAULT_MODES)}: those the inputs hold)")
    p.add_argument("--model-modes", action="append", default=[], metavar="MODEL:MODES",
                   help="modes drawn for one model instead of --modes, e.g. tiny-std-track:std (repeatable, once "
                        "per model: a model's modes go in one list; MODEL is the model name in its eval.json)")
    add_output_flags(p, "./figures/length_curves.html", kind="file", out_extra=": the HTML page")
    p.add_argument("--png", help="also write a PNG here (needs headless Chromium)")
    p.add_argument("--title", default=TITLE, help="the figure's title (default: the headline's)")
    p.add_argument("--markdown", action="store_true",
                   help="also print the drawn numbers as markdown tables (one per task, a row per model and mode, "
                        "a column per N)")
    add_plotly_flag(p)
    a = p.parse_args(argv)
    out, png = page_outputs(a.out if a.out is not None else figures_dir("length_curves.html"), a.png, a.overwrite)
    check_png(out, png, a.plotly)
    try:
        modes = tuple(_typed(a.modes if a.modes is not None else DEFAULT_MODES))
    except UserError as e:
        raise UserError(f"--modes {a.modes!r}: {e}") from None
    model_specs, given = [], {}
    for spec in a.model_modes:
        name, sep, ms = spec.partition(":")
        wanted = tuple(m.strip() for m in ms.split(",") if m.strip())
        if not sep or not wanted:
            raise UserError(f"--model-modes {spec!r}: expected MODEL:MODE[,MODE...], e.g. tiny-std-track:std")
        if name in given:  # the later one used to replace the earlier silently
            raise UserError(f"--model-modes {spec!r}: {name} already has its modes (--model-modes {given[name][0]!r});"
                            f" give a model's modes once, in one list: {name}:{','.join(given[name][1] + wanted)}")
        given[name] = (spec, wanted)
        try:
            canonical_modes(wanted)
        except UserError as e:
            raise UserError(f"--model-modes {spec!r}: {e}") from None
        model_specs.append((spec, name, wanted))
    evals = [load_eval(e) for e in a.evals]
    names = list(dict.fromkeys(n for n, _ in evals))
    held = {n: {parse_mode(r["mode"]).name for m, rs in evals if m == n for r in rs} for n in names}
    if a.modes is not None:  # asked for by name: each one drawn somewhere
        for m in modes:
            if not any(parse_mode(m).name in h for h in held.values()):
                raise UserError(f"--modes {m}: no input holds rows of mode {parse_mode(m).name} (they hold "
                                f"{', '.join(sorted(set().union(*held.values())))})")
    model_modes = {}
    for spec, name, wanted in model_specs:
        if name not in names:
            raise UserError(f"--model-modes {spec!r}: no model {name!r} among the inputs ({', '.join(names)})")
        for m in wanted:
            if parse_mode(m).name not in held[name]:
                raise UserError(f"--model-modes {spec!r}: {name} has no rows of mode {parse_mode(m).name} (it has "
                                f"{', '.join(sorted(held[name]))})")
        model_modes[name] = wanted
    fig = length_figure(evals, modes, model_modes=model_modes, title=a.title)  # every refusal of the inputs here
    table = markdown_tables(evals, modes, model_modes) if a.markdown else None
    html = fig.to_html(include_plotlyjs=include_plotlyjs(a.plotly), full_html=True, div_id=DIV_ID,
                       config={"displayModeBar": False})
    write_page(out, html, png, fig, DIV_ID, a.plotly, a.overwrite)
    say(f"wrote {out}", *([f"wrote {png}"] if png else []), *([table] if table is not None else []),
        *_not_drawn(held, modes, model_modes))
    return 0


def _not_drawn(held: dict, modes, model_modes: dict) -> list[str]:
    """One line naming the modes the inputs hold that no curve draws (the default --modes is a fixed list: a
    recirculation or recurrent-2 row was left out without a word), the fused-k sweep counted, not listed."""
    drawn = {parse_mode(m).name for m in modes} | {parse_mode(m).name for ms in model_modes.values() for m in ms}
    left = sorted(set().union(*held.values()) - drawn)
    if not left:
        return []
    sweep = [m for m in left if re.fullmatch(r"fused-\d+", m)]
    named = [m for m in left if m not in sweep]
    parts = named + ([f"{len(sweep)} fused-k of the sweep"] if sweep else [])
    return [f"not drawn (the inputs hold them; name them in --modes): {', '.join(parts)}"]


def write_png(evals, png, modes=DEFAULT_MODES, model_modes=None, title: str = TITLE) -> Path:
    """The figure as a PNG (headless Chromium, probes.depth_curves.figure_png)."""
    from probes.depth_curves import figure_png

    return figure_png(length_figure(evals, modes, model_modes=model_modes, title=title), png, DIV_ID)


if __name__ == "__main__":
    main()
