"""Token character spans of a byte-level BPE tokenizer, computed from the token ids.

The tokenizer's `encode_batch` spends about a fifth of its work on offsets (a token string per
token, byte offsets turned into character offsets); `encode_batch_fast` skips that and returns
ids only. Labelling needs character spans at region edges, and for a byte-level BPE tokenizer
that hands the text to the model unchanged they follow from the ids alone: token k holds exactly
the bytes its vocabulary entry spells, in text order, so its byte offsets are the running sum of
the byte lengths of the tokens before it. A token's character span is that of every character one
of its bytes belongs to, as `encode_batch` reports it: a token holding part of a multi-byte
character spans the whole character, and so does the token holding the rest of it.

`ByteSpans.of(tokenizer)` decides once per tokenizer whether this holds (None: the caller keeps
`encode_batch`'s offsets): a BPE model under a ByteLevel pre-tokenizer without a prefix space,
no normalizer, pre-tokenizers that only split (never remove) text, no post-processor that trims
offsets, and a probe text whose spans agree with `encode_batch`'s. Added tokens count the bytes
of their text; one that also takes the whitespace around it (lstrip/rstrip) has no fixed length
and is marked unknown. Per text, `spans` returns None when an id has no known length or the
lengths do not add up to the text's bytes; the caller then encodes that text with offsets.
"""

from __future__ import annotations

import json
from typing import Optional

import numpy as np

# the byte-level alphabet (GPT-2's): bytes that are printable Latin-1 stand for themselves, the
# other 68 bytes are written as the code points 256-323; every vocabulary character is one byte
_SELF = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
_ONE_BYTE = np.zeros(325, dtype=bool)  # code point -> is a byte-level character (324: anything above)
_ONE_BYTE[_SELF] = True
_ONE_BYTE[256:324] = True
_SPLITTERS = {"Split", "Digits", "Punctuation"}  # pre-tokenizers that cut text without changing it
_PROBE = "Hi there!\n\n  x\t=  3.14159 e\u0301 日本語 🎉🚀 ß İ ﬁ \u200b Ａ\r\nend "


class ByteSpans:
    def __init__(self, tok):
        self.tok = tok
        # byte length per id: -1 unknown, -2 not looked up yet (the vocabulary is looked up whole, 0.1 s
        # for 129k entries, by the first text with such an id; the probe looks up its own ids only)
        added = tok.get_added_tokens_decoder()
        self.lengths = np.full(max([tok.get_vocab_size(with_added_tokens=True), *(i + 1 for i in added)]), -2, np.int64)
        for i, t in added.items():
            self.lengths[i] = -1 if t.lstrip or t.rstrip else len(t.content.encode("utf-8"))
        unk = getattr(tok.model, "unk_token", None)
        if unk is not None and tok.token_to_id(unk) is not None:
            self.lengths[tok.token_to_id(unk)] = -1  # stands for text it does not spell
        self.post_adds = tok.num_special_tokens_to_add(False) > 0  # BOS/EOS with add_special_tokens

    @classmethod
    def of(cls, tok) -> Optional["ByteSpans"]:
        """For a tokenizers.Tokenizer: spans from ids when they are exact for it, else None."""
        try:
            if not _byte_level(tok):
                return None
            self = cls(tok)
            added = [str(t.content) for t in tok.get_added_tokens_decoder().values() if not (t.lstrip or t.rstrip)]
            probe = _PROBE + "".join(sorted(added)[:50])  # with added tokens of known length, text-adjacent
            enc = tok.encode(probe, add_special_tokens=False)
            self._look_up(np.unique(np.asarray(enc.ids, dtype=np.int64)))
            got = self.spans(np.asarray(enc.ids, dtype=np.int64), probe)
        except Exception:  # a tokenizers version without these accessors: keep the encoding's offsets
            return None
        if got is None or not np.array_equal(np.stack(got, axis=1), np.asarray(enc.offsets).reshape(-1, 2)):
            return None
        return self

    def usable(self, add_special: bool) -> bool:
        """Whether encodings made with this add_special_tokens flag can take spans from ids."""
        return not (add_special and self.post_adds)

    def spans(self, ids: np.ndarray, text: str) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """(starts, ends): the character span of each token of `text` encoded as `ids`; None when
        the ids do not spell the text's bytes."""
        if len(ids) == 0:
            return (np.zeros(0, np.int64),) * 2 if not text else None
        try:
            lens = self.lengths[ids]  # ids are never negative: the tokenizer's are unsigned
        except IndexError:
            return None
        least = lens.min()
        if least == -2:
            self._look_up(np.flatnonzero(self.lengths == -2))
            lens = self.lengths[ids]
            least = lens.min()
        if least <= 0:
            return None
        ends = lens.cumsum()
        starts = ends - lens
        if text.isascii():
            return (starts, ends) if int(ends[-1]) == len(text) else None
        try:
            raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        except UnicodeEncodeError:
            return None
        if int(ends[-1]) != len(raw):
            return None
        char_of_byte = np.cumsum((raw & 0xC0) != 0x80) - 1  # continuation bytes belong to the char before
        return char_of_byte[starts], char_of_byte[ends - 1] + 1

    def _look_up(self, ids: np.ndarray):
        """Byte lengths of vocabulary ids: their characters, each one byte of the byte-level alphabet
        (an entry with any other character: unknown)."""
        words = [self.tok.id_to_token(i) or "" for i in ids.tolist()]
        n_chars = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
        points = np.frombuffer("".join(words).encode("utf-32-le"), dtype=np.uint32)
        bad = np.concatenate([[0], np.cumsum(~_ONE_BYTE[np.minimum(points, len(_ONE_BYTE) - 1)])])
        ends = np.cumsum(n_chars)
        self.lengths[ids] = np.where((bad[ends] - bad[ends - n_chars] == 0) & (n_chars > 0), n_chars, -1)


def _state(component) -> Optional[dict]:
    return None if component is None else json.loads(component.__getstate__())


def _byte_level(tok) -> bool:
    if type(tok.model).__name__ != "BPE":
        return False
    norm = _state(tok.normalizer)
    if norm is not None and not (norm.get("type") == "Sequence" and not norm.get("normalizers")):
        return False
    pre = _state(tok.pre_tokenizer)
    steps = pre.get("pretokenizers", []) if pre is not None and pre.get("type") == "Sequence" else [pre]
    levels = [s for s in steps if s is not None and s.get("type") == "ByteLevel"]
    if len(levels) != 1 or levels[0].get("add_prefix_space"):
        return False
    if any(s is None or (s.get("type") not in _SPLITTERS | {"ByteLevel"}) or s.get("behavior") == "Removed"
           for s in steps):
        return False
    post = _state(tok.post_processor)
    posts = post.get("processors", []) if post is not None and post.get("type") == "Sequence" else [post]
    return all(p is None or p.get("type") == "TemplateProcessing" or (p.get("type") == "ByteLevel"
                                                                     and not p.get("trim_offsets")) for p in posts)
