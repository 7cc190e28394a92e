"""Loss formulas against numbers computed by hand, on a stub model whose log-probs are known.

The stub: hidden = one-hot of the token, so the logits after token a are column a of W; the
columns below give p(.|0) = [1/8, 2/8, 5/8], p(.|1) = [3/5, 1/5, 1/5], p(.|2) = uniform.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from astrai.schema import IGNORE_INDEX
from astrai.train.batches import group_advantages
from astrai.train.strategies import DPOStrategy, Env, LMStrategy

I = IGNORE_INDEX
LOG = math.log


class Stub(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.lm_head = torch.nn.Linear(3, 3, bias=False)
        self.config = SimpleNamespace(final_logit_softcapping=None)  # what the losses read of a model's config
        with torch.no_grad():
            self.lm_head.weight.copy_(w)

    def forward(self, ids, pos, ctx, return_aux=False):
        h = torch.nn.functional.one_hot(ids, 3).float()
        return (h, None) if return_aux else h


def policy():
    w = torch.tensor([[0.0, LOG(3), 0.0], [LOG(2), 0.0, 0.0], [LOG(5), 0.0, 0.0]])  # W[b, a] = logit of b after a
    return Stub(w)


def uniform():
    return Stub(torch.zeros(3, 3))


def test_seq_and_sft_by_hand():
    rows = [{"input_ids": torch.tensor([0, 2, 1, 0]), "labels": torch.tensor([I, I, 1, 0]),
             "position_ids": torch.arange(4), "seq_lens": torch.tensor([3, 1])}]
    env = Env()
    seq = LMStrategy("seq")
    b = seq.collate(rows)
    s, aux, _ = seq.loss(policy(), b, env)
    # doc [0, 2, 1]: -log p(2|0) - log p(1|2); doc [0] has no next token inside its document
    assert seq.units(b) == 2 and aux is None
    assert abs(float(s.detach()) - (-LOG(5 / 8) - LOG(1 / 3))) < 1e-6
    sft = LMStrategy("sft")
    b = sft.collate(rows)
    s, _, _ = sft.loss(policy(), b, env)
    assert sft.units(b) == 1 and abs(float(s.detach()) - (-LOG(1 / 3))) < 1e-6  # only label 1 at position 2 is trained


def test_dpo_by_hand():
    rows = [{"chosen_input_ids": [0, 2, 1], "chosen_labels": [I, 2, 1],
             "rejected_input_ids": [0, 1, 0], "rejected_labels": [I, 1, 0]}]
    st = DPOStrategy(uniform(), beta=0.5)
    b = st.collate(rows)
    st.prepare(policy(), [b], [[7]], Env())
    assert st.cache[7] == pytest.approx((2 * LOG(1 / 3), 2 * LOG(1 / 3)), abs=1e-6)
    s, _, m = st.loss(policy(), b, Env())
    pc, pr = LOG(5 / 8) + LOG(1 / 3), LOG(2 / 8) + LOG(3 / 5)
    rc = rr = 2 * LOG(1 / 3)
    z = 0.5 * ((pc - rc) - (pr - rr))
    assert st.units(b) == 1
    assert abs(float(s.detach()) - (-LOG(1 / (1 + math.exp(-z))))) < 1e-6
    assert m["reward_accuracy"] == 1.0 and abs(m["reward_margin"] - z) < 1e-6
    # TRL's figures: r = beta * (policy - reference) per side, the policy's summed log-probs
    assert m["reward_chosen"] == pytest.approx(0.5 * (pc - rc)) and m["reward_rejected"] == pytest.approx(0.5 * (pr - rr))
    assert m["logp_chosen"] == pytest.approx(pc) and m["logp_rejected"] == pytest.approx(pr)


def test_group_advantages_by_hand():
    a = group_advantages(torch.tensor([1.0, 0.0, 0.5]))
    std = math.sqrt(((0.5) ** 2 + 0.5 ** 2 + 0) / 2)  # Bessel: divide by n - 1
    torch.testing.assert_close(a, torch.tensor([0.5, -0.5, 0.0]) / (std + 1e-4))
    assert group_advantages(torch.tensor([0.3, 0.3])).abs().max() == 0
