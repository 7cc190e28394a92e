"""The three LM-head loss modes give the same loss and gradients as a plain cross-entropy over full
logits (torch's F.cross_entropy, label smoothing included), and token log-probs match log_softmax."""

import pytest
import torch
import torch.nn.functional as F

from astrai.schema import IGNORE_INDEX
from astrai.train.lm_loss import cross_entropy_sum, token_logprobs


def _setup(seed=0, t=50, h=16, v=37):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (t,), generator=g)
    targets[::4] = IGNORE_INDEX
    return hidden, weight, targets


@pytest.mark.parametrize("mode", ["full", "chunked", "fused"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_modes_equal_plain_cross_entropy(mode, smoothing):
    hidden, weight, targets = _setup()
    ref = F.cross_entropy(hidden @ weight.t(), targets, ignore_index=IGNORE_INDEX, reduction="sum",
                          label_smoothing=smoothing)
    gh, gw = torch.autograd.grad(ref * 0.7, (hidden, weight))
    got = cross_entropy_sum(hidden, weight, targets, mode=mode, chunk=8, smoothing=smoothing)
    h2, w2 = torch.autograd.grad(got * 0.7, (hidden, weight))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(h2, gh, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w2, gw, atol=1e-5, rtol=1e-4)


def test_cross_entropy_by_hand():
    # one position, vocab 3, logits [0, ln 2, ln 5] via weight rows: p(target=1) = 2 / 8
    hidden = torch.tensor([[1.0]])
    weight = torch.tensor([[0.0], [torch.log(torch.tensor(2.0))], [torch.log(torch.tensor(5.0))]])
    loss = cross_entropy_sum(hidden, weight, torch.tensor([1]))
    assert abs(float(loss) - (-torch.log(torch.tensor(0.25)).item())) < 1e-6
    # label smoothing 0.3: 0.7 * -log(2/8) + 0.3 * mean(-log(1/8), -log(2/8), -log(5/8))
    smooth = cross_entropy_sum(hidden, weight, torch.tensor([1]), smoothing=0.3)
    import math
    by_hand = 0.7 * -math.log(0.25) + 0.3 * (-math.log(1 / 8) - math.log(2 / 8) - math.log(5 / 8)) / 3
    assert abs(float(smooth) - by_hand) < 1e-6


@pytest.mark.parametrize("mode", ["full", "chunked"])
def test_token_logprobs(mode):
    hidden, weight, targets = _setup(1)
    lp = token_logprobs(hidden, weight, targets, mode=mode, chunk=8)
    full = torch.log_softmax(hidden @ weight.t(), -1)
    keep = targets != IGNORE_INDEX
    torch.testing.assert_close(lp[keep], full[keep].gather(1, targets[keep, None])[:, 0], atol=1e-5, rtol=0)
    assert (lp[~keep] == 0).all()
    g1 = torch.autograd.grad((lp * torch.arange(len(lp))).sum(), hidden)[0]
    ref = (full[keep].gather(1, targets[keep, None])[:, 0] * torch.arange(len(lp))[keep]).sum()
    torch.testing.assert_close(g1, torch.autograd.grad(ref, hidden)[0], atol=1e-5, rtol=1e-4)


def test_fused_bfloat16_follows_full():
    """Half-precision hidden states and head: the fused loss and its gradients stay within bf16
    rounding of the full-logits loss computed the same way."""
    hidden, weight, targets = _setup(2, t=40, h=32, v=53)
    h16 = hidden.detach().bfloat16().requires_grad_()
    w16 = weight.detach().bfloat16().requires_grad_()
    ref = cross_entropy_sum(hidden, weight, targets, mode="full")
    gh, gw = torch.autograd.grad(ref, (hidden, weight))
    got = cross_entropy_sum(h16, w16, targets, mode="fused", chunk=16)
    h2, w2 = torch.autograd.grad(got, (h16, w16))
    assert got.dtype == torch.float32 and h2.dtype == w2.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=0.5)
    torch.testing.assert_close(h2.float(), gh, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(w2.float(), gw, rtol=5e-2, atol=5e-2)


class _Shapes(torch.overrides.TorchFunctionMode):
    """Records the shape of every new tensor a torch call returns (not the inputs themselves, nor
    views of them), and counts the matrix products."""

    def __init__(self):
        super().__init__()
        self.shapes, self.matmuls = [], 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        self.matmuls += name in ("mm", "matmul", "__matmul__", "addmm", "addmm_")
        inputs = {a.untyped_storage().data_ptr() for a in (*args, *(kwargs or {}).values()) if torch.is_tensor(a)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in inputs:
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("mode", ["auto", "chunked", "fused"])
def test_no_grad_runs_forward_only(mode):
    """Validation runs under no_grad with a head that requires grad: the loss equals the full-logits
    loss, one product per chunk is computed (no gradient matmuls) and no [vocab, hidden] gradient
    buffer or [positions, hidden] gradient is allocated."""
    hidden, weight, targets = _setup(3, t=50, h=16, v=41)
    n = int((targets != IGNORE_INDEX).sum())
    ref = cross_entropy_sum(hidden.detach(), weight.detach(), targets, mode="full", smoothing=0.1)
    with torch.no_grad(), _Shapes() as seen:
        got = cross_entropy_sum(hidden, weight, targets, mode=mode, chunk=8, smoothing=0.1)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)
    assert not got.requires_grad
    assert seen.matmuls == -(-n // 8)
    assert tuple(weight.shape) not in seen.shapes and (n, 16) not in seen.shapes[2:]  # [1]: hidden[keep]
    with torch.no_grad(), _Shapes() as seen:
        lp = token_logprobs(hidden, weight, targets, mode="chunked" if mode == "auto" else mode, chunk=8)
    assert seen.matmuls == -(-n // 8) and tuple(weight.shape) not in seen.shapes
    torch.testing.assert_close(lp, token_logprobs(hidden.detach(), weight.detach(), targets), atol=1e-5, rtol=0)


def test_with_grad_the_fused_mode_still_folds_gradients_in_the_forward():
    """The contrast that makes the no_grad test meaningful: with grad on, fused allocates the head's
    gradient buffer and computes two extra products per chunk."""
    hidden, weight, targets = _setup(3, t=50, h=16, v=41)
    n = int((targets != IGNORE_INDEX).sum())
    with _Shapes() as seen:
        cross_entropy_sum(hidden, weight, targets, mode="fused", chunk=8)
    assert tuple(weight.shape) in seen.shapes and seen.matmuls == 3 * -(-n // 8)


@pytest.mark.parametrize("mode", ["full", "chunked", "fused"])
def test_final_logit_softcapping_in_every_mode(mode):
    # Gemma's final_logit_softcapping: the loss sees cap * tanh(z / cap); the reference is autograd through it
    hidden, weight, targets = _setup(2)
    cap = 3.0
    z = hidden @ weight.t()
    assert z.abs().max() > 2 * cap  # the cap bends these logits
    ref = F.cross_entropy(torch.tanh(z / cap) * cap, targets, ignore_index=IGNORE_INDEX, reduction="sum",
                          label_smoothing=0.1)
    gh, gw = torch.autograd.grad(ref, (hidden, weight))
    got = cross_entropy_sum(hidden, weight, targets, mode=mode, chunk=8, smoothing=0.1, softcap=cap)
    h2, w2 = torch.autograd.grad(got, (hidden, weight))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(h2, gh, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w2, gw, atol=1e-5, rtol=1e-4)
    lp = token_logprobs(hidden, weight, targets, mode="chunked" if mode != "full" else "full", chunk=8, softcap=cap)
    keep = targets != IGNORE_INDEX
    full = torch.log_softmax(torch.tanh(z / cap) * cap, -1)
    torch.testing.assert_close(lp[keep], full[keep].gather(1, targets[keep, None])[:, 0], atol=1e-5, rtol=0)
