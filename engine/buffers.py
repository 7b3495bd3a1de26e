"""Key/value buffers kept between caches, so a new cache writes into pages the process already has.

Why: a cache's buffers are freed when its run ends, glibc hands that memory back to the kernel, and the next
cache's first write faults every page in again (the kernel maps and zeroes them). On the benchmark's 4-layer model
at T = 1024 that is ~600 faults, ~1 ms, 2% of a recurrent-1 pass (docs/benchmarks.md, issue 38, fourth session).
PyTorch's CUDA allocator keeps freed blocks for reuse; its CPU allocator does not, so the engine keeps its own few.

Safety is by ownership, read off the storage: a buffer is handed out again only when nothing but the pool holds its
storage (torch's storage use count), so a live cache, a view of its keys that escaped, or a numpy array over them
keeps the buffer out of reach; results never alias. CPU tensors only; at most `max_bytes` kept (least recently
used first out); a request that does not fit is a plain `new_empty`, as before. Buffers made under
`torch.inference_mode` are handed out only there (torch forbids writing inference tensors elsewhere), and others
only outside it.
"""
from __future__ import annotations

import math
import threading
from contextlib import contextmanager

import torch

__all__ = ["BufferPool", "POOL", "pool_enabled"]

_use_count = getattr(torch._C, "_storage_Use_Count", None)  # private torch API; without it, no pool


def _storage_refs(t: torch.Tensor) -> int:
    return _use_count(t.untyped_storage()._cdata)


class BufferPool:
    """Flat CPU buffers, handed out as contiguous tensors of any shape that fits (`empty`)."""

    def __init__(self, max_bytes: int = 32 << 20):
        self.max_bytes = int(max_bytes)
        self.enabled = _use_count is not None
        self._bufs: list[torch.Tensor] = []  # flat [numel] tensors, least recently handed out first
        self._lock = threading.Lock()
        self._alone: int | None = None  # the storage use count of a tensor nothing else shares

    def empty(self, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """`like.new_empty(shape)` (dtype and device of `like`, no grad), on a kept buffer where one is free."""
        need = math.prod(shape)
        if not self.enabled or like.device.type != "cpu" or need == 0:
            return like.new_empty(shape)
        inference = torch.is_inference_mode_enabled()
        with self._lock:
            if self._alone is None:
                self._alone = _storage_refs(torch.empty(1))
            for i, b in enumerate(self._bufs):
                # at most twice the size asked for: a small request never pins a big buffer
                if (b.dtype == like.dtype and b.is_inference() == inference and need <= b.numel() <= 2 * need
                        and self._free(b)):
                    self._bufs.append(self._bufs.pop(i))
                    return b[:need].view(shape)
            size = need * like.element_size()
            if size > self.max_bytes:
                return like.new_empty(shape)
            kept = sum(b.numel() * b.element_size() for b in self._bufs)
            i = 0
            while kept + size > self.max_bytes and i < len(self._bufs):  # drop unused ones, oldest first
                if self._free(self._bufs[i]):
                    kept -= self._bufs[i].numel() * self._bufs[i].element_size()
                    del self._bufs[i]
                else:
                    i += 1
            if kept + size > self.max_bytes:  # every kept buffer is in use: this one is not kept
                return like.new_empty(shape)
            b = like.new_empty(need)
            self._bufs.append(b)
            return b.view(shape)

    def _free(self, b: torch.Tensor) -> bool:
        return _storage_refs(b) <= self._alone

    def kept_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() * b.element_size() for b in self._bufs)

    def clear(self) -> None:
        """Forget every kept buffer (those in use stay valid: their holders keep them alive)."""
        with self._lock:
            self._bufs.clear()


POOL = BufferPool()


@contextmanager
def pool_enabled(on: bool = True):
    """Switch the engine's buffer pool on or off inside the block (benchmarks and tests compare the two)."""
    before = POOL.enabled
    POOL.enabled = bool(on) and _use_count is not None
    try:
        yield
    finally:
        POOL.enabled = before
