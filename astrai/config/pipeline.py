"""The pipeline model: how records become token sequences, and how they are packed and written.

One declaration per option: the YAML files, the CLI (`--set a.b=c`, `--help`) and the Python API
read these pydantic models, each option with its default and a one-line meaning next to it. The
combination checks (which options cannot go together, and the fix) sit right below the models.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal, Optional, Union

from pydantic import Field, PositiveInt, model_validator

from astrai.config.formats import FORMAT_NAMES, format_section
from astrai.config.loading import (StrictModel, get_in, load_model, load_yaml, override, raise_combination_problems,
                                   validate_data)
from astrai.schema import SOURCE_TOKEN_COLUMNS, TOKEN_COLUMNS, ValueType, source_column, value_column

Action = Literal["train", "mask", "$role", "value"]
TrainOrMask = Literal["train", "mask"]


class Section(StrictModel):
    field: Union[str, list[str], None] = Field(
        None, description="record field to read (required unless messages_from); a list of message fields is "
        "joined into one conversation (e.g. [prompt, chosen]) whose messages from all but the last field are "
        "prompt: never trained"
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
    message_keys: Optional[dict[Literal["role", "content"], str]] = Field(
        None, description="template sections: the keys a message holds its role and content under "
                          "(ShareGPT: {role: from, content: value}); default {role: role, content: content}"
    )
    roles: dict[str, str] = Field(
        default_factory=dict, description="template sections: rename roles as they are read (ShareGPT: {human: user, "
                                          "gpt: assistant}); a role not listed passes through unchanged"
    )
    messages_from: Optional[dict[str, Union[str, list[str]]]] = Field(
        None, description="template sections without field: one message per role from plain fields, in this order "
                          "(Alpaca: {system: system, user: [instruction, input], assistant: output}); a role's fields "
                          "are joined by a blank line, missing or blank ones left out"
    )
    separator: str = Field("", description="non-template sections: text placed before this section's text")
    value_type: ValueType = Field(
        "float", description="value sections: the column type (float is float32: a reward of 0.8 stays 0.8)"
    )


class Source(StrictModel):
    sections: list[Section] = Field(description="how this output's tokens are built, as in input.sections")
    list_field: Optional[str] = Field(
        None, description="record field holding a list; sections read each item (field: $item for plain strings)"
    )


InputFormat = Literal[FORMAT_NAMES]  # type: ignore[valid-type]


class InputConfig(StrictModel):
    format: Optional[InputFormat] = Field(
        None, description="a chat format by name, instead of sections: messages | sharegpt | alpaca | "
                          "prompt_completion (astrai/config/formats.py; rendered with chat_template)"
    )
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
        if sum(x is not None for x in (self.format, self.sections, self.sources)) != 1:
            raise ValueError(ONE_MODE)
        return self

    @property
    def single_sections(self) -> Optional[list[Section]]:
        """A single-output pipeline's sections: input.sections, or the one input.format stands for."""
        if self.format is not None:
            return [Section(**format_section(self.format))]
        return self.sections


ONE_MODE = ("give exactly one of input.format (a chat format by name), input.sections (single output) or "
            "input.sources (DPO/GRPO multi-output)")


class Preprocessing(StrictModel):
    max_seq_len: Optional[int] = Field(None, gt=0, description="longest document in tokens; longer ones are truncated")
    min_chars: Optional[int] = Field(None, ge=0, description="drop records whose text is shorter (reason: too_short)")
    max_chars: Optional[int] = Field(None, gt=0, description="drop records whose text is longer (reason: too_long)")
    max_items: Optional[int] = Field(None, gt=0, description="read at most this many input records (in input order)")
    max_record_bytes: int = Field(64 << 20, gt=0, description="longest JSONL line in bytes; a longer one is a "
                                                              "located reject (record_too_large), never read whole")
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
    max_reject_share: float = Field(
        0.5, ge=0, le=1, description="fail the run (after writing rejects.jsonl) when more records than this share "
                                     "are rejected, or none is kept"
    )
    partition_bytes: Union[Literal["auto"], PositiveInt] = Field(
        "auto", description="input bytes per work partition (the unit of parallelism and resume); auto: the "
                            "inputs' total size / 64, within 1-32 MiB (so a small dataset still feeds every worker)"
    )


class Output(StrictModel):
    format: Literal["parquet"] = Field("parquet", description="shard format")
    max_tokens_per_shard: int = Field(50_000_000, gt=0, description="a new shard starts past this many tokens")
    row_group_rows: int = Field(1024, gt=0, description="rows per Parquet row group (streaming granularity)")
    position_ids_mode: Literal["none", "doc_reset", "continuous"] = Field(
        "doc_reset", description="none | doc_reset (restart at 0 per document) | continuous"
    )
    domain_key: Optional[str] = Field(None, description="record field whose value is counted per domain in stats.json")



DEFAULT_MASK = {"system": "mask", "user": "mask", "assistant": "train", "tool": "mask"}


class Pipeline(StrictModel):
    version: Literal[1] = Field(description="pipeline format version")
    tokenizer: Optional[str] = Field(None, description="HF tokenizer directory (or --tokenizer / the recipe)")
    chat_template: Optional[str] = Field(
        None, description="'tokenizer' (the model's own: tokenizer_config.json or chat_template.jinja), a .jinja "
                          "path, or a bundled name (chatml, llama3, qwen, mistral); default: tokenizer"
    )
    chat_template_mismatch: Literal["refuse", "allow"] = Field(
        "refuse", description="a template other than the model's own (the data would be rendered unlike at "
                              "serve time): refuse before any work, or allow"
    )
    added_tokens: list[str] = Field(
        default_factory=list, description="special tokens the template needs that the tokenizer lacks (e.g. <|im_end|>)"
    )
    input: InputConfig
    mask: dict[str, TrainOrMask] = Field(default_factory=lambda: dict(DEFAULT_MASK), description="role -> train|mask")
    mask_default: Optional[TrainOrMask] = Field(
        None, description="rule for roles not in mask; unset, such a role (a typo: 'asistant') rejects its record "
                          "as unknown_role"
    )
    preprocessing: Preprocessing = Field(default_factory=Preprocessing)
    output: Output = Field(default_factory=Output)

    @model_validator(mode="after")
    def _combinations(self):
        return raise_combination_problems(self)

    @property
    def uses_template(self) -> bool:
        sections = list(self.input.single_sections or [])
        sections += [s for src in (self.input.sources or {}).values() for s in src.sections]
        return any(s.template for s in sections)

    @property
    def template_spec(self) -> Optional[str]:
        """The template that renders the messages: chat_template, else the tokenizer's own (None when
        no section uses a template: nothing is rendered)."""
        return (self.chat_template or "tokenizer") if self.uses_template else None

    @property
    def bin_capacity(self) -> Optional[int]:
        """The most tokens a packed row holds: max_packed_len, else max_seq_len (None: unbounded)."""
        return self.preprocessing.max_packed_len or self.preprocessing.max_seq_len

    @classmethod
    def combination_problems(cls, data: Any) -> list[tuple[tuple, str]]:
        return pipeline_combination_problems(data)


def pipeline_combination_problems(data: Any) -> list[tuple[tuple, str]]:
    """Invalid option combinations, checked on raw data so they are reported together with type errors."""
    out: list[tuple[tuple, str]] = []
    inp = get_in(data, "input", default={}) or {}
    fmt, sections, sources = get_in(inp, "format"), get_in(inp, "sections"), get_in(inp, "sources")
    if isinstance(inp, dict) and sum(x is not None for x in (fmt, sections, sources)) != 1:
        out.append((("input",), ONE_MODE))
    groups = []
    if fmt in FORMAT_NAMES and sections is None:
        sections = [format_section(fmt)]
        groups.append((("input", "format"), sections))
    elif isinstance(sections, list):
        groups.append((("input", "sections"), sections))
    if isinstance(sources, dict):
        for name, src in sources.items():
            secs = get_in(src, "sections")
            if isinstance(secs, list):
                groups.append((("input", "sources", name, "sections"), secs))
    for where, secs in groups:
        if not secs:
            out.append((where, "no sections: declare at least one"))
        elif where[:2] == ("input", "sections") and all(isinstance(s, dict) and s.get("action") == "value" for s in secs):
            # a single output is a token sequence; a value rides along with it (it crashed the writer)
            out.append((where, "single-output sections need at least one train, mask or $role section; "
                               "value sections only copy values next to the tokens"))
        for i, s in enumerate(secs):
            if not isinstance(s, dict):
                continue
            at = where + (i,) if where[-1] != "format" else where
            tmpl = s.get("template") is True
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
            out += _message_source_problems(s, at, tmpl, get_in(data, "mask"), get_in(data, "mask_default"))
            if s.get("separator") and tmpl:
                out.append((at + ("separator",), "separator applies to plain sections; a template section is "
                                                 "rendered exactly as the template says"))
    out += _value_column_problems(sections, sources)
    pp = get_in(data, "preprocessing", default={}) or {}
    strategy = get_in(pp, "packing_strategy", default="none")
    mpl, msl = get_in(pp, "max_packed_len"), get_in(pp, "max_seq_len")
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
    lo, hi = get_in(pp, "min_chars"), get_in(pp, "max_chars")
    if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
        out.append((("preprocessing", "min_chars"), "min_chars is larger than max_chars: no record could pass"))
    out += tokenizer_problems(data)
    return out


def _message_source_problems(s: dict, at: tuple, tmpl: bool, mask: Any, mask_default: Any) -> list[tuple[tuple, str]]:
    """Where a section's messages come from: field, or (template sections) messages_from, not both;
    message_keys and roles read a list of messages, so they go with field."""
    out = []
    source = s.get("messages_from")
    if s.get("field") is None and source is None:
        out.append((at + ("field",), "field is required (the record field to read)"
                                     + ("; or messages_from: {role: field, ...}" if tmpl else "")))
    if source is not None and s.get("field") is not None:
        out.append((at + ("messages_from",), "give field (a list of messages) or messages_from (plain fields), "
                                             "not both"))
    for key in ("message_keys", "roles", "messages_from"):
        if s.get(key) and not tmpl:
            out.append((at + (key,), f"{key} applies to template sections; set template: true or remove {key}"))
    if source is not None and (s.get("message_keys") or s.get("roles")):
        out.append((at + ("messages_from",), "message_keys and roles read a list of messages (field); with "
                                             "messages_from the roles are its own keys"))
    if isinstance(source, dict) and not source:
        out.append((at + ("messages_from",), "messages_from: give at least one role: field"))
    known = list(mask) if isinstance(mask, dict) else list(DEFAULT_MASK)
    if isinstance(source, dict) and mask_default is None:
        for role in source:
            if role not in known:
                out.append((at + ("messages_from", role), f"role '{role}' is not one of {', '.join(known)} (mask "
                                                          f"rules); add it to mask:"))
    return out


def tokenizer_problems(data: Any, at: tuple = ("tokenizer",)) -> list[tuple[tuple, str]]:
    """A `package:` tokenizer must be a top-level package name: it is located, never imported."""
    problem = package_spec_problem(get_in(data, *at))
    return [(at, problem)] if problem else []


_PACKAGE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(-[A-Za-z0-9_]+)*")


def package_spec_problem(spec) -> Optional[str]:
    """Why a `package:NAME` tokenizer value is not acceptable (None if it is, or is not package:).
    Only a top-level name: finding `a.b` through the import system would import (run) `a`."""
    if not isinstance(spec, str) or not spec.startswith("package:"):
        return None
    name = spec[len("package:"):]
    if "." in name:
        return (f"'{spec}': give a top-level package name (e.g. package:{name.split('.')[0]}), not a dotted "
                f"module path; astrai locates the package's files and never imports it")
    if not _PACKAGE_NAME.fullmatch(name):
        return f"'{spec}': '{name}' is not a package name (letters, digits, '_' and '-')"
    return None


def _value_column_problems(sections: Any, sources: Any) -> list[tuple[tuple, str]]:
    """A value's column is named after its field (single output) or its source (multi-output); the
    writer would silently replace a token column, or an earlier value of the same source, with it."""
    def values(secs):
        return [(i, s) for i, s in enumerate(secs if isinstance(secs, list) else [])
                if isinstance(s, dict) and s.get("action") == "value"]

    out = []
    for i, s in values(sections):
        fld = s.get("field")
        if isinstance(fld, str) and value_column("", fld) in TOKEN_COLUMNS:
            out.append((("input", "sections", i, "field"), f"a value is written to a column named after its field, "
                                                           f"and '{s['field']}' is a token column of the output; "
                                                           f"rename the field in the records"))
    if isinstance(sources, dict):
        taken = {source_column(name, col) for name in sources for col in SOURCE_TOKEN_COLUMNS}
        for name, src in sources.items():
            vals = values(get_in(src, "sections"))
            for i, _ in vals[1:]:
                out.append((("input", "sources", name, "sections", i, "field"),
                            f"a source writes one value column (named '{name}'); put each value in its own source"))
            if vals and value_column(name, "") in taken:
                out.append((("input", "sources", name), f"source '{name}' writes a value column named '{name}', "
                                                        f"which is a token column of another source; rename it"))
    return out


def load_pipeline(path: str | os.PathLike, overrides: tuple[str, ...] = (), shown_prefix: str = "",
                  input_format: Optional[str] = None) -> Pipeline:
    """`shown_prefix`: how the overrides were written (a recipe's `pipeline.`), for their errors.
    `input_format`: read the records in that format instead of the pipeline's own input (a recipe's
    preprocess `format:`); the overrides apply after it."""
    if input_format is None:
        return load_model(path, Pipeline, overrides, shown_prefix)
    data, marks = load_yaml(path)
    if isinstance(data, dict):
        data["input"] = with_format(data.get("input"), input_format)
    return validate_data(data, Pipeline, str(path), marks, override(data, overrides, path, shown_prefix))


def with_format(inp: Any, input_format: str) -> dict:
    """A pipeline's raw `input:` read as `input_format`: its sections, sources or format replaced,
    its other keys (tools_field, template_kwargs) kept."""
    kept = {k: v for k, v in inp.items() if k not in ("format", "sections", "sources")} if isinstance(inp, dict) else {}
    return {**kept, "format": input_format}
