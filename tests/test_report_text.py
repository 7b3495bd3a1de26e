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


def _report_with_swap(ne, ci, acc=1.0):
    """A minimal report the verdict reads: a clean run, a state swap and a skipped subspace."""
    row = {"name": "state_swap", "normalized_effect": ne, "normalized_effect_ci": ci, "follows_donor_rate": 0.5,
           "follows_donor_rate_ci": [0.4, 0.6], "changed_rate": 0.5, "changed_rate_ci": [0.4, 0.6], "n": 32,
           "n_groups": 16}
    return {"config": {"task": "parity", "mode": "recurrent-full", "distractors": 8},
            "model": {"name": "m"},
            "results": {"clean": {"recurrent-full": {"accuracy": acc, "accuracy_ci": [0.5, 1.0], "n": 32}},
                        "interventions": [row], "subspace": {"rank": 1, "skipped": "test", "rows": []}}}


def test_the_verdict_names_an_effect_away_from_the_donor_and_judges_nothing_without_an_interval():
    from interventions.report import verdict

    assert verdict(_report_with_swap(-3.0, [-5.0, -1.0]))[0] == "used in reverse"  # a CI wholly below 0 detects
    assert verdict(_report_with_swap(-0.01, [-0.2, 0.1]))[0] == "not detectably used"
    assert verdict(_report_with_swap(0.9, None))[0].startswith("inconclusive")  # no CI: not "not detectably used"
    assert verdict(_report_with_swap(None, None))[0].startswith("inconclusive")
    assert verdict(_report_with_swap(1.6, [1.2, 2.0]))[0] == "causally used"
    assert "used in reverse where its upper end is below -0.05" in verdict(_report_with_swap(0.0, [-0.1, 0.1]))[1]


def test_a_clean_accuracy_under_the_bar_never_reads_as_the_bar():
    from interventions.report import _f, _places, verdict

    label, sentence = verdict(_report_with_swap(0.9, [0.8, 1.0], acc=239 / 400))  # 0.5975: under 0.6
    assert label.startswith("inconclusive") and "clean accuracy 0.598" in sentence
    assert "clean accuracy 1.00" in verdict(_report_with_swap(0.9, [0.8, 1.0]))[1]
    assert _places(0.6, 0.6) == 2 and _places(0.594, 0.6) == 2 and _places(0.5951, 0.6) == 3
    # a value that rounds to zero has no sign: a CI [0.00, -0.00] would read lo > hi
    assert [_f(-0.0), _f(-0.004), _f(-0.006), _f(-0.001, pct=True), _f(-0.0004, 3)] == \
        ["0.00", "0.00", "-0.01", "0%", "0.000"]


def test_the_loop_clause_says_from_an_iteration_only_where_every_later_one_holds():
    from interventions.report import _loop_clause

    def res(rates):
        rows = [{"iteration": i, "swap_T": {"follows_donor_rate": v, "follows_donor_rate_ci": None},
                 "swap_all_positions": {"follows_donor_rate": v, "follows_donor_rate_ci": None}}
                for i, v in enumerate(rates)]
        return {"loop_iterations": {"rows": rows, "mode": "loop-4", "iterations": 4}}

    assert "at T at iteration 1 only, not the last (at most 0.90)" in _loop_clause(res([0.1, 0.9, 0.2, 0.1, 0.05]))
    assert "at T from iteration 3 (0.70" in _loop_clause(res([0.1, 0.9, 0.4, 0.7, 0.8]))
    assert "at T at no iteration (at most 0.40)" in _loop_clause(res([0.1, 0.4, 0.2]))


def test_the_largest_layer_patching_effect_leaves_out_the_donors_own_output():
    from interventions.report import _resid_clause

    lp = {"modes": ["standard"], "depths": [0, 1, 2], "positions": ["T-1", "T"], "top_depth": {"standard": 2},
          "standard": {"normalized_effect": [[0.1, 0.7], [0.2, 0.4], [0.0, 1.0]]}}
    text = _resid_clause({"layer_patching": lp})
    assert "largest normalized effect is 0.70 at depth 0, position T (leaving out depth 2 at T" in text
    lp["depths"], lp["top_depth"] = [0, 1, 2], {"standard": 4}  # a subset below the top: nothing left out
    assert "is 1.00 at depth 2, position T" in _resid_clause({"layer_patching": lp})


def test_the_largest_layer_patching_effect_carries_its_ci_and_is_not_read_off_a_model_at_chance():
    """A model at chance (clean LD ~2e-4) had "the largest normalized effect is 0.83 at depth 0" in its verdict:
    a ratio over a denominator near 0, its CI [-6.06, 19.47] unsaid. The CI is said now, and a model under the
    verdict's 0.6 bar gets no largest effect."""
    from interventions.report import _resid_clause

    lp = {"modes": ["standard"], "depths": [0, 1], "positions": ["T-1", "T"], "top_depth": {"standard": 1},
          "standard": {"normalized_effect": [[0.1, 0.83], [0.2, 1.0]]},
          "cells": {"standard": [{"depth": 0, "position_name": "T", "normalized_effect": 0.83,
                                  "normalized_effect_ci": [-6.06, 19.47]}]}}
    solved = {"accuracy": 0.95}
    assert "largest normalized effect is 0.83 [-6.06, 19.47] at depth 0, position T" in \
        _resid_clause({"layer_patching": lp}, solved)
    text = _resid_clause({"layer_patching": lp}, {"accuracy": 0.5})
    assert "largest" not in text and "does not solve the task (clean accuracy 0.50)" in text


def test_the_position_sweep_plots_T_at_zero_and_the_json_is_committed_last(tiny_ckpt, tmp_path, monkeypatch):
    from interventions.run import main

    out = tmp_path / "r"
    assert main(["--model", str(tiny_ckpt), "--task", "completion", "--n-pairs", "10", "--distractors", "2",
                 "--control-model", "none", "--n-boot", "20", "--no-progress", "--out", str(out),
                 "--max-positions", "3"]) == 0
    rep = json.loads((out / "causal_report.json").read_text())
    from interventions.report import html_report, write_report

    page, dec = html_report(rep, "cdn"), json.JSONDecoder()
    figs = []  # (traces, layout) of each Plotly.newPlot("id", [traces], {layout}, ...) call
    for chunk in page.split("Plotly.newPlot(")[1:]:
        data, end = dec.raw_decode(chunk, chunk.index("[", chunk.index(",")))
        layout, _ = dec.raw_decode(chunk, chunk.index("{", end))
        figs.append((data, layout))
    data = next(d for d, lay in figs if any(a.get("text") == "by position t - T" for a in lay.get("annotations", [])))
    trace = next(t for t in data if t["name"] == "normalized_effect")
    offsets = [r["position"] for r in rep["results"]["position_sweep"]["rows"] if r["normalized_effect"] is not None]
    assert trace["x"] == [p + 1 for p in offsets] and max(trace["x"]) == 0  # T at t - T = 0
    import os

    order = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (order.append(os.path.basename(b)), real(a, b)))
    write_report(rep, out, overwrite=True, plotly="cdn")
    assert [n for n in order if n.startswith("causal_report")][-1] == "causal_report.json"


def test_a_control_is_another_model_and_is_called_negative_only_where_its_fusion_was_never_trained(
        tiny_ckpt, tmp_path, capsys):
    import shutil

    from interventions.run import _control_role, main
    from engine.modes import parse_mode
    from models.checkpoints import checkpoint_dir, fusion_trained

    same = tmp_path / "same"  # the model under study by another path: refused, by its weights
    shutil.copytree(tiny_ckpt, same)
    args = ["--model", str(tiny_ckpt), "--task", "completion", "--n-pairs", "10", "--distractors", "2",
            "--n-boot", "20", "--no-progress", "--max-positions", "2"]
    with pytest.raises(SystemExit) as e:
        main(args + ["--control-model", str(same), "--out", str(tmp_path / "a")])
    assert e.value.code == 2 and "has the weights of the model under study" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    # the training log decides what the control is: tiny-std never ran its fusion, tiny-fbt did
    log = lambda d, cfg: (d.mkdir(), (d / "train_log.json").write_text(json.dumps({"config": cfg})))
    log(tmp_path / "one", {"schedule": "1"})
    log(tmp_path / "jac", {"schedule": "60/25/15"})
    log(tmp_path / "rec", {"schedule": "1", "objective": "recurrent"})
    log(tmp_path / "on", {"schedule": "1", "base": str(tmp_path / "jac")})  # a one-pass run on a trained fusion
    log(tmp_path / "zero", {"schedule": "1/0"})
    assert [fusion_trained(tmp_path / n) for n in ("one", "jac", "rec", "on", "zero", "a")] == \
        [False, True, True, True, False, None]
    if checkpoint_dir("tiny-std").is_dir():
        assert fusion_trained(checkpoint_dir("tiny-std")) is False and fusion_trained(checkpoint_dir("tiny-fbt"))
    rec, full = parse_mode("recirc-2:1:0.5", 2), parse_mode("recurrent-full")
    assert _control_role(full, tmp_path / "one")["role"] == "negative control"
    assert _control_role(full, tmp_path / "jac") == {"role": "control", "about": "its fusion was trained too"}
    assert _control_role(rec, tmp_path / "one")["role"] == "control"  # recirculation trains nothing
    # the default control is not run under recirculation: no model holds an untrained version of it
    assert main(args + ["--mode", "recirc-2:1:0.5", "--out", str(tmp_path / "r")]) == 0
    rep = json.loads((tmp_path / "r" / "causal_report.json").read_text())
    assert rep["control"]["skipped"].startswith("recirculation trains nothing")
    assert "Control model: skipped (recirculation trains nothing" in (tmp_path / "r" / "causal_report.md").read_text()


def test_a_second_mode_into_the_default_folder_is_told_how_to_go_on(tmp_path):
    """Running --mode standard then --mode recirc-... for one model and task met "already holds results" with no
    hint that the folder is per model and task, not per mode: the refusal names the earlier mode and an --out."""
    import json

    from common.errors import UserError
    from interventions.report import check_no_results

    out = tmp_path / "figures" / "m" / "parity"
    out.mkdir(parents=True)
    (out / "causal_report.json").write_text(json.dumps({"config": {"mode": "standard"}}))
    with pytest.raises(UserError) as e:
        check_no_results(out, overwrite=False)
    assert "(causal_report.json, mode standard)" in str(e.value) and f"--out {out.as_posix()}-MODE" in str(e.value)
    check_no_results(out, overwrite=True)
