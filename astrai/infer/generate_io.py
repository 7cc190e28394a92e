"""What `astrai generate` reads and writes: prompt records in, results out, checked before any work.

- `read_records(path, chat_only, base)`: JSONL prompt records from a file or standard input (`-`),
  each checked as it is read: valid JSON, a prompt or messages of the right shape (a message
  without role or content, a number or null where a prompt belongs), and its own `sampling` keys
  validated as the flags are (a sampling key beside the prompt instead of under "sampling", or a
  misspelt record key, is an error; other keys are the user's own). Every problem is one line
  naming file:line and the key. Only regular files are opened (a FIFO or a directory is refused,
  never waited on), and only a regular file (or a new one) is written.
- `open_output(path)`: the --output file, opened before the model is loaded, so a directory that
  does not exist, a directory given as the file, or a path that cannot be written is found before
  any generation. Nothing in an existing file is touched until the first result is ready.
- `ResultWriter`: one JSONL record per finished request, appended and flushed as it finishes (a
  killed batch keeps what finished; "index" is each result's position in the input), and the text
  view a person reads on a terminal (`TextWriter`: the conversation, then the answer).
"""

from __future__ import annotations

import difflib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from astrai.config.infer import SamplingParams, sampling_with
from astrai.errors import InputError, open_regular
from astrai.text.prompt import prompt_problem


@dataclass
class Item:
    prompt: Any  # text, messages or token ids
    sampling: Optional[dict]  # the record's own sampling keys (validated)
    where: str  # "file:line", "<stdin>:3" or "--prompt"


def read_records(path: str, chat_only: bool, base: SamplingParams, stdin=None) -> list[Item]:
    flag = "--chat" if chat_only else "--input"
    if path == "-":
        return _parse((stdin or sys.stdin), "<stdin>", chat_only, base)
    try:
        with open_regular(path, "r", what=f"{flag} file") as fh:
            return _parse(fh, path, chat_only, base)
    except UnicodeDecodeError as e:
        raise InputError(f"{flag} file {path}: not UTF-8 text (byte {e.start}: {e.reason})") from None


def _parse(lines, name: str, chat_only: bool, base: SamplingParams) -> list[Item]:
    out = []
    want = "messages" if chat_only else "prompt or messages"
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{name}:{n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
        if isinstance(rec, list):
            rec = {"messages": rec}
        if not isinstance(rec, dict):
            raise InputError(f"{where}: expected an object with {want} (or a list of messages), got "
                             f"{'null' if rec is None else type(rec).__name__}")
        if "messages" in rec:
            key, prompt = "messages", rec["messages"]
            if not isinstance(prompt, list) or not prompt or not isinstance(prompt[0], dict):
                raise InputError(f"{where}: messages must be a non-empty list of {{role, content}} objects")
        elif "prompt" in rec and not chat_only:
            key, prompt = "prompt", rec["prompt"]
        else:
            keys = ", ".join(map(repr, rec)) or "none"
            raise InputError(f"{where}: expected an object with {want} (or a list of messages); its keys: {keys}"
                             + ("" if chat_only else " (a conversation is \"messages\": [...])"))
        problem = prompt_problem(prompt)
        if problem:
            raise InputError(f"{where}: {problem}" if problem.startswith("messages[") else f"{where}: {key}: {problem}")
        _misplaced_keys(rec, where)
        over = rec.get("sampling")
        sampling_with(base, over, where)  # a typo is an error now, not after the model is loaded
        out.append(Item(prompt, over, where))
    if not out:
        raise InputError(f"{name}: no records (one JSON object per line)")
    return out


RECORD_KEYS = ("prompt", "messages", "sampling")


def _misplaced_keys(rec: dict, where: str) -> None:
    """A sampling option written beside the prompt instead of under "sampling", or a misspelt record
    key, is an error (it would be ignored); other keys (an id, metadata) are the user's own and left alone."""
    fields = tuple(SamplingParams.model_fields)
    for key in rec:
        if key in RECORD_KEYS or not isinstance(key, str):
            continue
        near = difflib.get_close_matches(key, fields + RECORD_KEYS, n=1, cutoff=0.8)
        if key in fields or (near and near[0] in fields):
            name = key if key in fields else near[0]
            raise InputError(f"{where}: {key!r} is not a record key; sampling options go under \"sampling\": "
                             f"{{\"sampling\": {{\"{name}\": ...}}}}")
        if near:
            raise InputError(f"{where}: unknown record key {key!r}; did you mean {near[0]!r}?")


def open_output(path: str):
    """The --output file, for appending; checked and opened before any work (InputError if not)."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"--output {p}: is a directory; give a file name, e.g. {p / 'results.jsonl'}")
    if p.exists() and not p.is_file():
        raise InputError(f"--output {p}: not a regular file (a device, FIFO or socket); give a file path "
                         f"(for standard output, leave out --output and pass --json)")
    parent = p.parent
    if not parent.exists():
        raise InputError(f"--output {p}: the directory {parent} does not exist; create it first (mkdir -p {parent})")
    if not parent.is_dir():
        raise InputError(f"--output {p}: {parent} is not a directory")
    try:
        return open(p, "a", encoding="utf-8")  # "a": an old file survives a failed start; emptied at the first result
    except OSError as e:
        raise InputError(f"--output {p}: cannot be written ({e.strerror or e}); choose another path") from None


def completion_record(c, prompt) -> dict:
    rec = {"index": c.index, "prompt" if isinstance(prompt, str) or not _is_messages(prompt) else "messages": prompt,
           "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
           "prompt_tokens": len(c.prompt_token_ids), "cached_tokens": c.cached_tokens,
           "preemptions": c.preemptions, "latency_s": round(c.latency, 4)}
    if c.logprobs is not None:
        rec["logprobs"] = [{"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top} for lp in c.logprobs]
    return rec


def _is_messages(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


class ResultWriter:
    """JSONL, one line per finished request, flushed at once."""

    def __init__(self, stream, name: str, total: int, fresh: bool = False):
        self.stream, self.name, self.total, self.written = stream, name, total, 0
        self.fresh = fresh  # an --output file opened for appending: emptied before the first line

    def start(self, items: list[Item]) -> None:
        pass

    def delta(self, index: int, text: str) -> None:
        pass

    def done(self, completion, item: Item) -> None:
        if self.fresh:
            self.stream.seek(0)
            self.stream.truncate()
            self.fresh = False
        self.stream.write(json.dumps(completion_record(completion, item.prompt), ensure_ascii=False) + "\n")
        self.stream.flush()
        self.written += 1

    def kept(self) -> str:
        return (f"{self.written} of {self.total} result(s) were written to {self.name} as they finished (their "
                f"\"index\" is the input position); the other {self.total - self.written} were not generated")


class TextWriter:
    """What a person reads on a terminal: each conversation (or prompt) and its answer. One request
    is streamed token by token; several are printed whole as each finishes."""

    def __init__(self, stream, total: int, echo: bool = True):
        self.stream, self.total, self.written, self.live = stream, total, 0, total == 1
        self.echo = echo  # --prompt: only the continuation is printed, as before

    def _show(self, item: Item) -> str:
        p = item.prompt
        if isinstance(p, str):
            return p
        if _is_messages(p):
            lines = [f"{m.get('role')}: {m.get('content') if m.get('content') is not None else ''}" for m in p]
            return "\n".join(lines) + "\nassistant: "
        return f"[{len(p)} token ids] "

    def start(self, items: list[Item]) -> None:
        if self.live and self.echo:
            self.stream.write(self._show(items[0]))
            self.stream.flush()

    def delta(self, index: int, text: str) -> None:
        if self.live and text:
            self.stream.write(text)
            self.stream.flush()

    def done(self, completion, item: Item) -> None:
        if not self.live:
            self.stream.write(f"--- {item.where}\n{self._show(item)}{completion.text}")
        self.stream.write("\n")
        self.stream.flush()
        self.written += 1

    def kept(self) -> str:
        return f"{self.written} of {self.total} answer(s) were printed; the others were not generated"
