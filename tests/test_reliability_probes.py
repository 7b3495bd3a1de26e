"""Reliability of probes.run / interventions.run: modes keyed by canonical name, bounded flags, output paths,
--overwrite, the output-directory lock, temporaries on interrupt, NaN weights. Tiny random checkpoints."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from common.errors import UserError

FAST = ["--n-pairs", "20", "--distractors", "0", "--n-boot", "50", "--no-progress"]


def _save_tiny(path, nan=False):
    import torch

    from models.configs import qwen3_config
    from models.full_bandwidth import FullBandwidthLM
    from tasks import build_tokenizer

    tok = build_tokenizer()
    model = FullBandwidthLM.from_config(qwen3_config(len(tok), n_layers=2, d_model=32, n_heads=2, n_kv_heads=1,
                                                     initializer_range=0.1), seed=0).eval()
    if nan:
        with torch.no_grad():
            model.fusion.up.weight[0, 0] = float("nan")
    model.save_pretrained(path, tokenizer=tok)
    return path


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def nan_ckpt(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("ckpt") / "nanny", nan=True)


def _probes(argv):
    from probes.run import main

    return main([str(a) for a in argv])


def _refused(main, argv, capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def _probes_refused(argv, capsys):
    from probes.run import main

    return _refused(main, argv, capsys)


def _interventions_refused(argv, capsys):
    from interventions.run import main

    return _refused(main, argv, capsys)


def _snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _no_tmp(d: Path):
    return [p.name for p in d.rglob("*") if p.name.endswith(".tmp")]


# ----- 1. modes are canonicalised once and rows keyed by the canonical name ------------------------------------
def test_alias_modes_do_not_shift_labels(tiny_ckpt, tmp_path):
    cache = tmp_path / "cache"
    a, b = tmp_path / "a", tmp_path / "b"
    assert _probes(["--task", "completion", "--model", tiny_ckpt, "--out", a, "--cache-dir", cache,
                    "--modes", "standard,fused-0,recurrent-1", *FAST]) == 0
    assert _probes(["--task", "completion", "--model", tiny_ckpt, "--out", b, "--cache-dir", cache,
                    "--modes", "standard,recurrent-1", *FAST]) == 0
    da, db = (json.loads((d / "probes.json").read_text()) for d in (a, b))
    assert da["meta"]["run"]["modes"] == ["standard", "recurrent-1"]
    assert {r["mode"] for r in da["results"]} == {"standard", "recurrent-1"}
    assert da["results"] == db["results"]  # the recurrent-1 rows hold recurrent-1's numbers


# ----- 2. bounded flags, checked before any work ---------------------------------------------------------------
@pytest.mark.parametrize("extra, needle", [
    (["--seed", "4294967296"], "--seed: must be an integer in 0..4294967295"),
    (["--seed", "-1"], "--seed: must be an integer in 0..4294967295"),
    (["--n-pairs", "0"], "--n-pairs: must be an integer in 5..5000"),
    (["--batch-size", "0"], "--batch-size: must be an integer in 1..4096"),
    (["--n-boot", "1000000000"], "--n-boot: must be an integer in 20..100000"),
    (["--distractors", "300"], "--distractors must be comma-separated integers in 0..256"),
    (["--modes", "fused-99999"], "at most 1000 fused passes"),
    (["--out", ""], "--out is empty"),
    (["--cache-dir", ""], "--cache-dir is empty"),
    (["--out", "/proc/x"], "--out /proc/x"),
])
def test_bad_flags_refused_before_any_work(extra, needle, tiny_ckpt, tmp_path, capsys, monkeypatch):
    import models.loading

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(models.loading, "load_model", no_load)
    argv = ["--task", "completion", "--model", tiny_ckpt, "--cache-dir", tmp_path / "c", "--out", tmp_path / "o"]
    err = _probes_refused(argv + extra, capsys)
    assert needle in err
    assert not (tmp_path / "o").exists() and not (tmp_path / "c").exists()


def test_help_documents_every_size_range(capsys):
    from probes.run import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for rng in ("5..5000", "0..4294967295", "1..4096", "20..100000", "0..256"):
        assert rng in text, rng


# ----- 3. output paths -----------------------------------------------------------------------------------------
def test_model_path_ending_in_dotdot_names_the_model(tiny_ckpt, tmp_path, monkeypatch):
    (tiny_ckpt / "sub").mkdir(exist_ok=True)
    monkeypatch.chdir(tmp_path)  # the default output lands under ./figures of the current directory
    assert _probes(["--task", "completion", "--model", tiny_ckpt / "sub" / "..", "--no-cache", *FAST]) == 0
    out = tmp_path / "figures" / "tiny" / "completion"
    doc = json.loads((out / "probes.json").read_text())
    assert doc["meta"]["model"]["name"] == "tiny" and doc["meta"]["run"]["model"] == "tiny"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figures"]


def test_interventions_default_out_is_under_the_current_directory(tiny_ckpt, tmp_path, monkeypatch, capsys):
    cwd = tmp_path / "cwd"
    target = cwd / "figures" / "tiny" / "completion"  # common.paths.default_output, as for probes.run
    target.mkdir(parents=True)
    (target / "causal_report.json").write_text("{}")
    (tiny_ckpt / "sub").mkdir(exist_ok=True)
    monkeypatch.chdir(cwd)
    err = _interventions_refused(["--model", tiny_ckpt / "sub" / "..", "--control-model", "none"], capsys)
    assert str(target) in err and "--overwrite" in err  # it looked beside probes.json, under the cwd
    assert [p.name for p in target.iterdir()] == ["causal_report.json"]
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "cwd", "cwd/figures", "cwd/figures/tiny", "cwd/figures/tiny/completion",
        "cwd/figures/tiny/completion/causal_report.json"]


# ----- 4. --overwrite replaces exactly the old probes run; refused runs touch nothing --------------------------
def test_overwrite_removes_old_activations_but_keeps_causal_report(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "o"
    base = ["--task", "completion", "--model", tiny_ckpt, "--out", out, "--no-cache", *FAST]
    assert _probes(base + ["--save-activations"]) == 0
    assert (out / "activations").is_dir()
    (out / "causal_report.json").write_text('{"keep": 1}')
    before = _snapshot(out)
    # a different run without --overwrite, or with a bad flag, is refused and modifies nothing; so is the same
    # run without --save-activations (it deleted the exported activations/)
    assert "different run" in _probes_refused(base + ["--seed", "1"], capsys)
    assert "holds activations/" in _probes_refused(base, capsys)
    _probes_refused(base + ["--seed", "1", "--overwrite", "--batch-size", "0"], capsys)
    _probes_refused(base + ["--seed", "1", "--overwrite", "--modes", "fused-99999"], capsys)
    assert _snapshot(out) == before
    assert _probes(base + ["--seed", "1", "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["causal_report.json", "depth_curves.html", "plotly.min.js",
                                                     "probes.json"]
    assert json.loads((out / "probes.json").read_text())["meta"]["seed"] == 1
    assert (out / "causal_report.json").read_text() == '{"keep": 1}'


def test_failed_write_keeps_the_old_run_and_leaves_no_tmp(tiny_ckpt, tmp_path, monkeypatch, capsys):
    import probes.run

    out = tmp_path / "o"
    base = ["--task", "completion", "--model", tiny_ckpt, "--out", out, "--no-cache", "--save-activations", *FAST]
    assert _probes(base) == 0
    before = _snapshot(out)

    def boom(doc):  # the last file of the write phase: activations and the page are already in temporaries
        raise KeyboardInterrupt

    monkeypatch.setattr(probes.run, "_json_dumps", boom)
    with pytest.raises(SystemExit) as e:
        _probes(base + ["--seed", "2", "--overwrite"])
    assert e.value.code == 130
    assert _snapshot(out) == before  # old probes.json, depth_curves.html and activations/ intact
    assert _no_tmp(out) == [] and sorted(p.name for p in out.iterdir()) == ["activations", "depth_curves.html",
                                                                             "plotly.min.js", "probes.json"]


def test_sigterm_mid_run_leaves_no_folder_and_keeps_an_earlier_run(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """A scheduler's SIGTERM during the write phase: 'terminated', exit 143; a fresh run leaves no folder (nor the
    plotly.js temporary it had staged), an --overwrite run keeps the earlier results byte for byte."""
    import signal

    import probes.run

    real = probes.run._json_dumps

    def terminated(doc):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):
            pass
        return real(doc)

    monkeypatch.setattr(probes.run, "_json_dumps", terminated)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        fresh = tmp_path / "fresh"
        with pytest.raises(SystemExit) as e:
            _probes(["--task", "completion", "--model", tiny_ckpt, "--out", fresh, "--no-cache", *FAST])
        assert e.value.code == 143 and capsys.readouterr().err.endswith("terminated\n")
        assert not fresh.exists()

        out = tmp_path / "o"
        base = ["--task", "completion", "--model", tiny_ckpt, "--out", out, "--no-cache", *FAST]
        monkeypatch.setattr(probes.run, "_json_dumps", real)
        assert _probes(base) == 0
        before = _snapshot(out)
        monkeypatch.setattr(probes.run, "_json_dumps", terminated)
        with pytest.raises(SystemExit) as e:
            _probes(base + ["--seed", "2", "--overwrite"])
        assert e.value.code == 143
        assert _snapshot(out) == before and _no_tmp(out) == []
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_write_depth_curves_leaves_no_tmp_on_interrupt(tmp_path, monkeypatch):
    import common.io
    from probes import depth_curves

    monkeypatch.setattr(depth_curves, "render_html", lambda *a, **k: "<html></html>")

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(common.io.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        depth_curves.write_depth_curves({"meta": {}, "results": []}, tmp_path / "depth_curves.html")
    assert list(tmp_path.iterdir()) == []


def test_an_empty_cache_variable_is_refused(tiny_ckpt, tmp_path, capsys, monkeypatch):
    """FBPROBE_CACHE="" put the cache in ./activations of the current directory, silently."""
    monkeypatch.setenv("FBPROBE_CACHE", " ")
    monkeypatch.chdir(tmp_path)
    base = ["--task", "completion", "--model", tiny_ckpt, "--out", tmp_path / "o", *FAST]
    assert "FBPROBE_CACHE is set but empty" in _probes_refused(base, capsys)
    assert list(tmp_path.iterdir()) == []


def test_a_folder_where_a_file_goes_is_refused_before_anything_moves(tiny_ckpt, tmp_path, capsys):
    """A folder named probes.json (or plotly.min.js) in --out was a traceback, and with --overwrite the page and
    plotly.min.js were already replaced when it came: a new page beside the old results."""
    from common.io import commit_outputs
    from common.staged import Staged

    out = tmp_path / "o"
    (out / "probes.json").mkdir(parents=True)
    base = ["--task", "completion", "--model", tiny_ckpt, "--out", out, "--no-cache", *FAST]
    assert "not a readable probes.json" in _probes_refused(base, capsys)
    (out / "depth_curves.html").write_text("old page")
    assert "is a folder where this run writes a file" in _probes_refused(base + ["--overwrite"], capsys)
    assert (out / "depth_curves.html").read_text() == "old page" and not (out / "plotly.min.js").exists()
    assert _no_tmp(out) == []
    with pytest.raises(UserError, match="is a folder"):
        with Staged(out) as st:
            st.file("a.txt", "new")
            st.file("probes.json", "new")
            st.commit()
    assert not (out / "a.txt").exists()
    tmp = tmp_path / "t"
    tmp.write_text("x")
    with pytest.raises(UserError, match="is a folder"):
        commit_outputs([(out / "probes.json", tmp)], overwrite=True)


def test_staged_restores_an_old_folder_when_the_commit_fails(tmp_path, monkeypatch):
    import common.staged
    from common.staged import Staged

    (tmp_path / "activations").mkdir()
    (tmp_path / "activations" / "old.npz").write_text("old")
    (tmp_path / "probes.json").write_text("old")
    real = common.staged.os.replace

    def fail_on_file(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(common.staged.os, "replace", fail_on_file)
    with pytest.raises(KeyboardInterrupt):
        with Staged(tmp_path) as st:
            (st.dir("activations") / "new.npz").write_text("new")
            st.file("probes.json", "new")
            st.commit()
    monkeypatch.setattr(common.staged.os, "replace", real)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["activations", "old.npz", "probes.json"]
    assert (tmp_path / "probes.json").read_text() == "old"


# ----- 5. one run at a time per output directory; the cache under concurrent writers ---------------------------
def test_probes_refused_while_another_run_holds_the_directory(tiny_ckpt, tmp_path, capsys):
    from common.io import DirLock

    out = tmp_path / "o"
    with DirLock(out):
        err = _probes_refused(["--task", "completion", "--model", tiny_ckpt, "--out", out, "--no-cache", *FAST],
                              capsys)
    assert "right now" in err and list(out.iterdir()) == []


def test_interventions_refused_while_another_run_holds_the_directory(tiny_ckpt, tmp_path, capsys):
    from common.io import DirLock

    out = tmp_path / "o"
    with DirLock(out):
        err = _interventions_refused(["--model", tiny_ckpt, "--out", out, "--control-model", "none",
                                      "--n-pairs", "10", "--no-progress"], capsys)
    assert "right now" in err and list(out.iterdir()) == []


def test_cache_readers_never_see_a_partial_entry(tmp_path):
    from probes.collect import ActivationCache

    cache = ActivationCache(tmp_path)
    arr = np.arange(4 * 3 * 256, dtype=np.float32).reshape(4, 3, 256)
    stop, bad, errors = threading.Event(), [], []

    def writer():
        try:
            for _ in range(40):
                cache.put("k", arr)
        except Exception as e:  # pragma: no cover
            errors.append(e)

    def reader():
        while not stop.is_set():
            got = cache.get("k", arr.shape)
            if got is not None and not np.array_equal(got, arr):
                bad.append(got)

    ws = [threading.Thread(target=writer) for _ in range(2)]
    r = threading.Thread(target=reader)
    r.start()
    for w in ws:
        w.start()
    for w in ws:
        w.join()
    stop.set()
    r.join()
    assert not errors and not bad
    assert np.array_equal(cache.get("k", arr.shape), arr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.npz"]


# ----- 7. NaN weights: one line from interventions.run too, for the model and for the control ------------------
def test_probes_refuses_nan_weights(nan_ckpt, tmp_path, capsys):
    err = _probes_refused(["--task", "completion", "--model", nan_ckpt, "--out", tmp_path / "o", "--no-cache",
                           *FAST], capsys)
    assert "nan" in err.lower() and not (tmp_path / "o").exists()


@pytest.mark.parametrize("which", ["model", "control"])
def test_interventions_refuses_nan_weights(which, tiny_ckpt, nan_ckpt, tmp_path, capsys):
    main_m, control = (nan_ckpt, tiny_ckpt) if which == "model" else (tiny_ckpt, nan_ckpt)
    err = _interventions_refused(["--model", main_m, "--control-model", control, "--out", tmp_path / "o",
                                  "--n-pairs", "10", "--distractors", "0", "--no-progress"], capsys)
    assert "nan" in err.lower() and not (tmp_path / "o").exists()
