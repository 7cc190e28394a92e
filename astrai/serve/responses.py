"""OpenAI response bodies: chat and text completions, whole or as Server-Sent Events chunks, with logprobs.

Streaming follows the OpenAI API: for chat, each choice first gets a chunk whose delta carries the
role, then one chunk per piece of new text (`delta.content`), then a chunk with an empty delta and
the finish_reason; with `stream_options.include_usage` every chunk carries `"usage": null` and one
last chunk has no choices and the usage; then `data: [DONE]`. Text completions stream `text` pieces
the same way. A piece never ends inside a multi-byte character (the engine's detokenizer holds it back).

No float in a response is NaN or Infinity (strict JSON parsers refuse them): a logprob of -inf (a
token the model gives no chance) is written as LOGPROB_FLOOR, as vLLM writes it; a NaN or +inf
logprob can only come from a broken model and raises NotFinite, which the server answers as an error.

Chunks are the hot path of a busy server (one per token per client), so they are written from
pre-serialised fragments around json.dumps of the new text rather than by serialising a dict.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from functools import lru_cache
from typing import Optional

DONE = b"data: [DONE]\n\n"
LOGPROB_FLOOR = -9999.0


class NotFinite(ValueError):
    """The model's output holds NaN or +inf: its weights (or an adapter's) make non-finite logits."""


def _logprob(v: float) -> float:
    if math.isnan(v) or v == math.inf:
        raise NotFinite(f"the model's output is not a number (a logprob of {v}): its weights, or an adapter's, "
                        f"make non-finite logits; check the checkpoint")
    return max(v, LOGPROB_FLOOR)


def _bytes_to_unicode() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): printable bytes stand for themselves, the others are shifted
    to 256 + k; the inverse gives a token's exact bytes, even for half a UTF-8 character."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, k = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + k)] = b
            k += 1
    return chars


_BYTE_OF = _bytes_to_unicode()


def _dumps(value) -> str:
    return json.dumps(value, allow_nan=False)


class TokenText:
    """A token id's text and bytes for logprobs (cached: the vocabulary does not change)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer.tok if tokenizer is not None else None
        decoder = type(getattr(self.tok, "decoder", None)).__name__
        self.byte_level = decoder == "ByteLevel"
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, tid: int) -> str:
        return self.tok.decode([tid], skip_special_tokens=False) if self.tok is not None else f"<{tid}>"

    def _bytes(self, tid: int) -> list[int]:
        piece = self.tok.id_to_token(tid) if self.tok is not None else None
        if self.byte_level and piece and all(c in _BYTE_OF for c in piece):
            return [_BYTE_OF[c] for c in piece]
        return list(self.text(tid).encode("utf-8"))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(completions, prompt_lens: list[int], n: int) -> dict:
    """Prompt tokens count once per prompt, not per choice (choice i*n+j answers prompt i); cached = what the
    prompt found in the prefix cache: the least any of its choices found (later choices also reuse the
    pages the first one computed)."""
    prompt = sum(prompt_lens)
    completion = sum(len(c.token_ids) for c in completions)
    cached = [min(min(c.cached_tokens, prompt_lens[i]) for c in completions[i * n:(i + 1) * n])
              for i in range(len(prompt_lens))]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached)}}


def chat_logprobs(lps, tt: TokenText) -> dict:
    def entry(tid, lp):
        return {"token": tt.text(tid), "logprob": _logprob(lp), "bytes": tt.bytes(tid)}

    return {"content": [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]}
                        for x in lps]}


def completion_logprobs(lps, tt: TokenText, offset: int = 0) -> dict:
    tokens, offsets, at = [], [], offset
    for x in lps:
        s = tt.text(x.token_id)
        tokens.append(s)
        offsets.append(at)
        at += len(s)
    return {"tokens": tokens, "token_logprobs": [_logprob(x.logprob) for x in lps],
            "top_logprobs": [{tt.text(t): _logprob(v) for t, v in x.top} for x in lps], "text_offset": offsets}


def chat_response(rid: str, model: str, completions, logprobs: bool, tt: TokenText) -> dict:
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c.logprobs, tt) if logprobs and c.logprobs is not None else None,
                "finish_reason": c.finish_reason} for c in completions]
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(completions, [len(completions[0].prompt_token_ids)], len(completions))}


def text_response(rid: str, model: str, completions, logprobs: bool, tt: TokenText, prompt_lens: list[int],
                  n: int) -> dict:
    choices = [{"index": c.index, "text": c.text,
                "logprobs": completion_logprobs(c.logprobs, tt) if logprobs and c.logprobs is not None else None,
                "finish_reason": c.finish_reason} for c in completions]
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(completions, prompt_lens, n)}


class ChunkWriter:
    """The SSE lines of one streamed response."""

    def __init__(self, rid: str, model: str, chat: bool, include_usage: bool):
        self.chat = chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        self.head = (f'data: {{"id":{_dumps(rid)},"object":"{obj}","created":{int(time.time())},'
                     f'"model":{_dumps(model)},"choices":[')
        self.tail = ']' + (',"usage":null' if include_usage else '') + '}\n\n'

    def _choice(self, index: int, body: str, logprobs: Optional[dict], finish: Optional[str]) -> str:
        lp = _dumps(logprobs) if logprobs is not None else "null"
        fr = f'"{finish}"' if finish is not None else "null"
        return f'{{"index":{index},{body},"logprobs":{lp},"finish_reason":{fr}}}'

    def role(self, index: int) -> bytes:
        return (self.head + self._choice(index, '"delta":{"role":"assistant","content":""}', None, None)
                + self.tail).encode()

    def text(self, index: int, text: str, logprobs: Optional[dict] = None) -> bytes:
        body = f'"delta":{{"content":{_dumps(text)}}}' if self.chat else f'"text":{_dumps(text)}'
        return (self.head + self._choice(index, body, logprobs, None) + self.tail).encode()

    def tool_calls(self, index: int, calls: list[dict]) -> bytes:
        """One delta with every call of the choice (OpenAI's streamed shape: an index per call)."""
        body = _dumps({"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]})
        return (self.head + self._choice(index, f'"delta":{body}', None, None) + self.tail).encode()

    def finish(self, index: int, reason: str) -> bytes:
        body = '"delta":{}' if self.chat else '"text":""'
        return (self.head + self._choice(index, body, None, reason) + self.tail).encode()

    def usage(self, usage_: dict) -> bytes:
        return (self.head + '],"usage":' + _dumps(usage_) + '}\n\n').encode()


def sse_error(err: dict) -> bytes:
    return b"data: " + _dumps(err).encode() + b"\n\n"
