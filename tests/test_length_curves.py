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
