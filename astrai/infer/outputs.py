"""What the engine returns: a request's `Completion`, the `StreamEvent`s of a streamed call, and the engine's
running `EngineStats` (astrai.infer.engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from astrai.infer.sampling import TokenLogprob
from astrai.infer.scheduler import Scheduler


@dataclass
class Completion:
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: Optional[Union[int, str]] = None
    logprobs: Optional[list[TokenLogprob]] = None
    cached_tokens: int = 0
    preemptions: int = 0
    time_to_first_token: float = 0.0
    latency: float = 0.0


@dataclass
class StreamEvent:
    index: int  # position of the prompt in the call
    token_id: int
    text: str  # newly visible text (may be empty)
    finish_reason: Optional[str] = None
    completion: Optional[Completion] = None  # set on the last event of a request


@dataclass
class EngineStats:
    steps: int = 0
    step_seconds: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    requests: int = 0
    constrained_requests: int = 0  # requests held to a grammar
    grammar_failures: int = 0  # tokens a request's grammar refused (ends that request)

    def as_dict(self, sched: Scheduler) -> dict:
        return {"requests": self.requests, "steps": self.steps, "prompt_tokens": self.prompt_tokens,
                "generated_tokens": self.generated_tokens, "seconds": self.step_seconds,
                "tokens_per_second": self.generated_tokens / self.step_seconds if self.step_seconds else 0.0,
                # share of the tokens requests brought at admission whose K/V came from the radix cache
                "prefix_cache_hit_rate": sched.num_cached_tokens / max(sched.num_admitted_tokens, 1),
                "preemptions": sched.num_preemptions, "constrained_requests": self.constrained_requests,
                "grammar_failures": self.grammar_failures}
