"""A model whose forward overflows (finite weights, NaN / inf logits) has no accuracy or logit difference: every
command that scores logits refuses it in one line and writes nothing (evaluate printed accuracy 0.000 and then
crashed on the JSON; interventions.run blamed the engine; probes.run crashed in its lens). Also: text chunks past a
GPT-2's position table, and the mediation study's tie rule (1/2, as every causal report's)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from common.errors import UserError


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory):
    from models.configs import qwen3_config
    from models.full_bandwidth import FullBandwidthLM
    from tasks import build_tokenizer

    tok = build_tokenizer()
    model = FullBandwidthLM.from_config(qwen3_config(len(tok), n_layers=2, d_model=32, initializer_range=0.1),
                                        seed=0)
    # finite weights (the loader's check passes); the final norm's ~3e38 gain overflows float32 in the top state
    model.family.final_norm(model.lm).weight.data.fill_(3e38)
    path = tmp_path_factory.mktemp("ckpt") / "overflow"
    model.save_pretrained(path, tok)
    return path


def _one_line(capsys, code):
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "logits are NaN or inf" in err, err
    return err


def test_evaluate_refuses_non_finite_logits(overflowing, tmp_path, capsys):
    from analysis.evaluate import main

    out = tmp_path / "eval.json"
    with pytest.raises(SystemExit) as e:
        main(["--model", str(overflowing), "--tasks", "memory", "--distractors", "2", "--modes", "std",
              "--n-pairs", "5", "--out", str(out), "--no-progress"])
    assert "memory N=2 std" in _one_line(capsys, e.value.code)
    assert not out.exists()


def test_interventions_refuse_non_finite_logits(overflowing, tmp_path, capsys):
    from interventions.run import main

    with pytest.raises(SystemExit) as e:
        main(["--model", str(overflowing), "--task", "completion", "--distractors", "0", "--n-pairs", "12",
              "--mode", "recurrent-1", "--control-model", "none", "--out", str(tmp_path / "c"), "--no-progress"])
    assert "clean standard run" in _one_line(capsys, e.value.code)  # not "differ from the prefill engine's by nan"
    assert not (tmp_path / "c" / "causal_report.json").exists()


def test_probes_refuse_non_finite_lens_logits(overflowing, tmp_path, capsys):
    from probes.run import main

    with pytest.raises(SystemExit) as e:
        main(["--model", str(overflowing), "--task", "completion", "--distractors", "0", "--n-pairs", "12",
              "--no-cache", "--no-mdl", "--n-boot", "20", "--out", str(tmp_path / "p"), "--no-progress"])
    assert "the logit lens" in _one_line(capsys, e.value.code)
    assert not (tmp_path / "p" / "probes.json").exists()


def test_require_finite_names_the_rows():
    import torch

    from engine.result import require_finite

    require_finite(torch.zeros(3, 5), "x")  # finite: nothing
    z = torch.zeros(4, 2, 5)
    z[1, 0, 3] = float("inf")
    z[3, 1, 0] = float("nan")
    with pytest.raises(UserError, match=r"^here: the model's logits are NaN or inf in 2 of 4 rows"):
        require_finite(z, "here")


def test_text_chunks_past_a_gpt2_position_table_are_refused_before_the_baseline():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from analysis.recirculation.perplexity import Evaluator
    from models.full_bandwidth import FullBandwidthLM

    cfg = GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=2, n_head=2)
    model = FullBandwidthLM(GPT2LMHeadModel(cfg), fusion=False).eval()
    Evaluator(model, torch.randint(0, 64, (2, 8)), 2, [1.0])  # at the context: fine
    with pytest.raises(UserError, match=r"text chunks of 9 tokens \(--seq-len\): .*longer than the model's context \(8\)"):
        Evaluator(model, torch.randint(0, 64, (2, 9)), 2, [1.0])  # an IndexError in the position table before


def test_mediation_counts_a_binary_tie_as_one_half(tmp_path):
    # every weight 0: every logit 0, LD = 0 on every row: accuracy 1/2 (it read 0.000; interventions.run 0.50)
    import torch

    from analysis.recirculation.mediation import mediation
    from engine.recirculation import RecircSpec
    from models.configs import qwen3_config
    from models.full_bandwidth import FullBandwidthLM
    from tasks import build_tokenizer

    tok = build_tokenizer()
    model = FullBandwidthLM.from_config(qwen3_config(len(tok), n_layers=2, d_model=32), fusion=False, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    res = mediation(model.eval(), tok, [RecircSpec(2, 1, 0.5, "convex")], "parity", 10, 4, 8, 0)
    accs = {k: v["accuracy"] for k, v in res["conditions"].items()}
    assert accs and all(a == 0.5 for a in accs.values()), accs
    assert np.isclose(res["conditions"]["base"]["mean_ld"], 0.0)
    assert res["note"].startswith("inconclusive: the model does not solve parity (base accuracy 0.50 < 0.6)")
