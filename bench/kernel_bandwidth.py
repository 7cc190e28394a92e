"""GPU benchmark of the astrai kernels against a device-to-device copy measured in the same run.

    python bench/kernel_bandwidth.py [--dtype float16] [--quick] [--json out.jsonl]

Paged decode is memory-bound: its ceiling is the card's memory bandwidth. The figure of merit is
achieved bandwidth = bytes of K/V read / kernel time, reported as a fraction of the bandwidth of a
large torch device-to-device copy timed here (copy bandwidth counts read + write bytes, the usual
convention: an H200 copies ~4.3 TB/s). Target at batch >= 16 and context >= 1k: >= 0.80. The torch
backend (gather + SDPA) is timed on the same cases for reference. Rotary is reported as tokens/s and
bytes moved / s. Needs CUDA + CuPy; prints one line per case and writes JSON lines with --json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from astrai.kernels import launch as K
from astrai.kernels.cupy_exec import CupyExecutor


def time_ms(fn, iters: int = 20, warmup: int = 3) -> float:
    """GPU milliseconds per call, without the host's launch overhead: a sleep kernel keeps the GPU
    busy while Python enqueues every iteration, so the events time back-to-back kernels only."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # ~25 ms at 2 GHz: longer than enqueuing `iters` calls
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy, read + write counted."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters=10)
    return 2 * nbytes / (ms / 1e3)


def decode_case(ex, batch, ctx, hq, hkv, d, page_size, dtype, copy_bw, with_torch):
    pages_per_req = math.ceil(ctx / page_size)
    num_pages = batch * pages_per_req
    k_cache = torch.randn(num_pages * page_size, hkv, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    page_indices = torch.randperm(num_pages, device="cuda").int()  # scattered pages
    kv_indptr = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * pages_per_req
    kv_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, hq, d, device="cuda", dtype=dtype)
    run = lambda: K.decode(q, k_cache, v_cache, kv_indptr, page_indices, kv_lens, page_size, ctx, ex)  # noqa: E731
    ms = time_ms(run)
    kv_bytes = 2 * batch * ctx * hkv * d * k_cache.element_size()
    bw = kv_bytes / (ms / 1e3)
    row = dict(bench="paged_decode", dtype=str(dtype), batch=batch, context=ctx, hq=hq, hkv=hkv, head_dim=d,
               page_size=page_size, splits=K.plan_splits(batch, hkv, ctx, ex.num_sms)[0], ms=round(ms, 4),
               kv_gb_per_s=round(bw / 1e9, 1), copy_gb_per_s=round(copy_bw / 1e9, 1),
               fraction_of_copy=round(bw / copy_bw, 3))
    if with_torch:
        from astrai.infer.backend import AttentionMeta
        from astrai.infer.backends.torch_native import TorchBackend

        pages = page_indices.view(batch, pages_per_req).tolist()
        meta = AttentionMeta.build([1] * batch, [ctx] * batch, pages, page_size, device="cuda")
        tb = TorchBackend([k_cache], [v_cache])
        row["torch_backend_ms"] = round(time_ms(lambda: tb.decode(0, q, meta), iters=5), 4)
    return row


def rotary_case(ex, tokens, hq, hkv, d, dtype):
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, device="cuda", dtype=dtype)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, device="cuda").float() / d)
    angles = torch.arange(8192, device="cuda").float()[:, None] * inv
    cos, sin = angles.cos(), angles.sin()
    ms = time_ms(lambda: K.rotary(q, k, positions, cos, sin, False, ex))
    moved = 2 * tokens * (hq + hkv) * d * qkv.element_size()  # read + write of q and k
    return dict(bench="rotary", dtype=str(dtype), tokens=tokens, hq=hq, hkv=hkv, head_dim=d, ms=round(ms, 4),
                tokens_per_s=round(tokens / (ms / 1e3)), gb_per_s=round(moved / (ms / 1e3) / 1e9, 1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--quick", action="store_true", help="fewer cases (the prepared GPU check)")
    ap.add_argument("--json", help="append JSON lines here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/kernel_bandwidth.py needs a CUDA device", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    ex = CupyExecutor(torch.device("cuda"))
    copy_bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: {ex.num_sms} SMs, d2d copy {copy_bw / 1e9:.0f} GB/s (read + write)")
    batches = [1, 16, 64] if args.quick else [1, 4, 16, 32, 64, 128]
    contexts = [1024, 4096] if args.quick else [512, 1024, 4096, 16384]
    rows = []
    for batch in batches:
        for ctx in contexts:
            for page_size in ([16] if args.quick else [1, 16]):
                rows.append(decode_case(ex, batch, ctx, 32, 8, 128, page_size, dtype, copy_bw,
                                        with_torch=batch <= 16 and ctx <= 4096))
                print(json.dumps(rows[-1]))
    for tokens in [1, 256, 16384]:
        rows.append(rotary_case(ex, tokens, 32, 8, 128, dtype))
        print(json.dumps(rows[-1]))
    target = [r for r in rows if r["bench"] == "paged_decode" and r["batch"] >= 16 and r["context"] >= 1024]
    if target:
        worst = min(r["fraction_of_copy"] for r in target)
        print(f"paged decode at batch >= 16, context >= 1k: worst {worst:.2f} of copy bandwidth (target 0.80)")
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
