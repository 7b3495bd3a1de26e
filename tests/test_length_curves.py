"""analysis.length_curves: the accuracy-vs-N page from eval.json files (offline HTML, deterministic)."""
from __future__ import annotations

import json

import pytest


def _eval(path, model, accs):
    rows = [{"task": t, "n_distractors": n, "mode": m, "accuracy": a, "n_samples": 200, "ci_low": a - 0.05,
             "ci_high": min(1.0, a + 0.05)} for (t, n, m), a in accs.items()]
    path.write_text(json.dumps({"meta": {"model": model}, "results": rows}))
    return path


def test_page_has_every_model_and_mode_and_the_chance_lines(tmp_path):
    from analysis.length_curves import main

    a = _eval(tmp_path / "a.json", "checkpoints/fbt", {("parity", 8, "std"): 0.5, ("parity", 16, "std"): 0.52,
                                                      ("parity", 8, "recurrent-full"): 1.0,
                                                      ("shell_game", 8, "recurrent-full"): 0.99})
    b = _eval(tmp_path / "b.json", "checkpoints/std", {("parity", 8, "std"): 0.49, ("shell_game", 8, "std"): 0.33})
    out = tmp_path / "page.html"
    assert main([str(a), str(b), "--out", str(out)]) == 0
    html = out.read_text()
    for name in ("fbt std", "fbt recurrent-full", "std std", "chance 0.50", "chance 0.33"):
        assert name in html
    first = html
    with pytest.raises(SystemExit) as e:  # never overwrites silently
        main([str(a), str(b), "--out", str(out)])
    assert e.value.code == 2
    assert main([str(a), str(b), "--out", str(out), "--overwrite"]) == 0
    assert out.read_text() == first  # deterministic


def test_bad_input_is_one_line(tmp_path, capsys):
    from analysis.length_curves import main

    (tmp_path / "x.json").write_text("{")
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "x.json"), "--out", str(tmp_path / "o.html")])
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1
    assert not (tmp_path / "o.html").exists()


def test_model_modes_pick_the_lines_of_one_model(tmp_path, capsys):
    from analysis.length_curves import main

    a = _eval(tmp_path / "a.json", "checkpoints/fbt", {("parity", 8, "std"): 0.5, ("parity", 8, "recurrent-full"): 1.0})
    b = _eval(tmp_path / "b.json", "checkpoints/std", {("parity", 8, "std"): 0.49, ("parity", 8, "recurrent-full"): 0.5})
    out = tmp_path / "page.html"
    assert main([str(a), str(b), "--out", str(out), "--model-modes", "std:std"]) == 0
    html = out.read_text()
    assert "fbt recurrent-full" in html and "fbt std" in html and "std std" in html
    assert "std recurrent-full" not in html
    for bad, msg in (("nosuch:std", "no model 'nosuch'"), ("std", "expected MODEL:MODE")):
        with pytest.raises(SystemExit) as e:
            main([str(a), str(b), "--out", str(tmp_path / "o.html"), "--model-modes", bad])
        assert e.value.code == 2 and msg in capsys.readouterr().err


def test_markdown_tables_hold_the_drawn_numbers(tmp_path, capsys):
    from analysis.length_curves import main

    a = _eval(tmp_path / "a.json", "checkpoints/fbt", {("parity", 8, "std"): 0.5, ("parity", 16, "recurrent-full"): 1.0,
                                                      ("parity", 8, "recurrent-full"): 0.9876})
    b = _eval(tmp_path / "b.json", "checkpoints/loop", {("parity", 8, "loop-8"): 0.25, ("parity", 8, "std"): 0.75})
    assert main([str(a), str(b), "--out", str(tmp_path / "p.html"), "--model-modes", "loop:loop-8", "--markdown",
                 "--title", "three ways"]) == 0
    text = capsys.readouterr().out
    assert "| parity (chance 0.50), N update lines | 8 | 16 |" in text
    assert "| fbt, std | 0.500 |  |" in text
    assert "| fbt, recurrent-full | 0.988 | 1.000 |" in text
    assert "| loop, loop-8 | 0.250 |  |" in text and "loop, std" not in text  # --model-modes: only its modes
    assert "three ways" in (tmp_path / "p.html").read_text()


def _rows(model, rows, meta=None):
    return {"meta": {"model": model, **(meta or {})}, "results": [
        {"task": t, "n_distractors": n, "mode": m, "accuracy": a, "n_samples": 100} for t, n, m, a in rows]}


def _write(path, doc):
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return str(path)


def _refused(main, args, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(args + ["--out", str(tmp_path / "refused" / "o.html")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert not (tmp_path / "refused").exists()  # nothing written, not even plotly.min.js or the folder
    return err


def _traces(html):
    """(name, x, y) of the page's named traces (plotly's JSON in the page, typed arrays decoded)."""
    from tests.test_figures import plotly_call

    import base64

    import numpy as np

    def dec(v):
        if isinstance(v, dict) and "bdata" in v:
            return np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"])).tolist()
        return list(v)

    traces, _ = plotly_call(html, "length-curves")
    return [(t["name"], dec(t["x"]), dec(t["y"])) for t in traces if t.get("showlegend") is not False]


def test_a_probes_json_or_a_bad_row_is_not_an_eval_json(tmp_path, capsys):
    """A probes.json was read as an eval.json and its probe accuracies drawn as label accuracy; a NaN or string
    accuracy was drawn; a row without its keys was a KeyError traceback."""
    from analysis.length_curves import main

    row = {"task": "parity", "n_distractors": 8, "mode": "standard", "accuracy": 0.9, "n_samples": 100}
    probes = {"meta": {"schema": "fbprobe.probes/2", "model": {"name": "m"}}, "results": [{**row, "depth": 3}]}
    cases = (({"meta": {"model": "m"}, "results": [{**row, "depth": 3}]}, "results[0]: a row with a depth"),
             (probes, "is not an eval.json (python -m analysis.evaluate): it is a probes.json"),
             ({"schema": {"name": "causal-report"}, "results": {}}, "it is a causal_report.json"),
             ([row], "the top level is an array"),
             ({"meta": {"model": "m"}, "results": [{**row, "accuracy": "high"}]}, "accuracy must be a number"),
             ({"meta": {"model": "m"}, "results": [{**row, "accuracy": 1.5}]}, "accuracy must be a number in [0, 1]"),
             ('{"meta": {"model": "m"}, "results": [{"task": "parity", "n_distractors": 8, "mode": "std", '
              '"accuracy": NaN, "n_samples": 3}]}', "NaN is not a JSON number"),
             ({"meta": {"model": "m"}, "results": [{"task": "parity"}]}, "results[0]: missing n_distractors, mode"),
             ({"meta": {"model": "m"}, "results": [{**row, "mode": "nosuch"}]}, "unknown prefill mode 'nosuch'"),
             ({"meta": {"model": "m"}, "results": [{**row, "n_distractors": True}]}, "n_distractors must be"),
             ({"meta": {"model": "m"}, "results": [row, row]}, "results[0] and results[1] are both parity N = 8"),
             ({"meta": {"model": 5}, "results": [row]}, "meta.model must be the model's name"),
             ({"meta": {"model": "m"}, "results": []}, "no result rows"))
    for i, (doc, msg) in enumerate(cases):
        path = _write(tmp_path / f"in{i}.json", doc)
        err = _refused(main, [path], tmp_path, capsys)
        assert msg in err and path in err, err


def test_files_of_one_model_merge_but_never_give_one_point_twice(tmp_path, capsys):
    """Two eval.json files of one model name gave the page two y values per N and the table the last file's:
    files that overlap are refused; files that do not are one curve, the same on the page and in the table."""
    from analysis.length_curves import main

    a = _write(tmp_path / "a.json", _rows("runs/m", [("parity", 8, "std", 0.9), ("parity", 16, "std", 0.8)]))
    b = _write(tmp_path / "b.json", _rows("other/m", [("parity", 16, "std", 0.5)]))
    c = _write(tmp_path / "c.json", _rows("m", [("parity", 32, "std", 0.7)]))
    err = _refused(main, [a, b], tmp_path, capsys)
    assert f"m parity std at N = 16: {a} and {b} both hold it" in err
    assert f"{a} is given twice" in _refused(main, [a, a], tmp_path, capsys)
    out = tmp_path / "p.html"
    assert main([a, c, "--out", str(out), "--markdown"]) == 0
    assert "| m, std | 0.900 | 0.800 | 0.700 |" in capsys.readouterr().out
    assert _traces(out.read_text()) == [("m std", [8, 16, 32], [0.9, 0.8, 0.7])]


def test_modes_are_read_by_the_engines_parser(tmp_path, capsys):
    """--modes standard / fused-0 on rows named std drew nothing (exit 0); rows named standard (an eval run with
    --modes standard) vanished under the default --modes; an unknown mode or one no input holds is refused."""
    from analysis.length_curves import main

    std = _write(tmp_path / "s.json", _rows("s", [("parity", 8, "std", 0.6), ("parity", 8, "recurrent-full", 0.9)]))
    loop = _write(tmp_path / "l.json", _rows("l", [("parity", 8, "standard", 0.7), ("parity", 8, "loop-8", 0.8)]))
    for i, modes in enumerate(("standard", "fused-0", "std", "recurrent-0")):
        out = tmp_path / f"p{i}.html"
        assert main([std, "--modes", modes, "--out", str(out)]) == 0
        assert _traces(out.read_text()) == [("s std", [8], [0.6])]
    out = tmp_path / "default.html"
    assert main([loop, std, "--out", str(out), "--markdown"]) == 0
    assert [t[0] for t in _traces(out.read_text())] == ["l standard", "s std", "s recurrent-full"]
    text = capsys.readouterr().out
    assert "| l, standard | 0.700 |" in text and "| s, std | 0.600 |" in text
    for modes, msg in (("nosuch", "--modes 'nosuch': unknown prefill mode"), ("", "no modes given"),
                       ("std,fused-4", "--modes fused-4: no input holds rows of mode fused-4"),
                       ("fused-1..30", "unknown prefill mode")):
        assert msg in _refused(main, [std, "--modes", modes], tmp_path, capsys)
    for spec, msg in (("l:loop-16", "l has no rows of mode loop-16"), ("l:bogus", "unknown prefill mode 'bogus'")):
        assert msg in _refused(main, [std, loop, "--model-modes", spec], tmp_path, capsys)


def test_a_file_with_fused_and_the_sweeps_fused_1_draws_one_curve(tmp_path, capsys):
    """analysis.evaluate's default run writes both `fused` and the sweep's `fused-1` (one computation): one
    curve, under the spelling --modes names."""
    from analysis.length_curves import main

    ev = _write(tmp_path / "e.json", _rows("m", [("parity", 8, "fused", 0.75), ("parity", 8, "fused-1", 0.75)]))
    assert main([ev, "--out", str(tmp_path / "a.html")]) == 0
    assert _traces((tmp_path / "a.html").read_text()) == [("m fused", [8], [0.75])]
    assert main([ev, "--modes", "fused-1", "--out", str(tmp_path / "b.html")]) == 0
    assert _traces((tmp_path / "b.html").read_text()) == [("m fused-1", [8], [0.75])]


def test_chance_is_one_over_the_custom_tasks_label_words(tmp_path, capsys):
    """A custom task with 4 label words was drawn with chance 0.50: 1/K from meta.custom_tasks; a task whose K
    is unknown (neither built in nor described) is refused rather than guessed."""
    from analysis.length_curves import main

    custom = [{"kind": "jsonl", "spec": "w4.jsonl", "name": "which4", "label_words": ["A", "B", "C", "D"]}]
    ev = _write(tmp_path / "e.json", _rows("m", [("which4", 0, "std", 0.4), ("parity@hold", 4, "std", 0.6)],
                                            {"custom_tasks": custom}))
    out = tmp_path / "p.html"
    assert main([ev, "--out", str(out), "--markdown"]) == 0
    text = capsys.readouterr().out
    assert "| which4 (chance 0.25)," in text and "| parity@hold (chance 0.50)," in text
    assert "which4 (chance 0.25)" in out.read_text()
    unknown = _write(tmp_path / "u.json", _rows("m", [("which4", 0, "std", 0.4)]))
    assert "task 'which4'" in _refused(main, [unknown], tmp_path, capsys)
    other = [{**custom[0], "label_words": ["A", "B"]}]
    clash = _write(tmp_path / "c.json", _rows("n", [("which4", 0, "std", 0.4)], {"custom_tasks": other}))
    assert "different label words" in _refused(main, [ev, clash], tmp_path, capsys)


def test_two_curves_of_one_model_are_told_apart(tmp_path):
    """A mode --modes does not name took its place among the model's curves as its colour, which could be a named
    mode's: one model's standard and loop-1 were drawn in one colour and one dash."""
    from analysis.length_curves import load_eval, plan_traces

    loop = _eval(tmp_path / "l.json", "checkpoints/loop", {("parity", 8, m): 0.5 for m in ("std", "loop-1", "loop-8")})
    std = _eval(tmp_path / "s.json", "checkpoints/std", {("parity", 8, "std"): 0.5})
    _, _, traces = plan_traces([load_eval(loop), load_eval(std)], ["loop-8", "std"],
                               model_modes={"loop": ("std", "loop-1")})
    looks = [(t["color"], t["dash"]) for t in traces["parity"] if t["model"] == "loop"]
    assert len(looks) == 2 and len(set(looks)) == 2
