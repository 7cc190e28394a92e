"""The train output directory: astrai's only by its marker, written only by astrai, and what it may delete.

    OUTPUT/.astrai-train        the marker that makes OUTPUT a train output of astrai's
    OUTPUT/metrics.jsonl        appended; loss.png; completions.jsonl, val_completions.jsonl (online GRPO)
    OUTPUT/checkpoints/step-N/  one checkpoint each (astrai.train.resume)
    OUTPUT/final/               the last model; runs/ and wandb/ (report_to)

`claim(out)`, before anything is written (rank 0, holding the output's lock): a missing or empty
directory is claimed (the marker); one that carries the marker is resumed; any other non-empty
directory is refused in one line naming it, and nothing in it is touched. A train output is
never taken for a preprocess output or a recipe's run directory, nor those for it: each has its
own marker. Then every entry astrai writes at a fixed name is checked: a symbolic link (or a
FIFO, a device) planted at any of them is refused (astrai.runtime.LinkRefused, naming it), as is
a step directory or final/ that holds a file astrai does not write (`foreign`), and a metrics.jsonl
line that is not a record (astrai.train.summary.read_records names the file and the line).

Deleting: a step directory or final/ is only ever removed or replaced when every file in it is one
astrai writes there (`WRITTEN`, by name); a hidden temporary directory of ours (`.final.tmp`,
`.step-N.tmp`) is removed as such, and a link planted at its name is unlinked, never followed.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from astrai.errors import InputError
from astrai.runtime import claim_output, is_ours, refuse_link
from astrai.train.summary import read_records

TRAIN_MARKER = ".astrai-train"
FILES = ("metrics.jsonl", "loss.png", "completions.jsonl", "val_completions.jsonl")
DIRS = ("checkpoints", "final", "runs", "wandb")
CHECKPOINTS, FINAL, FINAL_TMP = "checkpoints", "final", ".final.tmp"

# every file astrai writes into a checkpoint or final/ (and final/merged/): the model (or its LoRA
# adapters), the data's tokenizer and chat template, the training state, an older astrai's pickles
# (astrai.train.legacy converts them), and temporary files of a write a kill interrupted
WRITTEN = re.compile(r"config\.json|model\.safetensors|adapter_config\.json|adapter_model\.safetensors"
                     r"|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|chat_template\.jinja"
                     r"|trainer_state\.json|optimizer\.(safetensors|json|pt)"
                     r"|scheduler\.(json|pt)|rng\.pt|rng-rank\d+\.(safetensors|json)|\..+\.tmp-\d+")
SUBDIRS = ("merged",)  # final/merged/: the base with the LoRA adapters merged in
_TMP_STEP = re.compile(r"\.step-\d{8}\.tmp.*")


class TrainOutputError(InputError):
    """The output cannot be used (not astrai's), or a directory in it holds files astrai did not write."""


def foreign(directory: Path) -> list[str]:
    """The entries of `directory` (relative paths) astrai does not write there: a file of another
    name, a link, a special file, a folder other than merged/."""
    out = []
    for p in sorted(Path(directory).iterdir()):
        if p.is_symlink():
            out.append(f"{p.name} (a symbolic link)")
        elif p.is_dir() and p.name in SUBDIRS:
            out += [f"{p.name}/{name}" for name in foreign(p)]
        elif not (p.is_file() and WRITTEN.fullmatch(p.name)):
            out.append(p.name + ("/" if p.is_dir() else ""))
    return out


def only_ours(directory: Path, why: str):
    """Raise unless `directory` (a real directory, not a link) holds only what astrai writes there."""
    refuse_link(directory, directory=True)
    found = foreign(directory)
    if found:
        raise TrainOutputError(f"{directory} holds {found[0]}" + (f" and {len(found) - 1} more" if len(found) > 1
                                                                   else "")
                               + f", which astrai did not write; {why}, so it was left untouched: move that "
                                 f"away (or choose another output)")


def remove_ours(directory: Path, why: str):
    """Delete a step directory or final/ of ours, after checking it holds only what astrai writes."""
    only_ours(directory, why)
    shutil.rmtree(directory)


def clear_tmp(path: Path):
    """Remove a hidden temporary directory of ours (left by a killed run) so it can be made anew; a
    link or file planted at its name is unlinked, never followed."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def claim(out: Path):
    """Use `out` for training only when it carries the train marker or is empty (then mark it); refuse
    anything else before writing a byte into it. Then refuse planted links and foreign files."""
    out = Path(out)
    if not is_ours(out, TRAIN_MARKER):
        if any(out.iterdir()):
            kind = " (it is a preprocess output)" if is_ours(out) else ""
            raise TrainOutputError(f"output {out} is not empty and is not a train output of astrai's (no "
                                   f"{TRAIN_MARKER} marker){kind}; nothing in it was touched: choose a new or "
                                   f"empty output directory")
        claim_output(out, {"kind": "train"}, TRAIN_MARKER)
    check_entries(out)


def check_entries(out: Path):
    """Every name astrai writes at in `out` is absent or what astrai made there (no link, no FIFO), and
    every checkpoint and final/ holds only astrai's files (a resume may replace or prune them)."""
    for name in FILES:
        refuse_link(out / name)
    read_records(out / "metrics.jsonl")  # a malformed line is one error naming it, before any step
    for name in (*DIRS, FINAL_TMP):
        refuse_link(out / name, directory=True)
    ckpts = out / CHECKPOINTS
    if ckpts.is_dir():
        for p in sorted(ckpts.iterdir()):
            if p.name.startswith(("step-", ".step-")):
                refuse_link(p, directory=True)
                if not _TMP_STEP.fullmatch(p.name):  # our half-written save: removed whole by the next one
                    only_ours(p, "a checkpoint is only deleted or replaced when all it holds is astrai's")
    if (out / FINAL).is_dir():
        only_ours(out / FINAL, "final/ is replaced at the end of training")
