"""Pipeline and recipe configuration: one declaration per option.

The YAML files, the CLI (`--set a.b=c`) and the Python API all read these pydantic models, so an
option is declared once, here, with its default and a one-line meaning next to it.

Loading guarantees:
- safe YAML only (no tags that construct Python objects);
- every problem is reported at once, each with its dotted key path and YAML line:column;
- unknown keys are errors with a "did you mean" suggestion;
- invalid combinations are rejected before any work and name the fix.

NOTE: this module imports neither torch nor anything under astrai.train/astrai.infer.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from astrai import yaml_bounded

# ----------------------------------------------------------------------------------------------
# Errors


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


class _StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# ----------------------------------------------------------------------------------------------
# Pipeline

Action = Literal["train", "mask", "$role", "value"]
TrainOrMask = Literal["train", "mask"]


class Section(_StrictModel):
    field: Union[str, list[str]] = Field(
        description="record field to read; a list of message fields is joined into one conversation "
        "(e.g. [prompt, chosen]) whose messages from all but the last field are prompt: never trained"
    )
    action: Action = Field("train", description="train | mask | $role (role rules, needs template) | value (copy raw)")
    template: bool = Field(False, description="render the field's messages with the chat template")
    add_special_tokens: Optional[bool] = Field(
        None, description="let the tokenizer add BOS/EOS; default: true only for a plain first section of the sequence"
    )
    add_generation_prompt: bool = Field(False, description="template sections: end the render with the assistant header")
    mask_key: Optional[str] = Field(
        None, description="template sections: per-message boolean field; true = train, false = mask (overrides role rule)"
    )
    separator: str = Field("", description="non-template sections: text placed before this section's text")
    value_type: Literal["float", "float_list", "int", "string", "bool"] = Field(
        "float", description="value sections: the column type (float is float32: a reward of 0.8 stays 0.8)"
    )


class Source(_StrictModel):
    sections: list[Section] = Field(description="how this output's tokens are built, as in input.sections")
    list_field: Optional[str] = Field(
        None, description="record field holding a list; sections read each item (field: $item for plain strings)"
    )


class InputConfig(_StrictModel):
    sections: Optional[list[Section]] = Field(None, description="single-output mode: one token sequence per record")
    sources: Optional[dict[str, Source]] = Field(
        None, description="multi-output mode: one token sequence per named source (DPO pairs, GRPO groups)"
    )
    tools_field: Optional[str] = Field(None, description="record field holding the tools list passed to the template")
    template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra variables passed to the chat template (e.g. enable_thinking)"
    )

    @model_validator(mode="after")
    def _one_mode(self):
        if (self.sections is None) == (self.sources is None):
            raise ValueError(
                "give exactly one of input.sections (single output) or input.sources (DPO/GRPO multi-output)"
            )
        return self


class Preprocessing(_StrictModel):
    max_seq_len: Optional[int] = Field(None, gt=0, description="longest document in tokens; longer ones are truncated")
    min_chars: Optional[int] = Field(None, ge=0, description="drop records whose text is shorter (reason: too_short)")
    max_chars: Optional[int] = Field(None, gt=0, description="drop records whose text is longer (reason: too_long)")
    max_items: Optional[int] = Field(None, gt=0, description="read at most this many input records (in input order)")
    batch_size: int = Field(1000, gt=0, description="records per Arrow batch read and tokenized together")
    packing_strategy: Literal["none", "simple", "bfd", "bfd_split"] = Field(
        "none", description="none | simple (next-fit, input order) | bfd (best-fit decreasing) | bfd_split"
    )
    max_packed_len: Optional[int] = Field(None, gt=0, description="tokens per packed row; default max_seq_len")
    truncation_mode: Literal["keep_start", "keep_end"] = Field(
        "keep_start", description="which end of an over-long document is kept"
    )
    end_of_turn: TrainOrMask = Field("train", description="train or mask the end-of-turn token(s) after trained messages")
    empty_message: Literal["filter", "mask", "train"] = Field(
        "filter", description="a trained message with no text: filter the record (reason empty_message), mask the "
                              "message, or train its end-of-turn token alone"
    )
    on_error: Literal["raise", "skip"] = Field(
        "raise", description="bad record: raise (stop with file:line) or skip (write it to rejects.jsonl)"
    )
    partition_bytes: int = Field(
        32 << 20, gt=0, description="input bytes per work partition (the unit of parallelism and resume)"
    )


class Output(_StrictModel):
    format: Literal["parquet"] = Field("parquet", description="shard format")
    max_tokens_per_shard: int = Field(50_000_000, gt=0, description="a new shard starts past this many tokens")
    row_group_rows: int = Field(1024, gt=0, description="rows per Parquet row group (streaming granularity)")
    position_ids_mode: Literal["none", "doc_reset", "continuous"] = Field(
        "doc_reset", description="none | doc_reset (restart at 0 per document) | continuous"
    )
    domain_key: Optional[str] = Field(None, description="record field whose value is counted per domain in stats.json")


DEFAULT_MASK = {"system": "mask", "user": "mask", "assistant": "train", "tool": "mask"}


class Pipeline(_StrictModel):
    version: Literal[1] = Field(description="pipeline format version")
    tokenizer: Optional[str] = Field(None, description="HF tokenizer directory (or --tokenizer / the recipe)")
    chat_template: Optional[str] = Field(
        None, description="'tokenizer' (from tokenizer_config.json), a .jinja path, or a bundled name (chatml, llama3, qwen, mistral)"
    )
    added_tokens: list[str] = Field(
        default_factory=list, description="special tokens the template needs that the tokenizer lacks (e.g. <|im_end|>)"
    )
    input: InputConfig
    mask: dict[str, TrainOrMask] = Field(default_factory=lambda: dict(DEFAULT_MASK), description="role -> train|mask")
    mask_default: TrainOrMask = Field(
        "mask", description="rule for roles not in mask; set it explicitly to accept such roles (else unknown_role)"
    )
    preprocessing: Preprocessing = Field(default_factory=Preprocessing)
    output: Output = Field(default_factory=Output)

    @model_validator(mode="after")
    def _combinations(self):
        problems = pipeline_combination_problems(self.model_dump())
        if problems:
            raise ValueError("; ".join(m for _, m in problems))
        return self

    @property
    def packed_len(self) -> Optional[int]:
        return self.preprocessing.max_packed_len or self.preprocessing.max_seq_len


# ----------------------------------------------------------------------------------------------
# Recipe


class PreprocessStage(_StrictModel):
    pipeline: str = Field(description="pipeline YAML path, relative to the recipe file")
    inputs: list[str] = Field(description="input files or globs, relative to the recipe file")
    output: str = Field(description="output directory, relative to the recipe file")
    tokenizer: Optional[str] = Field(None, description="overrides the pipeline's tokenizer")
    workers: Optional[int] = Field(None, gt=0, description="parallel workers; default: number of cores")


NOT_LANDED_STAGES = ("train", "eval", "generate")


class Recipe(_StrictModel):
    version: Literal[1] = Field(description="recipe format version")
    name: Optional[str] = Field(None, description="a name for logs")
    preprocess: PreprocessStage
    # Train/eval/generate stages are part of the design (DESIGN.md) but have not landed yet; a recipe
    # that declares one is rejected by validation, never silently ignored.
    train: Optional[dict[str, Any]] = Field(None, description="(not available yet)")
    eval: Optional[dict[str, Any]] = Field(None, description="(not available yet)")
    generate: Optional[dict[str, Any]] = Field(None, description="(not available yet)")

    @model_validator(mode="after")
    def _stages_landed(self):
        problems = recipe_combination_problems(self.model_dump())
        if problems:
            raise ValueError("; ".join(m for _, m in problems))
        return self


def _get(d: Any, *keys, default=None):
    for k in keys:
        if isinstance(d, dict) and k in d:
            d = d[k]
        elif isinstance(d, list) and isinstance(k, int) and 0 <= k < len(d):
            d = d[k]
        else:
            return default
    return d


def pipeline_combination_problems(data: Any) -> list[tuple[tuple, str]]:
    """Invalid option combinations, checked on raw data so they are reported together with type errors."""
    out: list[tuple[tuple, str]] = []
    inp = _get(data, "input", default={}) or {}
    sections, sources = _get(inp, "sections"), _get(inp, "sources")
    if isinstance(inp, dict) and (sections is None) == (sources is None):
        out.append((("input",), "give exactly one of input.sections (single output) or input.sources (DPO/GRPO multi-output)"))
    groups = []
    if isinstance(sections, list):
        groups.append((("input", "sections"), sections))
    if isinstance(sources, dict):
        for name, src in sources.items():
            secs = _get(src, "sections")
            if isinstance(secs, list):
                groups.append((("input", "sources", name, "sections"), secs))
    uses_template = False
    for where, secs in groups:
        if not secs:
            out.append((where, "no sections: declare at least one"))
        elif where == ("input", "sections") and all(isinstance(s, dict) and s.get("action") == "value" for s in secs):
            # a single output is a token sequence; a value rides along with it (it crashed the writer)
            out.append((where, "single-output sections need at least one train, mask or $role section; "
                               "value sections only copy values next to the tokens"))
        for i, s in enumerate(secs):
            if not isinstance(s, dict):
                continue
            at = where + (i,)
            tmpl = s.get("template") is True
            uses_template |= tmpl
            if s.get("action") == "$role" and not tmpl:
                out.append((at + ("action",), "action '$role' needs template: true (role rules apply to rendered messages)"))
            if s.get("action") == "value" and tmpl:
                out.append((at + ("template",), "action 'value' copies a raw value; remove template: true"))
            if s.get("mask_key") and not tmpl:
                out.append((at + ("mask_key",), "mask_key applies to messages; set template: true or remove mask_key"))
            if s.get("add_generation_prompt") and not tmpl:
                out.append((at + ("add_generation_prompt",), "add_generation_prompt needs template: true"))
            if isinstance(s.get("field"), list) and not tmpl:
                out.append((at + ("field",), "a list of fields is only allowed for template sections (messages)"))
            if s.get("separator") and tmpl:
                out.append((at + ("separator",), "separator applies to plain sections; a template section is "
                                                 "rendered exactly as the template says"))
    out += _value_column_problems(sections, sources)
    if uses_template and _get(data, "chat_template") is None:
        out.append(((), "a section has template: true but chat_template is not set (use 'tokenizer', a bundled name or a .jinja path)"))
    pp = _get(data, "preprocessing", default={}) or {}
    strategy = _get(pp, "packing_strategy", default="none")
    mpl, msl = _get(pp, "max_packed_len"), _get(pp, "max_seq_len")
    if strategy in ("simple", "bfd", "bfd_split"):
        if mpl is None and msl is None:
            out.append((("preprocessing", "packing_strategy"), f"packing_strategy '{strategy}' needs preprocessing.max_packed_len (or max_seq_len)"))
        if sources is not None:
            out.append((("preprocessing", "packing_strategy"), "packing applies to single-output pipelines; set packing_strategy: none with input.sources"))
    if isinstance(mpl, int) and isinstance(msl, int) and msl > mpl and strategy == "bfd":
        out.append((("preprocessing", "max_seq_len"), "max_seq_len is larger than max_packed_len: lower max_seq_len or use packing_strategy: bfd_split"))
    has_values = any(isinstance(s, dict) and s.get("action") == "value" for _, secs in groups for s in secs)
    if strategy != "none" and has_values and sources is None:
        out.append((("preprocessing", "packing_strategy"), "value sections are per record; use packing_strategy: none with them"))
    lo, hi = _get(pp, "min_chars"), _get(pp, "max_chars")
    if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
        out.append((("preprocessing", "min_chars"), "min_chars is larger than max_chars: no record could pass"))
    out += _tokenizer_problems(data)
    return out


def _tokenizer_problems(data: Any, at: tuple = ("tokenizer",)) -> list[tuple[tuple, str]]:
    from astrai.data.tokenizer import package_spec_problem  # stdlib-only module: config stays light

    problem = package_spec_problem(_get(data, *at))
    return [(at, problem)] if problem else []


TOKEN_COLUMNS = ("input_ids", "labels", "position_ids", "seq_lens")


def _value_column_problems(sections: Any, sources: Any) -> list[tuple[tuple, str]]:
    """A value's column is named after its field (single output) or its source (multi-output); the
    writer would silently replace a token column, or an earlier value of the same source, with it."""
    def values(secs):
        return [(i, s) for i, s in enumerate(secs if isinstance(secs, list) else [])
                if isinstance(s, dict) and s.get("action") == "value"]

    out = []
    for i, s in values(sections):
        if s.get("field") in TOKEN_COLUMNS:
            out.append((("input", "sections", i, "field"), f"a value is written to a column named after its field, "
                                                           f"and '{s['field']}' is a token column of the output; "
                                                           f"rename the field in the records"))
    if isinstance(sources, dict):
        taken = {f"{name}_{col}" for name in sources for col in ("input_ids", "labels")}
        for name, src in sources.items():
            vals = values(_get(src, "sections"))
            for i, _ in vals[1:]:
                out.append((("input", "sources", name, "sections", i, "field"),
                            f"a source writes one value column (named '{name}'); put each value in its own source"))
            if vals and name in taken:
                out.append((("input", "sources", name), f"source '{name}' writes a value column named '{name}', "
                                                        f"which is a token column of another source; rename it"))
    return out


def recipe_combination_problems(data: Any) -> list[tuple[tuple, str]]:
    return [
        ((s,), f"stage '{s}' is not available in this version of astrai yet; remove it from the recipe")
        for s in NOT_LANDED_STAGES
        if _get(data, s) is not None
    ] + _tokenizer_problems(data, ("preprocess", "tokenizer"))


_COMBINATION_CHECKS: dict = {}  # model -> raw-data check; filled once the models exist

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


def _find_mark(marks: dict, loc: tuple, key: bool = False):
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
            line, col = _find_mark(marks, loc, key=True)
        else:
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, "):]
            if e["type"] not in ("value_error",) and "input" in e and not isinstance(e["input"], (dict, list)):
                msg += f" (got {e['input']!r})"
            line, col = _find_mark(marks, loc)
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
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:  # a person's error (a wrong path), not a traceback
        raise ConfigError(str(path), [Problem("", f"no such file: {path}" if isinstance(e, FileNotFoundError)
                                              else f"cannot read {path}: {e.strerror or e}")]) from None
    try:
        data, node = yaml_bounded.load(text)  # aliases and nesting bounded before anything walks the tree
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line, col = (mark.line + 1, mark.column + 1) if mark else (None, None)
        raise ConfigError(str(path), [Problem("", f"invalid YAML: {getattr(e, 'problem', e)}", line, col)]) from None
    return data, (_marks(node) if node is not None else {})


def validate_data(data: Any, model: type[BaseModel], file: str, marks: Optional[dict] = None):
    marks = marks or {}
    if not isinstance(data, dict):
        raise ConfigError(file, [Problem("", f"expected a mapping at the top level, got {type(data).__name__}", 1, 1)])
    try:
        return model.model_validate(data)
    except ValidationError as err:
        problems = _problems_from_validation(err, model, marks)
    # Field errors stop pydantic before the combination checks; run those on the raw data so every
    # problem is reported in one go.
    check = _COMBINATION_CHECKS.get(model)
    if check is not None:
        combos = check(data)
        messages = {msg for _, msg in combos}
        # pydantic reported these at the model root (maybe split at '; '); re-add them with their own key path
        problems = [p for p in problems if not any(p.message in m for m in messages)]
        for loc, msg in combos:
            line, col = _find_mark(marks, loc)
            problems.append(Problem(_dotted(loc), msg, line, col))
    problems.sort(key=lambda p: (p.line or 0, p.column or 0))
    raise ConfigError(file, problems)


_COMBINATION_CHECKS.update({Pipeline: pipeline_combination_problems, Recipe: recipe_combination_problems})


def _override(data: Any, overrides, path):
    if isinstance(data, dict) and overrides:
        try:
            apply_overrides(data, list(overrides))
        except ValueError as e:
            raise ConfigError(str(path), [Problem("--set", str(e))]) from None


def load_pipeline(path: str | os.PathLike, overrides: tuple[str, ...] = ()) -> Pipeline:
    data, marks = load_yaml(path)
    _override(data, overrides, path)
    return validate_data(data, Pipeline, str(path), marks)


def load_recipe(path: str | os.PathLike, overrides: tuple[str, ...] = ()) -> Recipe:
    data, marks = load_yaml(path)
    _override(data, overrides, path)
    return validate_data(data, Recipe, str(path), marks)


def detect_kind(data: Any) -> str:
    """'recipe' or 'pipeline', from the top-level keys."""
    if isinstance(data, dict) and "preprocess" in data:
        return "recipe"
    return "pipeline"


@dataclass(frozen=True)
class Loaded:
    """A pipeline file, or a recipe with its pipeline, with paths resolved the way every verb needs."""

    recipe: Optional[Recipe]
    pipeline: Pipeline
    pipeline_path: Path
    recipe_dir: Optional[Path] = None

    def recipe_path(self, rel: str) -> str:
        """A path written in the recipe (inputs, output, tokenizer), relative to the recipe file."""
        if rel.startswith("package:") or Path(rel).is_absolute():
            return rel
        return os.path.normpath(self.recipe_dir / rel)

    @property
    def recipe_tokenizer(self) -> Optional[str]:
        tok = self.recipe.preprocess.tokenizer if self.recipe else None
        return self.recipe_path(tok) if tok else None


def split_overrides(overrides) -> tuple[list[str], list[str]]:
    """Recipe overrides, and the `pipeline.KEY=...` ones that go to the recipe's pipeline."""
    recipe = [o for o in overrides if not o.startswith("pipeline.")]
    pipe = [o[len("pipeline."):] for o in overrides if o.startswith("pipeline.")]
    return recipe, pipe


def load_any(path: str | os.PathLike, overrides: tuple[str, ...] = ()) -> Loaded:
    """Load a pipeline or a recipe (by its keys). For a recipe, its pipeline is loaded and checked too,
    and `pipeline.KEY=...` overrides go to that pipeline."""
    data, marks = load_yaml(path)
    if detect_kind(data) != "recipe":
        _override(data, overrides, path)
        return Loaded(None, validate_data(data, Pipeline, str(path), marks), Path(path))
    r_over, p_over = split_overrides(overrides)
    _override(data, r_over, path)
    recipe = validate_data(data, Recipe, str(path), marks)
    pipe_path = Path(path).parent / recipe.preprocess.pipeline
    if not pipe_path.exists():
        line, col = _find_mark(marks, ("preprocess", "pipeline"))
        raise ConfigError(str(path), [Problem("preprocess.pipeline", f"file not found: {pipe_path}", line, col)])
    return Loaded(recipe, load_pipeline(pipe_path, tuple(p_over)), pipe_path, Path(path).parent)


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
