"""analysis.length_curves and analysis.where_state: what they write, and when.

* --png is checked before anything is written: without headless Chromium, or at the --out page's own path (or its
  plotly.min.js), the run is one line and writes nothing (the page used to be written first);
* the page and the PNG never replace a file another run wrote while this one worked, without --overwrite (two runs
  into one --out both wrote, the last one won): the final write puts a new file in place only where none is;
* `--markdown | head` ends quietly, without a BrokenPipeError traceback.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _eval(tmp_path) -> str:
    p = tmp_path / "in" / "eval.json"
    p.parent.mkdir(exist_ok=True)
    p.write_text(json.dumps({"meta": {"model": "m"}, "results": [
        {"task": "parity", "n_distractors": n, "mode": "std", "accuracy": 0.5 + n / 100, "n_samples": 10}
        for n in (4, 8, 16)]}))
    return str(p)


def _where_args(tmp_path) -> list[str]:
    from tests.test_where_state import _docs

    d = tmp_path / "in"
    d.mkdir(exist_ok=True)
    probes, loop, fb = _docs(d)
    return ["--probes", probes, "--causal", loop, "--feedback", fb]


def _cli(which, tmp_path):
    """(main, its input arguments)."""
    if which == "length_curves":
        from analysis.length_curves import main

        return main, [_eval(tmp_path)]
    from analysis.where_state import main

    return main, _where_args(tmp_path)


def _files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


@pytest.fixture
def fake_chromium(monkeypatch):
    """A Chromium that 'renders' every PNG as the bytes b'PNG' (the tests run without a browser)."""
    from probes import depth_curves

    def figure_png(fig, png_path, div_id, pad=0):
        Path(png_path).write_bytes(b"PNG")
        return Path(png_path)

    monkeypatch.setattr(depth_curves, "find_chromium", lambda: "/usr/bin/fake-chromium")
    monkeypatch.setattr(depth_curves, "figure_png", figure_png)


@pytest.mark.parametrize("which", ["length_curves", "where_state"])
def test_png_is_checked_before_anything_is_written(which, tmp_path, capsys, monkeypatch):
    from probes import depth_curves

    main, args = _cli(which, tmp_path)
    out = tmp_path / "out"
    monkeypatch.setattr(depth_curves, "find_chromium", lambda: None)
    for extra, msg in ((["--out", str(out / "p.html"), "--png", str(out / "p.png")], "Chromium"),
                       (["--out", str(out / "p.html"), "--png", str(out / "p.html")], "is the --out page itself"),
                       (["--out", str(out / "p.html"), "--png", str(out / "plotly.min.js")],
                        "is the page's plotly.min.js")):
        with pytest.raises(SystemExit) as e:
            main(args + extra)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and msg in err, err
        assert not out.exists()  # no page, no plotly.min.js, no folder


@pytest.mark.parametrize("which", ["length_curves", "where_state"])
def test_page_and_png_are_written_together(which, tmp_path, capsys, fake_chromium):
    main, args = _cli(which, tmp_path)
    out = tmp_path / "out"
    assert main(args + ["--out", str(out / "p.html"), "--png", str(out / "p.png")]) == 0
    assert _files(out) == ["p.html", "p.png", "plotly.min.js"] and (out / "p.png").read_bytes() == b"PNG"
    assert f"wrote {out / 'p.png'}" in capsys.readouterr().out
    (out / "p.png").write_bytes(b"old")
    with pytest.raises(SystemExit):  # an existing PNG needs --overwrite
        main(args + ["--out", str(out / "q.html"), "--png", str(out / "p.png")])
    assert (out / "p.png").read_bytes() == b"old" and not (out / "q.html").exists()
    assert main(args + ["--out", str(out / "p.html"), "--png", str(out / "p.png"), "--overwrite"]) == 0
    assert (out / "p.png").read_bytes() == b"PNG"


@pytest.mark.parametrize("which", ["length_curves", "where_state"])
def test_a_file_another_run_wrote_meanwhile_is_never_replaced(which, tmp_path, capsys, monkeypatch, fake_chromium):
    """Two runs into one --out without --overwrite: both passed the check at the start and the last one's page
    replaced the first's. The other run's file appears after this run's checks (here: while plotly.min.js is
    written), and this run is refused in one line, its temporaries gone."""
    import analysis.length_curves as lc

    main, args = _cli(which, tmp_path)
    out = tmp_path / "out"
    real = lc.write_plotly_js
    theirs = {}

    def other_run_finishes(directory, mode="directory"):
        for p, data in theirs.items():
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(data)
        return real(directory, mode)

    monkeypatch.setattr(lc, "write_plotly_js", other_run_finishes)
    theirs = {out / "p.html": "the other run's page"}
    with pytest.raises(SystemExit) as e:
        main(args + ["--out", str(out / "p.html")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "appeared while this run was working" in err
    assert (out / "p.html").read_text() == "the other run's page"
    assert _files(out) == ["p.html", "plotly.min.js"]  # no temporary left
    # the PNG taken meanwhile: refused, and this run's page (already placed) taken back
    theirs = {out / "q.png": "the other run's png"}
    with pytest.raises(SystemExit):
        main(args + ["--out", str(out / "q.html"), "--png", str(out / "q.png")])
    assert "q.png appeared while this run was working" in capsys.readouterr().err
    assert (out / "q.png").read_text() == "the other run's png" and not (out / "q.html").exists()
    assert _files(out) == ["p.html", "plotly.min.js", "q.png"]
    # --overwrite: replaced, as asked
    theirs = {out / "p.html": "the other run's page"}
    assert main(args + ["--out", str(out / "p.html"), "--overwrite"]) == 0
    assert "<html>" in (out / "p.html").read_text()


def test_markdown_into_a_closed_pipe_ends_quietly(tmp_path):
    """`--markdown | head -1`: the reader goes away, and the command ends without a BrokenPipeError traceback."""
    ev = _eval(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "analysis.length_curves", ev, "--markdown", "--out",
                             str(tmp_path / "p.html")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # before the command prints anything: every write goes to a pipe with no reader
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert err == "" and (tmp_path / "p.html").is_file()


def test_no_clobber_write_without_hard_links(tmp_path, monkeypatch):
    """Where the file system has no hard links, the name is claimed with O_EXCL first: still never replaced."""
    import errno

    import common.io as cio

    def no_links(src, dst):
        raise OSError(errno.EPERM, "no hard links here")

    monkeypatch.setattr(cio.os, "link", no_links)
    out = tmp_path / "p.html"
    cio.commit_outputs([(out, cio.temp_beside(out, "new"))], overwrite=False)
    assert out.read_text() == "new"
    with pytest.raises(cio.UserError, match="appeared while this run was working"):
        cio.commit_outputs([(out, cio.temp_beside(out, "newer"))], overwrite=False)
    assert out.read_text() == "new" and _files(tmp_path) == ["p.html"]
