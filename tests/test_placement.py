"""--device / --dtype / --device-map (common.placement): bfloat16 on the CPU through loading, the engine, the
collector and the evaluation; one-line refusals for what this machine cannot do."""
from __future__ import annotations

import json

import pytest
import torch

from common.errors import UserError
from common.placement import Placement


def test_load_model_places_a_checkpoint_in_bfloat16(tiny_ckpt):
    from models.loading import load_model

    model, _, _ = load_model(str(tiny_ckpt), Placement("cpu", "bfloat16"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and not model.training
    model32, _, _ = load_model(str(tiny_ckpt))
    assert {p.dtype for p in model32.parameters()} == {torch.float32}


def test_bfloat16_collection_is_close_to_float32(tiny_ckpt):
    """The same prompts in bf16 and in f32: the collected residuals agree to bf16 precision, not exactly."""
    from probes.collect import Collector
    from models.loading import load_model

    seqs = [[5, 9, 13, 2, 7], [3, 4, 8], [11, 12, 13, 14, 15, 16]]
    out = {}
    for dtype in ("float32", "bfloat16"):
        model, _, _ = load_model(str(tiny_ckpt), Placement("cpu", dtype))
        out[dtype] = Collector(model, progress=False).collect(seqs, ["standard", "recurrent-1"])
    for m in ("standard", "recurrent-1"):
        a, b = out["float32"][m], out["bfloat16"][m]
        assert b.dtype == a.dtype  # float32 on the way out whatever the model's dtype
        scale = abs(a).max()
        assert abs(a - b).max() <= 0.05 * scale and abs(a - b).max() > 0


def test_evaluate_in_bfloat16_records_it(tiny_ckpt, tmp_path):
    from analysis.evaluate import main

    out = tmp_path / "e.json"
    main(["--model", str(tiny_ckpt), "--tasks", "memory", "--distractors", "0", "--n-pairs", "3", "--modes",
          "std,soft", "--dtype", "bfloat16", "--out", str(out), "--no-progress"])
    doc = json.loads(out.read_text())
    assert doc["meta"]["dtype"] == "bfloat16" and doc["meta"]["device"] == "cpu"
    assert {r["mode"] for r in doc["results"]} == {"std", "soft"}


@pytest.mark.parametrize("kw, needle", [
    ({"dtype": "float16"}, "float16 needs a CUDA device (--device cpu)"),
    ({"dtype": "float16", "device": "auto"}, "float16 needs a CUDA device (--device auto found no GPU)"),
    ({"device": "cuda"}, "no CUDA device"),
    ({"dtype": "float64"}, "--dtype 'float64'"),
])
def test_refusals_are_one_line(kw, needle):
    if kw.get("device") in ("cuda", "auto") and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda is valid here")

    class A:
        device, dtype, device_map = kw.get("device", "cpu"), kw.get("dtype", "float32"), "none"

    with pytest.raises(UserError) as e:
        Placement.from_args(A)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_device_map_is_refused_for_a_full_bandwidth_checkpoint(tiny_ckpt):
    from models.loading import load_model

    with pytest.raises(UserError, match="--device-map is for plain HF models"):
        load_model(str(tiny_ckpt), Placement("cpu", "float32", "auto"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine: the GPU path is "
                                                          "exercised only where one is present")
def test_probes_collection_on_cuda_equals_cpu(tiny_ckpt):
    from probes.collect import Collector
    from models.loading import load_model

    seqs = [[5, 9, 13, 2, 7], [3, 4, 8]]
    cpu = Collector(load_model(str(tiny_ckpt))[0], progress=False).collect(seqs, ["recurrent-1"])
    gpu = Collector(load_model(str(tiny_ckpt), Placement("cuda"))[0], progress=False).collect(seqs, ["recurrent-1"])
    assert abs(cpu["recurrent-1"] - gpu["recurrent-1"]).max() < 1e-3


def test_probes_run_in_bfloat16_end_to_end(tiny_ckpt, tmp_path):
    """probes.run --dtype bfloat16: collection, probes, lens and MDL run; the dtype is part of the run signature."""
    from probes.run import main

    out = tmp_path / "p"
    assert main(["--task", "completion", "--model", str(tiny_ckpt), "--out", str(out), "--distractors", "0",
                 "--n-pairs", "24", "--modes", "standard,recurrent-1", "--n-boot", "50", "--no-cache",
                 "--no-progress", "--dtype", "bfloat16"]) == 0
    doc = json.loads((out / "probes.json").read_text())
    assert doc["meta"]["run"]["dtype"] == "bfloat16"
    rows = [r for r in doc["results"] if r["mode"] == "standard" and r["depth"] == 0]
    assert rows and rows[0]["accuracy"] == pytest.approx(0.5)  # depth 0 at chance, as in float32
    assert all(r["logit_lens_ld"] is not None for r in doc["results"])


def test_bfloat16_keeps_the_rotary_frequencies_in_float32(tmp_path):
    """HF's from_pretrained(dtype=bfloat16) keeps the rotary frequencies in float32; placing a model in bfloat16 must
    too (`.to(dtype)` rounded them, and every position's phase: the model was not HF's model in bfloat16)."""
    from transformers import AutoModelForCausalLM

    from models.configs import qwen3_config
    from models.loading import load_model
    from tasks import build_tokenizer

    tok = build_tokenizer()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(qwen3_config(len(tok), n_layers=2, d_model=32, n_heads=2, n_kv_heads=1,
                                                  rope_theta=1e6)).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    ours = load_model(str(tmp_path / "m"), Placement("cpu", "bfloat16"))[0].lm
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.bfloat16).eval()
    bufs = {n: b for n, b in ours.named_buffers() if n.endswith("inv_freq")}
    assert bufs and all(b.dtype == torch.float32 for b in bufs.values())
    ref = dict(hf.named_buffers())
    assert all(torch.equal(b, ref[n]) for n, b in bufs.items())
    ids = torch.randint(2, len(tok), (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, hf(input_ids=ids).logits)
    # a full-bandwidth checkpoint placed in bfloat16 keeps them too
    from models.full_bandwidth import FullBandwidthLM

    fbt = Placement("cpu", "bfloat16").place(FullBandwidthLM.from_config(qwen3_config(len(tok), n_layers=2, d_model=32,
                                                                                      n_heads=2, n_kv_heads=1), seed=0))
    assert all(b.dtype == torch.float32 for n, b in fbt.named_buffers() if n.endswith("inv_freq"))
    assert {p.dtype for p in fbt.parameters()} == {torch.bfloat16}


def test_interventions_run_in_bfloat16_end_to_end(tiny_ckpt, tmp_path):
    """interventions.run --dtype bfloat16: the battery runs on a recurrent mode and records the dtype; the top
    residual at T patched from the donor is the donor's run, normalized effect 1 to bf16 rounding."""
    from interventions.run import main

    out = tmp_path / "i"
    assert main(["--task", "parity", "--model", str(tiny_ckpt), "--mode", "recurrent-1", "--n-pairs", "12",
                 "--distractors", "3", "--max-positions", "2", "--control-model", "none", "--dtype", "bfloat16",
                 "--out", str(out), "--no-progress"]) == 0
    rep = json.loads((out / "causal_report.json").read_text())
    assert rep["config"]["dtype"] == "bfloat16"
    lp = rep["results"]["layer_patching"]["recurrent-1"]
    assert lp["normalized_effect"][-1][-1] == pytest.approx(1.0, abs=0.05)
    assert rep["results"]["interventions"]


def test_a_bfloat16_causal_report_states_its_logit_resolution(tiny_ckpt, tmp_path):
    """interventions.run --dtype bfloat16: results.precision gives the step each label-word logit is rounded to
    (bfloat16's spacing at the largest |label-word logit|) beside the clean |LD|, and the verdict says it; a
    float32 run has none."""
    import math

    from interventions.run import main

    docs = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        assert main(["--task", "completion", "--model", str(tiny_ckpt), "--mode", "recurrent-1", "--distractors", "0",
                     "--n-pairs", "10", "--n-boot", "20", "--max-positions", "2", "--max-depths", "2",
                     "--control-model", "none", "--no-progress", "--dtype", dtype, "--out", str(out)]) == 0
        docs[dtype] = json.loads((out / "causal_report.json").read_text())
    assert docs["float32"]["results"]["precision"] is None
    assert "Logits are" not in docs["float32"]["verdict"]["sentence"]
    p = docs["bfloat16"]["results"]["precision"]
    assert p["dtype"] == "bfloat16"
    assert p["logit_step"] == 2.0 ** (math.floor(math.log2(p["max_abs_label_logit"])) - 7)  # 8 significant bits
    assert p["clean_abs_ld_in_steps"] == pytest.approx(p["clean_abs_ld_mean"] / p["logit_step"])
    assert f"Logits are bfloat16: each label-word logit is rounded to a step of up to {p['logit_step']:.3g}" in \
        docs["bfloat16"]["verdict"]["sentence"]
