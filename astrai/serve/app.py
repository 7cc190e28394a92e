"""The HTTP side: a Starlette app with the OpenAI routes, /health and /metrics, on one EngineLoop.

    GET  /v1/models                the one served model
    POST /v1/chat/completions      messages -> the chat template -> the engine (stream or not)
    POST /v1/completions           prompt text, token ids, or a batch of either
    GET  /health                   {"status", "running", "waiting", "kv_tokens_total", "kv_tokens_free", "kv_tokens_cached"}
    GET  /metrics                  Prometheus text format

Before a handler runs, the Guard middleware (guard.py) checks the Host header, the Content-Type of
POST bodies and the body's size and arrival time. A handler then parses the body (protocol.py: 400
with the field) and runs the checks of checks.py in order of cost: sizes and the number of choices
before any tokenizing, the chat template and tokenizer in a worker thread, then the context (prompt
+ max_tokens, both numbers named), the vocabulary, and the grammar of `response_format` or of a forced
tool call (structured.py: compiled by the grammar engine, or a 400 saying why). `tools` are rendered
by the chat template and calls parsed back from the answers (tools.py). Each choice samples with the request's own
values over the checkpoint's generation_config.json (as `astrai generate` and `astrai chat` do). The
choices go to the engine loop (429 when `--max-queue` requests already wait) and their tokens come
back. A client that disconnects, or stops reading a stream for `--stall-timeout` seconds, cancels its
request: its pages go back to the pool before the engine's next step. Any failure answers in OpenAI's
error shape; none stops the server. A response never carries NaN or Infinity: a logprob of -inf is
written as -9999.0 (vLLM's convention); a NaN one means the model's output is broken and the request
ends with a 500 saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from astrai.serve.checks import Checks
from astrai.serve.guard import Guard, HostRule
from astrai.serve.loop import EngineLoop, Stream
from astrai.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from astrai.serve.metrics import Metrics
from astrai.serve.protocol import APIError, ChatRequest, CompletionRequest, parse, sampling_params
from astrai.serve.responses import (DONE, ChunkWriter, NotFinite, TokenText, chat_logprobs, chat_response,
                                    completion_logprobs, new_id, sse_error, text_response, usage)
from astrai.serve.structured import chat_grammar, response_format
from astrai.serve.tools import HeldText, answer_calls, arguments_as_objects, check_tools

SHUTTING_DOWN = "the server is shutting down: the request was cancelled"
HEALTH_WAIT_S = 0.5  # longer inside one engine step: /health answers with the last snapshot's figures, "stale": true


@dataclass
class ServeConfig:
    model_name: str
    aliases: frozenset = frozenset()  # other model ids accepted for the served model (e.g. the absolute path)
    api_key: Optional[str] = None
    max_queue: int = 256
    stall_timeout: float = 30.0
    hosts: HostRule = field(default_factory=lambda: HostRule("127.0.0.1"))
    max_body: int = 32 * 2 ** 20  # bytes
    read_timeout: float = 30.0
    max_prompt_chars: Optional[int] = None  # default: CHARS_PER_TOKEN x the context


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream:
    """An SSE response that cancels its request when the client goes away or stops reading (an ASGI app)."""

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], None], stall_timeout: float):
        self.body, self.on_close, self.stall = body, on_close, stall_timeout
        self.sending_since: Optional[float] = None

    async def _send_all(self, send) -> None:
        async for data in self.body:
            self.sending_since = time.monotonic()
            await send({"type": "http.response.body", "body": data, "more_body": True})
            self.sending_since = None
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no")]})
        sender = asyncio.ensure_future(self._send_all(send))
        watcher = asyncio.ensure_future(_disconnected(receive))
        stopping = False
        try:
            while True:
                done, _ = await asyncio.wait({sender, watcher}, timeout=min(1.0, self.stall),
                                             return_when=asyncio.FIRST_COMPLETED)
                if sender in done:
                    sender.result()
                    break
                if watcher in done:
                    break  # the client went away
                since = self.sending_since
                if since is not None and time.monotonic() - since > self.stall:
                    break  # the client stopped reading: give its pages back, close the connection
        except asyncio.CancelledError:
            stopping = True  # the server stops and the grace period is over
        finally:
            for t in (sender, watcher):
                t.cancel()
            self.on_close()
        if stopping:  # say why the stream ends, if the client still reads (bounded: it may not)
            end = sse_error(APIError(503, SHUTTING_DOWN).body()) + DONE
            with contextlib.suppress(asyncio.TimeoutError, OSError):
                await asyncio.wait_for(send({"type": "http.response.body", "body": end, "more_body": False}), 1.0)


class Server:
    def __init__(self, engine, config: ServeConfig):
        self.engine = engine
        self.cfg = config
        self.metrics = Metrics(config.model_name)
        self.loop = EngineLoop(engine, self.metrics)
        self.tt = TokenText(engine.tokenizer)
        self.checks = Checks(engine, config.model_name, config.aliases, config.api_key, config.max_queue,
                             config.max_prompt_chars)
        self.defaults = engine.generation_defaults  # the checkpoint's generation_config.json, under each request

    def submit(self, choices, end_of_turn: bool, streaming: bool, arrival: float, grammar=None,
               adapter: Optional[str] = None) -> Stream:
        if self.loop.in_flight + len(choices) > self.checks.capacity:
            waiting = max(self.loop.in_flight - self.engine.scheduler.max_running, 0)
            raise APIError(429, f"the server is busy: {waiting} request(s) already wait for a slot (--max-queue "
                                f"{self.cfg.max_queue}); retry later", code="rate_limit_exceeded")
        self.metrics.submitted(adapter, len(choices))
        return self.loop.submit(choices, end_of_turn, streaming, arrival, grammar, adapter)

    async def collect(self, stream: Stream, request: Request) -> list:
        """Wait for every choice (non-streaming); a client that goes away cancels them."""
        watcher = asyncio.ensure_future(_disconnected(request.receive))
        try:
            await asyncio.wait({stream.done, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server stops and the grace period is over
            self.loop.cancel(stream)
            raise APIError(503, SHUTTING_DOWN) from None
        finally:
            watcher.cancel()
        if not stream.done.done():  # the client went away: nobody to answer
            self.loop.cancel(stream)
            return None
        errors = [r for r in stream.results if isinstance(r, str)]
        if errors:
            raise APIError(500, errors[0])
        return stream.results

    async def _request(self, model: type, request: Request):
        """(the checked request body: key, JSON, fields, model id; the LoRA adapter its model id names, or None)."""
        self.checks.authorize(request.headers)
        req = parse(model, await request.body())
        return req, self.checks.check_model(req.model)

    def _params(self, req, ids: list[int], max_tokens: int, logprobs: Optional[int], logprobs_param: str,
                prompt_param: str, n: int) -> list:
        params = [sampling_params(req, max_tokens, logprobs, logprobs_param, i, self.defaults) for i in range(n)]
        self.checks.check_ids(ids, params[0], prompt_param, logprobs_param)
        return params

    # ---- routes ----
    async def chat(self, request: Request):
        arrival = time.perf_counter()
        req, adapter = await self._request(ChatRequest, request)
        tool_fmt = check_tools(req, self.engine.template)  # the template's tool-call format, when tools are given
        conversation = arguments_as_objects(req.conversation())
        self.checks.check_size(conversation, "messages")
        if req.tools:
            self.checks.check_size(req.tools, "tools")
        self.checks.check_batch(req.n)
        ids = await self.checks.encode(conversation, "messages", req.tools if tool_fmt else None)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self.checks.max_tokens(len(ids), asked, param, "messages")
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = self._params(req, ids, max_tokens, k, "top_logprobs", "messages", req.n)
        grammar = await chat_grammar(self.engine, req, tool_fmt, self.metrics)
        stream = self.submit([(ids, p) for p in params], True, bool(req.stream), arrival, grammar, adapter)
        rid, model = new_id("chatcmpl"), req.model or self.cfg.model_name
        calls_fmt = tool_fmt if req.tool_choice != "none" else None  # answers parsed for tool calls
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            body = self._chunks(stream, ChunkWriter(rid, model, True, include), include, bool(req.logprobs), [len(ids)],
                                calls_fmt=calls_fmt)
            return EventStream(body, lambda: self.loop.cancel(stream), self.cfg.stall_timeout)
        done = await self.collect(stream, request)
        if done is None:
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        body = _finite(chat_response, rid, model, done, bool(req.logprobs), self.tt)
        for choice, c in zip(body["choices"], done) if calls_fmt else ():
            content, calls = answer_calls(calls_fmt, c, self.engine.tokenizer)
            if calls:
                choice["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                choice["finish_reason"] = "tool_calls"
        return JSONResponse(body)

    async def completions(self, request: Request):
        arrival = time.perf_counter()
        req, adapter = await self._request(CompletionRequest, request)
        prompts = req.prompts()
        for p in prompts:
            self.checks.check_size(p, "prompt")
        self.checks.check_batch(len(prompts) * req.n)
        prompts = [await self.checks.encode(p, "prompt") for p in prompts]
        choices = []
        for ids in prompts:
            max_tokens = self.checks.max_tokens(len(ids), req.max_tokens, "max_tokens", "prompt")
            params = self._params(req, ids, max_tokens, req.logprobs, "logprobs", "prompt", req.n)
            choices += [(ids, p) for p in params]
        grammar = await response_format(self.engine, req, self.metrics)
        stream = self.submit(choices, False, bool(req.stream), arrival, grammar, adapter)
        rid, model = new_id("cmpl"), req.model or self.cfg.model_name
        lens, want_lp = [len(p) for p in prompts], req.logprobs is not None
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            body = self._chunks(stream, ChunkWriter(rid, model, False, include), include, want_lp, lens, req.n)
            return EventStream(body, lambda: self.loop.cancel(stream), self.cfg.stall_timeout)
        done = await self.collect(stream, request)
        if done is None:
            return Response(status_code=499)
        return JSONResponse(_finite(text_response, rid, model, done, want_lp, self.tt, lens, req.n))

    async def _chunks(self, stream: Stream, w: ChunkWriter, include_usage: bool, want_lp: bool,
                      prompt_lens: list[int], n: Optional[int] = None, calls_fmt: Optional[str] = None
                      ) -> AsyncIterator[bytes]:
        """`calls_fmt`: the answers may hold tool calls in that format: text from a possible call on is held
        back and sent as tool_calls deltas at the end (or as content when it held no call)."""
        total = len(stream.results)
        held = [HeldText(calls_fmt) for _ in range(total)] if calls_fmt else None
        if w.chat:
            yield b"".join(w.role(i) for i in range(total))
        offsets = [0] * total
        left = total
        while left:
            events = [await stream.queue.get()]
            while not stream.queue.empty():
                events.append(stream.queue.get_nowait())
            out = []
            for ev in events:
                if ev.finish_reason == "error":
                    self.loop.cancel(stream)
                    yield b"".join(out) + sse_error(APIError(500, ev.completion).body()) + DONE
                    return
                lp = None
                if want_lp and ev.logprob is not None:
                    try:
                        lp = (chat_logprobs([ev.logprob], self.tt) if w.chat
                              else completion_logprobs([ev.logprob], self.tt, offsets[ev.index]))
                    except NotFinite as e:
                        self.loop.cancel(stream)
                        yield b"".join(out) + sse_error(_not_finite(e).body()) + DONE
                        return
                text, reason = ev.text, ev.finish_reason
                if held is not None:
                    text = held[ev.index].push(text)
                    if reason is not None and reason != "error":
                        content, calls = answer_calls(calls_fmt, ev.completion, self.engine.tokenizer)
                        if calls:
                            out += [w.text(ev.index, content[offsets[ev.index]:])] if content and \
                                len(content) > offsets[ev.index] else []
                            out.append(w.tool_calls(ev.index, calls))
                            out.append(w.finish(ev.index, "tool_calls"))
                            left -= 1
                            continue
                        text += held[ev.index].rest()
                if text or lp is not None:
                    out.append(w.text(ev.index, text, lp))
                    offsets[ev.index] += len(text)
                if reason is not None:
                    out.append(w.finish(ev.index, reason))
                    left -= 1
            yield b"".join(out)
        if include_usage:
            yield w.usage(usage(stream.results, prompt_lens, n or total))
        yield DONE

    async def models(self, request: Request):
        self.checks.authorize(request.headers)
        now, base = int(time.time()), self.cfg.model_name
        return JSONResponse({"object": "list", "data": [
            {"id": base, "object": "model", "created": now, "owned_by": "astrai", "max_model_len": self.checks.context},
            *({"id": name, "object": "model", "created": now, "owned_by": "astrai", "parent": base,
               "max_model_len": self.checks.context} for name in self.engine.adapter_names)]})

    async def health(self, request: Request):
        s = await self.loop.snapshot(wait=HEALTH_WAIT_S)
        return JSONResponse({"status": "ok", **{k: s[k] for k in ("running", "waiting", "kv_tokens_total",
                                                                    "kv_tokens_free", "kv_tokens_cached", "stale")
                                                if k in s}})

    async def prometheus(self, request: Request):
        snap = await self.loop.snapshot()
        return Response(self.metrics.render(snap), media_type=METRICS_CONTENT_TYPE)


def _not_finite(e: Exception) -> APIError:
    return APIError(500, str(e), code="model_output_not_finite")


def _finite(build, *args) -> dict:
    """A response body, or a 500 saying the model's output is not a number (never NaN in the JSON)."""
    try:
        return build(*args)
    except NotFinite as e:
        raise _not_finite(e) from None


def build_app(engine, config: ServeConfig) -> Starlette:
    server = Server(engine, config)

    @asynccontextmanager
    async def lifespan(app):
        server.loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            server.loop.stop()

    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    async def http_error(request, exc: HTTPException):
        what = "no route" if exc.status_code == 404 else exc.detail
        return await api_error(request, APIError(exc.status_code, f"{request.method} {request.url.path}: {what}",
                                                 code="not_found" if exc.status_code == 404 else None))

    routes = [Route("/v1/chat/completions", server.chat, methods=["POST"]),
              Route("/v1/completions", server.completions, methods=["POST"]),
              Route("/v1/models", server.models, methods=["GET"]),
              Route("/health", server.health, methods=["GET"]),
              Route("/metrics", server.prometheus, methods=["GET"])]
    guard = Middleware(Guard, hosts=config.hosts, max_body=config.max_body, read_timeout=config.read_timeout)
    app = Starlette(routes=routes, lifespan=lifespan, middleware=[guard],
                    exception_handlers={APIError: api_error, HTTPException: http_error})
    app.state.server = server
    return app
