"""GRPO's loss types against numbers computed by hand (astrai.train.grpo_loss's formulas).

The stub model of tests/train/test_strategies.py: hidden = one-hot of the token, so the logits after
token a are column a of W: p(.|0) = [1/8, 2/8, 5/8], p(.|1) = [3/5, 1/5, 1/5].
One group, prompt [0], completions [2] (reward 1) and [1, 0] (reward 0). The trained tokens are
p(2|0) in completion 1 and p(1|0), p(0|1) in completion 2; the old policy is set so that their
ratios are 1.5, 0.5 and 1.5.
"""

import math

import pytest
import torch

from astrai.train.grpo_loss import group_advantages
from astrai.train.strategies import Env, GRPOStrategy

LOG = math.log
ROWS = [{"prompt_input_ids": [0], "completion_input_ids": [[2], [1, 0]], "completion_labels": [[2], [1, 0]],
         "rewards": [1.0, 0.0]}]


class Stub(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = torch.nn.Linear(3, 3, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.tensor([[0.0, LOG(3), 0.0], [LOG(2), 0.0, 0.0], [LOG(5), 0.0, 0.0]]))

    def forward(self, ids, pos, ctx, return_aux=False):
        h = torch.nn.functional.one_hot(ids, 3).float()
        return (h, None) if return_aux else h


def run(loss_type, eps_low=None, eps_high=None, max_len=0):
    st = GRPOStrategy(None, clip_eps=0.2, kl_coef=0.0, loss_type=loss_type, clip_eps_low=eps_low,
                      clip_eps_high=eps_high, max_len=max_len)
    b = st.collate(ROWS)
    old = torch.zeros(5)  # positions: doc 1 = [0, 2] (0 trains p(2|0)), doc 2 = [0, 1, 0] (2: p(1|0), 3: p(0|1))
    old[0], old[2], old[3] = LOG(5 / 8) - LOG(1.5), LOG(2 / 8) - LOG(0.5), LOG(3 / 5) - LOG(1.5)
    b["old_logps"] = old
    s, _, m = st.loss(Stub(), b, Env())
    return st, b, float(s.detach()), m


A = 0.5 / (math.sqrt(0.5) + 1e-4)  # (r - mean) / (std + eps), std with Bessel's correction


def test_advantages_scaled_or_not():
    r = torch.tensor([1.0, 0.0, 0.5])
    std = math.sqrt((0.25 + 0.25 + 0) / 2)
    torch.testing.assert_close(group_advantages(r), torch.tensor([0.5, -0.5, 0.0]) / (std + 1e-4))
    torch.testing.assert_close(group_advantages(r, scale=False), torch.tensor([0.5, -0.5, 0.0]))
    assert group_advantages(torch.tensor([0.3, 0.3])).abs().max() == 0
    assert group_advantages(torch.tensor([0.3])).abs().max() == 0


# per token, eps 0.2: completion 1 (A = +a): ratio 1.5 -> -min(1.5a, 1.2a) = -1.2a (clipped: high)
# completion 2 (A = -a): ratio 0.5 -> -min(-0.5a, -0.8a) = 0.8a (clipped: low); ratio 1.5 -> -min(-1.5a, -1.2a) =
# 1.5a (not clipped: the gradient flows, so it is not counted)

def test_token_level():
    st, b, s, m = run("token")
    assert st.units(b) == 3
    assert s == pytest.approx((-1.2 + 0.8 + 1.5) * A, abs=1e-5)
    assert m["clip_low_fraction"] == 1 and m["clip_high_fraction"] == 1 and m["clip_fraction"] == 2


def test_grpo_per_sequence_mean_then_mean():
    st, b, s, m = run("grpo")
    assert st.units(b) == 2
    assert s == pytest.approx(-1.2 * A + (0.8 + 1.5) * A / 2, abs=1e-5)


def test_dr_grpo_unscaled_advantage_constant_normaliser():
    st, b, s, m = run("dr_grpo", max_len=4)
    torch.testing.assert_close(b["advantages"], torch.tensor([0.5, -0.5]))
    assert st.units(b) == 2 * 4  # G sequences x the rollout's max_tokens, whatever their lengths
    assert s == pytest.approx((-1.2 + 0.8 + 1.5) * 0.5, abs=1e-6)


def test_dapo_decoupled_clip():
    st, b, s, m = run("dapo", eps_low=0.2, eps_high=0.28)
    assert st.units(b) == 3
    # completion 1: -min(1.5a, 1.28a) = -1.28a; completion 2 as before
    assert s == pytest.approx((-1.28 + 0.8 + 1.5) * A, abs=1e-5)
    st, b, s, m = run("dapo", eps_low=0.2, eps_high=0.6)  # 1.5 < 1.6: the high side no longer clips
    assert s == pytest.approx((-1.5 + 0.8 + 1.5) * A, abs=1e-5)
    assert m["clip_high_fraction"] == 0 and m["clip_low_fraction"] == 1


def test_prepare_logs_clip_fractions_per_token_for_every_loss_type():
    for loss_type, units in (("token", 3), ("grpo", 2), ("dr_grpo", 8)):
        st = GRPOStrategy(None, clip_eps=0.2, kl_coef=0.0, loss_type=loss_type, max_len=4)
        b = st.collate(ROWS)
        st.prepare(Stub(), [b], [[0]], Env())
        b["old_logps"][0] -= LOG(1.5)  # ratio 1.5 on completion 1's token: clipped high
        s, _, m = st.loss(Stub(), b, Env())
        # the trainer divides metric sums by the step's units: the fraction is per completion token
        assert m["clip_high_fraction"] / units == pytest.approx(1 / 3)
