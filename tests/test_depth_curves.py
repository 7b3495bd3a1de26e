"""probes.depth_curves: self-contained Plotly pages of the depth curves, drawn by headless Chromium.

The two drawing tests need headless Chromium, a system package that no test installs: without it they are
skipped with the reason (`make chromium` installs it, or `apt-get install chromium`); the rest needs nothing.
"""
from __future__ import annotations

import re
import subprocess

import pytest

from probes.depth_curves import chromium_cmd, depth_curve_figure, find_chromium, render_html, write_depth_curves


def fake_doc(task="completion", modes=("standard", "recurrent-1"), ns=(0, 32), writes=(None,), L=3):
    rows = []
    for m in modes:
        for n in ns:
            for w in writes:
                for d in range(L + 1):
                    acc = 0.5 if (m == "standard" and d == 0) else min(1.0, 0.6 + 0.1 * d)
                    rows.append(dict(task=task, model="tiny", mode=m, n_distractors=n, writes=w, depth=d,
                                     accuracy=acc, accuracy_std=0.02, ci_low=acc - 0.05, ci_high=min(1, acc + 0.05),
                                     control_accuracy=0.5, selectivity=acc - 0.5, n_samples=64, n_groups=32,
                                     fold_accuracies=[acc] * 5))
    return {"meta": {"model": {"name": "tiny"}}, "results": rows}


def test_figure_panels_and_lines():
    fig = depth_curve_figure(fake_doc())
    titles = [a.text for a in fig.layout.annotations]
    assert "standard prefill" in titles and "recurrent-1 prefill" in titles
    named = [t for t in fig.data if t.name]
    assert sorted({t.name for t in named}) == ["N=0", "N=32"] and len(named) == 4  # one line per N per panel
    assert all("n = %{customdata[4]} samples" in t.hovertemplate for t in named)
    multi = depth_curve_figure(fake_doc("multi_register", ("standard", "recurrent-1", "recurrent-full"), (0,),
                                        (None, 2, 4, 8)))
    assert sorted({t.name for t in multi.data if t.name}) == ["2 writes/register", "4 writes/register",
                                                               "8 writes/register"]


def test_the_accuracy_axis_reaches_every_point_and_band():
    """A below-chance score (paired grouped CV: 0.20, its band down to 0.10) was drawn off the axis, whose floor was
    fixed at 0.3."""
    doc = fake_doc()
    assert depth_curve_figure(doc).layout.yaxis.range[0] == pytest.approx(0.3)
    low = doc["results"][1]
    low["accuracy"], low["ci_low"] = 0.2, 0.1
    assert depth_curve_figure(doc).layout.yaxis.range[0] <= 0.1


def test_html_is_self_contained_and_deterministic(tmp_path):
    html = render_html(fake_doc(), plotly="inline")
    assert not re.search(r"<script[^>]*\bsrc=", html) and not re.search(r"<link[^>]*\bhref=", html)
    assert "Plotly.newPlot" in html and len(html) > 1_000_000  # plotly.js inline
    assert html == render_html(fake_doc(), plotly="inline")
    p = write_depth_curves(fake_doc(), tmp_path / "d.html", plotly="inline")
    assert p.read_text() == html


def test_html_loads_the_plotly_js_beside_it_by_default(tmp_path):
    html = render_html(fake_doc())
    assert re.findall(r"<script[^>]*\bsrc=\"([^\"]+)\"", html) == ["plotly.min.js"]  # no network needed
    assert html == render_html(fake_doc()) and len(html) < 1_000_000
    p = write_depth_curves(fake_doc(), tmp_path / "d.html")
    assert p.read_text() == html and (tmp_path / "plotly.min.js").stat().st_size > 1_000_000


CHROMIUM = find_chromium()
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium not found (no chromium, chromium-browser, google-chrome or chrome "
                             "on PATH, no /usr/bin/chromium): the PNG export needs it; install it with `make "
                             "chromium` (Debian package `chromium`); tests never install anything")


@needs_chromium
def test_page_draws_in_headless_chromium(tmp_path):
    page = write_depth_curves(fake_doc(), tmp_path / "depth_curves.html")
    cmd = chromium_cmd(CHROMIUM, str(tmp_path / "profile"), "--virtual-time-budget=10000", "--dump-dom",
                       page.resolve().as_uri())
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-500:]
    dom = r.stdout
    assert 'class="main-svg"' in dom  # plotly drew its SVG
    assert dom.count('class="trace scatter') >= 12  # 2 panels x 2 N x (line + 2 band edges)
    assert "recurrent-1 prefill" in dom


@needs_chromium
def test_png_is_not_blank(tmp_path):
    from probes.depth_curves import write_png

    png = write_png(fake_doc(), tmp_path / "curve.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
