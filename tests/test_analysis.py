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


def test_stability_records_every_pass_and_the_gate(ckpt, tmp_path):
    from analysis import stability
    from models.evaluate import EVAL_SEED

    stability.main(["--models", str(ckpt), "--tasks", "memory", "--passes", "3", "--n-pairs", "3",
                    "--distractors", "2", "--out", str(tmp_path / "s")])
    doc = json.loads((tmp_path / "s" / "stability.json").read_text())
    rows = doc["results"][str(ckpt)]
    assert [r["passes"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["state_change"] is None and all(r["state_change"] > 0 for r in rows[1:])
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
    with pytest.raises(SystemExit):  # results exist: refuses without --overwrite
        stability.main(["--models", str(ckpt), "--tasks", "memory", "--passes", "1", "--out", str(tmp_path / "s")])


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
    arms = {r["arm"]: r for r in doc["results"]}
    assert set(arms) == {"baseline", "fbt/std", "fbt/soft", "fbt/fused"}
    # the same checkpoint as both models: the baseline and the no-feedback arm are the same computation
    assert arms["baseline"]["accuracy"] == arms["fbt/std"]["accuracy"]
    assert arms["baseline"]["label_loss"] == pytest.approx(arms["fbt/std"]["label_loss"])
    # and the baseline's figures are a plain forward's, computed here by hand
    model = FullBandwidthLM.from_pretrained(ckpt).eval()
    tok = build_tokenizer()
    from models.evaluate import EVAL_SEED

    samples = make_dataset("memory", n_pairs=4, n_distractors=0, seed=EVAL_SEED)
    words = torch.tensor(label_token_ids(tok, "memory"))
    ids, mask = pad_left([tok(s.text, add_special_tokens=False)["input_ids"] for s in samples], tok.pad_token_id)
    with torch.no_grad():
        lp = torch.log_softmax(model(ids, mask).logits[:, -1].float(), -1)  # [batch, vocab]
    target = words[torch.tensor([s.label for s in samples])]
    assert arms["baseline"]["accuracy"] == pytest.approx(float((lp.argmax(-1) == target).float().mean()))
    assert arms["baseline"]["label_loss"] == pytest.approx(float(-lp.gather(1, target[:, None]).mean()), rel=1e-4)
