"""The train stage's options: one model, read by a recipe's `train:` block, `astrai train CONFIG`,
--set overrides and the Python API (astrai.train.run.run_train) alike.

Validation that needs nothing but the options happens here (types, unknown keys, ranges, choices,
combinations); checks that need the data or the model (sft on data without labels, dpo on non-DPO
data, a tokenizer vocabulary larger than the model's embedding) are astrai.train.data.compat_problems,
run before any work. Like the rest of astrai.config, this imports neither torch nor astrai.train.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Optional, Union

from pydantic import Field, model_validator

from astrai.config.loading import StrictModel, get_in, raise_combination_problems


# positions per LM-head chunk: past one chunk, `lm_loss: auto` runs the fused loss (astrai.train.lm_loss)
LOSS_CHUNK = 1024

# LoRA targets by PEFT's names: the attention and MLP projections (the default), and the w1 (gate),
# w3 (up) and w2 (down) of each Mixtral-style expert (only when asked: they multiply the adapters)
LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_TARGETS = LORA_DEFAULT_TARGETS + ("w1", "w2", "w3")


class LoraOptions(StrictModel):
    """A train block's `lora:`: train low-rank adapters on a frozen pretrained base (astrai.model.lora)."""

    rank: int = Field(16, ge=1, description="adapter rank r (A: r x in, B: out x r)")
    alpha: float = Field(32.0, gt=0, description="the update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input (training only)")
    target_modules: list[str] = Field(list(LORA_DEFAULT_TARGETS),
                                      description=f"linear layers to adapt, by PEFT's names: {', '.join(LORA_TARGETS)}")
    merge: bool = Field(True, description="also write final/merged/: the base with the adapters merged in "
                                          "(a plain checkpoint)")
    quantize_base: Optional[Literal["nf4"]] = Field(
        None, description="QLoRA: hold the frozen base's decoder projections in 4-bit NormalFloat (blocks of 64, "
                          "double-quantized scales; needs torchao), computed in `dtype`; null: as `dtype`")

    @classmethod
    def combination_problems(cls, data) -> list[tuple[tuple, str]]:
        import difflib

        targets = get_in(data, "target_modules")
        if not isinstance(targets, list):
            return []
        if not targets:
            return [(("target_modules",), f"target_modules is empty; name layers to adapt, e.g. "
                                          f"[{', '.join(LORA_DEFAULT_TARGETS)}]")]
        p = []
        for i, t in enumerate(targets):
            if t not in LORA_TARGETS:
                guess = difflib.get_close_matches(str(t), LORA_TARGETS, n=1, cutoff=0.6)
                p.append((("target_modules", i), f"unknown target module {t!r}" + (
                    f" (did you mean {guess[0]!r}?)" if guess else "") + f"; known: {', '.join(LORA_TARGETS)}"))
        return p

    @model_validator(mode="after")
    def _combinations(self):
        return raise_combination_problems(self)


REWARD_NAMES = ("exact_match", "numeric_match", "format", "length_penalty")


class RewardSpec(StrictModel):
    """One reward function: a built-in by `name` (astrai.rl.rewards) or the user's `function`."""

    name: Optional[Literal["exact_match", "numeric_match", "format", "length_penalty"]] = Field(
        None, description="built-in: exact_match / numeric_match (the completion's final answer against `column`), "
                          "format (`pattern` found), length_penalty (DAPO's soft overlong penalty)")
    function: Optional[str] = Field(None, description="'module:function' or 'path/file.py:function': your "
                                                      "f(completion, sample) -> float (sample: prompt + row values)")
    weight: float = Field(1.0, description="the step reward is the weighted sum of every function's reward")
    column: str = Field("answer", description="exact/numeric_match: the data column holding the reference answer")
    extract: Literal["last_number", "answer_tag", "last_line", "whole"] = Field(
        "last_number", description="exact/numeric_match: which part of the completion is its final answer "
                                   "(answer_tag: the text inside <answer>...</answer>)")
    tolerance: float = Field(1e-6, ge=0, description="numeric_match: |answer - reference| <= tolerance * max(1, |ref|)")
    pattern: Optional[str] = Field(None, description="format: a regular expression")
    fullmatch: bool = Field(False, description="format: the whole completion (stripped) must match, not a part")
    max_tokens: Optional[int] = Field(None, ge=1, description="length_penalty: L_max (default: rollout.max_tokens)")
    buffer: int = Field(0, ge=0, description="length_penalty: L_cache; the penalty ramps from 0 at L_max - buffer "
                                             "to -1 at L_max (0: only past L_max)")
    label: Optional[str] = Field(None, description="name in metrics and completions.jsonl (default: name or function)")

    @model_validator(mode="after")
    def _one(self):
        if (self.name is None) == (self.function is None):
            raise ValueError("give exactly one of name (a built-in reward) or function ('module:function')")
        if self.name == "format" and not self.pattern:
            raise ValueError("the format reward needs pattern (a regular expression)")
        if self.pattern is not None:
            import re

            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"pattern {self.pattern!r} is not a regular expression: {e}") from None
        if self.function is not None and ":" not in self.function:
            raise ValueError(f"function {self.function!r}: write it as 'module:function' or 'file.py:function'")
        return self

    @property
    def key(self) -> str:
        return self.label or self.name or self.function.rsplit(":", 1)[-1]


class RolloutOptions(StrictModel):
    """Online GRPO: completions sampled each step from the current weights by the engine."""

    group_size: int = Field(8, ge=2, description="completions per prompt (G)")
    max_tokens: int = Field(64, ge=1, description="most tokens per completion")
    temperature: float = Field(1.0, ge=0, description="sampling temperature (0: greedy, every completion alike)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens (0: all)")
    prompts_per_step: Optional[int] = Field(None, ge=1, description="prompts per optimizer step (default "
                                                                     "batch_size x grad_accum)")
    mask_truncated: bool = Field(False, description="completions cut at max_tokens get no loss (overlong filtering)")
    dynamic_sampling: bool = Field(False, description="groups whose rewards are all equal are left out of the loss "
                                                      "(DAPO's filter; counted as zero_variance_share)")
    overlong_buffer: int = Field(0, ge=0, description="DAPO's soft overlong punishment: over the last N tokens "
                                                      "before max_tokens the reward ramps down to -overlong_penalty, "
                                                      "which a completion cut at max_tokens gets (0: off)")
    overlong_penalty: float = Field(1.0, ge=0, description="the soft overlong punishment's largest penalty")
    page_size: int = Field(16, ge=1, description="engine KV page size (the unit of prompt sharing)")
    max_running: int = Field(64, ge=1, description="engine: most completions decoding together")
    sleep: bool = Field(False, description="the engine gives back its KV pool and fused weight copies after each "
                                           "rollout (during the update) and takes them again at the next one")

    @model_validator(mode="after")
    def _buffer(self):
        if self.overlong_buffer > self.max_tokens:
            raise ValueError(f"overlong_buffer {self.overlong_buffer} is more than max_tokens {self.max_tokens}: the "
                             f"penalty ramps over the last overlong_buffer tokens before max_tokens")
        return self


class TrainOptions(StrictModel):
    """A recipe's `train:` block, or a train YAML. Paths are relative to that file."""

    data: Optional[str] = Field(None, description="preprocessed data directory (in a recipe: default the "
                                                  "preprocess stage's output)")
    model: str = Field("tiny", description="a size preset (tiny, small, base, ...), a config.json, a checkpoint dir, "
                       "or a llama.cpp .gguf file (converted once into the cache)")
    output: str = Field(description="run directory: checkpoints/, metrics.jsonl, final/")
    strategy: Literal["seq", "sft", "dpo", "grpo"] = Field("sft", description="training objective")
    val_data: Optional[str] = Field(None, description="preprocessed validation data (same strategy)")
    ref_model: Optional[str] = Field(None, description="dpo/grpo reference checkpoint (default: the initial model; "
                                                       "with lora, the base with the adapters off)")
    lora: Optional[LoraOptions] = Field(None, description="train LoRA adapters on the frozen `model` (a checkpoint) "
                                                         "instead of every weight; {} for the defaults")

    epochs: int = Field(1, ge=1, description="passes over the data")
    max_steps: Optional[int] = Field(None, ge=1, description="stop after this many optimizer steps")
    batch_size: int = Field(8, ge=1, description="rows per micro-batch per rank (one packed row each)")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    shuffle: bool = Field(True, description="a new row order every epoch (from seed and epoch)")
    seed: int = Field(0, description="model init, data order and RNG seed")

    lr: float = Field(3e-4, gt=0, description="peak learning rate (AdamW)")
    weight_decay: float = Field(0.1, ge=0, description="AdamW decoupled weight decay (not on norms)")
    betas: list[float] = Field([0.9, 0.95], description="AdamW betas [beta1, beta2]")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    max_grad_norm: Optional[float] = Field(1.0, gt=0, description="gradient clipping norm (null: no clipping)")
    scheduler: Literal["constant", "cosine", "sgdr", "wsd"] = Field("cosine", description="learning-rate schedule")
    warmup_steps: int = Field(0, ge=0, description="linear warmup steps")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final (or trough) lr as a fraction of lr")
    sgdr_cycle_steps: int = Field(100, ge=1, description="sgdr: first cycle length in steps")
    sgdr_cycle_mult: float = Field(2.0, ge=1, description="sgdr: each cycle is this much longer")
    wsd_decay_ratio: float = Field(0.2, gt=0, le=1, description="wsd: share of steps in the final decay")

    label_smoothing: float = Field(0.0, ge=0, lt=1, description="seq/sft label smoothing")
    dpo_beta: float = Field(0.1, gt=0, description="dpo: inverse temperature beta")
    grpo_clip_eps: float = Field(0.2, gt=0, lt=1, description="grpo: ratio clip epsilon")
    grpo_kl_coef: float = Field(0.01, ge=0, description="grpo: k3 KL weight (0: no reference model)")
    grpo_updates: int = Field(2, ge=1, description="grpo: optimizer steps per drawn batch")
    grpo_clip_eps_low: Optional[float] = Field(None, gt=0, lt=1, description="grpo: lower clip 1 - eps_low "
                                                                            "(default grpo_clip_eps)")
    grpo_clip_eps_high: Optional[float] = Field(None, gt=0, description="grpo: upper clip 1 + eps_high (default "
                                                                       "grpo_clip_eps; loss_type dapo: 0.28)")
    grpo_temperature: Optional[float] = Field(None, gt=0, description="offline grpo: the temperature the data's "
                                                                     "completions were sampled at; log-probs are of "
                                                                     "logits / T (default 1; online: "
                                                                     "rollout.temperature)")
    loss_type: Literal["token", "grpo", "dr_grpo", "dapo"] = Field(
        "token", description="grpo aggregation: token (sum / completion tokens), grpo (per-sequence mean, then "
                             "mean), dr_grpo (no std or length normalisation: sum / (sequences x max length)), "
                             "dapo (token-level, decoupled clip 0.2 / 0.28)")
    rollout: Optional[RolloutOptions] = Field(None, description="grpo: sample completions online from the current "
                                                                "weights (the data holds prompts); see rewards")
    rewards: list[RewardSpec] = Field(default_factory=list, description="online grpo: reward functions, summed "
                                                                        "with their weights")
    reward: Optional[RewardSpec] = Field(None, description="online grpo: a single reward function (or use rewards)")
    reward_timeout: Optional[float] = Field(30.0, gt=0, description="online grpo: seconds one reward call may take "
                                                                    "before it fails (the functions run in a worker "
                                                                    "process, restarted after a timeout); null: no "
                                                                    "limit, in the training process")
    reward_error_share: float = Field(0.5, ge=0, le=1, description="online grpo: a reward function failing on more "
                                                                   "than this share of a step's completions stops "
                                                                   "the run with its first error (1: never)")
    moe_aux_loss_coef: Optional[float] = Field(None, ge=0, description="MoE load-balancing weight (null: config's)")

    dtype: Literal["float32", "bfloat16", "float16", "float64"] = Field(
        "float32", description="parameter dtype (float64: for exactness checks, e.g. distributed == one process); "
                               "with lora, the frozen base's: the adapters stay float32")
    precision: Literal["fp32", "bf16-mixed", "auto"] = Field(
        "fp32", description="bf16-mixed: float32 weights, gradients and optimizer state, matmuls in bf16 under "
        "torch.autocast, the loss in float32; auto: bf16-mixed where bf16 products are faster (a CPU with "
        "avx512_bf16 or amx_bf16, a CUDA GPU of compute capability 8.0+), fp32 elsewhere")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available")
    attention: Literal["auto", "loop", "varlen"] = Field("auto", description="packed attention backend")
    lm_loss: Literal["auto", "full", "chunked", "fused"] = Field(
        "auto", description="LM head loss: auto = full up to loss_chunk_tokens positions, fused beyond "
        "(fused: fastest and smallest, bench/train.py)")
    loss_chunk_tokens: int = Field(LOSS_CHUNK, ge=1, description="positions per LM-head chunk")
    gradient_checkpointing: bool = Field(False, description="recompute layers in backward (less activation memory)")
    compile: bool = Field(False, description="torch.compile the decoder layers (attention loop stays eager)")
    return_freed_memory: bool = Field(
        False, description="CPU with glibc: tensors of 256 KiB or more get memory of their own, returned to the "
        "system when freed, so heap fragmentation does not grow the peak (SmolLM2 LoRA step: peak RSS -30%, "
        "step time +40-80%: off unless a run does not fit otherwise; astrai.train.host_memory)")
    parallel: Literal["ddp", "fsdp"] = Field(
        "ddp", description="under torchrun: ddp replicates the model; fsdp shards weights, gradients and "
        "optimizer state per decoder layer (FSDP2). One process: no effect")

    save_every: int = Field(100, ge=1, description="checkpoint every N optimizer steps (and at the end)")
    keep_last: int = Field(2, ge=1, description="checkpoints kept (older ones are deleted)")
    eval_every: Optional[int] = Field(None, ge=1, description="validation figures every N steps (loss; DPO/GRPO held-out "
                                       "rewards; also before the first step) (needs val_data)")
    log_every: int = Field(1, ge=1, description="metrics.jsonl line every N optimizer steps")
    progress: bool = Field(True, description="tqdm progress bar on rank 0")
    report_to: Union[Literal["none", "tensorboard", "wandb"], list[Literal["tensorboard", "wandb"]]] = Field(
        "none", description="where metrics go besides metrics.jsonl: tensorboard (event files in OUTPUT/runs), "
        "wandb (offline, OUTPUT/wandb), a list of both, or none; each needs its extra installed")
    resume: Literal["auto", "never"] = Field("auto", description="auto: continue from the latest checkpoint")
    skip_nonfinite_steps: int = Field(0, ge=0, description="optimizer steps with a NaN/inf loss or gradient norm "
                                                           "skipped (counted) before training stops; 0: stop at "
                                                           "the first")

    def with_reward_files_under(self, base) -> "TrainOptions":
        """Reward functions given as a relative 'file.py:name' are files next to the config (or recipe)."""
        from pathlib import Path

        def fix(spec: Optional[RewardSpec]):
            if spec is None or spec.function is None:
                return spec
            module, _, name = spec.function.rpartition(":")
            if (module.endswith(".py") or "/" in module) and not Path(module).is_absolute():
                return spec.model_copy(update={"function": f"{Path(base) / module}:{name}"})
            return spec

        return self.model_copy(update={"reward": fix(self.reward), "rewards": [fix(r) for r in self.rewards]})

    # a recipe's train stage validates on its data stage's val/ when it names no val_data (checked there,
    # with the upstream stage's facts): no "eval_every needs val_data" from the options alone
    val_data_from_data_stage: ClassVar[bool] = False

    @classmethod
    def combination_problems(cls, data) -> list[tuple[tuple, str]]:
        p = []
        if not cls.val_data_from_data_stage and get_in(data, "eval_every") is not None \
                and get_in(data, "val_data") is None:
            p.append((("eval_every",), "eval_every needs val_data (a preprocessed validation directory)"))
        strategy = get_in(data, "strategy", default="sft")
        if get_in(data, "ref_model") is not None and strategy not in ("dpo", "grpo"):
            p.append((("ref_model",), f"ref_model is only used by dpo and grpo, not {strategy}"))
        p += save_every_problems(get_in(data, "strategy", default="sft"), get_in(data, "save_every", default=100),
                                 get_in(data, "grpo_updates", default=2))
        betas = get_in(data, "betas")
        if isinstance(betas, list) and (len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1
                                                                  for b in betas)):
            p.append((("betas",), "betas must be two numbers in [0, 1), e.g. [0.9, 0.95]"))
        p += [(("lora",) + loc, m) for loc, m in LoraOptions.combination_problems(get_in(data, "lora"))]
        p += precision_problems(get_in(data, "precision"), get_in(data, "dtype", default="float32"),
                                get_in(data, "lora") is not None)
        online = get_in(data, "rollout") is not None
        if online and strategy != "grpo":
            p.append((("rollout",), f"rollout samples completions for strategy grpo, not {strategy}"))
        has_rewards = bool(get_in(data, "rewards")) or get_in(data, "reward") is not None
        if online and not has_rewards:
            p.append((("rewards",), "online grpo needs reward functions: rewards: [{name: numeric_match, column: "
                                    "answer}] or reward: {function: 'my_rewards:score'}"))
        if online and get_in(data, "grpo_temperature") is not None:
            p.append((("grpo_temperature",), "grpo_temperature is the sampling temperature of offline data; online, "
                                             "log-probs use rollout.temperature"))
        if has_rewards and not online:
            p.append((("rewards",), "rewards score online completions; add a rollout block (offline grpo data "
                                    "carries its rewards)"))
        return p

    @model_validator(mode="after")
    def _combinations(self):
        return raise_combination_problems(self)

    @property
    def reporters(self) -> list[str]:
        """report_to as a list of tracker names (none: [])."""
        return [] if self.report_to == "none" else [self.report_to] if isinstance(self.report_to, str) \
            else list(dict.fromkeys(self.report_to))


def save_every_problems(strategy, save_every, updates) -> list[tuple[tuple, str]]:
    """A checkpoint is only taken after a drawn batch's last update (where a resume can start), so
    with several GRPO updates per batch save_every must be a multiple of them to be exact."""
    if strategy != "grpo" or not isinstance(save_every, int) or not isinstance(updates, int) or updates < 1 \
            or save_every % updates == 0:
        return []
    lo, hi = max(updates, save_every - save_every % updates), save_every - save_every % updates + updates
    fix = f"{lo} or {hi}" if lo != hi else str(hi)
    return [(("save_every",), f"save_every {save_every} is not a multiple of grpo_updates {updates}: checkpoints "
                              f"are taken after a batch's last update (where training can resume); use {fix}")]


def bf16_mixed_allowed(dtype: str, lora: bool) -> bool:
    """bf16-mixed keeps float32 master weights: the trained parameters must be float32 (with lora, the
    frozen base may be bfloat16, never updated; the adapters are float32)."""
    return dtype == "float32" or (lora and dtype == "bfloat16")


def precision_problems(precision, dtype, lora: bool) -> list[tuple[tuple, str]]:
    if precision != "bf16-mixed" or bf16_mixed_allowed(dtype, lora):
        return []
    base = " (with lora: float32 or bfloat16, the frozen base's)" if lora else ""
    return [(("precision",), f"bf16-mixed keeps float32 master weights and multiplies in bf16 under autocast, "
                             f"but dtype: {dtype} makes the trained weights {dtype}: set dtype: float32{base}, or "
                             f"precision: fp32 to train in {dtype}")]
