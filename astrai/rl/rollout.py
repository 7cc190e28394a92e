"""Rollouts: G completions per prompt from the trainer's current weights, through the paged engine.

`Rollout(model, tokenizer, options, seed)` keeps one plain copy of the policy for the engine (a
CausalLM without adapters). Each `generate(prompts, step)`:
  1. copies the trainer's weights into it in place, in memory (with LoRA: W + (alpha/r) B A, the
     adapters merged as astrai.model.lora.merged_state does for final/merged/): the engine never
     sees a stale weight and nothing goes through disk;
  2. builds an Engine on that copy whose KV pool is sized for this step's requests (prompt pages
     once, as the G completions of a prompt share them through the radix cache, plus each
     completion's own pages), runs every request to its end, and drops the engine: its KV pool
     and fused weight copies are freed before the optimizer step, so the step's peak memory is the
     trainer's plus one policy copy, never the pool;
  3. returns, per prompt, its G completions (token ids including the stop token, text,
     finish_reason) and the step's counters (prefix-cache hits, tokens, seconds, KV pool bytes).
The engine stops a completion at the tokenizer's EOS, the model's eos ids, or the chat template's
end-of-turn token (prompts are rendered conversations), exactly as `astrai generate` does on a
conversation, so a temperature-0 rollout equals `astrai generate --temperature 0` on the same
weights. Sampling is seeded per completion from (seed, step, prompt, g): a step's rollouts do not
depend on what ran before, so a resumed run draws exactly what the killed one would have.
"""

from __future__ import annotations

import copy
import time

import torch

from astrai.config.infer import EngineOptions, SamplingParams
from astrai.config.train import RolloutOptions
from astrai.infer.cache import pages_for
from astrai.infer.engine import Engine
from astrai.model.lora import has_adapters, lora_layers, merged_state
from astrai.model.transformer import CausalLM


def completion_seed(seed: int, step: int, prompt: int, g: int) -> int:
    return ((seed * 1_000_003 + step) * 100_003 + prompt) * 1_009 + g


class Rollout:
    def __init__(self, model, tokenizer, options: RolloutOptions, seed: int = 0, device=None):
        self.options, self.tokenizer, self.seed = options, tokenizer, seed
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if has_adapters(model):
            # initialised weights are overwritten by sync: not drawn from the trainer's generator, so
            # where the copy is made (a first evaluation, or the first step) changes no training draw
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                self.policy = CausalLM(model.config).to(self.device)
        else:
            self.policy = copy.deepcopy(model)
        self.policy.requires_grad_(False).eval()
        self.sync(model)
        eos = model.config.eos_token_id
        self.eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []

    @torch.no_grad()
    def sync(self, model) -> None:
        """The trainer's current weights into the engine's copy, in place."""
        state = model.state_dict()
        if has_adapters(model):
            scaling = next(iter(lora_layers(model).values())).scaling
            state = merged_state(state, scaling)
        own = self.policy.state_dict(keep_vars=True)
        for name, p in own.items():
            p.copy_(state[name])

    def engine_options(self, prompts: list[list[int]]) -> EngineOptions:
        o, G = self.options, self.options.group_size
        ps = o.page_size
        pages = sum(pages_for(len(p), ps) + G * (pages_for(o.max_tokens, ps) + 1) for p in prompts)
        longest = max(len(p) for p in prompts) + o.max_tokens
        return EngineOptions(page_size=ps, kv_cache_tokens=max(pages * ps, pages_for(longest, ps) * ps + ps),
                             max_running=min(o.max_running, G * len(prompts)),
                             max_step_tokens=max(2048, longest, o.max_running), prefix_cache=True,
                             device=str(self.device), dtype="auto", cuda_graphs=False)

    def generate(self, prompts: list[list[int]], step: int, first: int = 0) -> tuple[list[list[dict]], dict]:
        """`first`: the number of the first prompt in its set (a set generated in pieces draws what
        it would in one call)."""
        o = self.options
        t0 = time.perf_counter()
        engine = Engine(self.policy, self.tokenizer, self.engine_options(prompts), self.eos_ids)
        kv_bytes = sum(t.numel() * t.element_size() for t in (*engine.backend.k_cache, *engine.backend.v_cache))
        reqs = []
        for i, ids in enumerate(prompts):
            for g in range(o.group_size):
                sp = SamplingParams(max_tokens=o.max_tokens, temperature=o.temperature, top_p=o.top_p, top_k=o.top_k,
                                    seed=completion_seed(self.seed, step, first + i, g))
                reqs.append(engine.add_request(list(ids), sp, end_of_turn=True))
        while engine.has_work():
            engine.step()
        groups, cached, generated = [], 0, 0
        for i in range(len(prompts)):
            group = []
            for g in range(o.group_size):
                c = engine.completion(reqs[i * o.group_size + g], i)
                cached += c.cached_tokens
                generated += len(c.token_ids)
                group.append({"token_ids": c.token_ids, "text": c.text, "finish_reason": c.finish_reason,
                              "cached_tokens": c.cached_tokens})
            groups.append(group)
        stats = engine.engine_stats()
        del engine  # the KV pool and the fused copies go before the optimizer step
        seconds = time.perf_counter() - t0
        return groups, {"rollout_seconds": seconds, "rollout_tokens": generated,
                        "rollout_tokens_per_second": generated / seconds if seconds else 0.0,
                        "prefix_cached_tokens": cached, "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"],
                        "kv_pool_mb": kv_bytes / 2 ** 20}
