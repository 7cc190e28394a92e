"""astrai's CPU product kernels (astrai.infer.native) against torch's, on SmolLM2-135M's projection shapes.

    python bench/cpu_kernels.py [--threads 2] [--rows 1,2,4,8,16] [--repeats 5]

Every projection of a 30-layer SmolLM2 (q/k/v [576 -> 960], o [576 -> 576], gate/up [576 -> 3072],
down [1536 -> 576]), distinct random weights so that none stays in cache, multiplied by `rows` input rows:
float32 (F.linear, MKL; astrai's `gemv_f32`), bf16 (F.linear: oneDNN, AMX / AVX-512 BF16 where the CPU has them; astrai's
`gemv_bf16` with AVX-512 BF16 and with AVX2), int8 weight-only (torch's `_weight_int8pack_mm`; astrai's
`gemv_int8`) and int4 by groups of 32 (torch's `_weight_int4pack_mm_for_cpu`; astrai's `gemv_int4`).
Milliseconds for all 120 products, best of --repeats rounds of 10 passes. The floor beside them: the same
bytes read once by torch's `max` over them (a read-only pass; a product cannot read its weights faster).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from astrai.infer import native
from astrai.runtime.hardware import cpu_flags_line

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
LAYERS = 30


def best_ms(fn, repeats: int, passes: int = 10) -> float:
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(passes):
            fn()
        best = min(best, (time.perf_counter() - t) / passes)
    return best * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    k = native.kernels()
    print(cpu_flags_line(), f"| torch {torch.__version__}, {args.threads} threads")
    if k is None or not k.int4:
        raise SystemExit("astrai's CPU kernels (int4: AVX-512) do not run here (see astrai.infer.native)")
    print(f"astrai kernels: {k.name}")
    from astrai.model import quant

    _, tu = quant._torchao()
    ws = [[torch.randn(o, i) for (i, o) in SHAPES] for _ in range(LAYERS)]
    bf = [[w.bfloat16() for w in lw] for lw in ws]
    q8 = []
    for lw in ws:
        q8.append([])
        for w in lw:
            q, s, _ = tu.dynamically_quantize_per_channel(w, -128, 127, torch.int8)
            q8[-1].append((q.contiguous(), s.float()))
    q4_torch, q4_astrai = [], []
    for lw in ws:
        for w in lw:
            codes, sz = quant.int4_grid(w, 32, "bench")
            q4_torch.append((torch._convert_weight_to_int4pack_for_cpu(codes, 1), sz))
            q4_astrai.append(native.int4_layout(codes, sz))
    flat = [w for lw in bf for w in lw]
    nbytes = {"float32": sum(w.numel() * 4 for lw in ws for w in lw), "bf16": sum(w.numel() * 2 for w in flat),
              "int8": sum(w.numel() for lw in ws for w in lw)}
    nbytes["int4"] = nbytes["int8"] // 2
    big = torch.cat([w.flatten() for w in flat]).view(torch.int16)
    floor_bf16 = best_ms(lambda: big.max(), args.repeats)
    print(f"weights per pass: float32 {nbytes['float32'] / 1e6:.0f} MB, bf16 {nbytes['bf16'] / 1e6:.0f} MB, "
          f"int8 {nbytes['int8'] / 1e6:.0f} MB, int4 {nbytes['int4'] / 1e6:.0f} MB (+ scales)")
    print(f"read floor: torch's max over the bf16 weights' bytes {floor_bf16:.2f} ms "
          f"({nbytes['bf16'] / floor_bf16 / 1e6:.1f} GB/s)")
    cols = ["f32 torch", "f32 astrai", "bf16 torch", "bf16 astrai", "bf16 astrai avx2", "int8 torch", "int8 astrai",
            "int4 torch", "int4 astrai"]
    print("rows  " + "  ".join(f"{c:>16}" for c in cols))
    table = {}
    for m in [int(r) for r in args.rows.split(",")]:
        xf = {i: torch.randn(m, i) for i, _ in SHAPES}
        xb = {i: v.bfloat16() for i, v in xf.items()}
        runs = {
            "f32 torch": lambda: [F.linear(xf[w.shape[1]], w) for lw in ws for w in lw],
            "f32 astrai": lambda: [torch.ops.astrai.gemv_f32(xf[w.shape[1]], w, k.int8_isa, 64) for lw in ws for w in lw],
            "bf16 torch": lambda: [F.linear(xb[w.shape[1]], w) for w in flat],
            "bf16 astrai": lambda: [torch.ops.astrai.gemv_bf16(xb[w.shape[1]], w, k.bf16_isa, 64) for w in flat],
            "bf16 astrai avx2": lambda: [torch.ops.astrai.gemv_bf16(xb[w.shape[1]], w, native.ISA_AVX2, 64)
                                         for w in flat],
            "int8 torch": lambda: [torch._weight_int8pack_mm(xf[q.shape[1]], q, s) for lq in q8 for q, s in lq],
            "int8 astrai": lambda: [k.gemv_int8(xf[q.shape[1]], q, s) for lq in q8 for q, s in lq],
            "int4 torch": lambda: [torch._weight_int4pack_mm_for_cpu(xf[SHAPES[j % 4][0]], c, 32, sz)
                                   for j, (c, sz) in enumerate(q4_torch)],
            "int4 astrai": lambda: [k.gemv_int4(xf[SHAPES[j % 4][0]], *p) for j, p in enumerate(q4_astrai)],
        }
        row = table[m] = dict(zip(cols, (best_ms(runs[c], args.repeats) for c in cols)))
        print(f"{m:>4}  " + "  ".join(f"{v:>16.2f}" for v in row.values()))
    print("milliseconds per pass over the 120 products, best of rounds. Speed-up, torch's time / astrai's:")
    for m, row in table.items():
        print(f"  {m} rows: float32 {row['f32 torch'] / row['f32 astrai']:.2f}x, bf16 {row['bf16 torch'] / row['bf16 astrai']:.2f}x (against float32 "
              f"{row['f32 torch'] / row['bf16 astrai']:.2f}x), int8 {row['int8 torch'] / row['int8 astrai']:.2f}x, "
              f"int4 {row['int4 torch'] / row['int4 astrai']:.2f}x; bf16 astrai at "
              f"{floor_bf16 / row['bf16 astrai']:.2f} of the read floor")


if __name__ == "__main__":
    main()
