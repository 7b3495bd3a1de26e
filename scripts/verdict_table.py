"""One markdown table of causal verdicts from several causal_report.json files (docs/results.md's SmolLM2 tables).

    python scripts/verdict_table.py figures/smollm2-135m/ioi-recirc-*/causal_report.json

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


@cli_entry
def main(argv=None) -> None:
    p = Parser(prog="python scripts/verdict_table.py", description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", help="causal_report.json files (or folders holding one)")
    a = p.parse_args(argv)
    print("| task | mode | N | n | clean acc (standard / mode) | state swap at T | sweep after the first diff "
          "(pooled) | largest sweep cell | verdict |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in a.reports:
        f = Path(path)
        f = f / "causal_report.json" if f.is_dir() else f
        if not f.is_file():
            raise UserError(f"no causal_report.json at {path}")
        print(row_of(read_user_json(f, "causal report")))


if __name__ == "__main__":
    main()
