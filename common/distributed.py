"""Several processes under torchrun, on torch.distributed: this process's place, and gathering rows to rank 0.

One process (no torchrun) is world 1, rank 0, and every helper here is then a no-op. gloo on CPU, nccl on
CUDA; the group is made by the first `Processes.start` of a process and ended by its `end`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from common.errors import UserError

# Rank 0 alone scores, evaluates and saves while the others wait in the next collective: gloo's 30-minute default
# would stop them in a long scoring or save. A process that fails ends the run through torchrun, not this wait.
GROUP_TIMEOUT = timedelta(hours=12)


def env_place() -> tuple[int, int, int]:
    """(world, rank, local_rank) from torchrun's environment, checked: one process without it. Refuses in one line
    what torchrun never sets (a rank with no world size, a rank outside the world, a value that is no integer)."""
    def read(name):
        v = os.environ.get(name)
        if v is None or not v.strip():
            return None
        try:
            return int(v)
        except ValueError:
            raise BadEnvironment(f"{name}={v!r} is not an integer (torchrun sets it; unset it to run one "
                                 "process)") from None

    world, rank, local = read("WORLD_SIZE"), read("RANK"), read("LOCAL_RANK")
    if world is None:
        if rank not in (None, 0) or local not in (None, 0):
            raise BadEnvironment(f"RANK / LOCAL_RANK set ({rank} / {local}) without WORLD_SIZE: start several "
                                 "processes with torchrun, or unset them to run one")
        return 1, 0, 0
    if world < 1 or rank is None and world > 1 or rank is not None and not 0 <= rank < world:
        raise BadEnvironment(f"WORLD_SIZE={world} with RANK={rank}: start several processes with torchrun (it "
                             "sets both), or unset them to run one")
    rank = rank or 0
    local = rank if local is None else local
    if local < 0:
        raise BadEnvironment(f"LOCAL_RANK={local} is negative (torchrun sets it)")
    return world, rank, local


@dataclass
class Processes:
    """This process's place in the run (torchrun's environment; one process without it)."""
    world: int
    rank: int
    device: torch.device
    owner: bool = False  # this object made the process group (and so ends it)

    @classmethod
    def start(cls, device: str = "cpu") -> "Processes":
        world, rank, local = env_place()
        dev = torch.device("cuda", local) if device == "cuda" else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        # A caller that made the group already (a test's workers) keeps it: a destroyed and re-made default group
        # on torchrun's store can hang.
        owner = world > 1 and not dist.is_initialized()
        if owner:
            missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
            if missing:
                raise UserError(f"WORLD_SIZE={world} without {' and '.join(missing)}: start several processes with "
                                "torchrun (it sets them)")
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=GROUP_TIMEOUT)
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

    def together(self, step) -> None:
        """Run `step()` (taking a lock, checking a folder: what rank 0 alone does) on rank 0 and tell every process
        its outcome: a refusal there is raised on every rank (said once, by rank 0), where the others would
        otherwise wait in the next collective until rank 0's exit breaks it with a traceback."""
        if self.world == 1:
            step()
            return
        refusal = None
        if self.is_main:
            try:
                step()
            except UserError as e:
                refusal = str(e)
        refusal = self.broadcast(refusal)
        if refusal is not None:
            raise UserError(refusal) if self.is_main else SaidElsewhere(refusal)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def end(self) -> None:
        if self.owner and dist.is_initialized():
            dist.destroy_process_group()


class BadEnvironment(UserError):
    """torchrun's variables, inconsistent in this process: said here (no other process may see the same)."""
    said_here = True


class SaidElsewhere(UserError):
    """A refusal another process (rank 0) prints: this one exits with the same code, silently."""
    said_elsewhere = True
