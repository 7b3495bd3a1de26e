"""gains.html and stability.html: every series has its own explicit look (colour, dash) on every panel, keyed by
its legend entry; stability checks every model before computing anything, prints each k once, and names the
state changes of exactly 0 that its log axis cannot draw."""
from __future__ import annotations

import time

import pytest

TASKS3 = ("completion", "memory", "multi_register")


def gains_rows(tasks=TASKS3, ns=(0, 8)):
    from analysis.gains import ARMS

    return [{"task": t, "n_distractors": n, "arm": arm, "mode": mode, "accuracy": 0.5 + 0.1 * i,
             "label_loss": 1.0 - 0.1 * i, "n_samples": 25}
            for t in tasks for n in ns for i, (arm, _, mode) in enumerate(ARMS)]


def stability_results(models, tasks=TASKS3, ks=(0, 1, 2, 3), change=lambda k: 1.0 / k):
    return {m: [{"task": t, "n_distractors": 8, "passes": k, "val_loss": 2.0 + 0.01 * k, "label_accuracy": 1.0,
                 "state_change": None if k == 0 else change(k), "state_norm": 3.0} for t in tasks for k in ks]
            for m in models}


def looks_by_legend_entry(fig, look):
    """{legend group: the one look of all its traces}; asserts every trace names its group and has one look."""
    groups: dict[str, set] = {}
    for tr in fig.data:
        assert tr.legendgroup and tr.legendgroup == tr.name, tr
        groups.setdefault(tr.legendgroup, set()).add(look(tr))
    for g, ls in groups.items():
        assert len(ls) == 1, (g, ls)  # the same series looks the same on every panel
    # each group has exactly one legend entry
    for g in groups:
        assert sum(tr.showlegend is not False for tr in fig.data if tr.legendgroup == g) == 1, g
    return {g: next(iter(ls)) for g, ls in groups.items()}


# ----- 1. colours match the legend ----------------------------------------------------------------------------
def test_gains_arms_have_one_explicit_colour_on_every_panel():
    from analysis.gains import ARMS, figure

    fig = figure(gains_rows())
    assert len(fig.data) == len(ARMS) * len(TASKS3) * 2
    for tr in fig.data:
        assert isinstance(tr.marker.color, str) and tr.marker.color, tr.name  # set, not left to plotly's cycle
    looks = looks_by_legend_entry(fig, lambda tr: tr.marker.color)
    assert set(looks) == {arm for arm, *_ in ARMS}
    assert len(set(looks.values())) == len(looks)  # two arms never share a colour


@pytest.mark.parametrize("n_models,tasks", [(2, TASKS3), (1, ("memory",)), (6, (
    "completion", "memory", "multi_register", "parity", "shell_game", "s5", "a5", "induction", "ioi", "lookup",
    "binding"))])
def test_stability_series_have_one_distinct_explicit_look(n_models, tasks):
    from analysis.stability import figure

    models = [f"model-{i}" for i in range(n_models)]
    fig = figure(stability_results(models, tasks))
    assert len(fig.data) == 2 * n_models * len(tasks)
    for tr in fig.data:
        assert isinstance(tr.line.color, str) and tr.line.color and tr.line.dash, tr.name
        assert tr.marker.color == tr.line.color, tr.name
    looks = looks_by_legend_entry(fig, lambda tr: (tr.line.color, tr.line.dash, tr.marker.symbol))
    assert set(looks) == {f"{m} / {t}" for m in models for t in tasks}
    # distinct legend entries: distinct (colour, dash), so no two are drawn alike (trace 10 was trace 0's blue)
    assert len({(c, d) for c, d, _ in looks.values()}) == len(looks)


def test_series_looks_never_repeat():
    from analysis.stability import series_looks

    looks = series_looks(2000)
    assert len({(c, d) for c, d, _ in looks}) == 2000
    assert looks[:12] == series_looks(12)  # a series' look depends on its place only


# ----- 2. every model checked before any computation -----------------------------------------------------------
def _no_compute(monkeypatch):
    from analysis import stability

    def boom(*a, **k):
        raise AssertionError("computed before every model was checked")

    monkeypatch.setattr(stability, "stability_curve", boom)
    monkeypatch.setattr(stability, "gate_token_dependence", boom)
    return stability


def test_stability_refuses_an_unknown_model_before_computing(tiny_ckpt, tmp_path, capsys, monkeypatch):
    stability = _no_compute(monkeypatch)
    t0 = time.time()
    with pytest.raises(SystemExit) as e:
        stability.main(["--models", f"{tiny_ckpt},nonexistent-model", "--tasks", "memory", "--passes", "2",
                        "--n-pairs", "2", "--distractors", "2", "--out", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "nonexistent-model" in lines[0], err
    assert time.time() - t0 < 5
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())


def test_stability_refuses_a_model_without_fusion_before_computing(tiny_ckpt, tmp_path, capsys, monkeypatch):
    from models.configs import qwen3_config
    from models.full_bandwidth import FullBandwidthLM
    from tasks import build_tokenizer

    tok = build_tokenizer()
    plain = tmp_path / "plain"
    FullBandwidthLM.from_config(qwen3_config(len(tok), n_layers=1, d_model=16, n_heads=2, n_kv_heads=1),
                                fusion=False, seed=0).save_pretrained(plain, tokenizer=tok)
    line = _refused_before_computing(monkeypatch, capsys, f"{tiny_ckpt},{plain}", "memory", tmp_path / "s")
    assert "no fusion module" in line and str(plain) in line
    assert not (tmp_path / "s" / "stability.json").exists() and not (tmp_path / "s" / "stability.html").exists()


def test_stability_refuses_a_tokenizer_without_the_task_before_computing(tiny_ckpt, tmp_path, capsys, monkeypatch):
    # the shipped tiny-fbt's tokenizer knows completion / memory / multi_register, not parity: the first model's
    # curve was computed before the second was refused
    line = _refused_before_computing(monkeypatch, capsys, f"{tiny_ckpt},tiny-fbt", "parity", tmp_path / "s")
    assert "does not know every word of the parity task" in line


def _refused_before_computing(monkeypatch, capsys, models: str, task: str, out) -> str:
    """analysis.stability on `models` with every computation refused: its one error line (exit 2)."""
    stability = _no_compute(monkeypatch)
    with pytest.raises(SystemExit) as e:
        stability.main(["--models", models, "--tasks", task, "--passes", "2", "--n-pairs", "2", "--distractors", "2",
                        "--out", str(out)])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1, err
    return lines[0]


# ----- 3. the summary prints each k once -----------------------------------------------------------------------
@pytest.mark.parametrize("ks,printed", [
    ((0, 1), [1]), ((0, 1, 2, 3), [1, 2, 3]), (tuple(range(6)), [1, 2, 3, 5]),
    (tuple(range(31)), [1, 2, 3, 5, 30]), ((0, 1, 2, 3, 100, 1000), [1, 2, 3, 100, 1000]),
    (tuple(range(31)) + (100, 1000), [1, 2, 3, 5, 1000])])
def test_summary_prints_each_k_once(ks, printed):
    import re

    from analysis.stability import summary_lines

    lines = summary_lines(stability_results(["m"], ("memory",), ks), ["memory"])
    assert len(lines) == 1
    assert [int(k) for k in re.findall(r"\bk=(\d+):", lines[0])] == printed, lines[0]
    assert ("..." in lines[0]) == (len([k for k in (1, 2, 3, 5, 10, 30, 100, 1000) if k in ks]) > 4)


def test_stability_run_prints_each_k_once(tiny_ckpt, tmp_path, capsys):
    import re

    from analysis import stability

    stability.main(["--models", str(tiny_ckpt), "--tasks", "memory", "--passes", "2", "--n-pairs", "2",
                    "--distractors", "2", "--out", str(tmp_path / "s")])
    [line] = [ln for ln in capsys.readouterr().out.splitlines() if " memory " in ln]
    assert re.findall(r"\bk=(\d+):", line) == ["1", "2"], line


# ----- 4. a state change of exactly 0 is named, not silently dropped from the log axis -------------------------
def zero_notes(fig):
    return [a.text for a in fig.layout.annotations if "exactly 0" in a.text]


def test_zero_state_change_is_named_on_the_page():
    from analysis.stability import figure

    res = stability_results(["tiny-fbt"], ("memory", "completion"), (0, 1, 2, 3, 100, 1000),
                            change=lambda k: 0.0 if k >= 100 else 1.0 / k)
    res["tiny-fbt"] = [r if r["task"] == "memory" or r["passes"] == 0 else {**r, "state_change": 0.5}
                       for r in res["tiny-fbt"]]  # completion: no zero
    fig = figure(res)
    [note] = zero_notes(fig)
    assert "not drawn on the log axis" in note and "tiny-fbt / memory: k = 100, 1000" in note, note
    assert "completion" not in note
    html = fig.to_html(include_plotlyjs=False)
    assert "not drawn on the log axis" in html and "k = 100, 1000" in html
    # no zero: no note
    assert zero_notes(figure(stability_results(["tiny-fbt"], ("memory",), (0, 1, 2, 100, 1000)))) == []


def test_a_long_run_of_zero_passes_is_one_range():
    """--passes 300 reaching the fixed point at 45 listed 256 passes in a note that ran off the page."""
    from analysis.stability import _ranges, zero_change_note

    assert _ranges([1, 2, 3, 5, 7, 8]) == "1-3, 5, 7-8" and _ranges([100, 1000]) == "100, 1000"
    rows = [{"task": "memory", "passes": k, "state_change": 0.0 if k >= 45 else 0.1} for k in range(0, 301)]
    assert zero_change_note({"m": rows}) == ["m / memory: k = 45-300"]
