"""Token text for display, and the token alignment behind `--compare`.

Token text is the exact bytes each token adds, decoded in sequence: a character split over two
byte-level tokens shows on the token that completes it (the other shows ◌), so the texts of a
sequence join to the tokenizer's decode of it. Byte-level BPE, byte fallback and sentencepiece
pieces are all read back to bytes. Whitespace is visible: newline ↵, tab ⇥, CR ␍.

`--compare` aligns two pipelines' tokens of one record by text: a token is marked ^ when its label
differs from its counterpart's and + when it is trained and has no counterpart.
"""

from __future__ import annotations

import codecs
from difflib import SequenceMatcher

import numpy as np

from astrai.data.inspect.views import Report, SeqView


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
