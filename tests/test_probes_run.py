"""probes.run CLI: end to end on a tiny random checkpoint; determinism; bad input -> one line, exit 2."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent




FAST = ["--n-pairs", "20", "--distractors", "0,8", "--n-boot", "100", "--no-progress"]


def run_cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "probes.run", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=900)


def strip_wall(doc):
    doc = json.loads(json.dumps(doc))
    doc["meta"].pop("wall_time_s")
    return doc


def test_end_to_end_deterministic(tiny_ckpt, tmp_path):
    from probes.run import main

    a, b = tmp_path / "a", tmp_path / "b"
    # separate caches: the second run recomputes everything
    assert main(["--task", "completion", "--model", str(tiny_ckpt), "--out", str(a), "--cache-dir",
                 str(tmp_path / "c1"), *FAST]) == 0
    assert main(["--task", "completion", "--model", str(tiny_ckpt), "--out", str(b), "--cache-dir",
                 str(tmp_path / "c2"), "--save-activations", *FAST]) == 0
    ja, jb = (a / "probes.json").read_text(), (b / "probes.json").read_text()
    da, db = json.loads(ja), json.loads(jb)
    assert strip_wall(da) == strip_wall(db)
    # byte-identical apart from the wall-time line
    strip = lambda s: [ln for ln in s.splitlines() if '"wall_time_s"' not in ln]  # noqa: E731
    assert strip(ja) == strip(jb)
    rows = da["results"]
    assert {(r["mode"], r["n_distractors"]) for r in rows} == {(m, n) for m in ("standard", "recurrent-1")
                                                                for n in (0, 8)}
    assert {r["depth"] for r in rows} == {0, 1, 2}
    keys = {"task", "mode", "n_distractors", "depth", "accuracy", "accuracy_std", "ci_low", "ci_high",
            "control_accuracy", "n_samples", "n_groups"}
    assert keys <= set(rows[0])
    for r in rows:  # standard depth 0 at chance: every prompt ends with the same token
        if r["mode"] == "standard" and r["depth"] == 0:
            assert r["ci_low"] <= 0.5 <= r["ci_high"]
    assert da["meta"]["warnings"] == [] and da["meta"]["seed"] == 0
    assert {"torch", "transformers", "nnsight"} <= set(da["meta"]["versions"])
    # the page loads the one plotly.min.js of its folder (written in the same staged commit)
    assert (a / "depth_curves.html").stat().st_size < 1_000_000 and (a / "plotly.min.js").stat().st_size > 1_000_000
    assert 'src="plotly.min.js"' in (a / "depth_curves.html").read_text()
    assert sorted(p.name for p in (b / "activations").iterdir()) == sorted(
        f"N{n}_{m}.{ext}" for n in (0, 8) for m in ("standard", "recurrent-1") for ext in ("npz", "json"))
    # same run again into the same dir: allowed (same settings), cache hit
    assert main(["--task", "completion", "--model", str(tiny_ckpt), "--out", str(a), "--cache-dir",
                 str(tmp_path / "c1"), *FAST]) == 0
    assert strip_wall(json.loads((a / "probes.json").read_text())) == strip_wall(da)


def test_multi_register_per_writes(tiny_ckpt, tmp_path):
    from probes.run import main

    out = tmp_path / "m"
    assert main(["--task", "multi_register", "--model", str(tiny_ckpt), "--out", str(out), "--modes",
                 "standard,recurrent-2", "--distractors", "0", "--n-pairs", "30", "--n-boot", "50",
                 "--no-cache", "--no-progress"]) == 0
    rows = json.loads((out / "probes.json").read_text())["results"]
    assert {r["writes"] for r in rows} == {None, 2, 4, 8}
    assert {r["n_samples"] for r in rows if r["writes"] == 2} == {20}


@pytest.fixture(scope="module")
def plain_hf_dir(tmp_path_factory):
    """A plain HF Llama-style model dir (no fusion module) with the task tokenizer beside it."""
    from transformers import AutoModelForCausalLM

    from models.configs import qwen3_config
    from tasks import build_tokenizer

    tok = build_tokenizer()
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(qwen3_config(len(tok), n_layers=3, d_model=32, n_heads=2, n_kv_heads=1,
                                                       initializer_range=0.1))
    path = tmp_path_factory.mktemp("hf") / "plain"
    lm.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_recirculate_mode_on_plain_model(plain_hf_dir, tmp_path):
    """--recirculate adds a recirculated mode; depths 0..d of the normal branch equal standard's (the two
    streams only differ above the target depth), deeper ones differ, and plain models default to standard."""
    from probes.run import main

    out = tmp_path / "r"
    assert main(["--task", "completion", "--model", str(plain_hf_dir), "--out", str(out), "--recirculate",
                 "3:1:0.5", "--save-activations", "--no-cache", *FAST]) == 0
    doc = json.loads((out / "probes.json").read_text())
    assert doc["meta"]["run"]["modes"] == ["standard", "recirc-3:1:0.5:convex"]
    assert {r["mode"] for r in doc["results"]} == {"standard", "recirc-3:1:0.5:convex"}
    import numpy as np
    for n in (0, 8):
        std = np.load(out / "activations" / f"N{n}_standard.npz")["resid"]
        rec = np.load(out / "activations" / f"N{n}_recirc-3:1:0.5:convex.npz")["resid"]
        assert np.abs(std[:, :2] - rec[:, :2]).max() <= 1e-5
        assert np.abs(std[:, 2:] - rec[:, 2:]).max() > 1e-3
    r = run_cli("--task", "completion", "--model", plain_hf_dir, "--out", tmp_path / "x", "--recirculate",
                "4:1:0.5", *FAST)
    assert r.returncode == 2 and "out of range" in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_a_config_change_is_another_run(plain_hf_dir, tmp_path, capsys):
    """The same tensors under another config (here the RoPE base) are another model: its run into the first one's
    folder is refused, and it shares no cached activations with it."""
    import shutil

    from probes.run import main

    cache = tmp_path / "cache"
    args = ["--task", "completion", "--out", str(tmp_path / "o"), "--cache-dir", str(cache), "--no-mdl",
            "--save-activations", *FAST]
    assert main(["--model", str(plain_hf_dir), *args]) == 0
    other = tmp_path / "elsewhere" / plain_hf_dir.name  # the same folder name: the same model name
    shutil.copytree(plain_hf_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rope_parameters"] = {**cfg["rope_parameters"], "rope_theta": 10.0}
    (other / "config.json").write_text(json.dumps(cfg))
    first = json.loads((tmp_path / "o" / "probes.json").read_text())
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        main(["--model", str(other), *args])
    assert refused.value.code == 2 and "differs in config" in capsys.readouterr().err
    assert json.loads((tmp_path / "o" / "probes.json").read_text()) == first  # nothing touched
    n_cached = len(list(cache.glob("*.npz")))
    assert main(["--model", str(other), *args, "--overwrite"]) == 0
    assert len(list(cache.glob("*.npz"))) == 2 * n_cached  # its own entries, none reused


@pytest.mark.parametrize("args, msg", [
    (["--task", "completion", "--recirculate", "2:3:0.1"], "deeper than the target"),
    (["--task", "completion", "--recirculate", "3:1:1.5"], "[0, 1]"),
    (["--task", "nope"], "unknown task"),
    (["--task", "completion", "--modes", "sideways"], "unknown prefill mode"),
    (["--task", "completion", "--model", "no-such-model"], "unknown model"),
    (["--task", "completion", "--distractors", "300"], "integers in 0..256"),
    (["--task", "completion", "--distractors", "-1"], "integers in 0..256"),
    (["--task", "completion", "--n-pairs", "0"], "--n-pairs: must be an integer in 5..5000"),
    (["--task", "completion", "--seed", "4294967296"], "--seed: must be an integer in 0..4294967295"),
    (["--task", "completion", "--modes", "fused-99999"], "at most 1000 fused passes"),
    (["--task", "memory", "--distractors", "0"], "single CV group"),
    (["--task", "multi_register", "--n-pairs", "12", "--distractors", "0"], "too few groups"),
    (["--task", "completion", "--bogus"], "unrecognized arguments"),
])
def test_bad_input_one_line_exit_2(args, msg):
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    assert msg in r.stderr and r.stderr.count("\n") == 1 and r.stderr.startswith("error: ")


def test_refuses_results_of_a_different_run(tiny_ckpt, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "probes.json").write_text(json.dumps({"meta": {"run": {"task": "memory"}}, "results": []}))
    r = run_cli("--task", "completion", "--model", tiny_ckpt, "--out", out, *FAST)
    assert r.returncode == 2 and "different run" in r.stderr and r.stderr.count("\n") == 1
    assert json.loads((out / "probes.json").read_text())["meta"]["run"] == {"task": "memory"}  # nothing lost
    assert not (out / "depth_curves.html").exists()
    # an unknown non-model mode for a plain HF model is refused too
    r = run_cli("--task", "completion", "--model", tiny_ckpt, "--out", tmp_path / "p", "--modes", "fused-x")
    assert r.returncode == 2


def test_a_task_whose_groups_cannot_reach_the_folds_at_this_n_says_so(tmp_path, capsys):
    """memory at N = 2 has 4 distinct prompts' groups however many pairs: "use more pairs, or fewer folds" could not
    be followed (probes.run has no folds flag); the refusal names the N as the cause."""
    from probes.run import main

    with pytest.raises(SystemExit) as e:
        main(["--task", "memory", "--model", "tiny-fbt", "--modes", "standard", "--distractors", "2", "--n-pairs",
              "500", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "memory N=2: only 4 distinct group(s) however many pairs" in err, err
    assert "use a larger N" in err and not (tmp_path / "o").exists()
    # completion at 5 pairs also has 4 groups, but more pairs bring more (its R digits): not a cap, "more pairs"
    with pytest.raises(SystemExit):
        main(["--task", "completion", "--model", "tiny-fbt", "--modes", "standard", "--distractors", "0",
              "--n-pairs", "5", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert "however many pairs" not in err and "use more pairs" in err, err
