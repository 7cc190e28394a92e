"""Sampling against transformers' logits processors; seeds independent of the batch; logprobs."""

import math

import pytest
import torch

from astrai.infer.request import Request, SamplingParams
from astrai.infer.sampling import apply_repetition_penalty, draw, make_generator, sample, warp


def req(tokens=(1, 2), **kw):
    params = SamplingParams(**kw)
    r = Request(0, list(tokens), params)
    r.generator = make_generator(params.seed)
    return r


def hf_warp(logits, input_ids, p: SamplingParams):
    from transformers.generation.logits_process import (
        MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
        TopPLogitsWarper)

    ids = torch.tensor([input_ids])
    x = logits[None].clone()
    if p.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, x)
    x = TemperatureLogitsWarper(p.temperature)(ids, x)
    if p.top_k:
        x = TopKLogitsWarper(p.top_k)(ids, x)
    if p.top_p < 1.0:
        x = TopPLogitsWarper(p.top_p)(ids, x)
    if p.min_p > 0:
        x = MinPLogitsWarper(p.min_p)(ids, x)
    return x[0]


@pytest.mark.parametrize("kw", [
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=5),
    dict(temperature=0.9, top_p=0.8),
    dict(temperature=1.0, top_k=20, top_p=0.6),
    dict(temperature=0.5, min_p=0.1),
    dict(temperature=1.0, top_k=30, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
])
def test_warpers_match_transformers(kw):
    torch.manual_seed(0)
    vocab = 64
    tokens = [3, 7, 7, 40, 63]
    rows = [req(tokens, **kw) for _ in range(3)]
    logits = torch.randn(3, vocab) * 3
    ours = warp(apply_repetition_penalty(logits.clone(), rows), rows)
    for b in range(3):
        ref = hf_warp(logits[b], tokens, rows[b].params)
        assert torch.equal(torch.isinf(ours[b]), torch.isinf(ref)), "a different set of tokens was kept"
        torch.testing.assert_close(ours[b].softmax(-1), ref.softmax(-1), atol=1e-6, rtol=1e-5)


def test_repetition_penalty_by_hand():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    out = apply_repetition_penalty(logits.clone(), [req((0, 1, 1), repetition_penalty=2.0)])
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]


def test_greedy_is_argmax_and_topk1_is_greedy():
    logits = torch.randn(4, 50)
    reqs = [req(temperature=0.0), req(top_k=1, seed=3), req(temperature=0.0), req(top_k=1)]
    tokens, _ = sample(logits, reqs)
    assert tokens == logits.argmax(-1).tolist()


def test_draw_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.log()[None].repeat(4000, 1)
    reqs = [req(temperature=1.0) for _ in range(4000)]
    torch.manual_seed(1)
    tokens, _ = sample(logits, reqs)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / 4000
    assert freq[3] == 0
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)


@pytest.mark.parametrize("u", [0.0, 1.0 - 2 ** -24])  # the ends of what torch.rand returns
def test_extreme_uniforms_never_pick_a_dropped_token(monkeypatch, u):
    """Whatever the generator returns, a token of probability 0 (dropped by a warper, or -inf) is never drawn,
    at either end of the vocabulary or between kept ones."""
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: real_rand(*a, **k).fill_(u))
    probs = torch.tensor([[0.0, 0.0, 0.7, 0.0, 0.3, 0.0]] * 2)
    reqs = [req(temperature=1.0), req(temperature=1.0, seed=1)]
    assert draw(probs, reqs).tolist() == [[2, 2], [4, 4]][u > 0.5]
    logits = torch.tensor([[float("-inf"), 2.0, float("-inf"), 1.0, float("-inf")]] * 3)
    reqs = [req(temperature=1.0), req(temperature=0.8, seed=1), req(temperature=1.0, top_p=0.5)]
    tokens, _ = sample(logits, reqs)
    assert tokens == [[1, 1, 1], [3, 3, 1]][u > 0.5]  # top_p=0.5 keeps token 1 only


def test_seed_gives_same_tokens_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)

    def run(order, batch_rows):
        reqs = {i: req(temperature=1.0, top_p=0.9, seed=100 + i) for i in order}
        seqs = {i: [] for i in order}
        for _ in range(8):
            rows = [i for i in order if i in batch_rows]
            toks, _ = sample(logits[rows], [reqs[i] for i in rows])
            for i, t in zip(rows, toks):
                seqs[i].append(t)
        return seqs

    alone = run([2], {2})
    crowded = run([5, 0, 2, 4], {5, 0, 2, 4})
    assert alone[2] == crowded[2]
    assert len(set(map(tuple, crowded.values()))) > 1  # different seeds, different draws


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    r = req((2,), temperature=0.0, logprobs=2, repetition_penalty=5.0)  # the penalty moves the argmax to 1
    tokens, lps = sample(logits, [r])
    lse = math.log(sum(math.exp(x) for x in [1.0, 2.0, 3.0, 0.0]))
    assert tokens == [1]
    assert lps[0].logprob == pytest.approx(logits[0, tokens[0]].item() - lse, abs=1e-6)
    assert [i for i, _ in lps[0].top] == [2, 1]
    assert lps[0].top[0][1] == pytest.approx(3.0 - lse, abs=1e-6)
    assert sample(logits, [req(temperature=0.0)])[1] == [None]


def test_params_are_validated():
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(stop=[""])
    with pytest.raises(ValueError):
        SamplingParams(max_token=3)  # misspelled: refused, not ignored


@pytest.mark.parametrize("shape", [(16, 129282), (3, 4096), (2, 2305), (5, 100)])
def test_first_argmax_is_argmax_with_ties(shape):
    from astrai.infer.sampling import first_argmax

    g = torch.Generator().manual_seed(shape[1])
    x = torch.randn(*shape, generator=g)
    top = x.max()
    x[0, 7], x[0, shape[1] - 1] = top + 1, top + 1  # tie in the first and the (short) tail block
    x[-1, shape[1] - 1] = top + 2  # a maximum in the last position only
    x[1 % shape[0], :] = 0.5  # a row that is all ties
    torch.testing.assert_close(first_argmax(x), torch.argmax(x, -1))
    assert int(first_argmax(x)[0]) == 7
