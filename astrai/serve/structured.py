"""The grammar a request's answer is held to: `response_format` (json_object, json_schema) for chat and
text completions, or a forced tool call (`tool_choice` "required" or a named function, astrai.serve.tools).

The grammar is built from the request and compiled by the engine's grammar engine (llguidance, see
astrai.infer.grammar) in a worker thread before anything is queued, so a schema it cannot compile is
a 400 naming the field and the reason, never a failed request later. Every choice of the request is
held to the same grammar.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from astrai.infer.grammar import GrammarError, lark_grammar, response_format_grammar
from astrai.serve.protocol import APIError
from astrai.serve.tools import forced_call_lark


def _kind(fmt) -> str:
    return fmt.get("type", "") if isinstance(fmt, dict) else ""


async def checked_grammar(engine, grammar: Optional[str], param: str, metrics=None) -> Optional[str]:
    """`grammar` once the engine's grammar engine compiled it (in a worker thread: a large schema takes
    a while and llguidance releases the GIL); a 400 naming `param` and the reason otherwise."""
    if grammar is None:
        return None
    try:
        await asyncio.get_running_loop().run_in_executor(None, engine.grammar.check, grammar)
    except GrammarError as e:
        if metrics is not None:
            metrics.grammar_errors.inc()
        raise APIError(400, f"{param}: the grammar engine cannot use this schema: {e}", param=param) from None
    return grammar


async def chat_grammar(engine, req, tool_fmt: Optional[str], metrics=None) -> Optional[str]:
    """A chat request's grammar: a forced tool call (tool_choice "required" or a named function, in the
    template's format `tool_fmt`) before `response_format`."""
    tok = engine.tokenizer

    def special(text: str) -> Optional[int]:
        tid = tok.tok.token_to_id(text) if tok is not None else None
        return tid if tid is not None and tid in tok.special_ids else None

    lark = forced_call_lark(req, tool_fmt, special) if tool_fmt else None
    if lark is None:
        return await response_format(engine, req, metrics)
    grammar = await checked_grammar(engine, lark_grammar(lark), "tools", metrics)
    if metrics is not None:
        metrics.constrained.labels("tool_call").inc()
    return grammar


async def response_format(engine, req, metrics=None) -> Optional[str]:
    """The grammar of `req.response_format` (None: plain text), compiled; 400 with param response_format."""
    try:
        grammar = response_format_grammar(req.response_format)
    except GrammarError as e:
        if metrics is not None:
            metrics.grammar_errors.inc()
        raise APIError(400, str(e), param="response_format") from None
    grammar = await checked_grammar(engine, grammar, "response_format", metrics)
    if grammar is not None and metrics is not None:
        metrics.constrained.labels(_kind(req.response_format)).inc()
    return grammar
