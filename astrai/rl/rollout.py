"""Rollouts: G completions per prompt from the trainer's current weights, through one paged engine.

`Rollout(model, tokenizer, options, seed)` keeps, for the whole run, one plain copy of the policy
(a CausalLM without adapters, in the trainer's dtype: bf16 training samples in bf16) and one
Engine on it. Each `generate(prompts, step)`, after `sync(model)`:
  1. `sync` copies the trainer's weights into the copy in place, in memory (with LoRA: W + (alpha/r)
     B A, merged in float32 and rounded once to the copy's dtype, as astrai.model.lora.merged_state
     does for final/merged/); the engine sees the change (astrai.infer.fused.WeightWatch), remakes
     its fused weight copies and drops its cached prefixes, so it never samples from a stale weight
     and nothing goes through disk. Syncing before each rollout is syncing after the optimizer
     steps that preceded it: the weights the engine uses are always the trainer's current ones;
  2. starts from an empty prefix cache (what a call samples does not depend on earlier calls, so a
     resumed run draws what the killed one would have), runs every request to its end (the G
     completions of a prompt share its pages through the radix cache);
  3. returns, per prompt, its G completions (token ids including the stop token, text,
     finish_reason) and the call's counters (tokens, seconds, prefix-cache hits, KV pool size).
The KV pool is sized once for the run, for its running completions (at most max_running, or G x the
prompts of a call): the longest prompt once per group that runs, and each completion's own pages (a
mix of groups that needs more pages waits for them: the scheduler's business, never an error).
With `sleep: true` the engine gives its KV pool and fused copies back after each rollout (the
optimizer step has that memory) and takes them again at the next (astrai.infer.engine.Engine.sleep).
The engine stops a completion at the tokenizer's EOS, the model's eos ids, or the chat template's
end-of-turn token (prompts are rendered conversations), exactly as `astrai generate` does on a
conversation, so a temperature-0 rollout equals `astrai generate --temperature 0` on the same
weights. Sampling is seeded per completion from (seed, step, prompt, g): a step's rollouts do not
depend on what ran before.
"""

from __future__ import annotations

import copy
import time
from typing import Optional

import torch

from astrai.config.infer import EngineOptions, SamplingParams
from astrai.config.train import RolloutOptions
from astrai.infer.cache import pages_for
from astrai.infer.budget import DTYPES
from astrai.infer.engine import Engine
from astrai.model.lora import has_adapters, lora_layers, merged_state
from astrai.model.transformer import CausalLM


def completion_seed(seed: int, step: int, prompt: int, g: int) -> int:
    return ((seed * 1_000_003 + step) * 100_003 + prompt) * 1_009 + g


class Rollout:
    def __init__(self, model, tokenizer, options: RolloutOptions, seed: int = 0, device=None,
                 longest_prompt: int = 0, prompts_per_call: Optional[int] = None):
        """`longest_prompt`: the longest prompt the run will send (the pool is sized for it; a longer one
        makes a new engine); `prompts_per_call`: the most prompts one `generate` gets (None: any)."""
        self.options, self.tokenizer, self.seed = options, tokenizer, seed
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if has_adapters(model):
            dtype = model.lm_head.weight.dtype  # the frozen base's: the trainer's dtype
            # initialised weights are overwritten by sync: not drawn from the trainer's generator, so
            # where the copy is made (a first evaluation, or the first step) changes no training draw
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                self.policy = CausalLM(model.config).to(device=self.device, dtype=dtype)
        else:
            self.policy = copy.deepcopy(model)
        self.policy.requires_grad_(False).eval()
        self.sync(model)
        eos = model.config.eos_token_id
        self.eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        self.longest_prompt, self.prompts_per_call = longest_prompt, prompts_per_call
        self.engine: Optional[Engine] = None
        self.engines_made = 0
        self.kv_bytes = 0

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

    def engine_options(self, longest: int) -> EngineOptions:
        o, ps, G = self.options, self.options.page_size, self.options.group_size
        running = o.max_running if self.prompts_per_call is None else min(o.max_running, G * self.prompts_per_call)
        context = longest + o.max_tokens
        # the prompts of the running completions (a group shares its prompt's full pages; groups of about
        # running / G prompts are live at once), and each completion's own pages: its prompt's partial
        # last page and its tokens
        pages = min(running, -(-running // G) + 1) * pages_for(longest, ps) + running * pages_for(ps + o.max_tokens, ps)
        dtype = str(self.policy.lm_head.weight.dtype).replace("torch.", "")
        return EngineOptions(page_size=ps, kv_cache_tokens=max(pages, pages_for(context, ps)) * ps,
                             max_running=running, max_step_tokens=max(2048, context, running), prefix_cache=True,
                             device=str(self.device), dtype=dtype if dtype in DTYPES else "float32",
                             cuda_graphs=False)

    def _engine(self, prompts: list[list[int]]) -> Engine:
        longest = max(len(p) for p in prompts)
        if self.engine is None or longest > self.longest_prompt:
            self.longest_prompt = max(self.longest_prompt, longest)
            self.engine = None  # the old pool goes before the new one is allocated
            self.engine = Engine(self.policy, self.tokenizer, self.engine_options(self.longest_prompt), self.eos_ids)
            self.engines_made += 1
            b = self.engine.backend
            self.kv_bytes = sum(t.numel() * t.element_size() for t in (*b.k_cache, *b.v_cache))
        return self.engine

    def generate(self, prompts: list[list[int]], step: int, first: int = 0) -> tuple[list[list[dict]], dict]:
        """`first`: the number of the first prompt in its set (a set generated in pieces draws what
        it would in one call)."""
        o = self.options
        t0 = time.perf_counter()
        engine = self._engine(prompts)
        engine.wake()
        engine.sync_weights()
        engine.pool.reset_prefix_cache()
        sched = engine.scheduler
        cached0, admitted0 = sched.num_cached_tokens, sched.num_admitted_tokens
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
        hit_rate = (sched.num_cached_tokens - cached0) / max(sched.num_admitted_tokens - admitted0, 1)
        if o.sleep:
            engine.sleep()
        seconds = time.perf_counter() - t0
        return groups, {"rollout_seconds": seconds, "rollout_tokens": generated,
                        "rollout_tokens_per_second": generated / seconds if seconds else 0.0,
                        "prefix_cached_tokens": cached, "prefix_cache_hit_rate": hit_rate,
                        "kv_pool_mb": self.kv_bytes / 2 ** 20}

    def close(self) -> None:
        """Free the engine (its KV pool and fused copies) and the policy copy."""
        self.engine = None
        self.policy = None
