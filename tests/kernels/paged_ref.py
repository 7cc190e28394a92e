"""Float32 references and paged-cache builders for the kernel tests (independent of astrai.infer)."""

from __future__ import annotations

import math

import torch


def paged_cache(kv_lens, page_size, num_kv_heads, head_dim, dtype, gen, spare_pages=3):
    """Random K/V for each request in scattered pages; every slot no request owns is NaN.

    Returns (k_cache, v_cache, kv_indptr, page_indices, slots) with slots[b] the cache rows of request b
    in position order, so a kernel that reads one row too many, or the wrong page, produces NaN.
    """
    pages_per_req = [math.ceil(n / page_size) for n in kv_lens]
    num_pages = sum(pages_per_req) + spare_pages
    order = torch.randperm(num_pages, generator=gen).tolist()
    shape = (num_pages * page_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    indptr, indices, slots = [0], [], []
    for n, count in zip(kv_lens, pages_per_req):
        pages, order = order[:count], order[count:]
        indices += pages
        indptr.append(len(indices))
        rows = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(n)], dtype=torch.long)
        k_cache[rows] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v_cache[rows] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        slots.append(rows)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    return k_cache, v_cache, i32(indptr), i32(indices), slots


def attention_ref(q, k, v, first_pos, window=None, scale=None):
    """Float32 attention of q [n, Hq, D] at positions first_pos.. over k, v [kv_len, Hkv, D], causal; with a
    sliding window the query at position p sees positions p - window + 1 .. p; softmax scale 1/sqrt(D) or `scale`."""
    q, k, v = q.float(), k.float(), v.float()
    n, hq, d = q.shape
    kv_len, hkv = k.shape[0], k.shape[1]
    if kv_len == 0:
        return torch.zeros(n, hq, d)
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("nhd,khd->hnk", q, k) * (1 / math.sqrt(d) if scale is None else scale)
    q_pos = (first_pos + torch.arange(n))[:, None]
    visible = torch.arange(kv_len)[None, :] <= q_pos
    if window is not None:
        visible &= torch.arange(kv_len)[None, :] > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnk,khd->nhd", scores.softmax(-1), v)


def rope_tables(max_pos, rot_dim, theta=10000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def rotary_ref(x, positions, cos, sin, interleaved):
    """Float32 RoPE on x [T, H, D] written from the formula: pair j rotated by angle(pos, j)."""
    x = x.float().clone()
    half = cos.shape[1]
    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]
    if interleaved:
        a, b = x[..., 0:2 * half:2].clone(), x[..., 1:2 * half:2].clone()
        x[..., 0:2 * half:2], x[..., 1:2 * half:2] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., :half].clone(), x[..., half:2 * half].clone()
        x[..., :half], x[..., half:2 * half] = a * c - b * s, b * c + a * s
    return x
