"""Generation: a paged KV cache with radix prefix sharing, continuous batching, sampling, and the eval stage.

The block diagram, one file per box (each file's docstring states what it guarantees):

    engine.py      Engine: prompts -> requests -> step() loop -> completions / stream events, stats
      scheduler.py   which tokens of which requests the next forward computes (continuous batching,
                     ragged + chunked prefill, admission by free + evictable memory, preemption)
      cache.py       PagePool: a request's pages (attach cached prefix, extend, cache, release)
        allocator.py   pages with reference counts (free list, evictable count)
        radix.py       exact, page-aligned prefix tree over pages, LRU leaf eviction
        kv_storage.py  K/V tensors per layer [slots, kv_heads, head_dim]; request-to-token table
      runner.py      one Batch -> one forward through PagedContext -> logits of the sampling rows
        fused.py       the engine's one forward, every family, on weights packed at load (packed.py);
                       compiled.py (CPU: torch.compile) and cuda_graph.py (GPU) run its decode step
        backend.py     the attention backend contract (+ selection); backends/torch_native.py
      sampling.py    penalties, temperature, top-k/p, min-p, seeded draws, logprobs
      detokenize.py  incremental text, stop strings
      chat.py        prompt text / conversation -> ids with astrai.data's template and tokenizer
    generate.py    `astrai generate`; eval.py + perplexity.py: `astrai eval` (eval.json)
    flags.py       CLI flags read off the option models (astrai/config/infer.py: SamplingParams,
                   EngineOptions, GenerateOptions, EvalOptions; torch-free, in the config layer)

NOTE: astrai.infer uses astrai.model and astrai.data, never astrai.train.
"""
