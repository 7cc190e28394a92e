"""Options of `astrai serve` (the OpenAI-compatible HTTP server) and `astrai chat` (the terminal chat).

Both run the generation engine, so both take its options (EngineOptions, the same flags as
`astrai generate`); sampling is per request for the server (each HTTP request says it) and a
command-line default for the chat. Declared in the config layer like every option model: the CLI
flags are read off these models (astrai.infer.flags).
"""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from astrai.config.infer import EngineOptions, SamplingParams


class ChatSampling(SamplingParams):
    """`astrai chat`'s sampling: an answer in a chat is longer than the library's default (16, vLLM's)."""

    max_tokens: int = Field(512, ge=1, description=SamplingParams.model_fields["max_tokens"].description)


CHECKPOINT = ("checkpoint directory (config.json, safetensors, tokenizer files), a LoRA adapter directory "
              "(adapter_config.json: its base is merged in), or a llama.cpp .gguf file (converted once into the cache)")
BASE = "the base checkpoint of an adapter directory CHECKPOINT (default: its adapter_config.json's base_model_name_or_path)"


class ServeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    checkpoint: str = Field(description=CHECKPOINT)
    base: Optional[str] = Field(None, description=BASE)
    host: str = Field("127.0.0.1", description="address to listen on; 0.0.0.0 makes the server reachable from "
                      "the network (give --api-key then)")
    port: int = Field(8000, ge=0, le=65535, description="TCP port; 0 takes a free one (printed at start)")
    api_key: Optional[str] = Field(None, description="require 'Authorization: Bearer KEY' on /v1/* (default: "
                                   "$ASTRAI_API_KEY when set, else no key)")
    served_model_name: Optional[str] = Field(None, description="the model id clients send and /v1/models lists; "
                                             "default: the checkpoint path as given")
    max_queue: int = Field(256, ge=0, description="most requests waiting for a running slot (beyond --max-running); "
                           "more are refused with 429")
    stall_timeout: float = Field(30.0, gt=0, description="seconds a stream may stay blocked on a client that stopped "
                                 "reading before its request is cancelled and the connection closed")
    shutdown_timeout: float = Field(10.0, ge=0, description="on Ctrl-C or SIGTERM: seconds running requests get to "
                                    "finish before they are cancelled")
    threads: Optional[int] = Field(None, ge=1, description="torch threads for the engine's CPU work; default: the "
                                   "cores less one (left to the HTTP side), at least 1")
    allowed_hosts: list[str] = Field(default_factory=list, description="Host header values accepted besides the "
                                     "bound address, localhost, 127.0.0.1 and [::1] (any port); '*' accepts any. "
                                     "Others get 421: a web page cannot reach the server by DNS rebinding")
    max_connections: int = Field(1024, ge=1, description="most open client connections; at the cap the connection "
                                 "idle longest (no request in progress) is closed to make room, else a new one gets "
                                 "503")
    read_timeout: float = Field(30.0, gt=0, description="seconds a client gets to send a request's headers, and "
                                "again for its body; a slower one is closed (headers) or answered 408 (body)")
    max_body_mb: float = Field(32.0, gt=0, description="largest request body in MiB; a larger one gets 413, on "
                               "its Content-Length or as it streams in")
    max_prompt_chars: Optional[int] = Field(None, ge=1, description="longest prompt, or all messages' text together, "
                                            "in characters, refused before the chat template and tokenizer run; "
                                            "default: 16 per token of the context length")
    lora: list[str] = Field(default_factory=list, description="NAME=DIR: a LoRA adapter (PEFT directory trained on "
                            "CHECKPOINT) served beside it as model NAME; requests for different adapters share "
                            "engine steps")
    engine: EngineOptions = Field(default_factory=EngineOptions)

    @field_validator("lora")
    @classmethod
    def _name_dir(cls, v: list[str]) -> list[str]:
        names = set()
        for item in v:
            name, sep, directory = item.partition("=")
            if not sep or not name.strip() or not directory.strip():
                raise ValueError(f"{item!r}: expected NAME=DIR (the model id clients send, the adapter directory)")
            if name.strip() in names:
                raise ValueError(f"adapter name {name.strip()!r} given twice")
            names.add(name.strip())
        return v

    def adapters(self) -> dict[str, str]:
        """--lora as {name: directory}."""
        return {name.strip(): directory.strip() for name, _, directory in (i.partition("=") for i in self.lora)}

    @field_validator("allowed_hosts")
    @classmethod
    def _split_commas(cls, v: list[str]) -> list[str]:
        return [h.strip() for item in v for h in item.split(",") if h.strip()]


class ChatOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    checkpoint: str = Field(description=CHECKPOINT)
    base: Optional[str] = Field(None, description=BASE)
    system: Optional[str] = Field(None, description="system message that opens the conversation")
    sampling: ChatSampling = Field(default_factory=ChatSampling)
    engine: EngineOptions = Field(default_factory=EngineOptions)
