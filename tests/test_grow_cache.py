"""engine.cache.GrowLayer: HF's DynamicLayer without the copy of the whole cache at every step.

Golden reference: transformers' own DynamicLayer (torch.cat) on the same sequence of writes and crops; the
engine's recurrence with GrowCache against the same run on HF's DynamicCache.
"""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from engine.cache import GrowCache, GrowLayer, cache_prefix, new_cache
from engine.prefill import recurrent_run
from models.configs import qwen3_config
from models.full_bandwidth import FullBandwidthLM


def kv(q, seed, B=2, H=3, D=4, grad=False):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, H, q, D, generator=g), torch.randn(B, H, q, D, generator=g)
    return (k.requires_grad_(), v.requires_grad_()) if grad else (k, v)


# a prefill, a crop, one-token steps past the first buffer, a multi-column write, a second crop, more steps
SCRIPT = [("w", 7), ("crop", 2), *[("w", 1)] * 9, ("w", 3), ("crop", 4), *[("w", 1)] * 30]


@pytest.mark.parametrize("reserve", [0, 5, 100])
def test_writes_and_crops_equal_hf_dynamic_layer(reserve):
    grow, ref = GrowLayer(reserve), DynamicLayer()
    for i, (op, n) in enumerate(SCRIPT):
        if op == "crop":
            grow.crop(-n), ref.crop(-n)
        else:
            k, v = kv(n, i)
            got, want = grow.update(k, v), ref.update(k, v)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert grow.get_seq_length() == ref.get_seq_length()
        assert torch.equal(grow.keys, ref.keys) and torch.equal(grow.values, ref.values)


def test_a_step_writes_in_place_and_the_buffer_grows_by_half():
    layer = GrowLayer(reserve=3)
    layer.update(*kv(10, 0))
    buf = layer._keys
    assert buf.shape[-2] == 13  # the prefill's columns plus the reserve
    for i in range(3):  # the reserved columns: written in place, earlier columns never copied
        layer.update(*kv(1, i + 1))
        assert layer._keys is buf and layer.keys.data_ptr() == buf.data_ptr()
    layer.update(*kv(1, 9))  # full: a new buffer, 13 + 13 // 2 + 16 columns
    assert layer._keys is not buf and layer._keys.shape[-2] == 13 + 6 + 16
    assert layer.get_seq_length() == 14


def test_autograd_gets_the_concatenation_and_the_same_gradients():
    """Training backpropagates through the steps: an in-place write into a tensor autograd saved would corrupt
    the backward pass, so under autograd a GrowLayer is HF's concatenation."""
    grads = []
    for cls in (GrowLayer, DynamicLayer):
        layer, inputs, loss = cls(), [], 0.0
        for i, n in enumerate([5, 1, 1, 1]):
            k, v = kv(n, i, grad=True)
            inputs += [k, v]
            keys, values = layer.update(k, v)
            loss = loss + (keys.sin() * values).sum()
        loss.backward()
        grads.append([x.grad for x in inputs])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_step_without_grad_after_one_with_grad_keeps_the_graph():
    """A cache that holds grad-carrying columns never writes in place again while autograd records, whatever the
    new columns carry (an in-place write would break the backward of the earlier steps' attention)."""
    layer = GrowLayer(reserve=8)
    k0, v0 = kv(4, 0, grad=True)
    keys, values = layer.update(k0, v0)
    loss = (keys * values).sum()
    for i in (1, 2):  # no grad in the new columns
        keys, values = layer.update(*kv(1, i))
        loss = loss + (keys.sin() * values).sum()  # sin saves its input for the backward pass
    loss.backward()
    ref = DynamicLayer()
    k1, v1 = kv(4, 0, grad=True)
    a, b = ref.update(k1, v1)
    ref_loss = (a * b).sum()
    for i in (1, 2):
        a, b = ref.update(*kv(1, i))
        ref_loss = ref_loss + (a.sin() * b).sum()
    ref_loss.backward()
    assert torch.equal(k0.grad, k1.grad) and torch.equal(v0.grad, v1.grad)


def test_a_buffer_made_in_inference_mode_is_copied_before_a_write_outside_it():
    layer = GrowLayer(reserve=4)
    with torch.inference_mode():
        layer.update(*kv(6, 0))
    k, v = kv(1, 1)
    with torch.no_grad():
        keys, _ = layer.update(k, v)  # torch refuses an in-place write to an inference tensor here
    assert not layer._keys.is_inference() and torch.equal(keys[..., -1:, :], k)


def test_cache_prefix_is_a_copy_the_source_cannot_change():
    src = GrowCache()
    src.update(*kv(8, 0), layer_idx=0)
    pre = cache_prefix(src, 5)
    before = pre.layers[0].keys.clone()
    src.crop(-4)
    src.update(*kv(1, 1), layer_idx=0)  # overwrites column 4 of the source's buffer in place
    assert torch.equal(pre.layers[0].keys, before) and pre.get_seq_length() == 5
    pre.update(*kv(1, 2), layer_idx=0)
    assert pre.get_seq_length() == 6 and src.get_seq_length() == 5


def test_a_batch_reorder_makes_the_next_write_copy():
    layer = GrowLayer(reserve=4)
    layer.update(*kv(5, 0))
    layer.batch_select_indices(torch.tensor([1, 0]))  # HF replaces keys/values with new tensors
    want = torch.cat([layer.keys, kv(1, 1)[0]], dim=-2)
    keys, _ = layer.update(*kv(1, 1))
    assert torch.equal(keys, want)


def test_recurrence_with_grow_cache_equals_hf_dynamic_cache(monkeypatch):
    """The engine's recurrent-full and recurrent-k, padded batch, on GrowCache and on HF's DynamicCache."""
    import engine.prefill as prefill

    torch.manual_seed(0)
    model = FullBandwidthLM.from_config(qwen3_config(40, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2,
                                                     max_len=128)).eval()
    with torch.no_grad():
        model.fusion.up.weight.normal_(0, 0.3)
    ids = torch.randint(2, 40, (3, 19))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :11] = 0
    cols = torch.arange(19)
    runs = {}
    for name, make in (("grow", new_cache), ("hf", lambda *a, **k: DynamicCache())):
        monkeypatch.setattr(prefill, "new_cache", make)
        with torch.no_grad():
            runs[name] = [recurrent_run(model, ids, mask, k, cols, full_std=False) for k in (None, 5)]
    for a, b in zip(runs["grow"], runs["hf"]):
        assert torch.allclose(a.logits, b.logits, atol=1e-6, rtol=0) and torch.allclose(a.top, b.top, atol=1e-6, rtol=0)
        assert a.cache.get_seq_length() == b.cache.get_seq_length() == 19


def test_the_engine_returns_ordinary_tensors():
    """The steps run under torch.inference_mode; nothing of it may leak out: callers edit results in place and
    feed them to autograd (probes, DAS), and keep stepping a returned cache outside inference mode."""
    from engine.prefill import generate, prefill_many

    torch.manual_seed(1)
    model = FullBandwidthLM.from_config(qwen3_config(40, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2,
                                                     max_len=128)).eval()
    ids = torch.randint(2, 40, (2, 9))
    mask = torch.ones_like(ids)
    res = prefill_many(model, ids, mask, ("standard", "recurrent-full", "recurrent-3"), positions=(-1, -4))
    for r in res.values():
        for x in (r.logits, r.top, r.resid):
            assert not x.is_inference()
            x.add_(0)  # an in-place edit, refused on an inference tensor outside inference mode
    assert not generate(model, ids, mask, 4, "soft").is_inference()
    with torch.no_grad():
        run = recurrent_run(model, ids, mask, 3, torch.tensor([8]))
        more = model(ids[:, :1], torch.ones(2, 10, dtype=torch.long), cache=run.cache, use_cache=True)
    assert run.cache.get_seq_length() == 10 and not more.logits.is_inference()
    w = torch.zeros(32, requires_grad=True)
    (res["recurrent-full"].top * w).sum().backward()  # autograd accepts them
    assert w.grad is not None
