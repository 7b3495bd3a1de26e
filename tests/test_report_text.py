"""The causal report's words and marks against its numbers (interventions.report): a null CI is said, never drawn
as a bar of width 0; the verdict prints its rule; a task file is named by its header; the depth-curve page names
only marks it draws."""
from __future__ import annotations

import json

import pytest


def test_a_null_interval_is_no_bar_and_reads_n_a():
    from interventions import report as rp

    assert rp._cis(None) == "[n/a]" and rp._cis([0.1, 0.2]) == "[0.10, 0.20]"
    assert rp._task_name({"task": "/tmp/x/last_write.jsonl", "task_source": {"name": "last_write"}}) == "last_write"
    assert rp._task_name({"task": "parity"}) == "parity"


def test_the_report_page_draws_no_bar_for_a_null_ci_and_prints_its_rule(tiny_ckpt, tmp_path):
    from interventions.run import main

    out = tmp_path / "r"
    assert main(["--model", str(tiny_ckpt), "--task", "completion", "--n-pairs", "10", "--distractors", "2",
                 "--control-model", "none", "--n-boot", "50", "--no-progress", "--out", str(out)]) == 0
    rep = json.loads((out / "causal_report.json").read_text())
    assert "causally used where its lower end exceeds 0.5, partly used above 0.05" in rep["verdict"]["sentence"]
    from interventions.report import verdict

    swap = next(r for r in rep["results"]["interventions"] if r["name"] == "state_swap")
    rep["results"]["clean"][rep["config"]["mode"]]["accuracy"] = 1.0
    swap["normalized_effect"], swap["normalized_effect_ci"] = 0.51, [0.69, 2.65]  # a CI that misses its estimate
    label, sentence = verdict(rep)
    assert label == "inconclusive (the effect's bootstrap CI does not contain its estimate)", label
    assert "or a CI that misses its estimate" in sentence
    swap["normalized_effect"] = 0.9  # inside it: the rule judges by the lower end
    assert verdict(rep)[0] == "causally used"
    # one row's CI made null: its error bar is none, the others keep theirs
    rep["results"]["interventions"][0]["normalized_effect_ci"] = None
    from interventions.report import html_report

    page = html_report(rep, "cdn")
    at = page.index('"error_y":') + len('"error_y":')
    bar, _ = json.JSONDecoder().raw_decode(page[at:])  # the first figure's first trace: the interventions at T
    n = len(rep["results"]["interventions"])
    assert bar["array"][0] is None and bar["arrayminus"][0] is None  # no bar, not a bar of width 0
    assert all(v is not None for v in bar["array"][1:n])
