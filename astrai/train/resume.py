"""Trainer checkpoints: everything an exact resume needs, written atomically, read without pickle.

A checkpoint is a directory `checkpoints/step-00000040/` holding
  config.json + model.safetensors  (a Hugging Face model: transformers loads it as is), or with LoRA
                                   only the adapters (adapter_config.json + adapter_model.safetensors,
                                   PEFT's format; the frozen base is the run's `model`, not copied)
  tokenizer files of the data      (so `astrai generate` needs nothing else)
  optimizer.safetensors/.json, scheduler.json, rng-rank<R>.safetensors/.json
                                   (astrai.train.state_files: tensors in safetensors, the rest in
                                   JSON; every rank's own generators)
  trainer_state.json               (step, epoch, position in the epoch = the sampler state, world
                                   size, options); written last: it marks the directory complete
Writing: every rank writes its generator files into `.step-00000040.tmp`, rank 0 the rest; then
rank 0 fsyncs every file and the directory and renames it into place. A kill during a save leaves a
hidden temporary directory (ignored, removed by the next save), never a directory that looks
complete. Saving a step that exists already moves the old directory aside, renames the new one in,
fsyncs, and only then deletes the old one (a kill in between leaves `.step-N.replaced`, which
`latest` still finds and the next save puts back). Nothing with non-finite weights is ever saved
(the trainer checks before calling `save`), so `prune` only ever removes a finite checkpoint in
favour of a newer finite one.

Reading (`load`) opens only the files above. A pickle container in the directory (optimizer.pt of
an older astrai, or any *.pt/*.bin/*.pkl planted there) is never opened: loading stops with one line
saying what to do (`python -m astrai.train.legacy DIR` converts our old format).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

import torch

from astrai.model.adapter_files import read_weights, save_weights
from astrai.runtime import fsync_dir, open_nofollow, refuse_link
from astrai.train.output import clear_tmp, foreign, only_ours, remove_ours
from astrai.train.resume_checks import STATE, STEP_NAME as _STEP, check_counters
from astrai.train.distributed import Dist, barrier, load_full_state, parameter_names
from astrai.train.state_files import (CheckpointError, pickle_files, read_checkpoint_json, read_optimizer, read_rng,
                                      read_scheduler, rng_files, write_optimizer, write_rng, write_scheduler)

FORMAT = 2  # 1: the torch.save (pickle) files of older astrai
_INTS = ("global_step", "epoch", "step_in_epoch", "consumed_rows", "saved_step")
LEGACY = ("optimizer.pt", "scheduler.pt", "rng.pt")


def _name(step: int) -> str:
    return f"step-{step:08d}"


def fsync_tree(path: Path):
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(path)


def save(root: Path, step: int, model, optimizer_state: dict, scheduler, state: dict, dist: Optional[Dist] = None,
         write_tokenizer=None, model_sd: Optional[dict] = None, keep: Optional[int] = None) -> Path:
    """Collective under torchrun: every rank calls it (each writes its own generator state).
    `optimizer_state`: keyed by parameter name (distributed.named_optimizer_state), needed on rank 0;
    `model_sd`: the full model state when it was gathered from a sharded model. `keep`: prune to the
    newest `keep` checkpoints once this one is in place."""
    d = dist or Dist()
    root = Path(root)
    final = root / _name(step)
    tmp = root / f".{final.name}.tmp"
    if d.is_main:
        refuse_link(root, directory=True)  # checkpoints/ planted as a link elsewhere
        root.mkdir(parents=True, exist_ok=True)
        _recover(root)
        for stale in root.glob(".step-*.tmp*"):  # (older astrai added its pid)
            clear_tmp(stale)
        tmp.mkdir()
    barrier(d)
    write_rng(tmp, d.rank)  # every rank: its own generators
    for name in rng_files(d.rank):
        with open(tmp / name, "rb") as fh:
            os.fsync(fh.fileno())
    if d.is_main:
        save_weights(model, tmp, model_sd)  # the model, or only its LoRA adapters
        if write_tokenizer is not None:
            write_tokenizer(tmp)
        write_optimizer(tmp, optimizer_state)
        write_scheduler(tmp, scheduler.state_dict())
    barrier(d)
    if d.is_main:
        missing = [r for r in range(d.world) if not all((tmp / n).exists() for n in rng_files(r))]
        if missing:
            raise CheckpointError(f"{tmp}: rank(s) {missing} wrote no generator state (is {root} on storage "
                                  f"every rank sees?)")
        with open_nofollow(tmp / STATE, "x") as fh:
            fh.write(json.dumps({**state, "format": FORMAT, "world": d.world}, indent=2, sort_keys=True) + "\n")
        fsync_tree(tmp)
        replace_dir(tmp, final)
        if keep:
            prune(root, keep, step)
    barrier(d)  # no rank goes on before the checkpoint is on disk
    return final


def replace_dir(tmp: Path, final: Path):
    """Rename `tmp` to `final`; an existing `final` stays complete on disk until the new one is in place,
    and is replaced only when all it holds is astrai's (astrai.train.output.only_ours)."""
    root = final.parent
    if final.exists() or final.is_symlink():
        only_ours(final, f"{final.name} is replaced by a new one")
        aside = root / f".{final.name}.replaced"
        _drop_aside(aside)
        os.replace(final, aside)
        os.replace(tmp, final)
        fsync_dir(root)
        shutil.rmtree(aside)
    else:
        os.replace(tmp, final)
    fsync_dir(root)


def _drop_aside(aside: Path):
    if aside.is_symlink():
        aside.unlink()
    elif aside.exists():
        remove_ours(aside, f"{aside.name} is the copy a re-save put aside")


def _recover(root: Path):
    """A save killed between its two renames left the finished directory aside: put it back."""
    for aside in root.glob(".step-*.replaced"):
        final = root / aside.name[1:-len(".replaced")]
        if not final.exists() and not aside.is_symlink() and _state_file(aside):
            os.replace(aside, final)
        else:
            _drop_aside(aside)
    fsync_dir(root)


def _state_file(directory: Path) -> bool:
    """A real directory (not a link) holding a trainer_state.json that is a regular file (not a link)."""
    return (not directory.is_symlink() and directory.is_dir() and not (directory / STATE).is_symlink()
            and (directory / STATE).is_file())


def _finished(root: Path) -> dict[int, Path]:
    """step -> directory of every complete checkpoint (one moved aside by an interrupted re-save too):
    real directories named by our rule whose state file is a regular file; a link is none."""
    out: dict[int, Path] = {}
    if not Path(root).is_dir() or Path(root).is_symlink():
        return out
    for p in Path(root).iterdir():
        m = _STEP.fullmatch(p.name)
        if m and _state_file(p) and (p.name.startswith("step-") or m.group(2)):
            step = int(m.group(1))
            if step not in out or p.name.startswith("step-"):
                out[step] = p
    return out


def latest(root: Path) -> Optional[Path]:
    done = _finished(root)
    return done[max(done)] if done else None


def prune(root: Path, keep: int, step: int):
    """Keep the newest `keep` checkpoints up to `step` (the one just saved): a checkpoint of a higher
    step is never deleted, nor one holding a file astrai did not write (it stays, and says why)."""
    done = _finished(root)
    for s in sorted(s for s in done if s <= step)[:-keep]:
        found = foreign(done[s])
        if found:
            print(f"astrai train: keep_last left {done[s]} in place: it holds {found[0]}, which astrai did not "
                  f"write", file=sys.stderr, flush=True)
            continue
        shutil.rmtree(done[s])
    fsync_dir(Path(root))


def refuse_pickles(path: Path):
    """Stop before reading anything from a checkpoint that holds pickle containers."""
    found = pickle_files(path)
    if not found:
        return
    if set(found) & set(LEGACY) and not (path / "optimizer.json").exists():
        raise CheckpointError(f"{path}: training state in the pickle format of an older astrai ({', '.join(found)}), "
                              f"which resuming never opens; convert it with `python -m astrai.train.legacy {path}` "
                              f"(reads it with torch.load(weights_only=True)), or delete {path} to resume from "
                              f"an earlier checkpoint")
    raise CheckpointError(f"{path}: holds {', '.join(found)}, a pickle file astrai never opens (it could run code); "
                          f"remove it to resume from this checkpoint")


def read_state(path: Path) -> dict:
    saved = read_checkpoint_json(path / STATE)
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path / STATE}: not a JSON object")
    for k in _INTS:
        v = saved.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise CheckpointError(f"{path / STATE}: {k} is {v!r}, not a non-negative integer; the file was edited or "
                                  f"damaged: delete {path} to resume from an earlier checkpoint")
    return saved


# options a continued run may change without changing what was trained so far
_FREE_OPTIONS = frozenset({"output", "resume", "progress", "max_steps", "epochs", "log_every", "eval_every",
                           "save_every", "keep_last", "report_to", "device", "return_freed_memory"})


def changed_options(saved: dict, now: dict) -> list[str]:
    """`key old -> new` for each option of the run being resumed that differs from the one that wrote
    the checkpoint (paths compared resolved), leaving out those a continued run may change."""
    before = saved.get("options")
    if not isinstance(before, dict):
        return []
    out = []
    for key in sorted(set(before) | set(now)):
        if key in _FREE_OPTIONS:
            continue
        a, b = before.get(key), now.get(key)
        if isinstance(a, str) and isinstance(b, str) and a != b and Path(a).exists() and Path(b).exists():
            if Path(a).resolve() == Path(b).resolve():
                continue
        if a != b:
            out.append(f"{key} {json.dumps(a)} -> {json.dumps(b)}")
    return out


def load(path: Path, model, optimizer, scheduler, dist: Optional[Dist] = None, order=None) -> dict:
    """Restore model weights (in place: the optimizer keeps its parameters; into the shards of an
    fsdp model), optimizer, scheduler and this rank's generators. Every rank reads the full files.
    Every counter is checked first (check_counters, against `order`: this run's resume_checks.DataOrder),
    the optimizer and scheduler state by their readers; the hyperparameters then follow the options
    (follow_options)."""
    d = dist or Dist()
    path = Path(path)
    refuse_pickles(path)
    saved = read_state(path)
    check_counters(path, saved, d.world, order, d.is_main)
    steps = saved["global_step"] - saved.get("skipped_nonfinite", 0)  # the optimizer steps taken
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    try:
        sd, complete = read_weights(path, model)  # the whole model, or a LoRA run's adapters
    except Exception as e:  # a truncated or foreign model file: one line, whatever safetensors raised
        raise CheckpointError(f"{path}: cannot read the weights ({e})") from None
    current = model.state_dict()
    odd = sorted((set(sd) ^ set(current)) if complete else (set(sd) - set(current)))
    odd = odd or [k for k in sd if tuple(sd[k].shape) != tuple(current[k].shape)]
    if odd:
        raise CheckpointError(f"{path}: its weights do not fit this model ({odd[0]}"
                              f"{' and more' if len(odd) > 1 else ''}); resume needs the same model shape")
    if not all(bool(torch.isfinite(t).all()) for t in sd.values() if t.is_floating_point()):
        raise CheckpointError(f"{path}: holds non-finite weights; delete it to resume from an earlier checkpoint")
    names = parameter_names(model)
    live = [{**g, "params": [names[id(p)] for p in g["params"]]} for g in optimizer.param_groups]
    shapes = {n: p.shape for n, p in model.named_parameters()}
    optim_sd = read_optimizer(path, live, shapes, steps)
    load_full_state(model, optimizer, {k: v.to(current[k].dtype) for k, v in sd.items()}, optim_sd, strict=complete)
    read_scheduler(path, scheduler, steps)
    for i, (base, g) in enumerate(zip(scheduler.base_lrs, optimizer.param_groups)):  # the two files agree
        if "initial_lr" in g and not math.isclose(base, g["initial_lr"], rel_tol=1e-9):
            raise CheckpointError(f"{path / 'scheduler.json'}: base_lrs[{i}] is {base!r}, but optimizer.json's "
                                  f"param_groups[{i}].initial_lr is {g['initial_lr']!r}; the file was edited: delete "
                                  f"{path} to resume from an earlier checkpoint")
    follow_options(optimizer, scheduler, fresh)
    if all((path / n).exists() for n in rng_files(d.rank)):
        read_rng(path, d.rank)
    # else: a rank the saving run did not have (check_counters allowed it and said so): this run's seeding
    return saved


def follow_options(optimizer, scheduler, fresh: list[dict]):
    """The hyperparameters of this run's options (`fresh`: the param groups as built from them) over
    the saved ones, and the learning rate the options' schedule gives at the restored step: a resume
    with unchanged options gets the saved values exactly, one with a lowered lr continues on it."""
    for g, f in zip(optimizer.param_groups, fresh):
        g.update({k: v for k, v in f.items() if k != "lr"})
    scheduler.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
    for g, lam, base in zip(optimizer.param_groups, scheduler.lr_lambdas, scheduler.base_lrs):
        g["lr"] = base * lam(scheduler.last_epoch)  # as LambdaLR computes it
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
