"""models.loading.load_model on damaged checkpoints: exactly one clear UserError line, never a traceback.

Every model-loading CLI goes through load_model, so these are the errors those CLIs print (cli_entry: one stderr
line, exit 2). Each case corrupts a copy of a tiny checkpoint saved with its tokenizer.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.errors import UserError
from models.full_bandwidth import FullBandwidthLM, check_finite_weights
from models.loading import load_model

ROOT = Path(__file__).resolve().parent.parent


def _vocab() -> int:
    from tasks import build_tokenizer

    return len(build_tokenizer())


def _save(family: str, path: Path, **kw) -> Path:
    from models.configs import gpt2_config, qwen3_config
    from tasks import build_tokenizer

    tok = build_tokenizer()
    build = {"qwen3": qwen3_config, "gpt2": gpt2_config}[family]
    extra = dict(n_heads=2, n_kv_heads=1) if family == "qwen3" else dict(n_heads=2)
    FullBandwidthLM.from_config(build(len(tok), n_layers=2, d_model=32, **extra, **kw), seed=0).save_pretrained(
        path, tokenizer=tok)
    return path


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    return {f: _save(f, root / f) for f in ("qwen3", "gpt2")}


@pytest.fixture(params=["qwen3", "gpt2"])
def ckpt(request, pristine, tmp_path):
    """A fresh copy of the family's tiny checkpoint, free to corrupt."""
    dst = tmp_path / "ckpt"
    shutil.copytree(pristine[request.param], dst)
    return dst


@pytest.fixture
def qwen_ckpt(pristine, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(pristine["qwen3"], dst)
    return dst


def _refused(path, *needles) -> str:
    with pytest.raises(UserError) as ei:
        load_model(str(path))
    msg = str(ei.value)
    assert "\n" not in msg and len(msg) < 400, msg
    for n in needles:
        assert n in msg, msg
    return msg


def _edit_config(path: Path, fn) -> None:
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_weights(path: Path, fn) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(path / "model.safetensors"))
    fn(sd)
    save_file(sd, str(path / "model.safetensors"))


def test_pristine_copy_loads(ckpt):
    model, tok, name = load_model(str(ckpt))
    assert tok is not None and name == "ckpt" and model.has_fusion


# ----- 1. tokenizer.json -------------------------------------------------------------------------------------
TOKENIZER_DAMAGE = {
    "truncated": lambda t: t[:len(t) // 3],
    "not-json": lambda t: "this is not json",
    "empty": lambda t: "",
    "json-list": lambda t: "[1, 2, 3]",
    "wrong-structure": lambda t: json.dumps({"version": "1.0", "model": {"type": "nothing"}}),
    "no-model": lambda t: json.dumps({k: v for k, v in json.loads(t).items() if k != "model"}),
}


@pytest.mark.parametrize("damage", list(TOKENIZER_DAMAGE))
def test_corrupt_tokenizer_json(ckpt, damage):
    f = ckpt / "tokenizer.json"
    f.write_text(TOKENIZER_DAMAGE[damage](f.read_text()))
    _refused(ckpt, "corrupt tokenizer", str(ckpt))


def test_binary_tokenizer_json_and_corrupt_tokenizer_config(qwen_ckpt):
    (qwen_ckpt / "tokenizer_config.json").write_text("{ not json")
    _refused(qwen_ckpt, "corrupt tokenizer")
    (qwen_ckpt / "tokenizer.json").write_bytes(b"\xff\xfe\x00garbage")
    _refused(qwen_ckpt, "corrupt tokenizer")


def test_tokenizer_larger_than_the_embedding(qwen_ckpt):
    _edit_config(qwen_ckpt, lambda c: c["base_config"].update(vocab_size=8))
    _edit_weights(qwen_ckpt, lambda sd: sd.update({k: v[:8].clone() for k, v in sd.items() if v.shape[0] == _vocab()}))
    _refused(qwen_ckpt, "tokenizer", "8 rows")


# ----- 2. format_version ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", [3, 0, "1", None, True, 1.5])
def test_unknown_format_version(qwen_ckpt, version):
    _edit_config(qwen_ckpt, lambda c: c.update(format_version=version) if version is not None
                 else c.pop("format_version"))
    _refused(qwen_ckpt, "format_version", "reads only format_version 1, 2")


# ----- 3. Qwen3 num_hidden_layers vs layer_types ------------------------------------------------------------------
@pytest.mark.parametrize("edit", [dict(num_hidden_layers=3), dict(layer_types=["full_attention"]),
                                  dict(num_hidden_layers=-1)])
def test_layer_count_disagrees_with_layer_types(qwen_ckpt, edit):
    _edit_config(qwen_ckpt, lambda c: c["base_config"].update(edit))
    _refused(qwen_ckpt, "num_hidden_layers", "layer_types")


# ----- 4. shape mismatches: one line, the count and the first tensor with both shapes -------------------------------
def test_shape_mismatch_is_one_line(qwen_ckpt):
    _edit_config(qwen_ckpt, lambda c: c["base_config"].update(intermediate_size=64))
    msg = _refused(qwen_ckpt, "corrupt checkpoint weights", "6 tensors of the wrong shape")
    assert "lm.model.layers.0.mlp.down_proj.weight: [32, 96] in the file, [32, 64] in the model" in msg


def test_vocab_mismatch_names_both_shapes(ckpt):
    v = _vocab()
    _edit_config(ckpt, lambda c: c["base_config"].update(vocab_size=v + 6))
    _refused(ckpt, "1 tensor of the wrong shape", f"[{v}, 32] in the file, [{v + 6}, 32] in the model")


def test_fusion_width_disagrees_with_the_base_model(qwen_ckpt):
    _edit_config(qwen_ckpt, lambda c: c["fusion"].update(d_model=64))
    _refused(qwen_ckpt, "fusion.d_model 64", "hidden size 32")


def test_fusion_eps_is_checked_and_used(pristine, tmp_path):
    _save("qwen3", tmp_path / "e")
    _edit_config(tmp_path / "e", lambda c: c["fusion"].update(eps=1e-3))
    assert load_model(str(tmp_path / "e"))[0].fusion.norm.eps == 1e-3  # the saved eps, not the default
    _edit_config(tmp_path / "e", lambda c: c["fusion"].update(eps="tiny"))
    _refused(tmp_path / "e", "fusion.eps")


# ----- 5. NaN / inf weights ------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_name_the_first_tensor(ckpt, value):
    def poison(sd):
        for k in ("fusion.gate.weight", "fusion.up.weight"):
            sd[k] = sd[k].clone()
            sd[k][0, 0] = value

    _edit_weights(ckpt, poison)
    msg = _refused(ckpt, "non-finite weights", "fusion.gate.weight [32, 32]", "and 1 more tensor")
    assert ("1 NaN" in msg) == (value != value)


def test_check_finite_weights_on_modules_and_mappings(tiny_model):
    check_finite_weights(tiny_model, "ok")  # finite: no error
    check_finite_weights({"ids": torch.tensor([1, 2])}, "ints are skipped")
    with torch.no_grad():
        tiny_model.fusion.norm.weight[3] = float("nan")
    with pytest.raises(UserError, match=r"non-finite weights in here: fusion.norm.weight \[32\] has 1 NaN"):
        check_finite_weights(tiny_model, "here")
    with pytest.raises(UserError, match="w"):
        check_finite_weights({"w": torch.tensor([0.0, float("inf")])}, "dict")
    # a tensor accelerate offloaded (meta: not in memory) cannot be read, so it is not checked (it raised
    # "Tensor.item() cannot be called on meta tensors")
    check_finite_weights({"offloaded": torch.empty(3, device="meta")}, "device map")


def test_plain_hf_model_with_nan_weights(qwen_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    lm = FullBandwidthLM.from_pretrained(qwen_ckpt).lm
    with torch.no_grad():
        lm.model.norm.weight[0] = float("nan")
    lm.save_pretrained(str(tmp_path / "hf"))
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")) is not None  # HF itself accepts it
    _refused(tmp_path / "hf", "non-finite weights", "model.norm.weight")


# ----- 6. other damage on the same path ---------------------------------------------------------------------------
def test_missing_weights_file(ckpt):
    (ckpt / "model.safetensors").unlink()
    _refused(ckpt, "no model.safetensors")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    _refused(ckpt, "no config.json")


@pytest.mark.parametrize("text", ["{ not json", "", "[1, 2]"])
def test_config_not_json(ckpt, text):
    (ckpt / "config.json").write_text(text)
    _refused(ckpt, str(ckpt))


def test_model_path_is_a_file(ckpt):
    _refused(ckpt / "config.json", "not a model directory")


def test_plain_hf_model_without_tokenizer_loads_with_none(qwen_ckpt, tmp_path):
    FullBandwidthLM.from_pretrained(qwen_ckpt).lm.save_pretrained(str(tmp_path / "hf"))
    model, tok, _ = load_model(str(tmp_path / "hf"))
    assert tok is None and not model.has_fusion


def test_plain_hf_model_with_corrupt_weights(qwen_ckpt, tmp_path):
    FullBandwidthLM.from_pretrained(qwen_ckpt).lm.save_pretrained(str(tmp_path / "hf"))
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"12345678garbage")
    _refused(tmp_path / "hf", "cannot load a model from")


def test_plain_hf_model_with_missing_weights(qwen_ckpt, tmp_path):
    FullBandwidthLM.from_pretrained(qwen_ckpt).lm.save_pretrained(str(tmp_path / "hf"))
    # HF would fill the missing tensor with random init and only warn.
    _edit_weights(tmp_path / "hf", lambda sd: sd.pop("model.norm.weight"))
    _refused(tmp_path / "hf", "missing weights", "model.norm.weight")


def test_plain_hf_model_with_bad_layer_types(qwen_ckpt, tmp_path):
    FullBandwidthLM.from_pretrained(qwen_ckpt).lm.save_pretrained(str(tmp_path / "hf"))
    _edit_config(tmp_path / "hf", lambda c: c.update(num_hidden_layers=3))
    _refused(tmp_path / "hf", "num_hidden_layers")


# ----- a CLI end to end --------------------------------------------------------------------------------------------
def test_evaluate_cli_on_nan_checkpoint_exits_2_with_one_line(qwen_ckpt, tmp_path):
    def poison(sd):
        sd["fusion.up.weight"] = sd["fusion.up.weight"].clone()
        sd["fusion.up.weight"][1, 2] = float("nan")

    _edit_weights(qwen_ckpt, poison)
    out = tmp_path / "e.json"
    r = subprocess.run([sys.executable, "-m", "analysis.evaluate", "--model", str(qwen_ckpt), "--n-pairs", "1",
                        "--tasks", "completion", "--distractors", "0", "--modes", "std", "--out", str(out),
                        "--no-progress"], capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**__import__("os").environ, "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: non-finite weights in "), r.stderr
    assert "fusion.up.weight" in lines[0]
    assert not out.exists()
