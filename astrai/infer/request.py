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

from pydantic import BaseModel, ConfigDict, Field, model_validator

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


class SamplingParams(BaseModel):
    """How to pick each next token and when to stop (vLLM's names and meanings where they exist)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, ge=1, description="most tokens to generate")
    temperature: float = Field(1.0, ge=0.0, description="softmax temperature; 0 = greedy (argmax)")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens; 0 = all")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="keep the smallest set with this total probability")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens below min_p * the top probability")
    repetition_penalty: float = Field(1.0, gt=0.0, description="> 1 discourages tokens already in prompt or output")
    seed: Optional[int] = Field(None, description="per-request seed: same seed, same output, whatever the batch")
    stop: list[str] = Field(default_factory=list, description="stop strings (not included in the text)")
    stop_token_ids: list[int] = Field(default_factory=list, description="stop when one of these ids is sampled")
    ignore_eos: bool = Field(False, description="keep going past the tokenizer's end-of-sequence token")
    logprobs: Optional[int] = Field(None, ge=0, description="return the chosen token's logprob and this many top ones")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @model_validator(mode="after")
    def _no_empty_stop(self):
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        return self


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
    status: str = WAITING
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    stop_reason: Optional[object] = None  # the stop token id or stop string that ended it
    generator: Optional[object] = None  # torch.Generator when seeded
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
