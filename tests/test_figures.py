"""The committed figures (docs/*.png, docs/*.html) and the pages the suite writes, without a browser.

* every committed figure is drawn by scripts/redraw_figures.sh, and the script's commands are the documented ones;
* docs/length_curves.html holds exactly the traces its committed inputs (the shipped eval.json files) give under
  the script's command, loads the plotly.min.js committed beside it, and docs/length_curves.png has the size of
  that figure; each depth-curve PNG has the three panel rows (accuracy, logit lens, MDL) the pages now have;
* plotly.js is written once per output folder (``--plotly directory``, the default), inline or from the CDN on
  request, atomically, and the pages cite no unnamed paper.
"""
from __future__ import annotations

import json
import re
import shlex
import struct
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SCRIPT = ROOT / "scripts" / "redraw_figures.sh"


def committed_figures() -> list[Path]:
    return sorted(p for p in DOCS.iterdir() if p.suffix in (".png", ".html"))


def script_text() -> str:
    return SCRIPT.read_text()


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


def plotly_call(html: str, div_id: str):
    """(traces, layout) of the page's Plotly.newPlot call."""
    dec = json.JSONDecoder()

    def skip(i):
        while html[i].isspace():
            i += 1
        return i

    i = html.index("Plotly.newPlot(")
    i = html.index(json.dumps(div_id), i) + len(json.dumps(div_id))
    traces, end = dec.raw_decode(html, skip(html.index(",", i) + 1))
    layout, _ = dec.raw_decode(html, skip(html.index(",", end) + 1))
    return traces, layout


def command_args(text: str, module: str, naming: str = "") -> list[str]:
    """The arguments of the one `-m module` command in `text` whose line holds `naming` (backslash continuations
    joined, comment dropped)."""
    lines = text.replace("\\\n", " ").splitlines()
    [line] = [ln for ln in lines if f"-m {module} " in ln and naming in ln]
    return shlex.split(line.split(f"-m {module}", 1)[1].split(" #")[0].split(";;")[0])


def length_curves_args() -> list[str]:
    """The analysis.length_curves arguments of the script (its one command for docs/length_curves.*)."""
    return command_args(script_text(), "analysis.length_curves", "docs/length_curves.html ")


# ----- every committed figure has a documented command ------------------------------------------------------
def test_every_committed_figure_is_redrawn_by_the_script():
    text = script_text()
    figs = committed_figures()
    assert {p.name for p in figs} >= {"length_curves.html", "length_curves.png", "depth_curves_memory.png"}
    for p in figs:
        # length_curves.*: named in its command; depth_curves_X.png: drawn by `depth depth_curves_X MODEL TASK`
        assert f"docs/{p.name}" in text or (p.suffix == ".png" and re.search(rf"\bdepth {p.stem} [\w.-]+ \w+", text)), \
            p.name
    # the script's figure list names exactly the committed depth curves
    listed = set(re.findall(r"\b(depth_curves_\w+)\b", text.split("ALL=(", 1)[1].split(")", 1)[0]))
    assert listed == {p.stem for p in figs if p.stem.startswith("depth_curves_")}


def test_the_redraw_script_is_documented():
    usage = (DOCS / "usage.md").read_text()
    assert "scripts/redraw_figures.sh" in usage
    assert "FBPROBE_CHECKPOINTS" in usage
    # the length-curve command documented in usage.md is the script's, --overwrite included: the page it writes is
    # committed, so without it the command as documented is refused in every checkout
    assert command_args(usage, "analysis.length_curves") == length_curves_args()


# ----- docs/length_curves.*: no drift from the committed eval.json files -------------------------------------
def _length_figure_from_inputs():
    from analysis.length_curves import DEFAULT_MODES, length_figure, load_eval

    args = length_curves_args()
    evals = [load_eval(ROOT / a) for a in args if a.endswith("eval.json")]
    modes = tuple(args[args.index("--modes") + 1].split(",")) if "--modes" in args else DEFAULT_MODES
    model_modes = {}
    for i, a in enumerate(args):
        if a == "--model-modes":
            name, _, ms = args[i + 1].partition(":")
            model_modes[name] = tuple(ms.split(","))
    return length_figure(evals, modes, model_modes=model_modes)


def test_length_curves_page_holds_what_its_inputs_give():
    fig = _length_figure_from_inputs()
    html = (DOCS / "length_curves.html").read_text()
    traces, layout = plotly_call(html, "length-curves")
    want = [t.to_plotly_json() for t in fig.data]
    assert [t.get("name") for t in traces] == [t.get("name") for t in want]
    named = [t["name"] for t in traces if t.get("showlegend") is not False and t.get("name")]
    assert named == ["tiny-fbt-track std", "tiny-fbt-track recurrent-full", "tiny-fbt-track fused-30",
                     "tiny-std-track std"]
    for got, exp in zip(traces, want):
        assert list(got["x"]) == list(exp["x"]) and got["y"] == pytest.approx(list(exp["y"]), abs=1e-12)
    assert [a["text"] for a in layout["annotations"]] == [a.text for a in fig.layout.annotations]
    assert layout["title"]["text"] == fig.layout.title.text


def test_length_curves_page_opens_offline():
    html = (DOCS / "length_curves.html").read_text()
    srcs = re.findall(r"<script[^>]*\bsrc=\"([^\"]+)\"", html)
    assert srcs == ["plotly.min.js"] and "://" not in "".join(srcs)
    js = DOCS / "plotly.min.js"
    assert js.is_file() and js.read_bytes()[:40].startswith(b"/**\n* plotly.js v")


def test_length_curves_png_has_the_figures_size():
    fig = _length_figure_from_inputs()
    assert png_size(DOCS / "length_curves.png") == (fig.layout.width, fig.layout.height)


def test_depth_curve_pngs_have_three_panel_rows():
    from probes.depth_curves import depth_curve_figure

    rows = [dict(task="memory", model="m", mode="standard", n_distractors=8, writes=None, depth=d, accuracy=0.5,
                 accuracy_std=0, ci_low=0.5, ci_high=0.5, control_accuracy=0.5, selectivity=0, n_samples=2,
                 n_groups=1, fold_accuracies=[0.5], logit_lens_ld=0.0, mdl_compression=1.0) for d in range(2)]
    height = depth_curve_figure({"meta": {}, "results": rows}).layout.height  # accuracy + lens + MDL rows
    pngs = [p for p in committed_figures() if p.name.startswith("depth_curves_")]
    assert len(pngs) == 5
    for p in pngs:
        w, h = png_size(p)
        assert h == height + 20 and w >= 720, (p.name, w, h)  # write_png: the page's size + 20


# ----- pages: plotly.js once per folder, atomically; no unnamed paper ----------------------------------------
def fake_doc():
    rows = [dict(task="completion", model="tiny", mode=m, n_distractors=0, writes=None, depth=d, accuracy=0.7,
                 accuracy_std=0.01, ci_low=0.6, ci_high=0.8, control_accuracy=0.5, selectivity=0.2, n_samples=10,
                 n_groups=5, fold_accuracies=[0.7] * 5) for m in ("standard", "recurrent-1") for d in range(3)]
    return {"meta": {"model": {"name": "tiny"}}, "results": rows}


def test_depth_curve_titles_cite_no_paper():
    from probes.depth_curves import depth_curve_figure

    for task in ("completion", "memory", "multi_register"):
        doc = fake_doc()
        for r in doc["results"]:
            r["task"] = task
            r["writes"] = 2 if task == "multi_register" else None
        assert "paper" not in depth_curve_figure(doc).layout.title.text
    assert "Fig. 7" not in (ROOT / "probes" / "depth_curves.py").read_text()


def test_directory_mode_writes_plotly_once_and_pages_reference_it(tmp_path):
    from common.plotlyjs import plotly_js
    from probes.depth_curves import write_depth_curves

    a = write_depth_curves(fake_doc(), tmp_path / "a.html")
    js = tmp_path / "plotly.min.js"
    assert js.read_bytes() == plotly_js()
    mtime = js.stat().st_mtime_ns
    write_depth_curves(fake_doc(), tmp_path / "b.html")
    assert js.stat().st_mtime_ns == mtime  # not rewritten: identical
    for page in (a, tmp_path / "b.html"):
        html = page.read_text()
        assert re.findall(r"<script[^>]*\bsrc=\"([^\"]+)\"", html) == ["plotly.min.js"]
        assert len(html) < 200_000
    js.write_text("truncated")  # a stale or broken copy is replaced
    write_depth_curves(fake_doc(), tmp_path / "a.html")
    assert js.read_bytes() == plotly_js()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.html", "b.html", "plotly.min.js"]


@pytest.mark.parametrize("mode", ["inline", "cdn"])
def test_inline_and_cdn_modes_write_no_plotly_file(tmp_path, mode):
    from probes.depth_curves import write_depth_curves

    html = write_depth_curves(fake_doc(), tmp_path / "p.html", plotly=mode).read_text()
    srcs = re.findall(r"<script[^>]*\bsrc=\"([^\"]+)\"", html)
    if mode == "inline":
        assert srcs == [] and len(html) > 1_000_000
    else:
        assert len(srcs) == 1 and srcs[0].startswith("https://cdn.plot.ly/") and len(html) < 200_000
    assert [p.name for p in tmp_path.iterdir()] == ["p.html"]


def test_plotly_flag_on_the_page_clis(tmp_path, capsys):
    from analysis.length_curves import main as lc_main
    from probes.depth_curves import main as dc_main

    (tmp_path / "probes.json").write_text(json.dumps(fake_doc()))
    assert dc_main([str(tmp_path / "probes.json"), "--plotly", "cdn"]) == 0
    assert not (tmp_path / "plotly.min.js").exists()
    assert dc_main([str(tmp_path / "probes.json")]) == 0
    assert (tmp_path / "plotly.min.js").is_file()
    with pytest.raises(SystemExit) as e:
        dc_main([str(tmp_path / "probes.json"), "--plotly", "nope"])
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1
    ev = tmp_path / "e" / "eval.json"
    ev.parent.mkdir()
    ev.write_text(json.dumps({"meta": {"model": "m"}, "results": [
        {"task": "parity", "n_distractors": n, "mode": "std", "accuracy": 0.5, "n_samples": 4} for n in (4, 8)]}))
    out = tmp_path / "lc" / "page.html"
    assert lc_main([str(ev), "--out", str(out), "--plotly", "inline"]) == 0
    assert not (out.parent / "plotly.min.js").exists()
    assert lc_main([str(ev), "--out", str(out), "--overwrite"]) == 0
    assert (out.parent / "plotly.min.js").is_file()


def test_a_hand_made_probes_json_missing_a_field_is_one_line(tmp_path, capsys):
    from probes.depth_curves import main as dc_main

    doc = fake_doc()
    for r in doc["results"]:
        del r["ci_low"]
    (tmp_path / "probes.json").write_text(json.dumps(doc))
    with pytest.raises(SystemExit) as e:
        dc_main([str(tmp_path / "probes.json")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "'ci_low'" in err
    assert [p.name for p in tmp_path.iterdir()] == ["probes.json"]


def test_a_failed_page_write_leaves_no_temporary(tmp_path, monkeypatch):
    import common.io
    from probes import depth_curves

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(common.io.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        depth_curves.write_depth_curves(fake_doc(), tmp_path / "depth_curves.html")
    assert list(tmp_path.iterdir()) == []


def test_staged_plotly_file_joins_the_run(tmp_path):
    from common.staged import Staged
    from common.plotlyjs import PLOTLY_JS, plotly_js, stage_plotly_js

    with Staged(tmp_path) as st:  # an interrupted run: nothing lands
        stage_plotly_js(st)
    assert list(tmp_path.iterdir()) == []
    with Staged(tmp_path) as st:
        stage_plotly_js(st)
        st.file("page.html", "<html></html>")
        st.commit()
    assert (tmp_path / PLOTLY_JS).read_bytes() == plotly_js()
    with Staged(tmp_path) as st:  # already there: not staged again
        stage_plotly_js(st)
        assert st.files == []


# ----- default outputs and the checkpoint search path --------------------------------------------------------
def test_default_outputs_are_under_the_current_directory(tmp_path, monkeypatch):
    from common.errors import UserError
    from common.paths import default_output, figures_dir

    monkeypatch.chdir(tmp_path)
    assert default_output("tiny-fbt", "memory") == tmp_path / "figures" / "tiny-fbt" / "memory"
    assert figures_dir("m", "eval.json") == tmp_path / "figures" / "m" / "eval.json"
    for bad in ("", ".", "..", "a/b"):
        with pytest.raises(UserError):
            default_output(bad, "memory")


def test_checkpoint_search_path(tmp_path, monkeypatch):
    from common.paths import PACKAGE_CHECKPOINTS
    from models.checkpoints import checkpoint_dir

    a, b, cwd = tmp_path / "a", tmp_path / "b", tmp_path / "cwd"
    for d in (a / "tiny-fbt", b / "tiny-fbt", b / "only-b", cwd / "checkpoints" / "tiny-std", cwd / "checkpoints" / "x"):
        d.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("FBPROBE_CHECKPOINTS", f"{a}::{b}")
    assert checkpoint_dir("tiny-fbt") == a / "tiny-fbt"  # the first root that has it
    assert checkpoint_dir("only-b") == b / "only-b"
    assert checkpoint_dir("tiny-std") == cwd / "checkpoints" / "tiny-std"  # then ./checkpoints
    assert checkpoint_dir("tiny-base") == PACKAGE_CHECKPOINTS / "tiny-base"  # then the package's
    assert checkpoint_dir("nowhere") == PACKAGE_CHECKPOINTS / "nowhere"  # none: the package's (training's --out)
    monkeypatch.delenv("FBPROBE_CHECKPOINTS")
    assert checkpoint_dir("tiny-fbt") == PACKAGE_CHECKPOINTS / "tiny-fbt"
