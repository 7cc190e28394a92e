"""What `astrai inspect` shows: one token sequence (SeqView), one record or row (Entry), the Report.

Both sources (records.py, dataset.py) build these, and every renderer (text, json, html) reads
only these, so the three formats show the same tokens, labels and notes.

Role boundaries are a display aid (the labels never depend on them, and shards do not store
them): a message's turn starts at the special token that introduces its header (in the template
text before the message, the first special token followed by a role name, else the last special
token), or at its text when the template uses no special tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional

import numpy as np



def shortest_floats(values: dict) -> dict:
    """Value columns as shown: floats as the float32 a shard holds, in the shortest form that reads
    back as that float32 (a reward of 0.8 shows as 0.8, not 0.800000011920929); other values as they are."""
    def one(v):
        if isinstance(v, float):
            return float(str(np.float32(v)))
        if isinstance(v, list):
            return [one(x) for x in v]
        return v

    return {k: one(v) for k, v in values.items()}


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
