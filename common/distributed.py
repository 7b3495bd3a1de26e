"""Several processes under torchrun, on torch.distributed: this process's place, and gathering rows to rank 0.

One process (no torchrun) is world 1, rank 0, and every helper here is then a no-op. gloo on CPU, nccl on
CUDA; the group is made by the first `Processes.start` of a process and ended by its `end`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


@dataclass
class Processes:
    """This process's place in the run (torchrun's environment; one process without it)."""
    world: int
    rank: int
    device: torch.device
    owner: bool = False  # this object made the process group (and so ends it)

    @classmethod
    def start(cls, device: str = "cpu") -> "Processes":
        world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if device == "cuda" else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        # A caller that made the group already (a test's workers) keeps it: a destroyed and re-made default group
        # on torchrun's store can hang.
        owner = world > 1 and not dist.is_initialized()
        if owner:
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        return cls(world, rank, dev, owner)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, items: list) -> list:
        """This process's share of a list of work items: every world-th item from its rank."""
        return items[self.rank::self.world]

    def gather_rows(self, local: dict[str, np.ndarray], rows: list[int], n: int) -> dict[str, np.ndarray] | None:
        """Every process's `local` {name: array [len(rows), ...]} holding rows `rows` of n -> on rank 0 the full
        {name: [n, ...]}; None on the other ranks. One process: `local` itself (rows must then be all n)."""
        if self.world == 1:
            return local
        parts = [None] * self.world if self.is_main else None
        dist.gather_object((list(rows), local), parts, dst=0)
        if not self.is_main:
            return None
        out = {}
        for name, first in local.items():
            full = np.zeros((n,) + first.shape[1:], dtype=first.dtype)
            for r, arrays in parts:
                full[r] = arrays[name]
            out[name] = full
        return out

    def broadcast(self, obj):
        """Rank 0's `obj` on every process (the same decision everywhere, e.g. which cache entries to use)."""
        if self.world == 1:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def end(self) -> None:
        if self.owner and dist.is_initialized():
            dist.destroy_process_group()
