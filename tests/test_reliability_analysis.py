"""Reliability of analysis.evaluate, analysis.stability, analysis.gains and analysis.recirculation's CLIs.

Aliased modes are one mode (keyed by what they compute, never by position); every size flag is bounded and
every output path checked before any model loads (a bad invocation: one stderr line, exit 2); results are
written atomically, never silently over an earlier run's, and never while another run holds the folder.
"""
from __future__ import annotations

import json
import shutil

import pytest

from common.io import DirLock

MISSING = "/nonexistent/model-dir"  # loading it is an error too: a check that runs late reports the model instead




def one_line_error(capsys, main, argv, *needles):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error:"), err
    for n in needles:
        assert n in err[0], err[0]
    return err[0]


def evaluate_main():
    from analysis.evaluate import main
    return main


def stability_main():
    from analysis.stability import main
    return main


def gains_main():
    from analysis.gains import main
    return main


def recirculation_main():
    from analysis.recirculation.cli import main
    return main


def rows_by_mode(path):
    return {r["mode"]: (r["accuracy"], r["label_loss"]) for r in json.loads(path.read_text())["results"]}


# ----- 1. aliased modes ----------------------------------------------------------------------------------------
def test_aliased_modes_give_the_plain_numbers(tiny_ckpt, tmp_path, capsys):
    main = evaluate_main()
    common = ["--model", str(tiny_ckpt), "--tasks", "completion", "--distractors", "8", "--n-pairs", "16",
              "--no-progress"]
    main([*common, "--modes", "std,soft", "--out", str(tmp_path / "plain.json")])
    main([*common, "--modes", "std,standard,soft", "--out", str(tmp_path / "alias.json")])
    main([*common, "--modes", "fused-0,recurrent-1,recurrent-0,std,soft", "--out", str(tmp_path / "alias2.json")])
    plain = rows_by_mode(tmp_path / "plain.json")
    assert set(plain) == {"std", "soft"}
    assert rows_by_mode(tmp_path / "alias.json") == plain
    # the first spelling names the rows: fused-0 is the standard prefill, recurrent-1 is soft decoding
    alias2 = rows_by_mode(tmp_path / "alias2.json")
    assert alias2 == {"standard": plain["std"], "recurrent-1": plain["soft"]}


def test_evaluate_function_dedupes_aliases(tiny_ckpt):
    from analysis.evaluate import evaluate
    from models.full_bandwidth import FullBandwidthLM
    from tasks import build_tokenizer

    model, tok = FullBandwidthLM.from_pretrained(tiny_ckpt).eval(), build_tokenizer()
    plain = evaluate(model, tok, ["memory"], [0], ["std", "soft", "fused"], 2, 4, progress=False)
    alias = evaluate(model, tok, ["memory"], [0], ["std", "standard", "soft", "recurrent-1", "fused", "fused-2"],
                     2, 4, batch_size=3, progress=False)
    key = lambda rows: {r["mode"]: (r["accuracy"], pytest.approx(r["label_loss"], rel=1e-5)) for r in rows}  # noqa: E731
    assert [r["mode"] for r in alias] == ["std", "soft", "fused", "fused-1", "fused-2"]
    assert key(alias) == key(plain)
    with pytest.raises(ValueError):
        evaluate(model, tok, ["memory"], [0], ["std"], 0, 4, batch_size=0, progress=False)


# ----- 2, 3, 7. bounded sizes, one line, before any model loads ------------------------------------------------
@pytest.mark.parametrize("args,flag", [
    (["--batch-size", "-4"], "--batch-size"), (["--batch-size", "0"], "--batch-size"),
    (["--batch-size", "1000000"], "--batch-size"),
    (["--n-pairs", "1000000000"], "--n-pairs"), (["--n-pairs", "0"], "--n-pairs"),
    (["--distractors", "100000000"], "--distractors"), (["--distractors", "-1"], "--distractors"),
    (["--distractors", "1.5"], "--distractors"),
    (["--modes", "fused-1..100000"], "fused-1..100000"), (["--modes", "fused-1..0"], "fused-1..0"),
    (["--modes", "fused-1..3x"], "fused-1..3x"), (["--modes", "sideways"], "sideways"),
    (["--tasks", "nope"], "nope"), (["--bogus"], "--bogus"),
])
def test_evaluate_bad_sizes(tmp_path, capsys, args, flag):
    one_line_error(capsys, evaluate_main(), ["--model", MISSING, "--out", str(tmp_path / "e.json"), *args], flag)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("args,flag", [
    (["--passes", "1000000000"], "--passes"), (["--passes", "0"], "--passes"),
    (["--n-pairs", "1000000000"], "--n-pairs"), (["--distractors", "100000000"], "--distractors"),
    (["--distractors", "-1"], "--distractors"), (["--models", ","], "--models"), (["--bogus"], "--bogus"),
])
def test_stability_bad_sizes(tmp_path, capsys, args, flag):
    one_line_error(capsys, stability_main(), ["--models", MISSING, "--out", str(tmp_path / "s"), *args], flag)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("args,flag", [
    (["--n-pairs", "1000000000"], "--n-pairs"), (["--distractors", "100000000"], "--distractors"),
    (["--distractors", "x"], "--distractors"), (["--bogus"], "--bogus"),
])
def test_gains_bad_sizes(tmp_path, capsys, args, flag):
    one_line_error(capsys, gains_main(), ["--fbt", MISSING, "--std", MISSING, "--out", str(tmp_path / "g"), *args],
                   flag)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("args,flag", [
    (["--passes", "nan"], "--passes"), (["--passes", "1.7"], "--passes"), (["--passes", "0"], "--passes"),
    (["--passes", "100000000"], "--passes"), (["--threads", "-1"], "--threads"),
    (["--threads", "100000"], "--threads"), (["--small-angle", "nan"], "--small-angle"),
    (["--small-angle", "-0.1"], "--small-angle"), (["--alpha", "nan"], "--alpha"), (["--alphas", "0.1,nan"], "--alphas"),
    (["--fail", "inf"], "--fail"), (["--temps", "0"], "--temps"), (["--temps", "nan"], "--temps"),
    (["--seq-len", "1"], "--seq-len"), (["--seq-len", "1000000000"], "--seq-len"), (["--n-tune", "0"], "--n-tune"),
    (["--n-test", "1000000000"], "--n-test"), (["--batch", "0"], "--batch"), (["--cost-block", "-1"], "--cost-block"),
    (["--ramp", "-1"], "--ramp"), (["--mediation-pairs", "0"], "--mediation-pairs"),
    (["--mediation-pairs", "1000000000"], "--mediation-pairs"),
    (["--mediation-distractors", "100000000"], "--mediation-distractors"), (["--seed", "-1"], "--seed"),
    (["--mediation-task", "nope"], "--mediation-task"), (["--mediation-spec", "3-1-0.1"], "3-1-0.1"),
    (["--bogus"], "--bogus"),
])
def test_recirculation_bad_numbers(tmp_path, capsys, args, flag):
    one_line_error(capsys, recirculation_main(), ["--model", MISSING, "--out", str(tmp_path / "r"), *args], flag)
    assert not any(tmp_path.iterdir())


def test_help_documents_the_ranges(capsys):
    for main, needles in ((evaluate_main(), ["1..5000", "0..16384", "1..4096", "1..1000"]),
                          (stability_main(), ["1..1000", "0..1024"]), (gains_main(), ["1..5000", "0..1024"]),
                          (recirculation_main(), ["3..4096", "1..1000", "0..1024", "[0, pi]"])):
        with pytest.raises(SystemExit) as e:
            main(["--help"])
        assert e.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        for n in needles:
            assert n in text, (main.__module__, n)


# ----- 5. output paths checked before any model loads ----------------------------------------------------------
def _cli_args(name, out):
    return {"evaluate": ["--model", MISSING, "--out", out], "stability": ["--models", MISSING, "--out", out],
            "gains": ["--fbt", MISSING, "--std", MISSING, "--out", out],
            "recirculation": ["--model", MISSING, "--out", out]}[name]


MAINS = {"evaluate": evaluate_main, "stability": stability_main, "gains": gains_main,
         "recirculation": recirculation_main}


@pytest.mark.parametrize("name", list(MAINS))
def test_bad_out_is_refused_first(name, tmp_path, capsys):
    main = MAINS[name]()
    one_line_error(capsys, main, _cli_args(name, "/proc/x"), "--out")
    one_line_error(capsys, main, _cli_args(name, ""), "--out")
    f = tmp_path / "a-file"
    f.write_text("keep")
    if name == "evaluate":  # a file output: a directory is refused
        d = tmp_path / "a-dir"
        d.mkdir()
        one_line_error(capsys, main, [*_cli_args(name, str(d)), "--overwrite"], "--out")
        assert list(d.iterdir()) == []
    else:
        one_line_error(capsys, main, _cli_args(name, str(f)), "--out")
    assert f.read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["a-file"] + (["a-dir"] if name == "evaluate" else []))


def test_evaluate_out_dir_overwrite_leaves_no_tmp(tiny_ckpt, tmp_path, capsys):
    d = tmp_path / "DIR"
    d.mkdir()
    one_line_error(capsys, evaluate_main(), ["--model", str(tiny_ckpt), "--tasks", "memory", "--distractors", "0",
                                             "--modes", "std", "--n-pairs", "2", "--no-progress", "--out", str(d),
                                             "--overwrite"], "--out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["DIR"] and not any(d.iterdir())


# ----- 6. atomic writes -----------------------------------------------------------------------------------------
def test_evaluate_failed_write_leaves_no_temporary(tiny_ckpt, tmp_path, monkeypatch):
    import os

    def boom(*a, **k):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk gone"):
        evaluate_main()(["--model", str(tiny_ckpt), "--tasks", "memory", "--distractors", "0", "--modes", "std",
                         "--n-pairs", "2", "--no-progress", "--out", str(tmp_path / "o" / "eval.json")])
    assert list(tmp_path.rglob("*")) == []  # no temporary, and no folder the failed run made


def test_evaluate_default_out_from_safe_name(tiny_ckpt, tmp_path, monkeypatch, capsys):
    m = tmp_path / "mymodel"
    shutil.copytree(tiny_ckpt, m)
    (m / "sub").mkdir()
    args = ["--tasks", "memory", "--distractors", "0", "--modes", "std", "--n-pairs", "2", "--no-progress"]
    monkeypatch.chdir(m)  # the default ./figures/ would lie inside the model's folder: refused (common.cli)
    one_line_error(capsys, evaluate_main(), ["--model", ".", *args], "model directory")
    assert not (m / "figures").exists()
    monkeypatch.chdir(tmp_path)  # a path ending in '..' is named after the folder it resolves to
    evaluate_main()(["--model", "mymodel/sub/..", *args])
    assert (tmp_path / "figures" / "mymodel" / "eval.json").is_file()


# ----- 8. never silently overwrite; the lock -------------------------------------------------------------------
def test_evaluate_refuses_to_overwrite_and_respects_the_lock(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "eval.json"
    args = ["--model", str(tiny_ckpt), "--tasks", "memory", "--distractors", "0", "--modes", "std", "--n-pairs", "2",
            "--no-progress", "--out", str(out)]
    evaluate_main()(args)
    before = out.read_bytes()
    one_line_error(capsys, evaluate_main(), args, "--overwrite")
    with DirLock(tmp_path):  # another run is writing into the folder: refused, nothing written
        one_line_error(capsys, evaluate_main(), [*args, "--overwrite"], "another")
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["eval.json"]
    evaluate_main()([*args, "--overwrite"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json"]


def test_evaluate_holds_its_folders_lock_for_the_whole_run(tiny_ckpt, tmp_path, monkeypatch):
    """A second run into the folder is refused while the first one computes (it was locked only while writing:
    two runs overlapped and the last writer won)."""
    import analysis.evaluate as ev
    from common.errors import UserError

    real, seen = ev.evaluate, []

    def evaluate_while_probing_the_lock(*a, **k):
        try:
            with DirLock(tmp_path):
                seen.append("free")
        except UserError:
            seen.append("held")
        return real(*a, **k)

    monkeypatch.setattr(ev, "evaluate", evaluate_while_probing_the_lock)
    evaluate_main()(["--model", str(tiny_ckpt), "--tasks", "memory", "--distractors", "0", "--modes", "std",
                     "--n-pairs", "2", "--no-progress", "--out", str(tmp_path / "eval.json")])
    assert seen == ["held"] and (tmp_path / "eval.json").is_file()


@pytest.mark.parametrize("name,owned", [("stability", ["stability.json", "stability.html"]),
                                        ("gains", ["gains.json", "gains.html"]),
                                        ("recirculation", ["results.json", "cost.html"])])
def test_dir_outputs_refuse_existing_results_and_a_held_lock(name, owned, tmp_path, capsys):
    main = MAINS[name]()
    out = tmp_path / "o"
    for f in owned:  # any one of a run's files is an earlier run's result
        out.mkdir(exist_ok=True)
        (out / f).write_text("old")
        one_line_error(capsys, main, _cli_args(name, str(out)), "--overwrite")
        assert [p.read_text() for p in out.iterdir()] == ["old"]
        (out / f).unlink()
    with DirLock(out):
        one_line_error(capsys, main, [*_cli_args(name, str(out)), "--overwrite"], "another")
    assert list(out.iterdir()) == []


def test_recirculation_writes_strict_json_atomically_and_drops_stale_files(tmp_path, capsys):
    from analysis.recirculation.cli import _results_text
    from common.errors import UserError

    out = tmp_path / "r"
    out.mkdir()
    (out / "results.json").write_text("old")
    (out / "mediation.html").write_text("stale: from an earlier run with --mediation")
    (out / ".results.json.abc.tmp").write_text("left by a killed run")
    recirculation_main()(["--model", "tiny-random-qwen3", "--out", str(out), "--overwrite", "--seq-len", "8",
                          "--n-tune", "1", "--n-test", "1", "--batch", "1", "--pairs", "4:1", "--alphas", "0.5",
                          "--passes", "1", "--temps", "1.1"])
    res = json.loads((out / "results.json").read_text())  # strict JSON parses
    assert res["best"]["alpha"] == 0.5
    assert sorted(p.name for p in out.iterdir()) == ["basis.html", "cost.html", "dose.html", "heatmap.html",
                                                     "plotly.min.js", "results.json", "temperature.html"]
    with pytest.raises(UserError, match="NaN"):
        _results_text({"x": float("nan")})
