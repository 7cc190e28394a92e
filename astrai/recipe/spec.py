"""A recipe: named stages in order, each referring to earlier stages by name; checked before any work.

    version: 1
    name: sft-sample
    run_dir: ../runs/sft            # relative to the recipe file (default: runs/<name> beside it)
    stages:                         # in the order they run; the key is the stage's name
      tokenizer: {inputs: [../samples/chat.jsonl], vocab_size: 2048}
      preprocess: {pipeline: ../pipelines/chatml_sft.yaml, inputs: [...], tokenizer: tokenizer}
      sft: {kind: train, data: preprocess}          # kind defaults to the name
      eval: {model: sft, data: preprocess}

`parse_recipe` validates every stage's options with its kind's model and resolves every reference,
reporting every problem at once, each with its key path and YAML line and the fix: a stage name
that is not a plain name (it names a folder of the run directory: `../x`, `/abs`, `1`), an unknown stage
or kind ("did you mean"), a reference to a later stage or to itself, a cycle, a reference to the
wrong sort of output, a missing input file, and whatever a consumer's `check` finds in what it
reads (DPO pairs into an SFT stage, unpacked data where packing is required, another tokenizer).
"""

from __future__ import annotations

import difflib
import glob
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from pydantic import BaseModel

from astrai.config import ConfigError, Problem, run_dir_of, validate_data
from astrai.config.loading import find_mark
from astrai.config.recipe import RECIPE_KEYS
from astrai.recipe.kinds import StageKind, describe_stage

TOP_KEYS = RECIPE_KEYS


@dataclass(frozen=True)
class StageSpec:
    name: str
    kind: str
    index: int
    options: BaseModel
    refs: dict[str, str] = field(default_factory=dict)  # option field -> upstream stage name
    paths: dict[str, str] = field(default_factory=dict)  # ref fields given a path instead of a stage
    described: dict = field(default_factory=dict)  # what the stage's output will be (kinds.describe_stage)


@dataclass(frozen=True)
class RecipeSpec:
    file: str
    base_dir: Path
    name: str
    run_dir: Path
    stages: list[StageSpec]

    def stage(self, name: str) -> StageSpec:
        return next(s for s in self.stages if s.name == name)


def stage_overrides(overrides, stage_names) -> list[str]:
    """`--set train.lr=1e-3` means stages.train.lr; a top-level key (run_dir=...) stays as written."""
    out = []
    for expr in overrides:
        head = expr.split("=", 1)[0].split(".", 1)[0].strip()
        out.append(f"stages.{expr}" if head in stage_names and head not in TOP_KEYS else expr)
    return out


def parse_recipe(data: Any, marks: dict, file: str, kinds: Mapping[str, StageKind]) -> RecipeSpec:
    """Validate and resolve a loaded recipe (data + marks from config.load_yaml); raise ConfigError."""
    problems: list[Problem] = []

    def problem(loc: tuple, message: str, key: bool = False):
        line, col = find_mark(marks, loc, key)
        problems.append(Problem(".".join(str(p) for p in loc), message, line, col))

    if not isinstance(data, dict):
        raise ConfigError(file, [Problem("", "expected a mapping at the top level", 1, 1)])
    base_dir = Path(file).resolve().parent
    for key in data:
        if key not in TOP_KEYS:
            problem((key,), _unknown("key", key, TOP_KEYS) + _stage_option_hint(key, data.get("stages"), kinds),
                    key=True)
    if data.get("version") != 1:
        problem(("version",), f"version must be 1 (got {data.get('version')!r})")
    name = data.get("name") or Path(file).stem
    run_dir = run_dir_of(file, data)
    raw = data.get("stages")
    if not isinstance(raw, dict) or not raw:
        problem(("stages",), "stages must be a mapping of stage name -> options, in run order")
        raise ConfigError(file, problems)

    order = list(raw)
    stages = []
    seen: dict[str, str] = {}
    for index, stage_name in enumerate(order):
        bad = _name_problem(stage_name, seen)
        if bad:
            problem(("stages", str(stage_name)), bad, key=True)
            continue
        spec = _stage(stage_name, index, raw[stage_name], marks, file, kinds, problem, problems)
        if spec is not None:
            stages.append(spec)
    stages = _resolve(stages, [str(n) for n in order], kinds, base_dir, problem)
    if problems:
        problems.sort(key=lambda p: (p.line or 0, p.column or 0))
        raise ConfigError(file, problems)
    return RecipeSpec(file, base_dir, str(name), run_dir, stages)


def _stage_option_hint(key: Any, stages: Any, kinds) -> str:
    """A top-level key that is an option of one of the stages (`--set format=...` for preprocess.format)."""
    if not isinstance(stages, dict):
        return ""
    owners = [name for name, block in stages.items() if isinstance(block, dict)
              and key in getattr(kinds.get(block.get("kind", name)), "options", BaseModel).model_fields]
    return f" ('{key}' is an option of stage '{owners[0]}': {owners[0]}.{key})" if owners else ""


STAGE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")


def _name_problem(name: Any, seen: dict[str, str]) -> Optional[str]:
    """A stage name is a plain name: it names a folder of the run directory, so nothing that could
    leave it (`../x`, `/abs`, `a/b`), and not two names one case-insensitive filesystem would merge."""
    if not isinstance(name, str) or not STAGE_NAME.fullmatch(name):
        return (f"stage name {name!r} is not a plain name: use a letter, then letters, digits, _ or - "
                f"(at most 64), e.g. sft or eval_2; it names the stage's folder in the run directory")
    other = seen.setdefault(name.lower(), name)
    if other != name:
        return f"stage name '{name}' differs from '{other}' only in case; give stages distinct names"
    return None


def _stage(name, index, raw, marks, file, kinds, problem, problems) -> Optional[StageSpec]:
    loc = ("stages", name)
    if not isinstance(raw, dict):
        problem(loc, "a stage is a mapping of its options")
        return None
    options = dict(raw)
    kind_name = options.pop("kind", name)
    if kind_name not in kinds:
        problem(loc + (("kind",) if "kind" in raw else ()),
                _unknown("stage kind", kind_name, list(kinds)) + ("" if "kind" in raw else
                                                                   f" (set `kind:` if '{name}' is only a name)"))
        return None
    sub_marks = {_strip(k, loc): v for k, v in marks.items() if _strip(k, loc) is not None}
    try:
        validated = validate_data(options, kinds[kind_name].options, file, sub_marks)
    except ConfigError as e:
        for p in e.problems:
            problems.append(Problem(".".join(map(str, loc)) + (f".{p.path}" if p.path else ""), p.message,
                                    p.line, p.column))
        return None
    return StageSpec(name, kind_name, index, validated)


def _resolve(stages: list[StageSpec], order: list[str], kinds, base_dir: Path, problem) -> list[StageSpec]:
    by_name = {s.name: s for s in stages}
    edges = {s.name: [getattr(s.options, f) for f in kinds[s.kind].refs if getattr(s.options, f, None) in by_name]
             for s in stages}
    cycles = _cycles(edges, order)
    resolved: list[StageSpec] = []
    described: dict[str, Optional[dict]] = {}  # None: the stage has a problem
    for s in stages:
        kind = kinds[s.kind]
        refs, paths, upstream, ok, upstream_ok = {}, {}, {}, True, True
        for f, accepted in kind.refs.items():
            value = getattr(s.options, f, None)
            loc = ("stages", s.name, f)
            if value is None:
                continue
            if value in kind.literals.get(f, ()) and value not in by_name:
                continue  # a plain value, not a reference (e.g. model: tiny)
            if value in order and value not in by_name:  # that stage has its own problem: no cascade
                ok = False
            elif value in by_name:
                target = by_name[value]
                if value in cycles.get(s.name, {}):
                    problem(loc, f"cycle: {' -> '.join(cycles[s.name][value])} (each reads the next); a stage "
                                 f"reads only stages above it")
                    ok = False
                elif target.index >= s.index:
                    problem(loc, f"'{value}' comes after '{s.name}' (stages run in the order written); "
                                 f"move '{value}' above '{s.name}'")
                    ok = False
                elif kinds[target.kind].produces not in accepted:
                    problem(loc, f"'{value}' is a {target.kind} stage (its output is {kinds[target.kind].produces}); "
                                 f"{f} needs {' or '.join(accepted)}: name a stage that produces it")
                    ok = False
                else:
                    refs[f] = value
                    if described.get(value) is None:  # it has its own problem: check with what is known
                        upstream_ok = False
                    upstream[f] = {**(described.get(value) or {}), "stage": value}
            elif f in kind.path_refs:
                where = _path_problem(value, base_dir)
                if where:
                    also = kind.literals.get(f)
                    guess = difflib.get_close_matches(str(value), order, n=1, cutoff=0.6)
                    problem(loc, f"'{value}' is neither a stage ({', '.join(order)})"
                                 + (f", one of {', '.join(also)}," if also else "") + f" nor {where}"
                                 + (f" (did you mean '{guess[0]}'?)" if guess else ""))
                    ok = False
                paths[f] = value
                upstream[f] = {"produces": accepted[0], "path": _path_identity(value, base_dir)}
            else:
                problem(loc, _unknown("stage", value, [n for n in order if by_name[n].index < s.index] or order))
                ok = False
        for f in kind.files:
            for pattern in _as_list(getattr(s.options, f, None)):
                if not glob.glob(str(base_dir / pattern)) and not glob.glob(pattern):
                    problem(("stages", s.name, f), f"missing input: {pattern} (relative to {base_dir}); "
                                                   f"fix the path or create the file")
                    ok = False
        desc: Optional[dict] = None
        if ok:
            found = kind.check(s.options, base_dir, upstream) if kind.check else []
            for f, message in found:
                problem(("stages", s.name, f), message)
            desc = None if found or not upstream_ok else describe_stage(kind, s.options, base_dir, upstream)
        described[s.name] = desc
        resolved.append(StageSpec(s.name, s.kind, s.index, s.options, refs, paths, desc or {}))
    return resolved


def _cycles(edges: dict[str, list[str]], order: list[str]) -> dict[str, dict[str, list[str]]]:
    """For each reference that closes a cycle: stage -> {target: [stage, target, ..., stage]}."""
    found: dict[str, dict[str, list[str]]] = {}
    for start in order:
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for nxt in edges.get(node, []):
                if nxt == start:
                    found.setdefault(node, {})[nxt] = [node] + path  # told from the reading stage
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    return found


def _path_problem(value: str, base_dir: Path) -> Optional[str]:
    if value.startswith("package:"):
        import importlib.util

        name = value[len("package:"):]
        return None if importlib.util.find_spec(name) else f"an installed package ({name} is not installed)"
    path = Path(value).expanduser()
    path = path if path.is_absolute() else base_dir / path
    return None if path.exists() else f"an existing path ({path} does not exist)"


def _path_identity(value: str, base_dir: Path) -> str:
    if value.startswith("package:"):
        return value
    path = Path(value).expanduser()
    return str((path if path.is_absolute() else base_dir / path).resolve())


def _as_list(value) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _unknown(what: str, value: Any, known) -> str:
    guess = difflib.get_close_matches(str(value), list(known), n=1, cutoff=0.6)
    return (f"unknown {what} '{value}'" + (f" (did you mean '{guess[0]}'?)" if guess else "")
            + f"; known: {', '.join(map(str, known))}")


def _strip(key: tuple, prefix: tuple) -> Optional[tuple]:
    if key[:1] == ("<key>",):
        rest = _strip(key[1:], prefix)
        return None if rest is None else ("<key>",) + rest
    return key[len(prefix):] if key[:len(prefix)] == prefix else None
