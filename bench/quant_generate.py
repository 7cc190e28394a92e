"""Quantized generation (EngineOptions.quantize) against llama.cpp's 8- and 4-bit files, in the same run.

    python bench/quant_generate.py --checkpoint ~/.cache/astrai/checkpoints/smollm2-135m-instruct \
        [--threads 2] [--repeats 3] [--tokens 48]
    python bench/quant_generate.py --kernels [--threads 2]     # the candidate kernels, SmolLM2's shapes

Batch-1 decode tokens/s, (N - 1) / (seconds for N tokens - seconds for 1) of one real chat, greedy, EOS
ignored (the prompt's prefill cancels out), best and range over --repeats interleaved rounds, for:
astrai float32, int8, int4 (each also with the LM head quantized: --quantize-head), and llama.cpp
(llama-cpp-python) on the Q8_0 file made from the package's Q4_1 with `llama_model_quantize` (8-bit
from 4-bit: the same values, in llama.cpp's 8-bit format), the package's Q4_1 file itself, and the f32
file. Ratios: astrai int8 / llama.cpp Q8_0 and astrai int4 / llama.cpp Q4_1.

--kernels: every projection of SmolLM2-135M (30 layers: q/k/v 576x960, o 576x576, gate/up 576x3072,
down 1536x576) at 1 and 16 rows, milliseconds per pass (best of 5), for float32 (astrai.infer.fused.matmul,
split over the threads), fbgemm's dynamic int8 and fp16 linears, torch's int8/int4 weight-only CPU kernels,
and torchao 0.18's CPU configurations; a configuration that fails prints why.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from astrai.runtime.hardware import cpu_flags_line  # noqa: E402

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30  # (in, out)


def best_ms(fns, rows, repeats=5) -> float:
    xs = {i: torch.randn(rows, i) for i, _ in SHAPES}
    best = float("inf")
    with torch.inference_mode():
        for f, (i, _) in zip(fns, SHAPES):  # warm-up
            f(xs[i])
        for _ in range(repeats):
            t = time.perf_counter()
            for f, (i, _) in zip(fns, SHAPES):
                f(xs[i])
            best = min(best, time.perf_counter() - t)
    return best * 1e3


def candidates(ws):
    """name -> list of per-projection callables (x -> x @ W.T)."""
    from astrai.infer.fused import matmul, split_parts
    from astrai.infer.quantized import quantize_weight

    out = {}
    wts = [w.t().contiguous() for w in ws]
    out["float32, fused.matmul split over the threads"] = [lambda x, w=w: matmul(x, w, split_parts(x)) for w in wts]
    q8 = [quantize_weight([(w, None)], "int8", "w") for w in ws]
    out["int8: fbgemm linear_dynamic (astrai.infer.quantized)"] = [q.product for q in q8]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p16 = [torch.ops.quantized.linear_prepack_fp16(w, None) for w in ws]
    out["fp16 weights: fbgemm linear_dynamic_fp16"] = [lambda x, p=p: torch.ops.quantized.linear_dynamic_fp16(x, p)
                                                       for p in p16]
    out["int8: torch _weight_int8pack_mm"] = [lambda x, q=q: torch._weight_int8pack_mm(x, q.layer.weight_int8,
                                                                                       q.layer.scales) for q in q8]
    q4 = [quantize_weight([(w, None)], "int4", "w") for w in ws]
    out["int4 g64: torch _weight_int4pack_mm_for_cpu (astrai.infer.quantized)"] = [q.product for q in q4]
    import torch.nn as nn
    import torchao.quantization as tq
    from torchao.quantization.granularity import PerAxis, PerGroup

    configs = {
        "torchao Int8WeightOnlyConfig": lambda: tq.Int8WeightOnlyConfig(),
        "torchao Int8DynamicActivationInt8WeightConfig": lambda: tq.Int8DynamicActivationInt8WeightConfig(),
        "torchao Int4WeightOnlyConfig g64": lambda: tq.Int4WeightOnlyConfig(group_size=64),
        "torchao Int8DynamicActivationIntxWeightConfig int4 g32": lambda: tq.Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4, weight_granularity=PerGroup(32)),
        "torchao Int8DynamicActivationIntxWeightConfig int8 per channel": lambda:
            tq.Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0)),
        "torchao IntxWeightOnlyConfig int4 g32": lambda: tq.IntxWeightOnlyConfig(weight_dtype=torch.int4,
                                                                                  granularity=PerGroup(32)),
    }
    for name, config in configs.items():
        try:
            lins = []
            for w in ws:
                m = nn.Sequential(nn.Linear(w.shape[1], w.shape[0], bias=False))
                m[0].weight.data = w.clone()
                tq.quantize_(m, config())
                lins.append(m[0])
            out[f"{name} [{type(lins[0].weight).__name__}]"] = lins
        except Exception as e:  # a configuration this torchao cannot run on this CPU: say why
            print(f"{name}: cannot run here: {type(e).__name__}: {str(e)[:160]}", flush=True)
    return out


def kernels():
    torch.manual_seed(0)
    ws = [torch.randn(o, i) * 0.02 for i, o in SHAPES]
    for name, fns in candidates(ws).items():
        slow = []
        for rows in (1, 16):
            slow.append(f"{best_ms(fns, rows, 5 if not slow or slow[0] < 200 else 1):9.2f} ms")
        print(f"{name:72s} 1 row {slow[0]}   16 rows {slow[1]}   (load {open('/proc/loadavg').read().split()[0]})",
              flush=True)


def decode_rate(generate, n: int) -> float:
    t = time.perf_counter()
    generate(1)
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    generate(n)
    return (n - 1) / (time.perf_counter() - t - t1)


def decode(args):
    from data import chats  # noqa: E402
    from llama_cpp_ref import LlamaCpp, f32_gguf, package_gguf

    from astrai.config.infer import EngineOptions, SamplingParams
    from astrai.infer.engine import Engine

    conv = [next(r["messages"][:1] for r in chats(200)[1] if r["messages"][0]["role"] == "user")]
    sides = {}
    for q, head, dtype in ((None, False, "float32"), (None, False, "bfloat16"), ("int8", False, "float32"),
                           ("int8", True, "float32"), ("int4", False, "float32"), ("int4", True, "float32")):
        t = time.perf_counter()
        engine = Engine.from_checkpoint(args.checkpoint, EngineOptions(device="cpu", dtype=dtype, quantize=q,
                                                                       quantize_head=head, kv_cache_tokens=4096))
        name = f"astrai {q or dtype}" + (" + head" if head else "")
        print(f"{name}: loaded and packed in {time.perf_counter() - t:.1f} s", flush=True)

        def run(n, engine=engine):
            engine.pool.reset_prefix_cache()
            return engine.generate([conv[0]], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        sides[name] = run
    prompt = Engine.from_checkpoint(args.checkpoint, EngineOptions(device="cpu")).encode(conv[0])
    tmp = tempfile.mkdtemp(prefix="bench-quant-")
    q41 = package_gguf()
    for name, path in (("llama.cpp Q8_0", f32_gguf(q41, os.path.join(tmp, "q8_0.gguf"), args.threads, "MOSTLY_Q8_0")),
                       ("llama.cpp Q4_1", q41),
                       ("llama.cpp f32", f32_gguf(q41, os.path.join(tmp, "f32.gguf"), args.threads))):
        llm = LlamaCpp(path, args.threads, max_seqs=1)
        sides[name] = lambda n, llm=llm: llm.generate([prompt], n, ignore_eos=True)
        print(f"{name}: {path} ({os.path.getsize(path) / 1e6:.0f} MB)", flush=True)
    rates = {k: [] for k in sides}
    for r in range(args.repeats):
        for name, fn in sides.items():
            rates[name].append(decode_rate(fn, args.tokens))
        print(f"round {r + 1}: load {open('/proc/loadavg').read().split()[0]}", flush=True)
    print(f"\nbatch-1 decode, {args.tokens} tokens, {torch.get_num_threads()} threads, tokens/s best (range):")
    for name, v in rates.items():
        print(f"  {name:28s} {max(v):7.1f} ({min(v):.1f}-{max(v):.1f})")
    best = {k: max(v) for k, v in rates.items()}
    for ours, cpp in (("astrai int8", "llama.cpp Q8_0"), ("astrai int8 + head", "llama.cpp Q8_0"),
                      ("astrai int4", "llama.cpp Q4_1"), ("astrai int4 + head", "llama.cpp Q4_1"),
                      ("astrai float32", "llama.cpp f32"), ("astrai bfloat16", "llama.cpp f32")):
        print(f"  {ours} / {cpp}: {best[ours] / best[cpp]:.2f}x")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint")
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}, {cpu_flags_line()}", flush=True)
    if args.kernels:
        kernels()
    if args.checkpoint:
        decode(args)


if __name__ == "__main__":
    main()
