"""The HTTP side: a Starlette app with the OpenAI routes, /health and /metrics, on one EngineLoop.

    GET  /v1/models                the one served model
    POST /v1/chat/completions      messages -> the chat template -> the engine (stream or not)
    POST /v1/completions           prompt text, token ids, or a batch of either
    GET  /health                   {"status", "running", "waiting", "kv_tokens_total", "kv_tokens_free", "kv_tokens_cached"}
    GET  /metrics                  Prometheus text format

A handler parses and checks the request (protocol.py: 400 with the field), renders and tokenizes the
prompt in a worker thread (a long chat template never blocks the event loop), checks the context
(prompt + max_tokens, both numbers named), then submits its choices to the engine loop (429 when
`--max-queue` requests already wait) and reads their tokens back. A client that disconnects, or stops
reading a stream for `--stall-timeout` seconds, cancels its request: its pages go back to the pool
before the engine's next step. Any failure answers in OpenAI's error shape; none stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import sys
import time
import traceback
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional

import jinja2
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from astrai.serve.loop import EngineLoop, Stream
from astrai.serve.metrics import Metrics
from astrai.serve.protocol import APIError, ChatRequest, CompletionRequest, parse, sampling_params
from astrai.serve.responses import (DONE, ChunkWriter, TokenText, chat_logprobs, chat_response, completion_logprobs,
                                    new_id, sse_error, text_response, usage)
from astrai.text.template import TemplateRaised

SHUTTING_DOWN = "the server is shutting down: the request was cancelled"
MAX_BODY = 32 * 2 ** 20  # bytes: far above any context's worth of JSON, far below what would hurt the server


@dataclass
class ServeConfig:
    model_name: str
    aliases: frozenset = frozenset()  # other model ids accepted for the served model (e.g. the absolute path)
    api_key: Optional[str] = None
    max_queue: int = 256
    stall_timeout: float = 30.0


async def _body(request: Request) -> bytes:
    """The request body, refused with 413 past MAX_BODY (read in pieces: a lying Content-Length cannot pass)."""
    if int(request.headers.get("content-length") or 0) > MAX_BODY:
        raise APIError(413, f"the body is larger than {MAX_BODY // 2 ** 20} MiB")
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise APIError(413, f"the body is larger than {MAX_BODY // 2 ** 20} MiB")
        parts.append(chunk)
    return b"".join(parts)


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
        self.context = engine.scheduler.max_context
        self.vocab = engine.model.config.vocab_size
        self.capacity = engine.scheduler.max_running + config.max_queue

    # ---- checks ----
    def authorize(self, request: Request) -> None:
        if self.cfg.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(given.encode(), self.cfg.api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY' with the key "
                                "the server was started with", code="invalid_api_key")

    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name != self.cfg.model_name and name not in self.cfg.aliases:
            raise APIError(404, f"The model `{name}` does not exist: this server serves `{self.cfg.model_name}`",
                           param="model", code="model_not_found")

    def max_tokens(self, n_prompt: int, asked: Optional[int], param: str, prompt_param: str) -> int:
        if asked is None:  # as long as the context allows (vLLM's default)
            if n_prompt >= self.context:
                raise APIError(400, f"This model's maximum context length is {self.context} tokens, and the prompt "
                                    f"has {n_prompt} tokens: shorten the prompt", param=prompt_param,
                               code="context_length_exceeded")
            return self.context - n_prompt
        if asked >= 1 and n_prompt + asked > self.context:
            raise APIError(400, f"This model's maximum context length is {self.context} tokens; the prompt has "
                                f"{n_prompt} tokens and {param} is {asked} ({n_prompt + asked} in all): shorten the "
                                f"prompt or lower {param}", param=param, code="context_length_exceeded")
        if asked >= 1:
            why = self.engine.scheduler.refusal(n_prompt, asked)  # the KV pool may be smaller than the context
            if why is not None:
                raise APIError(400, why, param=param, code="context_length_exceeded")
        return asked

    async def encode(self, prompt, param: str) -> list[int]:
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            bad = [t for t in prompt if not 0 <= t < self.vocab]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{self.vocab - 1})", param=param)
            ids = list(prompt)
        else:
            try:
                ids = await asyncio.get_running_loop().run_in_executor(None, self.engine.encode, prompt)
            except (TemplateRaised, jinja2.TemplateError, ValueError, TypeError) as e:
                raise APIError(400, f"{param}: {e}", param=param) from None
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        return ids

    def submit(self, choices, end_of_turn: bool, streaming: bool, arrival: float) -> Stream:
        if len(choices) > self.capacity:
            raise APIError(400, f"{len(choices)} choices (n x prompts) exceed what the server takes at once "
                                f"({self.capacity}: --max-running + --max-queue)", param="n")
        if self.loop.in_flight + len(choices) > self.capacity:
            waiting = max(self.loop.in_flight - self.engine.scheduler.max_running, 0)
            raise APIError(429, f"the server is busy: {waiting} request(s) already wait for a slot (--max-queue "
                                f"{self.cfg.max_queue}); retry later", code="rate_limit_exceeded")
        return self.loop.submit(choices, end_of_turn, streaming, arrival)

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

    # ---- routes ----
    async def chat(self, request: Request):
        arrival = time.perf_counter()
        self.authorize(request)
        req = parse(ChatRequest, await _body(request))
        self.check_model(req.model)
        ids = await self.encode(req.conversation(), "messages")
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self.max_tokens(len(ids), asked, param, "messages")
        k = (req.top_logprobs or 0) if req.logprobs else None
        choices = [(ids, sampling_params(req, max_tokens, k, "top_logprobs", i)) for i in range(req.n)]
        stream = self.submit(choices, True, bool(req.stream), arrival)
        rid, model = new_id("chatcmpl"), req.model or self.cfg.model_name
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            body = self._chunks(stream, ChunkWriter(rid, model, True, include), include, bool(req.logprobs), [len(ids)])
            return EventStream(body, lambda: self.loop.cancel(stream), self.cfg.stall_timeout)
        done = await self.collect(stream, request)
        if done is None:
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        return JSONResponse(chat_response(rid, model, done, bool(req.logprobs), self.tt))

    async def completions(self, request: Request):
        arrival = time.perf_counter()
        self.authorize(request)
        req = parse(CompletionRequest, await _body(request))
        self.check_model(req.model)
        prompts = [await self.encode(p, "prompt") for p in req.prompts()]
        choices = []
        for ids in prompts:
            max_tokens = self.max_tokens(len(ids), req.max_tokens, "max_tokens", "prompt")
            choices += [(ids, sampling_params(req, max_tokens, req.logprobs, "logprobs", i)) for i in range(req.n)]
        stream = self.submit(choices, False, bool(req.stream), arrival)
        rid, model = new_id("cmpl"), req.model or self.cfg.model_name
        lens, want_lp = [len(p) for p in prompts], req.logprobs is not None
        if req.stream:
            include = bool(req.stream_options and req.stream_options.include_usage)
            body = self._chunks(stream, ChunkWriter(rid, model, False, include), include, want_lp, lens, req.n)
            return EventStream(body, lambda: self.loop.cancel(stream), self.cfg.stall_timeout)
        done = await self.collect(stream, request)
        if done is None:
            return Response(status_code=499)
        return JSONResponse(text_response(rid, model, done, want_lp, self.tt, lens, req.n))

    async def _chunks(self, stream: Stream, w: ChunkWriter, include_usage: bool, want_lp: bool,
                      prompt_lens: list[int], n: Optional[int] = None) -> AsyncIterator[bytes]:
        total = len(stream.results)
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
                    yield sse_error(APIError(500, ev.completion).body()) + DONE
                    return
                lp = None
                if want_lp and ev.logprob is not None:
                    lp = (chat_logprobs([ev.logprob], self.tt) if w.chat
                          else completion_logprobs([ev.logprob], self.tt, offsets[ev.index]))
                if ev.text or lp is not None:
                    out.append(w.text(ev.index, ev.text, lp))
                    offsets[ev.index] += len(ev.text)
                if ev.finish_reason is not None:
                    out.append(w.finish(ev.index, ev.finish_reason))
                    left -= 1
            yield b"".join(out)
        if include_usage:
            yield w.usage(usage(stream.results, prompt_lens, n or total))
        yield DONE

    async def models(self, request: Request):
        self.authorize(request)
        return JSONResponse({"object": "list", "data": [
            {"id": self.cfg.model_name, "object": "model", "created": int(time.time()), "owned_by": "astrai",
             "max_model_len": self.context}]})

    async def health(self, request: Request):
        s = await self.loop.snapshot()
        return JSONResponse({"status": "ok", **{k: s[k] for k in ("running", "waiting", "kv_tokens_total",
                                                                    "kv_tokens_free", "kv_tokens_cached")}})

    async def prometheus(self, request: Request):
        snap = await self.loop.snapshot()
        return PlainTextResponse(self.metrics.render(snap), media_type="text/plain; version=0.0.4; charset=utf-8")


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


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
        return _error_response(exc)

    async def http_error(request, exc: HTTPException):
        what = "no route" if exc.status_code == 404 else exc.detail
        return _error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {what}",
                                        code="not_found" if exc.status_code == 404 else None))

    async def unexpected(request, exc: Exception):
        traceback.print_exception(exc, file=sys.stderr)
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    routes = [Route("/v1/chat/completions", server.chat, methods=["POST"]),
              Route("/v1/completions", server.completions, methods=["POST"]),
              Route("/v1/models", server.models, methods=["GET"]),
              Route("/health", server.health, methods=["GET"]),
              Route("/metrics", server.prometheus, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: api_error, HTTPException: http_error, Exception: unexpected})
    app.state.server = server
    return app
