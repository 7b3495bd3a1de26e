"""Markdown tables of docs/results.md's SmolLM2 sections: causal verdicts from causal_report.json files, or with
--targeted the targeted-vs-uniform table of analysis.recirculation's results.json (experiment (g)).

    python scripts/verdict_table.py figures/smollm2-135m/ioi-recirc-*/causal_report.json
    python scripts/verdict_table.py --targeted figures/smollm2-135m/targeted-ioi/results.json

Per report: task, mode, N, samples, clean accuracy (standard and the mode), the fed-state swap at T (normalized
effect with its 95% CI), the position sweep pooled over the positions after each pair's first differing token and
its largest cell (relative position), and the report's verdict label (interventions.report.verdict).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without an install

from common.cli import Parser  # noqa: E402
from common.errors import UserError, cli_entry  # noqa: E402
from common.jsonio import read_user_json  # noqa: E402
from interventions.report import verdict  # noqa: E402


def _ne(row) -> str:
    if not row or row.get("normalized_effect") is None:
        return "n/a"
    ci = row.get("normalized_effect_ci")
    return f"{row['normalized_effect']:.2f}" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def row_of(report: dict) -> str:
    cfg, res = report["config"], report["results"]
    mode = cfg["mode"]
    clean = res["clean"]
    swap = next((r for r in res.get("interventions") or [] if r["name"] == "state_swap"), None)
    sweep = res.get("position_sweep") or {}
    after = [r for r in sweep.get("by_first_diff") or [] if r["relative"] > 0 and r.get("normalized_effect") is not None]
    best = max(after, key=lambda r: r["normalized_effect"], default=None)
    best_txt = f"{_ne(best)} at +{best['relative']}" if best else "n/a"
    label, _ = verdict(report)
    acc = f"{clean['standard']['accuracy']:.2f} / {clean[mode]['accuracy']:.2f}"
    return (f"| {cfg['task']} | `{mode}` | {cfg['distractors']} | {clean[mode]['n']} | {acc} | {_ne(swap)} | "
            f"{_ne(sweep.get('after_first_diff'))} | {best_txt} | {label} |")


def _pm(point: dict, key: str, nd: int = 3) -> str:
    ci = point.get(key + "_ci")
    return f"{point[key]:+.{nd}f}" + (f" [{ci[0]:+.{nd}f}, {ci[1]:+.{nd}f}]" if ci else "")


def _alpha(a) -> str:
    return "none in the grid" if a is None else f"{a:g}"


def targeted_rows(res: dict) -> list[str]:
    """One row per alpha: accuracy and LD change against base, uniform and targeted, with their 95% CIs."""
    t = res["targeted"]
    b = t["base"]
    out = [f"{t['task']} (N = {t['n_distractors']}, {t['n']} prompts, {t['n_groups']} groups), `{t['spec']}`; base "
           f"accuracy {b['accuracy']:.3f}, LD {b['mean_ld']:+.2f}; failure alpha (accuracy more than "
           f"{t['fail_drop']:g} below base): uniform {_alpha(t['failure_alpha']['uniform'])}, targeted "
           f"{_alpha(t['failure_alpha']['targeted'])}", "",
           "| alpha | uniform: accuracy change | uniform: LD change | targeted: accuracy change | targeted: LD change |",
           "|---|---|---|---|---|"]
    for pt in t["points"]:
        u, g = pt["uniform"], pt["targeted"]
        out.append(f"| {pt['alpha']:g} | {_pm(u, 'accuracy_change')} | {_pm(u, 'ld_change')} | "
                   f"{_pm(g, 'accuracy_change')} | {_pm(g, 'ld_change')} |")
    return out


def _file(path: str, name: str) -> Path:
    f = Path(path)
    f = f / name if f.is_dir() else f
    if not f.is_file():
        raise UserError(f"no {name} at {path}")
    return f


@cli_entry
def main(argv=None) -> None:
    p = Parser(prog="python scripts/verdict_table.py", description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", help="causal_report.json files (or folders holding one); with --targeted "
                                               "analysis.recirculation results.json files (or their folders)")
    p.add_argument("--targeted", action="store_true", help="the targeted-vs-uniform tables of experiment (g)")
    a = p.parse_args(argv)
    if a.targeted:
        for path in a.reports:
            res = read_user_json(_file(path, "results.json"), "recirculation results")
            if not isinstance(res, dict) or not isinstance(res.get("targeted"), dict):
                raise UserError(f"{path} holds no targeted-vs-uniform results (run --targeted)")
            print("\n".join(targeted_rows(res)) + "\n")
        return
    rows = []  # every file read and checked before the table starts
    for path in a.reports:
        report = read_user_json(_file(path, "causal_report.json"), "causal report")
        try:
            rows.append(row_of(report))
        except (KeyError, TypeError, IndexError, AttributeError) as e:
            raise UserError(f"{path} is not a causal_report.json of interventions.run ({type(e).__name__}: "
                            f"{e})") from None
    print("| task | mode | N | n | clean acc (standard / mode) | state swap at T | sweep after the first diff "
          "(pooled) | largest sweep cell | verdict |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
