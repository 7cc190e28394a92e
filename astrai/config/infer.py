"""Options of the generation side (astrai.infer): sampling, engine, and the generate and eval verbs.

Declared here, in the config layer: a recipe's eval stage (astrai.recipe.eval_stage, which extends
EvalOptions) is validated without importing torch or the engine, and the CLI flags of `astrai
generate` / `astrai eval` are read off these same models (astrai.infer.flags).

`sampling_with` (a request's own sampling keys over a base) and `generation_config_sampling` (a
checkpoint's generation_config.json as SamplingParams keys) validate user-given sampling the way
the flags are validated, one line naming the place and the key. `with_checkpoint_defaults` is the
one rule `astrai generate`, `astrai chat` and `astrai serve` resolve sampling by: what was given
(flags, a record's or a request's own keys), then the checkpoint's generation_config.json, then the
defaults.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from astrai.errors import InputError, InvalidRequest

_DEVICE = re.compile(r"(auto|cpu|mps|cuda(:\d+)?)")


class SamplingParams(BaseModel):
    """How to pick each next token and when to stop (vLLM's names and meanings where they exist)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # temperature inf is a mistake

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
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids (>= 0), got {self.stop_token_ids}")
        return self


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
        "auto", description="auto: bfloat16 where bf16 products are faster (a CPU with avx512_bf16 or amx_bf16, a "
        "GPU of compute capability 8.0+), else float32 (float16 for a float16 checkpoint on an older GPU); printed")
    chat_template: Optional[str] = Field(None, description="bundled name or .jinja path; default: the tokenizer's")
    compile: bool = Field(False, description="cpu: torch.compile the decode step at start (tens of seconds once, "
                          "cached on disk; needs a C++ compiler)")
    cuda_graphs: bool = Field(True, description="gpu with the cuda attention backend: replay decode steps as CUDA "
                              "graphs captured per batch-size bucket")
    quantize: Optional[Literal["int8", "int4"]] = Field(
        None, description="cpu, float32: the decoder's projections as int8 (per channel, weight-only) or "
        "int4 (asymmetric, groups of 32) weights, packed at load; the checkpoint is not changed")
    quantize_head: bool = Field(False, description="with quantize: the LM head too (the embedding stays as it is)")

    @model_validator(mode="after")
    def _quantize_fits(self):
        if self.quantize_head and self.quantize is None:
            raise ValueError("quantize_head needs quantize (int8 or int4)")
        if self.quantize and self.compile:
            raise ValueError(f"quantize {self.quantize}: the compiled decode (compile) runs float32 weights only; drop "
                             f"one of the two")
        if self.quantize and self.dtype in ("bfloat16", "float16"):
            raise ValueError(f"quantize {self.quantize}: quantized weights multiply float32 activations; use dtype "
                             f"float32 or auto, not {self.dtype}")
        return self

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        if not _DEVICE.fullmatch(v):
            raise ValueError(f"device {v!r}: use auto, cpu, cuda or cuda:N (mps on a Mac)")
        return v


class GenerateSampling(SamplingParams):
    """`astrai generate`'s sampling: a command line's answer is longer than the library's default (16, vLLM's)."""

    max_tokens: int = Field(256, ge=1, description=SamplingParams.model_fields["max_tokens"].description)


class GenerateOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    checkpoint: str = Field(description="checkpoint directory (config.json, safetensors, tokenizer files), a "
                                        "LoRA adapter directory (adapter_config.json: its base is merged in), or a "
                                        "llama.cpp .gguf file (converted once into the cache)")
    base: Optional[str] = Field(None, description="the base checkpoint of an adapter directory CHECKPOINT "
                                "(default: its adapter_config.json's base_model_name_or_path)")
    prompt: Optional[str] = Field(None, description="raw text to continue")
    chat: Optional[str] = Field(None, description="JSONL file of conversations to answer, a {\"messages\": [...]} "
                                "object or a bare list of messages per line; - reads standard input")
    input: Optional[str] = Field(None, description="JSONL file of {prompt | messages [, sampling]} records; - reads "
                                 "standard input")
    output: Optional[str] = Field(None, description="write JSONL results here, one line per request as it finishes "
                                  "(its index is the input's position); default: standard output")
    json_schema: Optional[str] = Field(None, description="JSON Schema file: every answer is JSON valid against it "
                                       "(constrained decoding; a schema the grammar engine cannot compile is an "
                                       "error before generation)")
    as_json: bool = Field(False, description="flag --json: JSONL on standard output even on a terminal (where "
                          "--chat and --input print the conversations and answers as text)",
                          json_schema_extra={"flag": "--json"})
    sampling: GenerateSampling = Field(default_factory=GenerateSampling)
    engine: EngineOptions = Field(default_factory=EngineOptions)

    @model_validator(mode="after")
    def _one_source(self):
        given = [k for k in ("prompt", "chat", "input") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of --prompt, --chat, --input (got {', '.join(given) or 'none'})")
        return self


class EvalOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    checkpoint: Optional[str] = Field(None, description="checkpoint directory (config.json, safetensors, tokenizer "
                                      "files), LoRA adapter directory or .gguf file; in a recipe, default: what the train stage "
                                      "wrote")
    base: Optional[str] = Field(None, description="the base checkpoint of an adapter directory CHECKPOINT "
                                "(default: its adapter_config.json's base_model_name_or_path)")
    data: Optional[str] = Field(None, description="preprocessed held-out directory (manifest.json, data/*.parquet); "
                                "in a recipe, default: what the preprocess stage wrote")
    output: Optional[str] = Field(None, description="where eval.json goes; default: CHECKPOINT/eval.json")
    ref_model: Optional[str] = Field(None, description="DPO data: the reference checkpoint (the model DPO started "
                                     "from) for the held-out reward figures; in a recipe, a stage name")
    beta: float = Field(0.1, gt=0, description="DPO data: beta of the implicit reward (the train stage's dpo_beta)")
    max_rows: Optional[int] = Field(None, ge=1, description="evaluate at most this many rows")
    batch_tokens: int = Field(8192, ge=1, description="tokens per perplexity forward (whole rows)")
    samples: int = Field(4, ge=0, description="sample generations for held-out prompts")
    sample_max_tokens: int = Field(64, ge=1, description="most tokens per sample generation")
    temperature: float = Field(0.0, ge=0.0, description="sampling temperature of the samples; 0 = greedy")
    seed: int = Field(0, description="seed of the sample generations")
    engine: EngineOptions = Field(default_factory=EngineOptions)


# ---------------------------------------------------------------------------------------------
# sampling a user gives per request, or a checkpoint brings

# generation_config.json keys that are SamplingParams fields under the same name (transformers' names)
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _problems(err: ValidationError, prefix: str = "") -> str:
    from astrai.config.loading import _problems_from_validation

    return "; ".join(f"{prefix}{p.path}: {p.message}" if p.path else p.message
                     for p in _problems_from_validation(err, SamplingParams, {}))


def sampling_with(base: SamplingParams, over: Any, where: str) -> SamplingParams:
    """`base` with a request's own `sampling` keys over it, validated as the flags are: an unknown
    key ("did you mean temperature?") or a bad value raises InvalidRequest naming `where` (file:line)."""
    if over is None:
        return base
    if not isinstance(over, dict):
        raise InvalidRequest(f"{where}: sampling must be an object of sampling keys "
                             f"({', '.join(SamplingParams.model_fields)}), got {type(over).__name__}")
    try:
        return SamplingParams.model_validate({**base.model_dump(), **over})
    except ValidationError as e:
        raise InvalidRequest(f"{where}: {_problems(e, 'sampling.')}") from None


def generation_config_sampling(config: Any, where: str) -> dict:
    """The SamplingParams keys a checkpoint's generation_config.json sets: temperature, top_p, top_k,
    min_p and repetition_penalty where present, and `do_sample: false` as greedy (temperature 0), as
    transformers' generate reads it. A value astrai cannot use is an InputError naming the key."""
    if not isinstance(config, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(config).__name__}")
    out = {k: config[k] for k in GENERATION_CONFIG_KEYS if config.get(k) is not None}
    if config.get("do_sample") is False:
        out["temperature"] = 0.0
    try:
        SamplingParams.model_validate(out)
    except ValidationError as e:
        raise InputError(f"{where}: {_problems(e)} (fix the file, or override the key with its flag, e.g. "
                         f"--temperature)") from None
    return out


def checkpoint_sampling_note(checkpoint: dict) -> str | None:
    """One line saying which sampling defaults a checkpoint's generation_config.json brings (None: none)."""
    if not checkpoint:
        return None
    return ("sampling defaults from the checkpoint's generation_config.json: "
            + ", ".join(f"{k} {v}" for k, v in checkpoint.items()) + " (given values override them)")


def with_checkpoint_defaults(sampling: SamplingParams, checkpoint: dict) -> SamplingParams:
    """The sampling a request runs with: the fields `sampling` was given (its model_fields_set: flags and --set,
    a record's or an HTTP request's own keys) over the checkpoint's generation_config.json (`checkpoint`: what
    generation_config_sampling read, e.g. Engine.generation_defaults) over `sampling`'s defaults. As
    transformers' generate and vLLM read a checkpoint: its own sampling settings unless the caller says otherwise."""
    given = sampling.model_dump(include=sampling.model_fields_set)
    return SamplingParams.model_validate({**sampling.model_dump(), **checkpoint, **given})
