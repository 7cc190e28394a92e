"""Training state on disk in formats that cannot run code: tensors in safetensors, the rest in JSON.

    optimizer.safetensors   AdamW tensors (exp_avg, exp_avg_sq, step), key "<parameter name>/<field>"
    optimizer.json          param groups (hyperparameters, the names of their parameters) and any
                            non-tensor per-parameter value
    scheduler.json          the LR scheduler's counters (last_epoch, base_lrs, ...); the schedule's
                            shape is not stored: it comes from the options, so a run whose max_steps
                            grew continues on the longer schedule
    rng-rank<R>.safetensors each rank's torch CPU (and CUDA) generator and numpy MT19937 key
    rng-rank<R>.json        each rank's python `random` state and numpy's position/gauss cache

The optimizer state is keyed by parameter name, whatever the parallel mode (an fsdp run gathers
it by name, a plain run is re-keyed from torch's indices): a checkpoint moves between one process,
DDP and FSDP, and a state that covers only some parameters (the trainable ones) says which.

Readers open only these files, never unpickle, and check what they read (types, names, shapes)
against the live optimizer/scheduler before loading it; anything else is a CheckpointError with one
line that names the file. `pickle_files(dir)` lists the files a loader must refuse to go near.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from astrai import json_bounded
from astrai.errors import InputError
from astrai.runtime import atomic_write_text, fresh_tmp, fsync_replace

OPTIMIZER_TENSORS, OPTIMIZER_JSON, SCHEDULER_JSON = "optimizer.safetensors", "optimizer.json", "scheduler.json"
FORMAT = 1
MAX_JSON_BYTES = 64 << 20  # optimizer.json of a large model is some hundred KB
# suffixes of pickle containers (torch.save, pickle, joblib, pytorch_model.bin): never opened
PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".bin", ".ckpt", ".joblib", ".dill")


class CheckpointError(InputError):
    """A checkpoint that cannot be resumed from, with the file and the reason in one line."""


def rng_files(rank: int) -> tuple[str, str]:
    return f"rng-rank{rank}.safetensors", f"rng-rank{rank}.json"


def pickle_files(directory: Path) -> list[str]:
    return sorted(p.name for p in Path(directory).iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)


def _dump_json(path: Path, data: dict):
    atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True, allow_nan=True) + "\n")


def _save_tensors(path: Path, tensors: dict, metadata: dict):
    tmp = fresh_tmp(path)  # never through a link at the name (legacy conversion writes into an existing dir)
    save_file(tensors, str(tmp), metadata=metadata)
    fsync_replace(tmp, path)


def _regular(path: Path):
    """Only regular files are opened (a FIFO or a device named like a state file would block or
    stream forever)."""
    if path.exists() and not path.is_file():
        raise CheckpointError(f"{path}: not a regular file; the checkpoint is damaged (delete it to resume "
                              f"from an earlier one)")


def read_checkpoint_json(path: Path) -> dict:
    """A JSON file of a checkpoint (bounded size and nesting: astrai.json_bounded)."""
    if not path.exists():
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete (delete it to resume from an "
                              f"earlier one)")
    return json_bounded.read_json(path, "training-state file", MAX_JSON_BYTES, error=CheckpointError)


def _read_json(path: Path) -> dict:
    data = read_checkpoint_json(path)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an astrai training-state file of format {FORMAT}")
    return data


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    _regular(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def _plain(value, where: str):
    """A JSON-able hyperparameter (tuples become lists); anything else is refused when writing."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [_plain(v, where) for v in value]
    if torch.is_tensor(value) and value.numel() == 1:
        return value.item()
    raise TypeError(f"{where}: cannot store {type(value).__name__} in JSON")


def _like(saved, live, where: str, path: Path):
    """`saved` (from JSON) in the type of the live value it replaces: a tuple stays a tuple, a float a
    float; a value of another kind is refused (a hand-edited or foreign file)."""
    if isinstance(live, bool) or live is None or isinstance(live, str):
        ok = type(saved) is type(live) or live is None and (saved is None or isinstance(saved, (int, float, bool)))
        if not ok:
            raise CheckpointError(f"{path}: {where} is {saved!r}, expected a {type(live).__name__}")
        return saved
    if isinstance(live, (int, float)):
        whole = isinstance(live, int)
        if isinstance(saved, bool) or not isinstance(saved, (int, float)) or whole and not float(saved).is_integer():
            raise CheckpointError(f"{path}: {where} is {saved!r}, expected {'an integer' if whole else 'a number'}")
        return type(live)(saved)
    if isinstance(live, (tuple, list)):
        if not isinstance(saved, list) or len(saved) != len(live):
            raise CheckpointError(f"{path}: {where} is {saved!r}, expected {len(live)} values")
        return type(live)(_like(s, v, f"{where}[{i}]", path) for i, (s, v) in enumerate(zip(saved, live)))
    raise CheckpointError(f"{path}: {where}: a value of type {type(live).__name__} cannot be restored")


# ---- optimizer --------------------------------------------------------------------------------


def write_optimizer(directory: Path, state: dict):
    """`state`: a name-keyed optimizer state dict ({"state": {name: {field: value}}, "param_groups":
    [{..., "params": [name, ...]}]}), as distributed.named_optimizer_state gives it."""
    tensors, values = {}, {}
    for name, fields in state["state"].items():
        for field, v in fields.items():
            if torch.is_tensor(v):
                tensors[f"{name}/{field}"] = v.detach().to("cpu").contiguous()
            else:
                values.setdefault(name, {})[field] = _plain(v, f"optimizer state {name}.{field}")
    groups = [{k: _plain(v, f"param_groups[{i}].{k}") for k, v in g.items()} for i, g in enumerate(state["param_groups"])]
    _save_tensors(Path(directory) / OPTIMIZER_TENSORS, tensors, {"format": "astrai-optimizer"})
    _dump_json(Path(directory) / OPTIMIZER_JSON, {"format": FORMAT, "param_groups": groups, "values": values})


# how the live optimizer runs, not what it computes: a checkpoint saved under FSDP (no fused kernel for
# sharded tensors) resumes in one plain process (fused) and back, each keeping its own choice
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


# what an AdamW hyperparameter may be: (low, high, low included, high included)
RANGES = {"lr": (0.0, math.inf, True, False), "initial_lr": (0.0, math.inf, False, False),
          "eps": (0.0, 1.0, False, True), "weight_decay": (0.0, math.inf, True, False)}


def _in_range(value, where: str, path: Path, lo: float, hi: float, lo_in: bool = True, hi_in: bool = False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
        (lo <= value if lo_in else lo < value) and (value <= hi if hi_in else value < hi)
    if not ok:
        raise CheckpointError(f"{path}: {where} is {value!r}, outside what it can be ("
                              f"{'[' if lo_in else '('}{lo:g}, {hi:g}{']' if hi_in else ')'}); the file was edited or "
                              f"damaged: delete {path.parent} to resume from an earlier checkpoint")


def _check_group(g: dict, i: int, path: Path):
    """Every hyperparameter AdamW reads in range: lr no higher than the peak it was scheduled from."""
    for k, (lo, hi, lo_in, hi_in) in RANGES.items():
        if k in g:
            _in_range(g[k], f"param_groups[{i}].{k}", path, lo, hi, lo_in, hi_in)
    if "initial_lr" in g:  # every schedule multiplies the peak by at most 1
        _in_range(g.get("lr"), f"param_groups[{i}].lr", path, 0.0, g["initial_lr"] * (1 + 1e-6), True, True)
    betas = g.get("betas")
    if betas is not None:
        for j, b in enumerate(betas):
            _in_range(b, f"param_groups[{i}].betas[{j}]", path, 0.0, 1.0)


def _check_tensor(t: torch.Tensor, key: str, path: Path, steps: int):
    """Finite; a second moment never negative; AdamW's step an integer from 0 to the steps taken."""
    bad = None
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = "holds NaN or infinite values"
    elif key.endswith("/exp_avg_sq") and bool((t < 0).any()):
        bad = "holds negative values (a mean of squares never is)"
    elif key.endswith("/step") and (t.numel() != 1 or not 0 <= float(t) <= steps or float(t) != int(float(t))):
        bad = f"is {t.flatten()[:2].tolist()}, not a whole number of optimizer steps from 0 to {steps}"
    if bad:
        raise CheckpointError(f"{path}: '{key}' {bad}; the file was edited or damaged: delete {path.parent} to "
                              f"resume from an earlier checkpoint")


def read_optimizer(directory: Path, live_groups: list[dict], shapes: dict[str, torch.Size],
                   steps: int = 2 ** 62) -> dict:
    """The name-keyed state dict, checked against the live optimizer: the same groups holding the same
    parameter names (`live_groups`: the live param_groups with "params" given as names), every tensor
    of a known parameter with its parameter's shape (`shapes`: name -> full shape) or a scalar; and
    checked in itself: hyperparameters in range (RANGES), tensors finite, AdamW's step counters no
    more than `steps` (the optimizer steps the checkpoint records)."""
    directory = Path(directory)
    meta_path = directory / OPTIMIZER_JSON
    meta = _read_json(meta_path)
    groups = meta.get("param_groups")
    if not isinstance(groups, list) or len(groups) != len(live_groups):
        raise CheckpointError(f"{meta_path}: {len(groups) if isinstance(groups, list) else 'no'} parameter groups, "
                              f"this optimizer has {len(live_groups)}: the checkpoint belongs to another model or "
                              f"setup")
    out_groups = []
    for i, (g, live) in enumerate(zip(groups, live_groups)):
        if not isinstance(g, dict) or sorted(g.get("params") or []) != sorted(live["params"]):
            names = set(g.get("params") or []) if isinstance(g, dict) else set()
            extra, missing = sorted(names - set(live["params"])), sorted(set(live["params"]) - names)
            raise CheckpointError(f"{meta_path}: parameter group {i} does not hold this model's trainable parameters"
                                  + (f" (unknown: {', '.join(extra[:3])})" if extra else "")
                                  + (f" (missing: {', '.join(missing[:3])})" if missing else "")
                                  + "; resume needs the same model and trainable parameters")
        restored = {k: _like(v, live[k], f"param_groups[{i}].{k}", meta_path) for k, v in g.items()
                    if k != "params" and k in live and k not in IMPLEMENTATION_KEYS}
        _check_group(restored, i, meta_path)
        restored.update({k: live[k] for k in IMPLEMENTATION_KEYS if k in live})
        out_groups.append({**restored, "params": list(g["params"])})
    state: dict[str, dict] = {}
    tensor_path = directory / OPTIMIZER_TENSORS
    for key, t in _read_tensors(tensor_path).items():
        name, _, field = key.rpartition("/")
        if name not in shapes or not field:
            raise CheckpointError(f"{tensor_path}: tensor '{key}' names no trainable parameter of this model")
        if t.dim() and t.shape != shapes[name]:
            raise CheckpointError(f"{tensor_path}: '{key}' has shape {list(t.shape)}, the parameter "
                                  f"{list(shapes[name])}: the checkpoint belongs to another model shape")
        _check_tensor(t, key, tensor_path, steps)
        state.setdefault(name, {})[field] = t
    values = meta.get("values") or {}
    if not isinstance(values, dict):
        raise CheckpointError(f"{meta_path}: 'values' must be a mapping")
    for name, fields in values.items():
        if name not in shapes or not isinstance(fields, dict):
            raise CheckpointError(f"{meta_path}: values for '{name}', which is no trainable parameter of this model")
        for field, v in fields.items():
            if isinstance(v, (dict, list)) or isinstance(v, float) and not math.isfinite(v):
                raise CheckpointError(f"{meta_path}: values.{name}.{field} must be a finite number, string or null")
            state.setdefault(name, {})[field] = v
    return {"state": state, "param_groups": out_groups}


# ---- scheduler --------------------------------------------------------------------------------


def write_scheduler(directory: Path, state: dict):
    """`state`: the scheduler's state_dict()."""
    sd = {k: _plain(v, f"scheduler {k}") for k, v in state.items() if k != "lr_lambdas"}
    _dump_json(Path(directory) / SCHEDULER_JSON, {"format": FORMAT, "state": sd})


def read_scheduler(directory: Path, scheduler, steps: int | None = None):
    """Restore the counters into `scheduler`; only keys the live scheduler has, each of its type, in
    range: last_epoch (the scheduler's steps) equal to `steps` (the optimizer steps the checkpoint
    records) when given, _step_count one more, the learning rates finite and positive."""
    path = Path(directory) / SCHEDULER_JSON
    saved = _read_json(path).get("state")
    live = scheduler.state_dict()
    if not isinstance(saved, dict) or set(saved) - set(live):
        raise CheckpointError(f"{path}: unexpected scheduler state "
                              f"{sorted(set(saved) - set(live)) if isinstance(saved, dict) else saved!r}")
    restored = {k: _like(v, live[k], k, path) for k, v in saved.items()}
    last = restored.get("last_epoch", 0)
    if last < 0 or (steps is not None and last != steps):
        raise CheckpointError(f"{path}: last_epoch is {last}, but the checkpoint records {steps} optimizer steps "
                              f"(trainer_state.json); the file was edited: delete {path.parent} to resume from an "
                              f"earlier checkpoint")
    if "_step_count" in restored and restored["_step_count"] != last + 1:
        raise CheckpointError(f"{path}: _step_count is {restored['_step_count']}, not last_epoch + 1 ({last + 1}); "
                              f"the file was edited: delete {path.parent} to resume from an earlier checkpoint")
    for key in ("base_lrs", "_last_lr"):
        for i, v in enumerate(restored.get(key) or []):
            _in_range(v, f"{key}[{i}]", path, 0.0, math.inf, key == "_last_lr")
    if "lr_lambdas" in live:
        restored["lr_lambdas"] = [None] * len(live["lr_lambdas"])  # the schedule comes from the options
    scheduler.load_state_dict({**live, **restored})


# ---- random number generators ------------------------------------------------------------------


def rng_state() -> dict:
    """This process's generators."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def write_rng(directory: Path, rank: int, state: dict | None = None):
    """Generator states (default: this process's; every rank writes its own)."""
    state = state or rng_state()
    tensors_name, json_name = rng_files(rank)
    algorithm, keys, pos, has_gauss, cached = state["numpy"][:5]
    version, words, gauss = state["python"]
    tensors = {"torch": state["torch"], "numpy_keys": torch.from_numpy(np.asarray(keys).astype(np.int64))}
    cuda = list(state.get("cuda") or [])
    for i, s in enumerate(cuda):
        tensors[f"cuda.{i}"] = s
    _save_tensors(Path(directory) / tensors_name, tensors, {"format": "astrai-rng"})
    _dump_json(Path(directory) / json_name, {
        "format": FORMAT, "python": {"version": version, "state": list(words), "gauss": gauss},
        "numpy": {"algorithm": algorithm, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "cuda_devices": len(cuda)})


def read_rng(directory: Path, rank: int):
    """Restore this rank's generators from its own files."""
    tensors_name, json_name = rng_files(rank)
    meta_path, tensor_path = Path(directory) / json_name, Path(directory) / tensors_name
    meta = _read_json(meta_path)
    tensors = _read_tensors(tensor_path)
    py, npy = meta.get("python"), meta.get("numpy")
    try:
        words = tuple(int(w) for w in py["state"])
        if not isinstance(py["version"], int) or len(words) != 625 or not all(0 <= w < 2 ** 32 for w in words):
            raise ValueError
        gauss = py["gauss"]
        if gauss is not None and not isinstance(gauss, float):
            raise ValueError
        keys = tensors["numpy_keys"]
        if keys.dtype != torch.int64 or keys.shape != (624,) or bool((keys < 0).any() | (keys >= 2 ** 32).any()):
            raise ValueError
        np_state = (str(npy["algorithm"]), keys.numpy().astype(np.uint32), int(npy["pos"]), int(npy["has_gauss"]),
                    float(npy["cached_gaussian"]))
        cpu = tensors["torch"]
        if cpu.dtype != torch.uint8 or cpu.dim() != 1:
            raise ValueError
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{meta_path}: not a valid generator state (python, numpy and torch states of "
                              f"the right sizes)") from None
    try:
        random.setstate((py["version"], words, gauss))
        np.random.set_state(np_state)
        torch.set_rng_state(cpu)
    except (TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{meta_path}: generator state refused ({e})") from None
    n = meta.get("cuda_devices") or 0
    if n and torch.cuda.is_available() and n == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([tensors[f"cuda.{i}"] for i in range(n)])
