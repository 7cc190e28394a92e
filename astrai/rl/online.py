"""Online GRPO in one process: the trainer draws prompts, the engine samples, rewards score, GRPO learns.

`run_online_grpo(options)` is `astrai.train.run.run_train` with the `OnlineGRPO` strategy: the data
is a preprocessed prompt set (rendered conversations ending with the assistant header, plus value
columns such as an answer: pipelines/grpo_prompts.yaml). For each drawn step (prompts_per_step
prompts, dealt into micro-batches of batch_size), `draw`:
  1. samples G completions per prompt from the current weights (astrai.rl.rollout),
  2. scores each (astrai.rl.rewards) and computes its group's advantages (astrai.train.grpo_loss:
     std-normalised, or not for dr_grpo); a completion whose reward failed gets advantage 0 and
     the group's statistics use the others; with `mask_truncated` a completion cut at max_tokens,
     with `dynamic_sampling` a group of equal rewards, gets no loss (counted);
  3. appends every completion (step, prompt, completion, rewards, reward, advantage, finish
     reason, tokens) to OUTPUT/completions.jsonl, and leaves the step's rollout metrics for the
     trainer's metrics.jsonl line: reward_mean, reward_std (population), reward_<function> means,
     completion_length, truncated_share, zero_variance_share, reward_errors, rollout and scoring
     seconds, rollout tokens/s, prefix-cache hits, the KV pool's size, and update_seconds (drawn
     batch to optimizer step) and peak memory.
Then the trainer's GRPO objective runs as offline: old-policy log-probs from the policy that
sampled (the same weights, recomputed by the trainer's forward), the reference KL, `updates`
optimizer steps. A resumed run first drops completions.jsonl lines of steps after its checkpoint;
rollouts are seeded by (seed, step), so it draws the same completions and rewards again.
With validation data (val_data, or a recipe's holdout) `held_out_figures` samples G completions
per held-out prompt from the current weights, seeded alike at every evaluation (so two evaluations
differ by the weights alone), scores them as training does and reports val_reward_mean,
val_reward_std, val_reward_<function>, val_completion_length, val_truncated_share, ... (no
val_loss: on fresh samples the GRPO objective is the KL term alone); the completions go to
OUTPUT/val_completions.jsonl.
Online GRPO runs in one process (no torchrun).
"""

from __future__ import annotations

import json
import math
import resource
import time
from pathlib import Path

import torch

from astrai.config.train import TrainOptions
from astrai.errors import InputError
from astrai.rl.rewards import Scorer
from astrai.rl.rollout import Rollout
from astrai.runtime import atomic_write_text, open_nofollow
from astrai.schema import IGNORE_INDEX
from astrai.train.batches import collate_scored
from astrai.train.grpo_loss import group_advantages
from astrai.train.strategies import GRPOStrategy

COMPLETIONS = "completions.jsonl"
VAL_COMPLETIONS = "val_completions.jsonl"
VAL_STEP = 1 << 30  # the seed stream of held-out rollouts (training steps never reach it)


class OnlineGRPO(GRPOStrategy):
    def __init__(self, ref, options: TrainOptions, data, device):
        ro = options.rollout
        super().__init__(ref, options.grpo_clip_eps, options.grpo_kl_coef, options.grpo_updates,
                         loss_type=options.loss_type, clip_eps_low=options.grpo_clip_eps_low,
                         clip_eps_high=options.grpo_clip_eps_high, max_len=ro.max_tokens)
        self.ro, self.seed, self.device = ro, options.seed, device
        self.dataset, self.tokenizer = data.dataset, data.tokenizer
        self.scorer = Scorer(([options.reward] if options.reward else []) + list(options.rewards), ro.max_tokens)
        self.log = Path(options.output) / COMPLETIONS
        self.val_log = Path(options.output) / VAL_COMPLETIONS
        self.rollout = None
        self._drawn_at = None
        self._metrics: dict = {}
        self._trimmed = False

    @classmethod
    def build(cls, model, ref, data, options, dist):
        if dist.world > 1:
            raise InputError("online grpo (rollout) runs in one process: start it without torchrun")
        return cls(ref, options, data, dist.device)

    @property
    def step_metrics(self) -> dict:
        m = dict(self._metrics)
        if self._drawn_at is not None:
            m["update_seconds"] = time.perf_counter() - self._drawn_at
        m["peak_memory_mb"] = peak_memory_mb(self.device)
        return m

    def _ready(self, model, step: int):
        """The engine's copy of the current weights; a resumed run first forgets later steps' logs."""
        if not self._trimmed:
            trim_log(self.log, step)
            trim_log(self.val_log, step)
            self._trimmed = True
        if self.rollout is None:
            self.rollout = Rollout(model, self.tokenizer, self.ro, self.seed, self.device)
        else:
            self.rollout.sync(model)

    def draw(self, model, window: list[list[int]], step: int) -> list[dict]:
        self._ready(model, step)
        rows = [i for idx in window for i in idx]
        prompts = [self.dataset[i]["input_ids"].tolist() for i in rows]
        was_training = model.training
        groups, stats = self.rollout.generate(prompts, step)
        model.train(was_training)
        t0 = time.perf_counter()
        scored = [self._score(step + 1, prompts[k], self.dataset.values(i), groups[k]) for k, i in enumerate(rows)]
        stats["scoring_seconds"] = time.perf_counter() - t0
        self._metrics = {**summary(scored, self.scorer.keys), **stats}
        self._write(scored)
        batches, k = [], 0
        for idx in window:
            batches.append(collate_scored([s["group"] for s in scored[k:k + len(idx)]]))
            k += len(idx)
        self._drawn_at = time.perf_counter()
        return batches

    def _score(self, step: int, prompt_ids: list[int], values: dict, group: list[dict]) -> dict:
        prompt = self.tokenizer.decode(prompt_ids)
        totals, parts, errors = [], [], []
        for c in group:
            sample = {**values, "prompt": prompt, "completion_tokens": len(c["token_ids"]),
                      "truncated": c["finish_reason"] == "length"}
            total, per, err = self.scorer.score(c["text"], sample)
            totals.append(total)
            parts.append(per)
            errors.append(err)
        ok = [t is not None for t in totals]
        rewards = torch.tensor([t if t is not None else 0.0 for t in totals], dtype=torch.float32)
        adv = torch.zeros_like(rewards)
        good = torch.tensor(ok)
        if good.any():
            adv[good] = group_advantages(rewards[good], self.adv_eps, scale=self.loss_type != "dr_grpo")
        zero_var = int(good.sum()) < 2 or bool((rewards[good] == rewards[good][0]).all())
        labels = []
        for c in group:
            drop = (self.ro.mask_truncated and c["finish_reason"] == "length") or (self.ro.dynamic_sampling and zero_var)
            labels.append([IGNORE_INDEX] * len(c["token_ids"]) if drop else list(c["token_ids"]))
        records = [{"step": step, "prompt": prompt, "completion": c["text"], "rewards": p, "reward": t,
                    "advantage": float(a), "finish_reason": c["finish_reason"], "tokens": len(c["token_ids"]),
                    **({"reward_error": e} if e else {})}
                   for c, p, t, a, e in zip(group, parts, totals, adv.tolist(), errors)]
        return {"group": (prompt_ids, [c["token_ids"] for c in group], labels, adv, rewards), "records": records,
                "zero_variance": zero_var}

    def held_out_figures(self, model, val_dataset, step: int) -> dict:
        """Rewards of G completions per held-out prompt, sampled from the current weights in pieces
        of the engine's running slots (each prompt seeded by its number in the set)."""
        self._ready(model, step)
        piece = max(1, self.ro.max_running // self.ro.group_size)
        scored = []
        for first in range(0, len(val_dataset), piece):
            rows = range(first, min(first + piece, len(val_dataset)))
            prompts = [val_dataset[i]["input_ids"].tolist() for i in rows]
            groups, _ = self.rollout.generate(prompts, VAL_STEP, first=first)
            scored += [self._score(step, prompts[k], val_dataset.values(i), groups[k]) for k, i in enumerate(rows)]
        self._write(scored, self.val_log)
        return {f"val_{k}": v for k, v in summary(scored, self.scorer.keys).items()}

    def _write(self, scored: list[dict], path: Path = None):
        path = path or self.log
        path.parent.mkdir(parents=True, exist_ok=True)
        with open_nofollow(path, "a") as fh:  # a link planted at its name is refused
            for s in scored:
                for r in s["records"]:
                    fh.write(json.dumps(r, ensure_ascii=False) + "\n")


def summary(scored: list[dict], keys: list[str]) -> dict:
    recs = [r for s in scored for r in s["records"]]
    ok = [r["reward"] for r in recs if r["reward"] is not None]
    mean = sum(ok) / len(ok) if ok else float("nan")
    m = {"reward_mean": mean,
         "reward_std": math.sqrt(sum((x - mean) ** 2 for x in ok) / len(ok)) if ok else float("nan"),
         "reward_errors": sum(r["reward"] is None for r in recs),
         "completion_length": sum(r["tokens"] for r in recs) / max(len(recs), 1),
         "truncated_share": sum(r["finish_reason"] == "length" for r in recs) / max(len(recs), 1),
         "zero_variance_share": sum(s["zero_variance"] for s in scored) / max(len(scored), 1),
         "completions": len(recs)}
    for k in keys:
        vals = [r["rewards"][k] for r in recs if k in r["rewards"]]
        m[f"reward_{k}"] = sum(vals) / len(vals) if vals else float("nan")
    return m


def trim_log(path: Path, step: int):
    """A resumed run (at `step` optimizer steps) forgets the completions logged for later steps."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    keep = [ln for ln in lines if ln.strip() and json.loads(ln)["step"] <= step]
    if len(keep) == len(lines):
        return
    atomic_write_text(path, "".join(keep))


def peak_memory_mb(device) -> float:
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kilobytes on Linux


def run_online_grpo(options: TrainOptions, callbacks=()) -> dict:
    """Train with `options.rollout`: prompts_per_step (when given) sets batch_size x grad_accum."""
    from astrai.train.run import TrainConfigError, run_train

    pps = options.rollout.prompts_per_step
    if pps is not None:
        if pps % options.grad_accum:
            raise TrainConfigError(f"train config: rollout.prompts_per_step {pps} is not a multiple of grad_accum "
                                   f"{options.grad_accum}")
        options = options.model_copy(update={"batch_size": pps // options.grad_accum})
    return run_train(options, callbacks, strategy_factory=OnlineGRPO.build)
