"""Semantics tier (and GPU tier, same cases): paged decode and ragged paged prefill, the real .cu sources run on the CPU emulator,
against float32 references built in paged_ref.py (gathering K/V by hand through the page list).

Unused cache slots are NaN, outputs start NaN, shared memory starts NaN: reading the wrong page,
one position too many, or leaving an output unwritten shows up as NaN or a mismatch.
"""

from __future__ import annotations

import pytest
import torch

from astrai.kernels import launch as L
from paged_ref import attention_ref, paged_cache

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _lens(page_size, long):
    """0, 1, page-1, page, page+1 and a long one, without duplicates (page 1 collapses some)."""
    return sorted(set([0, 1, max(page_size - 1, 1), page_size, page_size + 1, long]))


def _check_close(out, ref, dtype, what):
    assert not torch.isnan(out).any(), f"{what}: NaN in the output"
    err = (out.float() - ref).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref.abs().max().item()), f"{what}: max error {err}"


DECODE_CASES = [
    # (dtype, head_dim, num_q_heads, num_kv_heads, page_size, long, num_splits)
    (torch.float16, 64, 4, 4, 16, 80, None),
    (torch.bfloat16, 128, 8, 1, 16, 70, 3),
    (torch.float32, 64, 6, 2, 1, 40, None),
    (torch.float16, 128, 16, 2, 1, 33, 2),
    (torch.bfloat16, 64, 2, 2, 16, 300, None),  # auto split: 300 > MIN_SPLIT_LEN
    (torch.float16, 64, 5, 1, 16, 97, 4),
]


@pytest.mark.parametrize("dtype,head_dim,hq,hkv,page_size,long,num_splits", DECODE_CASES)
def test_paged_decode_matches_reference(target, dtype, head_dim, hq, hkv, page_size, long, num_splits):
    gen = torch.Generator().manual_seed(hash((head_dim, hq, page_size, long)) % 2**31)
    kv_lens = _lens(page_size, long)
    k_cache, v_cache, kv_indptr, pages, slots = paged_cache(kv_lens, page_size, hkv, head_dim, dtype, gen)
    q = torch.randn(len(kv_lens), hq, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    out = L.decode(*target.to(q, k_cache, v_cache, kv_indptr, pages, lens), page_size, max(kv_lens),
                   target.executor, num_splits).cpu()
    for b, n in enumerate(kv_lens):
        ref = attention_ref(q[b:b + 1], k_cache[slots[b]], v_cache[slots[b]], n - 1)[0]
        _check_close(out[b], ref, dtype, f"request {b} (kv_len {n})")


def test_decode_reads_q_through_a_fused_qkv_view(target):
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, ps = 4, 2, 64, 16
    kv_lens = [5, 40]
    k_cache, v_cache, kv_indptr, pages, slots = paged_cache(kv_lens, ps, hkv, d, torch.float16, gen)
    qkv = torch.randn(2, (hq + 2 * hkv) * d, generator=gen).half()
    q = qkv[:, : hq * d].view(2, hq, d)
    q_dev = target.to(qkv)[:, : hq * d].view(2, hq, d)
    assert not q_dev.is_contiguous()
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    out = L.decode(q_dev, *target.to(k_cache, v_cache, kv_indptr, pages, lens), ps, 40, target.executor).cpu()
    for b, n in enumerate(kv_lens):
        ref = attention_ref(q[b:b + 1], k_cache[slots[b]], v_cache[slots[b]], n - 1)[0]
        _check_close(out[b], ref, torch.float16, f"request {b}")


PREFILL_CASES = [
    # (dtype, head_dim, hq, hkv, page_size, [(q_len, kv_len) per request], tile_tokens)
    (torch.float16, 64, 4, 2, 16, [(1, 1), (15, 15), (16, 16), (17, 17), (70, 70)], None),
    (torch.bfloat16, 128, 8, 1, 16, [(5, 40), (0, 9), (17, 33), (1, 64)], None),  # cached prefixes
    (torch.float32, 64, 3, 3, 1, [(2, 2), (1, 1), (9, 30)], 4),
    (torch.float16, 128, 8, 2, 1, [(33, 33), (4, 7)], 3),
]


@pytest.mark.parametrize("dtype,head_dim,hq,hkv,page_size,reqs,tile", PREFILL_CASES)
def test_ragged_paged_prefill_matches_reference(target, dtype, head_dim, hq, hkv, page_size, reqs, tile):
    gen = torch.Generator().manual_seed(len(reqs) * 31 + head_dim)
    q_lens = [r[0] for r in reqs]
    kv_lens = [r[1] for r in reqs]
    k_cache, v_cache, kv_indptr, pages, slots = paged_cache(kv_lens, page_size, hkv, head_dim, dtype, gen)
    qo = [0]
    for n in q_lens:
        qo.append(qo[-1] + n)
    q = torch.randn(qo[-1], hq, head_dim, generator=gen).to(dtype)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    out = L.prefill(*target.to(q, k_cache, v_cache, i32(qo), kv_indptr, pages, i32(kv_lens)), page_size,
                    max(q_lens), target.executor, tile).cpu()
    for b, (q_len, kv_len) in enumerate(reqs):
        if q_len == 0:
            continue
        ref = attention_ref(q[qo[b]:qo[b + 1]], k_cache[slots[b]], v_cache[slots[b]], kv_len - q_len)
        _check_close(out[qo[b]:qo[b + 1]], ref, dtype, f"request {b} (q_len {q_len}, kv_len {kv_len})")


def test_plan_splits_fills_the_machine_and_respects_the_minimum():
    assert L.plan_splits(1, 8, 100, 132) == (1, 128)  # short: one split
    splits, split_len = L.plan_splits(1, 8, 8192, 132)
    assert splits == 32 and split_len == 256 and splits * split_len >= 8192
    splits, split_len = L.plan_splits(64, 8, 8192, 132)  # 512 blocks already fill 132 SMs
    assert splits == 1
    assert L.plan_splits(2, 2, 0, 132)[0] == 1


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
def test_gqa_head_dim_page_size_sweep(target, group, head_dim, page_size):
    """Every GQA ratio 1-8 x head dims x page sizes, decode (split) and prefill with a cached prefix."""
    gen = torch.Generator().manual_seed(group * 1000 + head_dim + page_size)
    hkv, dtype = 2, torch.float16
    hq = hkv * group
    reqs = [(1, page_size + 1), (page_size + 2, 2 * page_size + 3), (3, 3)]
    kv_lens = [r[1] for r in reqs]
    k_cache, v_cache, kv_indptr, pages, slots = paged_cache(kv_lens, page_size, hkv, head_dim, dtype, gen)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    q = torch.randn(len(reqs), hq, head_dim, generator=gen).to(dtype)
    out = L.decode(*target.to(q, k_cache, v_cache, kv_indptr, pages, i32(kv_lens)), page_size, max(kv_lens),
                   target.executor, num_splits=2).cpu()
    for b, n in enumerate(kv_lens):
        ref = attention_ref(q[b:b + 1], k_cache[slots[b]], v_cache[slots[b]], n - 1)[0]
        _check_close(out[b], ref, dtype, f"decode request {b}")
    qo = [0, 1, 1 + page_size + 2, 1 + page_size + 2 + 3]
    qp = torch.randn(qo[-1], hq, head_dim, generator=gen).to(dtype)
    out = L.prefill(*target.to(qp, k_cache, v_cache, i32(qo), kv_indptr, pages, i32(kv_lens)), page_size,
                    max(r[0] for r in reqs), target.executor).cpu()
    for b, (q_len, kv_len) in enumerate(reqs):
        ref = attention_ref(qp[qo[b]:qo[b + 1]], k_cache[slots[b]], v_cache[slots[b]], kv_len - q_len)
        _check_close(out[qo[b]:qo[b + 1]], ref, dtype, f"prefill request {b}")


def test_automatic_split_plan_on_a_wide_machine(emu):
    """The executor's SM count drives plan_splits: on a 64-SM machine a 700-token request splits in 3."""
    from harness import EmuExecutor

    wide = EmuExecutor()
    wide.num_sms = 64
    gen = torch.Generator().manual_seed(8)
    kv_lens = [700, 5]
    k_cache, v_cache, kv_indptr, pages, slots = paged_cache(kv_lens, 16, 1, 64, torch.float16, gen)
    q = torch.randn(2, 4, 64, generator=gen).half()
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    plan = L.decode_launches(q, k_cache, v_cache, kv_indptr, pages, lens, 16, 700, wide.empty(q.shape, q.dtype, "cpu"),
                             wide)
    assert [launch.kernel for launch in plan] == ["paged_decode", "merge_splits"] and plan[0].grid[0] == 3
    out = L.decode(q, k_cache, v_cache, kv_indptr, pages, lens, 16, 700, wide)
    for b, n in enumerate(kv_lens):
        _check_close(out[b], attention_ref(q[b:b + 1], k_cache[slots[b]], v_cache[slots[b]], n - 1)[0],
                     torch.float16, f"request {b}")


@pytest.mark.parametrize("window", [1, 5, 16, 23, 1000])
@pytest.mark.parametrize("page_size", [1, 16])
def test_sliding_window_and_softmax_scale(target, window, page_size):
    """Per-layer sliding windows (1, shorter and longer than a page, a tile, the context) and a softmax
    scale of the model's own: prefill with cached prefixes and several tiles, decode with several splits."""
    gen = torch.Generator().manual_seed(window * 7 + page_size)
    dtype, hq, hkv, d, scale = torch.float32, 4, 2, 64, 0.3
    reqs = [(1, 1), (9, 9), (6, 40), (37, 70), (1, 64)]  # (new tokens, kv_len)
    kv_lens = [r[1] for r in reqs]
    k_cache, v_cache, kv_indptr, pages, slots = paged_cache(kv_lens, page_size, hkv, d, dtype, gen)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    q = torch.randn(len(reqs), hq, d, generator=gen)
    out = L.decode(*target.to(q, k_cache, v_cache, kv_indptr, pages, i32(kv_lens)), page_size, max(kv_lens),
                   target.executor, num_splits=3, scale=scale, window=window).cpu()
    for b, n in enumerate(kv_lens):
        ref = attention_ref(q[b:b + 1], k_cache[slots[b]], v_cache[slots[b]], n - 1, window, scale)[0]
        _check_close(out[b], ref, dtype, f"decode request {b} (kv_len {n})")
    qo = [0]
    for n, _ in reqs:
        qo.append(qo[-1] + n)
    qp = torch.randn(qo[-1], hq, d, generator=gen)
    out = L.prefill(*target.to(qp, k_cache, v_cache, i32(qo), kv_indptr, pages, i32(kv_lens)), page_size,
                    max(r[0] for r in reqs), target.executor, 4, scale=scale, window=window).cpu()
    for b, (q_len, kv_len) in enumerate(reqs):
        ref = attention_ref(qp[qo[b]:qo[b + 1]], k_cache[slots[b]], v_cache[slots[b]], kv_len - q_len, window, scale)
        _check_close(out[qo[b]:qo[b + 1]], ref, dtype, f"prefill request {b} (q_len {q_len}, kv_len {kv_len})")
