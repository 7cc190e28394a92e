"""Real-thread mode: a few launches of the real kernels under ThreadSanitizer and AddressSanitizer.

The fiber emulator is deterministic, so it only sees the interleavings its scheduler makes; here
every CUDA thread is an OS thread and the sanitizers watch every shared and global access:
TSan reports a shared-memory race (a missing barrier), ASan+UBSan an out-of-bounds read on
exact-size buffers. Slow (each sanitizer build takes a while once; cached afterwards).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from astrai.kernels import launch as L
from astrai.kernels.catalog import KERNEL_DIR
from harness import EmuError, SanitizerExecutor, kernel_copy
from paged_ref import attention_ref, paged_cache

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")]


def _case():
    gen = torch.Generator().manual_seed(11)
    kv_lens = [3, 40]
    k_cache, v_cache, kv_indptr, pages, slots = paged_cache(kv_lens, 16, 2, 64, torch.float16, gen)
    q = torch.randn(2, 4, 64, generator=gen).half()
    return q, k_cache, v_cache, kv_indptr, pages, torch.tensor(kv_lens, dtype=torch.int32), slots


@pytest.mark.parametrize("sanitizer", ["thread", "address"])
def test_decode_and_prefill_are_clean_under_sanitizers(sanitizer):
    ex = SanitizerExecutor(sanitizer)
    q, kc, vc, indptr, pages, lens, slots = _case()
    out = L.decode(q, kc, vc, indptr, pages, lens, 16, 40, ex, num_splits=2)
    qp = torch.randn(43, 4, 64).half()
    qo = torch.tensor([0, 3, 43], dtype=torch.int32)
    outp = L.prefill(qp, kc, vc, qo, indptr, pages, lens, 16, 40, ex)
    for b, n in enumerate([3, 40]):
        ref = attention_ref(q[b:b + 1], kc[slots[b]], vc[slots[b]], n - 1)[0]
        assert (out[b].float() - ref).abs().max() < 2e-3
        refp = attention_ref(qp[qo[b]:qo[b + 1]], kc[slots[b]], vc[slots[b]], 0)
        assert (outp[qo[b]:qo[b + 1]].float() - refp).abs().max() < 2e-3


def test_thread_sanitizer_reports_a_missing_barrier():
    src = (KERNEL_DIR / "paged_attention.cuh").read_text()
    anchor = src.index("__syncthreads();", src.index("K/V tile -> shared"))
    planted = kernel_copy({"paged_attention.cuh": src[:anchor] + "/* planted */" + src[anchor + 16:]})
    q, kc, vc, indptr, pages, lens, _ = _case()
    with pytest.raises(EmuError, match="data race"):
        L.decode(q, kc, vc, indptr, pages, lens, 16, 40, SanitizerExecutor("thread", kernel_dir=planted),
                 num_splits=1)


def test_address_sanitizer_reports_an_out_of_bounds_page():
    q, kc, vc, indptr, pages, lens, _ = _case()
    pages = pages.clone()
    pages[-1] = kc.shape[0] // 16  # one page past the end of the cache
    with pytest.raises(EmuError, match="heap-buffer-overflow"):
        L.decode(q, kc, vc, indptr, pages, lens, 16, 40, SanitizerExecutor("address"), num_splits=1)
