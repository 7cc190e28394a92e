"""Next-token selection for a batch of requests, each with its own SamplingParams.

Order (that of transformers' generate, so its warpers are the reference in the tests):
repetition penalty (prompt + output tokens; a positive logit is divided by the penalty, a negative
one multiplied) -> greedy rows take the argmax -> temperature -> top-k -> top-p (keep the smallest
most-likely set whose probability reaches top_p) -> min-p (drop tokens under min_p x the top
probability) -> draw.

Every step is a few operations on the whole [B, vocab] block, whatever the mix of requests: the
penalty is one gather and one scatter over all penalised (row, token) pairs, the warpers take
per-row parameter vectors, and the draw is by inverse CDF: one uniform u per row, and the token
is the first whose cumulative probability exceeds u x the row's total (a token of probability 0
has an empty interval and is never drawn). A seeded request draws its u from its own
torch.Generator, exactly one number per sampled token, so its output depends on its seed alone
and never on which other requests share the batch (or on a preemption in between); unseeded rows
draw theirs from the process RNG in one call. The cumulative sums are float32: a token's
probability is kept to about 1e-7 of the row's total.

Rows whose request has a grammar (astrai.infer.grammar: structured output, forced tool calls) get
the grammar's mask first, after the penalty and before greedy or warping: a token the grammar cannot
take next is -inf. Only those rows are masked (the whole block in one op when every row is
constrained); the other rows' logits are left as they are, so their tokens are the same with or
without a constrained neighbour, and a step with no constrained row does no grammar work at all.

Logprobs (when asked) are of the model's own distribution, log_softmax of the raw logits, before
penalty, grammar mask and warping, like vLLM's default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from astrai.infer.request import Request


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the `logprobs` most likely (id, logprob), best first


def apply_repetition_penalty(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """In place on the rows whose request has a penalty: every token of its prompt or output (once,
    however often it occurs) has a positive logit divided by the penalty, a negative one multiplied."""
    rows, cols, pens = [], [], []
    for b, req in enumerate(reqs):
        penalty = req.params.repetition_penalty
        if penalty != 1.0:
            rows += [b] * len(req.tokens)
            cols += req.tokens
            pens += [penalty] * len(req.tokens)
    if not rows:
        return logits
    dev = logits.device
    rows_t, cols_t = torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)
    pen = torch.tensor(pens, device=dev, dtype=logits.dtype)
    seen = logits[rows_t, cols_t]  # read all before writing: a token seen twice is penalised once
    logits[rows_t, cols_t] = torch.where(seen < 0, seen * pen, seen / pen)
    return logits


def warp(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on rows that sample; returns logits with dropped tokens at -inf."""
    dev = logits.device
    temp = torch.tensor([r.params.temperature for r in reqs], device=dev, dtype=logits.dtype)
    logits = logits / temp[:, None]
    vocab = logits.shape[-1]
    top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in reqs]
    top_p = [r.params.top_p for r in reqs]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=dev)
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= torch.tensor(top_k, device=dev)[:, None],
                                                  float("-inf"))
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs  # the most likely token always stays (mass before it is 0)
        drop = mass_before >= torch.tensor(top_p, device=dev, dtype=probs.dtype)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    min_p = torch.tensor([r.params.min_p for r in reqs], device=dev, dtype=logits.dtype)
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        drop = probs < min_p[:, None] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def apply_grammar(logits: torch.Tensor, reqs: list[Request], rows: list[int]) -> torch.Tensor:
    """`logits` with the tokens the grammar of each of `rows` (requests with a matcher) cannot take next at
    -inf: a new tensor; `logits` itself is left as it was."""
    allowed = np.empty((len(rows), logits.shape[-1]), dtype=bool)
    for i, b in enumerate(rows):
        reqs[b].matcher.fill(allowed[i], reqs[b].stop_ids)
    mask = torch.from_numpy(allowed).to(logits.device)
    if len(rows) == logits.shape[0]:  # every row constrained: one op, no gather or scatter
        return logits.masked_fill(~mask, float("-inf"))
    index = torch.tensor(rows, device=logits.device)
    out = logits.clone()
    out[index] = logits[index].masked_fill(~mask, float("-inf"))
    return out


def uniforms(reqs: list[Request], device) -> torch.Tensor:
    """One U[0, 1) per request: from its own generator when seeded, else from the process RNG."""
    u = torch.rand(len(reqs), device=device)
    for b, req in enumerate(reqs):
        if req.generator is not None:
            u[b] = torch.rand((), generator=req.generator, device=device)
    return u


def draw(probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """probs [B, V] (rows need not sum to exactly 1) -> one token per row, token i with probability p_i."""
    cdf = probs.cumsum(-1)
    x = uniforms(reqs, probs.device)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, x, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


def first_argmax(x: torch.Tensor, block: int = 256) -> torch.Tensor:
    """x [B, V] -> index of the first maximum of each row (argmax's answer). On CPU, max with indices
    over a 129k vocabulary runs at about a third of the speed of amax: take the per-block amax, find
    the first block holding the row maximum, and search only that block (bench/RESULTS.md has the
    timings); a decode step pays this once."""
    r, n = x.shape
    nb = n // block
    if nb < 8:
        return x.max(-1).indices
    head = x[:, :nb * block].view(r, nb, block).amax(-1)
    if nb * block < n:
        head = torch.cat([head, x[:, nb * block:].amax(-1, keepdim=True)], 1)
    start = head.max(-1).indices * block  # the first block whose maximum is the row's
    idx = start[:, None] + torch.arange(block, device=x.device)
    seg = x.gather(1, idx.clamp(max=n - 1))
    seg = torch.where(idx < n, seg, float("-inf"))  # the tail block can be short
    return start + seg.max(-1).indices


def sample(logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[Optional[TokenLogprob]]]:
    """logits [B, V] (float32) for reqs -> one token id per request, plus logprobs where asked."""
    logits = logits.float()
    raw = logits
    if any(r.params.repetition_penalty != 1.0 for r in reqs):
        logits = apply_repetition_penalty(logits.clone(), reqs)
    constrained = [b for b, r in enumerate(reqs) if r.matcher is not None]
    if constrained:
        logits = apply_grammar(logits, reqs, constrained)
    tokens = first_argmax(logits)
    rows = [b for b, r in enumerate(reqs) if not r.params.greedy]
    if rows:
        sub = [reqs[b] for b in rows]
        probs = warp(logits[rows], sub).softmax(-1)
        tokens[rows] = draw(probs, sub)
    out_tokens = tokens.tolist()
    return out_tokens, _logprobs(raw, reqs, out_tokens)


def _logprobs(raw: torch.Tensor, reqs: list[Request], tokens: list[int]) -> list[Optional[TokenLogprob]]:
    want = [b for b, r in enumerate(reqs) if r.params.logprobs is not None]
    out: list[Optional[TokenLogprob]] = [None] * len(reqs)
    if not want:
        return out
    lp = raw[want].log_softmax(-1)
    for i, b in enumerate(want):
        n = reqs[b].params.logprobs
        top = []
        if n:
            vals, ids = lp[i].topk(n)
            top = list(zip(ids.tolist(), vals.tolist()))
        out[b] = TokenLogprob(tokens[b], float(lp[i, tokens[b]]), top)
    return out


def make_generator(seed: Optional[int], device="cpu") -> Optional[torch.Generator]:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g
