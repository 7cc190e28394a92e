"""What a model's sequence log-probs say about preference data: the figures training logs and the
eval stage reports, computed in one place (train and infer both import them).

Inputs are summed log-probs of the trained tokens of whole answers (one number per sequence).

DPO, as TRL defines its rewards/* metrics: with r = beta * (policy - reference) per answer,
  reward_chosen, reward_rejected   the r of each side
  reward_accuracy                  1 where r_chosen > r_rejected (strictly: 0 at the start, where all are 0)
  reward_margin                    r_chosen - r_rejected
  logp_chosen, logp_rejected       the policy's summed log-probs
returned as sums over the pairs (the caller divides by their number).

Scored groups (GRPO data: a prompt with G candidate answers and their rewards), as (sum, count):
  reward_mean, reward_std          the candidates' rewards (mean; std within the group, averaged)
  policy_reward                    per group, the rewards weighted by the policy's probability of
                                   each candidate (softmax over the group of their summed log-probs):
                                   the reward the policy collects choosing among them; uniform = mean
  policy_accuracy                  1 where the most probable candidate has the group's best reward,
                                   over the groups whose rewards are not all equal
"""

from __future__ import annotations

import torch


def dpo_figures(pi_c: torch.Tensor, pi_r: torch.Tensor, ref_c: torch.Tensor, ref_r: torch.Tensor,
                beta: float) -> dict[str, float]:
    chosen, rejected = beta * (pi_c - ref_c).detach(), beta * (pi_r - ref_r).detach()
    margin = chosen - rejected
    return {"reward_chosen": float(chosen.sum()), "reward_rejected": float(rejected.sum()),
            "reward_accuracy": float((margin > 0).sum()), "reward_margin": float(margin.sum()),
            "logp_chosen": float(pi_c.detach().sum()), "logp_rejected": float(pi_r.detach().sum())}


def reward_figures(rewards: torch.Tensor, group_sizes: list[int]) -> dict[str, tuple[float, float]]:
    stds = [float(r.std()) if len(r) > 1 else 0.0 for r in rewards.split(group_sizes)]
    return {"reward_mean": (float(rewards.sum()), float(len(rewards))), "reward_std": (sum(stds), float(len(stds)))}


def choice_figures(seq_logps: torch.Tensor, rewards: torch.Tensor,
                   group_sizes: list[int]) -> dict[str, tuple[float, float]]:
    reward_sum = right = decided = 0.0
    for lp, r in zip(seq_logps.detach().split(group_sizes), rewards.to(seq_logps.device).split(group_sizes)):
        p = torch.softmax(lp.double(), dim=0)
        reward_sum += float((p * r.double()).sum())
        if float(r.max()) > float(r.min()):
            decided += 1
            right += float(r[int(lp.argmax())] == r.max())
    return {"policy_reward": (reward_sum, float(len(group_sizes))), "policy_accuracy": (right, decided)}
