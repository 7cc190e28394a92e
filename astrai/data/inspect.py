"""`astrai inspect`: see exactly which tokens will be trained, before spending GPU hours.

    astrai inspect PIPELINE_OR_RECIPE [-i INPUT] [-n N | --record K ...] [--compare OTHER.yaml]
    astrai inspect OUTDIR [-n N | --record K ...]
        [--format text|json|html] [-o FILE] [--table] [--color auto|always|never]

Two sources, one view:

- records: the first N input records (or the chosen ones, counted from 0 in input order) go
  through the same `Processor` as `astrai preprocess`, so the token ids, labels and the
  filter/reject reasons shown are exactly what preprocess writes. Position ids are those of an
  unpacked document (0..n-1; null when position_ids_mode is none or the pipeline is multi-output).
- a written dataset (a preprocess output directory): rows of the Parquet shards, i.e. bins, their
  documents (from seq_lens) and position ids as written, decoded with the tokenizer recorded in
  manifest.json (plus the pipeline's added_tokens), and the statistics from stats.json.

Only what is shown is read: JSONL inputs are scanned line by line up to the last wanted record and
only wanted lines are parsed; Parquet inputs skip whole row groups by their metadata; dataset rows
come from the row group that holds them. Nothing is planned over the whole input, so a few records
of a huge file come back in about the time it takes to load the tokenizer.

Token text is the exact bytes each token adds, decoded in sequence: a character split over two
byte-level tokens shows on the token that completes it (the other shows ◌), so the texts of a
sequence join to the tokenizer's decode of it. Whitespace is visible: newline ↵, tab ⇥, CR ␍.

Formats. text: colour on a terminal (trained: green background in alternating shades so token
boundaries show; masked: dim; special tokens: bold magenta); elsewhere, or with NO_COLOR, plain
markers ⟦trained⟧ and «special». json: one object per line (kind record | bin | row | stats |
note | compare) with per-token {id, text, trained, position_id, doc, special} (+ msg, role for
records). html: one self-contained page (no network: a Content-Security-Policy forbids loads) with
hover details, the statistics and a length histogram. `--compare` shows a second pipeline beside
the first, turn by turn; tokens are aligned by text, and a token is marked ^ when its label
differs from its counterpart's and + when it is trained and has no counterpart.

Role boundaries are a display aid (the labels never depend on them, and shards do not store
them): a message's turn starts at the special token that introduces its header (in the template
text before the message, the first special token followed by a role name, else the last special
token), or at its text when the template uses no special tokens.
"""

from __future__ import annotations

import codecs
import html
import json
import os
import shutil
import sys
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from functools import cached_property
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from astrai.data.errors import InputError, RecordError

DEFAULT_N = 3
IGNORE = -100  # labels: not trained (as astrai.data.mask.IGNORE)


def add_arguments(p):
    p.add_argument("target", nargs="?", help="pipeline/recipe YAML, or a preprocessed output directory")
    p.add_argument("-i", "--input", dest="inputs", action="append", default=None, metavar="INPUT",
                   help="input file, glob or saved HF dataset dir (repeatable) [default: the recipe's inputs]")
    p.add_argument("-n", dest="n", type=int, default=None, metavar="N",
                   help=f"show the first N records (or dataset rows) [default: {DEFAULT_N}]")
    p.add_argument("--record", dest="records", type=int, action="append", default=None, metavar="K",
                   help="show record (or dataset row) K, counted from 0 in input order (repeatable; replaces -n)")
    p.add_argument("--format", choices=("text", "json", "html"), default="text",
                   help="text, json (one object per line) or html (one self-contained page) [default: text]")
    p.add_argument("-o", "--output", default=None, metavar="FILE", help="write to FILE [default: stdout]")
    p.add_argument("--compare", default=None, metavar="OTHER.yaml",
                   help="show each record under a second pipeline/recipe too, side by side, marking tokens whose "
                        "label differs (--set applies to the first one only)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="HF tokenizer directory [default: the pipeline's, or the one recorded in manifest.json]")
    p.add_argument("--table", action="store_true", help="text: one token per line (id, position, doc, message)")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="text colour [default: auto: on a terminal unless NO_COLOR is set]")
    p.add_argument("--width", type=int, default=None, help="text width for --compare [default: the terminal's]")


def run(args) -> int:
    if not args.target:
        print("astrai inspect: give a pipeline/recipe YAML (with -i INPUT) or a preprocessed output directory",
              file=sys.stderr)
        return 2
    if (args.n is not None and args.n < 1) or (args.records and min(args.records) < 0):
        print("astrai inspect: -n must be at least 1 and --record counts from 0", file=sys.stderr)
        return 2
    wanted = sorted(set(args.records)) if args.records else list(range(args.n or DEFAULT_N))
    explicit = bool(args.records)
    target = Path(args.target)
    if target.is_dir():
        if args.compare:
            raise InputError("--compare runs two pipelines on input records: give a pipeline or recipe, "
                             "not a dataset directory")
        report = dataset_report(target, wanted, args.tokenizer, explicit)
    else:
        overrides = list(getattr(args, "overrides", None) or [])
        report = records_report(str(target), args.inputs, wanted, overrides, args.tokenizer, explicit)
        if args.compare:
            report.other = records_report(args.compare, args.inputs or report.inputs, wanted, [], args.tokenizer)
            add_compare_marks(report, report.other)
    if args.format == "json":
        text = render_json(report)
    elif args.format == "html":
        text = render_html(report)
    else:
        tty = args.output is None and sys.stdout.isatty()
        color = args.color == "always" or (args.color == "auto" and tty and not os.environ.get("NO_COLOR")
                                           and os.environ.get("TERM") != "dumb")
        width = args.width or (shutil.get_terminal_size((160, 40)).columns if tty else 160)
        text = render_text(report, color, width, args.table)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0 if report.entries else 1


# ---------------------------------------------------------------------------------------------
# what is shown


@dataclass
class SeqView:
    """One token sequence as it will be trained: a document (records) or a whole bin (datasets)."""

    ids: np.ndarray
    trained: np.ndarray  # bool per token
    positions: Optional[np.ndarray]  # None: no position ids are written
    docs: np.ndarray  # document index per token, within the bin
    texts: list[str]  # display text per token (TokenText.texts)
    special: np.ndarray  # bool per token: a special token
    msg: Optional[np.ndarray] = None  # message index per token (-1: template text); records only
    roles: list[str] = field(default_factory=list)
    truncated: int = 0
    source: str = ""  # multi-output source name; "" for single output
    item: Optional[int] = None  # index inside a list source (GRPO completions)
    is_bin: bool = False  # a dataset row: its documents are shown with their boundaries

    @property
    def label(self) -> str:
        return self.source + (f"[{self.item}]" if self.item is not None else "")

    def role(self, k: int) -> Optional[str]:
        m = -1 if self.msg is None else int(self.msg[k])
        return self.roles[m] if 0 <= m < len(self.roles) else None

    @cached_property
    def turns(self) -> list[tuple[int, int]]:
        """(first token, message) per message turn, the turn starting at the header that introduces it."""
        if self.msg is None or not (self.msg >= 0).any():
            return []
        content = np.flatnonzero(self.msg >= 0)
        _, first = np.unique(self.msg[content], return_index=True)
        firsts = sorted((int(content[f]), int(self.msg[content[f]])) for f in first)
        out = [(0, firsts[0][1])]
        for k, m in firsts[1:]:
            before = int(np.searchsorted(content, k)) - 1
            run0 = int(content[before]) + 1 if before >= 0 else 0
            specials = [p for p in range(run0, k) if self.special[p]]
            start = k
            for p in specials:
                if p == specials[-1] or (not self.special[p + 1] and self.texts[p + 1].strip()):
                    start = p
                    break
            out.append((max(start, out[-1][0] + 1), m))
        return out

    @cached_property
    def heads(self) -> dict[int, str]:
        """Token index -> the header line shown before it: message turns, or documents inside a bin."""
        if self.turns:
            bounds = [s for s, _ in self.turns] + [len(self.ids)]
            out = {}
            for i, (s, m) in enumerate(self.turns):
                own = self.msg[s:bounds[i + 1]] == m
                state = "trained" if self.trained[s:bounds[i + 1]][own].any() else "masked"
                out[s] = f"[{m}] {self.roles[m] if m < len(self.roles) else '?'} · {state}"
            return out
        if not (self.is_bin and len(self.ids)):
            return {}
        starts = np.flatnonzero(np.diff(self.docs, prepend=-1)).tolist()
        out = {}
        for s, e in zip(starts, starts[1:] + [len(self.ids)]):
            out[s] = f"doc {int(self.docs[s])} · {e - s} tokens · {int(self.trained[s:e].sum())} trained"
            if self.positions is not None:
                out[s] += f" · positions {int(self.positions[s])}‥{int(self.positions[e - 1])}"
        return out

    def segments(self) -> list[tuple[Optional[int], int, int]]:
        """(message or None, start, end): the rows of a side-by-side comparison."""
        turns = self.turns or [(0, None)]
        bounds = [s for s, _ in turns] + [len(self.ids)]
        return [(m, s, bounds[i + 1]) for i, (s, m) in enumerate(turns)]


@dataclass
class Entry:
    """One record (records mode) or one row of the shards (dataset mode)."""

    kind: str  # record | bin | row
    index: int
    where: str
    status: str  # kept | filtered | rejected | excluded | written
    reason: str = ""
    detail: str = ""
    seqs: list[SeqView] = field(default_factory=list)
    values: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seq_lens: Optional[list[int]] = None
    capacity: Optional[int] = None  # bins: max_packed_len when packed
    marks: dict = field(default_factory=dict)  # compare: seq label -> array of '', '^', '+'


@dataclass
class Report:
    title: str
    name: str  # the pipeline/recipe or directory, for column headings
    entries: list[Entry]
    stats: dict
    inputs: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # warnings, missing records, rejects.jsonl excerpt
    other: Optional["Report"] = None
    is_dataset: bool = False


# ---------------------------------------------------------------------------------------------
# token text


def _byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level alphabet (bytes_to_unicode): printable char -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenText:
    """The text each token adds, from its exact bytes (byte-level BPE, byte fallback, or plain pieces)."""

    def __init__(self, tok):
        self.hf = tok.tok
        self.added = {int(i): t.content for i, t in self.hf.get_added_tokens_decoder().items()}
        self.special_ids = frozenset(int(i) for i in tok.special_ids)
        self.byte_of = _byte_decoder() if "ByteLevel" in repr(self.hf.decoder) else {}
        self._bytes: dict[int, bytes] = {}

    def token_bytes(self, i: int) -> bytes:
        if i not in self._bytes:
            piece = self.added.get(i)
            if piece is not None:
                b = piece.encode()
            else:
                piece = self.hf.id_to_token(i)
                if piece is None:
                    b = f"<unk:{i}>".encode()
                elif self.byte_of and all(c in self.byte_of for c in piece):
                    b = bytes(self.byte_of[c] for c in piece)
                elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # byte fallback
                    b = bytes([int(piece[3:5], 16)])
                else:
                    b = piece.replace("\u2581", " ").encode()  # sentencepiece word marker
            self._bytes[i] = b
        return self._bytes[i]

    def view(self, ids, trained, positions, docs, **kw) -> SeqView:
        ids = np.asarray(ids, dtype=np.int64)
        dec = codecs.getincrementaldecoder("utf-8")("replace")  # a split character waits for its last byte
        texts = [dec.decode(self.token_bytes(int(i))) for i in ids]
        if texts:
            texts[-1] += dec.decode(b"", final=True)
        special = np.fromiter((int(i) in self.special_ids for i in ids), dtype=bool, count=len(ids))
        return SeqView(ids, np.asarray(trained, dtype=bool), positions, docs, texts, special, **kw)


_VISIBLE = {"\n": "↵\n", "\t": "⇥", "\r": "␍"}


def visible(text: str) -> str:
    """Display form of a token's text: whitespace made visible, control characters escaped."""
    if not text:
        return "◌"
    return "".join(_VISIBLE.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 32 or ord(c) == 127 else c) for c in text)


# ---------------------------------------------------------------------------------------------
# records mode: a pipeline or recipe, and input records


def records_report(path: str, inputs: Optional[list[str]], wanted: list[int], overrides: list[str],
                   tokenizer: Optional[str], explicit: bool = False) -> Report:
    from astrai.data.process import Processor
    from astrai.data.read import expand_inputs
    from astrai.data.tokenizer import load_tokenizer

    pipeline, pipe_dir, tok_spec, tok_base, recipe_inputs = _load_config(path, overrides, tokenizer)
    inputs = inputs or recipe_inputs
    if not inputs:
        raise InputError(f"{path} is a pipeline: give the records to inspect with -i INPUT (a recipe names its own)")
    proc = Processor(pipeline, load_tokenizer(tok_spec, tok_base), pipe_dir)
    seen: dict = {}
    items = list(read_records(expand_inputs(inputs), wanted, seen))
    found = {i for i, _, _, _ in items}
    notes = [f"record {k}: not in the input (it has {seen.get('records')} records)"
             for k in wanted if explicit and k not in found]
    entries = _process(proc, pipeline, TokenText(proc.tok), items)
    return Report(f"{path} on {', '.join(inputs)}", path, entries, records_stats(entries), list(inputs), notes)


def _load_config(path: str, overrides: list[str], tokenizer: Optional[str]):
    """(pipeline, pipeline dir, tokenizer spec, its base dir, the recipe's inputs) for a pipeline or a recipe."""
    from astrai.config import detect_kind, load_pipeline, load_recipe, load_yaml

    if not Path(path).is_file():
        raise InputError(f"{path}: no such file (give a pipeline/recipe YAML or a preprocessed output directory)")
    data, _ = load_yaml(path)
    spec, tok_base, inputs = None, None, []
    if detect_kind(data) == "recipe":
        # as `astrai run`: `pipeline.KEY=...` overrides go to the recipe's pipeline
        recipe = load_recipe(path, tuple(o for o in overrides if not o.startswith("pipeline.")))
        base = Path(path).parent
        pipe_path = base / recipe.preprocess.pipeline
        if not pipe_path.is_file():
            raise InputError(f"{path}: preprocess.pipeline: no such file {pipe_path}")
        pipeline = load_pipeline(pipe_path, tuple(o[9:] for o in overrides if o.startswith("pipeline.")))
        inputs = [os.path.normpath(base / i) for i in recipe.preprocess.inputs]
        spec, tok_base = recipe.preprocess.tokenizer, base
    else:
        pipe_path = Path(path)
        pipeline = load_pipeline(pipe_path, tuple(overrides))
    if tokenizer:
        # a path typed on the command line is relative to the working directory (else to the pipeline)
        spec, tok_base = tokenizer, Path.cwd() if Path(tokenizer).exists() else pipe_path.parent
    elif not spec:
        spec, tok_base = pipeline.tokenizer, pipe_path.parent
    if not spec:
        raise InputError("no tokenizer: set `tokenizer:` in the pipeline, the recipe, or pass --tokenizer DIR")
    return pipeline, str(pipe_path.parent), spec, tok_base, inputs


def read_records(files: list[Path], wanted: list[int], seen: Optional[dict] = None) -> Iterator[tuple]:
    """(index, record | RecordError, file, where) for the wanted indices, reading only up to the last.

    Indices count records in input order as preprocess reads them (blank JSONL lines are not
    records, unparsable ones are). Unwanted records are skipped without parsing where the format
    allows (JSONL lines, Parquet row groups). When the input ends first, seen["records"] is its size.
    """
    from astrai.data.read import SUFFIX_KINDS

    want, last, idx = set(wanted), max(wanted), 0
    for f in files:
        if idx > last:
            return
        kind = "arrow" if f.is_dir() else SUFFIX_KINDS.get(f.suffix.lower())
        if kind is None:
            raise InputError(f"input {f}: unknown format '{f.suffix}' (expected .jsonl, .json, .parquet or a "
                             f"save_to_disk directory)")
        reader = {"jsonl": _jsonl_records, "parquet": _parquet_records}.get(kind, _whole_records)
        idx = yield from reader(f, idx, want, last)
    if seen is not None and idx <= last:
        seen["records"] = idx


def _jsonl_records(f: Path, idx: int, want: set, last: int):
    from astrai.data.read import Partition, read_partition

    offset, line = 0, 0
    with open(f, "rb") as fh:
        for raw in fh:
            line += 1
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue  # as the reader: a blank line is not a record
            if idx in want:  # parse this line alone, with the reader's own checks and messages
                for batch in read_partition(Partition(0, str(f), "jsonl", start, offset, line), 1):
                    for rec, where in batch:
                        yield idx, rec, str(f), where
            idx += 1
            if idx > last:
                break
    return idx


def _parquet_records(f: Path, idx: int, want: set, last: int):
    import pyarrow.parquet as pq

    from astrai.data.read import Partition, read_partition

    md = pq.ParquetFile(f).metadata
    row0 = 0
    for g in range(md.num_row_groups):
        rows = md.row_group(g).num_rows
        if any(idx <= k < idx + rows for k in want):
            k = idx
            for batch in read_partition(Partition(0, str(f), "parquet", g, g + 1, row0), 64):
                for rec, where in batch:
                    if k in want:
                        yield k, rec, str(f), where
                    k += 1
                if k > last:
                    break
        idx, row0 = idx + rows, row0 + rows
        if idx > last:
            break
    return idx


def _whole_records(f: Path, idx: int, want: set, last: int):
    """JSON files and saved HF datasets: read in order (a JSON document is parsed whole anyway)."""
    from astrai.data.read import plan_partitions, read_partition

    for part in plan_partitions([f], 1 << 62):
        for batch in read_partition(part, 64):
            for rec, where in batch:
                if idx in want:
                    yield idx, rec, part.file, where
                idx += 1
                if idx > last:
                    return idx
    return idx


def _where(file: str, where: str) -> str:
    rel = os.path.relpath(file) if os.path.isabs(file) else file
    shown = file if rel.startswith("..") else rel
    return f"{shown}:{where}" if where.isdigit() else f"{shown} {where}"


def _process(proc, pipeline, tt: TokenText, items) -> list[Entry]:
    from astrai.data.process import Filtered

    pp = pipeline.preprocessing
    todo = [(i, rec) for i, rec, _, _ in items
            if not isinstance(rec, RecordError) and (pp.max_items is None or i < pp.max_items)]
    results = dict(zip([i for i, _ in todo], proc.process_batch([rec for _, rec in todo]))) if todo else {}
    entries = []
    for i, rec, file, where in items:
        e = Entry("record", i, _where(file, where), "kept")
        res = rec if isinstance(rec, RecordError) else results.get(i)
        if res is None:
            e.status, e.reason = "excluded", "max_items"
            e.detail = f"preprocessing.max_items is {pp.max_items}: preprocess reads records 0..{pp.max_items - 1}"
        elif isinstance(res, RecordError):
            err = res.located(file, where)
            e.status, e.reason, e.detail = "rejected", err.reason, str(err)
            if pp.on_error == "raise":
                e.notes.append("on_error is raise: preprocess stops at this record")
        elif isinstance(res, Filtered):
            e.status, e.reason, e.detail = "filtered", res.reason, res.detail
        else:
            _fill_doc(e, res, proc, pipeline, tt)
        entries.append(e)
    return entries


def _fill_doc(e: Entry, doc, proc, pipeline, tt: TokenText):
    multi = pipeline.input.sources is not None
    mode = "none" if multi else pipeline.output.position_ids_mode  # multi-output rows carry no position ids
    for name, seq in doc.seqs.items():
        if all(sec.action == "value" for sec in proc.sources[name][0]):
            continue  # a value-only source (rewards) has no tokens: its values are shown with the record
        for j, s in enumerate(seq) if isinstance(seq, list) else [(None, seq)]:
            n = len(s)
            trained = np.ones(n, bool) if s.labels is None else np.asarray(s.labels) != IGNORE
            pos = None if mode == "none" else np.arange(n, dtype=np.int64)
            e.seqs.append(tt.view(s.input_ids, trained, pos, np.zeros(n, np.int64), msg=np.asarray(s.token_msg),
                                  roles=list(s.roles), truncated=int(s.truncated), source=name, item=j))
    e.values = dict(doc.values)
    pp, packed = pipeline.preprocessing, pipeline.packed_len
    n = len(e.seqs[0].ids) if e.seqs else 0
    if not multi and packed and pp.packing_strategy != "none" and n > packed:
        e.notes.append(f"bfd_split: split over {-(-n // packed)} bins of {packed} tokens"
                       if pp.packing_strategy == "bfd_split" else
                       f"packing cuts {n - packed} more tokens ({pp.truncation_mode}, max_packed_len {packed})")


def records_stats(entries: list[Entry]) -> dict:
    """The stats.json figures for the records shown (same keys, so one renderer serves both)."""
    from astrai.data.preprocess import HIST_EDGES

    c, filt, rej, roles, troles, hist = Counter(), Counter(), Counter(), Counter(), Counter(), Counter()
    for e in entries:
        c[e.status] += 1
        if e.status in ("filtered", "rejected"):
            (filt if e.status == "filtered" else rej)[e.reason] += 1
        for v in e.seqs:
            c["tokens"] += len(v.ids)
            c["trained"] += int(v.trained.sum())
            c["truncated_tokens"] += v.truncated
            c["truncated_docs"] += bool(v.truncated)
            k = int(np.searchsorted(HIST_EDGES, len(v.ids)))
            hist[f"<={HIST_EDGES[k]}" if k < len(HIST_EDGES) else f">{HIST_EDGES[-1]}"] += 1
            for k in range(len(v.ids)):
                role = v.role(k) or "other"
                roles[role] += 1
                troles[role] += bool(v.trained[k])
    tokens = c["tokens"]
    return {"records_read": len(entries) - c["excluded"], "records_kept": c["kept"],
            "records_filtered": c["filtered"], "records_rejected": c["rejected"],
            "filtered_by_reason": dict(filt), "rejected_by_reason": dict(rej), "tokens": tokens,
            "trained_tokens": c["trained"], "supervised_share": c["trained"] / tokens if tokens else None,
            "truncated_tokens": c["truncated_tokens"], "truncated_docs": c["truncated_docs"],
            "tokens_per_role": dict(roles), "trained_tokens_per_role": {k: v for k, v in troles.items() if v},
            "doc_length_histogram": dict(hist)}


# ---------------------------------------------------------------------------------------------
# dataset mode: a preprocess output directory


def dataset_report(out: Path, wanted: list[int], tokenizer: Optional[str], explicit: bool = False) -> Report:
    from astrai.data.tokenizer import load_tokenizer, with_added_tokens

    man_path = out / "manifest.json"
    if not man_path.exists():
        why = "preprocess has not finished (rerun it)" if (out / ".work").exists() else "not a preprocess output"
        raise InputError(f"{out}: no manifest.json: {why}")
    manifest = json.loads(man_path.read_text(encoding="utf-8"))
    stats = json.loads((out / "stats.json").read_text(encoding="utf-8")) if (out / "stats.json").exists() else {}
    pipe = manifest.get("pipeline") or {}
    recorded = manifest.get("tokenizer") or {}
    spec = tokenizer or recorded.get("path")
    if not spec:
        raise InputError(f"{man_path} names no tokenizer: pass --tokenizer DIR")
    try:
        tok = load_tokenizer(spec, Path.cwd())
    except InputError as e:
        raise InputError(f"{e} (the tokenizer recorded in {man_path}; pass --tokenizer DIR)") from None
    notes = []
    if tok.fingerprint != recorded.get("fingerprint"):
        notes.append(f"warning: tokenizer {tok.path} is not the one the dataset was written with (fingerprint "
                     f"differs): token texts may be wrong")
    tt = TokenText(with_added_tokens(tok, pipe.get("added_tokens") or []))
    entries = list(_dataset_rows(out, manifest, wanted, tt))
    if explicit and len(entries) < len(wanted):
        import pyarrow.parquet as pq

        total = sum(pq.ParquetFile(out / s).metadata.num_rows for s in manifest.get("shards", []))
        found = {e.index for e in entries}
        notes += [f"row {k}: not in the dataset (it has {total} rows)" for k in wanted if k not in found]
    notes += _rejects_excerpt(out / "rejects.jsonl")
    return Report(str(out), str(out), entries, stats, [], notes, is_dataset=True)


def _dataset_rows(out: Path, manifest: dict, wanted: list[int], tt: TokenText) -> Iterator[Entry]:
    """Rows by global index (shards in manifest order), reading only the row groups that hold them."""
    import pyarrow.parquet as pq

    pipe = manifest.get("pipeline") or {}
    want, base = sorted(wanted), 0
    for shard in manifest.get("shards", []):
        pf = pq.ParquetFile(out / shard)
        for g in range(pf.metadata.num_row_groups):
            rows = pf.metadata.row_group(g).num_rows
            here = [k for k in want if base <= k < base + rows]
            if here:
                table = pf.read_row_group(g)
                for k in here:
                    row = table.slice(k - base, 1).to_pylist()[0]
                    where = f"{shard} row {k - base}"
                    yield _bin_entry(row, k, where, pipe, tt) if "input_ids" in row else _row_entry(row, k, where,
                                                                                                    pipe, tt)
            base += rows
            want = [k for k in want if k >= base]
            if not want:
                return


def _bin_entry(row: dict, index: int, where: str, pipe: dict, tt: TokenText) -> Entry:
    from astrai.data.write import positions

    ids, labels = row["input_ids"], row.get("labels")
    trained = np.ones(len(ids), bool) if labels is None else np.asarray(labels) != IGNORE
    seq_lens = [int(x) for x in (row.get("seq_lens") or [len(ids)])]
    pos = None if row.get("position_ids") is None else np.asarray(row["position_ids"], dtype=np.int64)
    pp = pipe.get("preprocessing") or {}
    packed = pp.get("max_packed_len") or pp.get("max_seq_len")
    packed = packed if pp.get("packing_strategy", "none") != "none" else None
    e = Entry("bin", index, where, "written", seq_lens=seq_lens, capacity=packed)
    docs = np.repeat(np.arange(len(seq_lens)), seq_lens)
    docs = docs if len(docs) == len(ids) else np.zeros(len(ids), np.int64)  # inconsistent row: warned below
    e.seqs.append(tt.view(ids, trained, pos, docs, is_bin=True))
    e.values = {k: v for k, v in row.items() if k not in ("input_ids", "labels", "position_ids", "seq_lens")}
    mode = (pipe.get("output") or {}).get("position_ids_mode", "doc_reset")
    if sum(seq_lens) != len(ids):
        e.notes.append(f"warning: seq_lens sum to {sum(seq_lens)} but the row has {len(ids)} tokens")
    elif pos is not None:  # the writer's own rule, as a check on what was written
        expect = positions(np.asarray(seq_lens, dtype=np.int64), mode)
        if expect is not None and not np.array_equal(expect, pos):
            bad = int(np.flatnonzero(expect != pos)[0]) if len(expect) == len(pos) else 0
            e.notes.append(f"warning: position ids differ from {mode} from token {bad} on")
    return e


def _row_entry(row: dict, index: int, where: str, pipe: dict, tt: TokenText) -> Entry:
    """A multi-output row: {source}_input_ids (+ {source}_labels; nested for list sources), value columns."""
    e = Entry("row", index, where, "written")
    secs = (pipe.get("input") or {}).get("sources") or {}
    # the writer's rule: no labels column = all trained for plain text, all masked for a prompt-only source
    has_labels = any(s.get("template") or s.get("action") == "mask" for src in secs.values() for s in src["sections"])
    for name in sorted(k[:-len("_input_ids")] for k in row if k.endswith("_input_ids")):
        sections = (secs.get(name) or {}).get("sections", [])
        if sections and all(s.get("action") == "value" for s in sections):
            continue  # a value-only source (rewards): its values are shown with the row
        trains = any(s.get("action") in ("train", "$role") for s in sections) and not has_labels
        ids, labels = row[f"{name}_input_ids"], row.get(f"{name}_labels")
        nested = bool(ids) and isinstance(ids[0], list)
        pairs = list(zip(ids, labels or [None] * len(ids))) if nested else [(ids, labels)]
        for j, (one, lab) in enumerate(pairs):
            trained = np.asarray(lab) != IGNORE if lab is not None else np.full(len(one), trains)
            e.seqs.append(tt.view(one, trained, None, np.zeros(len(one), np.int64), source=name,
                                  item=j if nested else None))
    e.values = {k: v for k, v in row.items() if not k.endswith(("_input_ids", "_labels"))}
    return e


def _rejects_excerpt(path: Path, n: int = 5) -> list[str]:
    if not path.exists():
        return []
    out = []
    with open(path, encoding="utf-8") as fh:
        for k, line in enumerate(fh):
            if k == n:
                return out + ["rejected: ... (more in rejects.jsonl)"]
            r = json.loads(line)
            key = f"{r['key']}: " if r.get("key") else ""
            out.append(f"rejected: {r.get('file')}:{r.get('line')}: {key}{r.get('detail')} [{r.get('reason')}]")
    return out


# ---------------------------------------------------------------------------------------------
# compare: which labels differ between two pipelines


def compare_marks(a: SeqView, b: SeqView) -> tuple[np.ndarray, np.ndarray]:
    """Per token: '^' label differs from the aligned token, '+' trained with no counterpart, '' otherwise.

    Tokens are aligned by text (difflib); inside replaced stretches (different templates) by
    characters, so `<|im_end|>` against `<|eot_id|>` compares their labels instead of counting as
    two unrelated tokens.
    """
    ta, tb, fa, fb = a.texts, b.texts, a.trained, b.trained
    ma, mb = np.full(len(ta), "", dtype="<U1"), np.full(len(tb), "", dtype="<U1")
    seen_a, seen_b = np.zeros(len(ta), bool), np.zeros(len(tb), bool)
    for tag, i1, i2, j1, j2 in SequenceMatcher(None, ta, tb, autojunk=False).get_opcodes():
        if tag == "equal":
            seen_a[i1:i2] = seen_b[j1:j2] = True
            differ = fa[i1:i2] != fb[j1:j2]
            ma[i1:i2][differ] = mb[j1:j2][differ] = "^"
        elif tag == "replace":
            owner_a = [k for k in range(i1, i2) for _ in ta[k]]
            owner_b = [k for k in range(j1, j2) for _ in tb[k]]
            chars = SequenceMatcher(None, "".join(ta[i1:i2]), "".join(tb[j1:j2]), autojunk=False)
            for a0, b0, size in chars.get_matching_blocks():
                for c in range(size):
                    ka, kb = owner_a[a0 + c], owner_b[b0 + c]
                    seen_a[ka] = seen_b[kb] = True
                    if fa[ka] != fb[kb]:
                        ma[ka] = mb[kb] = "^"
    ma[~seen_a & fa] = "+"
    mb[~seen_b & fb] = "+"
    return ma, mb


def add_compare_marks(a: Report, b: Report):
    for ea, eb in zip(a.entries, b.entries):
        vb = {v.label: v for v in eb.seqs}
        for va in ea.seqs:
            if va.label in vb:
                ea.marks[va.label], eb.marks[va.label] = compare_marks(va, vb[va.label])


# ---------------------------------------------------------------------------------------------
# json


def entry_json(e: Entry) -> dict:
    d: dict = {"kind": e.kind, "index": e.index, "where": e.where, "status": e.status}
    if e.reason:
        d.update(reason=e.reason, detail=e.detail)
    for key in ("seq_lens", "values", "notes"):
        if getattr(e, key):
            d[key] = getattr(e, key)
    d["counts"] = {"tokens": sum(len(v.ids) for v in e.seqs), "trained": sum(int(v.trained.sum()) for v in e.seqs),
                   "truncated": sum(v.truncated for v in e.seqs)}
    seqs = []
    for v in e.seqs:
        marks = e.marks.get(v.label)
        toks = []
        for k in range(len(v.ids)):
            t = {"id": int(v.ids[k]), "text": v.texts[k], "trained": bool(v.trained[k]),
                 "position_id": None if v.positions is None else int(v.positions[k]), "doc": int(v.docs[k]),
                 "special": bool(v.special[k])}
            if v.msg is not None:
                t.update(msg=int(v.msg[k]), role=v.role(k))
            if marks is not None:
                t["diff"] = {"^": "label", "+": "only_here"}.get(str(marks[k]))
            toks.append(t)
        seqs.append({"source": v.source, "item": v.item, "counts": {"tokens": len(v.ids),
                     "trained": int(v.trained.sum()), "truncated": v.truncated}, "tokens": toks})
    # one output (SFT, pretraining, bins): the tokens right here; multi-output: one entry per sequence
    if len(seqs) == 1 and not seqs[0]["source"]:
        d["tokens"] = seqs[0]["tokens"]
    elif seqs:
        d["seqs"] = seqs
    return d


def render_json(report: Report) -> str:
    lines: list[dict] = [{"kind": "stats", "stats": report.stats}] if report.is_dataset and report.stats else []
    lines += [{"kind": "note", "text": n} for n in report.notes]
    if report.other is None:
        lines += [entry_json(e) for e in report.entries]
    else:
        lines += [{"kind": "compare", "index": a.index, "where": a.where, "a": entry_json(a), "b": entry_json(b)}
                  for a, b in zip(report.entries, report.other.entries)]
    return "".join(json.dumps(x, ensure_ascii=False, default=str) + "\n" for x in lines)


# ---------------------------------------------------------------------------------------------
# text: tokens become cells (text, style); cells become lines; lines are printed with colour or markers

TRAINED, SPECIAL, ALT, DIFF, ONLY, HEAD, MARK, LINE = (1 << k for k in range(8))


def _sgr(style: int) -> str:
    if style & MARK:
        return ""
    if style & HEAD:
        return "\x1b[36m"
    codes = ["30", "102" if style & ALT else "42"] if style & TRAINED else [] if style & SPECIAL else ["2"]
    if style & SPECIAL:
        codes += ["1", "35"]
    if style & (DIFF | ONLY):
        codes += ["4", "58;5;196"]  # underline, red where the terminal supports underline colour
    return "\x1b[" + ";".join(codes) + "m"


def token_groups(v: SeqView, marks=None) -> list[list[tuple[str, int]]]:
    """Per token, its cells: the header line that starts before it (if any), then its text."""
    groups = []
    for k in range(len(v.ids)):
        st = (TRAINED if v.trained[k] else 0) | (SPECIAL if v.special[k] else 0) | (ALT if k % 2 else 0)
        if marks is not None:
            st |= {"^": DIFF, "+": ONLY}.get(str(marks[k]), 0)
        cell = (visible(v.texts[k]), st)
        groups.append([(f"── {v.heads[k]} ──", HEAD | LINE), cell] if k in v.heads else [cell])
    return groups


def layout(cells: list[tuple[str, int]], plain: bool) -> list[list[tuple[str, int]]]:
    """Cells -> lines of (text, style); plain text gets ⟦ ⟧ around trained runs and « » around specials."""
    lines, cur, open_ = [], [], False

    def close():
        nonlocal open_
        if open_:
            cur.append(("⟧", MARK))
            open_ = False

    for text, st in cells:
        if st & LINE:
            if plain:
                close()
            if cur:
                lines.append(cur)
                cur = []
            lines.append([(text, st)])
            continue
        if plain:
            if st & TRAINED and not open_:
                cur.append(("⟦", MARK))
                open_ = True
            elif not st & TRAINED:
                close()
            if st & SPECIAL:
                text = f"«{text}»"
        for j, part in enumerate(text.split("\n")):
            if j:
                lines.append(cur)
                cur = []
            if part:
                cur.append((part, st))
    if plain:
        close()
    return lines + [cur] if cur else lines


def _cw(ch: str) -> int:
    return 0 if unicodedata.combining(ch) else 2 if unicodedata.east_asian_width(ch) in "WF" else 1


def _width(s: str) -> int:
    return sum(_cw(c) for c in s)


def wrap(line: list[tuple[str, int]], width: int) -> list[list[tuple[str, int]]]:
    """Split a line at `width` columns, keeping each token whole where it fits on a line."""
    out, cur, w = [], [], 0
    for text, st in line:
        if cur and w + _width(text) > width >= _width(text):
            out.append(cur)
            cur, w = [], 0
        buf = ""
        for ch in text:
            if w + _cw(ch) > width and (cur or buf):
                out.append(cur + [(buf, st)] if buf else cur)
                cur, buf, w = [], "", 0
            buf += ch
            w += _cw(ch)
        if buf:
            cur.append((buf, st))
    return out + [cur]


def fmt(line: list[tuple[str, int]], color: bool) -> str:
    if not color:
        return "".join(t for t, _ in line)
    out, prev = [], ""
    for t, st in line:  # one escape sequence per run of the same style
        code = _sgr(st)
        if code != prev:
            out.append(("\x1b[0m" if prev else "") + code)
            prev = code
        out.append(t)
    return "".join(out) + ("\x1b[0m" if prev else "")


def gutter(line: list[tuple[str, int]]) -> str:
    return "".join(("^" if st & DIFF else "+" if st & ONLY else " ") * _width(t) for t, st in line).rstrip()


def _paint(s: str, code: str, color: bool) -> str:
    return f"\x1b[{code}m{s}\x1b[0m" if color else s


def _pct(a, b) -> str:
    return f"{100 * a / b:.1f}%" if b else "n/a"


def _counts_line(e: Entry) -> str:
    n, t = sum(len(v.ids) for v in e.seqs), sum(int(v.trained.sum()) for v in e.seqs)
    if e.seq_lens is None:
        return f"{n} tokens · {t} trained ({_pct(t, n)}) · {sum(v.truncated for v in e.seqs)} truncated"
    fill = f" ({_pct(n, e.capacity)} of max_packed_len {e.capacity})" if e.capacity else ""
    return f"{len(e.seq_lens)} doc{'s' * (len(e.seq_lens) != 1)} · {n} tokens{fill} · {t} trained ({_pct(t, n)})"


def _info(e: Entry) -> list[str]:
    """The lines under an entry's heading: why it is not trained, its counts, values, notes."""
    out = [e.detail] if e.reason and e.detail else []
    out += [_counts_line(e)] if e.seqs else []
    out += ["values: " + ", ".join(f"{k}={v}" for k, v in e.values.items())] if e.values else []
    return out + [f"note: {n}" for n in e.notes]


def _status(e: Entry) -> str:
    s = e.status.upper() if e.status in ("filtered", "rejected", "excluded") else e.status
    return s + (f": {e.reason}" if e.reason else "")


def render_text(report: Report, color: bool, width: int, table: bool = False) -> str:
    out = [f"astrai inspect {report.title}"]
    if report.other is not None:
        out += [f"  compared with {report.other.title}",
                "gutter: ^ label differs from the other pipeline's token there; + trained, no counterpart there"]
    legend = fmt([("trained", TRAINED), (" masked ", 0), ("«special»", SPECIAL)], True) if color else \
        "⟦trained⟧ masked «special»"
    out.append(f"legend: {legend}  ↵ newline  ⇥ tab  ◌ part of a character")
    out += report.notes
    if report.is_dataset and report.stats:
        out += [""] + stats_lines(report.stats, color)
    for k, e in enumerate(report.entries):
        out.append("")
        if report.other is not None:
            out += _compare_text(e, report.other.entries[k], report, color, width)
            continue
        bad = e.status in ("filtered", "rejected", "excluded")
        out.append(_paint(f"═══ {e.kind} {e.index} · {e.where} · {_status(e)} ═══",
                          ("1;31" if e.status == "rejected" else "1;33") if bad else "1", color))
        out += ["    " + line for line in _info(e)]
        for v in e.seqs:
            if v.label:
                out.append(_paint(f"── {v.label} ──", "1;36", color))
            cells = [c for g in token_groups(v) for c in g]
            out += _table(v, color) if table else [fmt(line, color) for line in layout(cells, not color)]
    if report.entries and not report.is_dataset and report.other is None:
        s = report.stats
        out += ["", f"{len(report.entries)} record(s): {s['records_kept']} kept, {s['records_filtered']} filtered, "
                    f"{s['records_rejected']} rejected · {s['tokens']} tokens, {s['trained_tokens']} trained "
                    f"({_pct(s['trained_tokens'], s['tokens'])})"]
    return "\n".join(out) + "\n"


def _table(v: SeqView, color: bool) -> list[str]:
    out = [f"{'#':>6} {'id':>8} {'pos':>6} {'doc':>4} {'msg':>4} {'role':<10} T  text"]
    for k in range(len(v.ids)):
        if k in v.heads:
            out.append(_paint(f"── {v.heads[k]} ──", "36", color))
        st = (TRAINED if v.trained[k] else 0) | (SPECIAL if v.special[k] else 0)
        shown = visible(v.texts[k]).replace("\n", "")
        shown = f"«{shown}»" if v.special[k] and not color else shown
        pos = "-" if v.positions is None else int(v.positions[k])
        msg = "" if v.msg is None else int(v.msg[k])
        out.append(f"{k:>6} {int(v.ids[k]):>8} {pos:>6} {int(v.docs[k]):>4} {msg:>4} {v.role(k) or '':<10} "
                   f"{'✓' if v.trained[k] else '·'}  {fmt([(shown, st)], color)}")
    return out


def _compare_text(ea: Entry, eb: Entry, report: Report, color: bool, width: int) -> list[str]:
    col = max(20, (width - 3) // 2)
    out = [_paint(f"═══ record {ea.index} · {ea.where} ═══", "1", color)]
    info_a = [f"A: {report.name} · {_status(ea)}"] + _info(ea)
    info_b = [f"B: {report.other.name} · {_status(eb)}"] + _info(eb)
    out += _columns([wrap([(t, 0)], col) for t in info_a], [wrap([(t, 0)], col) for t in info_b], col, False)
    for label, va, vb in _pairs(ea, eb):
        if label:
            out.append(_paint(f"── {label} ──", "1;36", color))
        left = _segment_lines(va, ea.marks.get(label), col, color) if va else {}
        right = _segment_lines(vb, eb.marks.get(label), col, color) if vb else {}
        for m in sorted(set(left) | set(right), key=_turn_order):
            out += _columns(left.get(m, []), right.get(m, []), col, color)
    return out


def _pairs(ea: Entry, eb: Entry) -> list[tuple[str, Optional[SeqView], Optional[SeqView]]]:
    """(label, A's sequence, B's sequence) for every sequence either side has."""
    a, b = {v.label: v for v in ea.seqs}, {v.label: v for v in eb.seqs}
    return [(label, a.get(label), b.get(label)) for label in list(a) + [x for x in b if x not in a]]


def _turn_order(m: Optional[int]) -> int:
    return -1 if m is None else m


def _segment_lines(v: SeqView, marks, col: int, color: bool) -> dict:
    """Message index (None: a sequence without messages) -> its wrapped lines, so turns line up in rows."""
    groups = token_groups(v, marks)
    return {m: [wrap(line, col) for line in layout([c for g in groups[s:e] for c in g], not color)]
            for m, s, e in v.segments()}


def _columns(left: list, right: list, col: int, color: bool) -> list[str]:
    """Two columns of wrapped lines (lists of wrap() results), with a gutter row under marked lines."""
    lf = [ln for group in left for ln in group]
    rf = [ln for group in right for ln in group]
    out = []
    for k in range(max(len(lf), len(rf))):
        a, b = (lf[k] if k < len(lf) else []), (rf[k] if k < len(rf) else [])
        pad = " " * max(0, col - _width("".join(t for t, _ in a)))
        out.append(f"{fmt(a, color)}{pad} │ {fmt(b, color)}".rstrip())
        ga, gb = gutter(a), gutter(b)
        if ga or gb:
            out.append(_paint(f"{ga:<{col}} │ {gb}".rstrip(), "31", color))
    return out


def stats_lines(s: dict, color: bool) -> list[str]:
    """stats.json (or the same figures for the records shown), for people."""
    out = [_paint("statistics", "1", color)]
    if s.get("records_read") is not None:
        out.append(f"  records: {s['records_read']} read, {s.get('records_kept')} kept, {s.get('records_filtered')} "
                   f"filtered, {s.get('records_rejected')} rejected")
    for kind in ("filtered", "rejected"):
        by = s.get(f"{kind}_by_reason") or {}
        if by:
            ranked = sorted(by.items(), key=lambda kv: -kv[1])
            out.append(f"  {kind} by reason: " + ", ".join(f"{k} {v}" for k, v in ranked))
    tokens, trained = s.get("tokens") or 0, s.get("trained_tokens") or 0
    out.append(f"  tokens: {tokens:,} · trained {trained:,} · supervised share {_pct(trained, tokens)}")
    per, tper = s.get("tokens_per_role") or {}, s.get("trained_tokens_per_role") or {}
    if per:
        ranked = sorted(per.items(), key=lambda kv: -kv[1])
        out.append("  tokens per role: " + " · ".join(f"{r} {n:,} ({tper.get(r, 0):,} trained)" for r, n in ranked))
    lost = s.get("truncated_tokens") or 0
    out.append(f"  truncation: {s.get('truncated_docs') or 0} docs cut by max_seq_len, {lost:,} tokens lost "
               f"({_pct(lost, tokens + lost)} of all)" + (f"; packing cut {s['pack_truncated_tokens']:,} tokens of "
                                                           f"{s.get('pack_truncated_docs')} docs"
                                                           if s.get("pack_truncated_tokens") else ""))
    if s.get("packing_strategy") is not None:
        eff = s.get("packing_efficiency")
        out.append(f"  packing: {s['packing_strategy']}, max_packed_len {s.get('max_packed_len')}, "
                   f"{s.get('bins', s.get('rows'))} rows, efficiency {'n/a' if eff is None else f'{100 * eff:.1f}%'}")
    if s.get("records_per_domain"):
        out.append("  domains: " + ", ".join(f"{k} {v}" for k, v in s["records_per_domain"].items()))
    hist = histogram(s.get("doc_length_histogram") or {})
    if hist:
        top = max(n for _, n in hist)
        out.append("  document lengths (tokens):")
        out += [f"    {label:>9} {n:>8,} {'█' * max(1, round(30 * n / top))}" for label, n in hist]
    return out


def histogram(h: dict) -> list[tuple[str, int]]:
    """Buckets in length order ('<=16', ..., '>131072'), whatever order the JSON kept."""
    return [(k, int(h[k])) for k in sorted(h, key=lambda b: (b[0] == ">", int(b.lstrip("<=>")))) if h[k]]


# ---------------------------------------------------------------------------------------------
# html: one page, no network

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{position:sticky;top:0;background:#fff;border-bottom:1px solid #dde;padding:10px 18px;z-index:2}
h1{font-size:17px;margin:0 0 4px}h2{font-size:15px;margin:0 0 6px}.sub{color:#556;font-size:13px}
.legend{margin-top:6px;font-size:13px}.legend>span{margin-right:8px}
#info{margin-top:6px;font:12px ui-monospace,monospace;color:#334;min-height:1.4em}main{padding:12px 18px}
.card{background:#fff;border:1px solid #dde;border-radius:6px;padding:10px 14px;margin:0 0 14px}
.status{font-weight:600;padding:1px 6px;border-radius:4px;background:#e7f3ea;color:#17602b}
.status.filtered,.status.excluded{background:#fff3d6;color:#7a5300}.status.rejected{background:#fde2e2;color:#9b1c1c}
.meta{color:#556;font-size:13px;margin:2px 0}.note{color:#7a5300;font-size:13px}
.seq{font:13px/1.75 ui-monospace,Menlo,Consolas,"DejaVu Sans Mono",monospace;white-space:pre-wrap;word-break:break-all}
.t{color:#8a8f99;border-radius:2px}.t.tr{background:#b6efc1;color:#0c3b17}.t.tr.alt{background:#93e2a3}
.t.sp{color:#7b1fa2;font-weight:700;outline:1px solid #c9a2e0}.t.tr.sp{color:#4a0072}
.t.df{box-shadow:inset 0 -3px 0 #e0202a}.t.on{box-shadow:inset 0 -3px 0 #f08c00}.t:hover{outline:2px solid #1d2330}
.head{display:block;color:#0b6b8a;font:600 12px system-ui,sans-serif;border-top:1px dashed #c5d3dc;margin-top:6px}
.head.doc{color:#6b3fa0;border-top-color:#d2c4e6}.src{font-weight:600;margin-top:8px}
.cmp{display:grid;grid-template-columns:1fr 1fr;gap:0 18px}.cmp>div{min-width:0}
table.stats{border-collapse:collapse;font-size:13px}table.stats td{padding:2px 10px 2px 0;vertical-align:top}
.hist td.bar{width:320px}.hist .b{background:#4c8bf5;height:12px;border-radius:2px}
"""

_JS = """document.addEventListener('mouseover',function(e){var t=e.target.closest&&e.target.closest('.t');
if(t&&t.title){document.getElementById('info').textContent=t.title;}});"""


def _h(s) -> str:
    # ':' as an entity: text from the data (a URL in a message) never reads as an address in the page source
    return html.escape(str(s)).replace(":", "&#58;")


_MARKS = {"^": ("label differs from the other pipeline", " df"), "+": ("trained, no counterpart there", " on")}


def _token_html(v: SeqView, k: int, mark: str) -> str:
    parts = [f"id {int(v.ids[k])}", f"text {v.texts[k]!r}",
             f"position {'-' if v.positions is None else int(v.positions[k])}", f"doc {int(v.docs[k])}"]
    if v.msg is not None:
        parts.append(f"message {int(v.msg[k])} ({v.role(k)})" if v.role(k) else "template text")
    parts.append("trained" if v.trained[k] else "masked")
    cls = "t"
    if v.trained[k]:
        cls += " tr alt" if k % 2 else " tr"
    if v.special[k]:
        parts.append("special")
        cls += " sp"
    if mark:
        parts.append(_MARKS[mark][0])
        cls += _MARKS[mark][1]
    head = (f'<span class="head{"" if v.turns else " doc"}">{_h(v.heads[k])}</span>' if k in v.heads else "")
    return f'{head}<span class="{cls}" title="{_h(" · ".join(parts))}">{_h(visible(v.texts[k]))}</span>'


def _tokens_html(v: SeqView, marks, start: int = 0, end: Optional[int] = None) -> str:
    end = len(v.ids) if end is None else end
    return "".join(_token_html(v, k, "" if marks is None else str(marks[k])) for k in range(start, end))


def _entry_head_html(e: Entry) -> str:
    out = [f'<h2>{e.kind} {e.index} · {_h(e.where)} · <span class="status {e.status}">{_h(_status(e).lower())}'
           f"</span></h2>"]
    return "".join(out + [f'<div class="{"note" if line.startswith("note:") else "meta"}">{_h(line)}</div>'
                          for line in _info(e)])


def _compare_html(ea: Entry, eb: Entry, a: Report, b: Report) -> str:
    """Two columns, one grid row per message turn, so the same turn sits side by side."""
    out = [f'<div class="cmp"><div><div class="src">A: {_h(a.name)}</div>{_entry_head_html(ea)}</div>'
           f'<div><div class="src">B: {_h(b.name)}</div>{_entry_head_html(eb)}</div>']
    for label, va, vb in _pairs(ea, eb):
        if label:
            out.append(f'<div class="src">{_h(label)}</div>' * 2)
        sa = {m: (s, e) for m, s, e in va.segments()} if va else {}
        sb = {m: (s, e) for m, s, e in vb.segments()} if vb else {}
        for m in sorted(set(sa) | set(sb), key=_turn_order):
            for v, segs, e in ((va, sa, ea), (vb, sb, eb)):
                body = _tokens_html(v, e.marks.get(label), *segs[m]) if m in segs else ""
                out.append(f'<div class="seq">{body}</div>')
    return "".join(out) + "</div>"


def _stats_html(s: dict, title: str) -> str:
    rows = []
    for line in stats_lines(s, False)[1:]:
        if line.startswith("  ") and not line.startswith("    ") and not line.endswith("(tokens):"):
            key, _, val = line.strip().partition(": ")
            rows.append(f"<tr><td>{_h(key)}</td><td>{_h(val)}</td></tr>")
    hist = histogram(s.get("doc_length_histogram") or {})
    top = max((n for _, n in hist), default=1)
    bars = "".join(f'<tr><td>{_h(label)}</td><td>{n:,}</td><td class="bar"><div class="b" '
                   f'style="width:{100 * n / top:.1f}%"></div></td></tr>' for label, n in hist)
    return (f'<section class="card"><h2>{_h(title)}</h2><table class="stats">{"".join(rows)}</table>'
            + (f'<h2 style="margin-top:10px">document length histogram (tokens)</h2><table class="stats hist">'
               f"{bars}</table>" if bars else "") + "</section>")


def render_html(report: Report) -> str:
    other = report.other
    legend = ('<span class="t tr">trained</span><span class="t">masked</span><span class="t sp">&lt;special&gt;</span>'
              + ('<span class="t tr df">label differs</span><span class="t tr on">trained, only here</span>' if other
                 else "") + "<span>↵ newline · ⇥ tab · ◌ part of a character</span>")
    sub = _h(report.title) + (f"<br>compared with {_h(other.title)}" if other else "")
    body = [f'<header><h1>astrai inspect</h1><div class="sub">{sub}</div><div class="legend">{legend}</div>'
            f'<div id="info">hover a token for its id, position, document and label</div></header><main>']
    body += [f'<div class="card note">{_h(n)}</div>' for n in report.notes]
    if report.stats:
        title = "dataset statistics" if report.is_dataset else "statistics of the records shown" + " (A)" * bool(other)
        body.append(_stats_html(report.stats, title))
    for k, e in enumerate(report.entries):
        if other is not None:
            inner = _compare_html(e, other.entries[k], report, other)
        else:
            inner = _entry_head_html(e) + "".join(
                (f'<div class="src">{_h(v.label)}</div>' if v.label else "")
                + f'<div class="seq">{_tokens_html(v, None)}</div>' for v in e.seqs)
        body.append(f'<section class="card">{inner}</section>')
    csp = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'"
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{csp}">'
            f"<title>astrai inspect · {_h(report.name)}</title><style>{_CSS}</style></head><body>"
            + "".join(body) + f"</main><script>{_JS}</script></body></html>\n")
