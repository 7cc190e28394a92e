"""GRPO's advantages, per-token objective and aggregations (`loss_type`), as pure tensor functions.

For a group of G completions o_1..o_G of one prompt with rewards r_1..r_G, token t of o_i has the
ratio rho_it = pi(o_it) / pi_old(o_it) and, with a reference model, Schulman's k3 estimate of the
KL to it, k3_it = exp(ref_it - logp_it) - (ref_it - logp_it) - 1 (unbiased, never negative). Every
log-prob is of the policy the completions were sampled from: the log-softmax of logits / T at the
sampling temperature T (astrai.train.lm_loss.token_logprobs; TRL does the same), for pi, pi_old and
the reference alike. The per-token loss is

    l_it = -min(rho_it * A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) * A_i) + kl_coef * k3_it

and the loss types differ in A_i, the clip and in how the l_it are summed (the trainer divides a
step's sum by the step's `units`, over all micro-batches, so accumulation never changes the weighting):

- token   (our default): A_i = (r_i - mean r) / (std r + eps); sum_i sum_t l_it / sum_i |o_i|.
- grpo    (DeepSeekMath, Shao et al. 2024, eq. 3): A_i as above;
          (1/G) sum_i (1/|o_i|) sum_t l_it: each sequence's mean, then the mean over all G sequences
          (one whose tokens are all masked counts, with 0, as in TRL); units = sequences.
- dr_grpo (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A_i = r_i - mean r (no std
          normalisation) and no 1/|o_i|: sum_i sum_t l_it / (G * L), L a constant (online: the
          rollout's max_tokens; offline: the data's longest completion) and G every sequence, masked
          ones included; units = sequences * L.
- dapo    (Yu et al. 2025): A_i std-normalised; token-level sum_i sum_t l_it / sum_i |o_i| over all
          the step's trained tokens, with the decoupled clip: eps_low = grpo_clip_eps_low (default
          grpo_clip_eps), eps_high = grpo_clip_eps_high (default 0.28, the paper's; `clip_range`).
          Its dynamic sampling (groups whose rewards are all equal are left out), overlong filtering
          (truncated completions masked) and soft overlong punishment are rollout options
          (astrai.config.train.RolloutOptions; the penalty: astrai.rl.rewards.soft_overlong).

std is the sample standard deviation (Bessel's correction, as TRL); a group of one completion or
of equal rewards has A = 0 under every type. Clip fractions count only the tokens whose gradient
the clip removes: low = rho < 1 - eps_low with A < 0, high = rho > 1 + eps_high with A > 0.
"""

from __future__ import annotations

import torch

LOSS_TYPES = ("token", "grpo", "dr_grpo", "dapo")
DAPO_EPS_HIGH = 0.28  # Yu et al. 2025, "clip-higher"


def clip_range(loss_type: str, clip_eps: float, eps_low=None, eps_high=None) -> tuple[float, float]:
    """(eps_low, eps_high): each as given, else clip_eps; dapo's eps_high defaults to 0.28 instead."""
    low = clip_eps if eps_low is None else eps_low
    high = eps_high if eps_high is not None else DAPO_EPS_HIGH if loss_type == "dapo" else clip_eps
    return low, high


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4, scale: bool = True) -> torch.Tensor:
    """A for one group: r - mean, divided by (std + eps) when `scale` (every type but dr_grpo)."""
    if rewards.numel() < 2:
        return torch.zeros_like(rewards)
    centred = rewards - rewards.mean()
    return centred / (rewards.std() + eps) if scale else centred


def per_token_terms(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, eps_low: float,
                    eps_high: float, ref_logp=None, kl_coef: float = 0.0) -> dict:
    """l_it and its parts, per token (adv already repeated per token)."""
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    loss = -torch.minimum(ratio * adv, clipped * adv)
    out = {"loss": loss, "clip_low": (ratio < 1 - eps_low) & (adv < 0), "clip_high": (ratio > 1 + eps_high) & (adv > 0)}
    if ref_logp is not None and kl_coef:
        d = ref_logp - logp
        out["kl"] = torch.exp(d) - d - 1
        out["loss"] = loss + kl_coef * out["kl"]
    return out


def aggregate(per_token: torch.Tensor, valid: torch.Tensor, doc: torch.Tensor, n_docs: int, loss_type: str
              ) -> torch.Tensor:
    """The micro-batch's loss SUM for `loss_type` (divided by `units` over the step by the trainer).
    `doc`: each position's sequence index; `valid`: the trained (completion) positions."""
    masked = torch.where(valid, per_token, torch.zeros_like(per_token))
    if loss_type != "grpo":
        return masked.sum()
    sums = torch.zeros(n_docs, dtype=per_token.dtype, device=per_token.device).index_add(0, doc, masked)
    lens = torch.zeros(n_docs, dtype=per_token.dtype, device=per_token.device).index_add(0, doc, valid.to(per_token.dtype))
    return (sums / lens.clamp(min=1)).sum()


def units(valid: torch.Tensor, doc: torch.Tensor, n_docs: int, loss_type: str, max_len: int = 0) -> float:
    """What a micro-batch's sum is a sum over: trained tokens (token, dapo), sequences (grpo), or
    sequences * L (dr_grpo; L = max_len, or the micro-batch's longest trained completion when 0).
    Sequences are all of them, masked ones included (a constant normaliser, as the papers and TRL)."""
    if loss_type in ("token", "dapo"):
        return float(valid.sum())
    if loss_type == "grpo":
        return float(n_docs)
    if max_len <= 0 and n_docs:
        max_len = int(torch.zeros(n_docs, dtype=torch.long, device=valid.device).index_add(0, doc, valid.long()).max())
    return float(n_docs * max_len)
