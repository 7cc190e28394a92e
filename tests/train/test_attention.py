"""Packed rows with document isolation give exactly the loss and gradients of running each
document alone (loss within 1e-5, gradients within 1e-4), dense and MoE."""

import pytest
import torch

from astrai.model import CausalContext, CausalLM, ModelConfig
from astrai.schema import IGNORE_INDEX
from astrai.train.packed_attention import DocumentLoopContext, packed_context
from astrai.train.lm_loss import cross_entropy_sum, shift_targets


def _docs(vocab, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in lens:
        ids = torch.randint(0, vocab, (n,), generator=g)
        labels = ids.clone()
        labels[: n // 3] = IGNORE_INDEX  # a masked prompt
        docs.append((ids, labels))
    return docs


def _grads(model):
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_packed_equals_one_by_one(preset):
    torch.manual_seed(0)
    # use_cache left on, as a user might: our model has no cache path in training, so it changes nothing
    cfg = ModelConfig.preset(preset, extra={"use_cache": True})
    model = CausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)  # bigger than init: attention leaking across documents would change the loss visibly
    docs = _docs(cfg.vocab_size, [17, 5, 33, 1, 24])
    w = model.lm_head.weight

    # one by one: each document its own causal sequence, positions from 0
    total, n = 0.0, 0
    for ids, labels in docs:
        t = len(ids)
        h = model(ids, torch.arange(t), CausalContext())
        targets = torch.cat([labels[1:], torch.tensor([IGNORE_INDEX])])
        total = total + cross_entropy_sum(h, w, targets)
        n += int((targets != IGNORE_INDEX).sum())
    (total / n).backward()
    ref_loss, ref_grads = float((total / n).detach()), _grads(model)
    model.zero_grad()

    # packed: one flat row, position ids restarting per document, the loop context
    ids = torch.cat([d[0] for d in docs])
    labels = torch.cat([d[1] for d in docs])
    lens = torch.tensor([len(d[0]) for d in docs])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    pos = torch.cat([torch.arange(int(x)) for x in lens])
    ctx = packed_context(cu)
    assert isinstance(ctx, DocumentLoopContext)
    targets = shift_targets(labels, cu)
    assert int((targets != IGNORE_INDEX).sum()) == n
    loss = cross_entropy_sum(model(ids, pos, ctx), w, targets) / n
    loss.backward()
    assert abs(float(loss.detach()) - ref_loss) < 1e-5
    got = _grads(model)
    assert got.keys() == ref_grads.keys()
    for k in ref_grads:
        torch.testing.assert_close(got[k], ref_grads[k], atol=1e-4, rtol=0, msg=k)

    # and the isolation is real: one causal sequence over the same row gives a different loss
    leak = cross_entropy_sum(model(ids, pos, CausalContext()), w, targets) / n
    assert abs(float(leak) - ref_loss) > 1e-3


def test_shift_targets_never_crosses_documents():
    labels = torch.tensor([1, 2, 3, 4, 5, 6])
    cu = torch.tensor([0, 2, 6])
    assert shift_targets(labels, cu).tolist() == [2, IGNORE_INDEX, 4, 5, 6, IGNORE_INDEX]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_varlen_matches_loop_on_gpu(family):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", head_dim=64)
    if family == "gemma3_text":  # a sliding window shorter than the documents, and a softmax scale of its own
        cfg = cfg.replace(family=family, hidden_act="gelu_pytorch_tanh", sliding_window=16, query_pre_attn_scalar=100,
                          layer_types=("sliding_attention", "full_attention"))
    model = CausalLM(cfg).cuda().to(torch.bfloat16)
    lens = torch.tensor([70, 3, 129, 40])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    ids = torch.randint(0, cfg.vocab_size, (int(lens.sum()),), device="cuda")
    pos = torch.cat([torch.arange(int(x)) for x in lens]).cuda()
    with torch.no_grad():
        a = model(ids, pos, packed_context(cu, torch.device("cuda"), torch.bfloat16, backend="varlen")).float()
        b = model(ids, pos, packed_context(cu, backend="loop")).float()
    torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.preset("tiny"))
    ids = _docs(512, [9])[0][0]
    cu = torch.tensor([0, 4, 9])
    pos = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4])
    grads = []
    for flag in (False, True):
        model.gradient_checkpointing = flag
        model.zero_grad()
        h = model(ids, pos, packed_context(cu))
        cross_entropy_sum(h, model.lm_head.weight, shift_targets(ids, cu)).backward()
        grads.append(_grads(model))
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=1e-6, rtol=1e-5)
