"""Depth curves of probe accuracy: interactive Plotly HTML, and a PNG.

Input: a probes.json document (``{"meta": ..., "results": [...]}``, written by ``python -m probes.run``).

* completion / memory: one panel per prefill mode (standard, recurrent-1, ...), x = depth,
  y = held-out accuracy, one line per distractor count N with its 95% CI as a band, the chance line at 0.5,
  hover showing accuracy, CI, fold spread, control accuracy and n (samples / groups).
* multi_register: one panel per mode (standard, recurrent-1/2/4, recurrent-full), one line per
  writes-per-register (2, 4, 8; and per N when several N were run).
* any other task (parity, shell_game, custom tasks): as completion; the chance line is at 1/K for K label
  classes (``meta.labels.chance``; without it the built-in task's label words, else 0.5).

* rows that carry them (probes.run schema 2) add a second row of panels with the logit lens (label logit
  difference per depth, same x axis; the fed state h_{T-1} at x = -1 in feedback modes) and a third with the MDL
  compression; ``probes.run --erase D`` adds, dashed, the accuracy after LEACE erasure at depth D.

plotly.js (``--plotly``): ``directory`` (default) makes the page load ``plotly.min.js`` from its own folder,
written there once (atomically; replaced only when it differs from the installed plotly's bundle), so a folder
of pages holds one 4.8 MB copy and opens offline; ``inline`` embeds it in the page (self-contained, offline);
``cdn`` loads it from cdn.plot.ly (small, needs a network). The page uses a fixed div id, so the same document
always gives the same page. ``write_png`` renders the page with headless Chromium (kaleido is not required).

CLI: ``python -m probes.depth_curves figures/tiny-fbt/completion/probes.json [--png out.png]
[--plotly directory|inline|cdn]``.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common.errors import UserError, cli_entry
from common.plotlyjs import include_plotlyjs, write_plotly_js

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")
MODE_ORDER = ("standard", "recurrent-1", "recurrent-2", "recurrent-4", "recurrent-8", "recurrent-full")
DIV_ID = "depth-curves"


def _mode_key(m: str):
    if m in MODE_ORDER:
        return (0, MODE_ORDER.index(m), m)
    return (1, 0, m)


def rgba(hex_color: str, alpha: float) -> str:
    h = hex_color.lstrip("#")
    r, g, b = (int(h[i:i + 2], 16) for i in (0, 2, 4))
    return f"rgba({r},{g},{b},{alpha})"


def load_results_doc(path, what: str) -> dict:
    """A results document (probes.json, eval.json: {"meta": ..., "results": [...]}) or one-line UserError."""
    from common.jsonio import read_user_json

    p = Path(path)
    if not p.is_file():
        raise UserError(f"no {what} at {p}")
    doc = read_user_json(p, what)  # NaN, huge or deep values: one line too
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        raise UserError(f"{p} is not a {what} (needs a 'results' list)")
    return doc


def _load(doc_or_path) -> dict:
    return doc_or_path if isinstance(doc_or_path, dict) else load_results_doc(doc_or_path, "probes.json")


def chance_level(doc: dict, task: str) -> float:
    """The probe's chance: ``meta.labels.probe_chance`` (probes that fit the pair role, tasks.probe_labels), else
    1/K: ``meta.labels.chance`` if the document has it, else from the built-in task's label words, else 0.5."""
    labels = (doc.get("meta") or {}).get("labels") or {}
    for key in ("probe_chance", "chance"):
        if isinstance(labels.get(key), (int, float)) and 0 < labels[key] < 1:
            return float(labels[key])
    from tasks import LABEL_WORDS

    return 1.0 / len(LABEL_WORDS[task]) if task in LABEL_WORDS else 0.5


def _lines(rows: list[dict], task: str) -> dict:
    """{mode: {line label: rows sorted by depth}}"""
    by_mode: dict[str, dict[str, list]] = {}
    multi = task == "multi_register"
    n_values = sorted({r["n_distractors"] for r in rows})
    for r in rows:
        if multi:
            if r.get("writes") is None:
                continue
            label = f"{r['writes']} writes/register" + (f", N={r['n_distractors']}" if len(n_values) > 1 else "")
            key = (r["writes"], r["n_distractors"])
        else:
            if r.get("writes") is not None:
                continue
            label = f"N={r['n_distractors']}"
            key = (r["n_distractors"],)
        by_mode.setdefault(r["mode"], {}).setdefault((key, label), []).append(r)
    out = {}
    for mode in sorted(by_mode, key=_mode_key):
        lines = by_mode[mode]
        out[mode] = {label: sorted(rs, key=lambda r: r["depth"]) for (key, label), rs in sorted(lines.items())}
    return out


def _has(rows, key) -> bool:
    return any(r.get(key) is not None for r in rows)


def depth_curve_figure(doc_or_path, title: str | None = None):
    """Plotly figure of the depth curves of one probes.json (one task).

    Row 1: probe accuracy (and, with probes.run --erase, dashed: the accuracy after LEACE at that depth).
    Row 2 when the rows carry it: the logit lens' label logit difference per depth (same x axis), the fed state
    h_{T-1} drawn at x = -1. Row 3 when the rows carry it: the MDL compression (online code) per depth."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    doc = _load(doc_or_path)
    rows = doc["results"]
    if not rows:
        raise UserError("probes.json has no results to plot")
    tasks = sorted({r["task"] for r in rows})
    if len(tasks) != 1:
        raise UserError(f"one task per figure (got {', '.join(tasks)})")
    task = tasks[0]
    chance = chance_level(doc, task)
    lines = _lines(rows, task)
    modes = list(lines)
    erased = _lines([r for r in (doc.get("erased") or []) if r.get("accuracy") is not None], task)
    fed = {}
    for r in doc.get("fed_state_lens") or []:
        if r.get("logit_lens_ld") is not None:
            fed.setdefault(r["mode"], []).append(r)
    panels = ["accuracy"] + (["lens"] if _has(rows, "logit_lens_ld") else []) + \
        (["mdl"] if _has(rows, "mdl_compression") else [])
    model = doc.get("meta", {}).get("model", {}).get("name") or rows[0].get("model", "")
    titles = [f"{m} prefill" for m in modes] + [""] * (len(modes) * (len(panels) - 1))
    fig = make_subplots(rows=len(panels), cols=len(modes), shared_yaxes="rows", shared_xaxes="columns",
                        subplot_titles=titles, horizontal_spacing=0.04 if len(modes) > 3 else 0.06,
                        vertical_spacing=0.08 if len(panels) > 1 else 0.3,
                        row_heights=[0.5] + [0.5 / (len(panels) - 1)] * (len(panels) - 1) if len(panels) > 1
                        else None)
    labels = []
    for lines_m in lines.values():
        for label in lines_m:
            if label not in labels:
                labels.append(label)
    color = {label: PALETTE[i % len(PALETTE)] for i, label in enumerate(labels)}
    max_depth = max(r["depth"] for r in rows)
    lo_x = -1.3 if fed else -0.3
    for col, mode in enumerate(modes, start=1):
        for label, rs in lines[mode].items():
            x = [r["depth"] for r in rs]
            c = color[label]
            # CI band: upper edge, then lower edge filled up to it.
            fig.add_trace(go.Scatter(x=x, y=[r["ci_high"] for r in rs], mode="lines", line=dict(width=0),
                                     hoverinfo="skip", showlegend=False, legendgroup=label),
                          row=1, col=col)
            fig.add_trace(go.Scatter(x=x, y=[r["ci_low"] for r in rs], mode="lines", line=dict(width=0),
                                     fill="tonexty", fillcolor=rgba(c, 0.18), hoverinfo="skip",
                                     showlegend=False, legendgroup=label),
                          row=1, col=col)
            custom = [[r["ci_low"], r["ci_high"], r["accuracy_std"], r["control_accuracy"], r["n_samples"],
                       r["n_groups"]] for r in rs]
            fig.add_trace(go.Scatter(
                x=x, y=[r["accuracy"] for r in rs], mode="lines+markers", name=label, legendgroup=label,
                showlegend=col == 1, line=dict(color=c, width=2), marker=dict(size=6, color=c),
                customdata=custom,
                hovertemplate=(f"{mode}, {label}<br>depth %{{x}}: accuracy %{{y:.3f}}"
                               "<br>95% CI [%{customdata[0]:.3f}, %{customdata[1]:.3f}], fold sd %{customdata[2]:.3f}"
                               "<br>control %{customdata[3]:.3f}<br>n = %{customdata[4]} samples, "
                               "%{customdata[5]} groups<extra></extra>"),
            ), row=1, col=col)
            _method_traces(fig, go, panels, mode, label, rs, c, col, erased.get(mode, {}).get(label),
                           [r for r in fed.get(mode, []) if _fed_label(r, rows, task) == label])
        fig.add_hline(y=chance, line=dict(color="#555", dash="dash", width=1), row=1, col=col)
        for i, panel in enumerate(panels, start=1):
            ticks = ([-1] if fed else []) + list(range(0, max_depth + 1, 1 if max_depth <= 12 else 5))
            fig.update_xaxes(range=[lo_x, max_depth + 0.3], row=i, col=col, zeroline=False, tickvals=ticks,
                             ticktext=["fed h<sub>T-1</sub>" if t < 0 else str(t) for t in ticks])
            if panel in ("lens", "mdl"):  # reference line (0 = undecided / 1 = no compression); a trace, so that
                # layout.shapes keeps holding the chance lines only
                ref = 0.0 if panel == "lens" else 1.0
                fig.add_trace(go.Scatter(x=[lo_x, max_depth + 0.3], y=[ref, ref], mode="lines", hoverinfo="skip",
                                         showlegend=False, line=dict(color="#555", dash="dot", width=1)),
                              row=i, col=col)
        fig.update_xaxes(title_text="depth (0 = input of block 0)", row=len(panels), col=col)
    # low enough for every point and band drawn in the row (a below-chance score under paired grouped CV was
    # drawn off the axis, 0.20 with its band at 0.10)
    drawn = [v for r in (*rows, *(doc.get("erased") or [])) for v in (r.get("accuracy"), r.get("ci_low"))
             if isinstance(v, (int, float))]
    bottom = min(0.3, round(chance - 0.2, 3), round(min(drawn, default=1.0) - 0.03, 3))
    fig.update_yaxes(title_text="held-out probe accuracy", range=[bottom, 1.03], row=1, col=1)
    fed_all = [r for rs in fed.values() for r in rs]
    for panel, key, name, base in (("lens", "logit_lens_ld", "logit lens: label LD", 0.0),
                                   ("mdl", "mdl_compression", "MDL compression", 1.0)):
        if panel in panels:  # explicit range from the data (and its reference line): same on every panel of the row
            vals = [r[key] for r in rows + (fed_all if panel == "lens" else []) if r.get(key) is not None] + [base]
            lo, hi = min(vals), max(vals)
            pad = 0.08 * (hi - lo) or 0.5
            fig.update_yaxes(title_text=name, row=panels.index(panel) + 1, col=1, range=[lo - pad, hi + pad])
    fig.add_annotation(text="chance" if chance == 0.5 else f"chance 1/{round(1 / chance)}", x=max_depth, y=chance,
                       xref="x", yref="y", showarrow=False, yshift=-10, font=dict(size=10, color="#555"))
    more = []
    if erased:
        more.append(f"dashed lines: accuracy after LEACE erasure of the label at depth {doc['erased'][0]['erased_at']}")
    if "lens" in panels:
        more.append("row 2: logit lens, own label word minus the best other (0 = undecided"
                    + ("; diamond: fed state)" if fed_all else ")"))  # the diamond only where one is drawn
    if "mdl" in panels:
        more.append(f"row {len(panels)}: MDL compression, uniform / online code (1 = nothing learnable)")
    more = "".join(f"<br><sup>{m}</sup>" for m in more)
    fig.update_layout(
        title=title or (f"{task} on {model}: linear-probe accuracy by depth"
                        f"<br><sup>bands = 95% bootstrap CI; dashed = chance</sup>{more}"),
        template="plotly_white", height=450 + 260 * (len(panels) - 1), width=max(700, 380 * len(modes)),
        legend=dict(title="writes per register" if task == "multi_register" else "distractors"),
        hovermode="closest", margin=dict(l=60, r=20, t=80 + 30 * more.count("<br>"), b=60),
    )
    if more:  # a multi-line title grows downwards from the top edge, clear of the panel titles
        fig.update_layout(title=dict(y=1 - 30 / fig.layout.height, yanchor="top"))
    return fig


def _fed_label(r, rows, task) -> str | None:
    """The line label `_lines` gives rows of this fed-state row's mode / N (None: not drawn, e.g. the
    multi_register panels, which draw per-writes lines only)."""
    if task == "multi_register":
        return None
    return f"N={r['n_distractors']}"


def _method_traces(fig, go, panels, mode, label, rs, c, col, erased_rs, fed_rs):
    """The lens / MDL rows of one line, its erased curve and its fed-state lens point."""
    x = [r["depth"] for r in rs]
    if erased_rs:
        fig.add_trace(go.Scatter(
            x=[r["depth"] for r in erased_rs], y=[r["accuracy"] for r in erased_rs], mode="lines+markers",
            name=f"{label}, erased at {erased_rs[0]['erased_at']}", legendgroup=label, showlegend=col == 1,
            line=dict(color=c, width=2, dash="dash"), marker=dict(size=5, color=c, symbol="x"),
            customdata=[[r["ci_low"], r["ci_high"]] for r in erased_rs],
            hovertemplate=(f"{mode}, {label}, after LEACE at depth {erased_rs[0]['erased_at']}<br>depth %{{x}}: "
                           "accuracy %{y:.3f}<br>95% CI [%{customdata[0]:.3f}, %{customdata[1]:.3f}]<extra></extra>")),
            row=1, col=col)
    if "lens" in panels:
        i = panels.index("lens") + 1
        custom = [[(r.get("logit_lens_ld_ci") or [None, None])[0], (r.get("logit_lens_ld_ci") or [None, None])[1],
                   r.get("logit_lens_rank"), r.get("logit_lens_accuracy")] for r in rs]
        fig.add_trace(go.Scatter(
            x=x, y=[r.get("logit_lens_ld") for r in rs], mode="lines+markers", name=f"{label} (lens)",
            legendgroup=label, showlegend=False, line=dict(color=c, width=2), marker=dict(size=5, color=c),
            customdata=custom,
            hovertemplate=(f"{mode}, {label}<br>depth %{{x}}: lens LD %{{y:.2f}}<br>95% CI [%{{customdata[0]:.2f}}, "
                           "%{customdata[1]:.2f}]<br>mean rank %{customdata[2]:.1f}, lens accuracy "
                           "%{customdata[3]:.3f}<extra></extra>")), row=i, col=col)
        for r in fed_rs:
            ci = r.get("logit_lens_ld_ci") or [None, None]
            fig.add_trace(go.Scatter(
                x=[-1], y=[r["logit_lens_ld"]], mode="markers", name=f"{label} (fed state lens)",
                legendgroup=label, showlegend=False, marker=dict(size=9, color=c, symbol="diamond"),
                customdata=[[ci[0], ci[1], r.get("logit_lens_rank"), r.get("logit_lens_accuracy")]],
                hovertemplate=(f"{mode}, {label}<br>fed state h_(T-1): lens LD %{{y:.2f}}<br>95% CI "
                               "[%{customdata[0]:.2f}, %{customdata[1]:.2f}]<br>mean rank %{customdata[2]:.1f}, "
                               "lens accuracy %{customdata[3]:.3f}<extra></extra>")), row=i, col=col)
    if "mdl" in panels:
        i = panels.index("mdl") + 1
        fig.add_trace(go.Scatter(
            x=x, y=[r.get("mdl_compression") for r in rs], mode="lines+markers", name=f"{label} (MDL)",
            legendgroup=label, showlegend=False, line=dict(color=c, width=2), marker=dict(size=5, color=c),
            customdata=[[r.get("mdl_online_bits"), r.get("mdl_uniform_bits")] for r in rs],
            hovertemplate=(f"{mode}, {label}<br>depth %{{x}}: compression %{{y:.2f}}<br>online %{{customdata[0]:.1f}}"
                           " bits, uniform %{customdata[1]:.1f} bits<extra></extra>")), row=i, col=col)


def loop_grid(rows) -> tuple[list[int], list[int], list[list[float | None]]]:
    """(iterations, core blocks, accuracy[block][iteration]) of a looped model's core rows of one (mode, N)."""
    its = sorted({r["loop"]["iteration"] for r in rows})
    blocks = sorted({r["loop"]["block"] for r in rows})
    cell = {(r["loop"]["block"], r["loop"]["iteration"]): r["accuracy"] for r in rows}
    return its, blocks, [[cell.get((b, i)) for i in its] for b in blocks]


def loop_core_rows(doc) -> list[dict]:
    """A probes document's rows on a looped model's core (rows with `loop`, part core), first writes setting."""
    return [r for r in doc["results"] if r.get("loop") and r["loop"]["part"] == "core" and r.get("writes") is None]


def iteration_heatmap(doc_or_path):
    """A looped model's probes (rows with `loop`): held-out accuracy per (core block, iteration), one panel per
    (mode, N) of the first writes setting; None for other models."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = loop_core_rows(_load(doc_or_path))
    if not rows:
        return None
    panels = sorted({(r["mode"], r["n_distractors"]) for r in rows}, key=lambda k: (_mode_key(k[0]), k[1]))
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[f"{m}, N = {n}" for m, n in panels],
                        horizontal_spacing=0.05)
    for col, (mode, n) in enumerate(panels, start=1):
        its, blocks, z = loop_grid([r for r in rows if r["mode"] == mode and r["n_distractors"] == n])
        text = [[f"{v:.2f}" if v is not None else "" for v in row] for row in z]
        fig.add_trace(go.Heatmap(z=z, x=its, y=[f"core block {b}" for b in blocks], zmin=0, zmax=1,
                                 colorscale="Viridis", showscale=col == 1, text=text, texttemplate="%{text}",
                                 hovertemplate="iteration %{x}, %{y}: accuracy %{z:.3f}<extra></extra>"),
                      row=1, col=col)
        fig.update_xaxes(title_text="iteration", row=1, col=col)
    fig.update_layout(title="Probe accuracy per loop iteration and core block (the last block's output is the loop "
                            "state s_i)", height=360, width=max(600, 380 * len(panels)))
    return fig


def render_html(doc_or_path, title: str | None = None, plotly: str = "directory") -> str:
    """HTML of the depth curves (and, for a looped model, the iteration x core-block heatmap below them); plotly.js
    as `plotly` says (directory: plotly.min.js beside the page)."""
    fig = depth_curve_figure(doc_or_path, title)
    html = fig.to_html(include_plotlyjs=include_plotlyjs(plotly), full_html=True, div_id=DIV_ID,
                       config={"displaylogo": False, "responsive": False})
    heat = iteration_heatmap(doc_or_path)
    if heat is not None:
        div = heat.to_html(include_plotlyjs=False, full_html=False, config={"displaylogo": False})
        html = html.replace("</body>", div + "</body>", 1)
    return html


def write_depth_curves(doc_or_path, path: str | Path, title: str | None = None, plotly: str = "directory") -> Path:
    """Write the HTML atomically (common.io.atomic_write: the temporary is removed on every exit path), and under
    "directory" plotly.min.js beside it first (only when missing or different)."""
    from common.io import atomic_write

    html = render_html(doc_or_path, title, plotly)
    write_plotly_js(Path(path).parent, plotly)
    return atomic_write(path, html)


# ----------------------------------------------------------------------------------------------------------
# headless Chromium
# ----------------------------------------------------------------------------------------------------------
def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        p = shutil.which(name)
        if p:
            return p
    return "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None


def chromium_cmd(chromium: str, user_data_dir: str, *extra: str) -> list[str]:
    return [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--no-first-run", "--disable-dev-shm-usage", f"--user-data-dir={user_data_dir}", *extra]


def html_to_png(html_path: str | Path, png_path: str | Path, width: int = 1200, height: int = 500,
                timeout: float = 120) -> Path:
    """Screenshot a local HTML page with headless Chromium."""
    chromium = find_chromium()
    if chromium is None:
        raise UserError("headless Chromium not found (install Debian `chromium`) — needed to write a PNG")
    html_path, png_path = Path(html_path).resolve(), Path(png_path).resolve()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as prof:
        tmp_png = Path(prof) / "shot.png"
        cmd = chromium_cmd(chromium, str(Path(prof) / "profile"), f"--screenshot={tmp_png}",
                           f"--window-size={width},{height}", "--hide-scrollbars",
                           "--virtual-time-budget=5000", html_path.as_uri())
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0 or not tmp_png.is_file():
            raise UserError(f"chromium screenshot failed (exit {r.returncode}): {r.stderr.strip()[-300:]}")
        shutil.move(str(tmp_png), png_path)
    return png_path


def figure_png(fig, png_path: str | Path, div_id: str, pad: int = 0) -> Path:
    """A plotly figure as a PNG at its own size: a temporary self-contained static page, screenshot by headless
    Chromium (so it needs neither a network nor plotly.min.js beside any page)."""
    width, height = int(fig.layout.width), int(fig.layout.height)
    with tempfile.TemporaryDirectory() as d:
        html = Path(d) / "page.html"
        html.write_text(fig.to_html(include_plotlyjs=True, full_html=True, div_id=div_id,
                                    config={"displayModeBar": False, "staticPlot": True}), encoding="utf-8")
        return html_to_png(html, png_path, width=width + pad, height=height + pad)


def write_png(doc_or_path, png_path: str | Path, title: str | None = None) -> Path:
    """PNG of the depth curves (for the README): render the HTML, screenshot it with headless Chromium."""
    fig = depth_curve_figure(doc_or_path, title)
    width, height = int(fig.layout.width), int(fig.layout.height)
    with tempfile.TemporaryDirectory() as d:
        html = Path(d) / "page.html"
        html.write_text(fig.to_html(include_plotlyjs=True, full_html=True, div_id=DIV_ID,
                                    config={"staticPlot": True}), encoding="utf-8")
        return html_to_png(html, png_path, width=width + 20, height=height + 20)


@cli_entry
def main(argv=None):
    from common.cli import Parser, add_overwrite_flag, add_plotly_flag, output_file

    p = Parser(prog="python -m probes.depth_curves", description=__doc__)
    p.add_argument("probes_json")
    p.add_argument("--html", help="output HTML (default: depth_curves.html beside the JSON, which a redraw "
                                  "replaces; a --html file that exists only with --overwrite)")
    p.add_argument("--png", help="also write a PNG (needs headless Chromium); an existing file only with --overwrite")
    add_overwrite_flag(p, "; here: an existing --html or --png file (the default page beside the JSON is always "
                          "redrawn)")
    add_plotly_flag(p)
    args = p.parse_args(argv)
    src = Path(args.probes_json)
    html = output_file(args.html, "--html") if args.html is not None else src.parent / "depth_curves.html"
    png = output_file(args.png, "--png") if args.png is not None else None
    for given, path in ((args.html, html), (args.png, png)):
        if given is not None and path.exists() and not args.overwrite:
            raise UserError(f"{path} exists; pass --overwrite to replace it")
    doc = load_results_doc(src, "probes.json")  # read once: a missing or bad file is one line, nothing written
    try:
        write_depth_curves(doc, html, plotly=args.plotly)
    except (KeyError, TypeError) as e:  # a hand-made or truncated file: its page is drawn into a temporary first
        raise UserError(f"{src} is not a probes.json this tool wrote ({type(e).__name__}: {e}): nothing "
                        "written") from None
    print(f"wrote {html}")
    if png:
        print(f"wrote {write_png(doc, png)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
