"""analysis.length_curves and analysis.where_state: what the pages draw, and the inputs they refuse.

length_curves: every (model, mode) has one legend entry and one colour whatever panel it first appears in (a
curve only in a later panel was drawn unnamed); N = 0 is drawn apart on the log axis (it vanished); two models
whose meta.model paths share a folder name are refused (they were merged into one curve); --model-modes given
twice for one model is refused (the earlier one was dropped); a CI that does not contain its accuracy is refused.
where_state: a follows-donor CI that is inverted, outside [0, 1] or not around its rate, a probe cell given twice,
a loop iteration given twice or beyond r, and inputs at different N or of another loop are refused in one line;
the right panel states N; the left panel's axis title no longer claims an iteration-0 column.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_length_curves import _refused, _rows, _write  # one refusal check for both pages
from test_where_state import _docs, _edit


def _ev(tmp_path, name, model, rows, ci=False):
    doc = _rows(model, rows)
    if ci:
        for r in doc["results"]:
            r["ci_low"], r["ci_high"] = max(0.0, r["accuracy"] - 0.05), min(1.0, r["accuracy"] + 0.05)
    return _write(tmp_path / name, doc)


def _figure(paths, **kw):
    from analysis.length_curves import length_figure, load_eval

    return length_figure([load_eval(p) for p in paths], **kw)


# ----- length_curves: legend and colour ---------------------------------------------------------------------------
def test_a_curve_first_drawn_in_a_later_panel_has_its_legend_entry(tmp_path):
    """tiny-fbt-group (s5, a5) beside tiny-fbt-track (parity): the track model's curves were drawn but never named
    (showlegend only on the first panel). Each (model, mode): one legend entry, on its first trace."""
    from analysis.length_curves import main

    a = _ev(tmp_path, "a.json", "ck/grp", [("s5", 8, "recurrent-full", 0.9), ("a5", 8, "recurrent-full", 0.8)])
    b = _ev(tmp_path, "b.json", "ck/trk", [("parity", 8, "recurrent-full", 0.7), ("parity", 16, "recurrent-full", 0.6)])
    fig = _figure([a, b], modes=("recurrent-full",))
    named = [t.name for t in fig.data if t.showlegend is not False and t.name]
    assert named == ["grp recurrent-full", "trk recurrent-full"]
    trk = [t for t in fig.data if t.name == "trk recurrent-full"]
    assert [t.xaxis for t in trk] == ["x3"] and trk[0].showlegend is True
    out = tmp_path / "p.html"
    assert main([a, b, "--modes", "recurrent-full", "--out", str(out)]) == 0
    from test_length_curves import _traces

    assert [t[0] for t in _traces(out.read_text())] == ["grp recurrent-full", "trk recurrent-full"]


def test_a_curve_has_one_colour_on_every_panel(tmp_path):
    """A mode outside --modes (here loop-8, via --model-modes) took its colour from its rank in each panel: the
    same curve was another colour where the panel held fewer of the model's modes."""
    a = _ev(tmp_path, "a.json", "m", [("parity", 8, "standard", 0.6), ("parity", 8, "loop-8", 0.9),
                                     ("shell_game", 8, "loop-8", 0.8)])
    fig = _figure([a], model_modes={"m": ("standard", "loop-8")})
    colours = {t.xaxis: t.line.color for t in fig.data if t.name == "m loop-8"}
    assert set(colours) == {"x", "x2"} and len(set(colours.values())) == 1, colours
    assert [t.name for t in fig.data if t.showlegend is not False and t.name] == ["m standard", "m loop-8"]


# ----- length_curves: N = 0 on the log axis -----------------------------------------------------------------------
def test_n_zero_is_drawn_apart_on_the_log_axis(tmp_path, capsys):
    """tiny-fbt/eval.json has N in {0, 8, 32, 128, 256}: the N = 0 rows vanished from the log axis. They are drawn
    as markers (CI as error bars) left of a break, on a tick labelled 0; a panel without N = 0 is drawn as before."""
    from analysis.length_curves import main

    a = _ev(tmp_path, "a.json", "m", [("memory", 0, "std", 0.95), ("memory", 8, "std", 0.9), ("memory", 32, "std", 0.7),
                                     ("parity", 8, "std", 0.6), ("parity", 16, "std", 0.55)], ci=True)
    b = _ev(tmp_path, "b.json", "z", [("memory", 0, "std", 0.4)], ci=True)  # a curve of N = 0 only
    fig = _figure([a, b], modes=("std",))
    zero = [t for t in fig.data if t.xaxis == "x" and t.mode == "markers"]
    assert [(t.name, list(t.x), list(t.y)) for t in zero] == [("m std", [2.0], [0.95]), ("z std", [2.0], [0.4])]
    assert list(zero[0].error_y.array) == pytest.approx([0.05]) and "N=0" in zero[0].hovertemplate
    line = next(t for t in fig.data if t.name == "m std" and t.xaxis == "x" and t.mode == "lines+markers")
    assert list(line.x) == [8, 32]  # the line does not run through the break
    assert [t.name for t in fig.data if t.showlegend is not False and t.name] == ["m std", "z std"]
    ax, ax2 = fig.layout.xaxis, fig.layout.xaxis2
    assert ax.type == "log" and list(ax.ticktext) == ["0", "8", "16", "32"] and list(ax.tickvals)[0] == 2.0
    assert "N = 0" in ax.title.text
    assert ax2.tickvals is None and ax2.dtick == 0.30103 and ax2.title.text == "N update lines"  # as before
    out = tmp_path / "p.html"
    assert main([a, b, "--out", str(out), "--markdown", "--modes", "std"]) == 0
    assert "| memory (chance 0.50), N update lines | 0 | 8 | 32 |" in capsys.readouterr().out


# ----- length_curves: one model per name, --model-modes once per model, a CI around its point ----------------------
def test_two_models_with_one_folder_name_are_refused(tmp_path, capsys):
    """runs/x/tiny-fbt-track and runs/y/tiny-fbt-track were merged into one curve (a model was its folder's
    name). Files without meta.weights_sha256 (these, and those written before evaluate recorded it): different paths
    of one name are refused; a bare name, or a path that ends with the other, may be the same model and still
    merges."""
    from analysis.length_curves import main

    x = _ev(tmp_path, "x.json", "runs/x/tiny-fbt-track", [("parity", 8, "std", 0.9)])
    y = _ev(tmp_path, "y.json", "runs/y/tiny-fbt-track", [("parity", 16, "std", 0.2)])
    err = _refused(main, [x, y], tmp_path, capsys)
    assert f"{x} is of model runs/x/tiny-fbt-track, {y} of model runs/y/tiny-fbt-track" in err
    assert "two models named tiny-fbt-track" in err
    bare = _ev(tmp_path, "bare.json", "tiny-fbt-track", [("parity", 32, "std", 0.5)])
    absolute = _ev(tmp_path, "abs.json", "/home/u/runs/x/tiny-fbt-track/", [("parity", 64, "std", 0.4)])
    out = tmp_path / "p.html"
    assert main([x, bare, absolute, "--out", str(out), "--markdown"]) == 0
    assert "| tiny-fbt-track, std | 0.900 | 0.500 | 0.400 |" in capsys.readouterr().out
    assert "two models named" in _refused(main, [x, bare, y], tmp_path, capsys)  # three files: still two models


def test_two_weights_under_one_name_are_refused(tmp_path, capsys):
    """A checkpoint retrained in place between two evaluations: same meta.model, other meta.weights_sha256. They were
    drawn as one curve; the weights tell them apart now (and equal weights under two paths are one model)."""
    from analysis.length_curves import main

    def with_weights(name, model, rows, sha):
        return _write(tmp_path / name, _rows(model, rows, {"weights_sha256": sha}))

    a = with_weights("a.json", "tiny-fbt-track", [("parity", 8, "std", 0.9)], "a" * 64)
    b = with_weights("b.json", "tiny-fbt-track", [("parity", 16, "std", 0.2)], "b" * 64)
    err = _refused(main, [a, b], tmp_path, capsys)
    assert "two models named tiny-fbt-track (weights sha256 aaaaaaaaaaaa and bbbbbbbbbbbb)" in err
    c = with_weights("c.json", "runs/y/tiny-fbt-track", [("parity", 32, "std", 0.5)], "a" * 64)
    out = tmp_path / "p.html"
    assert main([a, c, "--out", str(out), "--markdown"]) == 0  # one model's weights under two paths


def test_modes_the_default_leaves_out_are_named(tmp_path, capsys):
    """The default --modes is a fixed list: a file's recirc and recurrent-2 rows were left off the page without a
    word. They are named now (a fused-k sweep counted)."""
    from analysis.length_curves import main

    rows = [("parity", 8, m, 0.9) for m in ("std", "recirc-2:1:0.5", "recurrent-2", "fused-2", "fused-3")]
    a = _ev(tmp_path, "a.json", "m", rows)
    assert main([a, "--out", str(tmp_path / "p.html")]) == 0
    out = capsys.readouterr().out
    assert "not drawn (the inputs hold them; name them in --modes): recirc-2:1:0.5:convex, recurrent-2, 2 fused-k" in out
    assert main([a, "--modes", "std,recirc-2:1:0.5,recurrent-2,fused-2,fused-3", "--out", str(tmp_path / "q.html")]) == 0
    assert "not drawn" not in capsys.readouterr().out


def test_model_modes_twice_for_one_model_is_refused(tmp_path, capsys):
    """--model-modes A:std --model-modes A:recurrent-full drew recurrent-full only (the earlier one dropped): a
    model's modes are one list."""
    from analysis.length_curves import main

    a = _ev(tmp_path, "a.json", "A", [("parity", 8, "std", 0.5), ("parity", 8, "recurrent-full", 0.9)])
    b = _ev(tmp_path, "b.json", "B", [("parity", 8, "std", 0.5)])
    err = _refused(main, [a, "--model-modes", "A:std", "--model-modes", "A:recurrent-full"], tmp_path, capsys)
    assert "--model-modes 'A:recurrent-full': A already has its modes (--model-modes 'A:std')" in err
    assert "A:std,recurrent-full" in err
    out = tmp_path / "p.html"
    assert main([a, b, "--model-modes", "A:std,recurrent-full", "--model-modes", "B:std", "--out", str(out)]) == 0


def test_a_ci_not_around_its_accuracy_is_refused(tmp_path, capsys):
    from analysis.length_curves import main

    row = {"task": "parity", "n_distractors": 8, "mode": "std", "accuracy": 0.5, "n_samples": 100}
    for i, (lo, hi) in enumerate(((0.9, 0.95), (0.1, 0.4))):
        path = _write(tmp_path / f"e{i}.json", {"meta": {"model": "m"}, "results": [{**row, "ci_low": lo,
                                                                                    "ci_high": hi}]})
        err = _refused(main, [path], tmp_path, capsys)
        assert f"results[0]: the CI [{lo}, {hi}] does not contain its accuracy 0.5" in err and path in err
    ok = _write(tmp_path / "ok.json", {"meta": {"model": "m"}, "results": [{**row, "accuracy": 1.0, "ci_low": 0.9,
                                                                           "ci_high": 1.0}]})
    assert main([ok, "--out", str(tmp_path / "ok.html")]) == 0  # a point on its CI's edge


# ----- where_state ------------------------------------------------------------------------------------------------
def _swap_ci(path, ci, rate=None, name=None):
    def edit(d):
        m = d["results"]["loop_iterations"]["rows"][1]["swap_T"]
        m["follows_donor_rate_ci"] = ci
        if rate != "keep":
            m["follows_donor_rate"] = rate if rate is not None else m["follows_donor_rate"]
    return _edit(path, edit, name)


def test_where_state_refuses_a_follows_donor_ci_that_is_not_around_its_rate(tmp_path, capsys):
    from analysis.where_state import main

    probes, loop, fb = _docs(tmp_path)  # rows[1].swap_T: rate 0.1, CI [0.0, 0.2]
    for i, (ci, msg) in enumerate((([0.8, 0.2], "follows_donor_rate_ci [0.8, 0.2] must be [low, high] with 0 <="),
                                   ([-5, 7], "follows_donor_rate_ci [-5, 7] must be [low, high] with 0 <="))):
        bad = _swap_ci(loop, ci, name=tmp_path / f"ci{i}.json")
        err = _refused(main, ["--probes", probes, "--causal", bad], tmp_path, capsys)
        assert f"--causal {bad}: results.loop_iterations.rows[1]: swap_T." in err and msg in err, err
    null_rate = _edit(loop, lambda d: d["results"]["loop_iterations"]["rows"][1]["swap_T"].update(
        follows_donor_rate=None), tmp_path / "null.json")
    assert "beside a null follows_donor_rate" in _refused(main, ["--probes", probes, "--causal", null_rate],
                                                          tmp_path, capsys)


def test_where_state_refuses_a_probe_cell_or_a_loop_iteration_given_twice_or_beyond_r(tmp_path, capsys):
    """A repeated (block, iteration) probe cell was drawn last-wins; duplicate iterations and one beyond the loop's
    r were drawn as given."""
    from analysis.where_state import main

    probes, loop, fb = _docs(tmp_path)
    dup_cell = _edit(probes, lambda d: d["results"].append({**d["results"][0], "accuracy": 0.01}))
    err = _refused(main, ["--probes", dup_cell, "--causal", loop], tmp_path, capsys)
    assert f"--probes {dup_cell}: results[9]: results[0] is the same cell (core block 0, iteration 1" in err

    def rows_of(d):
        return d["results"]["loop_iterations"]["rows"]

    dup_it = _edit(loop, lambda d: rows_of(d)[2].update(iteration=1), tmp_path / "dup_it.json")
    beyond = _edit(loop, lambda d: (d["results"]["loop_iterations"].update(iterations=4),
                                    rows_of(d).append({**rows_of(d)[-1], "iteration": 9})), tmp_path / "beyond.json")
    beyond_mode = _edit(loop, lambda d: rows_of(d).append({**rows_of(d)[-1], "iteration": 9}),
                        tmp_path / "beyond_mode.json")  # no iterations field: loop-8's R
    negative = _edit(loop, lambda d: rows_of(d)[0].update(iteration=-1), tmp_path / "negative.json")
    for bad, msg in ((dup_it, "rows[2]: iteration 1 is given twice (rows[1] too)"),
                     (beyond, "rows[5]: iteration 9 is outside 0..4 (the loop's r = 4)"),
                     (beyond_mode, "rows[5]: iteration 9 is outside 0..8 (the loop's r = 8)"),
                     (negative, "rows[0]: iteration -1 is outside 0..8")):
        err = _refused(main, ["--probes", probes, "--causal", bad], tmp_path, capsys)
        assert f"--causal {bad}: results.loop_iterations.{msg}" in err, err


def _at_n(path, n, name):
    return _edit(path, lambda d: d["config"].update(distractors=n), name)


def test_where_state_refuses_inputs_at_different_n_and_states_n(tmp_path, capsys):
    """Probes at N = 16 beside a causal report at N = 8, or a --feedback report at N = 32 beside an N = 16 loop,
    were drawn as one page: refused, naming both N; the right panel's title states N."""
    from analysis.where_state import main, where_figure

    probes, loop, fb = _docs(tmp_path)  # probes at N = 16
    loop8, loop16 = _at_n(loop, 8, tmp_path / "l8.json"), _at_n(loop, 16, tmp_path / "l16.json")
    fb32, fb16 = _at_n(fb, 32, tmp_path / "f32.json"), _at_n(fb, 16, tmp_path / "f16.json")
    err = _refused(main, ["--probes", probes, "--causal", loop8], tmp_path, capsys)
    assert f"--probes {probes} holds its loop probes at N = 16, --causal {loop8} is at N = 8" in err
    err = _refused(main, ["--probes", probes, "--causal", loop16, "--feedback", fb32], tmp_path, capsys)
    assert f"--feedback {fb32} is at N = 32, --causal {loop16} at N = 16" in err
    out = tmp_path / "ok.html"
    assert main(["--probes", probes, "--causal", loop16, "--feedback", fb16, "--out", str(out)]) == 0
    fig = where_figure(*(json.loads(Path(p).read_text()) for p in (probes, loop16)), [json.loads(Path(fb16).read_text())])
    titles = [a.text for a in fig.layout.annotations]
    assert titles[1] == "loopy (loop-8, N = 16): swap the loop state s_i with the donor's", titles


def test_where_state_draws_the_probe_grid_of_the_causal_runs_n_and_mode(tmp_path, capsys):
    """The left panel was the probes file's first (mode, N) whatever --causal ran: it is the grid at --causal's N
    and mode; a --causal run of another loop (another mode with another number of iterations) is refused."""
    from analysis.where_state import main, where_figure

    probes, loop, fb = _docs(tmp_path)

    def more(d):  # loop-16 at N = 16 first, then loop-8 at N = 8 and at N = 16 (the file's own rows)
        base = [r for r in d["results"] if r["loop"]["part"] == "core"]
        d["results"] = [{**r, "mode": "loop-16", "accuracy": 0.11} for r in base] \
            + [{**r, "n_distractors": 8, "accuracy": 0.22} for r in base] + d["results"]
    many = _edit(probes, more, tmp_path / "many.json")
    loop16 = _at_n(loop, 16, tmp_path / "l16.json")
    fig = where_figure(json.loads(Path(many).read_text()), json.loads(Path(loop16).read_text()), [])
    assert fig.layout.annotations[0].text == "loopy: probe accuracy per iteration (loop-8, N = 16)"
    assert list(fig.data[0].z[1]) == pytest.approx([0.56, 0.61, 0.66, 0.71])
    other = _edit(loop16, lambda d: d["results"]["loop_iterations"].update(mode="loop-2", iterations=2,
                                                                           rows=d["results"]["loop_iterations"]
                                                                           ["rows"][:3]), tmp_path / "loop2.json")
    err = _refused(main, ["--probes", probes, "--causal", other], tmp_path, capsys)
    assert f"--causal {other} runs loop-2 (2 iterations), --probes {probes} probes loop-8 (4 iterations) at " \
           "N = 16: give files of one loop mode" in err


def test_where_state_axis_titles_say_what_the_panels_hold():
    """The heatmap has no iteration-0 column (core iterations 1..r), yet its axis said '0 = the prelude's output';
    that is the right panel's s_0."""
    from analysis.where_state import where_figure

    import tempfile

    with tempfile.TemporaryDirectory() as d:
        probes, loop, fb = (json.loads(Path(p).read_text()) for p in _docs(Path(d)))
    fig = where_figure(probes, loop, [fb])
    assert 0 not in list(fig.data[0].x)
    left, right = fig.layout.xaxis.title.text, fig.layout.xaxis2.title.text
    assert "0" not in left and "s_i" in left
    assert "s_0 = the prelude's output" in right and 0 in list(fig.data[2].x)
