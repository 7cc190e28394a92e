"""The tokenizer stage: train a byte-level BPE on a recipe's own records, write an HF tokenizer dir.

What it guarantees:
- the text it learns from is the records' own text, streamed partition by partition through the
  same readers as preprocessing (never the whole input in memory);
- the chat template's marker tokens (every `<|...|>` literal in the template, e.g. <|im_start|>,
  <|im_end|>) and bos/eos/pad are single special tokens, never split by the BPE;
- the output is a normal Hugging Face tokenizer directory: tokenizer.json plus tokenizer_config.json
  carrying the chat template and the special tokens, so `transformers.AutoTokenizer.from_pretrained`
  and `astrai.text.tokenizer.load_tokenizer` both load it, with the same ids (tests compare them);
- determinism: the same records and options give byte-identical files (BPE merges are chosen by
  count, ties by pair order; the files are written with sorted keys).

A plain encode (`add_special_tokens=True`) starts with bos when `add_bos` is on, so pretraining
documents get a boundary token; chat renders are tokenized without it (the template decides).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterator, Optional

from pydantic import BaseModel, ConfigDict, Field

from astrai.errors import InputError, RecordError
from astrai.runtime import atomic_write_text

TEMPLATE_TOKEN = re.compile(r"<\|[A-Za-z0-9_]+\|>")  # ChatML/Llama-3 style marker literals


class TokenizerOptions(BaseModel):
    """Options of a `tokenizer` stage (one declaration: YAML, --set and Python read this model)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    inputs: list[str] = Field(description="record files or globs to learn from (paths relative to the recipe)")
    vocab_size: int = Field(4096, ge=300, description="final vocabulary size, special tokens included")
    min_frequency: int = Field(2, ge=1, description="a merge must occur at least this often")
    chat_template: Optional[str] = Field(
        "chatml", description="bundled name or .jinja path written into tokenizer_config.json; null for none")
    special_tokens: list[str] = Field(
        default_factory=list, description="extra special tokens, beyond the template's <|...|> markers")
    bos_token: Optional[str] = Field("<|begin_of_text|>", description="beginning-of-sequence token; null for none")
    eos_token: str = Field("<|im_end|>", description="end token (generation stops at it)")
    pad_token: str = Field("<|pad|>", description="padding token")
    add_bos: bool = Field(True, description="plain encodes start with bos_token (pretraining document boundary)")
    skip_keys: list[str] = Field(["id", "source"], description="record keys whose strings are not text")
    max_records: Optional[int] = Field(None, gt=0, description="learn from at most this many records")


def record_texts(record, skip_keys: frozenset = frozenset()) -> Iterator[str]:
    """Every string in a record (recursing into messages, lists and dicts), except under skip_keys."""
    if isinstance(record, str):
        if record:
            yield record
    elif isinstance(record, dict):
        for key, value in record.items():  # order is irrelevant to BPE (it counts words)
            if key not in skip_keys:
                yield from record_texts(value, skip_keys)
    elif isinstance(record, list):
        for item in record:
            yield from record_texts(item, skip_keys)


class _Corpus:
    """Streams the texts of the input records and counts what it read (for the stage's metrics)."""

    def __init__(self, inputs: list[str], base_dir, skip_keys, max_records: Optional[int]):
        from astrai.data.read import expand_inputs

        self.files = expand_inputs(list(inputs), base_dir)
        if not self.files:
            raise InputError(f"tokenizer inputs {inputs}: no files found")
        self.skip_keys = frozenset(skip_keys)
        self.max_records = max_records
        self.records = 0
        self.chars = 0

    def __iter__(self) -> Iterator[str]:
        from astrai.data.read import plan_partitions, read_partition

        for part in plan_partitions(self.files, 64 << 20):
            for batch in read_partition(part, 256):
                for record, where in batch:
                    if isinstance(record, RecordError):
                        raise InputError(str(record.located(part.file, where)))
                    if self.max_records is not None and self.records >= self.max_records:
                        return
                    self.records += 1
                    for text in record_texts(record, self.skip_keys):
                        self.chars += len(text)
                        yield text


def special_tokens_for(options: TokenizerOptions, template_source: Optional[str]) -> list[str]:
    """bos, eos, pad, the template's markers in order of appearance, then the extra ones; no duplicates."""
    found = TEMPLATE_TOKEN.findall(template_source or "")
    tokens = [options.bos_token, options.eos_token, options.pad_token, *found, *options.special_tokens]
    return list(dict.fromkeys(t for t in tokens if t))


def train_tokenizer(options: TokenizerOptions, output: str | os.PathLike, base_dir=None) -> dict:
    """Train on the records of `options.inputs` and write the tokenizer directory; returns the metrics."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    template_source = _template_source(options.chat_template, base_dir)
    specials = special_tokens_for(options, template_source)
    corpus = _Corpus(options.inputs, base_dir, options.skip_keys, options.max_records)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=options.vocab_size, min_frequency=options.min_frequency, show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    if corpus.records == 0:
        raise InputError(f"tokenizer inputs {options.inputs}: no records to learn from")
    tok.post_processor = _post_processor(tok, options, processors)

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_json = json.loads(tok.to_str())
    _write_json(out / "tokenizer.json", tokenizer_json)
    _write_json(out / "tokenizer_config.json", _tokenizer_config(tok, options, specials, template_source))
    return {"records": corpus.records, "chars": corpus.chars, "vocab_size": tok.get_vocab_size(),
            "special_tokens": len(specials)}


def _post_processor(tok, options: TokenizerOptions, processors):
    # ByteLevel keeps offsets exact (no prefix-space trimming): masks rely on character offsets.
    byte_level = processors.ByteLevel(trim_offsets=False)
    if not (options.add_bos and options.bos_token):
        return byte_level
    bos = options.bos_token
    template = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                             special_tokens=[(bos, tok.token_to_id(bos))])
    return processors.Sequence([byte_level, template])


def _tokenizer_config(tok, options: TokenizerOptions, specials: list[str], template_source: Optional[str]) -> dict:
    decoder = {}
    for token in specials:
        decoder[str(tok.token_to_id(token))] = {"content": token, "lstrip": False, "normalized": False,
                                                "rstrip": False, "single_word": False, "special": True}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "bos_token": options.bos_token,
        "eos_token": options.eos_token,
        "pad_token": options.pad_token,
        "unk_token": None,
        "add_bos_token": bool(options.add_bos and options.bos_token),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000_000,
    }
    if template_source is not None:
        config["chat_template"] = template_source
    return config


def _template_source(spec: Optional[str], base_dir) -> Optional[str]:
    if spec is None:
        return None
    if spec == "tokenizer":
        raise InputError("tokenizer stage: chat_template 'tokenizer' means 'the template of the tokenizer being "
                         "trained', which does not exist yet; name a bundled template (e.g. chatml) or a .jinja")
    from astrai.text.template import resolve_template

    return resolve_template(spec, base_dir=base_dir).source


def _write_json(path: Path, data: dict):
    # Written under a temporary name then renamed: a killed run never leaves half a file behind.
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def run_tokenizer_stage(ctx) -> dict:
    """The recipe entry: train on the stage's inputs (relative to the recipe) into its output dir."""
    metrics = train_tokenizer(ctx.options, ctx.output, base_dir=ctx.base_dir)
    ctx.log(f"vocabulary of {metrics['vocab_size']} from {metrics['records']} records ({metrics['chars']} chars)")
    return metrics
