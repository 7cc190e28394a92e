"""The preference figures shared by training and eval, against numbers worked by hand."""

import math

import pytest
import torch

from astrai.model.scores import choice_figures, dpo_figures, reward_figures


def test_dpo_figures_by_hand():
    pi_c, pi_r = torch.tensor([-2.0, -5.0]), torch.tensor([-3.0, -4.0])
    ref_c, ref_r = torch.tensor([-2.5, -4.0]), torch.tensor([-2.5, -4.5])
    f = dpo_figures(pi_c, pi_r, ref_c, ref_r, beta=0.5)
    # r_chosen = 0.5 * [0.5, -1.0] = [0.25, -0.5]; r_rejected = 0.5 * [-0.5, 0.5] = [-0.25, 0.25]
    assert f["reward_chosen"] == pytest.approx(-0.25) and f["reward_rejected"] == pytest.approx(0.0)
    assert f["reward_accuracy"] == 1.0  # pair 1: 0.25 > -0.25; pair 2: -0.5 < 0.25
    assert f["reward_margin"] == pytest.approx(0.5 - 0.75)
    assert f["logp_chosen"] == -7.0 and f["logp_rejected"] == -7.0
    same = dpo_figures(pi_c, pi_r, pi_c, pi_r, 0.1)
    assert same["reward_accuracy"] == 0.0 and same["reward_margin"] == 0.0  # TRL counts > strictly


def test_choice_figures_skip_undecided_groups():
    lp = torch.log(torch.tensor([0.2, 0.8, 0.5, 0.5, 0.9, 0.1]))
    r = torch.tensor([1.0, 0.0, 0.3, 0.3, 0.0, 1.0])
    f = choice_figures(lp, r, [2, 2, 2])
    assert f["policy_reward"][0] == pytest.approx(0.2 + 0.3 + 0.1) and f["policy_reward"][1] == 3.0
    assert f["policy_accuracy"] == (0.0, 2.0)  # group 2 has equal rewards: no best answer to pick


def test_reward_figures_by_hand():
    f = reward_figures(torch.tensor([1.0, 0.0, 0.5, 0.5]), [2, 2])
    assert f["reward_mean"] == (2.0, 4.0)
    assert f["reward_std"][0] == pytest.approx(math.sqrt(0.5) + 0.0) and f["reward_std"][1] == 2.0
