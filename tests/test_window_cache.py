"""The window cache (engine.cache.WindowLayer): a windowed model's sliding layers keep only their last W - 1 (+ slack)
columns, so a recurrence costs O(T * W). Held to the full cache (every column kept, HF masking the window) in every
mode at T > W, with and without left padding; its refusals; and the context limit it lifts."""
from __future__ import annotations

import pytest
import torch

from common.errors import UserError
from engine.cache import WindowCache, WindowLayer, cache_prefix, new_cache
from engine.hooks import ResidualRecorder
from engine.inputs import context_length
from engine.prefill import generate, pad_left, prefill_many, recurrent_logits, recurrent_run
from models.configs import qwen3_config
from models.full_bandwidth import FullBandwidthLM

W, V = 5, 44
TOL = 1e-5


def model_of(window=W, n_layers=3, layer_types=None, max_len=2048, seed=0) -> FullBandwidthLM:
    torch.manual_seed(seed)
    kw = {}
    if layer_types is not None:
        kw = dict(layer_types=layer_types, sliding_window=window, use_sliding_window=True, max_window_layers=0)
        window = None
    cfg = qwen3_config(V, n_layers=n_layers, d_model=32, n_heads=2, n_kv_heads=1, attn_window=window,
                       max_len=max_len, **kw)
    model = FullBandwidthLM.from_config(cfg).eval()
    with torch.no_grad():  # a fusion that matters (random, not the near-identity init)
        model.fusion.up.weight.normal_(0, 0.3)
        model.fusion.gate.weight.normal_(0, 3.0)
    return model


def batch(lengths=(23, 17, 9), seed=1):
    g = torch.Generator().manual_seed(seed)
    return pad_left([torch.randint(2, V, (n,), generator=g).tolist() for n in lengths])


@pytest.fixture(scope="module")
def model():
    return model_of()


def test_new_cache_picks_window_layers_only_for_sliding_layers(model):
    assert type(new_cache()).__name__ == "GrowCache" and type(new_cache(model_of(window=None))).__name__ == \
        "GrowCache"
    c = new_cache(model, slack=2)
    assert isinstance(c, WindowCache) and all(isinstance(l, WindowLayer) and l.keep == W + 1 for l in c.layers)
    mixed = new_cache(model_of(layer_types=["sliding_attention", "full_attention", "sliding_attention"]))
    assert [isinstance(l, WindowLayer) for l in mixed.layers] == [True, False, True]


@pytest.mark.parametrize("k", [1, 2, 7, None])
@pytest.mark.parametrize("padded", [False, True])
def test_recurrent_run_equals_the_full_cache(model, k, padded):
    ids, mask = batch() if padded else batch((23, 23, 23))
    T = ids.shape[1]
    outs = []
    for full in (True, False):
        with ResidualRecorder(model) as rec, torch.no_grad():
            run = recurrent_run(model, ids, mask, k, torch.arange(T), rec, full_cache=full)
        outs.append(run)
    a, b = outs
    real = mask.bool()
    for name in ("logits", "top", "resid"):
        d = (getattr(a, name) - getattr(b, name)).abs().flatten(2).amax(-1)
        assert d[real].max() <= TOL, (name, k)
    kept = [l.keys.shape[-2] for l in b.cache.layers]
    # the window only (the crop's slack is released once taken), at the absolute length
    assert kept == [W - 1] * 3 and b.cache.get_seq_length() == T


@pytest.mark.parametrize("modes", [["standard", "recurrent-1", "recurrent-full"], ["recurrent-3", "fused-2"]])
def test_prefill_many_modes_equal_the_full_cache(model, modes):
    ids, mask = batch()
    with torch.no_grad():
        got = prefill_many(model, ids, mask, modes, collect=True, positions=(-1, -4))
        ref = prefill_many(model, ids, mask, modes, collect=True, positions=(-1, -4), full_cache=True)
    for m in modes:
        assert (got[m].logits - ref[m].logits).abs().max() <= TOL, m
        assert (got[m].resid - ref[m].resid).abs().max() <= TOL, m


def test_training_recurrence_gradients_equal_the_full_cache(monkeypatch):
    ids, mask = batch((19, 19))
    grads = []
    for full in (True, False):
        m = model_of(seed=3).train()
        import engine.prefill as ep

        real_run = ep.recurrent_run
        monkeypatch.setattr(ep, "recurrent_run", lambda *a, full=full, **kw: real_run(*a, **{**kw, "full_cache": full}))
        decoy = (torch.zeros_like(ids, dtype=torch.bool).index_fill_(1, torch.tensor([6, 11]), True),
                 torch.tensor([1, 0]))
        logits = recurrent_logits(m, ids, mask, decoy=decoy)
        logits.logsumexp(-1).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]))
        monkeypatch.undo()
    assert (grads[0] - grads[1]).abs().max() <= 1e-4 * grads[0].abs().max()


def test_generation_continues_from_the_window_cache(model):
    ids, mask = batch()
    with torch.no_grad():
        a = generate(model, ids, mask, 6, decoding="soft")
    import engine.prefill as ep

    real_run = ep.recurrent_run
    ep.recurrent_run = lambda *x, **kw: real_run(*x, **{**kw, "full_cache": True})
    try:
        with torch.no_grad():
            b = generate(model, ids, mask, 6, decoding="soft")
    finally:
        ep.recurrent_run = real_run
    assert torch.equal(a, b)


def test_refusals_are_one_line(model):
    ids, mask = batch((20,))
    with torch.no_grad():
        run = recurrent_run(model, ids, mask, None, torch.arange(20))
    with pytest.raises(UserError, match="full cache") as e:
        cache_prefix(run.cache, 5)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="cannot take back 1"):
        run.cache.crop(-1)  # slack 0: the next query would miss a column of its window
    c = new_cache(model, slack=3)
    with torch.no_grad():
        model(ids, mask, cache=c, use_cache=True)
    c.crop(-3)
    assert c.get_seq_length() == 17 and all(l.keys.shape[-2] == W - 1 for l in c.layers)
    with pytest.raises(UserError, match="cannot take back"):
        c.crop(-1)


def test_context_limit_lifted_for_windowed_rotary_models_only():
    ids, mask = batch((90, 40), seed=4)  # longer than max_len = 64
    win = model_of(max_len=64)
    with torch.no_grad():
        out = prefill_many(win, ids, mask, ["recurrent-full"])["recurrent-full"].logits
    assert torch.isfinite(out).all()
    for m in (model_of(window=None, max_len=64),
              model_of(layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_len=64)):
        with pytest.raises(UserError, match="longer than the model's context"):
            prefill_many(m, ids, mask, ["recurrent-full"])


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0}, {"rope_type": "yarn", "factor": 2.0}])
def test_context_limit_kept_for_context_dependent_rope_scaling(rope):
    """Dynamic NTK rescales its frequencies past max_position_embeddings and YaRN is fitted to an original context:
    their positions are not relative past it, so a windowed model with them keeps the refusal."""
    m = model_of(max_len=64)
    m.config.rope_parameters = {**m.config.rope_parameters, **rope}
    assert context_length(m.config, [W] * 3) == 64
    ids, mask = batch((90,), seed=4)
    with pytest.raises(UserError, match="longer than the model's context"):
        prefill_many(m, ids, mask, ["recurrent-full"])
    m.config.rope_parameters = {**m.config.rope_parameters, "rope_type": "linear"}
    assert context_length(m.config, [W] * 3) is None


def test_rotary_positions_past_the_old_context_are_relative():
    """A windowed rotary model reads only relative positions: the same last W * L + 1 tokens give the same last
    logits whatever comes before them, at absolute positions beyond max_len (recurrent-1 reads the fed state of
    T-2 too, so the tail is one column longer)."""
    win = model_of(max_len=32, n_layers=2)
    g = torch.Generator().manual_seed(5)
    tail = torch.randint(2, V, (1, 2 * (W - 1) + 2), generator=g)
    outs = []
    for pre in (3, 70):
        ids = torch.cat([torch.randint(2, V, (1, pre), generator=g), tail], 1)
        with torch.no_grad():
            outs.append(prefill_many(win, ids, torch.ones_like(ids), ["recurrent-1"])["recurrent-1"].logits)
    assert (outs[0] - outs[1]).abs().max() <= 1e-4


def test_causal_context_checks_its_clean_runs_bit_for_bit_on_a_windowed_model():
    """The interventions' clean runs keep every column (their patched runs copy cache prefixes); the engine is asked
    for the same computation (prefill_many(full_cache=True)), so the bit-for-bit check holds at T > W."""
    from interventions.core import Batch, CausalContext
    from tasks import build_tokenizer, make_dataset

    tok = build_tokenizer()
    torch.manual_seed(0)
    cfg = qwen3_config(len(tok.get_vocab()), n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, attn_window=W)
    m = FullBandwidthLM.from_config(cfg).eval()
    batch = Batch.from_samples(make_dataset("parity", 3, 12, seed=0), tok, "parity")
    assert batch.input_ids.shape[1] > 4 * W
    ctx = CausalContext(m, batch, modes=("standard", "recurrent-full"))
    with torch.no_grad():
        win = prefill_many(m, batch.input_ids, batch.attention_mask, ["recurrent-full"])["recurrent-full"]
    assert (win.logits[:, -1] - ctx.clean["recurrent-full"].logits).abs().max() <= TOL


@pytest.mark.parametrize("looped", [False, True])
def test_chunked_standard_pass_equals_the_full_pass(looped, monkeypatch):
    """prefill_many(chunked=True) runs a windowed model's standard (and loop-R) pass in chunks over the window cache
    once T > 2 chunks: the logits and top states at the read columns equal the full pass's, padded rows included;
    a model with a full-attention layer, and a recording run, keep the full pass."""
    import engine.prefill as prefill_mod

    monkeypatch.setattr(prefill_mod, "STANDARD_CHUNK", 4)
    calls = []
    real = prefill_mod._standard_chunked
    monkeypatch.setattr(prefill_mod, "_standard_chunked", lambda *a, **k: calls.append(1) or real(*a, **k))
    if looped:
        from models.looped import LoopedLM, LoopSpec
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        cfg = qwen3_config(V, n_layers=4, d_model=32, n_heads=2, n_kv_heads=1, attn_window=W)
        m = LoopedLM(AutoModelForCausalLM.from_config(cfg), LoopSpec(1, 2, 1, 3)).eval()
        modes = ["standard", "loop-5"]
    else:
        m, modes = model_of(), ["standard"]
    ids, mask = batch((23, 17, 9))
    positions = (-1, -2, -9)
    full = prefill_many(m, ids, mask, modes, positions=positions, collect=False)
    chunked = prefill_many(m, ids, mask, modes, positions=positions, collect=False, chunked=True)
    assert len(calls) == len(modes)
    for mode in modes:
        assert torch.allclose(chunked[mode].logits, full[mode].logits, atol=TOL)
        assert torch.allclose(chunked[mode].top, full[mode].top, atol=TOL)
    calls.clear()
    mixed = model_of(layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    prefill_many(mixed, ids, mask, ["standard"], collect=False, chunked=True)
    prefill_many(m, ids, mask, ["standard"], collect=True, chunked=True)
    assert not calls
