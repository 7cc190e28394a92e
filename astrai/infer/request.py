"""What a generation request asks for (SamplingParams) and what the engine tracks about it (Request).

A request's sequence is `tokens` = prompt + generated ids. `kv_len` counts the leading tokens whose
K/V is written in the pages of `pages` (page i holds positions i*page_size .. (i+1)*page_size-1).
Each step computes tokens[kv_len:kv_len+n] for some n >= 1; when that reaches the end of `tokens`
the step's last logits sample the next token. Prefill, chunked prefill, decode and recomputation
after preemption are all this one move, so the scheduler has a single kind of work item.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from astrai.config.infer import SamplingParams
from astrai.errors import InvalidRequest

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


def check_request(ids: list[int], params: SamplingParams, vocab_size: int, from_text: bool = False) -> None:
    """What only the model can tell about a request: its token ids and stop token ids exist in the
    vocabulary, and `logprobs` asks for no more alternatives than there are tokens. InvalidRequest otherwise."""
    if not ids:
        raise InvalidRequest("the prompt has no tokens: give some text or token ids")
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"token id {ids[bad]} (position {bad}) is outside the model's vocabulary (0..{vocab_size - 1})"
            + ("; the tokenizer does not belong to this model" if from_text else ""))
    bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"stop token id {bad} is outside the model's vocabulary (0..{vocab_size - 1})")
    if params.logprobs is not None and params.logprobs > vocab_size:
        raise InvalidRequest(f"logprobs {params.logprobs}: the model has {vocab_size} tokens; ask for at most that "
                             f"many alternatives")


@dataclass
class RequestStats:
    arrival: float = field(default_factory=time.perf_counter)
    first_token: Optional[float] = None
    finished: Optional[float] = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (summed over admissions)
    computed_tokens: int = 0  # tokens run through the model for this request (recomputation included)
    preemptions: int = 0


@dataclass(eq=False)
class Request:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset = frozenset()  # stop_token_ids plus eos unless ignore_eos
    tokens: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    kv_len: int = 0
    row: Optional[int] = None  # row in the request-to-token table while it holds pages
    cache_epoch: int = 0  # the pool's epoch when its K/V began (PagePool.reset_prefix_cache)
    status: str = WAITING
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    stop_reason: Optional[object] = None  # the stop token id or stop string that ended it
    generator: Optional[object] = None  # torch.Generator when seeded
    adapter: int = 0  # the LoRA adapter it runs with (astrai.infer.lora_bank; 0: the base)
    matcher: Optional[object] = None  # astrai.infer.grammar.Matcher when the output is held to a grammar
    logprobs: list = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return len(self.tokens) - self.kv_len
