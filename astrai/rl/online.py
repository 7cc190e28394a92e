"""Online GRPO in one process: the trainer draws prompts, the engine samples, rewards score, GRPO learns.

`run_online_grpo(options)` is `astrai.train.run.run_train` with the `OnlineGRPO` strategy: the data
is a preprocessed prompt set (rendered conversations ending with the assistant header, plus value
columns such as an answer: pipelines/grpo_prompts.yaml). For each drawn step (prompts_per_step
prompts, dealt into micro-batches of batch_size), `draw`:
  1. samples G completions per prompt from the current weights (astrai.rl.rollout: one engine for
     the run, the weights copied into it in place before each rollout),
  2. scores each (astrai.rl.rewards; in a worker process with a per-call `reward_timeout`), adds
     DAPO's soft overlong penalty when `overlong_buffer` is set, and computes each group's
     advantages (`advantages`: std-normalised, or not for dr_grpo; in float64); a completion whose
     reward failed gets advantage 0 and the group's statistics use the others; a function failing
     on more than `reward_error_share` of the step's completions stops the run (RewardError, its
     first failure quoted). With `mask_truncated` a completion cut at max_tokens, with
     `dynamic_sampling` a group of equal rewards, gets no loss (counted);
  3. appends every completion (step, prompt, completion, rewards, reward, advantage, finish
     reason, tokens) to OUTPUT/completions.jsonl, and leaves the step's rollout metrics for the
     trainer's metrics.jsonl line: reward_mean, reward_std (population), reward_<function> means,
     completion_length, truncated_share, zero_variance_share, reward_errors, rollout and scoring
     seconds, rollout tokens/s, prefix-cache hits, the KV pool's size, and update_seconds (drawn
     batch to optimizer step) and peak memory.
Then the trainer's GRPO objective runs as offline, every log-prob at the rollout's temperature
(logits / T): old-policy log-probs from the policy that sampled (the same weights, recomputed by
the trainer's forward), the reference KL, `updates` optimizer steps; dr_grpo's constant L is
max_tokens. A resumed run first drops completions.jsonl lines of steps after its checkpoint;
rollouts are seeded by (seed, step), so it draws the same completions and rewards again.
With validation data (val_data, or a recipe's holdout) `held_out_figures` samples G completions
per held-out prompt from the current weights, seeded alike at every evaluation (so two evaluations
differ by the weights alone), scores them as training does and reports val_reward_mean,
val_reward_std, val_reward_<function>, val_completion_length, val_truncated_share, ... (no
val_loss: on fresh samples the GRPO objective is the KL term alone); the completions go to
OUTPUT/val_completions.jsonl.
Online GRPO runs in one process (no torchrun); `run_online_grpo` closes the reward worker and
the engine when training ends, however it ends.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from astrai.config.train import TrainOptions
from astrai.errors import InputError
from astrai.rl.rewards import Scorer, soft_overlong
from astrai.rl.rollout import Rollout
from astrai.runtime import atomic_write_text, open_nofollow
from astrai.schema import IGNORE_INDEX, INPUT_IDS
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
                         clip_eps_high=options.grpo_clip_eps_high, max_len=ro.max_tokens, temperature=ro.temperature)
        self.ro, self.seed, self.device = ro, options.seed, device
        self.dataset, self.tokenizer = data.dataset, data.tokenizer
        self.prompts_per_step = options.batch_size * options.grad_accum
        self.longest = longest_prompt(self.dataset)
        self.has_val = options.val_data is not None
        if options.val_data:
            from astrai.train.data import TrainData

            self.longest = max(self.longest, longest_prompt(TrainData(options.val_data).dataset))
        self.scorer = Scorer(([options.reward] if options.reward else []) + list(options.rewards), ro.max_tokens,
                             options.reward_timeout, options.reward_error_share)
        self.log = Path(options.output) / COMPLETIONS
        self.val_log = Path(options.output) / VAL_COMPLETIONS
        self.rollout = None
        self._drawn_at = None
        self._metrics: dict = {}
        self._trimmed = False
        self._warned: set = set()

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
            piece = max(1, self.ro.max_running // self.ro.group_size) if self.has_val else 0  # held-out per call
            self.rollout = Rollout(model, self.tokenizer, self.ro, self.seed, self.device, self.longest,
                                   max(self.prompts_per_step, piece))
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
        scored = self._score(step + 1, prompts, [self.dataset.values(i) for i in rows], groups)
        stats["scoring_seconds"] = time.perf_counter() - t0
        self._metrics = {**summary(scored, self.scorer.keys), **stats}
        self._write(scored)
        batches, k = [], 0
        for idx in window:
            batches.append(collate_scored([s["group"] for s in scored[k:k + len(idx)]]))
            k += len(idx)
        self._drawn_at = time.perf_counter()
        return batches

    def _score(self, step: int, prompts: list[list[int]], values: list[dict], groups: list[list[dict]],
               what: Optional[str] = None) -> list[dict]:
        """Every completion of the call scored at once (the failure share is per step), then per group."""
        texts = [self.tokenizer.decode(p) for p in prompts]
        items = [(c["text"], {**v, "prompt": t, "completion_tokens": len(c["token_ids"]),
                              "truncated": c["finish_reason"] == "length"})
                 for t, v, group in zip(texts, values, groups) for c in group]
        results = iter(self.scorer.score_all(items, what or f"step {step}"))
        self._say_failures(items, step)
        return [self._group(step, p, t, g, [next(results) for _ in g]) for p, t, g in zip(prompts, texts, groups)]

    def _group(self, step: int, prompt_ids: list[int], prompt: str, group: list[dict], results: list) -> dict:
        ro = self.ro
        totals, parts, errors = [], [], []
        for c, (total, per, err) in zip(group, results):
            if total is not None and ro.overlong_buffer:
                per = {**per, "overlong": soft_overlong(len(c["token_ids"]), c["finish_reason"] == "length",
                                                        ro.max_tokens, ro.overlong_buffer)}
                total += ro.overlong_penalty * per["overlong"]
            totals.append(total)
            parts.append(per)
            errors.append(err)
        adv = advantages(totals, self.adv_eps, scale=self.loss_type != "dr_grpo")
        ok = [t for t in totals if t is not None]
        zero_var = len(ok) < 2 or all(t == ok[0] for t in ok)
        rewards = torch.tensor([t if t is not None else 0.0 for t in totals], dtype=torch.float32)
        labels = []
        for c in group:
            drop = (ro.mask_truncated and c["finish_reason"] == "length") or (ro.dynamic_sampling and zero_var)
            labels.append([IGNORE_INDEX] * len(c["token_ids"]) if drop else list(c["token_ids"]))
        records = [{"step": step, "prompt": prompt, "completion": c["text"], "rewards": p, "reward": t,
                    "advantage": float(a), "finish_reason": c["finish_reason"], "tokens": len(c["token_ids"]),
                    **({"reward_error": e} if e else {})}
                   for c, p, t, a, e in zip(group, parts, totals, adv.tolist(), errors)]
        return {"group": (prompt_ids, [c["token_ids"] for c in group], labels, adv, rewards), "records": records,
                "zero_variance": zero_var}

    def _say_failures(self, items: list, step: int):
        """A function's first failures are said on the console once (the rest: reward_errors, completions.jsonl)."""
        for key, (count, first) in self.scorer.last_failures.items():
            if key not in self._warned:
                self._warned.add(key)
                print(f"astrai train: step {step}: reward {key!r} failed on {count} of {len(items)} completions "
                      f"(first: {first}); those get advantage 0 and count as reward_errors (completions.jsonl has "
                      f"each error); more than reward_error_share {self.scorer.error_share:g} of a step's stops the "
                      f"run", file=sys.stderr, flush=True)

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
            scored += self._score(step, prompts, [val_dataset.values(i) for i in rows], groups,
                                  f"held-out evaluation at step {step}")
        self._write(scored, self.val_log)
        return {f"val_{k}": v for k, v in summary(scored, self.scorer.keys).items()}

    def close(self):
        """The reward worker and the engine go (run_online_grpo calls it when training ends)."""
        self.scorer.close()
        if self.rollout is not None:
            self.rollout.close()
            self.rollout = None

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


def advantages(rewards: list[Optional[float]], eps: float, scale: bool) -> torch.Tensor:
    """Each completion's advantage within its group (float32): the group's statistics over the rewards
    that did not fail (None), whose completions get 0; computed in float64, so rewards up to
    float32's range never overflow the variance."""
    good = [i for i, r in enumerate(rewards) if r is not None]
    adv = torch.zeros(len(rewards), dtype=torch.float64)
    if good:
        adv[good] = group_advantages(torch.tensor([rewards[i] for i in good], dtype=torch.float64), eps, scale)
    return adv.float()


def longest_prompt(dataset) -> int:
    """The most tokens of one prompt in a prompt set (Arrow list lengths: no row is decoded)."""
    import pyarrow.compute as pc

    return max((int(pc.max(pc.list_value_length(t.column(INPUT_IDS))).as_py() or 0) for t in dataset.tables),
               default=0)


def trim_log(path: Path, step: int):
    """A resumed run (at `step` optimizer steps) forgets the completions logged for later steps, and a
    last line cut by a kill."""
    if not path.exists():
        return
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    keep = []
    for n, ln in enumerate(lines, 1):
        if not ln.endswith("\n"):
            break  # cut by a kill mid-write: the rerun writes that step again
        try:
            if ln.strip() and json.loads(ln)["step"] <= step:
                keep.append(ln)
        except (json.JSONDecodeError, KeyError, TypeError):
            raise InputError(f"{path}:{n}: not a completion record (a JSON object with a step); move the file "
                             f"away to start its log over") from None
    if len(keep) != len(lines):
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
    made = []

    def build(*args):
        made.append(OnlineGRPO.build(*args))
        return made[-1]

    try:
        return run_train(options, callbacks, strategy_factory=build)
    finally:
        for strategy in made:
            strategy.close()
