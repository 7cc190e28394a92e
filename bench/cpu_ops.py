"""The CPU operations the engine's torch backend and runner replaced, each against what it replaced,
timed in the same run with one torch thread (best of --repeats, milliseconds per call):

- prefill after a cached prefix: SDPA with an explicit bottom-right causal mask (the baseline)
  against the split into two flash calls merged by log-sum-exp (astrai.infer.backends.torch_native)
- LM head: F.linear on the [vocab, hidden] weight against a matmul with its transposed contiguous
  copy (astrai.infer.runner)
- greedy pick: max with indices against first_argmax by block maxima (astrai.infer.sampling)

Shapes: the bench/generate.py models (tiny: head_dim 16, hidden 64; small: head_dim 64, hidden 256;
4 query heads over 2 K/V heads), 16 sequences, the deepseek vocabulary size (129,282).

Run: python bench/cpu_ops.py [--repeats 30]

    python bench/cpu_ops.py --decode-weights [--threads 2]

times instead each projection of SmolLM2-135M's 30 layers (q/k/v fused, o, gate/up fused, down;
random float32 values) at 1, 16 and 256 rows, as nn.Linear computes it (x @ W^T, W [out, in])
against an input-major copy (x @ W, W [in, out] contiguous), in process CPU seconds (steadier than
wall-clock on a loaded machine): what astrai.infer.fused's choice of layouts rests on.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from astrai.infer.backends.torch_native import _split_attention  # noqa: E402
from astrai.infer.sampling import first_argmax  # noqa: E402

VOCAB = 129282


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def row(what: str, base: float, new: float):
    print(f"{what:58s} baseline {base:8.3f} ms   astrai {new:8.3f} ms   {base / new:5.2f}x")


def decode_weights(threads: int, repeats: int) -> None:
    torch.set_num_threads(threads)
    hidden, inter, layers = 576, 1536, 30
    shapes = {"q/k/v": (576 + 2 * 192, hidden), "o": (hidden, hidden), "gate/up": (2 * inter, hidden),
              "down": (hidden, inter)}
    clock = time.process_time
    print(f"{threads} threads, process CPU ms for the 30 layers' projection (best of {repeats})")
    for rows in (1, 16, 256):
        for name, (out, inp) in shapes.items():
            ws = [torch.randn(out, inp) for _ in range(layers)]
            ws_t = [w.t().contiguous() for w in ws]
            x = torch.randn(rows, inp)
            linear = lambda: [F.linear(x, w) for w in ws]  # noqa: E731
            input_major = lambda: [x @ w for w in ws_t]  # noqa: E731
            torch.testing.assert_close(linear()[0], input_major()[0], atol=1e-3, rtol=1e-4)
            times = {"linear": [], "input-major": []}
            with torch.inference_mode():
                for _ in range(repeats):  # interleaved, so a change in the machine's load hits both
                    for k, fn in (("linear", linear), ("input-major", input_major)):
                        t = clock()
                        fn()
                        times[k].append(clock() - t)
            base, new = (min(times[k]) * 1e3 for k in ("linear", "input-major"))
            print(f"{rows:4d} rows, {name:8s} [{out}, {inp}] x {layers}: x @ W^T on [out, in] {base:8.1f} ms   "
                  f"x @ W on [in, out] {new:8.1f} ms   {base / new:5.2f}x")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--decode-weights", action="store_true", help="the decode step's projections, two layouts")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    if a.decode_weights:
        return decode_weights(a.threads, min(a.repeats, 10))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    for d in (16, 64):
        cached, new = 512, 512
        q = torch.randn(1, 4, new, d)
        k, v = torch.randn(1, 2, cached + new, d), torch.randn(1, 2, cached + new, d)
        mask = torch.arange(cached + new)[None, :] <= torch.arange(cached, cached + new)[:, None]
        masked = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # noqa: E731
        torch.testing.assert_close(_split_attention(q, k, v, cached), masked(), atol=1e-5, rtol=1e-4)
        row(f"prefill {new} new after {cached} cached, head_dim {d}", best_ms(masked, a.repeats),
            best_ms(lambda: _split_attention(q, k, v, cached), a.repeats))
    for hidden in (64, 256):
        w = torch.randn(VOCAB, hidden)
        w_t = w.t().contiguous()
        h = torch.randn(16, hidden)
        torch.testing.assert_close(h @ w_t, F.linear(h, w), atol=1e-4, rtol=1e-4)
        row(f"LM head [16, {hidden}] x [{hidden}, {VOCAB}]", best_ms(lambda: F.linear(h, w), a.repeats),
            best_ms(lambda: h @ w_t, a.repeats))
    x = torch.randn(16, VOCAB)
    assert torch.equal(first_argmax(x), x.argmax(-1))
    row(f"greedy pick over [16, {VOCAB}]", best_ms(lambda: x.max(-1).indices, a.repeats),
        best_ms(lambda: first_argmax(x), a.repeats))


if __name__ == "__main__":
    main()
