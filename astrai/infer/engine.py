"""Engine: prompts in, completions out (batch or streamed), over scheduler + model runner + sampler.

    engine = Engine.from_checkpoint("runs/sft/model")
    outs = engine.generate(["Once upon", [{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=32))
    for ev in engine.stream(prompts, params): print(ev.text, end="")

One `step()` = schedule -> one forward -> sample -> stop checks; finished requests give their memory
back at once (their written pages stay in the radix cache for later prompts). A request ends with
finish_reason "stop" (a stop token id, the tokenizer's EOS unless ignore_eos, the chat template's
end-of-turn token for conversations, or a stop string, or the end of its grammar), "length"
(max_tokens) or "abort". A request may carry a grammar (astrai.infer.grammar: a JSON schema, any
JSON object, a Lark grammar): its tokens are masked to the grammar and its matcher advanced with
each one; requests without one are not touched by it.

Weights may change between steps (online RL copies a trainer's weights into the model in place):
each step first calls `sync_weights()`, which refreshes the fused copies and drops every cached
prefix when they did. `sleep()` gives the KV pool's memory and the fused copies back while no
request is in flight (a trainer's optimizer step can use it); `wake()`, or the next step, takes
them again.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence, Union

import torch

from astrai.config.infer import EngineOptions, generation_config_sampling
from astrai.errors import InputError, InvalidRequest
from astrai.infer.backend import select_backend
from astrai.infer.budget import check_engine_memory, resolve_device, resolve_dtype
from astrai.infer.cache import PagePool, pages_for
from astrai.text.prompt import Prompt, chat_template_for, encode_prompt, end_of_turn_id, is_chat
from astrai.text.template import ChatTemplate
from astrai.infer.detokenize import OutputText
from astrai.infer.grammar import GrammarTokens
from astrai.infer.kv_storage import KVStorage
from astrai.infer.outputs import Completion, EngineStats, StreamEvent
from astrai.infer.request import FINISHED, Request, SamplingParams, check_request
from astrai.infer.runner import ModelRunner
from astrai.infer.sampling import TokenLogprob, make_generator, sample
from astrai.infer.scheduler import Scheduler


class Engine:
    def __init__(self, model, tokenizer=None, options: Optional[EngineOptions] = None, eos_ids: Iterable[int] = ()):
        self.options = o = options or EngineOptions()
        self.device = resolve_device(o.device)
        dtype, self.dtype_reason = resolve_dtype(o.dtype, self.device, next(model.parameters()).dtype)
        if o.quantize:  # astrai.infer.quantized: float32 activations on the CPU
            from astrai.infer.quantized import check_engine

            if o.dtype == "auto":
                dtype, self.dtype_reason = torch.float32, "dtype auto: float32 (quantized weights take float32 activations)"
            check_engine(o.quantize, self.device, dtype)
            self.dtype_reason += f", weights {o.quantize}" + (" (LM head too)" if o.quantize_head else "")
        self.dtype = dtype
        c = model.config
        check_engine_memory(o, c, dtype, self.device)  # before the KV pool is allocated
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids) | ({tokenizer.eos_id} if tokenizer and tokenizer.eos_id is not None else set())
        self.generation_defaults: dict = {}  # SamplingParams keys of the checkpoint's generation_config.json
        # the chat template is compiled and probed on the first conversation, never for text or ids
        self._template, self._eot_id = None, None
        num_pages = pages_for(o.kv_cache_tokens, o.page_size)
        # one page more than the pool hands out: the scratch page padded rows of a CUDA graph write to
        kv = KVStorage(c.num_hidden_layers, (num_pages + 1) * o.page_size, c.num_key_value_heads, c.head_dim, dtype,
                       self.device)
        self.pool = PagePool(num_pages, o.page_size, o.max_running,
                             min(num_pages * o.page_size, c.max_position_embeddings), o.prefix_cache, self.device)
        self.model.reserve_positions(self.pool.max_context)  # fused RoPE kernels read the table unchecked
        self.backend = select_backend(self.device, dtype, c)(kv.k_cache, kv.v_cache)
        self.scheduler = Scheduler(self.pool, o.max_running, o.max_step_tokens)
        self.runner = ModelRunner(self.model, self.pool, self.backend, self.device, compile=o.compile,
                                  cuda_graphs=o.cuda_graphs, quantize=(o.quantize, o.quantize_head))
        self.stats = EngineStats()
        self.asleep = False
        self._next_rid = 0
        self._texts: dict[int, OutputText] = {}
        self.grammar = GrammarTokens(tokenizer, c.vocab_size, self.eos_ids)  # llguidance's vocabulary, built on use

    @property
    def template(self) -> Optional[ChatTemplate]:
        if self._template is None and self.tokenizer is not None:
            self._template = chat_template_for(self.tokenizer, self.options.chat_template) or False
        return self._template or None

    @property
    def eot_id(self) -> Optional[int]:
        if self._eot_id is None:
            self._eot_id = end_of_turn_id(self.tokenizer, self.template) if self.template is not None else False
        return None if self._eot_id is False else self._eot_id

    @classmethod
    def from_checkpoint(cls, path: Union[str, Path], options: Optional[EngineOptions] = None,
                        base: Optional[Union[str, Path]] = None,
                        adapters: Optional[dict[str, Union[str, Path]]] = None) -> "Engine":
        """A checkpoint directory (config.json + safetensors + tokenizer files, generation_config.json),
        or a LoRA adapter directory: its base (`base`, else the one it names) with the adapters merged
        in, the adapter directory's tokenizer when it has one (else the base's). A base that does not
        fit the adapter is refused before any weight is loaded (astrai.model.adapter_files).
        `adapters` (name -> adapter directory): LoRA adapters served beside a full checkpoint, each
        request choosing one by name (`load_adapters`)."""
        from astrai import json_bounded
        from astrai.model.adapter_files import is_adapter, load_checkpoint, resolve_base
        from astrai.model.packaged import checkpoint_path
        from astrai.text.tokenizer import load_tokenizer

        resolve_device((options or EngineOptions()).device)  # a device this machine lacks: said before loading
        path, base = checkpoint_path(path), None if base is None else checkpoint_path(base)  # a .gguf: converted
        if adapters and is_adapter(path):
            raise InputError(f"{path} is an adapter directory: adapters served side by side need a full base "
                             f"checkpoint (give the base, and this adapter as one of them)")
        checked = None
        if adapters:  # every adapter checked against the base's config before any weight is read
            from astrai.infer.lora_bank import AdapterBank

            checked = AdapterBank.check(adapters, path)
        model = load_checkpoint(path, base)
        dirs = [path, resolve_base(path, base)] if is_adapter(path) else [path]
        tok_dir = next((d for d in dirs if (d / "tokenizer.json").exists()), None)
        tokenizer = load_tokenizer(str(tok_dir)) if tok_dir is not None else None
        eos, defaults = [], {}
        for name in ("config.json", "generation_config.json"):
            f = dirs[-1] / name
            if not f.exists():
                continue
            cfg = json_bounded.read_json(f, name, 1 << 20)  # bounded size and nesting
            e = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
            ids = e if isinstance(e, list) else [e] if e is not None else []
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
                raise InputError(f"{f}: eos_token_id must be a token id or a list of them, got {e!r}")
            eos += ids
            if name == "generation_config.json":
                defaults = generation_config_sampling(cfg, str(f))
        engine = cls(model, tokenizer, options, eos)
        engine.generation_defaults = defaults
        if adapters:
            engine.load_adapters(adapters, path, checked)
        return engine

    def load_adapters(self, adapters: dict[str, Union[str, Path]], base_dir: Union[str, Path],
                      checked: Optional[list] = None) -> None:
        """Serve these LoRA adapters (name -> PEFT directory trained on `base_dir`, this engine's model)
        beside the base: a request names one (`add_request(..., adapter=NAME)`), requests of different
        adapters share a step (astrai.infer.lora_bank), and cached prefixes are never shared across
        adapters. `checked`: AdapterBank.check's result for them, when it already ran."""
        from astrai.infer.lora_bank import AdapterBank

        self.runner.bank = AdapterBank.load(adapters, base_dir, self.model, self.dtype, self.device, checked)
        self.pool.reset_prefix_cache()

    @property
    def adapter_names(self) -> list[str]:
        return list(self.runner.bank.names) if self.runner.bank is not None else []

    # ---- requests ----
    def encode(self, prompt: Prompt, tools: Optional[list] = None) -> list[int]:
        """The token ids of a prompt (a conversation rendered with the chat template, and `tools` when given); no
        engine state is touched, so a server may call it outside the thread that steps the engine."""
        return encode_prompt(prompt, self.tokenizer, self.template if is_chat(prompt) else None, tools)

    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                    end_of_turn: Optional[bool] = None, grammar: Optional[str] = None,
                    adapter: Optional[str] = None) -> Request:
        """`end_of_turn`: also stop at the chat template's end-of-turn token; default: when the prompt is a
        conversation (pass True with the ids of a conversation already rendered by `encode`). `grammar`: an
        llguidance grammar (astrai.infer.grammar.json_grammar, lark_grammar) the output is held to; one the
        grammar engine cannot compile raises GrammarError (an InvalidRequest) before anything is queued.
        `adapter`: the name of a LoRA adapter of `load_adapters` to run with (None: the base)."""
        params = params or SamplingParams()
        if adapter is not None and adapter not in self.adapter_names:
            raise InvalidRequest(f"adapter {adapter!r} is not served here"
                                 + (f" (adapters: {', '.join(self.adapter_names)})" if self.adapter_names else ""))
        ids = self.encode(prompt)
        check_request(ids, params, self.model.config.vocab_size, isinstance(prompt, str) or is_chat(prompt))
        stop_ids = set(params.stop_token_ids)
        if end_of_turn is None:
            end_of_turn = is_chat(prompt)
        if not params.ignore_eos:
            stop_ids |= self.eos_ids | ({self.eot_id} if end_of_turn and self.eot_id is not None else set())
        req = Request(self._next_rid, ids, params, frozenset(stop_ids))
        req.adapter = self.runner.bank.adapter_id(adapter) if adapter is not None else 0
        req.generator = make_generator(params.seed, self.device)
        if grammar is not None:
            req.matcher = self.grammar.matcher(grammar)
        self.scheduler.add(req)  # raises RequestTooLarge for a request that can never fit
        self._next_rid += 1
        self.stats.requests += 1
        self.stats.constrained_requests += grammar is not None
        self.stats.prompt_tokens += len(ids)
        if self.tokenizer is not None:
            self._texts[req.rid] = OutputText(self.tokenizer.tok, ids, params.stop)
        return req

    def abort(self, req: Request) -> None:
        self.scheduler.finish(req, "abort")
        self._texts.pop(req.rid, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- weights and memory between uses (online RL: astrai.rl.rollout) ----
    def sync_weights(self) -> bool:
        """Before each step: when the model's weights changed in place (an optimizer step, a copy into
        them) the fused copies are remade and every cached prefix is dropped (its K/V is of the old
        weights: no later request may reuse it). True when they had changed."""
        if not self.runner.sync_weights():
            return False
        self.pool.reset_prefix_cache()
        return True

    def sleep(self) -> None:
        """Give back the KV pool's memory and the fused weight copies until `wake` (or the next step),
        so that a trainer's optimizer step can have it; only with no request in flight."""
        if self.scheduler.has_work():
            raise RuntimeError("the engine cannot sleep with requests in flight")
        if self.runner.graphs is not None or self.runner.compiled is not None:
            raise ValueError("the engine cannot sleep with CUDA graphs or a compiled decode step: they hold the KV "
                             "pool's addresses")
        if self.asleep:
            return
        self.pool.reset_prefix_cache()  # the K/V it points at is about to go
        self._kv_shape = (self.backend.k_cache[0].shape, self.backend.k_cache[0].dtype)
        for caches in (self.backend.k_cache, self.backend.v_cache):
            for i, t in enumerate(caches):  # in place: the backend and its kernels index these same lists
                caches[i] = t.new_empty(0)
        self.runner.release()
        self.asleep = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """Take the KV pool's memory again (zeroed, as at start); the fused copies are remade at the next step."""
        if not self.asleep:
            return
        shape, dtype = self._kv_shape
        for caches in (self.backend.k_cache, self.backend.v_cache):
            for i in range(len(caches)):
                caches[i] = torch.zeros(shape, dtype=dtype, device=self.device)
        self.asleep = False

    # ---- one step ----
    def step(self) -> list[tuple[Request, int, str]]:
        """Run one forward; returns (request, sampled token, newly visible text) per sampled token: nothing,
        and no forward, when no request is waiting or running."""
        if not self.scheduler.has_work():
            return []
        t0 = time.perf_counter()
        if self.asleep:
            self.wake()
        self.sync_weights()
        batch = self.scheduler.schedule()
        if not batch.reqs:
            raise RuntimeError("scheduler made no progress with requests pending (a bug: please report)")
        sampling = [r for i, r in enumerate(batch.reqs) if batch.samples(i)]
        logits = self.runner.forward(batch)
        self.scheduler.advance(batch)
        tokens, logprobs = sample(logits, sampling) if sampling else ([], [])
        out = [(r, t, self._accept(r, t, lp)) for r, t, lp in zip(sampling, tokens, logprobs)]
        self.stats.steps += 1
        self.stats.generated_tokens += len(out)
        self.stats.step_seconds += time.perf_counter() - t0
        return out

    def _accept(self, req: Request, token: int, lp: Optional[TokenLogprob]) -> str:
        req.tokens.append(token)
        if lp is not None:
            req.logprobs.append(lp)
        if req.stats.first_token is None:
            req.stats.first_token = time.perf_counter()
        text = self._texts.get(req.rid)
        delta, reason = "", None
        if token in req.stop_ids:
            reason, req.stop_reason = "stop", token
        elif text is not None:
            delta = text.push(token)
            if text.stop_string is not None:
                reason, req.stop_reason = "stop", text.stop_string
        if reason is None and req.matcher is not None:
            if not req.matcher.advance(token):
                self.stats.grammar_failures += 1
                reason = "stop"
            elif req.matcher.done:  # the grammar takes nothing more: the output is complete
                reason = "stop"
        if reason is None and req.num_output >= req.params.max_tokens:
            reason = "length"
        if reason is not None:
            delta += text.flush() if text is not None else ""
            self.scheduler.finish(req, reason)
            req.stats.finished = time.perf_counter()
        return delta

    def completion(self, req: Request, index: int) -> Completion:
        text = self._texts.pop(req.rid, None)
        s = req.stats
        return Completion(index, list(req.prompt_ids), req.output_ids, text.text if text else "", req.finish_reason,
                          req.stop_reason, req.logprobs if req.params.logprobs is not None else None,
                          s.cached_tokens, s.preemptions, (s.first_token or s.arrival) - s.arrival,
                          (s.finished or time.perf_counter()) - s.arrival)

    # ---- whole calls ----
    def stream(self, prompts: Sequence[Prompt], params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
               grammar: Optional[str] = None, adapters: Optional[Sequence[Optional[str]]] = None
               ) -> Iterator[StreamEvent]:
        """Events as tokens are sampled, across all prompts (continuous batching), in sampling order;
        `grammar`: every answer held to it (add_request); `adapters`: per prompt, the LoRA adapter it
        runs with (None: the base)."""
        adapters = list(adapters) if adapters is not None else [None] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(adapters)} adapters")
        if isinstance(params, SamplingParams) or params is None:
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        index = {}
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                try:
                    index[self.add_request(p, sp, grammar=grammar, adapter=adapters[i]).rid] = i
                except InvalidRequest as e:  # which request: the caller maps it to a file line
                    raise InvalidRequest(str(e), i) from None
            while any(self._live(index)):
                for req, token, delta in self.step():
                    if req.rid not in index:
                        continue  # a request of another caller sharing the engine
                    i = index[req.rid]
                    done = req.status == FINISHED
                    yield StreamEvent(i, token, delta, req.finish_reason if done else None,
                                      self.completion(req, i) if done else None)
        finally:  # the consumer stopped early (or an error): free what is still held
            for req in list(self._live(index)):
                self.abort(req)

    def _live(self, index: dict) -> Iterator[Request]:
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            if req.rid in index:
                yield req

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 grammar: Optional[str] = None, adapters: Optional[Sequence[Optional[str]]] = None
                 ) -> list[Completion]:
        if isinstance(prompts, str) or is_chat(prompts) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        out: list[Optional[Completion]] = [None] * len(prompts)
        for ev in self.stream(prompts, params, grammar, adapters):
            if ev.completion is not None:
                out[ev.index] = ev.completion
        return out

    def engine_stats(self) -> dict:
        return self.stats.as_dict(self.scheduler)
