"""Convert checkpoints of an older astrai (optimizer.pt, scheduler.pt, rng.pt) to the current format.

    python -m astrai.train.legacy CHECKPOINT_DIR [CHECKPOINT_DIR ...]

Resuming never opens those files: they were written with torch.save, a pickle, which can run code.
This converter reads them with `torch.load(weights_only=True)` (torch's restricted unpickler: plain
containers, numbers and tensors; for rng.pt also numpy's uint32 arrays, whose reconstruction
globals are allowed explicitly, nothing else) and writes the safetensors + JSON files that astrai.train.resume
reads (astrai.train.state_files), then removes the .pt files. Run it only on checkpoints you made:
it is safer than unpickling, not a reason to trust a stranger's files. An index-keyed optimizer
state is re-keyed by parameter name from the model that config.json describes (built on the meta
device: no memory, no weights read). The generator state of older checkpoints was rank 0's only:
it becomes rank 0's; other ranks resume with their seeded generators.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from astrai.runtime import atomic_write_text
from astrai.train.resume import LEGACY, STATE, FORMAT, fsync_tree
from astrai.train.state_files import CheckpointError, read_checkpoint_json, write_optimizer, write_rng, write_scheduler


def _load(path: Path, numpy_arrays: bool = False):
    core = getattr(np, "_core", None) or np.core
    allowed = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), core.multiarray._reconstruct] if numpy_arrays else []
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # the restricted unpickler refuses anything else: say so in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: not a plain state file of astrai ({first}); not converted") from None


def _named(directory: Path, optim_sd: dict) -> dict:
    groups = optim_sd.get("param_groups") or []
    if any(isinstance(p, str) for g in groups for p in g["params"]):
        return optim_sd  # an fsdp run's: keyed by name already
    from astrai.model import CausalLM
    from astrai.model.hf_checkpoint import read_config
    from astrai.train.distributed import _rekey_by_name
    from astrai.train.optim import build_optimizer

    with torch.device("meta"):
        model = CausalLM(read_config(directory))
    optimizer = build_optimizer(model, 1e-3, 0.0, (0.9, 0.95), 1e-8)
    return _rekey_by_name(model, optimizer, optim_sd)


def convert(directory: Path) -> list[str]:
    """Convert one checkpoint directory in place; return the files removed."""
    directory = Path(directory)
    if not (directory / STATE).is_file():
        raise CheckpointError(f"{directory}: no {STATE}; not an astrai checkpoint")
    missing = [n for n in LEGACY if not (directory / n).is_file()]
    if missing:
        raise CheckpointError(f"{directory}: no {', '.join(missing)}; nothing to convert")
    optim_sd = _named(directory, _load(directory / "optimizer.pt"))
    scheduler_sd = _load(directory / "scheduler.pt")
    rng = _load(directory / "rng.pt", numpy_arrays=True)
    if not (isinstance(optim_sd, dict) and isinstance(scheduler_sd, dict) and isinstance(rng, dict)):
        raise CheckpointError(f"{directory}: the .pt files do not hold astrai's state dicts; not converted")
    write_optimizer(directory, optim_sd)
    write_scheduler(directory, scheduler_sd)
    write_rng(directory, 0, {**rng, "cuda": rng.get("cuda") or []})
    state = read_checkpoint_json(directory / STATE)
    state.update(format=FORMAT, world=1)
    atomic_write_text(directory / STATE, json.dumps(state, indent=2, sort_keys=True) + "\n")
    fsync_tree(directory)
    for n in LEGACY:
        (directory / n).unlink()
    return list(LEGACY)


def main(argv=None) -> int:
    dirs = list(sys.argv[1:] if argv is None else argv)
    if not dirs:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    status = 0
    for d in dirs:
        try:
            removed = convert(Path(d))
            print(f"{d}: converted ({', '.join(removed)} replaced by safetensors + JSON)")
        except CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
