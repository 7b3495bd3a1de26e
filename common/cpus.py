"""CPU facts shared by the benchmarks."""
from __future__ import annotations

import os


def available_cpus() -> int:
    """CPUs this process may run on (its affinity set), the default thread count of the benchmarks."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
