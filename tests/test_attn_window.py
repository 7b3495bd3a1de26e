"""Sliding-window attention (qwen3_config(attn_window=W)) through the engine.

The engine keeps every column in its caches (engine.cache) and relies on HF's per-layer masks for the window;
these tests hold it to HF's own no-cache forward of the same sliding-window model, through the hand-written
recurrence references of test_prefill, with and without left padding.
"""
from __future__ import annotations

import pytest
import torch

from engine.prefill import pad_left, prefill_many
from models.configs import qwen3_config
from models.full_bandwidth import FullBandwidthLM
from tests.test_prefill import naive_fused, naive_recurrent, ref_forward

W, L, V = 4, 2, 44
PROMPT = [7, 3, 41, 12, 5, 29, 33, 8, 2, 17, 9, 30, 11, 6]  # T = 14 > L * (W - 1): the window bites
TOL = 1e-5


def windowed(window=W, seed=0) -> FullBandwidthLM:
    torch.manual_seed(seed)
    # HF's default init: a wider one makes this random recurrence chaotic (float rounding grows ~1e-3 over 14
    # steps with or without a window)
    cfg = qwen3_config(V, n_layers=L, d_model=32, n_heads=2, n_kv_heads=1, attn_window=window)
    model = FullBandwidthLM.from_config(cfg).eval()
    with torch.no_grad():  # a fusion that matters: random, not the near-identity init
        model.fusion.up.weight.normal_(0, 0.3)
        model.fusion.gate.weight.normal_(0, 3.0)
    return model


def test_config_is_sliding_in_every_layer():
    cfg = qwen3_config(V, n_layers=3, attn_window=16)
    assert cfg.layer_types == ["sliding_attention"] * 3 and cfg.sliding_window == 16
    assert set(qwen3_config(V, n_layers=3).layer_types) == {"full_attention"}


@torch.no_grad()
def test_window_limits_what_the_last_position_sees():
    model = windowed()
    ids = torch.tensor([PROMPT])
    base = model(ids).logits[0, -1]
    far, near = ids.clone(), ids.clone()
    far[0, len(PROMPT) - 1 - L * (W - 1) - 1] = 1  # one past the receptive field of L windowed layers
    near[0, len(PROMPT) - 1 - L * (W - 1)] = 1  # its edge
    assert torch.equal(model(far).logits[0, -1], base)
    assert (model(near).logits[0, -1] - base).abs().max() > 1e-4


@torch.no_grad()
def test_window_wider_than_the_prompt_is_full_attention():
    wide, full = windowed(window=64), windowed(window=None)
    full.load_state_dict(wide.state_dict())
    ids = torch.tensor([PROMPT])
    assert torch.equal(wide(ids).logits, full(ids).logits)


@pytest.mark.parametrize("pad", [0, 3])
@pytest.mark.parametrize("mode,k", [("standard", 0), ("recurrent-full", None), ("recurrent-3", 3)])
def test_recurrence_matches_the_hand_written_reference(pad, mode, k):
    """The engine's cached one-token steps (full-length caches, cropped for recurrent-k) == recomputing the
    whole prefix with HF's no-cache sliding-window forward at every position."""
    model = windowed()
    other = [5] * (len(PROMPT) + pad)
    ids, mask = pad_left([PROMPT, other], pad_id=0)
    res = prefill_many(model, ids, mask, [mode], positions=tuple(range(-len(PROMPT), 0)), collect=False)[mode]
    ref = ref_forward(model, PROMPT) if mode == "standard" else naive_recurrent(model, PROMPT, k)
    assert (res.logits[0] - ref.logits).abs().max() <= TOL
    assert (res.top[0] - ref.top).abs().max() <= TOL


def test_fused_passes_match_the_hand_written_reference():
    model = windowed()
    ids, mask = pad_left([PROMPT, PROMPT[:9]], pad_id=0)
    res = prefill_many(model, ids, mask, ["fused-3"], collect=False)["fused-3"]
    ref = naive_fused(model, PROMPT, 3)
    assert (res.logits[0, -1] - ref.logits[-1]).abs().max() <= TOL


def test_checkpoint_keeps_the_window(tmp_path):
    model = windowed()
    model.save_pretrained(tmp_path / "m")
    back = FullBandwidthLM.from_pretrained(tmp_path / "m")
    assert back.config.sliding_window == W and set(back.config.layer_types) == {"sliding_attention"}
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


def test_tracking_twins_share_a_window_that_bites_and_a_pass_that_sees_everything():
    """docs/recipe.md item 19: the trained prompts are longer than the window (the windowed regime of longer
    prompts is trained), and the standard pass's receptive field covers every trained prompt (the twin is not
    blinded by the window at the trained lengths)."""
    from tasks import make_dataset
    from tasks.tokenizer import build_tokenizer, tokenize_samples
    from training.presets import get_preset

    fbt, std = get_preset("tiny-fbt-track"), get_preset("tiny-std-track")
    arch = ("arch", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "attn_window", "distractors", "tasks")
    assert all(getattr(fbt, a) == getattr(std, a) for a in arch)
    tok = build_tokenizer()
    longest = max(len(ids) for t in fbt.tasks
                  for ids in tokenize_samples(make_dataset(t, n_pairs=4, n_distractors=max(fbt.distractors), seed=0),
                                              tok)[0])
    assert fbt.attn_window < longest <= fbt.n_layers * (fbt.attn_window - 1)
