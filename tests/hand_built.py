"""The hand-built model with a known answer, shared by tests/test_interventions.py and tests/test_leace.py.

`state_only_model`: a 2-layer Qwen3-style FullBandwidthLM whose blocks are the identity (attention and MLP
outputs zeroed) and whose fusion passes the state through (gate 0, up = identity), with token embeddings that
write the label into dimensions 0/1 (token A -> C e_0, token B -> C e_1; every other token 0). So the logits at
T depend only on the state fed back from T-1. `state_batch(n_pairs)`: pairs of prompts `ctx A F` / `ctx B F`.
"""
from __future__ import annotations

import numpy as np
import torch

from interventions.core import Batch

A, B, F, C = 3, 4, 5, 2.0


def make_state_only_model(config):
    from models.full_bandwidth import FullBandwidthLM, decoder_layers

    model = FullBandwidthLM.from_config(config, seed=0).eval().float()
    D = model.d_model
    with torch.no_grad():
        for layer in decoder_layers(model.lm):
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.fusion.gate.weight.zero_()
        model.fusion.up.weight.copy_(torch.eye(D))
        model.fusion.norm.weight.fill_(1.0)
        E = model.lm.get_input_embeddings().weight
        E.zero_()
        E[A, 0] = C
        E[B, 1] = C
    return model


def state_batch(n_pairs: int) -> Batch:
    g = torch.Generator().manual_seed(1)
    rows, labels = [], []
    for _ in range(n_pairs):
        ctx_tokens = torch.randint(6, 50, (4,), generator=g).tolist()
        for label, tok in ((0, A), (1, B)):
            rows.append(ctx_tokens + [tok, F])
            labels.append(label)
    ids = torch.tensor(rows)
    return Batch(ids, torch.ones_like(ids), torch.tensor(labels), torch.arange(len(rows)) ^ 1,
                 np.repeat(np.arange(n_pairs), 2), (A, B))
