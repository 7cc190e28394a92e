"""What a request must satisfy before it reaches the engine, cheapest first, each refusal a 4xx naming the field.

    authorize      the API key (401)
    check_model    the model id (404)
    check_size     prompt text, or the messages' text together, at most `max_prompt_chars` characters;
                   token-id prompts at most the context: before the chat template or tokenizer runs
    check_batch    n x prompts at most what the server takes at once: before any encoding
    encode         the chat template and tokenizer, in a worker thread (the tokenizer releases the GIL,
                   so /health keeps answering while a long prompt is tokenized)
    max_tokens     prompt + max_tokens within the context and the KV pool (both numbers named)
    check_ids      the engine's own checks of ids and sampling against the vocabulary (stop_token_ids)

`max_prompt_chars` defaults to 16 characters per token of the context: natural text and code average
3 to 5 characters per token, so a prompt past the bound cannot fit; only text made of long runs of one
character averages more, and `--max-prompt-chars` takes it.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Optional

import jinja2

from astrai.errors import InvalidRequest
from astrai.infer.request import check_request
from astrai.serve.protocol import APIError
from astrai.text.sandbox import weight
from astrai.text.template import TemplateLimit, TemplateRaised

CHARS_PER_TOKEN = 16


class Checks:
    def __init__(self, engine, model_name: str, aliases: frozenset, api_key: Optional[str], max_queue: int,
                 max_prompt_chars: Optional[int] = None):
        self.engine = engine
        self.model_name, self.aliases, self.api_key, self.max_queue = model_name, aliases, api_key, max_queue
        self.context = engine.scheduler.max_context
        self.vocab = engine.model.config.vocab_size
        self.capacity = engine.scheduler.max_running + max_queue
        self.max_chars = max_prompt_chars or CHARS_PER_TOKEN * self.context

    def authorize(self, headers) -> None:
        if self.api_key is None:
            return
        auth = headers.get("authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY' with the key "
                                "the server was started with", code="invalid_api_key")

    def check_model(self, name: Optional[str]) -> Optional[str]:
        """The LoRA adapter a request's model id names (None: the base); 404 for an id not served here."""
        if name is None or name == self.model_name or name in self.aliases:
            return None
        adapters = self.engine.adapter_names
        if name in adapters:
            return name
        served = ", ".join(f"`{m}`" for m in [self.model_name, *adapters])
        raise APIError(404, f"The model `{name}` does not exist: this server serves {served}",
                       param="model", code="model_not_found")

    def check_size(self, prompt, param: str) -> None:
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):  # token ids
            if len(prompt) > self.context:
                raise APIError(400, f"This model's maximum context length is {self.context} tokens, and the prompt "
                                    f"has {len(prompt)} tokens: shorten the prompt", param=param,
                               code="context_length_exceeded")
            return
        chars = weight(prompt, self.max_chars)  # messages: their text and keys, counted up to the bound
        if chars > self.max_chars:
            held = (f"the prompt has {chars:,}" if isinstance(prompt, str)
                    else f"the messages hold more than {self.max_chars:,}")
            raise APIError(400, f"{held} characters; this server takes at most {self.max_chars:,} before tokenizing "
                                f"({self.context} tokens of context): shorten it, or start the server with a larger "
                                f"--max-prompt-chars", param=param, code="context_length_exceeded")

    def check_batch(self, n_choices: int) -> None:
        if n_choices > self.capacity:
            raise APIError(400, f"{n_choices} choices (n x prompts) exceed what the server takes at once "
                                f"({self.capacity}: --max-running + --max-queue)", param="n")

    async def encode(self, prompt, param: str, tools: Optional[list] = None) -> list[int]:
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            bad = [t for t in prompt if not 0 <= t < self.vocab]
            if bad:
                raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{self.vocab - 1})", param=param)
            ids = list(prompt)
        else:
            try:
                ids = await asyncio.get_running_loop().run_in_executor(None, self.engine.encode, prompt, tools)
            except TemplateLimit as e:  # the client's conversation took the template past its bounds
                raise APIError(400, f"{param}: the chat template cannot render this conversation within its "
                                    f"limits: {e}", param=param) from None
            except (TemplateRaised, jinja2.TemplateError, ValueError, TypeError) as e:
                raise APIError(400, f"{param}: {e}", param=param) from None
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)
        return ids

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

    def check_ids(self, ids: list[int], params, prompt_param: str, logprobs_param: str) -> None:
        """The engine's own request checks, here where the answer can still be a 400 naming the field."""
        try:
            check_request(ids, params, self.vocab, from_text=True)
        except InvalidRequest as e:
            if any(not 0 <= t < self.vocab for t in params.stop_token_ids):
                param = "stop_token_ids"
            elif params.logprobs is not None and params.logprobs > self.vocab:
                param = logprobs_param
            else:
                param = prompt_param
            raise APIError(400, f"{param}: {e}", param=param) from None
