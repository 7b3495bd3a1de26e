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

Every full-attention layer is a `GrowLayer`: HF's DynamicLayer concatenates each new column onto a new copy of
the whole cache (`torch.cat`), so a one-token step copies O(t) keys and values and a recurrence over T columns
O(T^2); a GrowLayer writes the new columns into spare capacity of its buffer (amortized O(1) a column) and
falls back to the concatenation wherever autograd records the step (training backpropagates through it).
"""
from __future__ import annotations

from functools import partial

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from common.errors import UserError


class GrowLayer(DynamicLayer):
    """A full-attention layer's keys/values as views of the first n columns of a buffer with spare columns.

    `update` writes the new columns in place (no copy of the earlier ones) and grows the buffer by half when it
    is full; `reserve`: spare columns of the first buffer (the steps known to follow a prefill). Under autograd
    (grad enabled and the new or the cached keys require grad) it is HF's DynamicLayer: the concatenation, never
    an in-place write into a tensor autograd saved. A crop keeps the buffer, so the next step overwrites the dropped
    columns: nothing else may hold views of them (`cache_prefix` copies)."""

    def __init__(self, reserve: int = 0):
        super().__init__()
        self.reserve = int(reserve)
        self._keys = self._values = None  # [batch, heads, capacity, head_dim] buffers; None = none owned

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad or (
                self.is_initialized and (self.keys.requires_grad or self.values.requires_grad))):
            self._keys = self._values = None
            return super().update(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q = self.get_seq_length(), key_states.shape[-2]
        if not self._owns(key_states, n) or n + q > self._keys.shape[-2]:
            self._grow(key_states, value_states, n, n + q)
        self._keys[..., n:n + q, :] = key_states
        self._values[..., n:n + q, :] = value_states
        self.keys, self.values = self._keys[..., :n + q, :], self._values[..., :n + q, :]
        return self.keys, self.values

    def _owns(self, key_states: torch.Tensor, n: int) -> bool:
        """Whether keys/values are still the first n > 0 columns of this layer's buffers (HF's crop slices them;
        anything that replaces them, e.g. a batch reorder, makes the next write copy into a new buffer)."""
        return (self._keys is not None and n > 0 and self._keys.shape[:2] == key_states.shape[:2]
                and self._keys.dtype == key_states.dtype
                # a buffer made under torch.inference_mode (engine.prefill's steps) is written outside it only
                # after a copy: torch forbids in-place writes to inference tensors there
                and (not self._keys.is_inference() or torch.is_inference_mode_enabled())
                and self.keys.data_ptr() == self._keys.data_ptr() and self.keys.stride() == self._keys.stride()
                and self.values.data_ptr() == self._values.data_ptr()
                and self.values.stride() == self._values.stride())

    def _grow(self, key_states, value_states, n: int, need: int) -> None:
        cap = need + self.reserve if n == 0 else max(need, n + n // 2 + 16)
        keys = key_states.new_empty(key_states.shape[:-2] + (cap, key_states.shape[-1]))
        values = value_states.new_empty(value_states.shape[:-2] + (cap, value_states.shape[-1]))
        if n:
            keys[..., :n, :], values[..., :n, :] = self.keys, self.values
        self._keys, self._values = keys, values

    def reset(self) -> None:
        super().reset()
        self._keys = self._values = None


class GrowCache(DynamicCache):
    """HF's DynamicCache with `GrowLayer`s: one-token steps write their column in place (see GrowLayer)."""

    def __init__(self, reserve: int = 0, n_layers: int | None = None):
        if n_layers is None:  # layers are made as the model first writes them
            Cache.__init__(self, layer_class_to_replicate=partial(GrowLayer, reserve))
        else:
            Cache.__init__(self, layers=[GrowLayer(reserve) for _ in range(n_layers)])


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

    def __init__(self, windows, slack: int = 0, reserve: int = 0):
        super().__init__(layers=[GrowLayer(reserve) if w is None else WindowLayer(w, slack) for w in windows])

    def set_slack(self, slack: int) -> None:
        """From the next update on, keep window - 1 + `slack` columns (a crop's slack, once it is taken, is not
        needed again: recurrent-k crops once after its full-width prefill, then steps)."""
        for layer in self.layers:
            if isinstance(layer, WindowLayer):
                layer.keep = layer.window - 1 + int(slack)


def new_cache(model=None, slack: int = 0, reserve: int = 0) -> GrowCache | WindowCache:
    """An empty cache. Without `model` (or for a model with no sliding layer) every layer keeps every column
    (croppable by any count, copyable); with `model`, sliding layers keep only their window plus `slack`.
    `reserve`: columns known to follow the first write (one-token steps after a prefill), allocated with it."""
    windows = model_windows(model)
    if windows is None or all(w is None for w in windows):
        return GrowCache(reserve)
    return WindowCache(windows, slack, reserve)


def model_windows(model) -> list[int | None] | None:
    """Per-layer attention windows of an engine model (a FullBandwidthLM), None when unknown."""
    family = getattr(model, "family", None)
    return None if family is None else family.windows(model.config)


def cache_prefix(cache: DynamicCache, t: int, reserve: int | None = None) -> GrowCache:
    """A new cache holding a copy of the first t columns of `cache` (left untouched: a GrowLayer writes in place,
    so a prefix of views would see the source's later steps). The keys/values of a column never change once
    computed, so the final cache of a clean recurrent run cropped to t columns is the cache its step at column t
    started from. `reserve`: spare columns (default: as many as `cache` holds after the first t)."""
    if isinstance(cache, WindowCache):
        raise UserError("a window cache keeps only its last columns: the shared clean prefix needs a full cache "
                        "(engine.cache.new_cache() without a model)")
    if reserve is None:
        reserve = max(cache.get_seq_length() - t, 0)
    out = GrowCache(reserve, n_layers=len(cache.layers))
    for layer, src in zip(out.layers, cache.layers):
        if src.is_initialized and src.keys.numel():
            layer.update(src.keys[..., :t, :], src.values[..., :t, :])
    return out
