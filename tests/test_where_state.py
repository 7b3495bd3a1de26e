"""analysis.where_state: the looped model's per-iteration verdicts beside the fed-state swaps (one figure)."""
from __future__ import annotations

import json

import pytest


def _rate(v):
    return {"follows_donor_rate": v, "follows_donor_rate_ci": [max(0.0, v - 0.1), min(1.0, v + 0.1)]}


def _docs(tmp_path):
    probes = {"meta": {}, "results": [
        {"mode": "loop-8", "n_distractors": 16, "writes": None, "accuracy": 0.5 + 0.05 * i + 0.01 * b,
         "loop": {"part": "core", "iteration": i, "block": b}} for i in range(1, 5) for b in range(2)]
        + [{"mode": "loop-8", "n_distractors": 16, "writes": None, "accuracy": 0.9,
            "loop": {"part": "coda", "iteration": 4, "block": 0}}]}
    causal = {"model": {"name": "loopy"}, "results": {"loop_iterations": {"mode": "loop-8", "rows": [
        {"iteration": i, "swap_T": _rate(0.1 * i), "swap_all_positions": _rate(0.2 * i), "lens_accuracy": 0.5}
        for i in range(5)]}}}
    fb = {"model": {"name": "fbt"}, "results": {"interventions": [
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
