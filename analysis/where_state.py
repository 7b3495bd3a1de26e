"""Where each kind of feedback keeps its state: the looped model per iteration beside the fed-state verdicts.

Inputs, all written by the suite's own commands on the same task:
- ``--probes``: a looped model's probes.json (``python -m probes.run`` on a looped checkpoint: rows with ``loop``);
- ``--causal``: the same model's causal_report.json (``python -m interventions.run``: ``results.loop_iterations``);
- ``--feedback`` (repeatable): causal_report.json files of feedback models (their fed-state swap at T).

Left panel: held-out probe accuracy per (core block, iteration) of the loop (the first (mode, N) in the probes
file). Right panel, per iteration i = 0..r: the share of answers that follow the donor when the loop state s_i is
swapped with the paired sample's at T only and at every position, with their 95% CIs, and the logit lens on s_i;
one horizontal line per feedback model at its fed-state swap's rate at T (the feedback's verdict: 1 = the answer
is read from the fed state alone).

    python -m analysis.where_state --probes figures/tiny-loop-track/parity/probes.json \\
        --causal figures/tiny-loop-track/parity-causal/causal_report.json \\
        --feedback figures/tiny-fbt-track/parity-causal/causal_report.json --out docs/where_state.html --png docs/where_state.png
"""
from __future__ import annotations

from common.cli import Parser, add_output_flags, add_plotly_flag, page_outputs
from common.errors import UserError, cli_entry
from common.io import atomic_write
from common.jsonio import read_user_json
from common.paths import figures_dir
from common.plotlyjs import include_plotlyjs, write_plotly_js
from probes.depth_curves import PALETTE, load_results_doc, loop_core_rows, loop_grid, rgba

DIV_ID = "where-state"


def loop_probe_grid(probes: dict) -> tuple[str, list[int], list[int], list[list[float | None]]]:
    """(panel title, iterations, core blocks, accuracy[block][iteration]) of the first (mode, N) of the loop rows."""
    rows = loop_core_rows(probes)
    if not rows:
        raise UserError("--probes: no loop rows (run probes.run on a looped checkpoint)")
    mode, n = rows[0]["mode"], rows[0]["n_distractors"]
    its, blocks, z = loop_grid([r for r in rows if r["mode"] == mode and r["n_distractors"] == n])
    return f"probe accuracy per iteration ({mode}, N = {n})", its, blocks, z


def loop_swap_rows(causal: dict) -> tuple[dict, list[dict]]:
    lp = (causal.get("results") or {}).get("loop_iterations")
    if not lp or not lp.get("rows"):
        raise UserError("--causal: no results.loop_iterations (run interventions.run on a looped checkpoint)")
    return lp, lp["rows"]


def fed_state_swap(causal: dict) -> dict:
    """The feedback model's fed-state swap at T (results.interventions, name state_swap)."""
    for r in (causal.get("results") or {}).get("interventions") or []:
        if r.get("name") == "state_swap":
            return r
    raise UserError(f"--feedback {causal.get('model', {}).get('name', '?')}: no state_swap row (a model with a "
                    "fed state, under a recurrent mode)")


def where_figure(probes: dict, causal: dict, feedback: list[dict]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    title, its, blocks, z = loop_probe_grid(probes)
    lp, rows = loop_swap_rows(causal)
    name = (causal.get("model") or {}).get("name", "looped model")
    fig = make_subplots(rows=1, cols=2, column_widths=[0.45, 0.55], horizontal_spacing=0.13,
                        subplot_titles=[f"{name}: {title}",
                                        f"{name} ({lp['mode']}): swap the loop state s_i with the donor's"])
    fig.add_trace(go.Heatmap(z=z, x=its, y=[f"core block {b}" for b in blocks], zmin=0, zmax=1, colorscale="Viridis",
                             text=[[f"{v:.2f}" if v is not None else "" for v in row] for row in z],
                             texttemplate="%{text}", colorbar=dict(x=0.41, len=0.9, thickness=14),
                             hovertemplate="iteration %{x}, %{y}: accuracy %{z:.3f}<extra></extra>"), row=1, col=1)
    x = [r["iteration"] for r in rows]
    series = (("swap at T", lambda r: r["swap_T"]), ("swap at every position", lambda r: r["swap_all_positions"]))
    for k, (label, get) in enumerate(series):
        color = PALETTE[k % len(PALETTE)]
        y = [get(r)["follows_donor_rate"] for r in rows]
        ci = [get(r).get("follows_donor_rate_ci") for r in rows]
        if all(ci):
            fig.add_trace(go.Scatter(x=x + x[::-1], y=[c[1] for c in ci] + [c[0] for c in ci][::-1], fill="toself",
                                     mode="lines", line=dict(width=0), fillcolor=rgba(color, 0.15), hoverinfo="skip",
                                     showlegend=False), row=1, col=2)
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name=f"{name}: {label}, follows donor",
                                 line=dict(color=color)), row=1, col=2)
    fig.add_trace(go.Scatter(x=x, y=[r["lens_accuracy"] for r in rows], mode="lines+markers",
                             name=f"{name}: logit lens on s_i, accuracy", line=dict(color=PALETTE[2], dash="dot")),
                  row=1, col=2)
    for k, fb in enumerate(feedback):
        row = fed_state_swap(fb)
        fb_name = (fb.get("model") or {}).get("name", f"feedback {k}")
        fig.add_trace(go.Scatter(x=[x[0], x[-1]], y=[row["follows_donor_rate"]] * 2, mode="lines",
                                 name=f"{fb_name} ({row.get('mode')}): fed-state swap at T, follows donor",
                                 line=dict(color=PALETTE[(3 + k) % len(PALETTE)], dash="dash")), row=1, col=2)
    fig.update_xaxes(title_text="iteration i (0 = the prelude's output)", row=1, col=1)
    fig.update_xaxes(title_text="iteration i", row=1, col=2, dtick=1)
    fig.update_yaxes(range=[0, 1.02], title_text="rate", row=1, col=2)
    fig.update_layout(template="plotly_white", width=1300, height=480, legend=dict(font=dict(size=10), y=-0.25,
                                                                                   orientation="h"),
                      title="Where the state lives: looped depth per iteration, beside across-position feedback")
    return fig


@cli_entry
def main(argv=None):
    p = Parser(prog="python -m analysis.where_state", description=__doc__)
    p.add_argument("--probes", required=True, help="the looped model's probes.json (probes.run)")
    p.add_argument("--causal", required=True, help="the looped model's causal_report.json (interventions.run)")
    p.add_argument("--feedback", action="append", default=[], metavar="CAUSAL_REPORT",
                   help="a feedback model's causal_report.json under a recurrent mode (repeatable)")
    add_output_flags(p, "./figures/where_state.html", kind="file", out_extra=": the HTML page")
    p.add_argument("--png", help="also write a PNG here (needs headless Chromium)")
    add_plotly_flag(p)
    a = p.parse_args(argv)
    out, png = page_outputs(a.out if a.out is not None else figures_dir("where_state.html"), a.png, a.overwrite)
    probes = load_results_doc(a.probes, "probes.json")
    causal = read_user_json(a.causal, "causal_report.json")
    feedback = [read_user_json(f, "causal_report.json") for f in a.feedback]
    fig = where_figure(probes, causal, feedback)
    write_plotly_js(out.parent, a.plotly)
    atomic_write(out, fig.to_html(include_plotlyjs=include_plotlyjs(a.plotly), full_html=True, div_id=DIV_ID,
                                  config={"displayModeBar": False}))
    print(f"wrote {out}")
    if png:
        from probes.depth_curves import figure_png

        figure_png(fig, png, DIV_ID)
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    main()
