"""The engine's KV caches: one constructor, one prefix copy.

By default every layer's cache keeps every column, sliding-window layers included: the engine crops a cache
(recurrent-k recomputes its last k columns) and copies prefixes of it (an intervention's shared clean prefix),
which HF's sliding-window cache layers cannot do once their window is full. The window itself is never lost: HF
builds each layer's attention mask from `config.layer_types` and `config.sliding_window`, whatever cache it is
given, so a sliding layer still attends to its last `sliding_window` columns only (tests/test_attn_window.py
checks the engine against plain HF forwards of a sliding-window model). But each one-token step then attends over
all T columns (masked), so a recurrence over T columns costs O(T^2).

`new_cache(model, slack=k)` gives a windowed model's sliding layers a `WindowLayer` instead: it keeps only the
last W - 1 + k columns (the W - 1 a next query can see, plus k that a crop may take back), so a step costs O(W)
and a recurrence O(T * W). Its mask sizes are HF's own protocol (`get_mask_sizes`: the kept columns' absolute
offset), so HF masks padding and the window exactly as over the full cache. What it cannot do is give back a
column it dropped: a crop deeper than k, or `cache_prefix`, refuse in one line (the interventions keep full
caches). tests/test_window_cache.py checks it against the full cache in every mode, at T > W.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from common.errors import UserError


class WindowLayer(DynamicLayer):
    """One sliding layer's keys/values: the last `keep` = window - 1 + slack columns of the `seen` so far."""

    is_sliding = True

    def __init__(self, window: int, slack: int = 0):
        super().__init__()
        self.window, self.keep = int(window), int(window) - 1 + int(slack)
        self.seen = 0  # columns written so far (absolute length: positions, masks, get_seq_length)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        self.keys, self.values = keys[..., keys.shape[-2] - min(self.keep, keys.shape[-2]):, :], \
            values[..., values.shape[-2] - min(self.keep, values.shape[-2]):, :]
        return keys, values  # this call's queries see the kept columns and the new ones

    def reset(self) -> None:
        super().reset()
        self.seen = 0

    def _stored(self) -> int:
        return 0 if not self.is_initialized or self.keys.numel() == 0 else self.keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(keys the next call attends over, absolute column of the first of them)."""
        stored = self._stored()
        return stored + query_length, self.seen - stored

    def get_seq_length(self) -> int:
        return self.seen

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("WindowLayer.crop takes a negative count (columns to remove)")
        m = -tokens_to_remove
        if m == 0:
            return
        if m > self._stored() or (self.seen > self._stored() and self._stored() - m < self.window - 1):
            raise UserError(f"a window cache keeps {self.keep} columns ({self.window - 1} + slack "
                            f"{self.keep - self.window + 1}): it cannot take back {m}")
        self.keys, self.values = self.keys[..., :-m, :], self.values[..., :-m, :]
        self.seen -= m


class WindowCache(Cache):
    """A cache whose sliding layers are WindowLayers and whose full-attention layers keep every column."""

    def __init__(self, windows, slack: int = 0):
        super().__init__(layers=[DynamicLayer() if w is None else WindowLayer(w, slack) for w in windows])

    def set_slack(self, slack: int) -> None:
        """From the next update on, keep window - 1 + `slack` columns (a crop's slack, once it is taken, is not
        needed again: recurrent-k crops once after its full-width prefill, then steps)."""
        for layer in self.layers:
            if isinstance(layer, WindowLayer):
                layer.keep = layer.window - 1 + int(slack)


def new_cache(model=None, slack: int = 0) -> DynamicCache | WindowCache:
    """An empty cache. Without `model` (or for a model with no sliding layer) every layer keeps every column
    (croppable by any count, copyable); with `model`, sliding layers keep only their window plus `slack`."""
    windows = model_windows(model)
    if windows is None or all(w is None for w in windows):
        return DynamicCache()
    return WindowCache(windows, slack)


def model_windows(model) -> list[int | None] | None:
    """Per-layer attention windows of an engine model (a FullBandwidthLM), None when unknown."""
    family = getattr(model, "family", None)
    return None if family is None else family.windows(model.config)


def cache_prefix(cache: DynamicCache, t: int) -> DynamicCache:
    """A new cache holding the first t columns of `cache` (left untouched). The keys/values of a column never
    change once computed, so the final cache of a clean recurrent run cropped to t columns is the cache its step
    at column t started from."""
    if isinstance(cache, WindowCache):
        raise UserError("a window cache keeps only its last columns: the shared clean prefix needs a full cache "
                        "(engine.cache.new_cache() without a model)")
    return DynamicCache(ddp_cache_data=[(layer.keys[..., :t, :], layer.values[..., :t, :])
                                        for layer in cache.layers])
