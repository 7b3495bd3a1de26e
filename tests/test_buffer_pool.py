"""engine.buffers: key/value buffers kept between caches, never handed out while anything else holds them.

The invariants: a buffer is reused only once nothing but the pool holds its storage (a live cache, an escaped view
or a numpy array over it keep it out of reach); the engine's results are bit for bit the same with the pool on or
off, and on a second run over reused buffers; the byte cap holds; inference-mode buffers stay in inference mode.
"""
from __future__ import annotations

import threading

import pytest
import torch

from engine.buffers import POOL, BufferPool, pool_enabled
from engine.cache import GrowCache
from engine.prefill import prefill_many
from models.configs import qwen3_config
from models.full_bandwidth import FullBandwidthLM


def span(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def disjoint(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = span(a), span(b)
    return a1 <= b0 or b1 <= a0


def write(cache: GrowCache, fill: float, T: int = 6, B: int = 2, H: int = 2, D: int = 4) -> GrowCache:
    k = torch.full((B, H, T, D), fill)
    cache.update(k, k + 0.5, 0)
    return cache


def test_a_dropped_cache_buffer_is_reused():
    pool = BufferPool()
    like = torch.zeros(1)
    a = pool.empty(like, (2, 3, 4))
    ptr = a.data_ptr()
    del a
    b = pool.empty(like, (2, 3, 4))
    assert b.data_ptr() == ptr and b.shape == (2, 3, 4) and b.is_contiguous()
    c = pool.empty(like, (3, 4))  # smaller, but over half: may reuse; b is still held, so not b's buffer
    assert disjoint(b, c)


def test_live_caches_never_share_and_keep_their_values():
    first = write(GrowCache(), 1.0)
    second = write(GrowCache(), 2.0)
    assert disjoint(first.layers[0].keys, second.layers[0].keys)
    assert disjoint(first.layers[0].keys, first.layers[0].values)
    assert bool((first.layers[0].keys == 1.0).all()) and bool((second.layers[0].keys == 2.0).all())


@pytest.mark.parametrize("holder", ["view", "numpy", "layer_buffer"])
def test_anything_holding_a_buffer_keeps_it_out_of_reach(holder):
    cache = write(GrowCache(), 3.0)
    layer = cache.layers[0]
    kept = {"view": lambda: layer.keys[:, :1],  # a view of a view of the buffer
            "numpy": lambda: layer.keys.numpy(),
            "layer_buffer": lambda: layer._keys}[holder]()
    before = torch.as_tensor(kept).clone()
    del cache, layer
    others = [write(GrowCache(), 9.0) for _ in range(3)]  # same shapes: every free buffer would be taken
    assert torch.equal(torch.as_tensor(kept), before)
    assert all(bool((o.layers[0].keys == 9.0).all()) for o in others)


def test_byte_cap_and_least_recently_used_first_out():
    pool = BufferPool(max_bytes=4 * 100)  # 100 float32s
    like = torch.zeros(1)
    big = pool.empty(like, (101,))  # over the cap: a plain tensor, not kept
    assert pool.kept_bytes() == 0 and big.shape == (101,)
    a, b = pool.empty(like, (50,)), pool.empty(like, (50,))
    assert pool.kept_bytes() == 400
    c = pool.empty(like, (50,))  # both kept buffers in use: c is not kept
    assert pool.kept_bytes() == 400 and disjoint(c, a) and disjoint(c, b)
    a_ptr = a.data_ptr()
    del a, c
    d = pool.empty(like, (60,))  # needs room: drops the free one (a's), keeps b's (in use)
    assert pool.kept_bytes() <= 400 and disjoint(d, b)
    e = pool.empty(like, (50,))  # a's buffer is gone; d and b are in use: a plain tensor
    assert disjoint(e, b) and disjoint(e, d)
    assert a_ptr is not None


def test_buffer_count_cap():
    pool = BufferPool(max_buffers=2)
    like = torch.zeros(1)
    held = [pool.empty(like, (8,)) for _ in range(3)]  # the third is not kept: both kept ones are in use
    assert pool.kept_bytes() == 2 * 8 * 4 and all(disjoint(a, b) for a in held for b in held if a is not b)
    del held[0]
    other = pool.empty(like, (8, 2))  # room made by dropping the free one
    assert pool.kept_bytes() == (8 + 16) * 4 and all(disjoint(other, h) for h in held)
    pool.clear()
    assert pool.kept_bytes() == 0 and bool((other == other).all())  # held tensors stay valid


def test_a_small_request_never_pins_a_big_buffer():
    pool = BufferPool()
    like = torch.zeros(1)
    big = pool.empty(like, (1000,))
    ptr = big.data_ptr()
    del big
    small = pool.empty(like, (10,))
    assert small.data_ptr() != ptr
    half = pool.empty(like, (500,))
    assert half.data_ptr() == ptr


def test_dtype_device_and_inference_mode_are_respected():
    pool = BufferPool()
    f32 = pool.empty(torch.zeros(1), (8,))
    ptr = f32.data_ptr()
    del f32
    assert pool.empty(torch.zeros(1, dtype=torch.float64), (8,)).dtype == torch.float64
    meta = pool.empty(torch.zeros(1, device="meta"), (8,))  # not CPU: never kept
    assert meta.device.type == "meta"
    with torch.inference_mode():
        inf = pool.empty(torch.zeros(1), (8,))
        assert inf.is_inference() and inf.data_ptr() != ptr  # a normal buffer is not handed out in inference mode
        inf_ptr = inf.data_ptr()
        del inf
    out = pool.empty(torch.zeros(1), (8,))
    assert not out.is_inference() and out.data_ptr() != inf_ptr
    out.fill_(1.0)  # writable outside inference mode


def test_grow_cache_written_outside_inference_mode_after_one_made_inside():
    with torch.inference_mode():
        write(GrowCache(), 1.0)
    cache = write(GrowCache(), 2.0)  # would raise if handed the inference-mode buffer
    cache.update(torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4), 0)
    assert cache.get_seq_length() == 7


def test_threads_never_get_the_same_buffer():
    pool = BufferPool(max_bytes=1 << 20)
    held: list[list[torch.Tensor]] = [[], []]
    errors = []

    def work(j):
        try:
            for i in range(200):
                t = pool.empty(torch.zeros(1), (64,))
                t.fill_(float(j))
                held[j].append(t)
                if i % 3 == 0:
                    held[j].pop(0)  # free some, so buffers are reused while the other thread asks
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(j,)) for j in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    live = held[0] + held[1]
    starts = [t.data_ptr() for t in live]
    assert len(set(starts)) == len(starts)
    assert all(bool((t == 0.0).all()) for t in held[0]) and all(bool((t == 1.0).all()) for t in held[1])


def test_pool_enabled_switch():
    with pool_enabled(False):
        assert not POOL.enabled
        with pool_enabled(True):
            assert POOL.enabled or not hasattr(torch._C, "_storage_Use_Count")
        assert not POOL.enabled
    assert POOL.enabled == hasattr(torch._C, "_storage_Use_Count")


@pytest.fixture(scope="module")
def tiny():
    cfg = qwen3_config(48, n_layers=3, d_model=32, n_heads=4, n_kv_heads=2, max_len=128)
    return FullBandwidthLM.from_config(cfg, seed=3).eval()


@pytest.mark.parametrize("mode", ["recurrent-1", "recurrent-3", "recurrent-full"])
def test_engine_results_bit_for_bit_with_the_pool_on_or_off(tiny, mode):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 48, (3, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # a left-padded row
    with pool_enabled(False):
        ref = prefill_many(tiny, ids, mask, ("standard", mode), positions=(-1, -5))
    with torch.no_grad():
        runs = [prefill_many(tiny, ids, mask, ("standard", mode), positions=(-1, -5)) for _ in range(3)]
    for got in runs:  # the second and third runs write into the first run's buffers
        for m in ("standard", mode):
            assert torch.equal(got[m].logits, ref[m].logits) and torch.equal(got[m].top, ref[m].top)
            assert torch.equal(got[m].resid, ref[m].resid)
