"""Data parallel plumbing: torchrun environment -> process group, DDP or FSDP2 wrap, sums across ranks.

One process (no WORLD_SIZE in the environment) needs no process group at all, and `parallel`
changes nothing there; under torchrun, gloo on CPU and nccl on CUDA. Every rank computes.

- ddp (default): DistributedDataParallel replicates the model; the model, its gradients and the
  AdamW state must fit one device. Gradients are all-reduced (averaged) on the last micro-batch.
- fsdp: FSDP2 (`torch.distributed.fsdp.fully_shard`) per decoder layer, then the root (embedding,
  final norm, LM head; a tied head shares the embedding's shard). Parameters, gradients and AdamW
  state are sharded over the ranks; a layer's weights are all-gathered for its forward and
  backward, gradients are reduce-scattered (averaged, like DDP) on the last micro-batch only
  (`set_requires_gradient_sync(False)` on the others is FSDP2's no_sync), so the trainer's step
  normaliser is the same for both. Rank 0's weights are broadcast before sharding, as DDP does.
  Clipping runs on the DTensor gradients and gives the unsharded norm.

Checkpoints stay what transformers loads: under fsdp every rank takes part in gathering the FULL
model and optimizer state (torch.distributed.checkpoint.state_dict, full_state_dict + CPU
offload, so only rank 0 holds it), rank 0 writes it, and the others wait at a barrier until it is
on disk. Resume reads the full state on every rank and loads it into the shards. The saved
optimizer state is keyed by parameter name in every mode (`named_optimizer_state`), so it loads
into either mode; an index-keyed state (torch's own) is re-keyed on load. Only rank 0 writes files
(checkpoints, metrics), except that every rank writes its own generator state into a checkpoint.

Tested on CPU with gloo, 2 processes (tests/train/test_fsdp.py, test_run.py): fsdp gives the losses,
gradient norms and validation loss of 1 process with the doubled batch (sft with tied embeddings;
dpo and grpo through `astrai train`), MoE equals DDP, no gradient is reduced before the last
micro-batch, gradient checkpointing changes nothing, the checkpoint equals the 1-process one and
loads in transformers, a run killed after a checkpoint resumes bitwise, and checkpoints move
between fsdp and one process. By hand on CPU only (not in the suite): compile with fsdp (the same
losses; ~40 s of compiling), bfloat16 with fsdp (losses within 1e-3 of 1 process in bfloat16; no
mixed-precision policy is offered: parameters, gradients and reductions are all in `dtype`).
NOT tested (no GPU here): nccl. The whole model is still built on every rank before sharding
(no meta-device init), so fsdp shards the training state (gradients, AdamW moments, one layer's
gathered weights at a time), not the initial load.
Under fsdp every forward and every save is collective, so: a stop signal is agreed by all ranks
at one step before anyone saves (tested with SIGTERM to one rank); an error raised on one rank
writes no checkpoint (the others cannot join the gather); validation runs the same number of
forwards on every rank, padding with a discarded batch, and `reshard` frees the root's weights
after forwards without backward. A DPO/GRPO reference model is replicated, not sharded.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

PARALLEL = ("ddp", "fsdp")


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


def barrier(d: Dist):
    if d.active:
        dist.barrier()


def finish(d: Dist):
    """The last call before teardown on the normal path (never on an error path: the other ranks may
    never arrive): every rank has finished, and gloo's worker threads get the GIL to free their
    last work. Seen here without it (torch 2.13, gloo, DDP, about one run in 4 under load, also on
    main): the rank that finished first freed the DDP reducer with the GIL held; that destroyed the
    process group, whose destructor joined a gloo thread that was waiting for the GIL to free a
    finished all_reduce's tensors: a deadlock at exit. gloo runs collectives on 2 threads, so the
    barrier alone does not close the window (still seen once in 8 runs); releasing the GIL for a
    moment after it does in practice, without a guarantee."""
    if d.active:
        dist.barrier()
        time.sleep(0.2)  # releases the GIL


def wrap(model: torch.nn.Module, d: Dist, parallel: str = "ddp") -> torch.nn.Module:
    """The module the trainer calls: the model itself (one process), DDP(model), or the model
    sharded in place by FSDP2 (then it is also the module the optimizer must be built from)."""
    if parallel not in PARALLEL:
        raise ValueError(f"parallel {parallel!r}: choose one of {', '.join(PARALLEL)}")
    if not d.active:
        return model
    if parallel == "fsdp":
        return shard(model)
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None, broadcast_buffers=False)


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2: one unit per decoder layer, then the root (embedding, norm, head) for the rest."""
    from torch.distributed.fsdp import fully_shard

    with torch.no_grad():  # every rank starts from rank 0's weights, as DDP guarantees
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t, src=0)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def reshard(model: torch.nn.Module):
    """Free the gathered weights a forward without backward leaves behind: FSDP2 keeps the root's
    (embedding, head) unsharded after its forward, expecting the backward to reshard them, which
    validation and GRPO's old-policy pass never run."""
    if is_sharded(model):
        model.reshard()


@contextmanager
def gradient_sync(model: torch.nn.Module, d: Dist, sync: bool):
    """Around one micro-batch's backward: gradients are reduced across ranks only when `sync`
    (the last micro-batch of an optimizer step); the others accumulate locally."""
    if sync or not d.active:
        yield
    elif is_sharded(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        with model.no_sync():
            yield


def _full_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_model_state(model: torch.nn.Module, trainable_only: bool = False) -> dict:
    """The unsharded model state dict (`trainable_only`: only the parameters that train, e.g. LoRA
    adapters). Collective under fsdp: every rank must call it; rank 0 gets the tensors (on CPU),
    the others an empty dict. The plain state dict otherwise."""
    if not is_sharded(model):
        sd = model.state_dict()
        if trainable_only:
            train = {n for n, p in model.named_parameters() if p.requires_grad}
            sd = {k: v for k, v in sd.items() if k in train}
        return sd
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_full_options(cpu_offload=True, ignore_frozen_params=trainable_only))


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its name (a tied weight under its first name, as named_parameters gives it)."""
    return {id(p): n for n, p in model.named_parameters()}


def named_optimizer_state(model: torch.nn.Module, optimizer) -> dict:
    """The unsharded optimizer state keyed by parameter name; collective like full_model_state
    (rank 0 gets the tensors when sharded)."""
    if not is_sharded(model):
        return _rekey_by_name(model, optimizer, optimizer.state_dict())
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_full_options(cpu_offload=True))


def load_full_state(model: torch.nn.Module, optimizer, model_sd: dict, optim_sd: dict, strict: bool = True):
    """Load full (unsharded) state into the model and optimizer, sharded or not. Each rank passes
    the whole state (every rank reads the checkpoint). An optimizer state keyed by index (written
    without fsdp) is re-keyed by parameter name, so checkpoints move between ddp and fsdp.
    `strict=False`: `model_sd` holds only some tensors (LoRA adapters; the rest stays as it is)."""
    if not is_sharded(model):
        missing = set(model_sd) - set(model.state_dict())
        if missing:
            raise ValueError(f"checkpoint tensors {sorted(missing)[:3]} are not in this model")
        model.load_state_dict(model_sd, strict=strict)
        if _keyed_by_name(optim_sd):
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            set_optimizer_state_dict(model, optimizer, optim_sd, options=_full_options())
        else:
            optimizer.load_state_dict(optim_sd)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(model, model_sd, options=_full_options(strict=strict))
    if not _keyed_by_name(optim_sd):
        optim_sd = _rekey_by_name(model, optimizer, optim_sd)
    set_optimizer_state_dict(model, optimizer, optim_sd, options=_full_options())


def _keyed_by_name(optim_sd: dict) -> bool:
    groups = optim_sd.get("param_groups", [])
    return any(isinstance(p, str) for g in groups for p in g["params"])


def _rekey_by_name(model, optimizer, optim_sd: dict) -> dict:
    """Index-keyed optimizer state -> name-keyed: the saved groups list their parameters in the
    order this optimizer was built (build_optimizer walks named_parameters the same way)."""
    names = parameter_names(model)
    state, groups = {}, []
    for saved, live in zip(optim_sd["param_groups"], optimizer.param_groups):
        if len(saved["params"]) != len(live["params"]):
            raise ValueError("optimizer state does not match this model's parameter groups")
        fqns = [names[id(p)] for p in live["params"]]
        for idx, fqn in zip(saved["params"], fqns):
            if idx in optim_sd["state"]:
                state[fqn] = optim_sd["state"][idx]
        groups.append({**saved, "params": fqns})
    return {"state": state, "param_groups": groups}
