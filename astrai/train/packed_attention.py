"""Attention for packed batches: every document attends only to itself, and only the diagonal
blocks are computed (never a dense S x S mask).

A packed batch is one flat row of T tokens holding documents back to back, described by
cu_seqlens [N+1] (document i is tokens cu[i]:cu[i+1]). Two contexts implement the protocol of
astrai.model.attention behind one constructor, `packed_context(cu_seqlens, ...)`:

- `DocumentLoopContext` (the reference, and the CPU path): a loop over the documents, each a causal
  SDPA call with enable_gqa (its speed against padded batches: bench/train.py, bench/RESULTS.md).
  Document boundaries are read to Python once, in the constructor, so a torch.compile of the rest
  of the model does not recompile for every new document count. A sliding-window layer attends in
  query blocks of the window's length (astrai.model.attention.causal_sdpa): O(S x window) work.
- `VarlenContext` (CUDA, half precision): one `torch.nn.attention.varlen.varlen_attn` call (flash
  attention over cu_seqlens, causal via window (-1, 0), or (W - 1, 0) for a sliding window of W).
  Chosen automatically when it applies.

Cross-document targets are the loss's business: see astrai.train.lm_loss.shift_targets.
"""

from __future__ import annotations

import torch

from astrai.model.attention import AttentionContext, causal_sdpa


class DocumentLoopContext(AttentionContext):
    def __init__(self, cu_seqlens: torch.Tensor):
        self.bounds = [int(x) for x in cu_seqlens.tolist()]

    @torch.compiler.disable  # under torch.compile the loop stays eager: no recompile per document layout
    def attend(self, layer_idx, q, k, v, window=None, scale=None):
        b = self.bounds
        if len(b) == 2:
            return causal_sdpa(q, k, v, window, scale)
        # split, not q[s:e]: a slice's backward zero-fills a full [T, H, D] gradient per document
        lens = [e - s for s, e in zip(b[:-1], b[1:])]
        parts = zip(q.split(lens), k.split(lens), v.split(lens))
        return torch.cat([causal_sdpa(qd, kd, vd, window, scale) for qd, kd, vd in parts if qd.shape[0]])


class VarlenContext(AttentionContext):
    def __init__(self, cu_seqlens: torch.Tensor, max_seqlen: int):
        self.cu = cu_seqlens.to(torch.int32)
        self.max_seqlen = int(max_seqlen)

    def attend(self, layer_idx, q, k, v, window=None, scale=None):
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(q, k, v, self.cu, self.cu, self.max_seqlen, self.max_seqlen, scale=scale,
                           window_size=(-1 if window is None else window - 1, 0), enable_gqa=q.shape[1] != k.shape[1])


def varlen_available(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def packed_context(cu_seqlens: torch.Tensor, device: torch.device = torch.device("cpu"),
                   dtype: torch.dtype = torch.float32, backend: str = "auto") -> AttentionContext:
    """backend: auto (varlen when it applies, else the loop) | loop | varlen."""
    if backend not in ("auto", "loop", "varlen"):
        raise ValueError(f"attention backend {backend!r}: choose auto, loop or varlen")
    if backend == "varlen" or (backend == "auto" and varlen_available(device, dtype)):
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        return VarlenContext(cu_seqlens.to(device), int(lens.max()) if lens.numel() else 0)
    return DocumentLoopContext(cu_seqlens)
