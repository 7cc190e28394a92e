"""Trainer checkpoints: everything an exact resume needs, written atomically.

A checkpoint is a directory `checkpoints/step-00000040/` holding
  config.json + model.safetensors  (a Hugging Face model: transformers loads it as is), or with LoRA
                                   only the adapters (adapter_config.json + adapter_model.safetensors,
                                   PEFT's format; the frozen base is the run's `model`, not copied)
  tokenizer files of the data      (so `astrai generate` needs nothing else)
  optimizer.pt, scheduler.pt       (torch state dicts; an fsdp run's optimizer.pt is the full state
                                   keyed by parameter name: astrai.train.distributed)
  rng.pt                           (python, numpy, torch CPU and CUDA generator states)
  trainer_state.json               (step, epoch, position in the epoch = the sampler state, options)
It is written under `.step-00000040.tmp-<pid>` and renamed when complete: a kill during a save
leaves a hidden temporary directory (ignored, removed by the next save), never a directory that
looks complete. `latest(root)` only considers finished directories.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from astrai.model.adapter_files import read_weights, save_weights
from astrai.train.distributed import load_full_state

STATE = "trainer_state.json"


def rng_state() -> dict:
    s = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict):
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def _name(step: int) -> str:
    return f"step-{step:08d}"


def save(root: Path, step: int, model, optimizer, scheduler, state: dict,
         write_tokenizer=None, model_sd: Optional[dict] = None, optim_sd: Optional[dict] = None) -> Path:
    """`model_sd`/`optim_sd`: the full state dicts when they were gathered from a sharded model
    (distributed.full_model_state, full_optimizer_state); by default the model's and optimizer's own."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".step-*.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / _name(step)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    save_weights(model, tmp, model_sd)  # the model, or only its LoRA adapters
    if write_tokenizer is not None:
        write_tokenizer(tmp)
    torch.save(optimizer.state_dict() if optim_sd is None else optim_sd, tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / STATE).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")  # last: marks completeness
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():  # the same step saved again (e.g. at the end right after a periodic save)
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def latest(root: Path) -> Optional[Path]:
    done = sorted(p for p in Path(root).glob("step-*") if (p / STATE).exists()) if Path(root).exists() else []
    return done[-1] if done else None


def prune(root: Path, keep: int):
    done = sorted(p for p in Path(root).glob("step-*") if (p / STATE).exists())
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load(path: Path, model, optimizer, scheduler) -> dict:
    """Restore model weights (in place: the optimizer keeps its parameters; into the shards of an
    fsdp model), optimizer, scheduler, RNG. Every rank reads the full files."""
    path = Path(path)
    sd, complete = read_weights(path, model)
    current = model.state_dict()
    load_full_state(model, optimizer, {k: v.to(current[k].dtype) for k, v in sd.items()},
                    torch.load(path / "optimizer.pt", weights_only=False), strict=complete)
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return json.loads((path / STATE).read_text())
