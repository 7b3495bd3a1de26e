"""analysis.stability and analysis.gains end to end on tiny random checkpoints with the task tokenizer."""
from __future__ import annotations

import json

import pytest
import torch

from models.configs import qwen3_config
from models.full_bandwidth import FullBandwidthLM
from engine.prefill import pad_left
from tasks import build_tokenizer, label_token_ids, make_dataset


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tok = build_tokenizer()
    d = tmp_path_factory.mktemp("m") / "fbt"
    FullBandwidthLM.from_config(qwen3_config(len(tok), n_layers=2, d_model=32, n_heads=2, n_kv_heads=1),
                                seed=0).save_pretrained(d, tokenizer=tok)
    return d


def test_stability_records_every_pass_and_the_gate(ckpt, tmp_path, capsys):
    from analysis import stability
    from analysis.evaluate import EVAL_SEED

    stability.main(["--models", str(ckpt), "--tasks", "memory", "--passes", "3", "--n-pairs", "3",
                    "--distractors", "2", "--out", str(tmp_path / "s")])
    doc = json.loads((tmp_path / "s" / "stability.json").read_text())
    rows = doc["results"][str(ckpt)]
    assert [r["passes"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["state_change"] is None and all(r["state_change"] > 0 for r in rows[1:])
    from models.fingerprint import weights_hash  # which tensors answered, through which tokenizer

    assert {k: doc["meta"][k] for k in ("tokenizer", "weights_sha256", "prompt_prefix")} == \
        {"tokenizer": None, "weights_sha256": {str(ckpt): weights_hash(FullBandwidthLM.from_pretrained(ckpt))},
         "prompt_prefix": {str(ckpt): []}}
    # pass 0 is standard prefill: its label accuracy equals a plain forward's, computed here by hand
    model = FullBandwidthLM.from_pretrained(ckpt).eval()
    tok = build_tokenizer()
    samples = make_dataset("memory", n_pairs=3, n_distractors=2, seed=EVAL_SEED)
    ids, mask = pad_left([tok(s.full_text, add_special_tokens=False)["input_ids"] for s in samples], tok.pad_token_id)
    with torch.no_grad():
        pred = model(ids, mask).logits[:, -2].argmax(-1)
    assert rows[0]["label_accuracy"] == pytest.approx(float((pred == ids[:, -1]).float().mean()))
    g = doc["gate"][str(ckpt)]
    assert 0 < g["mean"] < 1 and g["token_std"] > 0
    # results exist: refused without --overwrite, in one error line (exit 2), both files left byte for byte
    before = {f: (tmp_path / "s" / f).read_bytes() for f in ("stability.json", "stability.html")}
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        stability.main(["--models", str(ckpt), "--tasks", "memory", "--passes", "1", "--out", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "already holds stability results" in err \
        and "--overwrite" in err, err
    assert {f: (tmp_path / "s" / f).read_bytes() for f in before} == before
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["plotly.min.js", "stability.html",
                                                                  "stability.json"]


def test_gate_statistics_of_a_token_blind_gate():
    from analysis.stability import gate_token_dependence

    tok = build_tokenizer()
    model = FullBandwidthLM.from_config(qwen3_config(len(tok), n_layers=1, d_model=16, n_heads=2, n_kv_heads=1),
                                        seed=0)
    with torch.no_grad():
        model.fusion.gate.weight.zero_()
    g = gate_token_dependence(model, tok)
    assert g == {"mean": 0.5, "token_std": 0.0, "digits_01_abs_diff": 0.0}


def test_gains_baseline_row_is_the_standard_models_accuracy(ckpt, tmp_path):
    from analysis import gains

    gains.main(["--fbt", str(ckpt), "--std", str(ckpt), "--tasks", "memory", "--distractors", "0",
                "--n-pairs", "4", "--out", str(tmp_path / "g"), "--no-progress"])
    doc = json.loads((tmp_path / "g" / "gains.json").read_text())
    assert (tmp_path / "g" / "gains.html").is_file()
    from analysis.evaluate import EVAL_SEED as seed  # what the rows were drawn with, recorded beside them

    assert {k: doc["meta"][k] for k in ("tasks", "n_distractors", "n_pairs", "seed")} == \
        {"tasks": ["memory"], "n_distractors": [0], "n_pairs": 4, "seed": seed}
    from models.fingerprint import weights_hash  # which tensors answered, through which tokenizer

    w = weights_hash(FullBandwidthLM.from_pretrained(ckpt))
    assert {k: doc["meta"][k] for k in ("tokenizer", "weights_sha256", "prompt_prefix")} == \
        {"tokenizer": None, "weights_sha256": {"fbt": w, "std": w}, "prompt_prefix": {"fbt": [], "std": []}}
    arms = {r["arm"]: r for r in doc["results"]}
    assert set(arms) == {"baseline", "fbt/std", "fbt/soft", "fbt/fused"}
    # the same checkpoint as both models: the baseline and the no-feedback arm are the same computation
    assert arms["baseline"]["accuracy"] == arms["fbt/std"]["accuracy"]
    assert arms["baseline"]["label_loss"] == pytest.approx(arms["fbt/std"]["label_loss"])
    # and the baseline's figures are a plain forward's, computed here by hand
    model = FullBandwidthLM.from_pretrained(ckpt).eval()
    tok = build_tokenizer()
    from analysis.evaluate import EVAL_SEED

    samples = make_dataset("memory", n_pairs=4, n_distractors=0, seed=EVAL_SEED)
    words = torch.tensor(label_token_ids(tok, "memory"))
    ids, mask = pad_left([tok(s.text, add_special_tokens=False)["input_ids"] for s in samples], tok.pad_token_id)
    with torch.no_grad():
        lp = torch.log_softmax(model(ids, mask).logits[:, -1].float(), -1)  # [batch, vocab]
    target = words[torch.tensor([s.label for s in samples])]
    assert arms["baseline"]["accuracy"] == pytest.approx(float((lp.argmax(-1) == target).float().mean()))
    assert arms["baseline"]["label_loss"] == pytest.approx(float(-lp.gather(1, target[:, None]).mean()), rel=1e-4)


def test_stability_and_gains_run_the_tracking_tasks(ckpt, tmp_path):
    from analysis import gains, stability

    stability.main(["--models", str(ckpt), "--tasks", "parity,shell_game", "--passes", "1", "--n-pairs", "3",
                    "--distractors", "4", "--out", str(tmp_path / "s")])
    rows = json.loads((tmp_path / "s" / "stability.json").read_text())["results"][str(ckpt)]
    assert {r["task"] for r in rows} == {"parity", "shell_game"}
    gains.main(["--fbt", str(ckpt), "--std", str(ckpt), "--tasks", "shell_game", "--distractors", "4",
                "--n-pairs", "3", "--out", str(tmp_path / "g"), "--no-progress"])
    arms = {r["arm"]: r for r in json.loads((tmp_path / "g" / "gains.json").read_text())["results"]}
    assert arms["baseline"]["task"] == "shell_game" and 0 <= arms["baseline"]["accuracy"] <= 1


@pytest.mark.parametrize("argv", [["--tasks", "parity", "--distractors", "0"], ["--tasks", "nope"]])
def test_stability_refuses_a_bad_task_in_one_line(argv, ckpt, tmp_path, capsys):
    from analysis import stability

    with pytest.raises(SystemExit) as e:
        stability.main(["--models", str(ckpt), "--out", str(tmp_path / "s"), *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "s" / "stability.json").exists()


def test_fixed_point_diagnostic_when_the_fused_input_ignores_the_state(tiny_ckpt, tmp_path, capsys):
    """analysis.fixed_point: with the fusion's up-projection zeroed the fused input no longer depends on the
    state, so every fused-k (k >= 1) is one and the same computation, the fixed point; the printed errors of
    k = 1..8 all equal the fixed point's, and they are not 0 (fusing still replaces the embedding)."""
    from analysis import fixed_point
    from tasks import build_tokenizer

    model = FullBandwidthLM.from_pretrained(tiny_ckpt).eval()
    with torch.no_grad():
        model.fusion.up.weight.zero_()
    model.save_pretrained(tmp_path / "m", tokenizer=build_tokenizer())
    fixed_point.main([str(tmp_path / "m"), "--n", "2"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "fused-k from std" in ln]
    assert [ln.split(":")[0] for ln in lines] == ["completion N=2", "memory N=2", "multi_register N=2"]
    for ln in lines:
        ks = [float(v) for v in ln.split("k = 1..8:")[1].split("|")[0].split()]
        fix = float(ln.split("fixed point")[1])
        assert len(ks) == 8 and fix > 0.01 and all(abs(k - fix) <= 0.0015 for k in ks), ln


def test_fixed_point_diagnostic_refuses_a_model_without_fusion(tiny_ckpt, tmp_path, capsys):
    from analysis import fixed_point

    FullBandwidthLM(FullBandwidthLM.from_pretrained(tiny_ckpt).lm, fusion=False).save_pretrained(tmp_path / "b")
    with pytest.raises(SystemExit) as e:
        fixed_point.main([str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and "no fusion module" in err, err


def test_a_tokenizer_without_a_pad_token_pads_with_a_masked_zero(ckpt, tmp_path):
    """Most GPT-2 and Llama tokenizers have no pad token: evaluate raised a TypeError from pad_left (probes.run and
    interventions.run padded with 0). A masked column's id is never read: the same accuracies as with [PAD]."""
    import shutil

    from analysis.evaluate import main
    from transformers import AutoTokenizer

    ids, mask = pad_left([[5, 6, 7], [8]], None)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    nopad = tmp_path / "nopad"
    shutil.copytree(ckpt, nopad)
    tok = AutoTokenizer.from_pretrained(nopad)
    tok.pad_token = None
    tok.save_pretrained(nopad)
    assert AutoTokenizer.from_pretrained(nopad).pad_token_id is None
    rows = {}
    for name, path in (("pad", ckpt), ("nopad", nopad)):
        out = tmp_path / f"{name}.json"
        main(["--model", str(path), "--tasks", "multi_register", "--distractors", "4", "--modes", "std,recurrent-1",
              "--n-pairs", "6", "--out", str(out), "--no-progress"])
        rows[name] = [(r["mode"], r["accuracy"], round(r["label_loss"], 5)) for r in json.loads(out.read_text())["results"]]
    assert rows["pad"] == rows["nopad"]


def test_stability_runs_its_passes_without_autograd(ckpt, tmp_path, monkeypatch):
    """Each pass's top state feeds the next: with autograd on, every pass's graph stayed in memory (100 passes of
    tiny-fbt: 11.5 GB against 0.4 GB)."""
    from analysis import stability

    seen = []
    real = stability.iter_fused

    def spy(*a, **k):
        for item in real(*a, **k):
            seen.append((torch.is_grad_enabled(), item[1].top.requires_grad))
            yield item

    monkeypatch.setattr(stability, "iter_fused", spy)
    stability.main(["--models", str(ckpt), "--tasks", "memory", "--passes", "3", "--n-pairs", "3",
                    "--distractors", "2", "--out", str(tmp_path / "s")])
    assert len(seen) == 4 and not any(g or r for g, r in seen), seen


def test_a_prompt_past_the_context_is_refused_before_any_forward(tiny_ckpt, tmp_path, capsys, monkeypatch):
    """analysis.evaluate computed every shorter N first and then refused the long one (92 s thrown away); the
    fixed-point diagnostic never refused and ran past the context. Both refuse before the first forward now."""
    from analysis import evaluate, fixed_point

    def no_forward(*a, **k):
        raise AssertionError("a forward ran before the refusal")

    monkeypatch.setattr(evaluate, "prefill_many", no_forward)
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", str(tiny_ckpt), "--tasks", "memory", "--distractors", "2,1024", "--modes", "std",
                       "--n-pairs", "2", "--out", str(tmp_path / "e.json"), "--no-progress"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "memory N=1024: prompt of 4108 tokens is longer than the model's context" in err, err
    monkeypatch.setattr(fixed_point, "_runs", no_forward)
    with pytest.raises(SystemExit) as e:
        fixed_point.main([str(tiny_ckpt), "--n", "520"])
    captured = capsys.readouterr()
    assert e.value.code == 2 and "longer than the model's context" in captured.err and not captured.out


def test_gains_names_the_default_distractors_when_a_tracking_task_gets_n_0(tmp_path, capsys):
    from analysis import gains

    with pytest.raises(SystemExit) as e:
        gains.main(["--tasks", "parity", "--out", str(tmp_path / "g")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "got N = 0 (from the default --distractors 0,8,32,128" in err, err
    assert not (tmp_path / "g").exists()
