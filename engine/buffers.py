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


class _Kept:
    """One kept buffer with what the hand-out checks read, as plain attributes (the scan runs per cache layer)."""

    __slots__ = ("numel", "dtype", "inference", "nbytes", "buf", "storage", "cdata", "alone")

    def __init__(self, buf: torch.Tensor):
        self.numel, self.dtype, self.inference = buf.numel(), buf.dtype, buf.is_inference()
        self.nbytes = self.numel * buf.element_size()
        self.buf, self.storage = buf, buf.untyped_storage()  # holding the storage object: no new one per check
        self.cdata = self.storage._cdata
        self.alone = _use_count(self.cdata)  # the count while only the pool holds it

    def free(self) -> bool:
        return _use_count(self.cdata) <= self.alone


class BufferPool:
    """Flat CPU buffers, handed out as contiguous tensors of any shape that fits (`empty`)."""

    def __init__(self, max_bytes: int = 32 << 20, max_buffers: int = 256):
        self.max_bytes, self.max_buffers = int(max_bytes), int(max_buffers)
        self.enabled = _use_count is not None
        self._kept: list[_Kept] = []  # least recently handed out first: after a cache dies, its buffers lead
        self._bytes = 0
        self._lock = threading.Lock()

    def empty(self, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """`like.new_empty(shape)` (dtype and device of `like`, no grad), on a kept buffer where one is free."""
        need = math.prod(shape)
        if not self.enabled or like.device.type != "cpu" or need == 0:
            return like.new_empty(shape)
        dtype, inference = like.dtype, torch.is_inference_mode_enabled()
        with self._lock:
            for i, k in enumerate(self._kept):
                # at most twice the size asked for: a small request never pins a big buffer
                if need <= k.numel <= 2 * need and k.dtype == dtype and k.inference == inference and k.free():
                    self._kept.append(self._kept.pop(i))
                    return k.buf[:need].view(shape)
            size = need * like.element_size()
            if size > self.max_bytes:
                return like.new_empty(shape)
            i = 0  # make room: drop kept buffers nothing holds, least recently handed out first
            while (self._bytes + size > self.max_bytes or len(self._kept) >= self.max_buffers) \
                    and i < len(self._kept):
                if self._kept[i].free():
                    self._bytes -= self._kept.pop(i).nbytes
                else:
                    i += 1
            if self._bytes + size > self.max_bytes or len(self._kept) >= self.max_buffers:
                return like.new_empty(shape)  # every kept buffer is in use: this one is not kept
            k = _Kept(like.new_empty(need))
            self._kept.append(k)
            self._bytes += k.nbytes
            return k.buf.view(shape)

    def kept_bytes(self) -> int:
        return self._bytes

    def clear(self) -> None:
        """Forget every kept buffer (those in use stay valid: their holders keep them alive)."""
        with self._lock:
            self._kept.clear()
            self._bytes = 0


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
