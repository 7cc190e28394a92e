"""Exact loss masks for rendered chat templates, in linear time (steps 1-4, the regions, are in
astrai.data.regions; step 5, token labels, here).

The problem: which characters of a rendered conversation are a message's own text (content or
reasoning), as opposed to template scaffolding (role headers, default system prompts, dates)?
Searching for token ids is wrong (the same text tokenizes differently in context), and rendering
each message alone or each prefix again is wrong for stateful templates and O(T^2).

The method (two renders, one tokenization, all linear in the conversation):

1. Render the conversation once: `text`. This is exactly what apply_chat_template returns, and
   the only string that is tokenized.
2. Render it a second time with every message's text replaced by a unique sentinel (a private-use
   character pair around an index). Content holding `<think>`/`</think>` tags is split at the tags
   so templates that move reasoning around (Qwen3/DeepSeek-R1 style) see the same structure.
   Empty texts stay empty (no sentinel), so templates that branch on `{% if message.content %}`
   take the same branch in both renders. Whatever lies between sentinels in that `skeleton` is
   template scaffolding.
3. Walk `text` with a cursor against the skeleton: each scaffold piece must match exactly at the
   cursor, and each sentinel must be followed by its message text (as the template emitted it:
   verbatim or trimmed) followed by the next scaffold piece. Any mismatch means the template
   treats content in a way we cannot verify, and the record is rejected with that reason.
4. A trained message's region runs from the end of its header to the end of its last text span.
   For assistant messages the header is the template's generation prompt, found in the scaffold
   just before the message, so generated markup such as `<think>` and `</think>` is trained; other
   roles start at their text. The rule: an assistant turn is trained from where the prompt ends
   (what add_generation_prompt renders) to its end-of-turn. A template without a generation prompt
   that writes text between the prompt and the answer (Llama-2: "[/INST]" + " " + answer) has that
   "answer lead" trained too: the model generates it, merged into the answer's first token. Think
   tags that open or close the message's own text belong to it (this matters when the template has
   no generation prompt). Role headers are never trained. The
   end-of-turn token(s) right after the region (whitespace, then the first special token) are
   trained or masked by policy.
   Tool calls are rendered by the template from structured data, so they have no sentinel: a
   trained message with tool calls owns everything after its text up to the next special token,
   which must come before the next message's text (that token is its end-of-turn; if its text
   also occurs inside the tool-call data, the end is ambiguous and the record is rejected). So
   does one whose content left no text (empty, or think tags only) while its reasoning did: the
   template's markup closing the reasoning is its output too. The end-of-turn token of any
   trained message must also come before the next message's text. A
   trained assistant message whose render holds no text at all (empty content, or tool calls only)
   is anchored at its own generation prompt (header): the assistant messages without text between
   two messages with text must own the generation prompts found there one for one, in order, else
   the record is rejected. A template without a generation prompt has no header to anchor at: an
   answer made only of think tags is then located by its own text, which must occur exactly once
   there.
5. Tokenize `text` once with character offsets. A token is trained iff its span lies inside a
   trained region. A token that straddles a region's start (template text and message text merged
   in one token) cannot be attributed, and the record is rejected with that reason; one that
   straddles it holding no character of any message's text (Llama-2 as template collections write
   it, without `-` whitespace control: "[/INST]\n" + indentation + " " + answer, where a tokenizer
   merges the newline with the indentation) is template text on both sides, and is masked. One that
   straddles its end merges the text with template text of the same turn: the turn is then trained
   to its end-of-turn token (the rule), if one follows before the next message's text.
"""

from __future__ import annotations

import bisect
from typing import Optional

import numpy as np

from astrai.errors import RecordError
from astrai.data.regions import Region, RenderedChat, prompt_probe, render_with_regions  # noqa: F401
from astrai.schema import IGNORE_INDEX


class TokenSpans:
    """Character spans of the tokens of one encoding, queried at region edges only.

    Building the full offsets array costs as much as the rest of labeling (a Python tuple per
    token), so edges are looked up through the encoding (`char_to_token`) and the array is built
    only if a tokenizer's normalizer removed characters and a lookup finds no token.

    Tokens a post-processor adds (BOS/EOS with add_special_tokens) hold no characters: they sit
    before `lo` and from `hi` on, inside no region. Their (0, 0) offsets would also break the
    sorted-array lookups, so those search only tokens [lo, hi).
    """

    def __init__(self, enc, text_len: int):
        self.enc = enc
        self.n = len(enc) if hasattr(enc, "__len__") else len(enc.ids)
        self.text_len = text_len
        self._arrays = None
        self._ends_at(lambda k: enc.token_to_chars(k))

    @classmethod
    def from_offsets(cls, offsets: np.ndarray, text_len: int) -> "TokenSpans":
        self = cls.__new__(cls)
        self.enc, self.n, self.text_len = None, len(offsets), text_len
        self._arrays = (offsets[:, 0], offsets[:, 1])
        self._ends_at(lambda k: tuple(offsets[k]))
        return self

    def _ends_at(self, chars):
        def empty(k):
            c = chars(k)
            return c is None or c[0] == c[1]

        self.lo, self.hi = 0, self.n
        while self.lo < self.n and empty(self.lo):
            self.lo += 1
        while self.hi > self.lo and empty(self.hi - 1):
            self.hi -= 1

    def arrays(self):
        if self._arrays is None:
            off = np.asarray(self.enc.offsets, dtype=np.int64).reshape(-1, 2)
            self._arrays = (off[:, 0], off[:, 1])
        return self._arrays

    def span(self, k: int) -> tuple[int, int]:
        if k < self.lo or k >= self.hi:  # no characters: an empty span at the end it sits at
            c = 0 if k < self.lo else self.text_len
            return c, c
        if self._arrays is not None:
            return int(self._arrays[0][k]), int(self._arrays[1][k])
        return self.enc.token_to_chars(k)

    def _search(self, which: int, c: int, side: str) -> int:
        """np.searchsorted over the starts (0) or ends (1) of tokens [lo, hi), as a token index."""
        return self.lo + int(np.searchsorted(self.arrays()[which][self.lo:self.hi], c, side=side))

    def _containing(self, c: int) -> Optional[int]:
        """Index of the first token whose span holds character c (None: no such token known)."""
        if self._arrays is None and self.enc is not None:
            t = self.enc.char_to_token(c)
            if t is not None:
                return t
        j = self._search(1, c, "right")  # first token ending after c
        return j if j < self.hi and self.arrays()[0][j] <= c else None

    def first_at_or_after(self, c: int) -> int:
        """Index of the first token starting at or after character c."""
        if c >= self.text_len:
            return self.hi
        t = self._containing(c)
        if t is None:
            return self._search(0, c, "left")
        return t if self.span(t)[0] >= c else t + 1

    def ending_by(self, c: int) -> int:
        """Number of tokens that end at or before character c (counting those before lo)."""
        if c >= self.text_len:
            return self.hi
        t = self._containing(c)
        if t is None:
            return self._search(1, c, "right")
        return t

    def straddler(self, c: int) -> Optional[int]:
        """A token that holds both character c-1 and c (text on both sides of edge c), if any."""
        if c <= 0 or c >= self.text_len:
            return None
        t = self._containing(c)
        return t if t is not None and self.span(t)[0] < c else None


def label_tokens(chat: RenderedChat, ids: np.ndarray, spans: TokenSpans, special_ids: frozenset,
                 end_of_turn: str) -> np.ndarray:
    """Labels for the tokens of chat.text (ids with their character spans)."""
    n = len(ids)
    labels = np.full(n, IGNORE_INDEX, dtype=np.int32)
    if n == 0:
        return labels
    text = chat.text

    def tok_text(k):
        s, e = spans.span(k)
        return text[s:e]

    def straddle(r, j) -> RecordError:
        return RecordError("boundary_straddle", f"message {r.msg} ({r.role}): token {tok_text(j)!r} spans template "
                                                f"text and message text; no exact label exists")

    text_starts = [s for s, _, _ in chat.text_spans]

    def holds_message_text(k) -> bool:
        s, e = spans.span(k)
        i = bisect.bisect_left(text_starts, e) - 1  # the last message text starting before the token ends
        return i >= 0 and chat.text_spans[i][1] > s

    for r in chat.regions:
        if not r.trained:
            continue
        j = spans.straddler(r.start)
        # a straddler holding only template text (the newline and indentation a template without
        # whitespace control leaves between turns) is scaffolding: masked, as first_at_or_after skips it
        if j is not None and holds_message_text(j):
            raise straddle(r, j)
        # the end edge of a to_eot region is not a label edge: the tokens after it are trained too. A
        # token merging the text's end with template text of the same turn (Qwen's tools block after a
        # system prompt: ".\n\n") has an exact label by the rule too: the turn is trained to its
        # end-of-turn token, template text inside the turn included
        end_straddler = None if r.to_eot else spans.straddler(r.end)
        to_eot = r.to_eot or end_straddler is not None
        lo = spans.first_at_or_after(r.start)
        hi = max(lo, spans.ending_by(r.end))
        # tokens [lo, hi) lie inside the region (spans are monotonic for one encode)
        labels[lo:hi] = ids[lo:hi]
        # where the next message's text starts; none (the end of the text): a token the tokenizer adds
        # after the text (EOS) may end the turn
        limit = r.next_text_start if 0 <= r.next_text_start < len(text) else len(text) + 1
        if end_straddler is not None:
            k = hi
            while k < n and ids[k] not in special_ids and spans.span(k)[0] < limit:
                k += 1
            if k == n or ids[k] not in special_ids or spans.span(k)[0] >= limit:
                raise straddle(r, end_straddler)  # no end-of-turn inside the turn: no exact label
        if to_eot:
            # tool calls: everything up to the next special token, which must come before the next message
            k = hi
            while k < n and ids[k] not in special_ids and spans.span(k)[0] < limit:
                k += 1
            if k == n or ids[k] not in special_ids or spans.span(k)[0] >= limit:
                raise RecordError("no_end_of_turn", f"message {r.msg} ({r.role}) has tool calls (or no text) but no "
                                                    f"special end-of-turn token follows before the next message, so "
                                                    f"its output cannot be delimited; add the template's end token "
                                                    f"to added_tokens")
            eot_text = tok_text(k)
            # tool calls were rendered (something stands between text and end) and their data holds the
            # end token's text: the token may be inside the tool call, not after it
            # (an EOS added after the text has no text: it cannot be inside the data)
            if eot_text and text[r.end:spans.span(k)[0]].strip() and any(eot_text in d for d in r.tool_call_strings):
                raise RecordError("span_unverified", f"message {r.msg} ({r.role}): its tool calls contain the special "
                                                     f"token text {eot_text!r}, so where its output ends is ambiguous")
            labels[hi:k] = ids[hi:k]
            hi = k
        if end_of_turn == "train":
            # whitespace, then a special token, before the next message's text: whitespace at or past
            # `limit` is that message's text (and the token after it its end of turn, not ours)
            k = hi
            while k < n and ids[k] not in special_ids and not tok_text(k).strip() and spans.span(k)[0] < limit:
                k += 1
            if k < n and ids[k] in special_ids and spans.span(k)[0] < limit:
                labels[hi:k + 1] = ids[hi:k + 1]
            else:
                raise RecordError("no_end_of_turn", f"message {r.msg} ({r.role}) is trained but no special "
                                                    f"end-of-turn token follows it; set end_of_turn: mask, or add "
                                                    f"the template's end token to added_tokens")
    return labels


def message_of_tokens(chat: RenderedChat, spans: TokenSpans) -> np.ndarray:
    """Message index per token (-1 for template scaffolding), for stats and inspect."""
    out = np.full(spans.n, -1, dtype=np.int32)
    for s, e, i in chat.text_spans:
        lo = spans.first_at_or_after(s)
        hi = max(lo, spans.ending_by(e))
        out[lo:hi] = i
    return out
