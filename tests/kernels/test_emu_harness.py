"""The emulator catches the bugs it exists for: planted in copies of the real sources, or in tiny kernels."""

from __future__ import annotations

import pytest
import torch

from astrai.kernels import launch as L
from astrai.kernels.catalog import KERNEL_DIR
from harness import EmuError, EmuExecutor, build, invoke, kernel_copy
from paged_ref import attention_ref, paged_cache


def _decode_case(page_size=16, kv_lens=(40, 75)):
    gen = torch.Generator().manual_seed(5)
    kv_lens = list(kv_lens)
    k_cache, v_cache, kv_indptr, pages, slots = paged_cache(kv_lens, page_size, 2, 64, torch.float16, gen)
    q = torch.randn(len(kv_lens), 4, 64, generator=gen).half()
    return q, k_cache, v_cache, kv_indptr, pages, torch.tensor(kv_lens, dtype=torch.int32), slots


def test_the_unmodified_copy_passes():
    emu = EmuExecutor(kernel_dir=kernel_copy({}))
    q, kc, vc, indptr, pages, lens, slots = _decode_case()
    out = L.decode(q, kc, vc, indptr, pages, lens, 16, 75, emu)
    ref = attention_ref(q[1:2], kc[slots[1]], vc[slots[1]], 74)[0]
    assert (out[1].float() - ref).abs().max() < 2e-3


@pytest.mark.parametrize("barrier", ["after the K/V tile load", "before the next tile"])
def test_a_missing_barrier_is_caught(barrier):
    src = (KERNEL_DIR / "paged_attention.cuh").read_text()
    if barrier == "after the K/V tile load":
        anchor = src.index("__syncthreads();", src.index("K/V tile -> shared"))
    else:
        anchor = src.index("__syncthreads();  // the next tile")
    # Remove exactly that barrier (occurrence-precise: cut at the anchor).
    emu = EmuExecutor(kernel_dir=kernel_copy({"paged_attention.cuh": src[:anchor] + "/* planted */" + src[anchor + 16:]}))
    q, kc, vc, indptr, pages, lens, slots = _decode_case()
    out = L.decode(q, kc, vc, indptr, pages, lens, 16, 75, emu, num_splits=1)
    refs = torch.stack([attention_ref(q[b:b + 1], kc[slots[b]], vc[slots[b]], int(n) - 1)[0]
                        for b, n in enumerate(lens)])
    wrong = torch.isnan(out).any() or (out.float() - refs).abs().max() > 1e-2
    assert wrong, f"removing the barrier {barrier} went unnoticed"


def test_an_out_of_bounds_page_read_is_caught(emu):
    q, kc, vc, indptr, pages, lens, _ = _decode_case()
    num_pages = kc.shape[0] // 16
    pages = pages.clone()
    pages[-1] = num_pages  # one page past the end of the cache
    with pytest.raises(EmuError, match="out-of-bounds access"):
        L.decode(q, kc, vc, indptr, pages, lens, 16, 75, emu)


def test_a_wrong_scalar_type_is_refused(emu):
    q, kc, vc, indptr, pages, lens, _ = _decode_case()
    out = emu.empty(q.shape, q.dtype, q.device)
    (launch,) = L.decode_launches(q, kc, vc, indptr, pages, lens, 16, 75, out, emu, num_splits=1)
    args = list(launch.args)
    args[11] = L.I64(args[11])  # num_q_heads: the kernel takes int
    with pytest.raises(EmuError, match="argument 11: kernel takes int, launch passed long long"):
        emu.run(L.Launch(launch.kernel, launch.name_expression, launch.grid, launch.block, launch.smem,
                         tuple(args)))
    args[11] = 4  # a bare Python int: CuPy would pass it as 64-bit
    with pytest.raises(TypeError, match="not typed"):
        emu.run(L.Launch(launch.kernel, launch.name_expression, launch.grid, launch.block, launch.smem,
                         tuple(args)))


TOY = r"""
#include <cuda_fp16.h>
__global__ void divergent(float* out) {
  if (threadIdx.x < 32) __syncthreads();
  out[threadIdx.x] = 1.f;
}
__global__ void split_barriers(float* out) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.f;
}
__global__ void shuffle_vs_barrier(float* out) {
  float v = threadIdx.x;
  if (threadIdx.x < 16) v = __shfl_xor_sync(0xffffffffu, v, 1); else __syncthreads();
  out[threadIdx.x] = v;
}
__global__ void shuffled(float* out) {
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (float)threadIdx.x, 5);
}
"""


@pytest.mark.parametrize("kernel,message", [
    ("divergent", "divergent barrier: threads exited while others wait"),
    ("split_barriers", "divergent barrier: threads wait at different __syncthreads"),
    ("shuffle_vs_barrier", "deadlock"),
])
def test_barrier_misuse_is_reported_not_hung(kernel, message):
    names = ["divergent", "split_barriers", "shuffle_vs_barrier", "shuffled"]
    lib = build("toy.cu", names, kernel_dir=kernel_copy({"toy.cu": TOY}, base=None))
    out = torch.zeros(64)
    with pytest.raises(EmuError, match=message):
        invoke(lib, getattr(lib, f"emu_kernel_{names.index(kernel)}"),
               L.Launch("toy", kernel, (1, 1, 1), (64, 1, 1), 0, (out,)))


def test_warp_shuffle_exchanges_lanes():
    lib = build("toy.cu", ["shuffled"], kernel_dir=kernel_copy({"toy.cu": TOY}, base=None))
    out = torch.zeros(64)
    invoke(lib, lib.emu_kernel_0, L.Launch("toy", "shuffled", (1, 1, 1), (64, 1, 1), 0, (out,)))
    lane = torch.arange(64)
    assert torch.equal(out, ((lane % 32) ^ 5) + lane // 32 * 32)
