"""Records to token ids and labels: sections, sources, mask rules, filters and truncation.

One `Processor` per (pipeline, tokenizer). `process_batch` takes a batch of records and returns,
per record, a `RecordOutput` (kept: one or more `TokenSeq` per source), a `Filtered` (dropped with a
reason) or a `RecordError` (bad input).
Texts of the whole batch are tokenized together with `encode_batch` (the Rust tokenizer's threads).

Sections (single output) or sources (one token sequence per named source) are built the same way:
- template sections render the field's messages (a list of fields is concatenated, e.g.
  [prompt, chosen]) once with the chat template; labels come from `astrai.data.mask`;
- train/mask sections tokenize the field's text on its own and concatenate (prompt/completion
  data: this is how the prompt is tokenized at inference, so the boundary is the real one);
- value sections copy a raw value (a reward, a score) without tokenizing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Iterator, Optional, Union

import numpy as np

from astrai.config.pipeline import Pipeline, Section
from astrai.errors import RecordError
from astrai.data.mask import (
    RenderedChat, TokenSpans, label_tokens, message_of_tokens, prompt_probe, render_with_regions,
)
from astrai.text.template import ChatTemplate, resolve_template
from astrai.text.tokenizer import Tokenizer, with_added_tokens
from astrai.data.turns import answer_sources, empty_messages, end_answer, end_of_turn_id
from astrai.data.messages import read_messages, section_fields
from astrai.data.values import check_unicode, check_value, type_name
from astrai.schema import IGNORE_INDEX, value_column

ITEM = "$item"


@dataclass
class TokenSeq:
    """One token sequence (a document, in packing terms) with its labels and what inspect/stats need."""

    input_ids: np.ndarray
    labels: Optional[np.ndarray]
    token_msg: np.ndarray  # message index per token (-1: template text / non-chat section)
    roles: list[str]  # role of each message index
    truncated: int = 0

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def trained(self) -> int:
        return len(self.input_ids) if self.labels is None else int((self.labels != IGNORE_INDEX).sum())


@dataclass
class RecordOutput:
    """What one kept record produces: its token sequences per source, its values, its domain."""

    # "" for single output, source names otherwise. Always a list: one sequence per record for a
    # plain source, one per item for a list source (Processor.list_sources says which is which).
    seqs: dict[str, list[TokenSeq]]
    values: dict[str, Any] = field(default_factory=dict)
    domain: Optional[str] = None
    chars: int = 0

    def seq(self, source: str = "") -> TokenSeq:
        """The sequence of a plain (not list) source; the only one of a single-output pipeline."""
        (one,) = self.seqs[source]
        return one


@dataclass
class Filtered:
    reason: str
    detail: str = ""


Result = Union[RecordOutput, Filtered, RecordError]


@dataclass
class _Part:
    text: str
    add_special: bool
    train: bool
    chat: Optional[RenderedChat] = None
    roles: list[str] = field(default_factory=list)


class Processor:
    def __init__(self, pipeline: Pipeline, tokenizer: Tokenizer, base_dir=None, template: Optional[ChatTemplate] = None):
        self.p = pipeline
        self.tok = with_added_tokens(tokenizer, pipeline.added_tokens)
        self.template = template
        if self.template is None and pipeline.template_spec is not None:
            self.template = resolve_template(pipeline.template_spec, self.tok, base_dir)
        self.special = dict(self.tok.special_tokens_map)
        self.kwargs = dict(pipeline.input.template_kwargs)
        self.gen_prompt, self.answer_lead, after_answer = (
            prompt_probe(self.template, self.special, self.kwargs) if self.template else ("", "", ""))
        self.end_of_turn_id = end_of_turn_id(self.tok, after_answer)
        # Roles outside `mask` are bad input (a typo such as 'asistant' must not train silently), unless
        # the pipeline sets mask_default: then that rule covers every other role.
        self.any_role = pipeline.mask_default is not None
        self.roles_allowed = list(pipeline.mask)  # in the pipeline's order, for messages
        if pipeline.input.single_sections is not None:
            self.sources = {"": (pipeline.input.single_sections, None)}
        else:
            self.sources = {k: (s.sections, s.list_field) for k, s in pipeline.input.sources.items()}
        self.list_sources = {name for name, (_, list_field) in self.sources.items() if list_field is not None}
        self.prompt_groups = _shared_prompt_groups(self.sources)
        # plain-text answers to a chat prompt (GRPO completions) end with the end-of-turn token (turns.py)
        self.answer_sources = answer_sources(self.sources, self.end_of_turn_id)

    @cached_property
    def value_types(self) -> dict[str, tuple[str, bool]]:
        """Value column -> (value_type, one value per list item)."""
        out = {}
        for name, (secs, list_field) in self.sources.items():
            for s in secs:
                if s.action == "value":
                    fld = s.field if isinstance(s.field, str) else s.field[0]
                    out[value_column(name, fld)] = (s.value_type, list_field is not None)
        return out

    @cached_property  # read per record on the hot path
    def has_labels(self) -> bool:
        """False for plain-text pretraining: every section trains all its tokens, so labels are omitted."""
        return any(s.template or s.action == "mask" for secs, _ in self.sources.values() for s in secs)

    # -- public -------------------------------------------------------------------------------

    def process_batch(self, records: list[dict]) -> list[Result]:
        prepared, texts = self._prepare_batch(records)
        return self._assemble_batch(prepared, self._encode(texts))

    def process_stream(self, batches: Iterable[tuple[Any, list[dict]]]) -> Iterator[tuple[Any, list[Result]]]:
        """process_batch over a stream of (key, records), yielding (key, results) in order. A batch is
        encoded in a second thread (the tokenizer releases the GIL) while this one assembles the
        batch before it and prepares the next, so rendering and labelling overlap the encoding."""
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1, thread_name_prefix="astrai-encode") as pool:
            pending = None
            for key, records in batches:
                prepared, texts = self._prepare_batch(records)
                encoding = pool.submit(self._encode, texts)
                if pending is not None:
                    yield pending[0], self._assemble_batch(pending[1], pending[2].result())
                pending = (key, prepared, encoding)
            if pending is not None:
                yield pending[0], self._assemble_batch(pending[1], pending[2].result())

    def _prepare_batch(self, records: list[dict]) -> tuple[list, dict[bool, list[str]]]:
        prepared: list[Union[tuple, Filtered, RecordError]] = []
        texts: dict[bool, list[str]] = {True: [], False: []}
        for rec in records:
            try:
                prepared.append(self._prepare(rec))
            except RecordError as e:
                prepared.append(e)
                continue
            except (RecursionError, _Drop) as e:  # nested too deeply for a template or a check; or filtered
                prepared.append(e.args[0] if isinstance(e, _Drop) else
                                RecordError("too_deep", "the record is nested too deeply to process"))
                continue
            if isinstance(prepared[-1], Filtered):
                continue
            for part in _parts_of(prepared[-1][0]):
                texts[part.add_special].append(part.text)
        return prepared, texts

    def _encode(self, texts: dict[bool, list[str]]) -> dict:
        return {flag: iter(self.tok.tok.encode_batch(t, add_special_tokens=flag)) if t else iter(())
                for flag, t in texts.items()}

    def _assemble_batch(self, prepared: list, encoded: dict) -> list[Result]:
        out: list[Result] = []
        for prep in prepared:
            if isinstance(prep, (Filtered, RecordError)):
                out.append(prep)
                continue
            # every prepared record takes its encodings in order, even if it fails below
            encs = [next(encoded[part.add_special]) for part in _parts_of(prep[0])]
            try:
                out.append(self._assemble(prep, iter(encs)))
            except RecordError as e:
                out.append(e)
        return out

    def process_one(self, record: dict) -> Result:
        return self.process_batch([record])[0]

    # -- prepare: validate, render, collect texts ----------------------------------------------

    def _prepare(self, rec: dict):
        parts_by_source: dict[str, list[list[_Part]]] = {}  # per source: each sequence's parts
        values: dict[str, Any] = {}
        chars = 0
        for name, (sections, list_field) in self.sources.items():
            tokenized = any(sec.action != "value" for sec in sections)  # a value-only source has no tokens
            if list_field is None:
                parts, vals, n = self._prepare_sections(rec, sections, name)
                if tokenized:
                    parts_by_source[name] = [parts]
                chars += n
                values.update(vals)
            else:
                items = _field(rec, list_field)
                if not isinstance(items, list) or not items:
                    raise RecordError("wrong_type", f"must be a non-empty list, got {type_name(items)}", key=list_field)
                all_parts, item_vals = [], {}
                for j, item in enumerate(items):
                    scope = item if isinstance(item, dict) else {ITEM: item}
                    try:
                        parts, vals, n = self._prepare_sections(scope, sections, name)
                    except RecordError as e:
                        inner = f".{e.key}" if e.key and e.key != ITEM else ""
                        raise e.at_key(f"{list_field}[{j}]{inner}") from None
                    all_parts.append(parts)
                    chars += n
                    for k, v in vals.items():
                        item_vals.setdefault(k, []).append(v)
                if tokenized:
                    parts_by_source[name] = all_parts
                values.update(item_vals)
        pp = self.p.preprocessing
        if pp.min_chars is not None and chars < pp.min_chars:
            return Filtered("too_short", f"{chars} chars < min_chars {pp.min_chars}")
        if pp.max_chars is not None and chars > pp.max_chars:
            return Filtered("too_long", f"{chars} chars > max_chars {pp.max_chars}")
        domain = None
        if self.p.output.domain_key:
            d = rec.get(self.p.output.domain_key)
            domain = None if d is None else str(d)
        return parts_by_source, values, domain, chars

    def _prepare_sections(self, rec: dict, sections: list[Section], source: str):
        parts: list[_Part] = []
        values: dict[str, Any] = {}
        chars = 0
        first = True  # the tokenizer's specials (BOS) go only at the very start of a sequence
        for s in sections:
            if s.action == "value":
                fld = s.field if isinstance(s.field, str) else s.field[0]
                values[value_column(source, fld)] = check_value(_field(rec, fld), s.value_type, fld)
                continue
            if s.template:
                msgs, n_prompt = read_messages(rec, s, self.roles_allowed, self.any_role)
                trained = self._trained_flags(msgs, s)
                trained[:n_prompt] = [False] * n_prompt
                detail = empty_messages(msgs, trained, self.p.preprocessing.empty_message)  # masks them, or:
                if detail:
                    raise _Drop(Filtered("empty_message", detail))
                # tools are optional per record: a missing or null field renders no tools
                tools = rec.get(self.p.input.tools_field) if self.p.input.tools_field else None
                chat = render_with_regions(self.template, msgs, trained, add_generation_prompt=s.add_generation_prompt,
                                           tools=tools, special_tokens=self.special, template_kwargs=self.kwargs,
                                           gen_prompt=self.gen_prompt, answer_lead=self.answer_lead)
                check_unicode(chat.text, section_fields(s)[-1])
                chars += sum(len(m.get("content") or "") for m in msgs)
                parts.append(_Part(chat.text, bool(s.add_special_tokens), any(trained), chat,
                                   [str(m.get("role")) for m in msgs]))
                first = False
            else:
                text = _field(rec, s.field)
                if not isinstance(text, str):
                    raise RecordError("wrong_type", f"must be a string, got {type_name(text)}", key=s.field)
                check_unicode(text, s.field)
                add_special = s.add_special_tokens if s.add_special_tokens is not None else first
                first = False
                chars += len(text)
                parts.append(_Part(s.separator + text, add_special, s.action == "train"))
        return parts, values, chars

    def _trained_flags(self, msgs: list[dict], s: Section) -> list[bool]:
        flags = []
        for m in msgs:
            if s.mask_key is not None and m.get(s.mask_key) is not None:
                flags.append(bool(m[s.mask_key]))
            elif s.action == "$role":
                flags.append(self.p.mask.get(m["role"], self.p.mask_default) == "train")
            else:
                flags.append(s.action == "train")
        return flags

    # -- assemble: labels, truncation ---------------------------------------------------------

    def _assemble(self, prep, encs) -> Union[RecordOutput, Filtered]:
        parts_by_source, values, domain, chars = prep
        eot, policy = self.end_of_turn_id, self.p.preprocessing.end_of_turn
        seqs = {name: [self._truncate(end_answer(self._join(p, encs), eot, policy) if name in self.answer_sources
                                      else self._join(p, encs)) for p in parts]
                for name, parts in parts_by_source.items()}
        if self.has_labels:
            for name, group in seqs.items():
                for one in group:
                    if self.source_trains(name) and one.trained == 0:
                        reason = "no_trained_tokens_after_truncation" if one.truncated else "no_trained_tokens"
                        return Filtered(reason, f"{name or 'record'} has no trained token")
        for group in self.prompt_groups:
            for other in group[1:]:
                _check_shared_prompt(group[0], seqs[group[0]][0], other, seqs[other][0])
        return RecordOutput(seqs, values, domain, chars)

    def source_trains(self, name: str) -> bool:
        secs, _ = self.sources[name]
        return any(s.action in ("train", "$role") for s in secs)

    def _join(self, parts: list[_Part], encs) -> TokenSeq:
        ids_l, lab_l, msg_l, roles = [], [], [], []
        for part in parts:
            enc = next(encs)
            ids = np.asarray(enc.ids, dtype=np.int32)
            if part.chat is not None:
                spans = TokenSpans(enc, len(part.text))
                if part.train:
                    labels = label_tokens(part.chat, ids, spans, self.tok.special_ids,
                                          self.p.preprocessing.end_of_turn)
                else:
                    labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int32)
                tm = message_of_tokens(part.chat, spans)
                tm[tm >= 0] += len(roles)
                msg_l.append(tm)
                roles.extend(part.roles)
            else:
                labels = ids.copy() if part.train else np.full(len(ids), IGNORE_INDEX, dtype=np.int32)
                msg_l.append(np.full(len(ids), -1, dtype=np.int32))
            ids_l.append(ids)
            lab_l.append(labels)
        ids = np.concatenate(ids_l) if ids_l else np.zeros(0, np.int32)
        labels = np.concatenate(lab_l) if lab_l else np.zeros(0, np.int32)
        tmsg = np.concatenate(msg_l) if msg_l else np.zeros(0, np.int32)
        return TokenSeq(ids, labels if self.has_labels else None, tmsg, roles)

    def _truncate(self, seq: TokenSeq) -> TokenSeq:
        limit = self.p.preprocessing.max_seq_len
        if limit is None or len(seq) <= limit:
            return seq
        cut = len(seq) - limit
        keep = slice(0, limit) if self.p.preprocessing.truncation_mode == "keep_start" else slice(cut, None)
        labels = None if seq.labels is None else seq.labels[keep]
        return TokenSeq(seq.input_ids[keep], labels, seq.token_msg[keep], seq.roles, seq.truncated + cut)


class _Drop(Exception):
    """Raised while preparing a record that a filter drops; args[0] is its Filtered."""


def _shared_prompt_groups(sources: dict) -> list[list[str]]:
    """Plain sources whose first section renders the same prompt fields before their own answer
    (a template section `field: [prompt, X]`), e.g. DPO's chosen and rejected, whatever their names:
    preference training compares them token for token after a common prompt."""
    groups: dict[tuple, list[str]] = {}
    for name, (sections, list_field) in sources.items():
        first = sections[0] if sections else None
        if (list_field is None and first is not None and first.template and isinstance(first.field, list)
                and len(first.field) > 1):
            groups.setdefault(tuple(first.field[:-1]), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _check_shared_prompt(name_a: str, a: TokenSeq, name_b: str, b: TokenSeq):
    """The tokens before the first trained token must be the same in both sequences."""
    def prompt(s: TokenSeq) -> np.ndarray:
        trained = np.flatnonzero(s.labels != IGNORE_INDEX) if s.labels is not None else np.array([0])
        return s.input_ids[: trained[0] if len(trained) else len(s.input_ids)]

    pa_, pb = prompt(a), prompt(b)
    if len(pa_) != len(pb) or not np.array_equal(pa_, pb):
        raise RecordError("prompt_mismatch", f"{name_a} and {name_b} do not share the exact prompt tokens "
                                             f"({len(pa_)} vs {len(pb)} tokens before the answer)")


def _parts_of(parts_by_source) -> list[_Part]:
    return [part for groups in parts_by_source.values() for parts in groups for part in parts]


def _field(rec: dict, name: str):
    if name not in rec:
        raise RecordError("missing_field", "field is missing", key=name)
    return rec[name]
