"""EngineOptions: memory and batching of the generation engine (torch-free, so CLI help stays light)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field


class EngineOptions(BaseModel):
    """Memory and batching of the engine (sampling is per request: SamplingParams)."""

    model_config = ConfigDict(extra="forbid")

    page_size: int = Field(16, ge=1, description="tokens per KV page (the unit of prefix sharing)")
    kv_cache_tokens: int = Field(65536, ge=1, description="token slots in the KV pool (rounded up to pages)")
    max_running: int = Field(64, ge=1, description="most requests decoding together")
    max_step_tokens: int = Field(2048, ge=1, description="most tokens per forward (longer prompts are chunked)")
    prefix_cache: bool = Field(True, description="share K/V of common prompt prefixes (radix cache)")
    device: str = Field("auto", description="auto (cuda when available, else cpu) | cpu | cuda | cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: float32 on cpu, the checkpoint's dtype on a GPU")
    chat_template: Optional[str] = Field(None, description="bundled name or .jinja path; default: the tokenizer's")
