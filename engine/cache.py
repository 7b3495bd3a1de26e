"""The engine's KV caches: one constructor, one prefix copy.

Every layer's cache keeps every column, sliding-window layers included. The engine crops a cache (recurrent-k
recomputes its last k columns) and copies prefixes of it (an intervention's shared clean prefix), which HF's
sliding-window cache layers cannot do once their window is full. The window itself is never lost: HF builds each
layer's attention mask from `config.layer_types` and `config.sliding_window`, whatever cache it is given, so a
sliding layer still attends to its last `sliding_window` columns only (tests/test_attn_window.py checks the
engine against plain HF forwards of a sliding-window model).
"""
from __future__ import annotations

from transformers import DynamicCache


def new_cache() -> DynamicCache:
    """An empty cache whose every layer keeps every column (croppable, copyable)."""
    return DynamicCache()


def cache_prefix(cache: DynamicCache, t: int) -> DynamicCache:
    """A new cache holding the first t columns of `cache` (left untouched). The keys/values of a column never
    change once computed, so the final cache of a clean recurrent run cropped to t columns is the cache its step
    at column t started from."""
    return DynamicCache(ddp_cache_data=[(layer.keys[..., :t, :], layer.values[..., :t, :])
                                        for layer in cache.layers])
