"""CPU facts shared by the benchmarks and the test runner (the Makefile's worker count, the workers' threads)."""
from __future__ import annotations

import os
from contextlib import contextmanager


def available_cpus() -> int:
    """CPUs this process may run on (its affinity set): the default thread count of the benchmarks, and what `make
    test` splits among its pytest-xdist workers."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# ----- threads for sequential single-token loops ----------------------------------------------------------------
# A loop of one-token steps (the recurrence, cached decoding) runs hundreds of tiny ops per token, each split
# across the OpenMP threads; when another process holds a core, the split op waits for a descheduled worker
# (libgomp spin-waits, then sleeps) and a step costs 10-100x its 1-thread time. Measured on this project's 2-CPU
# machine, tiny-fbt one-token HF steps: 1.8 ms at 1 thread vs 1.8 ms at 2 threads idle, but 3.8 ms vs 128 ms with
# one other busy process. SmolLM2-135M-shaped steps gain from threads on an idle machine (57 -> 34 ms at batch 1,
# 120 -> 64 ms at batch 8, 1 -> 2 threads) and lose 8x under contention (98 vs 814 ms): set the env var to opt in.
SEQUENTIAL_THREADS_ENV = "FBPROBE_SEQUENTIAL_THREADS"
SEQUENTIAL_THREADS_DEFAULT = 1


def sequential_thread_count() -> int | None:
    """Intra-op threads for sequential single-token loops: $FBPROBE_SEQUENTIAL_THREADS if set (0 = leave torch's
    count as it is, returned as None), else SEQUENTIAL_THREADS_DEFAULT (1)."""
    from common.errors import UserError

    raw = os.environ.get(SEQUENTIAL_THREADS_ENV, "").strip()
    if not raw:
        return SEQUENTIAL_THREADS_DEFAULT
    try:
        n = int(raw, 10)
    except ValueError:
        n = -1
    if n < 0:
        raise UserError(f"{SEQUENTIAL_THREADS_ENV} must be an integer >= 0 (0 = leave the thread count), got {raw!r}")
    return n or None


@contextmanager
def sequential_threads(n: int | None = None):
    """Run the body with `n` torch intra-op threads (default: `sequential_thread_count()`), then restore the
    previous count, also on an exception. Yields the count in effect. For loops of single-token steps only
    (the parallel prefill keeps every thread); torch's thread count is process-wide, so do not use it around
    work that other Python threads run at the same time. Switching costs well under a microsecond."""
    import torch

    if n is None:
        n = sequential_thread_count()
    if n is not None and n < 1:
        raise ValueError(f"sequential_threads: n must be >= 1 or None, got {n!r}")
    old = torch.get_num_threads()
    if n is None or n == old:
        yield old
        return
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(old)
