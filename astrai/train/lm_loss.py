"""The LM head and its loss without holding the whole [tokens, vocab] logits.

At a 32k vocabulary the head plus cross-entropy is the largest cost of a small model's step, and
its float32 logits the largest tensors; at 129k it dominates. Three ways to compute the same
numbers, picked by `mode`:

- "full": logits for every trained position at once (fastest when they fit).
- "chunked": per chunk of positions, the logits are computed, reduced and dropped; backward
  recomputes them (torch.utils.checkpoint), so peak memory holds one chunk's logits.
- "fused" (cross-entropy only): per chunk, the forward also computes the gradient of the loss
  with respect to the chunk's logits (softmax - target) and folds it straight into the gradients
  of the hidden states and of the head weight; backward only scales them. No recomputation.

"auto" (the default): full up to `chunk` positions (1024 by default), fused beyond (cross-entropy);
log-probs (DPO, GRPO) full up to 4 chunks, chunked beyond. Fused computes each chunk's logits once
and holds one chunk's at a time, so past one chunk it is both the fastest mode and the smallest
(`python bench/train.py --loss-modes`: time and peak memory of each mode in bench/RESULTS.md).

Only positions with a target are sent through the head at all (an SFT batch with 30% trained
tokens pays 30% of the head), in every mode.

Without a gradient to compute (under torch.no_grad(), as validation runs, or when neither the hidden
states nor the head require one), the chunked and fused modes run forward only: per chunk the
logits are reduced and dropped; no gradient buffer ([chunk, hidden] per chunk, a float32 [vocab,
hidden] for the head) is allocated and no gradient matmul is paid.

Final logit soft-capping (Gemma's final_logit_softcapping, `softcap`): the loss is taken on
cap * tanh(z / cap) in every mode; the fused mode multiplies the logits' gradient by 1 - tanh^2.

Mixed precision (bf16-mixed training, astrai.train.precision): under torch.autocast every mode's
head products are bf16 (the fused mode casts its operands itself: autocast does not reach into its
custom function) and the logits are widened to float32 before soft-capping and the loss.

Targets: `shift_targets(labels, cu_seqlens)` turns unshifted labels (HF convention) of a packed
row into next-token targets; the last token of each document gets IGNORE_INDEX, so a document's
last token is never trained to predict the next document's first token.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from astrai.config.train import LOSS_CHUNK
from astrai.model.casts import autocast_dtype, frozen_cast
from astrai.model.transformer import acc_dtype, at_least_float32
from astrai.schema import IGNORE_INDEX

MODES = ("auto", "full", "chunked", "fused")


def shift_targets(labels: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """targets[t] = labels[t + 1] inside a document; IGNORE_INDEX at each document's last token."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:-1] = labels[1:]
    ends = cu_seqlens[1:].to(labels.device).long() - 1
    targets[ends[ends >= 0]] = IGNORE_INDEX
    return targets


def _ce_rows(z: torch.Tensor, y: torch.Tensor, smoothing: float) -> torch.Tensor:
    # as torch.nn.functional.cross_entropy(label_smoothing=e): (1-e)*nll + e*mean_v(-log p_v)
    return F.cross_entropy(at_least_float32(z), y, reduction="none", label_smoothing=smoothing)


def _head(h: torch.Tensor, weight: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    # float32 from here on: under autocast the product is bf16, the soft-capping and the loss are not
    z = at_least_float32(h @ _frozen_in_autocast(weight, h.device.type).t())
    return z if softcap is None else torch.tanh(z / softcap) * softcap


def _frozen_in_autocast(weight: torch.Tensor, device: str) -> torch.Tensor:
    """A frozen head weight (LoRA's tied embedding) in autocast's dtype, cast once (astrai.model.casts), while
    autocast is on; else the weight (autocast casts it, caching weights that train itself)."""
    dtype = autocast_dtype(device)
    return weight if weight.requires_grad or dtype is None else frozen_cast(weight, dtype)


def _autocast_operands(h: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused loss's operands in autocast's dtype when autocast is on (bf16-mixed training):
    autocast does not reach inside a custom autograd function (its products write into preallocated
    buffers), so they are cast here, as autocast casts a plain head's, and the function runs its
    half-precision path (bf16 products, float32 softmax, loss and weight-gradient accumulation)."""
    dtype = autocast_dtype(h.device.type)
    if dtype is None:
        return h, weight
    return h.to(dtype), _frozen_in_autocast(weight, h.device.type).to(dtype)


def cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, mode: str = "full",
                      chunk: int = LOSS_CHUNK, smoothing: float = 0.0, softcap: Optional[float] = None) -> torch.Tensor:
    """Sum over positions with a target of the next-token cross-entropy (float32 scalar)."""
    keep = targets != IGNORE_INDEX
    h, y = hidden[keep], targets[keep]
    if h.shape[0] == 0:
        return hidden.sum() * 0.0  # keeps the graph (and DDP's gradient hooks) connected
    if mode == "full" or (mode == "auto" and h.shape[0] <= chunk):
        return _ce_rows(_head(h, weight, softcap), y, smoothing).sum()
    if mode in MODES and not _needs_grad(h, weight):
        return sum(_chunk_ce(h[s:s + chunk], weight, y[s:s + chunk], smoothing, softcap)
                   for s in range(0, h.shape[0], chunk))
    if mode in ("fused", "auto"):  # auto past one chunk: fused, no recompute and one chunk's logits
        return _FusedLinearCrossEntropy.apply(*_autocast_operands(h, weight), y, chunk, smoothing, softcap)
    if mode == "chunked":
        parts = [checkpoint(_chunk_ce, h[s:s + chunk], weight, y[s:s + chunk], smoothing, softcap,
                            use_reentrant=False) for s in range(0, h.shape[0], chunk)]
        return torch.stack(parts).sum()
    raise ValueError(f"lm_loss mode {mode!r}: choose one of {', '.join(MODES)}")


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _chunk_ce(h, weight, y, smoothing, softcap=None):
    return _ce_rows(_head(h, weight, softcap), y, smoothing).sum()


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, mode: str = "full",
                   chunk: int = LOSS_CHUNK, softcap: Optional[float] = None, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) per position [T] in float32; 0 where there is no target. `temperature`: the
    log-softmax of logits / temperature (after soft-capping), the distribution a sampler at that
    temperature draws from."""
    keep = targets != IGNORE_INDEX
    out = torch.zeros(targets.shape, dtype=acc_dtype(hidden.dtype), device=hidden.device)
    h, y = hidden[keep], targets[keep]
    if h.shape[0] == 0:
        return out + hidden.sum() * 0.0
    # no fused form for log-probs: auto keeps them whole up to 4 chunks (the recompute costs ~1/3 more)
    if mode in ("chunked", "fused") or (mode == "auto" and h.shape[0] > 4 * chunk):
        # recomputation is only worth its cost when a backward will need the chunk's logits
        run = (lambda *a: checkpoint(_chunk_logp, *a, use_reentrant=False)) if _needs_grad(h, weight) else _chunk_logp
        lp = torch.cat([run(h[s:s + chunk], weight, y[s:s + chunk], softcap, temperature)
                        for s in range(0, h.shape[0], chunk)])
    else:
        lp = _chunk_logp(h, weight, y, softcap, temperature)
    return out.masked_scatter(keep, lp)


def _chunk_logp(h, weight, y, softcap=None, temperature=1.0):
    z = at_least_float32(_head(h, weight, softcap))
    if temperature != 1.0:
        z = z / temperature
    return z.gather(1, y[:, None])[:, 0] - torch.logsumexp(z, dim=-1)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """sum_t CE(h_t W^T, y_t) with d/dh and d/dW computed chunk by chunk in the forward.

    Per chunk, one float32 [chunk, vocab] buffer (reused by every chunk) goes logits -> exp -> softmax
    -> gradient in place: no log-softmax copy, no softmax copy, no fresh allocation per chunk (on CPU
    every fresh buffer this size is new pages the kernel faults in and zeroes). With z the logits, m = max z, s = sum exp(z - m), lse = m + log s:
    CE = (1-e) (lse - z_y) + e (lse - mean_v z_v), dCE/dz = softmax(z) - (1-e) onehot(y) - e/V.
    """

    @staticmethod
    def forward(ctx, h, weight, y, chunk, smoothing, softcap=None):
        vocab = weight.shape[0]
        grad_h = torch.empty_like(h)
        acc = acc_dtype(h.dtype)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if weight.requires_grad else None
        total = torch.zeros((), dtype=acc, device=h.device)
        buf = torch.empty((min(chunk, h.shape[0]), vocab), dtype=acc, device=h.device)
        slope_buf = torch.empty_like(buf) if softcap is not None else None
        for s in range(0, h.shape[0], chunk):
            hc, yc = h[s:s + chunk], y[s:s + chunk]
            rows = torch.arange(len(yc), device=h.device)
            z = buf[:len(yc)]
            if h.dtype == acc and weight.dtype == acc:
                torch.mm(hc, weight.t(), out=z)
            else:
                z.copy_(hc @ weight.t())
            if softcap is not None:  # z <- cap * tanh(z / cap); the chain rule's factor is 1 - tanh^2
                z.div_(softcap).tanh_()
                slope = torch.mul(z, z, out=slope_buf[:len(yc)]).neg_().add_(1.0)
                z.mul_(softcap)
            m = z.amax(dim=-1, keepdim=True)
            picked = z[rows, yc]
            mean_z = z.mean(dim=-1) if smoothing else None
            z.sub_(m).exp_()
            ssum = z.sum(dim=-1, keepdim=True)
            lse = (m + ssum.log())[:, 0]
            ce = lse - picked
            if smoothing:
                ce = (1.0 - smoothing) * ce + smoothing * (lse - mean_z)
            total += ce.sum()
            g = z.div_(ssum)  # softmax
            g[rows, yc] -= 1.0 - smoothing
            if smoothing:
                g.sub_(smoothing / vocab)
            if softcap is not None:
                g.mul_(slope)
            g = g.to(h.dtype)  # no copy in float32
            torch.mm(g, weight.to(g.dtype), out=grad_h[s:s + chunk])
            if grad_w is not None:
                grad_w.addmm_(g.t().to(acc), hc.to(acc))
        ctx.save_for_backward(grad_h, grad_w if grad_w is not None else torch.empty(0))
        ctx.has_w = grad_w is not None
        ctx.w_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        gw = (grad_w * grad_out).to(ctx.w_dtype) if ctx.has_w else None
        return grad_h * grad_out.to(grad_h.dtype), gw, None, None, None, None
