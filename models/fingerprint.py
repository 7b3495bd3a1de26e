"""Fingerprints of a model and a tokenizer: what a run's signature and the activation cache key (probes.collect)
record, and what causal_report.json's model.weights_sha256 / config_sha256 are (interventions.run).

A model is its weights *and* its config: two folders with the same tensors and another `rope_theta`,
`sliding_window`, norm epsilon (the fusion's too), soft-cap or looped split are different models, and must not share cached activations."""
from __future__ import annotations

import hashlib
import json

import torch


def weights_hash(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter and buffer (name, dtype, shape, bytes), in name order."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")  # 0-dim too
    return h.hexdigest()


# Config entries that say how the model was saved or is called, not what it computes (the tensors' dtype is in
# weights_hash): left out, so a copy of a folder elsewhere or from another transformers version keeps its hash.
_NOT_COMPUTATION = frozenset({"_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype",
                              "_commit_hash", "output_hidden_states", "output_attentions", "return_dict", "use_cache"})


def config_hash(model_or_config) -> str:
    """SHA-256 of the HF config's entries (a FullBandwidthLM's wrapped LM's; a config or config dict as given),
    as sorted JSON, but for those in _NOT_COMPUTATION; for a FullBandwidthLM also what its own config.json
    holds beside the HF config: the fusion's settings (its RMSNorm eps) and a looped model's prelude / core /
    coda split, neither of which is a tensor or an HF config entry."""
    obj = getattr(model_or_config, "lm", model_or_config)
    config = getattr(obj, "config", obj)
    d = config if isinstance(config, dict) else config.to_dict()
    d = {k: v for k, v in d.items() if k not in _NOT_COMPUTATION}
    wrapper = {}
    if hasattr(model_or_config, "fusion_settings"):
        wrapper["fusion"] = model_or_config.fusion_settings()
    spec = getattr(model_or_config, "spec", None)
    if hasattr(spec, "to_dict"):
        wrapper["loop"] = spec.to_dict()
    if wrapper:  # a key no HF config has; a bare HF config's hash is what it was
        d = {"hf_config": d, "full_bandwidth": wrapper}
    blob = json.dumps(d, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def tokenizer_hash(tokenizer) -> str:
    """SHA-256 of the tokenizer's full serialization (fast tokenizers) or of its vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        blob = backend.to_str()
    else:
        blob = json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()
