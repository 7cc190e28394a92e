"""Training objectives: seq, sft, dpo, grpo. Each returns a SUM and the count it is a sum over.

The trainer divides every micro-batch's sum by the total count of the whole optimizer step, over
all micro-batches and ranks (`units`), so gradient accumulation and data parallelism never change
how long and short answers are weighted (a mean per micro-batch divided by the number of
micro-batches would weight each token of a short micro-batch more than one of a long one).

- seq:  next-token cross-entropy over every token (optional label smoothing); units = tokens.
- sft:  the same over tokens whose label != IGNORE_INDEX; units = trained tokens.
- dpo:  -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), pi/ref = the sum of a sequence's
        token log-probs over its trained tokens; units = pairs. The reference model is frozen, so
        its log-probs are computed once per row and cached (once per run, hence once per epoch),
        except when the reference is the fsdp-sharded policy itself with its LoRA adapters off
        (`cache_ref=False`): its forwards are collective, and ranks would hit their caches apart.
- grpo: per trained completion token, -min(rho * A, clip(rho, 1-eps_low, 1+eps_high) * A) + kl_coef * k3,
        rho = pi / pi_old, k3 = exp(ref - pi) - (ref - pi) - 1 (Schulman's unbiased, positive KL
        estimator), A the group-normalised advantage of the completion; every log-prob taken at the
        sampling temperature (logits / T); units = completion tokens (loss_type token/dapo),
        sequences (grpo) or sequences * L (dr_grpo): astrai.train.grpo_loss.
        pi_old is the policy when the batch was drawn: `prepare` records it, then the trainer runs
        `updates` optimizer steps on the same batch, so the clip acts from the second update on
        (with one update, pi_old = pi detached: the ratio is 1 and no extra forward is run).

Metrics: each loss also returns figures for the logs. A plain number is a sum over the step's
units (the trainer divides by them); a pair (sum, count) is a mean over its own count (groups,
completions), summed over micro-batches and ranks before the division. DPO's are TRL's rewards/*
(astrai.model.scores: implicit rewards of each side, accuracy, margin, log-probs), per pair.
GRPO's: the clip fractions per completion token (`clip_low_fraction`, `clip_high_fraction`,
counted apart; `clip_fraction` their sum), `kl`, and what shows learning (astrai.model.scores):
`reward_mean`/`reward_std` of the batch, `policy_reward`/`policy_accuracy` (how the policy would
choose among each group's candidates).

MoE: the load-balancing loss of each forward is added as coef * aux * (micro units / step units),
so it too sums to one weighted mean per step; task loss, aux and weighted aux are logged apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from astrai.config.train import LOSS_CHUNK
from astrai.schema import IGNORE_INDEX
from astrai.train.packed_attention import packed_context
from astrai.train.batches import collate_dpo, collate_grpo, collate_lm
from astrai.model.scores import choice_figures, dpo_figures, reward_figures
from astrai.model.transformer import acc_dtype
from astrai.train import grpo_loss
from astrai.train.lm_loss import cross_entropy_sum, token_logprobs


@dataclass
class Env:
    """How the forward runs (not what it computes)."""
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    attention: str = "auto"
    lm_loss: str = "auto"
    loss_chunk: int = LOSS_CHUNK


def unwrap(model):
    return getattr(model, "module", model)


def softcap(model):
    """The model's final logit soft-capping (Gemma), applied by the loss that runs the LM head."""
    # a model without a config (a test's stub head) has no soft-capping
    return getattr(getattr(unwrap(model), "config", None), "final_logit_softcapping", None)


def forward(model, batch: dict, env: Env):
    ctx = packed_context(batch["cu_seqlens"], env.device, env.dtype, env.attention)
    return model(batch["input_ids"], batch["position_ids"], ctx, return_aux=True)


def doc_sums(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(values.device)
    doc = torch.repeat_interleave(torch.arange(len(lens), device=values.device), lens)
    return torch.zeros(len(lens), dtype=values.dtype, device=values.device).index_add(0, doc, values)


class Strategy:
    name = ""
    updates = 1  # optimizer steps per drawn batch

    def collate(self, rows: list[dict]) -> dict:
        raise NotImplementedError

    def units(self, batch: dict) -> int:
        return int((batch["targets"] != IGNORE_INDEX).sum())

    def prepare(self, model, batches: list[dict], indices: list[list[int]], env: Env):
        """Once per drawn step, before any update (reference / old-policy log-probs)."""

    def loss(self, model, batch: dict, env: Env) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(task loss sum, aux loss or None, metrics: a sum over units, or a (sum, count) pair)."""
        raise NotImplementedError


class LMStrategy(Strategy):
    def __init__(self, name: str, label_smoothing: float = 0.0):
        self.name, self.smoothing = name, label_smoothing

    def collate(self, rows):
        return collate_lm(rows, train_all_tokens=self.name == "seq")

    def loss(self, model, batch, env):
        hidden, aux = forward(model, batch, env)
        s = cross_entropy_sum(hidden, unwrap(model).lm_head.weight, batch["targets"], env.lm_loss, env.loss_chunk,
                              self.smoothing, softcap(model))
        return s, aux, {}


class DPOStrategy(Strategy):
    name = "dpo"

    def __init__(self, ref_model, beta: float = 0.1, cache_ref: bool = True):
        self.ref, self.beta, self.cache_ref = ref_model, beta, cache_ref
        self.cache: dict[int, tuple[float, float]] = {}

    def collate(self, rows):
        return collate_dpo(rows)

    def units(self, batch):
        return batch["pairs"]

    def _seq_logps(self, model, batch, env):
        hidden, aux = forward(model, batch, env)
        lp = token_logprobs(hidden, unwrap(model).lm_head.weight, batch["targets"], env.lm_loss, env.loss_chunk,
                            softcap(model))
        return doc_sums(lp, batch["cu_seqlens"]), aux

    @torch.no_grad()
    def prepare(self, model, batches, indices, env):
        for b, idx in zip(batches, indices):
            if not (self.cache_ref and all(i in self.cache for i in idx)):
                s, _ = self._seq_logps(self.ref, b, env)
                for j, i in enumerate(idx):
                    self.cache[i] = (float(s[2 * j]), float(s[2 * j + 1]))
            b["ref_logps"] = torch.tensor([v for i in idx for v in self.cache[i]], dtype=acc_dtype(env.dtype),
                                          device=env.device)

    def loss(self, model, batch, env):
        s, aux = self._seq_logps(model, batch, env)
        ref = batch["ref_logps"]
        losses = -F.logsigmoid(self.beta * ((s[0::2] - ref[0::2]) - (s[1::2] - ref[1::2])))
        return losses.sum(), aux, dpo_figures(s[0::2], s[1::2], ref[0::2], ref[1::2], self.beta)


class GRPOStrategy(Strategy):
    """Clipped GRPO on groups (astrai.train.grpo_loss: the loss types and their formulas)."""
    name = "grpo"

    def __init__(self, ref_model: Optional[torch.nn.Module], clip_eps: float = 0.2, kl_coef: float = 0.01,
                 updates: int = 2, adv_eps: float = 1e-4, loss_type: str = "token", clip_eps_low=None,
                 clip_eps_high=None, max_len: int = 0, temperature: float = 1.0):
        """`max_len`: dr_grpo's constant L; `temperature`: the one the completions were sampled at
        (0, greedy, scores plain logits)."""
        self.ref, self.clip_eps, self.kl_coef, self.updates, self.adv_eps = ref_model, clip_eps, kl_coef, updates, adv_eps
        self.loss_type, self.max_len = loss_type, max_len
        self.temperature = temperature or 1.0
        self.eps_low, self.eps_high = grpo_loss.clip_range(loss_type, clip_eps, clip_eps_low, clip_eps_high)

    def collate(self, rows):
        return collate_grpo(rows, self.adv_eps, scale=self.loss_type != "dr_grpo")

    @staticmethod
    def _docs(batch):
        cu = batch["cu_seqlens"]
        lens = (cu[1:] - cu[:-1]).to(batch["targets"].device)
        return torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens), lens

    def units(self, batch):
        doc, lens = self._docs(batch)
        return grpo_loss.units(batch["targets"] != IGNORE_INDEX, doc, len(lens), self.loss_type, self.max_len)

    def _token_logps(self, model, batch, env):
        hidden, aux = forward(model, batch, env)
        return token_logprobs(hidden, unwrap(model).lm_head.weight, batch["targets"], env.lm_loss,
                              env.loss_chunk, softcap(model), self.temperature), aux

    @torch.no_grad()
    def prepare(self, model, batches, indices, env):
        for b in batches:
            if self.updates > 1:  # one update: pi_old is the policy of that update itself (ratio 1), no forward
                b["old_logps"] = self._token_logps(model, b, env)[0]
            if self.kl_coef and self.ref is not None:
                b["ref_logps"] = self._token_logps(self.ref, b, env)[0]
        # token counts (clip fractions, KL) are logged per completion token whatever the step's units
        tokens = sum(int((b["targets"] != IGNORE_INDEX).sum()) for b in batches)
        scale = sum(self.units(b) for b in batches) / max(tokens, 1)
        for b in batches:
            b["metric_scale"] = scale

    def loss(self, model, batch, env):
        logp, aux = self._token_logps(model, batch, env)
        valid = batch["targets"] != IGNORE_INDEX
        doc, lens = self._docs(batch)
        adv = torch.repeat_interleave(batch["advantages"].to(device=logp.device, dtype=logp.dtype), lens)
        old = batch["old_logps"] if "old_logps" in batch else logp.detach()
        t = grpo_loss.per_token_terms(logp, old, adv, self.eps_low, self.eps_high,
                                      batch.get("ref_logps"), self.kl_coef)
        scale = batch.get("metric_scale", 1.0)
        low, high = float(t["clip_low"][valid].sum()) * scale, float(t["clip_high"][valid].sum()) * scale
        m = {"clip_fraction": low + high, "clip_low_fraction": low, "clip_high_fraction": high}
        if "kl" in t:
            m["kl"] = float(t["kl"].detach()[valid].sum()) * scale
        sizes = batch["group_sizes"]
        m |= reward_figures(batch["rewards"], sizes)
        m |= choice_figures(doc_sums(logp.detach(), batch["cu_seqlens"]), batch["rewards"].to(logp.device), sizes)
        return grpo_loss.aggregate(t["loss"], valid, doc, len(lens), self.loss_type), aux, m


def grpo_options(options, dataset) -> dict:
    """make_strategy's grpo keywords from offline TrainOptions; dr_grpo's constant L is the longest
    completion in the data (what its sampler's max_tokens allowed, as far as the data shows)."""
    if options.strategy != "grpo":
        return {}
    return {"clip_eps": options.grpo_clip_eps, "kl_coef": options.grpo_kl_coef, "updates": options.grpo_updates,
            "loss_type": options.loss_type, "clip_eps_low": options.grpo_clip_eps_low,
            "clip_eps_high": options.grpo_clip_eps_high, "temperature": options.grpo_temperature or 1.0,
            "max_len": longest_completion(dataset) if options.loss_type == "dr_grpo" else 0}


def longest_completion(dataset) -> int:
    """The most tokens of one completion in GRPO data (Arrow list lengths: no row is decoded)."""
    import pyarrow.compute as pc

    best = 0
    for table in dataset.tables:
        lengths = pc.list_value_length(pc.list_flatten(table.column("completion_input_ids")))
        best = max(best, int(pc.max(lengths).as_py() or 0))
    return best


def make_strategy(name: str, ref_model=None, **opts) -> Strategy:
    if name in ("seq", "sft"):
        return LMStrategy(name, opts.get("label_smoothing", 0.0))
    if name == "dpo":
        return DPOStrategy(ref_model, opts.get("beta", 0.1), opts.get("cache_ref", True))
    if name == "grpo":
        return GRPOStrategy(ref_model, opts.get("clip_eps", 0.2), opts.get("kl_coef", 0.01), opts.get("updates", 2),
                            loss_type=opts.get("loss_type", "token"), clip_eps_low=opts.get("clip_eps_low"),
                            clip_eps_high=opts.get("clip_eps_high"), max_len=opts.get("max_len", 0),
                            temperature=opts.get("temperature", 1.0))
    raise ValueError(f"unknown strategy {name!r}: choose seq, sft, dpo or grpo")
