"""Loading configuration files: safe YAML, located problems, `--set` overrides, `--help` lines.

Guarantees, for every model loaded here (pipelines, recipes, stage options):
- safe YAML only (no tags that construct Python objects);
- every problem is reported at once, each with its dotted key path and YAML line:column;
- unknown keys are errors with a "did you mean" suggestion;
- invalid combinations are rejected before any work and name the fix. A model declares its
  combination checks beside itself, as a classmethod `combination_problems(raw_data)` returning
  (key path, message) pairs; they run on the raw data, so they are reported together with type
  errors, and its validator raises them for the Python API.

NOTE: this package imports neither torch nor anything under astrai.data/train/infer.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from astrai import yaml_bounded
from astrai.errors import InputError, read_text_regular

MAX_YAML_BYTES = 64 << 20  # a pipeline, recipe or train YAML (real ones are a few KB)

@dataclass(frozen=True)
class Problem:
    path: str  # dotted key path, e.g. "preprocessing.max_seq_len"
    message: str
    line: Optional[int] = None  # 1-based
    column: Optional[int] = None  # 1-based

    def __str__(self) -> str:
        where = f"{self.line}:{self.column}: " if self.line is not None else ""
        key = self.path or "<root>"
        return f"{where}{key}: {self.message}"


class ConfigError(Exception):
    """Raised with every problem of a config file at once."""

    def __init__(self, file: str, problems: list[Problem]):
        self.file = file
        self.problems = problems
        lines = [f"{file}:{p}" for p in problems]
        super().__init__(f"{len(problems)} problem(s) in {file}:\n  " + "\n  ".join(lines))



class StrictModel(BaseModel):
    """Every option model: unknown keys are errors, values are not coerced, instances are frozen."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def raise_combination_problems(model: BaseModel):
    """For a model's after-validator: its combination problems, as pydantic expects them."""
    problems = type(model).combination_problems(model.model_dump())
    if problems:
        raise ValueError("; ".join(m for _, m in problems))
    return model


def get_in(d: Any, *keys, default=None):
    for k in keys:
        if isinstance(d, dict) and k in d:
            d = d[k]
        elif isinstance(d, list) and isinstance(k, int) and 0 <= k < len(d):
            d = d[k]
        else:
            return default
    return d


# ----------------------------------------------------------------------------------------------
# Loading with line numbers


def _marks(node: yaml.Node, path: tuple = (), out: Optional[dict] = None) -> dict:
    """Map each key path to the (line, column) of its value node (and '<key>' entries for keys)."""
    if out is None:
        out = {}
    out.setdefault(path, (node.start_mark.line + 1, node.start_mark.column + 1))
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = k.value
            out[("<key>",) + path + (key,)] = (k.start_mark.line + 1, k.start_mark.column + 1)
            _marks(v, path + (key,), out)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _marks(v, path + (i,), out)
    return out


def find_mark(marks: dict, loc: tuple, key: bool = False):
    if key and ("<key>",) + loc in marks:
        return marks[("<key>",) + loc]
    for n in range(len(loc), -1, -1):
        if loc[:n] in marks:
            return marks[loc[:n]]
    return (None, None)


def _model_for_loc(model: type[BaseModel], loc: tuple):
    """Walk a pydantic model class along loc; return the model that owns the last key, if any."""
    cur: Any = model
    for part in loc[:-1]:
        if isinstance(cur, type) and issubclass(cur, BaseModel) and isinstance(part, str) and part in cur.model_fields:
            cur = cur.model_fields[part].annotation
            cur = _unwrap(cur)
        elif isinstance(part, int):
            continue
        else:
            return None
    return cur if isinstance(cur, type) and issubclass(cur, BaseModel) else None


def _unwrap(tp):
    from typing import get_args

    for arg in get_args(tp) or ():
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
        inner = _unwrap(arg)
        if inner is not None:
            return inner
    return tp


def _clean_loc(loc: tuple) -> tuple:
    # pydantic adds union member tags ('str', 'list[str]', 'function-after[...]') to locations
    return tuple(p for p in loc if isinstance(p, int) or not (("[" in p) or p in ("str", "int", "bool", "float")))


def _problems_from_validation(err: ValidationError, model: type[BaseModel], marks: dict) -> list[Problem]:
    problems = []
    seen = set()
    for e in err.errors():
        loc = _clean_loc(tuple(e["loc"]))
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            owner = _model_for_loc(model, loc)
            known = list(owner.model_fields) if owner else []
            guess = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
            msg = f"unknown key '{loc[-1]}'" + (f" (did you mean '{guess[0]}'?)" if guess else "")
            if known:
                msg += f"; allowed: {', '.join(known)}"
            line, col = find_mark(marks, loc, key=True)
        else:
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, "):]
            if e["type"] not in ("value_error",) and "input" in e and not isinstance(e["input"], (dict, list)):
                msg += f" (got {e['input']!r})"
            line, col = find_mark(marks, loc)
        path = _dotted(loc)
        # a combination error carries several problems joined by '; ' — report each on its own
        for part in msg.split("; ") if e["type"] == "value_error" else [msg]:
            key = (path, part)
            if key not in seen:
                seen.add(key)
                problems.append(Problem(path, part, line, col))
    return problems


def _dotted(loc: tuple) -> str:
    return ".".join(str(p) if isinstance(p, str) else f"[{p}]" for p in loc).replace(".[", "[")


def parse_set(expr: str) -> tuple[list[str], Any]:
    """'a.b=c' -> (['a','b'], typed value). The value is read as a YAML scalar/flow value (safe)."""
    if "=" not in expr:
        raise ValueError(f"--set expects dotted.key=value, got {expr!r}")
    key, raw = expr.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ValueError(f"--set has an empty key: {expr!r}")
    try:
        return parts, yaml_bounded.load(raw)[0] if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ValueError(f"--set {key.strip()}: the value {raw!r} is not valid YAML "
                         f"({getattr(e, 'problem', None) or e}); quote it as a string: {key.strip()}='\"...\"'") from None


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b=c` overrides in place. A numeric part indexes a list (input.sections.0.action=mask)."""
    for expr in overrides:
        parts, value = parse_set(expr)
        cur = data
        for i, p in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(cur, list):
                if not p.isdigit() or int(p) >= len(cur):
                    raise ValueError(f"--set {expr}: '{p}' is not an index of the {len(cur)}-item list "
                                     f"{'.'.join(parts[:i])}")
                key = int(p)
            else:
                key = p
            if last:
                cur[key] = value
            else:
                nxt = cur[key] if (isinstance(cur, list) or key in cur) else None
                if not isinstance(nxt, (dict, list)):
                    nxt = {}
                    cur[key] = nxt
                cur = nxt
    return data


def load_yaml(path: str | os.PathLike) -> tuple[Any, dict]:
    """Safe-load a YAML file; return (data, marks)."""
    try:
        text = read_text_regular(path, "config", MAX_YAML_BYTES)  # never a FIFO or a device: they would not end
    except InputError as e:  # a person's error (a wrong path), not a traceback
        raise ConfigError(str(path), [Problem("", str(e).removeprefix(f"config {path}: "))]) from None
    try:
        data, node = yaml_bounded.load(text)  # aliases and nesting bounded before anything walks the tree
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line, col = (mark.line + 1, mark.column + 1) if mark else (None, None)
        raise ConfigError(str(path), [Problem("", f"invalid YAML: {getattr(e, 'problem', e)}", line, col)]) from None
    return data, (_marks(node) if node is not None else {})


def validate_data(data: Any, model: type[BaseModel], file: str, marks: Optional[dict] = None, sets=()):
    """Validate or raise ConfigError with every problem. `sets` (from `override`) are the `--set`
    overrides applied: a problem under a key one of them set names that `--set`, not a file line."""
    try:
        return _validate(data, model, file, marks)
    except ConfigError as e:
        if sets:
            e = ConfigError(e.file, [_from_set(p, sets) for p in e.problems])
        raise e from None


def _from_set(p: Problem, sets) -> Problem:
    for key, shown in reversed(sets):  # the last override of a key is the one in effect
        if p.path and (p.path == key or p.path.startswith((key + ".", key + "[")) or key.startswith(p.path + ".")):
            return Problem(f"--set {shown}", f"{p.path}: {p.message}")
    return p


def _validate(data: Any, model: type[BaseModel], file: str, marks: Optional[dict] = None):
    marks = marks or {}
    if not isinstance(data, dict):
        raise ConfigError(file, [Problem("", f"expected a mapping at the top level, got {type(data).__name__}", 1, 1)])
    try:
        return model.model_validate(data)
    except ValidationError as err:
        problems = _problems_from_validation(err, model, marks)
    # Field errors stop pydantic before the combination checks; run those on the raw data so every
    # problem is reported in one go.
    check = getattr(model, "combination_problems", None)
    if check is not None:
        combos = check(data)
        messages = {msg for _, msg in combos}
        # pydantic reported these at the model root (maybe split at '; '); re-add them with their own key path
        problems = [p for p in problems if not any(p.message in m for m in messages)]
        for loc, msg in combos:
            line, col = find_mark(marks, loc)
            problems.append(Problem(_dotted(loc), msg, line, col))
    problems.sort(key=lambda p: (p.line or 0, p.column or 0))
    raise ConfigError(file, problems)


def override(data: Any, overrides, path, shown_prefix: str = "") -> list[tuple[str, str]]:
    """Apply `--set` overrides to loaded data; a bad one is a problem named by its `--set`. Returns
    (dotted key, the override as the user wrote it) for validate_data to name later problems by."""
    if isinstance(data, dict) and overrides:
        try:
            apply_overrides(data, list(overrides))
        except ValueError as e:
            raise ConfigError(str(path), [Problem("--set", str(e))]) from None
    sets = []
    for o in overrides:
        try:
            sets.append((".".join(parse_set(o)[0]), shown_prefix + o))
        except ValueError:
            pass
    return sets


def load_model(path: str | os.PathLike, model: type[BaseModel], overrides: tuple[str, ...] = (),
               shown_prefix: str = ""):
    data, marks = load_yaml(path)
    sets = override(data, overrides, path, shown_prefix)
    return validate_data(data, model, str(path), marks, sets)


def model_help(model: type[BaseModel], prefix: str = "") -> list[str]:
    """One line per option: dotted key, default and meaning (used by `--help`)."""
    lines = []
    for name, f in model.model_fields.items():
        sub = _unwrap(f.annotation)
        key = f"{prefix}{name}"
        if isinstance(sub, type) and issubclass(sub, BaseModel) and sub is not model and name not in ("sections", "sources"):
            lines.extend(model_help(sub, key + "."))
            continue
        default = "required" if f.is_required() else repr(f.get_default(call_default_factory=True))
        lines.append(f"  {key:<40} {f.description or ''} [default: {default}]")
    return lines
