"""Incremental detokenization with stop strings: the text of a request as its tokens arrive.

Text grows by decoding a short window of recent ids and taking what is new, held back while the
window ends inside an unfinished UTF-8 character (a byte-level BPE token can be half of one); the
window starts with a few prompt ids so the first output token decodes as it does mid-text (some
decoders drop a leading space at the start of a sequence).

Stop strings: generation stops at the first occurrence of any stop string, the text ends just
before it, and streamed text never shows a partial stop string: characters that could begin one
are held back until the next token proves otherwise (or the request ends, which releases them).
"""

from __future__ import annotations

from typing import Optional

CONTEXT_IDS = 6


class OutputText:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str] = (), skip_special_tokens: bool = True):
        self.tok = tokenizer  # a tokenizers.Tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids[-CONTEXT_IDS:])
        self.prefix = 0
        self.read = len(self.ids)
        self.stop = list(stop)
        self.text = ""  # everything decoded so far (cut at a stop string once found)
        self.emitted = 0  # characters of text already handed out by push/flush
        self.stop_string: Optional[str] = None

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_id: int) -> str:
        """Add a sampled token; returns the newly visible text. Check `stop_string` afterwards."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""  # no new character yet (or half of one)
        start = len(self.text)
        self.text += now[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        if self.stop:
            self._find_stop(start)
        return self._visible()

    def _find_stop(self, new_from: int) -> None:
        longest = max(map(len, self.stop))
        search_from = max(0, new_from - longest + 1)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            i, s = min(hits)
            self.text = self.text[:i]
            self.stop_string = s

    def _visible(self) -> str:
        end = len(self.text)
        if self.stop and self.stop_string is None:
            end -= self._held_back()
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """The request ended: release held-back text (and any final partial character as decoded)."""
        if self.stop_string is None and len(self.ids) > self.read:
            tail = self._decode(self.ids[self.prefix:])[len(self._decode(self.ids[self.prefix:self.read])):]
            self.text += tail
            self.read = len(self.ids)
            if self.stop:
                self._find_stop(len(self.text) - len(tail))
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out
