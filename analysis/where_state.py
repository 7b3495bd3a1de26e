"""Where each kind of feedback keeps its state: the looped model per iteration beside the fed-state verdicts.

Inputs, all written by the suite's own commands on the same task:
- ``--probes``: a looped model's probes.json (``python -m probes.run`` on a looped checkpoint: rows with ``loop``);
- ``--causal``: the same model's causal_report.json (``python -m interventions.run``: ``results.loop_iterations``);
- ``--feedback`` (repeatable): causal_report.json files of feedback models (their fed-state swap at T).

Each file is checked for what it must be (a probes.json: ``meta.schema`` fbprobe.probes/...; a causal report:
``schema.name`` causal-report, with the rows this page reads), and the files for one another: --probes and --causal
come from the same model (weights and config hashes, else the names) and every file from the same task
(probes.json ``meta.run.task``; a causal report's ``config.task_source.name``, else ``config.task``) and the same N
(the probe grid's ``n_distractors``, a causal report's ``config.distractors``); the probe grid and --causal must
run one loop (the same mode, else the same number of iterations). Within a file: a follows-donor CI must be
[low, high] in [0, 1] around its rate, a probe cell (mode, N, block, iteration) is given once, and --causal's
iterations are distinct and within 0..r. Anything else is refused in one line before anything is written.

Left panel: held-out probe accuracy per (core block, iteration i = 1..r) of the loop (the probes file's (mode, N)
of --causal's, else its first); the last core block's output at iteration i is the loop state s_i. Right panel, per
iteration i = 0..r (s_0 = the prelude's output): the share of answers that follow the donor when the loop state s_i
is swapped with the paired sample's at T only and at every position, with their 95% CIs, and the logit lens on s_i;
one horizontal line per feedback model at its fed-state swap's rate at T (the feedback's verdict: 1 = the answer
is read from the fed state alone). The right panel's title names the mode and N.

    python -m analysis.where_state --probes figures/tiny-loop-track/parity/probes.json \\
        --causal figures/tiny-loop-track/parity-causal/causal_report.json \\
        --feedback figures/tiny-fbt-track/parity-causal/causal_report.json --out docs/where_state.html --png docs/where_state.png
"""
from __future__ import annotations

from pathlib import Path

from analysis.length_curves import check_png, is_int, is_number, what_it_is, write_page
from common.cli import say
from common.cli import Parser, add_output_flags, add_plotly_flag, page_outputs
from common.errors import UserError, cli_entry
from common.jsonio import read_user_json
from common.paths import figures_dir
from common.plotlyjs import include_plotlyjs
from engine.modes import parse_mode
from probes.depth_curves import PALETTE, loop_core_rows, loop_grid, rgba

DIV_ID = "where-state"


# ----- reading and checking the inputs ----------------------------------------------------------------------------
def _rate_ok(v) -> bool:
    return v is None or (is_number(v) and 0 <= v <= 1)


def _obj(d, key: str, where: str) -> dict:
    v = d.get(key)
    if not isinstance(v, dict):
        raise UserError(f"{where}: no {key} object")
    return v


def check_probes(doc, where: str = "--probes") -> dict:
    """A probes.json (probes.run) with its meta (model, task) and well-formed loop rows, or one-line UserError."""
    meta = doc.get("meta") if isinstance(doc, dict) else None
    schema = meta.get("schema") if isinstance(meta, dict) else None
    if not (isinstance(schema, str) and schema.startswith("fbprobe.probes/")):
        other = what_it_is(doc, eval_json=True)
        raise UserError(f"{where} is not a probes.json (python -m probes.run): "
                        + (other or "no meta.schema fbprobe.probes/..."))
    if not isinstance(doc.get("results"), list):
        raise UserError(f"{where}: no results list")
    run, model = _obj(meta, "run", f"{where}: meta"), _obj(meta, "model", f"{where}: meta")
    if not isinstance(run.get("task"), str) or not isinstance(model.get("name"), str):
        raise UserError(f"{where}: meta.run.task and meta.model.name must name the task and the model")
    cells: dict[tuple, int] = {}
    for i, r in enumerate(doc["results"]):
        if not isinstance(r, dict):
            raise UserError(f"{where}: results[{i}] is not an object")
        if not r.get("loop"):
            continue
        lp, at = r["loop"], f"{where}: results[{i}]"
        if not isinstance(lp, dict) or not isinstance(lp.get("part"), str) or not is_int(lp.get("iteration")) \
                or not is_int(lp.get("block")):
            raise UserError(f"{at}: loop must be an object with part, iteration and block")
        if not isinstance(r.get("mode"), str) or not is_int(r.get("n_distractors")):
            raise UserError(f"{at}: a row needs its mode and n_distractors")
        if not (is_number(r.get("accuracy")) and 0 <= r["accuracy"] <= 1):
            raise UserError(f"{at}: accuracy must be a number in [0, 1], got {r.get('accuracy')!r}")
        if r.get("writes") is not None and not is_int(r.get("writes")):
            raise UserError(f"{at}: writes must be an integer or null, got {r.get('writes')!r}")
        cell = (r["mode"], r["n_distractors"], r.get("writes"), lp["part"], lp["block"], lp["iteration"])
        if cell in cells:  # was drawn last-wins
            raise UserError(f"{at}: results[{cells[cell]}] is the same cell ({lp['part']} block {lp['block']}, "
                            f"iteration {lp['iteration']}, {r['mode']}, N = {r['n_distractors']}"
                            + (f", writes {r['writes']}" if r.get("writes") is not None else "")
                            + "): a cell is given once")
        cells[cell] = i
    return doc


def check_causal(doc, where: str) -> dict:
    """A causal_report.json (interventions.run) with its model and task, or one-line UserError."""
    schema = doc.get("schema") if isinstance(doc, dict) else None
    if not (isinstance(schema, dict) and schema.get("name") == "causal-report"):
        other = what_it_is(doc, eval_json=True)
        raise UserError(f"{where} is not a causal_report.json (python -m interventions.run): "
                        + (other or "no schema causal-report"))
    model, config = _obj(doc, "model", where), _obj(doc, "config", where)
    _obj(doc, "results", where)
    if not isinstance(model.get("name"), str) or not isinstance(config.get("task"), str):
        raise UserError(f"{where}: model.name and config.task must name the model and the task")
    return doc


def _rate_row(r, key: str, at: str) -> None:
    m = r.get(key)
    if not isinstance(m, dict) or "follows_donor_rate" not in m or not _rate_ok(m["follows_donor_rate"]):
        raise UserError(f"{at}: {key} must hold follows_donor_rate (a rate in [0, 1] or null)")
    ci, rate = m.get("follows_donor_rate_ci"), m["follows_donor_rate"]
    if ci is None:
        return
    if not (isinstance(ci, list) and len(ci) == 2 and all(is_number(c) for c in ci)):
        raise UserError(f"{at}: {key}.follows_donor_rate_ci must be [low, high] or null")
    if not 0 <= ci[0] <= ci[1] <= 1:
        raise UserError(f"{at}: {key}.follows_donor_rate_ci {ci} must be [low, high] with 0 <= low <= high <= 1")
    if rate is None:
        raise UserError(f"{at}: {key}.follows_donor_rate_ci {ci} beside a null follows_donor_rate (an undefined rate "
                        "has no interval)")
    # (a rate outside its interval is not refused: a percentile interval over resampled groups of unequal sizes
    # can miss its own point, so a genuine report may hold one)


def _canonical(mode: str) -> str:
    try:
        return parse_mode(mode).name
    except UserError:
        return mode


def report_n(causal: dict) -> int | None:
    """A causal report's N (config.distractors; None where not recorded)."""
    n = causal["config"].get("distractors")
    return n if is_int(n) else None


def loop_r(lp: dict) -> int | None:
    """The r of --causal's loop (results.loop_iterations.iterations, else its loop-R mode's R; None: unknown)."""
    if lp.get("iterations") is not None:
        return lp["iterations"]
    try:
        m = parse_mode(lp["mode"])
    except UserError:
        return None
    if m.loop_iterations is not None:
        return m.loop_iterations
    return m.adaptive_exit[0] if m.adaptive_exit is not None else None  # loop-R:TOL: at most R


def probe_setting(probes: dict, causal: dict, names=("--probes", "--causal")) -> tuple[str, int]:
    """The (mode, N) of the probe grid drawn: at --causal's N (other N refused), under --causal's mode, else one
    with as many iterations as its loop (another loop refused); where --causal records no N, the first such."""
    rows = loop_core_rows(probes)
    if not rows:
        raise UserError(f"{names[0]}: no loop rows (run probes.run on a looped checkpoint)")
    settings = list(dict.fromkeys((r["mode"], r["n_distractors"]) for r in rows))
    n = report_n(causal)
    if n is not None:
        at_n = [st for st in settings if st[1] == n]
        if not at_n:
            ns = ", ".join(map(str, sorted({st[1] for st in settings})))
            raise UserError(f"{names[0]} holds its loop probes at N = {ns}, {names[1]} is at N = {n}: give files of "
                            "one N")
        settings = at_n
    lp, causal_rows = loop_swap_rows(causal, names[1])
    mode = _canonical(lp["mode"])
    r = loop_r(lp)
    r = r if r is not None else max(row["iteration"] for row in causal_rows)

    def its(st):
        return max(row["loop"]["iteration"] for row in rows if (row["mode"], row["n_distractors"]) == st)

    pick = next((st for st in settings if _canonical(st[0]) == mode), None) \
        or next((st for st in settings if its(st) == r), None)
    if pick is None:
        st = settings[0]
        raise UserError(f"{names[1]} runs {lp['mode']} ({r} iterations), {names[0]} probes {st[0]} ({its(st)} "
                        f"iterations) at N = {st[1]}: give files of one loop mode")
    return pick


def check_same_n(probes: dict, causal: dict, feedback: list[dict], names=("--probes", "--causal", ())) -> None:
    """--probes' grid, --causal and every --feedback report at one N (where a report records its N)."""
    mode, n = probe_setting(probes, causal, names[:2])
    for flag, fb in zip(names[2], feedback):
        if report_n(fb) is not None and report_n(fb) != n:
            ref = names[1] if report_n(causal) is not None else f"{names[0]} (its {mode} grid)"
            raise UserError(f"{flag} is at N = {report_n(fb)}, {ref} at N = {n}: give files of one N")


def loop_probe_grid(probes: dict, setting: tuple[str, int] | None = None) \
        -> tuple[str, list[int], list[int], list[list[float | None]]]:
    """(panel title, iterations, core blocks, accuracy[block][iteration]) of the loop rows of `setting` (mode, N),
    by default the first."""
    rows = loop_core_rows(probes)
    if not rows:
        raise UserError("--probes: no loop rows (run probes.run on a looped checkpoint)")
    mode, n = setting or (rows[0]["mode"], rows[0]["n_distractors"])
    its, blocks, z = loop_grid([r for r in rows if r["mode"] == mode and r["n_distractors"] == n])
    return f"probe accuracy per iteration ({mode}, N = {n})", its, blocks, z


def loop_swap_rows(causal: dict, where: str = "--causal") -> tuple[dict, list[dict]]:
    lp = (causal.get("results") or {}).get("loop_iterations")
    if not lp:
        raise UserError(f"{where}: no results.loop_iterations (run interventions.run on a looped checkpoint)")
    if not isinstance(lp, dict) or not isinstance(lp.get("rows"), list) or not lp["rows"]:
        raise UserError(f"{where}: results.loop_iterations needs a rows list (one row per iteration)")
    if not isinstance(lp.get("mode"), str):
        raise UserError(f"{where}: results.loop_iterations.mode must name the mode")
    if lp.get("iterations") is not None and not (is_int(lp["iterations"]) and lp["iterations"] >= 1):
        raise UserError(f"{where}: results.loop_iterations.iterations must be the loop's r (an integer >= 1), got "
                        f"{lp['iterations']!r}")
    r_max, seen = loop_r(lp), {}
    for i, r in enumerate(lp["rows"]):
        at = f"{where}: results.loop_iterations.rows[{i}]"
        if not isinstance(r, dict) or not is_int(r.get("iteration")):
            raise UserError(f"{at}: a row needs its iteration (an integer)")
        it = r["iteration"]
        if it < 0 or (r_max is not None and it > r_max):
            raise UserError(f"{at}: iteration {it} is outside 0.." + (f"{r_max} (the loop's r = {r_max})"
                                                                        if r_max is not None else "r"))
        if it in seen:
            raise UserError(f"{at}: iteration {it} is given twice (rows[{seen[it]}] too)")
        seen[it] = i
        for key in ("swap_T", "swap_all_positions"):
            _rate_row(r, key, at)
        if "lens_accuracy" not in r or not _rate_ok(r["lens_accuracy"]):
            raise UserError(f"{at}: lens_accuracy must be a number in [0, 1] or null")
    return lp, lp["rows"]


def fed_state_swap(causal: dict, where: str | None = None) -> dict:
    """The feedback model's fed-state swap at T (results.interventions, name state_swap)."""
    where = where or f"--feedback {(causal.get('model') or {}).get('name', '?')}"
    rows = (causal.get("results") or {}).get("interventions") or []
    if not isinstance(rows, list):
        raise UserError(f"{where}: results.interventions must be a list")
    for r in rows:
        if isinstance(r, dict) and r.get("name") == "state_swap":
            if not (is_number(r.get("follows_donor_rate")) and 0 <= r["follows_donor_rate"] <= 1):
                raise UserError(f"{where}: the state_swap row has no follows_donor_rate (a rate in [0, 1])")
            return r
    raise UserError(f"{where}: no state_swap row (a model with a fed state, under a recurrent mode)")


def check_solved(causal: dict, where: str) -> None:
    """Refuse a report whose model does not solve its task (clean accuracy under the verdict's 0.6 bar): its own
    verdict is "inconclusive", and a swap rate drawn from it would read as one that means something."""
    cfg, res = causal.get("config") or {}, causal.get("results") or {}
    clean = (res.get("clean") or {}).get(cfg.get("mode")) or {}
    acc = clean.get("accuracy")
    if is_number(acc) and acc < 0.6:
        raise UserError(f"{where}: the model does not solve the task there (clean accuracy {acc:.2f} under "
                        f"{cfg.get('mode')}, below the verdict's 0.6 bar: its report is inconclusive), so its swap "
                        "rates say nothing; use a run at an N the model solves")


def probes_task(probes: dict) -> str:
    return probes["meta"]["run"]["task"]


def causal_task(causal: dict) -> str:
    """The task's name: config.task_source.name (a custom task's config.task is its path), else config.task."""
    src = causal["config"].get("task_source")
    return src["name"] if isinstance(src, dict) and isinstance(src.get("name"), str) else causal["config"]["task"]


def _identity(name, weights, config) -> str:
    return name + (f" (weights {weights[:12]})" if isinstance(weights, str) else "")


def check_same_run(probes: dict, causal: dict, feedback: list[dict], names=("--probes", "--causal", ())) -> None:
    """--probes and --causal: one model (the weights' and config's hashes where both files carry them, else the
    names) and one task; every --feedback report: the same task."""
    pw, pc = probes["meta"]["model"].get("weights_sha256") or probes["meta"]["run"].get("weights"), \
        probes["meta"]["run"].get("config")
    cw, cc = causal["model"].get("weights_sha256"), causal["model"].get("config_sha256")
    pn, cn = probes["meta"]["model"]["name"], causal["model"]["name"]
    if isinstance(pw, str) and isinstance(cw, str):
        same = pw == cw and (not (isinstance(pc, str) and isinstance(cc, str)) or pc == cc)
    else:
        same = pn == cn
    if not same:
        raise UserError(f"{names[1]} is a report on {_identity(cn, cw, cc)}, {names[0]} on "
                        f"{_identity(pn, pw, pc)}: give both files of one model")
    task = probes_task(probes)
    for flag, doc in [(names[1], causal)] + list(zip(names[2], feedback)):
        if causal_task(doc) != task:
            raise UserError(f"{flag} is on task {causal_task(doc)!r}, {names[0]} on {task!r}: give files of one task")


# ----- the figure ---------------------------------------------------------------------------------------------------
def where_figure(probes: dict, causal: dict, feedback: list[dict]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    title, its, blocks, z = loop_probe_grid(probes, probe_setting(probes, causal))
    lp, rows = loop_swap_rows(causal)
    name = (causal.get("model") or {}).get("name", "looped model")
    n = report_n(causal)
    fig = make_subplots(rows=1, cols=2, column_widths=[0.45, 0.55], horizontal_spacing=0.13,
                        subplot_titles=[f"{name}: {title}",
                                        f"{name} ({lp['mode']}, " + (f"N = {n}" if n is not None else "N not recorded")
                                        + "): swap the loop state s_i with the donor's"])
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
        ci = row.get("follows_donor_rate_ci")
        ci_text = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if isinstance(ci, list) and len(ci) == 2 else ""
        fig.add_trace(go.Scatter(x=[x[0], x[-1]], y=[row["follows_donor_rate"]] * 2, mode="lines",
                                 name=f"{fb_name} ({row.get('mode')}): fed-state swap at T, follows donor "
                                      f"{row['follows_donor_rate']:.2f}{ci_text}",
                                 line=dict(color=PALETTE[(3 + k) % len(PALETTE)], dash="dash")), row=1, col=2)
    fig.update_xaxes(title_text="iteration i (the last core block's output is s_i)", row=1, col=1)
    fig.update_xaxes(title_text="iteration i (s_0 = the prelude's output)", row=1, col=2, dtick=1)
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
                   help="a feedback model's causal_report.json under a recurrent mode, on the same task (repeatable)")
    add_output_flags(p, "./figures/where_state.html", kind="file", out_extra=": the HTML page")
    p.add_argument("--png", help="also write a PNG here (needs headless Chromium)")
    add_plotly_flag(p)
    a = p.parse_args(argv)
    out, png = page_outputs(a.out if a.out is not None else figures_dir("where_state.html"), a.png, a.overwrite)
    check_png(out, png, a.plotly)
    w_probes, w_causal = f"--probes {a.probes}", f"--causal {a.causal}"
    w_feedback = [f"--feedback {f}" for f in a.feedback]
    probes = check_probes(read_user_json(a.probes, "probes.json"), w_probes)
    causal = check_causal(read_user_json(a.causal, "causal_report.json"), w_causal)
    feedback = [check_causal(read_user_json(f, "causal_report.json"), w) for f, w in zip(a.feedback, w_feedback)]
    loop_swap_rows(causal, w_causal)
    check_solved(causal, w_causal)
    for fb, w in zip(feedback, w_feedback):
        fed_state_swap(fb, w)
        check_solved(fb, w)
    check_same_run(probes, causal, feedback, (w_probes, w_causal, w_feedback))
    check_same_n(probes, causal, feedback, (w_probes, w_causal, w_feedback))
    fig = where_figure(probes, causal, feedback)
    html = fig.to_html(include_plotlyjs=include_plotlyjs(a.plotly), full_html=True, div_id=DIV_ID,
                       config={"displayModeBar": False})
    write_page(Path(out), html, png, fig, DIV_ID, a.plotly, a.overwrite)
    say(f"wrote {out}", *([f"wrote {png}"] if png else []))
    return 0


if __name__ == "__main__":
    main()
