"""`run_train(options) -> result`: the train stage as one call (the CLI and recipes call this).

Model source (`options.model`): a size preset (its vocabulary is sized to the data's tokenizer,
rounded up to a multiple of 64), a config.json (fresh weights), or a checkpoint directory
(config.json + safetensors, ours or a transformers one). DPO/GRPO use a frozen copy of the
initial model as the reference unless `ref_model` names one. Everything is checked before any
training step. Rank 0 writes `OUTPUT/final/` (model + tokenizer: what transformers and
`astrai generate` load) and `OUTPUT/metrics.jsonl`; checkpoints are under `OUTPUT/checkpoints/`.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from astrai.model import CausalLM, ModelConfig, load_model, save_model
from astrai.model.checkpoint_files import read_json
from astrai.model.config import PRESETS
from astrai.model.weights import check_fits_memory
from astrai.train.data import TrainData, compat_problems
from astrai.train.distributed import finish, full_model_state, setup, teardown
from astrai.config.train import TrainOptions
from astrai.train.strategies import make_strategy
from astrai.train.trainer import Trainer


class TrainConfigError(ValueError):
    pass


def build_model(spec: str, data: TrainData, seed: int) -> CausalLM:
    torch.manual_seed(seed)
    if spec in PRESETS:
        tok = data.tokenizer
        vocab = -(-data.vocab_size // 64) * 64
        return CausalLM(ModelConfig.preset(spec, vocab_size=vocab, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                                           pad_token_id=None))
    path = Path(spec)
    if path.is_dir():  # load_model refuses what it cannot read (pickles, bad files) with the reason
        return load_model(path, dtype=torch.float32)
    if path.suffix == ".json" and path.exists():
        config = ModelConfig.from_hf(read_json(path, "config.json"), str(path))
        check_fits_memory(config, torch.float32, str(path))  # before allocating fresh weights
        return CausalLM(config)
    raise TrainConfigError(f"model {spec!r}: not a preset ({', '.join(PRESETS)}), a config.json, "
                           f"or a checkpoint directory with model.safetensors")


def run_train(options: TrainOptions, callbacks=()) -> dict:
    if options.data is None:
        raise TrainConfigError("data is required: the preprocessed directory to train on")
    data = TrainData(options.data)
    model = build_model(options.model, data, options.seed)
    problems = compat_problems(options.strategy, data, model.config.vocab_size)
    val = TrainData(options.val_data) if options.val_data else None
    if val is not None and val.kind != data.kind:
        problems.append(f"val_data {val.dir} is {val.kind} data but data is {data.kind}")
    if problems:
        raise TrainConfigError("train config: " + "; ".join(problems))

    ref = None
    if options.strategy == "dpo" or (options.strategy == "grpo" and options.grpo_kl_coef > 0):
        ref = load_model(options.ref_model) if options.ref_model else copy.deepcopy(model)
        ref.requires_grad_(False).eval()
    strategy = make_strategy(options.strategy, ref, label_smoothing=options.label_smoothing, beta=options.dpo_beta,
                             clip_eps=options.grpo_clip_eps, kl_coef=options.grpo_kl_coef, updates=options.grpo_updates)
    dist = setup(options.device)
    try:
        if ref is not None:
            ref.to(device=dist.device, dtype=getattr(torch, options.dtype))
        trainer = Trainer(model, strategy, data.dataset, options, val_dataset=val.dataset if val else None,
                          callbacks=tuple(callbacks), dist=dist, write_tokenizer=data.write_tokenizer)
        state = trainer.fit()
        final = Path(options.output) / "final"
        full = full_model_state(trainer.raw_model) if state.stopped is None else None  # collective under fsdp
        if dist.is_main and state.stopped is None:
            save_model(trainer.raw_model, final, full)
            data.write_tokenizer(final)
        last = next((r for r in reversed(state.history) if "loss" in r), {})
        val_loss = next((r["val_loss"] for r in reversed(state.history) if "val_loss" in r), None)
        finish(dist)  # final/ is on disk before any rank returns; and see distributed.finish
        return {"output": str(options.output), "final": str(final) if state.stopped is None else None,
                "steps": state.global_step, "loss": last.get("loss"), "val_loss": val_loss,
                "stopped": state.stopped}
    finally:
        teardown(dist)
