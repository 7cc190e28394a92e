"""The OpenAI request bodies the server accepts, their checks, and the errors it answers with.

A body is parsed strictly (JSON types as the OpenAI API declares them: a string where a number is
expected is a 400, not a guess); an unknown field is refused as OpenAI refuses it ("Unrecognized
request argument"), so a misspelled option is never silently ignored. Fields OpenAI clients send
that this engine cannot honour are accepted only at their neutral value (presence_penalty 0, no
logit_bias, echo false, ...); `tools`, `tool_choice` and `response_format` are read by tools.py and
structured.py. Sampling values are checked by the engine's own
SamplingParams model (astrai.config.infer), the one `astrai generate` uses: one set of rules.

Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with the status codes
clients expect: 400 bad request, 401 API key, 404 unknown model or route, 408 body too slow, 413 body
too large, 415 not JSON, 421 Host not this server, 429 queue full.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from astrai.config.infer import SamplingParams, with_checkpoint_defaults

MAX_N = 128
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit (vLLM's default max_logprobs)
MAX_STOP = 16  # stop strings per request (OpenAI allows 4): each is searched for after every token
MAX_STOP_CHARS = 1000
SEED = Field(None, ge=-(2 ** 63), le=2 ** 63 - 1 - MAX_N)  # what a torch.Generator takes, for seed + choice
StopList = Union[str, list[str], None]


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type_: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error",
                              500: "server_error", 503: "server_error"}.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    # extra keys (name, tool_calls, tool_call_id, reasoning_content, ...) go to the chat template as given
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None


class _Common(_Strict):
    """Fields shared by chat and text completions."""

    model: Optional[str] = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = SEED
    stop: StopList = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: Optional[bool] = False
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    response_format: Optional[dict[str, Any]] = None  # text, json_object, json_schema (astrai.serve.structured)
    # accepted at their neutral values only (OpenAI clients send them)
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, Any]] = None
    service_tier: Optional[str] = None

    def neutral_fields(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP or any(len(x) > MAX_STOP_CHARS for x in stops):
            raise APIError(400, f"stop: at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters", param="stop")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported (use repetition_penalty)", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list[Any]] = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: Optional[bool] = None

    def neutral_fields(self) -> None:
        super().neutral_fields()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")

    def conversation(self) -> list[dict]:
        """Messages as the chat template reads them: text content, the developer role as system."""
        out = []
        for i, m in enumerate(self.messages):
            d = m.model_dump(exclude_none=True)
            d["role"] = "system" if m.role == "developer" else m.role
            if isinstance(m.content, list):
                parts = []
                for j, part in enumerate(m.content):
                    if part.type != "text":
                        raise APIError(400, f"messages[{i}].content: only text parts are supported, got "
                                            f"{part.type!r}", param="messages")
                    if part.text is None:
                        raise APIError(400, f"messages[{i}].content[{j}]: a text part needs its text",
                                       param="messages")
                    parts.append(part.text)
                d["content"] = "".join(parts)
            elif m.content is None:
                d["content"] = ""
            out.append(d)
        return out


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = 16  # OpenAI's default for text completions
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Optional[bool] = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def neutral_fields(self) -> None:
        super().neutral_fields()
        if self.echo:
            raise APIError(400, "echo is not supported by this server", param="echo")
        if self.best_of not in (None, 1, self.n):
            raise APIError(400, "best_of other than n is not supported", param="best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", param="suffix")

    def prompts(self) -> list[Union[str, list[int]]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return list(p)


def parse(model: type[BaseModel], body: bytes):
    """The request model from a JSON body, or a 400 naming the first bad field."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            raise APIError(400, f"the body is not valid JSON: {err['msg']}") from None
        loc = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"Unrecognized request argument supplied: {loc}", param=loc) from None
        if not loc:
            raise APIError(400, f"the body must be a JSON object: {err['msg']}") from None
        raise APIError(400, f"{loc}: {err['msg']}", param=str(err["loc"][0])) from None
    req.neutral_fields()
    return req


def sampling_params(req: _Common, max_tokens: int, logprobs: Optional[int], logprobs_param: str,
                    seed_offset: int = 0, checkpoint: Optional[dict] = None) -> SamplingParams:
    """The engine's SamplingParams for one choice: the request's own values over the checkpoint's
    generation_config.json (`checkpoint`) over the defaults; the engine's checks (the generate CLI's) give the 400s."""
    given = {"max_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p, "min_p": req.min_p,
             "repetition_penalty": req.repetition_penalty, "logprobs": logprobs,
             "top_k": 0 if req.top_k == -1 else req.top_k,  # vLLM's -1 = off
             "seed": None if req.seed is None else req.seed + seed_offset,  # n choices: n different draws
             "stop": [req.stop] if isinstance(req.stop, str) else req.stop, "stop_token_ids": req.stop_token_ids,
             "ignore_eos": req.ignore_eos}
    try:
        return with_checkpoint_defaults(SamplingParams(**{k: v for k, v in given.items() if v is not None}),
                                        checkpoint or {})
    except ValidationError as e:
        err = e.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        # a check across fields has no location: the field its message names first
        name = str(err["loc"][0]) if err["loc"] else _first_field(msg)
        param = logprobs_param if name == "logprobs" else name
        raise APIError(400, f"{param}: {msg}" if param else msg, param=param) from None


def _first_field(message: str) -> Optional[str]:
    hits = [(m.start(), name) for name in SamplingParams.model_fields
            if (m := re.search(rf"\b{name}\b", message)) is not None]
    return min(hits)[1] if hits else None
