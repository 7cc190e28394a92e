"""GRPO on scored groups: the objective as separate functions, and the figures that tell it works.

A drawn row is a prompt with G completions and their rewards; each completion's advantage is its
reward normalised within the group (astrai.train.batches.group_advantages). Per trained completion
token, with rho = pi / pi_old (pi_old: the policy when the batch was drawn):

    loss_t = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A) + kl_coef * k3
    k3     = exp(ref - pi) - (ref - pi) - 1          (Schulman's unbiased, positive KL estimator)

summed over tokens (the trainer divides by the step's completion tokens). The clip removes a
token's gradient only on the side that matters for the sign of its advantage: rho < 1 - eps_low
with A < 0 (`clip_low`), rho > 1 + eps_high with A > 0 (`clip_high`); both are counted per token,
as TRL's clip_ratio/low_mean and high_mean. The clip acts from a batch's second update on (at the
first, rho = 1).

The loss alone says little: at the first update rho = 1 and it is -sum(A * tokens) plus the KL,
often negative and flat. What shows learning, per step and on held-out groups, is defined in
astrai.model.scores: reward_mean and reward_std (the batch's rewards: with completions given in the
data they are the data's, and move only when sampling is online), and policy_reward and
policy_accuracy (how the policy would choose among each group's candidates).
"""

from __future__ import annotations

from typing import Optional

import torch

from astrai.model.scores import choice_figures, reward_figures
from astrai.schema import IGNORE_INDEX
from astrai.train.batches import collate_grpo
from astrai.train.strategies import Env, Strategy, doc_sums, forward, softcap, unwrap
from astrai.train.lm_loss import token_logprobs


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, eps_low: float,
                      eps_high: Optional[float] = None):
    """Per token: (-min(rho A, clip(rho) A), clipped on the low side, clipped on the high side)."""
    eps_high = eps_low if eps_high is None else eps_high
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    loss = -torch.minimum(ratio * adv, clipped * adv)
    low = (ratio < 1 - eps_low) & (adv < 0)
    high = (ratio > 1 + eps_high) & (adv > 0)
    return loss, low, high


def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    d = ref_logp - logp
    return torch.exp(d) - d - 1


class GRPOStrategy(Strategy):
    name = "grpo"

    def __init__(self, ref_model: Optional[torch.nn.Module], clip_eps: float = 0.2, kl_coef: float = 0.01,
                 updates: int = 2, adv_eps: float = 1e-4, clip_eps_high: Optional[float] = None):
        self.ref, self.kl_coef, self.updates, self.adv_eps = ref_model, kl_coef, updates, adv_eps
        self.eps_low, self.eps_high = clip_eps, clip_eps if clip_eps_high is None else clip_eps_high

    def collate(self, rows):
        return collate_grpo(rows, self.adv_eps)

    def _token_logps(self, model, batch, env):
        hidden, aux = forward(model, batch, env)
        return token_logprobs(hidden, unwrap(model).lm_head.weight, batch["targets"], env.lm_loss,
                              env.loss_chunk, softcap(model)), aux

    @torch.no_grad()
    def prepare(self, model, batches, indices, env):
        for b in batches:
            b["old_logps"] = self._token_logps(model, b, env)[0]
            if self.kl_coef and self.ref is not None:
                b["ref_logps"] = self._token_logps(self.ref, b, env)[0]

    def loss(self, model, batch, env):
        logp, aux = self._token_logps(model, batch, env)
        valid = batch["targets"] != IGNORE_INDEX
        cu = batch["cu_seqlens"]
        lens = (cu[1:] - cu[:-1]).to(logp.device)
        adv = torch.repeat_interleave(batch["advantages"].to(device=logp.device, dtype=logp.dtype), lens)
        per_token, low, high = clipped_surrogate(logp, batch.get("old_logps", logp.detach()), adv, self.eps_low,
                                                 self.eps_high)
        m = {"clip_low": float(low[valid].sum()), "clip_high": float(high[valid].sum())}
        if self.kl_coef and "ref_logps" in batch:
            kl = k3(logp, batch["ref_logps"])
            per_token = per_token + self.kl_coef * kl
            m["kl"] = float(kl.detach()[valid].sum())
        sizes = batch["group_sizes"]
        m |= reward_figures(batch["rewards"], sizes)
        m |= choice_figures(doc_sums(logp.detach(), cu), batch["rewards"].to(logp.device), sizes)
        return per_token[valid].sum(), aux, m
