"""Data parallel plumbing: torchrun environment -> process group, DDP wrap, sums across ranks.

One process (no WORLD_SIZE in the environment) needs no process group at all; under torchrun,
gloo on CPU and nccl on CUDA. Only rank 0 writes files (checkpoints, metrics); every rank computes.
FSDP2 is not wired (see the README): DDP replicates the model, so it must fit one device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


def setup(device: str = "auto") -> Dist:
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return Dist(rank, world, local, dev)


def teardown(d: Dist):
    if d.active and dist.is_initialized():
        dist.destroy_process_group()


def all_sum(values: list[float], d: Dist) -> list[float]:
    """Sum a few scalars over ranks in one collective (float64 so counts stay exact)."""
    if not d.active:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=d.device if d.device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return t.tolist()


def wrap(model: torch.nn.Module, d: Dist) -> torch.nn.Module:
    if not d.active:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None, broadcast_buffers=False)
