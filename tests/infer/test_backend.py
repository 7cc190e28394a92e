"""The torch attention backend against a slow float64 reference on unpaged K/V; backend selection."""

import math
import random

import pytest
import torch

from astrai.infer import backend as backend_mod
from astrai.infer.backend import AttentionMeta, BackendUnavailable, attn_backend, select_backend
from astrai.infer.backends import torch_native
from astrai.infer.backends.torch_native import TorchBackend


def reference_attention(q, k, v, q_start):
    """q [q_len, Hq, D] at positions q_start.., k/v [kv_len, Hkv, D] -> o, by explicit softmax in float64."""
    q_len, hq, d = q.shape
    group = hq // k.shape[1]
    out = torch.zeros(q_len, hq, d, dtype=torch.float64)
    for i in range(q_len):
        for h in range(hq):
            keys = k[: q_start + i + 1, h // group].double()
            w = torch.softmax(keys @ q[i, h].double() / math.sqrt(d), 0)
            out[i, h] = w @ v[: q_start + i + 1, h // group].double()
    return out


def build_case(rng, kv_lens, q_lens, page_size, hq=4, hkv=2, d=8, num_pages=None):
    num_pages = num_pages or sum(-(-n // page_size) for n in kv_lens) + 3
    k_cache = [torch.zeros(num_pages * page_size, hkv, d)]
    v_cache = [torch.zeros(num_pages * page_size, hkv, d)]
    be = TorchBackend(k_cache, v_cache)
    free = list(range(num_pages))
    rng.shuffle(free)  # pages scattered over the pool, not contiguous
    pages, dense = [], []
    for kv_len in kv_lens:
        n = -(-kv_len // page_size)
        pages.append([free.pop() for _ in range(n)])
        k, v = torch.randn(kv_len, hkv, d), torch.randn(kv_len, hkv, d)
        dense.append((k, v))
        slots = torch.tensor([pages[-1][p // page_size] * page_size + p % page_size for p in range(kv_len)])
        be.write_kv(0, k, v, slots)
    meta = AttentionMeta.build(q_lens, kv_lens, pages, page_size)
    q = torch.randn(sum(q_lens), hq, d)
    return be, meta, q, dense


@pytest.mark.parametrize("split_min_q", [1, 10**9])  # cached prefixes: split + merged always / never
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_prefill_ragged_with_cached_prefixes(page_size, split_min_q, monkeypatch):
    monkeypatch.setattr(torch_native, "SPLIT_MIN_Q", split_min_q)
    rng = random.Random(page_size)
    kv_lens = [5, 17, 1, 33, 12, 70]
    q_lens = [5, 3, 1, 33, 7, 40]  # fresh, cached prefix, single, fresh long, cached prefix, long after cached
    be, meta, q, dense = build_case(rng, kv_lens, q_lens, page_size)
    o = be.prefill(0, q, meta)
    start = 0
    for (k, v), kv_len, q_len in zip(dense, kv_lens, q_lens):
        ref = reference_attention(q[start:start + q_len], k, v, kv_len - q_len)
        torch.testing.assert_close(o[start:start + q_len].double(), ref, atol=1e-5, rtol=1e-5)
        start += q_len
    assert be.prefill(0, q, meta) is not None and "torch_prefill" in meta.scratch  # plan reused


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_batched_matches_reference(page_size):
    rng = random.Random(3)
    kv_lens = [1, 9, 40, 16]
    be, meta, q, dense = build_case(rng, kv_lens, [1] * 4, page_size, hq=6, hkv=3)
    o = be.decode(0, q, meta)
    for b, ((k, v), kv_len) in enumerate(zip(dense, kv_lens)):
        ref = reference_attention(q[b:b + 1], k, v, kv_len - 1)
        torch.testing.assert_close(o[b:b + 1].double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(be.prefill(0, q, meta), o, atol=1e-6, rtol=1e-6)  # both paths agree


def test_selection_env_and_context_manager(monkeypatch):
    monkeypatch.delenv(backend_mod.ENV_VAR, raising=False)
    assert select_backend("cpu", torch.float32) is TorchBackend
    monkeypatch.setenv(backend_mod.ENV_VAR, "nope")
    with pytest.raises(BackendUnavailable, match="ASTRAI_ATTN_BACKEND asks for attention backend 'nope'"):
        select_backend("cpu", torch.float32)
    with attn_backend("torch"):  # the context manager wins over the environment
        assert select_backend("cpu", torch.float32) is TorchBackend
    with pytest.raises(BackendUnavailable, match="unknown attention backend"):
        with attn_backend("nope"):
            pass


def test_forced_backend_that_cannot_serve_raises(monkeypatch):
    monkeypatch.delenv(backend_mod.ENV_VAR, raising=False)
    monkeypatch.setitem(backend_mod.BACKENDS, "fake", "astrai_no_such_module:Backend")
    with attn_backend("fake"):
        with pytest.raises(BackendUnavailable, match="cannot load"):
            select_backend("cpu", torch.float32)
    assert select_backend("cpu", torch.float32) is TorchBackend  # unforced: skipped, torch serves
    monkeypatch.setattr(TorchBackend, "supports", classmethod(lambda cls, dev, dt: (False, "test says no")))
    with attn_backend("torch"):
        with pytest.raises(BackendUnavailable, match="cannot serve cpu / torch.float32: test says no"):
            select_backend("cpu", torch.float32)


def test_shared_prefix_pages():
    from astrai.infer.backends.torch_native import shared_prefix_pages

    assert shared_prefix_pages([[1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 7]], [16, 15, 11], 4) == 2
    assert shared_prefix_pages([[1, 2, 3], [1, 2, 3]], [12, 12], 4) == 2  # leave each request a token of its own
    assert shared_prefix_pages([[1, 2, 3], [1, 2, 3]], [12, 9], 4) == 2
    assert shared_prefix_pages([[1, 2], [5, 2]], [8, 8], 4) == 0
    assert shared_prefix_pages([[1, 2, 3]], [12], 4) == 0  # one request: nothing to share


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_decode_cascade_over_a_shared_prefix(page_size, monkeypatch):
    """Requests whose first pages are the same physical pages (a radix-shared prompt) decode as a cascade;
    the answer is the plain attention over each request's whole K/V."""
    monkeypatch.setattr(torch_native, "CASCADE_MIN_TOKENS", 1)
    rng = random.Random(page_size)
    hkv, hq, d = 2, 6, 8
    shared_len = 3 * 16  # whole pages at every page size here
    own_lens = [1, 9, 30, 17]
    num_pages = (shared_len + sum(own_lens)) // page_size + len(own_lens) + 2
    k_cache = [torch.zeros(num_pages * page_size, hkv, d)]
    v_cache = [torch.zeros(num_pages * page_size, hkv, d)]
    be = TorchBackend(k_cache, v_cache)
    free = list(range(num_pages))
    rng.shuffle(free)
    shared_pages = [free.pop() for _ in range(shared_len // page_size)]
    ks, vs = torch.randn(shared_len, hkv, d), torch.randn(shared_len, hkv, d)
    be.write_kv(0, ks, vs, torch.tensor([shared_pages[p // page_size] * page_size + p % page_size
                                         for p in range(shared_len)]))
    pages, dense = [], []
    for n in own_lens:
        own = [free.pop() for _ in range(-(-n // page_size))]
        k, v = torch.randn(n, hkv, d), torch.randn(n, hkv, d)
        be.write_kv(0, k, v, torch.tensor([own[p // page_size] * page_size + p % page_size for p in range(n)]))
        pages.append(shared_pages + own)
        dense.append((torch.cat([ks, k]), torch.cat([vs, v])))
    kv_lens = [shared_len + n for n in own_lens]
    meta = AttentionMeta.build([1] * len(own_lens), kv_lens, pages, page_size)
    q = torch.randn(len(own_lens), hq, d)
    o = be.decode(0, q, meta)
    assert meta.scratch["torch_decode"][0] == "cascade"
    for b, ((k, v), kv_len) in enumerate(zip(dense, kv_lens)):
        ref = reference_attention(q[b:b + 1], k, v, kv_len - 1)
        torch.testing.assert_close(o[b:b + 1].double(), ref, atol=1e-5, rtol=1e-5)
