"""Fingerprints of a model and a tokenizer: what a run's signature and the activation cache key (probes.collect)
record, and what causal_report.json's model.weights_sha256 is (interventions.run)."""
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
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def tokenizer_hash(tokenizer) -> str:
    """SHA-256 of the tokenizer's full serialization (fast tokenizers) or of its vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        blob = backend.to_str()
    else:
        blob = json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()
