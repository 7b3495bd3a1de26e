"""save_pretrained / from_pretrained: exact round trip, the recorded config, and clean errors on bad input."""
from __future__ import annotations

import json

import pytest
import torch

from common.errors import UserError
from models.full_bandwidth import FullBandwidthLM


def _ids():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 50, (2, 7), generator=g)
    return ids, torch.ones_like(ids), torch.randn(2, 7, 32, generator=g)


def _perturb_fusion(model):
    # Non-default fusion weights, so a load that silently kept fresh init would be caught.
    with torch.no_grad():
        model.fusion.norm.weight.copy_(torch.linspace(0.5, 1.5, model.d_model))
        model.fusion.up.weight.mul_(3.0)


def _tied(model):
    return model.lm.get_output_embeddings().weight.data_ptr() == model.lm.get_input_embeddings().weight.data_ptr()


@pytest.fixture
def saved(tiny_model, tmp_path):
    _perturb_fusion(tiny_model)
    path = tmp_path / "ckpt"
    tiny_model.save_pretrained(path)
    return tiny_model, path


@torch.no_grad()
def test_round_trip_gives_identical_logits(saved):
    model, path = saved
    loaded = FullBandwidthLM.from_pretrained(path)
    assert type(loaded.lm) is type(model.lm) and not loaded.training
    ids, mask, state = _ids()
    for args in ((ids, mask), (ids, mask, state)):
        assert torch.equal(loaded(*args).logits, model(*args).logits)
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        assert torch.equal(sd[k], sd2[k]), k


def test_tied_weights_stay_tied(saved):
    model, path = saved
    assert _tied(model)
    loaded = FullBandwidthLM.from_pretrained(path)
    assert _tied(loaded)
    with torch.no_grad():  # still one tensor, not two equal copies
        loaded.lm.get_input_embeddings().weight[0, 0] += 1.0
    assert torch.equal(loaded.lm.get_input_embeddings().weight, loaded.lm.get_output_embeddings().weight)


def test_config_records_base_model_and_fusion(saved):
    model, path = saved
    assert {p.name for p in path.iterdir()} >= {"config.json", "model.safetensors"}
    assert not list(path.glob("*.tmp"))
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["format"] == "full-bandwidth-lm" and cfg["format_version"] == 1
    base = cfg["base_config"]
    assert base["model_type"] == model.config.model_type
    assert base["vocab_size"] == 50 and base["tie_word_embeddings"] is True
    assert cfg["fusion"]["enabled"] is True and cfg["fusion"]["d_model"] == 32
    assert cfg["fusion"]["eps"] == model.fusion.norm.eps and cfg["fusion"]["state"] == "post_final_norm"
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"fusion.up.weight", "fusion.gate.weight", "fusion.norm.weight"} <= keys
    assert all(k.startswith(("lm.", "fusion.")) for k in keys)


def test_round_trip_without_fusion(tiny_config, tmp_path):
    model = FullBandwidthLM.from_config(tiny_config, fusion=False, seed=0).eval()
    model.save_pretrained(tmp_path / "c")
    assert json.loads((tmp_path / "c" / "config.json").read_text())["fusion"]["enabled"] is False
    loaded = FullBandwidthLM.from_pretrained(tmp_path / "c")
    assert not loaded.has_fusion
    ids, mask, _ = _ids()
    with torch.no_grad():
        assert torch.equal(loaded(ids, mask).logits, model(ids, mask).logits)


def test_missing_directory_raises(tmp_path):
    with pytest.raises(UserError):
        FullBandwidthLM.from_pretrained(tmp_path / "nope")


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors"])
def test_missing_file_raises(saved, missing):
    _, path = saved
    (path / missing).unlink()
    with pytest.raises(UserError):
        FullBandwidthLM.from_pretrained(path)


@pytest.mark.parametrize("keep", [0.5, 0.99, 16])
def test_truncated_weights_raise(saved, keep):
    _, path = saved
    w = path / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[:int(len(data) * keep)] if isinstance(keep, float) else data[:keep])
    with pytest.raises(UserError):
        FullBandwidthLM.from_pretrained(path)


def test_weights_of_another_shape_raise(tiny_config, tmp_path):
    """A config.json paired with the weights of a different model."""
    FullBandwidthLM.from_config(tiny_config, seed=0).save_pretrained(tmp_path / "a")
    FullBandwidthLM.from_config(tiny_config, fusion=False, seed=0).save_pretrained(tmp_path / "b")
    (tmp_path / "b" / "model.safetensors").replace(tmp_path / "a" / "model.safetensors")
    with pytest.raises(UserError):
        FullBandwidthLM.from_pretrained(tmp_path / "a")


def _wrong_configs(saved_cfg: dict, hf_cfg: dict):
    no_base = dict(saved_cfg)
    del no_base["base_config"]
    no_fusion = dict(saved_cfg)
    del no_fusion["fusion"]
    return {
        "hf-config": json.dumps(hf_cfg),  # a plain HF config.json: no "format"
        "other-format": json.dumps({**saved_cfg, "format": "something-else"}),
        "not-json": "{ this is not json",
        "json-list": json.dumps([1, 2, 3]),
        "no-base-config": json.dumps(no_base),
        "no-fusion": json.dumps(no_fusion),
        "bad-model-type": json.dumps({**saved_cfg, "base_config": {**saved_cfg["base_config"],
                                                                   "model_type": "no-such-model"}}),
        "binary": b"\xff\xfe\x00garbage",
    }


@pytest.mark.parametrize("kind", ["hf-config", "other-format", "not-json", "json-list", "no-base-config",
                                  "no-fusion", "bad-model-type", "binary"])
def test_wrong_format_config_raises(saved, kind):
    model, path = saved
    cfg_file = path / "config.json"
    content = _wrong_configs(json.loads(cfg_file.read_text()), model.config.to_dict())[kind]
    if isinstance(content, bytes):
        cfg_file.write_bytes(content)
    else:
        cfg_file.write_text(content)
    with pytest.raises(UserError):
        FullBandwidthLM.from_pretrained(path)
