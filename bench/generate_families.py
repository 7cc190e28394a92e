"""`bench/generate.py --families llama,qwen2,gemma3_text`: batch-1 decode of every family on the engine's one
forward, random weights at SmolLM2-135M's size, measured side by side.

    python bench/generate.py --families llama,qwen2,gemma3_text [--threads 2] [--repeats 3] [--compile]

Each family is SmolLM2-135M-Instruct's shape (hidden 576, MLP 1536, 30 layers, 9 query and 3 K/V heads of 64,
vocabulary 49,152, tied embeddings) with the family's own traits: Qwen2's q/k/v biases; Qwen3's q/k norms;
Mistral's sliding window (4,096); Gemma 3's (1 + w) norms before and after attention and MLP, q/k norms,
GELU-tanh, embeddings times sqrt(hidden), softmax scale 1/sqrt(64), 5 sliding layers (window 512, RoPE base
10,000) to 1 global (base 1,000,000); Mixtral's 8 experts, top 2, of width 1536 / 4 (so an expert step moves
half a dense MLP's weights). Random weights (the model's own initialisation), float32, greedy with EOS ignored.

Batch-1 decode rate = (N - 1) / (seconds for N tokens - seconds for 1) from the same 32-token prompt, so the
prefill cancels out; every family once per round, interleaved, best of --repeats rounds (a shared machine
is noisy: ratios within one run are what to read). With one thread (--threads 1) the seconds are the
process's CPU seconds, which other processes on a shared machine barely move (--wall: wall clock); with
more, wall clock. Printed: tokens/s per family and its ratio to Llama's
(the target: every family within 10% of Llama).
"""

from __future__ import annotations

import time

import torch

from astrai.config.infer import EngineOptions
from astrai.infer.engine import Engine
from astrai.infer.request import SamplingParams
from astrai.model import CausalLM, ModelConfig

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
               max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
GEMMA_LAYERS = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(30))
TRAITS = {
    "llama": {},
    "qwen2": dict(family="qwen2"),
    "qwen3": dict(family="qwen3"),
    "mistral": dict(family="mistral", sliding_window=4096),
    "gemma3_text": dict(family="gemma3_text", hidden_act="gelu_pytorch_tanh", rms_norm_eps=1e-6, rope_theta=1e6,
                        query_pre_attn_scalar=64.0, sliding_window=512, layer_types=GEMMA_LAYERS,
                        local_rope={"rope_theta": 10000.0, "rope_type": "default"}),
    "mixtral": dict(family="mixtral", num_local_experts=8, num_experts_per_tok=2, intermediate_size=384),
}
PROMPT = 32


def engine_for(family: str, compile: bool) -> Engine:
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**{**SMOLLM2, **TRAITS[family]}))
    return Engine(model, options=EngineOptions(device="cpu", dtype="float32", max_running=4, kv_cache_tokens=4096,
                                               compile=compile))


def decode_rate(engine: Engine, n: int, clock) -> float:
    prompt = [(7 * i + 3) % 49152 for i in range(PROMPT)]

    def seconds(k: int) -> float:
        engine.pool.radix.clear() if engine.pool.radix is not None else None
        t = clock()
        engine.generate([prompt], SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True))
        return clock() - t

    t1 = seconds(1)
    return (n - 1) / (seconds(n) - t1)


def run(args) -> dict[str, float]:
    families = args.families.split(",")
    unknown = [f for f in families if f not in TRAITS]
    if unknown:
        raise SystemExit(f"--families: {unknown} not among {', '.join(TRAITS)}")
    if "llama" not in families:
        families.insert(0, "llama")
    # one thread: process CPU seconds, which what other processes on a shared machine do barely moves
    cpu = torch.get_num_threads() == 1 and not args.wall
    clock = time.process_time if cpu else time.perf_counter
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, SmolLM2-135M's shape with random weights, "
          f"batch-1 greedy decode of {args.decode_tokens} tokens after a {PROMPT}-token prompt, "
          f"{'compiled' if args.compile else 'eager'} decode, {'process CPU time' if cpu else 'wall clock'}",
          flush=True)
    engines = {}
    for f in families:
        t = time.perf_counter()
        engines[f] = engine_for(f, args.compile)
        print(f"{f}: engine ready in {time.perf_counter() - t:.1f} s", flush=True)
    rates = {f: [] for f in families}
    for r in range(args.repeats):
        for f, engine in engines.items():
            rates[f].append(decode_rate(engine, args.decode_tokens, clock))
        print(f"round {r + 1}: " + ", ".join(f"{f} {v[-1]:.1f}" for f, v in rates.items()), flush=True)
    best = {f: max(v) for f, v in rates.items()}
    print(f"\n{'family':14s} {'tokens/s best':>14s} {'range':>17s} {'vs llama':>9s}")
    for f, v in rates.items():
        print(f"{f:14s} {best[f]:14.1f} {min(v):8.1f}-{max(v):8.1f} {best[f] / best['llama']:9.2f}")
    return best
