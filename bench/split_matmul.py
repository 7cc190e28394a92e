"""The engine's split products against MKL's own, on SmolLM2-135M's projection shapes.

    python bench/split_matmul.py [--threads 2] [--rows 1,2,3,4,8,16,32,128,512] [--repeats 6] [--dtype bfloat16]

Every projection of a 30-layer SmolLM2 (q/k/v [576 -> 960], o [576 -> 576], gate/up [576 -> 3072],
down [1536 -> 576]) plus the LM head [576 -> 49152], distinct random float32 weights so that none stays
in cache, multiplied by `rows` input rows: F.linear on [out, in] weights, `x @ W` on input-major copies
(one MKL call each), and astrai.infer.fused.matmul split into one piece per thread up to SPLIT_N_ROWS rows
(the engine splits float32 products so; it leaves bfloat16 ones whole, which this column shows the cost
of), in --dtype (float32, or bfloat16: oneDNN's kernels, AMX/AVX-512 BF16 where the CPU has them).
Milliseconds for all of them, best of --repeats rounds, interleaved; the CPU's flags and the bytes of
weights read per step (the floor any kernel pays) first.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from astrai.infer.fused import SPLIT_N_ROWS, matmul
from astrai.runtime.hardware import cpu_flags_line

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
LAYERS = 30
VOCAB = 49152


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,3,4,8,16,32,128,512")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    weights = [(torch.randn(o, i) * 0.02).to(dtype) for _ in range(LAYERS) for i, o in SHAPES]
    weights.append((torch.randn(VOCAB, 576) * 0.02).to(dtype))
    copies = [w.t().contiguous() for w in weights]
    size = sum(w.numel() * w.element_size() for w in weights)
    print(f"torch {torch.__version__}, {args.threads} threads, {args.dtype}, {cpu_flags_line()}; "
          f"{size / 1e6:.0f} MB of weights; ms for every product of one step")
    print(f"{'rows':>6} {'F.linear':>10} {'x @ W':>10} {'split':>10} {'pieces':>7}")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {576: torch.randn(rows, 576, dtype=dtype), 1536: torch.randn(rows, 1536, dtype=dtype)}
            parts = args.threads if rows <= SPLIT_N_ROWS else 1
            runs = {"linear": lambda: [F.linear(xs[w.shape[1]], w) for w in weights],
                    "mm": lambda: [xs[c.shape[0]] @ c for c in copies],
                    "split": lambda: [matmul(xs[c.shape[0]], c, parts) for c in copies]}
            best = dict.fromkeys(runs, float("inf"))
            for _ in range(args.repeats):
                for name, run in runs.items():
                    t = time.perf_counter()
                    run()
                    best[name] = min(best[name], time.perf_counter() - t)
            print(f"{rows:>6} {best['linear'] * 1e3:>10.1f} {best['mm'] * 1e3:>10.1f} {best['split'] * 1e3:>10.1f} "
                  f"{parts:>7}", flush=True)


if __name__ == "__main__":
    main()
