"""What the recipe runner needs to know about a stage kind, and what a stage run receives.

A stage kind is a name, a typed options model and a run function (the stage registry's entry),
plus the facts that let `astrai run` chain stages without knowing them:

- `produces`: what its output is ("tokenizer", "data", "model", "report"), so a reference can be
  refused when it points at the wrong sort of stage (`data: tokenizer`);
- `refs`: option fields that name an earlier stage, each with the outputs it accepts; a field in
  `path_refs` may instead hold a path (a tokenizer directory, `package:NAME`), and one in
  `literals` one of the listed plain values (a model size preset);
- `files`: option fields holding input paths or globs (checked to exist, hashed into the fingerprint);
- `code`: the modules whose source is the stage's code version (an edit reruns it);
- `describe(options, base_dir, upstream)`: facts about the output it will produce, known before
  any work (data kind, packed or not, which tokenizer), given the descriptions of what it reads;
  consumers check them with `check(options, base_dir, upstream)` -> [(field, problem with its fix)]
  (an upstream stage with a problem of its own is described only by {"stage": name}: a check
  compares only what it finds, so every problem is still reported in one go);
- `extra(options, base_dir)`: anything else the output depends on that the options only name
  (e.g. the files of the tokenizer a pipeline names), added to the fingerprint;
- `figures`: metric keys shown in the end-of-run table;
- `stamped`: the parts of its output that are its product (default: all of it), stamped when the
  stage finishes; a stage whose product changed by hand since is not up to date; `unstamped`: file
  names in it that other tools write beside the product (astrai eval's eval.json beside a model);
- `growable` + `continues(old_options, new_options)`: options that may grow without starting over
  (a train stage's max_steps/epochs): when nothing else changed and `continues` agrees, the stage's
  replacement starts from a copy of its previous output (ctx.resume) instead of from scratch.

NOTE: nothing here imports torch; a kind's run function imports what it needs when it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from pydantic import BaseModel


@dataclass
class StageContext:
    """Everything a stage run gets: its validated options and resolved paths (never guessed ones)."""

    name: str
    options: BaseModel
    inputs: dict[str, Path]  # ref field -> the upstream stage's output dir (or the path given instead)
    output: Path  # the stage's own output directory, RUN/<name>/output
    base_dir: Path  # the recipe file's folder: relative option paths are relative to it
    log: Callable[[str], None]  # to the console and RUN/<name>/log.txt
    resume: bool = False  # an earlier run with the same fingerprint stopped part way: continue it


Describe = Callable[[BaseModel, Path, Mapping[str, dict]], dict]
Check = Callable[[BaseModel, Path, Mapping[str, dict]], list[tuple[str, str]]]
Extra = Callable[[BaseModel, Path], dict]


@dataclass(frozen=True)
class StageKind:
    name: str
    options: type[BaseModel]
    run: Callable[[StageContext], dict]  # returns the stage's metrics (key figures, loss curves)
    produces: str
    refs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    path_refs: frozenset = frozenset()
    literals: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    files: tuple[str, ...] = ()
    code: tuple[str, ...] = ()
    describe: Optional[Describe] = None
    check: Optional[Check] = None
    extra: Optional[Extra] = None
    figures: tuple[str, ...] = ()
    stamped: tuple[str, ...] = ()
    unstamped: tuple[str, ...] = ()
    growable: tuple[str, ...] = ()
    continues: Optional[Callable[[dict, BaseModel], bool]] = None


def describe_stage(kind: StageKind, options: BaseModel, base_dir: Path, upstream: Mapping[str, dict]) -> dict[str, Any]:
    """The kind's description of its output, always carrying what it produces."""
    out = dict(kind.describe(options, base_dir, upstream)) if kind.describe else {}
    out.setdefault("produces", kind.produces)
    return out
