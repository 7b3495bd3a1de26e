"""analysis.where_state: the looped model's per-iteration verdicts beside the fed-state swaps (one figure)."""
from __future__ import annotations

import json

import pytest

from test_length_curves import _refused  # one refusal check for both pages


def _rate(v):
    return {"follows_donor_rate": v, "follows_donor_rate_ci": [max(0.0, v - 0.1), min(1.0, v + 0.1)]}


def _docs(tmp_path):
    probes = {"meta": {"schema": "fbprobe.probes/2", "run": {"task": "parity", "model": "loopy", "weights": "w1",
                                                             "config": "c1"},
                       "model": {"name": "loopy", "weights_sha256": "w1"}}, "results": [
        {"mode": "loop-8", "n_distractors": 16, "writes": None, "accuracy": 0.5 + 0.05 * i + 0.01 * b,
         "loop": {"part": "core", "iteration": i, "block": b}} for i in range(1, 5) for b in range(2)]
        + [{"mode": "loop-8", "n_distractors": 16, "writes": None, "accuracy": 0.9,
            "loop": {"part": "coda", "iteration": 4, "block": 0}}]}
    causal = {"schema": {"name": "causal-report", "version": 8}, "config": {"task": "parity"},
              "model": {"name": "loopy", "weights_sha256": "w1", "config_sha256": "c1"}, "results": {"loop_iterations": {"mode": "loop-8", "rows": [
        {"iteration": i, "swap_T": _rate(0.1 * i), "swap_all_positions": _rate(0.2 * i), "lens_accuracy": 0.5}
        for i in range(5)]}}}
    fb = {"schema": {"name": "causal-report", "version": 8}, "config": {"task": "parity"},
          "model": {"name": "fbt", "weights_sha256": "w2", "config_sha256": "c2"}, "results": {"interventions": [
        {"name": "gate_bypass", "follows_donor_rate": 0.5}, {"name": "state_swap", "mode": "recurrent-full",
                                                             "follows_donor_rate": 0.97}]}}
    paths = []
    for name, doc in (("probes.json", probes), ("loop.json", causal), ("fb.json", fb)):
        (tmp_path / name).write_text(json.dumps(doc))
        paths.append(str(tmp_path / name))
    return paths


def test_figure_holds_the_grid_the_per_iteration_swaps_and_the_fed_state_line(tmp_path):
    from analysis.where_state import main
    import plotly.io as pio

    probes, loop, fb = _docs(tmp_path)
    out = tmp_path / "w.html"
    assert main(["--probes", probes, "--causal", loop, "--feedback", fb, "--out", str(out)]) == 0
    html = out.read_text()
    assert "loopy: swap at T, follows donor" in html and "fbt (recurrent-full): fed-state swap at T" in html
    from analysis.where_state import where_figure

    fig = where_figure(*(json.loads(open(p).read()) for p in (probes, loop)), [json.loads(open(fb).read())])
    heat = fig.data[0]
    assert list(heat.x) == [1, 2, 3, 4] and list(heat.z[1]) == pytest.approx([0.56, 0.61, 0.66, 0.71])  # core only
    swap_T = next(t for t in fig.data if t.name == "loopy: swap at T, follows donor")
    assert list(swap_T.y) == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    line = next(t for t in fig.data if t.name and t.name.startswith("fbt"))
    assert list(line.y) == [0.97, 0.97]
    assert pio.to_json(fig)  # serializable
    with pytest.raises(SystemExit) as e:  # never overwrites silently
        main(["--probes", probes, "--causal", loop, "--out", str(out)])
    assert e.value.code == 2


def test_wrong_inputs_are_one_line(tmp_path, capsys):
    from analysis.where_state import main

    probes, loop, fb = _docs(tmp_path)
    for args, msg in ((["--probes", probes, "--causal", fb], "no results.loop_iterations"),
                      (["--probes", probes, "--causal", loop, "--feedback", loop], "no state_swap row"),
                      (["--probes", fb, "--causal", loop], "is not a probes.json")):
        with pytest.raises(SystemExit) as e:
            main(args + ["--out", str(tmp_path / "o.html")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and msg in err and err.count("\n") == 1
        assert not (tmp_path / "o.html").exists()


def _edit(path, fn, new_path=None):
    """The JSON at `path` edited in place by `fn(doc)`, written to `new_path` (default beside it, 'x_' + name)."""
    from pathlib import Path

    doc = json.loads(Path(path).read_text())
    fn(doc)
    out = Path(new_path) if new_path else Path(path).with_name("x_" + Path(path).name)
    out.write_text(json.dumps(doc))
    return str(out)


def test_the_wrong_kind_of_json_is_one_line_naming_the_file(tmp_path, capsys):
    """A probes.json or an eval.json as --causal / --feedback, a causal file whose top level is a list, loop rows
    without swap_T: one line naming the flag and file (were AttributeError / KeyError tracebacks)."""
    from analysis.where_state import main

    probes, loop, fb = _docs(tmp_path)
    ev = tmp_path / "eval.json"
    ev.write_text(json.dumps({"meta": {"model": "loopy"}, "results": [
        {"task": "parity", "n_distractors": 8, "mode": "std", "accuracy": 0.5, "n_samples": 4}]}))
    (tmp_path / "list.json").write_text("[]")
    no_swap = _edit(loop, lambda d: [r.pop("swap_T") for r in d["results"]["loop_iterations"]["rows"]])
    bad_rate = _edit(loop, lambda d: d["results"]["loop_iterations"]["rows"][1]["swap_all_positions"].update(
        follows_donor_rate="high"), tmp_path / "rate.json")
    cases = ((["--causal", probes], f"--causal {probes} is not a causal_report.json", "it is a probes.json"),
             (["--causal", str(ev)], f"--causal {ev} is not a causal_report.json", "eval.json"),
             (["--causal", str(tmp_path / "list.json")], "is not a causal_report.json", "top level is an array"),
             (["--causal", loop, "--feedback", probes], f"--feedback {probes} is not a causal_report.json", ""),
             (["--causal", loop, "--feedback", str(ev)], f"--feedback {ev} is not a causal_report.json", ""),
             (["--causal", no_swap], f"--causal {no_swap}: results.loop_iterations.rows[0]", "swap_T"),
             (["--causal", bad_rate], "rows[1]: swap_all_positions must hold follows_donor_rate", ""))
    for args, msg, detail in cases:
        err = _refused(main, ["--probes", probes] + args, tmp_path, capsys)
        assert msg in err and detail in err, err
    err = _refused(main, ["--probes", loop, "--causal", loop], tmp_path, capsys)
    assert f"--probes {loop} is not a probes.json" in err and "it is a causal_report.json" in err
    bad_loop = _edit(probes, lambda d: d["results"][0].update(loop=[1, 2]))
    assert "results[0]: loop must be an object" in _refused(main, ["--probes", bad_loop, "--causal", loop],
                                                             tmp_path, capsys)


def test_files_of_another_model_or_task_are_refused(tmp_path, capsys):
    """A tiny-loop-group s5 probes.json beside a tiny-loop-track parity report drew a page titled with the one
    and the other's accuracies: the model (weights, config hash, else name) and task must agree."""
    from analysis.where_state import main

    probes, loop, fb = _docs(tmp_path)
    other_weights = _edit(probes, lambda d: (d["meta"]["model"].update(weights_sha256="w9", name="group"),
                                             d["meta"]["run"].update(weights="w9")))
    other_config = _edit(loop, lambda d: d["model"].update(config_sha256="c9"))
    other_task = _edit(probes, lambda d: d["meta"]["run"].update(task="s5"), tmp_path / "s5.json")
    fb_task = _edit(fb, lambda d: d["config"].update(task="s5"))
    no_hash = [_edit(probes, lambda d: (d["meta"]["model"].pop("weights_sha256"), d["meta"]["run"].pop("weights"),
                                        d["meta"]["model"].update(name="other")), tmp_path / "p2.json"),
               _edit(loop, lambda d: d["model"].pop("weights_sha256"), tmp_path / "l2.json")]  # names decide
    for args, msg in (([other_weights, loop], "is a report on loopy (weights w1), --probes"),
                      ([probes, other_config], "give both files of one model"),
                      ([no_hash[0], no_hash[1]], "give both files of one model"),
                      ([other_task, loop], "is on task 'parity', --probes")):
        err = _refused(main, ["--probes", args[0], "--causal", args[1]], tmp_path, capsys)
        assert msg in err, err
    err = _refused(main, ["--probes", probes, "--causal", loop, "--feedback", fb_task], tmp_path, capsys)
    assert f"--feedback {fb_task} is on task 's5'" in err
    custom = _edit(loop, lambda d: d["config"].update(task="tasks/p.jsonl", task_source={"name": "parity"}),
                   tmp_path / "custom.json")
    assert main(["--probes", probes, "--causal", custom, "--out", str(tmp_path / "ok.html")]) == 0  # a file's name


def test_a_report_of_a_model_that_does_not_solve_the_task_is_refused(tmp_path, capsys):
    """A feedback report whose own verdict is "inconclusive (the model does not solve the task)" (clean accuracy
    0.55) was drawn as a 0.45 "follows donor" line with no caveat; the looped report was not checked either."""
    from analysis.where_state import main

    probes, loop, fb = _docs(tmp_path)
    doc = json.loads(open(fb).read())
    doc["config"]["mode"] = "recurrent-full"
    doc["results"]["clean"] = {"recurrent-full": {"accuracy": 0.55}}
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    err = _refused(main, ["--probes", probes, "--causal", loop, "--feedback", str(tmp_path / "bad.json")], tmp_path,
                   capsys)
    assert "does not solve the task there (clean accuracy 0.55 under recurrent-full" in err
    doc["results"]["clean"]["recurrent-full"]["accuracy"] = 0.97
    (tmp_path / "good.json").write_text(json.dumps(doc))
    out = tmp_path / "w.html"
    assert main(["--probes", probes, "--causal", loop, "--feedback", str(tmp_path / "good.json"), "--out",
                 str(out)]) == 0
    assert "fed-state swap at T, follows donor 0.97" in out.read_text()
