"""Semantics tier (and GPU tier, same cases): fused rotary and KV write on the CPU emulator against float32 / index_copy references."""

from __future__ import annotations

import pytest
import torch

from astrai.kernels import launch as L
from paged_ref import rope_tables, rotary_ref

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (128, 128), (64, 32)])
def test_rotary_in_place_on_fused_qkv_views(target, dtype, interleaved, head_dim, rot_dim):
    gen = torch.Generator().manual_seed(head_dim + rot_dim + int(interleaved))
    tokens, hq, hkv = 7, 4, 2
    before = torch.randn(tokens, (hq + 2 * hkv) * head_dim, generator=gen).to(dtype)
    qkv = target.to(before.clone())
    q = qkv[:, : hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim:(hq + hkv) * head_dim].view(tokens, hkv, head_dim)
    positions = torch.tensor([0, 5, 3, 1000, 17, 2, 4095])
    cos, sin = rope_tables(4096, rot_dim)
    L.rotary(q, k, *target.to(positions, cos, sin), interleaved, target.executor)
    qkv, q, k = qkv.cpu(), q.cpu(), k.cpu()

    q_ref = rotary_ref(before[:, : hq * head_dim].view(tokens, hq, head_dim), positions, cos, sin, interleaved)
    k_ref = rotary_ref(before[:, hq * head_dim:(hq + hkv) * head_dim].view(tokens, hkv, head_dim), positions, cos,
                       sin, interleaved)
    assert (q.float() - q_ref).abs().max() <= TOL[dtype] * 4
    assert (k.float() - k_ref).abs().max() <= TOL[dtype] * 4
    assert torch.equal(qkv[:, (hq + hkv) * head_dim:], before[:, (hq + hkv) * head_dim:]), "v was touched"
    if rot_dim < head_dim:
        assert torch.equal(q[..., rot_dim:], before[:, : hq * head_dim].view(tokens, hq, head_dim)[..., rot_dim:])


def test_rotary_layouts_differ_and_position_zero_is_identity(emu):
    cos, sin = rope_tables(16, 64)
    x = torch.randn(2, 1, 64)
    q_half, q_inter = x.clone(), x.clone()
    k_half, k_inter = x.clone(), x.clone()
    pos = torch.tensor([0, 3])
    L.rotary(q_half, k_half, pos, cos, sin, False, emu)
    L.rotary(q_inter, k_inter, pos, cos, sin, True, emu)
    assert torch.equal(q_half[0], x[0]) and torch.equal(q_inter[0], x[0])
    assert not torch.allclose(q_half[1], q_inter[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kv_write_scatters_strided_views_and_skips_negative_slots(target, dtype):
    gen = torch.Generator().manual_seed(1)
    tokens, hq, hkv, d = 6, 4, 2, 64
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    k = qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(tokens, hkv, d)
    slots = torch.tensor([31, 0, -1, 16, 5, 17])
    qkv_dev = target.to(qkv)
    k_cache, v_cache = target.to(torch.full((32, hkv, d), float("nan"), dtype=dtype),
                                 torch.full((32, hkv, d), float("nan"), dtype=dtype))
    L.write_kv(qkv_dev[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d), qkv_dev[:, (hq + hkv) * d:].view(tokens, hkv, d),
               k_cache, v_cache, target.to(slots), target.executor)
    k_cache, v_cache = k_cache.cpu(), v_cache.cpu()

    keep = slots >= 0
    k_ref = torch.full_like(k_cache, float("nan")).index_copy_(0, slots[keep], k[keep])
    v_ref = torch.full_like(v_cache, float("nan")).index_copy_(0, slots[keep], v[keep])
    assert torch.equal(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))


def test_rotary_reads_a_hugging_face_table_in_place(emu):
    """astrai.model.rope keeps [max_pos, head_dim] tables (both halves equal); a column slice is enough."""
    cos_half, sin_half = rope_tables(64, 32)
    cos_full, sin_full = torch.cat([cos_half, cos_half], 1), torch.cat([sin_half, sin_half], 1)
    x = torch.randn(3, 2, 32)
    q1, k1, q2, k2 = x.clone(), x.clone(), x.clone(), x.clone()
    pos = torch.tensor([9, 0, 63])
    L.rotary(q1, k1, pos, cos_half, sin_half, False, emu)
    L.rotary(q2, k2, pos, cos_full[:, :16], sin_full[:, :16], False, emu)
    assert torch.equal(q1, q2) and torch.equal(k1, k2)
    assert (q1 - rotary_ref(x, pos, cos_half, sin_half, False)).abs().max() < 1e-5


def test_rotary_position_outside_the_table_is_nan_not_a_wild_read(emu):
    cos, sin = rope_tables(8, 16)
    q, k = torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    L.rotary(q, k, torch.tensor([3, 8]), cos, sin, False, emu)
    assert not torch.isnan(q[0]).any() and torch.isnan(q[1]).all() and torch.isnan(k[1]).all()
