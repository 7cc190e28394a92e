"""Constrained decoding: a request's output held to a grammar (a JSON schema, any JSON object, or a
Lark grammar) by masking, at each sampled token, every token the grammar cannot take next.

The grammar engine is llguidance (MIT; a Rust core with a dependency-free wheel): it compiles JSON
Schema and Lark grammars, computes a token mask over the whole vocabulary in tens of microseconds per
step, and advances a matcher with each accepted token. xgrammar (vLLM's and SGLang's) does the same
job, but its wheel requires triton and torch, which a CPU install of astrai would then pull;
outlines-core compiles a schema to a regex automaton up front, slower to build for large schemas and
without Lark grammars.

What the engine does with it (astrai.infer.sampling applies the mask, astrai.infer.engine advances):
- only rows whose request has a grammar are masked; other rows of the same step never touch it;
- the request's stop tokens (EOS, the chat template's end of turn, stop_token_ids) are allowed only
  where the grammar accepts (the text so far is a complete sentence of it), never elsewhere;
- when the grammar can take nothing more (a JSON document closed), the request ends with
  finish_reason "stop" at once, without waiting for the model to choose a stop token;
- a token the matcher refuses (it cannot happen through the mask; counted as a grammar failure)
  ends the request with finish_reason "stop" and the text so far.

JSON output is written compactly with one space after ":" and ",": whitespace inside JSON is the
freedom a sampled model at temperature 1 can spend forever (newline after newline) without ever
closing the document, so none beyond those separators is allowed.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Optional

import numpy as np

from astrai.errors import InvalidRequest

# what JSON output looks like: {"a": 1, "b": [1, 2]}, no other whitespace
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class GrammarError(InvalidRequest):
    """A schema or grammar the grammar engine cannot compile (the message says why)."""


def json_grammar(schema: Optional[dict] = None) -> str:
    """The llguidance grammar of JSON valid against `schema`; None: any JSON object (OpenAI's json_object).
    A schema that is not a JSON object raises GrammarError; compile problems show when it is checked."""
    import llguidance

    if schema is None:
        schema = {"type": "object"}
    if not isinstance(schema, dict):
        raise GrammarError(f"the JSON schema must be an object, got {type(schema).__name__}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None


def check_grammar(grammar: str, ll=None) -> None:
    """GrammarError naming why llguidance cannot use `grammar` (an unsupported keyword, a bad type, a missing
    $ref); `ll`: the LLTokenizer to check it against (None: the grammar alone, no tokenizer needed)."""
    import llguidance

    problem = llguidance.LLMatcher.validate_grammar(grammar, ll)
    if problem:
        raise GrammarError(problem.strip().splitlines()[0])


def lark_grammar(lark: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(lark)


class GrammarTokens:
    """The vocabulary as llguidance sees it (built once per engine on the first grammar: about a second
    for a 50k vocabulary), and the checks and matchers made with it. Thread-safe: a server checks grammars
    in worker threads while the engine thread builds matchers."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._ll = None
        self._lock = threading.Lock()

    @property
    def ll(self):
        with self._lock:
            if self._ll is None:
                import llguidance

                if self.tokenizer is None:
                    raise GrammarError("constrained output needs the checkpoint's tokenizer (tokenizer.json)")
                self._ll = llguidance.LLTokenizer(self.tokenizer.tok.to_str(), n_vocab=self.vocab_size,
                                                  eos_token=self.eos_ids or None)
            return self._ll

    def check(self, grammar: str) -> None:
        """check_grammar against this vocabulary."""
        check_grammar(grammar, self.ll)

    def matcher(self, grammar: str) -> "Matcher":
        return Matcher(self, grammar)


class Matcher:
    """One request's position in its grammar: the mask of allowed next tokens, advanced by each accepted token."""

    def __init__(self, tokens: GrammarTokens, grammar: str):
        import llguidance

        self.m = llguidance.LLMatcher(tokens.ll, grammar, log_level=0)
        if self.m.is_error():
            raise GrammarError(self.m.get_error().strip().splitlines()[0])
        self.grammar_eos = tokens.eos_ids
        self.failed: Optional[str] = None  # why the matcher refused a token (a grammar failure)

    def fill(self, row: np.ndarray, stop_ids) -> None:
        """row (bool [vocab]) := the tokens the grammar takes next; stop_ids only where the output may end here.
        numpy, single-threaded: a few elementwise torch ops on one 50k row cost milliseconds on a busy CPU
        (its thread pool), numpy's unpacking of llguidance's bit mask tens of microseconds."""
        vocab = row.shape[0]
        bits = np.unpackbits(np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        row[:] = bits[:vocab]  # bit t of the mask (little-endian 32-bit words) is token t
        ends = [t for t in (*self.grammar_eos, *stop_ids) if t < vocab]
        if ends:
            row[ends] = self.m.is_accepting()
            if not row.any():  # a matcher in error allows nothing: end the output rather than draw from nothing
                row[ends] = True

    def advance(self, token: int) -> bool:
        """Take `token`; False (and `failed` set) when the grammar refuses it."""
        if not self.m.consume_token(token):
            self.failed = self.m.get_error() or f"token {token} is not allowed here"
            return False
        return True

    @property
    def done(self) -> bool:
        """Nothing more can follow: the grammar is complete."""
        return self.m.is_stopped()


def validate(tokens: GrammarTokens, grammar: str, token_ids: list[int]) -> int:
    """How many leading tokens of `token_ids` a fresh matcher of `grammar` takes (llguidance's own check,
    independent of the mask the sampler applied)."""
    import llguidance

    return llguidance.LLMatcher(tokens.ll, grammar, log_level=0).validate_tokens(list(token_ids))


def response_format_grammar(fmt: Any) -> Optional[str]:
    """The grammar of an OpenAI `response_format`: None for text, any JSON object for json_object, the
    schema for json_schema. A malformed one raises GrammarError naming the key."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or "type" not in fmt:
        raise GrammarError("response_format must be an object with a type: text, json_object or json_schema")
    kind = fmt["type"]
    extra = set(fmt) - {"type", "json_schema"}
    if extra:
        raise GrammarError(f"response_format: unknown key(s) {', '.join(sorted(extra))}")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar(None)
    if kind != "json_schema":
        raise GrammarError(f"response_format.type {kind!r}: use text, json_object or json_schema")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise GrammarError("response_format.json_schema must be an object with a name (and a schema)")
    unknown = set(spec) - {"name", "description", "schema", "strict"}
    if unknown:
        raise GrammarError(f"response_format.json_schema: unknown key(s) {', '.join(sorted(unknown))}")
    if "strict" in spec and not isinstance(spec["strict"], (bool, type(None))):
        raise GrammarError("response_format.json_schema.strict must be true or false")
    schema = spec.get("schema", {})
    return json_grammar(schema if schema else {"type": "object"})
