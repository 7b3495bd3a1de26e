"""python -m analysis.demo: both verdicts of the suite side by side, in well under a minute on 2 idle CPU cores.

`make demo` runs it. Two studies, each a probes.run and an interventions.run (the quick budget) on the shipped
checkpoints, then one page, figures/demo/index.html, with the two verdicts, their depth curves, their key
numbers with 95% CIs and the command behind every number:

    decodable, not used    tiny-fbt on memory (N = 8), recurrent-1: the depth-0 probe reads the stored bit
                           after one recurrent step, yet swapping the fed state changes no answer
    necessary and used     tiny-fbt-track on parity (N = 32), recurrent-full: without its fed inputs the model
                           is at chance, and swapping the fed state (at T, or at each row's first position
                           after its differing line) makes the answer follow the donor

Each verdict is computed from the numbers by the rule printed beside it, never written in advance: a run whose
numbers do not meet either rule says "neither" and why. Outputs: figures/demo/<study>/ (probes.json,
depth_curves.html, causal_report.{json,md,html}) and figures/demo/index.html; an earlier demo is replaced only
with --overwrite, and only once both studies are complete (the study folders are replaced whole).
"""
from __future__ import annotations

import contextlib
import html
import io
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common.cli import Parser, add_output_flags, add_progress_flag, output_dir
from common.errors import UserError, cli_entry


@dataclass(frozen=True)
class Study:
    key: str  # the sub-folder of figures/demo/
    title: str
    model: str
    task: str
    mode: str  # the feedback mode intervened on
    n: int  # distractors
    n_pairs_probe: int
    n_pairs_battery: int
    claim: str  # what the study is expected to show (the page says whether the numbers show it)

    def probe_argv(self, out: Path) -> list[str]:
        return ["--task", self.task, "--model", self.model, "--modes", f"standard,{self.mode}", "--distractors",
                str(self.n), "--n-pairs", str(self.n_pairs_probe), "--out", str(out)]

    def battery_argv(self, out: Path) -> list[str]:
        return ["--task", self.task, "--model", self.model, "--mode", self.mode, "--distractors", str(self.n),
                "--n-pairs", str(self.n_pairs_battery), "--control-model", "none", "--out", str(out)]


STUDIES = (
    # memory, not completion: completion's groups hold out whole R values (tasks.generators), only 10 of them, and
    # there the depth-0 probe reads 0.95 [0.86, 1.00] at N = 8: decodable, short of this rule's CI low >= 0.9
    Study("memory", "Decodable, not used", "tiny-fbt", "memory", "recurrent-1", 8, 96, 60,
          "decodable, not used"),
    Study("parity", "Necessary and used", "tiny-fbt-track", "parity", "recurrent-full", 32, 48, 50,
          "necessary and used"),
)
FILES = ("probes.json", "causal_report.json")


def build_parser():
    p = Parser(prog="python -m analysis.demo", description=__doc__.split("\n\n")[0])
    add_output_flags(p, "./figures/demo/")
    add_progress_flag(p)
    return p


# ----- reading the two reports ---------------------------------------------------------------------------------
def _depth0(probes: dict, mode: str, n: int) -> dict:
    for r in probes["results"]:
        if r["mode"] == mode and r["depth"] == 0 and r["n_distractors"] == n and r.get("writes") is None:
            return r
    raise UserError(f"probes.json has no depth-0 row for {mode} at N = {n}")


def _row(report: dict, name: str) -> dict | None:
    for r in report["results"].get("interventions") or []:
        if r["name"] == name:
            return r
    return None


def key_numbers(study: Study, probes: dict, report: dict) -> dict:
    """The numbers the verdict rests on, each {value, ci, n} (None where the run has no such row)."""
    res = report["results"]

    def m(row, key):
        return None if row is None else {"value": row.get(key), "ci": row.get(key + "_ci"), "n": row.get("n")}

    def p(mode):
        r = _depth0(probes, mode, study.n)
        return {"value": r["accuracy"], "ci": [r["ci_low"], r["ci_high"]], "n": r["n_samples"]}

    sweep = res.get("position_sweep") or {}
    swap = _row(report, "state_swap")
    return {
        "probe_depth0_standard": p("standard"),
        "probe_depth0_feedback": p(study.mode),
        "accuracy_standard": m(res["clean"].get("standard"), "accuracy"),
        "accuracy_feedback": m(res["clean"].get(study.mode), "accuracy"),
        "swap_normalized_effect": m(swap, "normalized_effect"),
        "swap_follows_donor": m(swap, "follows_donor_rate"),
        "swap_changed": m(swap, "changed_rate"),
        "first_line_after_follows_donor": m(sweep.get("first_line_after"), "follows_donor_rate"),
        "bypass_at_T_accuracy": m(_row(report, "gate_bypass"), "accuracy"),
        "bypass_all_accuracy": m(_row(report, "gate_bypass_all"), "accuracy"),
        "chance": 1.0 / report["config"]["n_classes"],
    }


def _lo(x):
    return None if not x or not x.get("ci") else x["ci"][0]


def _hi(x):
    return None if not x or not x.get("ci") else x["ci"][1]


def judge(k: dict, report_label: str | None = None) -> tuple[str, str]:
    """(verdict, the rule it rests on), from the numbers alone.

    decodable: the depth-0 probe under feedback reads the label (CI low >= 0.9) where the standard one is at
    chance (CI high <= chance + 0.1); used: the state swap's normalized effect has CI low > 0.5; not used: its CI
    high < 0.1; necessary: the model answers (CI low >= 0.9) and feeding token embeddings at every position
    leaves it at chance (CI high <= chance + 0.15). `report_label`: the causal report's own verdict label, printed
    beside this one: "used" also needs it to be "causally used", "not used" "not detectably used" (a CI of
    0.06-0.09 is "not used" by the CI rule and "partly used" by the report's; a CI that misses its estimate is the
    report's "inconclusive"), so the page never says both."""
    chance = k["chance"]
    ok = lambda v: v is not None
    decodable = ok(_lo(k["probe_depth0_feedback"])) and _lo(k["probe_depth0_feedback"]) >= 0.9 and \
        _hi(k["probe_depth0_standard"]) <= chance + 0.1
    ne = k["swap_normalized_effect"]
    used = ok(_lo(ne)) and _lo(ne) > 0.5 and report_label in (None, "causally used")
    unused = ok(_hi(ne)) and _hi(ne) < 0.1 and report_label in (None, "not detectably used")
    solves = ok(_lo(k["accuracy_feedback"])) and _lo(k["accuracy_feedback"]) >= 0.9
    necessary = solves and ok(_hi(k["bypass_all_accuracy"])) and _hi(k["bypass_all_accuracy"]) <= chance + 0.15
    if not solves:
        return "neither: the model does not solve the task here", "clean accuracy CI low >= 0.9"
    if necessary and used:
        return ("necessary and used", "fed inputs removed at every position: accuracy CI high <= chance + 0.15; "
                                      "state swap at T: normalized effect CI low > 0.5")
    if decodable and unused:
        return ("decodable, not used", "depth-0 probe under feedback CI low >= 0.9, under standard CI high <= "
                                       "chance + 0.1; state swap at T: normalized effect CI high < 0.1")
    return ("neither rule holds", "see the numbers: decodable needs the probe, used/not used the swap's CI")


# ----- the page --------------------------------------------------------------------------------------------------
def _fmt(x, pct=False) -> str:
    if not x or x.get("value") is None:
        return "n/a"
    f = (lambda v: f"{100 * v:.0f}%") if pct else (lambda v: f"{v:.2f}")
    ci = f" [{f(x['ci'][0])}, {f(x['ci'][1])}]" if x.get("ci") else ""
    return f"{f(x['value'])}{ci} <span class=n>(n={x['n']})</span>"


LABELS = (
    ("probe_depth0_standard", "depth-0 probe, standard prefill", False),
    ("probe_depth0_feedback", "depth-0 probe, feedback mode", False),
    ("accuracy_standard", "answer accuracy, standard prefill", False),
    ("accuracy_feedback", "answer accuracy, feedback mode", False),
    ("bypass_all_accuracy", "accuracy with token embeddings fed at every position", False),
    ("bypass_at_T_accuracy", "accuracy with the token embedding fed at T only", False),
    ("swap_normalized_effect", "state swap at T: normalized effect", False),
    ("swap_follows_donor", "state swap at T: answers that follow the donor", True),
    ("swap_changed", "state swap at T: answers that change", True),
    ("first_line_after_follows_donor", "swap after the differing line: follows the donor", True),
)


def found_verdicts(studies, verdicts) -> str:
    """The intro's words for the verdicts these runs found (not the ones the studies claim)."""
    if len(verdicts) == 2 and verdicts[0] != verdicts[1] and set(verdicts) == {s.claim for s in studies}:
        return f"give opposite verdicts: {verdicts[0]}, and {verdicts[1]}"
    return "give these verdicts: " + "; ".join(f"{s.model}: {v}" for s, v in zip(studies, verdicts))


def page(studies, results, demo_cmd: str) -> str:
    from probes.depth_curves import depth_curve_figure

    cols = []
    for i, (st, (probes, report, k, (verdict, rule), cmds)) in enumerate(zip(studies, results)):
        fig = depth_curve_figure(probes, title=f"{st.task} on {st.model}: probe accuracy by depth")
        fig.update_layout(width=None, height=620, autosize=True)
        rows = "".join(f"<tr><td>{html.escape(label)}</td><td>{_fmt(k[key], pct)}</td></tr>"
                       for key, label, pct in LABELS if k.get(key))
        ok = verdict == st.claim
        cols.append(
            f"<div class=col><h2>{html.escape(st.title if ok else 'Claimed: ' + st.title.lower())}: "
            f"<code>{st.model}</code> on {st.task} "
            f"(N = {st.n}, {st.mode})</h2>"
            f"<p class='verdict {'ok' if ok else 'bad'}'>Verdict from the numbers: <b>{html.escape(verdict)}</b>"
            f"{'' if ok else ' (expected: ' + html.escape(st.claim) + ')'}</p>"
            f"<p class=rule>Rule: {html.escape(rule)}.</p>"
            f"<p>{html.escape(report['verdict']['sentence'])}</p>"
            f"<table>{rows}</table>"
            f"<p class=n>{report['dataset']['n_pairs']} pairs ({report['dataset']['n_samples']} samples) in the "
            f"battery, budget {report['config'].get('budget')}; 95% CIs by a bootstrap over groups. Chance "
            f"{k['chance']:.2f}.</p>"
            + "<div class=fig>" + fig.to_html(full_html=False, include_plotlyjs="directory" if i == 0 else False,
                                               default_width="100%", default_height="620px",
                                               config={"responsive": True}) + "</div>"
            + "<p>Reproduce:</p><pre>" + html.escape("\n".join(cmds)) + "</pre>"
            + f"<p>Full reports: <a href='{st.key}/causal_report.html'>causal report</a>, "
              f"<a href='{st.key}/depth_curves.html'>depth curves</a>, "
              f"<a href='{st.key}/causal_report.md'>markdown</a>.</p></div>")
    found = found_verdicts(studies, [v for _, _, _, (v, _), _ in results])
    style = ("body{font-family:sans-serif;margin:1.5em;max-width:1500px} .cols{display:flex;gap:2em}"
             ".col{flex:1;min-width:0} table{border-collapse:collapse} td{border-bottom:1px solid #ddd;"
             "padding:3px 8px} .n{color:#666;font-size:90%} .verdict{font-size:120%} .ok b{color:#1a7f37}"
             ".bad b{color:#b42318} .rule{color:#444;font-size:90%} pre{background:#f4f4f4;padding:6px;"
             "white-space:pre-wrap} .fig{clear:both;margin-top:1em;width:100%}")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>fbprobe demo: both verdicts</title>"
            f"<style>{style}</style></head><body><h1>Is latent feedback used, or only decodable?</h1>"
            "<p>A linear probe that reads the answer from the state fed back to layer 0 shows the answer is "
            "<i>there</i>; only an intervention on that state shows the model <i>uses</i> it. The same two "
            f"instruments on two shipped models {html.escape(found)}. Produced by <code>"
            f"{html.escape(demo_cmd)}</code>.</p><div class=cols>" + "".join(cols) + "</div></body></html>")


# ----- the run ----------------------------------------------------------------------------------------------------
@cli_entry
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from common.io import DirLock, remove_stale_tmp
    from common.paths import figures_dir
    from common.plotlyjs import stage_plotly_js
    from common.staged import Staged
    from interventions.report import write_report
    from interventions.run import main as battery
    from probes.run import main as probe

    out = output_dir(args.out if args.out is not None else figures_dir("demo"), "--out")
    quiet = ["--no-progress"] if args.no_progress else []
    t0 = time.perf_counter()
    results = []
    # Each study runs into a temporary folder; the study folders and the page replace an earlier demo together,
    # once both studies are complete: a demo killed midway leaves the earlier one whole, not half new.
    with DirLock(out, "demo"), Staged(out) as stage:
        remove_stale_tmp(out)  # the study folders a killed earlier demo left (this process holds the lock)
        # a study folder is replaced whole: any one there (demo files or not) and the page need --overwrite
        found = [f"{s.key}/" for s in STUDIES if (out / s.key).exists()]
        found += ["index.html"] if (out / "index.html").exists() else []
        if found and not args.overwrite:
            raise UserError(f"{out} already holds a demo ({', '.join(found)}); pass --overwrite or choose --out")
        said = []  # the studies' own lines, printed once their folders are in place, under their final names
        for st in STUDIES:
            sub, final = stage.dir(st.key), out / st.key
            print(f"[demo] {st.title.lower()}: {st.model} on {st.task}", file=sys.stderr, flush=True)
            with contextlib.redirect_stdout(io.StringIO()) as lines:
                if probe(st.probe_argv(sub) + quiet) != 0 or battery(st.battery_argv(sub) + quiet) != 0:
                    raise UserError(f"the {st.key} study failed")
            said.append(lines.getvalue().replace(str(sub), str(final)))
            probes = json.loads((sub / "probes.json").read_text())
            report = json.loads((sub / "causal_report.json").read_text())
            # the commands as they would be typed, with the folder the results end in (the report records its own)
            cmds = ["python -m probes.run " + " ".join(st.probe_argv(final)),  # the demo's own results are there:
                    "python -m interventions.run " + " ".join(st.battery_argv(final)) + " --overwrite"]  # replace them
            report["config"]["command"] = cmds[1] + "".join(f" {q}" for q in quiet)
            write_report(report, sub, overwrite=True)
            k = key_numbers(st, probes, report)
            results.append((probes, report, k, judge(k, (report.get("verdict") or {}).get("label")), cmds))
        text = page(STUDIES, results, "python -m analysis.demo" + (f" --out {args.out}" if args.out is not None else "")
                    + (" --overwrite" if args.overwrite else ""))
        stage_plotly_js(stage)
        stage.file("index.html", text)
        stage.commit()
    print("".join(said), end="")
    for s, r in zip(STUDIES, results):
        print(f"{s.model} on {s.task}: {r[3][0]}")
    print(f"wrote {out / 'index.html'} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
