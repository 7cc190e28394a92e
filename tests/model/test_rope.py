"""Rotary embeddings: the custom backward of apply_rotary equals autograd through the plain formula."""

import torch

from astrai.model.rope import apply_rotary, rotate_half


def test_rotary_backward_equals_autograd_of_the_formula():
    torch.manual_seed(0)
    t, d = 7, 8
    q = torch.randn(t, 3, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(t, 1, d, dtype=torch.float64, requires_grad=True)
    angles = torch.rand(t, d // 2, dtype=torch.float64) * 6
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    gq, gk = torch.randn(t, 3, d, dtype=torch.float64), torch.randn(t, 1, d, dtype=torch.float64)
    rq, rk = apply_rotary(q, k, cos, sin)
    got = torch.autograd.grad((rq * gq).sum() + (rk * gk).sum(), (q, k))
    c, s = cos[:, None, :], sin[:, None, :]
    ref_q, ref_k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s  # autograd through the slices
    want = torch.autograd.grad((ref_q * gq).sum() + (ref_k * gk).sum(), (q, k))
    assert torch.equal(rq, ref_q) and torch.equal(rk, ref_k)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-14, rtol=0)
    assert torch.autograd.gradcheck(lambda x: apply_rotary(x, k.detach(), cos, sin)[0], (q,))
