"""`python -m analysis.recirculation --dtype`: bfloat16 weights on the CPU, float16 refused before anything runs."""
from __future__ import annotations

import json
import math

import pytest
import torch

from analysis.recirculation.cli import main
from analysis.recirculation.perplexity import load
from common.placement import Placement

# The smallest settings of tests/test_recirculation.py's end-to-end CLI test: a few seconds on one thread.
SMALL = ["--seq-len", "12", "--n-tune", "2", "--n-test", "2", "--batch", "2", "--pairs", "4:1,3:2",
         "--alphas", "0.5", "--passes", "1,12", "--temps", "1.1"]


def test_load_places_tiny_model_in_bfloat16():
    model, _, _ = load("tiny-random-qwen3", Placement("cpu", "bfloat16"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and not model.training
    model, _, _ = load("tiny-random-qwen3")  # default: float32, as before
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_cli_bfloat16_end_to_end(tmp_path, capsys):
    out = tmp_path / "o"
    main(["--model", "tiny-random-qwen3", "--dtype", "bfloat16", "--out", str(out), *SMALL])
    res = json.loads((out / "results.json").read_text())
    assert res["dtype"] == "bfloat16"
    ppls = [res["base"]["tune_ppl"], res["base"]["test_ppl"]] + [c["ppl"] for c in res["cost"]["rows"]]
    assert all(math.isfinite(p) and p > 1 for p in ppls), ppls
    assert "(bfloat16)" in capsys.readouterr().out


def test_cli_float16_refused_one_line_before_writing(tmp_path, capsys):
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as e:
        main(["--model", "tiny-random-qwen3", "--dtype", "float16", "--out", str(out), *SMALL])
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "float16" in lines[0], lines
    assert not out.exists()


def test_mediation_only_in_bfloat16(tmp_path):
    """--mediation-only with bfloat16 weights: the label logits are read in float32, the run completes and
    alpha = 0 still changes nothing."""
    import json

    from models.configs import qwen3_config
    from models.full_bandwidth import FullBandwidthLM
    from tasks import build_tokenizer

    tok = build_tokenizer()
    FullBandwidthLM.from_config(qwen3_config(len(tok), n_layers=3, d_model=32, n_heads=2, n_kv_heads=1),
                                seed=0).save_pretrained(tmp_path / "m", tokenizer=tok)
    main(["--model", str(tmp_path / "m"), "--mediation-only", "--mediation-task", "completion",
          "--mediation-pairs", "12", "--mediation-distractors", "0", "--mediation-spec", "3:1:0:residual",
          "--dtype", "bfloat16", "--out", str(tmp_path / "o")])
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert res["dtype"] == "bfloat16"
    assert all(abs(c["mean_ld_change"]) < 0.05 for c in res["mediation"]["conditions"].values())
