"""The study's figures (plotly HTML, written atomically; plotly.js as --plotly says: by default one
plotly.min.js beside them, offline)."""
from __future__ import annotations

from pathlib import Path

from common.io import atomic_write
from common.plotlyjs import include_plotlyjs, write_plotly_js


def html(fig, path: Path, plotly: str = "directory"):
    write_plotly_js(path.parent, plotly)  # before the page: it never references a missing plotly.min.js
    atomic_write(path, fig.to_html(full_html=True, include_plotlyjs=include_plotlyjs(plotly)))


def mediation_t(n_groups: int | None) -> float:
    """The 95% quantile for a mean clustered over `n_groups` groups: Student's t with G - 1 degrees of freedom (1.96
    was too narrow for the 5-10 held-out groups of a task: 2.78 at 5); 1.96 for results that do not record G."""
    if not n_groups or n_groups < 2:
        return 1.96
    from scipy.stats import t

    return float(t.ppf(0.975, n_groups - 1))


def mediation_figure(med: dict, out: Path, plotly: str = "directory") -> None:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    c = med["conditions"]
    q = mediation_t(med.get("n_test_groups"))
    fig = make_subplots(rows=1, cols=2, subplot_titles=("change in LD vs base (held-out)", "accuracy"))
    fig.add_trace(go.Bar(x=list(c), y=[v["mean_ld_change"] for v in c.values()], showlegend=False,
                         error_y={"type": "data",  # 95% bars from the group-clustered s.e. (none: one group)
                                  "array": [q * (v["ld_change_se"] or 0.0) for v in c.values()]}),
                  row=1, col=1)
    fig.add_trace(go.Bar(x=list(c), y=[v["accuracy"] for v in c.values()], showlegend=False), row=1, col=2)
    fig.update_layout(title=f"Mediation on {med['task']} ({med['config']}; rank-{med['rank']} probe subspace "
                            f"at depth {med['probe_depth']})")
    html(fig, out / "mediation.html", plotly)


def targeted_figure(tg: dict, out: Path, plotly: str = "directory") -> None:
    """(g): accuracy change and LD change vs alpha, uniform vs targeted, with their 95% bootstrap CI bands."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    pts = tg["points"]
    x = [p["alpha"] for p in pts]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("accuracy change vs base", "LD change vs base"))
    colors = {"uniform": "31, 119, 180", "targeted": "214, 39, 40"}
    for col, key in ((1, "accuracy_change"), (2, "ld_change")):
        for cond, rgb in colors.items():
            cis = [p[cond][key + "_ci"] for p in pts]
            if all(ci is not None for ci in cis):
                fig.add_trace(go.Scatter(x=x + x[::-1], y=[ci[1] for ci in cis] + [ci[0] for ci in cis][::-1],
                                         fill="toself", fillcolor=f"rgba({rgb}, 0.15)", line={"width": 0},
                                         hoverinfo="skip", showlegend=False, legendgroup=cond), row=1, col=col)
            fig.add_trace(go.Scatter(x=x, y=[p[cond][key] for p in pts], mode="lines+markers", name=cond,
                                     line={"color": f"rgb({rgb})"}, legendgroup=cond, showlegend=col == 1),
                          row=1, col=col)
        fig.add_hline(y=0, line={"color": "gray", "width": 1, "dash": "dot"}, row=1, col=col)
        fig.update_xaxes(title_text="alpha", row=1, col=col)
    fa = tg["failure_alpha"]
    fail = ", ".join(f"{c} {fa[c] if fa[c] is not None else 'not reached'}" for c in fa)
    fig.update_layout(title=f"Targeted vs uniform recirculation on {tg['task']} ({tg['spec']}; base accuracy "
                            f"{tg['base']['accuracy']:.3f}, LD {tg['base']['mean_ld']:+.3f}; failure "
                            f"(accuracy -{tg['fail_drop']:g}) at alpha: {fail})")
    html(fig, out / "targeted.html", plotly)


def write_figures(res: dict, out: Path, plotly: str = "directory") -> None:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    cells = res["heatmap"]["cells"]
    srcs = sorted({c["source"] for c in cells})
    tgts = sorted({c["target"] for c in cells})
    fig = make_subplots(rows=1, cols=2, subplot_titles=("convex (beta = 1 - alpha)", "residual (beta = 1)"))
    vmax = max(1e-9, max(abs(c["ppl_change_pct"]) for c in cells))
    for i, mode in enumerate(("convex", "residual")):
        z = [[next((c["ppl_change_pct"] for c in cells if c["mode"] == mode and c["source"] == s
                    and c["target"] == d), None) for d in tgts] for s in srcs]
        fig.add_trace(go.Heatmap(z=z, x=[str(d) for d in tgts], y=[str(s) for s in srcs], zmid=0, zmin=-vmax,
                                 zmax=vmax, colorscale="RdBu_r", showscale=i == 1,
                                 colorbar={"title": "ppl change %"},
                                 hovertemplate="source %{y} -> target %{x}: %{z:+.2f}%<extra></extra>"),
                      row=1, col=i + 1)
        fig.update_xaxes(title_text="target depth d", row=1, col=i + 1)
        fig.update_yaxes(title_text="source depth s", row=1, col=i + 1)
    fig.update_layout(title=f"{res['model']}: perplexity change at alpha = {res['heatmap']['alpha']} "
                            f"(tuning split; chosen {res['best']['name']}, held-out "
                            f"{res['best']['test_ppl_change_pct']:+.2f}%)")
    html(fig, out / "heatmap.html", plotly)

    pts = res["dose"]["points"]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(go.Scatter(x=[p["alpha"] for p in pts], y=[p["test_ppl_change_pct"] for p in pts],
                             name="held-out ppl change %", mode="lines+markers"))
    fig.add_trace(go.Scatter(x=[p["alpha"] for p in pts], y=[p["tune_ppl_change_pct"] for p in pts],
                             name="tuning ppl change %", mode="lines+markers", line={"dash": "dot"}))
    fig.add_trace(go.Scatter(x=[p["alpha"] for p in pts], y=[max(p["test_kl"], 1e-12) for p in pts],
                             name="held-out KL(base || recirc)", mode="lines+markers"), secondary_y=True)
    fig.update_yaxes(title_text="ppl change %", secondary_y=False)
    fig.update_yaxes(title_text="KL (nats/token)", type="log", secondary_y=True)
    fig.update_xaxes(title_text="alpha")
    fa = res["dose"]["failure_alpha"]
    fig.update_layout(title=f"Dose-response, {res['dose']['mode']} s={res['dose']['pair'][0]} "
                            f"d={res['dose']['pair'][1]}; failure (> +{res['dose']['fail_threshold_pct']}%) at "
                            f"alpha = {fa if fa is not None else 'not reached'}")
    html(fig, out / "dose.html", plotly)

    t = res["temperature"]
    labels = [f"temperature only (T={t['t_temperature_only']})", "recirculation only",
              f"both (T={t['t_both']})", "sum of the two parts"]
    vals = [t["temperature_only_pct"], t["recirculation_only_pct"], t["both_pct"], t["sum_of_parts_pct"]]
    fig = go.Figure(go.Bar(x=labels, y=vals, text=[f"{v:+.3f}%" for v in vals], textposition="outside"))
    fig.update_layout(title="Temperature additivity (held-out ppl change vs base at T = 1)",
                      yaxis_title="ppl change %")
    html(fig, out / "temperature.html", plotly)

    bz = res["basis"]["ppl_change_pct"]
    fig = go.Figure(go.Bar(x=list(bz), y=list(bz.values()), text=[f"{v:+.3f}%" for v in bz.values()],
                           textposition="outside"))
    fig.update_layout(title=f"Basis test at {res['best']['name']} (held-out): z_s as is vs small rotation "
                            f"(mean cos {res['basis']['small_rotation_mean_cos']:.3f}) vs random orthogonal",
                      yaxis_title="ppl change %")
    html(fig, out / "basis.html", plotly)

    med = res.get("mediation")
    if isinstance(med, dict):
        mediation_figure(med, out, plotly)
    tg = res.get("targeted")
    if isinstance(tg, dict):
        targeted_figure(tg, out, plotly)

    rows = res["cost"]["rows"]
    fig = make_subplots(rows=1, cols=3, subplot_titles=("tokens/s", "peak RSS increase (MB)",
                                                        "ppl gap vs sequential (%)"))
    for i, key in enumerate(("tokens_per_s", "peak_rss_increase_mb", "ppl_gap_vs_sequential_pct")):
        fig.add_trace(go.Bar(x=[r["method"] for r in rows], y=[r[key] for r in rows], showlegend=False),
                      row=1, col=i + 1)
    fig.update_layout(title=f"Cost of recirculated prefill ({res['cost']['config']}, block {res['cost']['block']})")
    html(fig, out / "cost.html", plotly)
    return ["heatmap.html", "dose.html", "temperature.html", "basis.html", "cost.html"] + \
        (["mediation.html"] if isinstance(med, dict) else []) + (["targeted.html"] if isinstance(tg, dict) else [])

