"""probes.collect: nnsight-collected residuals equal the prefill engine's and HF output_hidden_states."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.prefill import call_schedule, pad_left, prefill_many
from probes.collect import ActivationCache, Collector, collect_with_cache, save_activations

TOL = 1e-5
SEQS = [[7, 3, 41, 12, 5, 29, 33, 8], [4, 9, 2], [11, 12, 13, 14, 15], [3, 3, 3, 3, 3, 3], [20, 21]]
MODES = ["standard", "recurrent-1", "recurrent-2", "recurrent-full", "fused-2"]


def per_row_engine(model, seqs, mode):
    """The engine on one unpadded row at a time: resid [N, L+1, D] at the last position."""
    out = []
    for s in seqs:
        ids, mask = pad_left([s])
        out.append(prefill_many(model, ids, mask, (mode,), collect=True)[mode].resid[0, 0])
    return torch.stack(out).numpy()


def test_collected_equals_engine_every_mode(tiny_model):
    got = Collector(tiny_model, batch_size=2, progress=False).collect(SEQS, MODES)
    for m in MODES:
        assert got[m].shape == (len(SEQS), tiny_model.n_layers + 1, tiny_model.d_model)
        assert got[m].dtype == np.float32
        assert np.abs(got[m] - per_row_engine(tiny_model, SEQS, m)).max() <= TOL, m
    # the modes really differ (so reading the wrong model call would be caught)
    assert np.abs(got["recurrent-1"][:, 0] - got["standard"][:, 0]).max() > 1e-3
    assert np.abs(got["recurrent-2"] - got["recurrent-1"]).max() > 1e-4


def test_collected_equals_engine_same_batch(tiny_model):
    ids, mask = pad_left(SEQS)
    col = Collector(tiny_model, progress=False)
    got = col.collect_batch(ids, mask, MODES)
    ref = prefill_many(tiny_model, ids, mask, MODES, collect=True)
    for m in MODES:
        assert torch.allclose(got[m], ref[m].resid[:, 0], atol=TOL, rtol=0), m


def test_collection_runs_no_lm_head(tiny_model, head_calls):
    """The collector reads residuals only: the traced engine runs with logits=False, and the LM head is never
    called (21-28% of a SmolLM2 pass), while the residuals stay the engine's (the tests above)."""
    ids, mask = pad_left(SEQS)
    with head_calls(tiny_model) as calls:
        Collector(tiny_model, progress=False).collect_batch(ids, mask, MODES)
    assert calls == []


def test_standard_equals_hf_output_hidden_states(tiny_model):
    got = Collector(tiny_model, progress=False).collect(SEQS, ["standard"])["standard"]
    L = tiny_model.n_layers
    for i, s in enumerate(SEQS):
        out = tiny_model.lm(torch.tensor([s]), output_hidden_states=True)
        hs = torch.stack(out.hidden_states, dim=1)[0, :, -1].detach().numpy()  # [L+1, D]
        assert np.abs(got[i, :L] - hs[:L]).max() <= TOL
        base = tiny_model.lm.base_model
        norm = base.norm if hasattr(base, "norm") else base.ln_f
        # depth L is the raw last-block output; HF's last hidden state is after the final norm
        assert np.abs(norm(torch.tensor(got[i, L])).detach().numpy() - hs[L]).max() <= TOL


def test_plain_hf_model_standard_only(tiny_config):
    from transformers import AutoModelForCausalLM

    from common.errors import UserError
    from models.full_bandwidth import FullBandwidthLM

    torch.manual_seed(0)
    model = FullBandwidthLM(AutoModelForCausalLM.from_config(tiny_config), fusion=False).eval()
    got = Collector(model, progress=False).collect(SEQS[:2], ["standard"])["standard"]
    assert np.abs(got - per_row_engine(model, SEQS[:2], "standard")).max() <= TOL
    with pytest.raises(UserError, match="fusion"):
        Collector(model, progress=False).collect(SEQS[:2], ["recurrent-1"])


def test_call_schedule_mirrors_engine():
    where, n = call_schedule(["standard", "recurrent-2", "fused-1", "recurrent-full"], 6)
    assert where == {"standard": 0, "recurrent-2": 2, "recurrent-full": 8, "fused-1": 10} and n == 11
    assert call_schedule(["recurrent-4"], 3) == ({"recurrent-4": 2}, 3)  # k capped at T-1
    assert call_schedule(["standard"], 1) == ({"standard": 0}, 1)


def test_cache_roundtrip_and_export(tiny_model, tmp_path):
    from tasks import build_tokenizer, make_dataset, tokenize_samples

    tok = build_tokenizer()
    from models.configs import qwen3_config
    from models.full_bandwidth import FullBandwidthLM

    model = FullBandwidthLM.from_config(qwen3_config(len(tok), n_layers=2, d_model=32, n_heads=2, n_kv_heads=1),
                                        seed=0).eval()
    ids, samples = tokenize_samples(make_dataset("completion", 3, 2, seed=0), tok)
    col = Collector(model, progress=False)
    cache = ActivationCache(tmp_path / "cache")
    a, st = collect_with_cache(col, ids, samples, ["standard", "recurrent-1"], tok, cache)
    assert st == {"standard": "miss", "recurrent-1": "miss"}
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 2
    assert not list((tmp_path / "cache").glob("*.tmp"))
    b, st = collect_with_cache(col, ids, samples, ["recurrent-1", "standard"], tok, cache)
    assert st == {"recurrent-1": "hit", "standard": "hit"}
    assert np.array_equal(a["standard"], b["standard"])
    # another dataset -> another key
    ids2, samples2 = tokenize_samples(make_dataset("completion", 3, 2, seed=1), tok)
    _, st = collect_with_cache(col, ids2, samples2, ["standard"], tok, cache)
    assert st == {"standard": "miss"}
    # the same tensors under another config (RoPE base) are another model: another key, other activations
    import copy

    from models.fingerprint import config_hash, weights_hash

    other = copy.deepcopy(model)
    other.lm.config.rope_parameters = {**other.lm.config.rope_parameters, "rope_theta": 10.0}
    other.lm.model.rotary_emb.__init__(other.lm.config)  # the inv_freq buffer follows the config, as on loading
    assert weights_hash(other) == weights_hash(model) and config_hash(other) != config_hash(model)
    c, st = collect_with_cache(Collector(other, progress=False), ids, samples, ["standard"], tok, cache)
    assert st == {"standard": "miss"} and np.abs(c["standard"][:, 1:] - a["standard"][:, 1:]).max() > 1e-3
    npz, js = save_activations(tmp_path / "exp", "N2_standard", a["standard"], samples, {"mode": "standard"})
    with np.load(npz) as z:
        assert z["resid"].shape == (6, 3, 32)
        assert list(z["label"]) == [s.label for s in samples]
    import json

    doc = json.loads(js.read_text())
    assert len(doc["samples"]) == 6 and doc["samples"][0]["index"] == 0 and "layout" in doc


def test_the_cache_key_changes_with_the_code_that_computes_an_activation(monkeypatch, tmp_path):
    """A fusion edit was served the old activations (0.10 off): the key holds a hash of engine/, models/ and the
    collector's source and of the torch / transformers versions."""
    import probes.collect as collect

    key = collect.cache_key("w", "c", "d", "t", "standard")
    assert collect.cache_key("w", "c", "d", "t", "standard") == key  # stable within one code
    monkeypatch.setattr(collect, "code_version", lambda: "another")
    assert collect.cache_key("w", "c", "d", "t", "standard") != key
    collect.code_version.cache_clear() if hasattr(collect.code_version, "cache_clear") else None


def test_the_code_version_covers_engine_models_and_the_versions(monkeypatch):
    import transformers

    import probes.collect as collect

    collect.code_version.cache_clear()
    before = collect.code_version()
    collect.code_version.cache_clear()
    monkeypatch.setattr(transformers, "__version__", transformers.__version__ + ".post1")
    assert collect.code_version() != before
    collect.code_version.cache_clear()
