"""`run_train(options) -> result`: the train stage as one call (the CLI and recipes call this).

Model source (`options.model`): a size preset (its vocabulary is sized to the data's tokenizer,
rounded up to a multiple of 64), a config.json (fresh weights), a checkpoint directory
(config.json + safetensors, ours or a transformers one), or a llama.cpp .gguf file (converted once
into the cache, astrai.model.packaged; the run then names that directory). DPO/GRPO use a frozen copy of the
initial model as the reference unless `ref_model` names one. Everything is checked before any
training step: the options against the data, and the data against what was written (shards and
tokenizer: astrai.train.data). One run writes an output at a time: rank 0 holds OUTPUT's lock
(astrai.runtime.output_lock) from before the first read of a checkpoint to the end, and a second
run fails at once naming the holder. Rank 0 writes `OUTPUT/final/` (model + tokenizer: what
transformers and `astrai generate` load; built aside and swapped in whole, never with non-finite
weights), `OUTPUT/metrics.jsonl` and `OUTPUT/loss.png` (loss, learning rate and reward curves:
astrai.plot); checkpoints are under `OUTPUT/checkpoints/`. With `lora:`, adapters train on the
frozen checkpoint and final/ holds them (astrai.train.adapters). The result carries the run's
figures (astrai.train.summary), which `astrai train` prints.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch

from astrai.errors import InputError, os_error_line
from astrai.model import CausalLM, ModelConfig, load_model
from astrai.model.adapter_files import is_adapter, load_checkpoint
from astrai.model.checkpoint_files import read_json
from astrai.model.config import PRESETS
from astrai.model.hf_config import config_from_hf
from astrai.model.weights import check_fits_memory
from astrai.train.adapters import add_adapters, base_problem, reference, write_final
from astrai.train.data import TrainData, compat_problems
from astrai.train.distributed import all_sum, finish, full_model_state, setup, teardown
from astrai.plot import curves, write_plot
from astrai.train.output import FINAL_TMP, TRAIN_MARKER, claim, clear_tmp
from astrai.train.report import check_reporters
from astrai.train.resume import fsync_tree, replace_dir
from astrai.train.summary import figures, read_records
from astrai.config.train import TrainOptions
from astrai.train.strategies import grpo_options, make_strategy
from astrai.train.trainer import Trainer


class TrainConfigError(ValueError):
    pass


def is_checkpoint(spec: str) -> bool:
    path = Path(spec)
    return path.is_dir() and ((path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists()
                              or is_adapter(path))


def build_model(spec: str, data: TrainData, seed: int, dtype: torch.dtype = torch.float32,
                quantize: Optional[str] = None) -> CausalLM:
    """`quantize` (QLoRA's lora.quantize_base): a checkpoint's decoder projections are quantized as they are
    read, one layer at a time, so the full-precision base is never held whole."""
    torch.manual_seed(seed)
    if spec in PRESETS:
        tok = data.tokenizer
        vocab = -(-data.vocab_size // 64) * 64
        return CausalLM(ModelConfig.preset(spec, vocab_size=vocab, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                                           pad_token_id=None))
    path = Path(spec)
    if quantize and path.is_dir() and not is_adapter(path):  # lora refuses an adapter directory as its base
        from astrai.config.train import LORA_TARGETS
        from astrai.model.quant import QuantError

        try:
            return load_model(path, dtype=dtype, quantize=quantize, quantize_modules=LORA_TARGETS)
        except QuantError as e:  # a dimension that does not divide the block, or torchao missing
            raise TrainConfigError(f"train config: lora.quantize_base: {e}") from None
    if path.is_dir():  # a checkpoint, or an adapter directory (merged into its base, which then trains);
        return load_checkpoint(path, dtype=dtype)  # what cannot be read (pickles, bad files) is refused by name
    if path.suffix == ".json" and path.exists():
        config = config_from_hf(read_json(path, "config.json"), str(path))
        check_fits_memory(config, dtype, str(path))  # before allocating fresh weights
        return CausalLM(config)
    raise TrainConfigError(f"model {spec!r}: not a preset ({', '.join(PRESETS)}), a config.json, "
                           f"or a checkpoint directory with model.safetensors")


def run_train(options: TrainOptions, callbacks=(), strategy_factory=None) -> dict:
    """`strategy_factory(model, ref, data, options, dist) -> Strategy`: a layer above this one builds
    the strategy (online GRPO: astrai.rl, which drives the inference engine)."""
    if options.data is None:
        raise TrainConfigError("data is required: the preprocessed directory to train on")
    missing = check_reporters(options.reporters)
    if missing:
        raise TrainConfigError("; ".join(missing))
    dist = setup(options.device)
    try:
        with locked_output(Path(options.output), dist):
            return _train(options, callbacks, dist, strategy_factory)
    finally:
        teardown(dist)


@contextmanager
def locked_output(out: Path, dist):
    """One writer per output directory (astrai.runtime.output_lock): rank 0 holds the lock for the
    whole run and, holding it, claims the directory (astrai.train.output.claim: ours or empty, no
    planted link); every rank learns whether that worked (one collective), so a refused run stops on
    all ranks at once instead of leaving the others waiting."""
    from astrai.runtime import LinkRefused, OutputBusy, output_lock

    lock, problem, existed = None, "", out.exists()
    if dist.is_main:
        try:
            lock = output_lock(out).__enter__()
            claim(out)
        except (OutputBusy, NotADirectoryError, InputError) as e:  # not ours, a bad metrics.jsonl
            problem = str(e)
        except LinkRefused as e:
            problem = os_error_line(e)
        except OSError as e:
            problem = f"output {out}: {e.strerror or e}; choose another output directory"
    if all_sum([float(bool(problem))], dist)[0] > 0:
        if lock is not None:
            lock.__exit__(None, None, None)
        raise InputError(problem or f"output {out}: rank 0 could not use it (see its error)")
    try:
        yield
    except BaseException:
        if lock is not None and not existed and [p.name for p in out.iterdir()] == [TRAIN_MARKER]:
            (out / TRAIN_MARKER).unlink()  # refused before any work (a bad combination, a changed tokenizer):
            out.rmdir()  # leave no trace
        raise
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)


def _train(options: TrainOptions, callbacks, dist, strategy_factory=None) -> dict:
    from astrai.model.packaged import checkpoint_path, is_packaged

    if is_packaged(options.model):  # a .gguf file: its converted checkpoint, which adapters then name as their base
        options = options.model_copy(update={"model": str(checkpoint_path(options.model))})
    data = TrainData(options.data)
    problem = base_problem(options, is_checkpoint(options.model))
    if problem:
        raise TrainConfigError(f"train config: {problem}")
    model = build_model(options.model, data, options.seed, getattr(torch, options.dtype),
                        options.lora.quantize_base if options.lora is not None else None)
    problems = compat_problems(options.strategy, data, model.config.vocab_size, online=options.rollout is not None)
    val = TrainData(options.val_data) if options.val_data else None
    if val is not None and val.kind != data.kind:
        problems.append(f"val_data {val.dir} is {val.kind} data but data is {data.kind}")
    if val is not None and val.tokenizer_fingerprint != data.tokenizer_fingerprint:
        problems.append(f"val_data {val.dir} was made with another tokenizer (fingerprint "
                        f"{val.tokenizer_fingerprint[:12]}) than data {data.dir} ({data.tokenizer_fingerprint[:12]}); "
                        f"preprocess both with the same tokenizer")
    if problems:
        raise TrainConfigError("train config: " + "; ".join(problems))

    if options.lora is not None:
        add_adapters(model, options)
    ref = reference(model, options)
    # a reference that is the (sharded) model itself runs collectively: no per-rank cache of its log-probs
    if options.rollout is not None:
        if strategy_factory is None:
            raise TrainConfigError("train config: online grpo (rollout) runs through astrai.rl.run_online_grpo, "
                                   "which drives the inference engine; astrai train and recipes call it")
        strategy = strategy_factory(model, ref, data, options, dist)
    else:
        strategy = make_strategy(options.strategy, ref, label_smoothing=options.label_smoothing, beta=options.dpo_beta,
                                 cache_ref=not (options.lora is not None and options.parallel == "fsdp"),
                                 **grpo_options(options, data.dataset))
    if isinstance(ref, torch.nn.Module):
        ref.to(device=dist.device, dtype=getattr(torch, options.dtype))
    trainer = Trainer(model, strategy, data.dataset, options, val_dataset=val.dataset if val else None,
                      callbacks=tuple(callbacks), dist=dist, write_tokenizer=data.write_tokenizer)
    began = time.perf_counter()
    state = trainer.fit()
    out = Path(options.output)
    final = out / "final"
    if state.stopped is None:
        merge = options.lora is None or options.lora.merge
        # collective under fsdp; the frozen base is gathered only to be merged
        full = full_model_state(trainer.raw_model, trainable_only=not merge)
        trainer.check_finite_weights("final/")
        if dist.is_main:
            # written aside and swapped in whole: a kill leaves the previous final/ or the new one
            tmp = final.with_name(FINAL_TMP)
            clear_tmp(tmp)
            tmp.mkdir()
            write_final(trainer.raw_model, tmp, full, data.write_tokenizer, merge)
            fsync_tree(tmp)
            replace_dir(tmp, final)
    # the whole run's records (a resumed run's file holds the earlier sessions too); rank 0 wrote them
    records = read_records(out / "metrics.jsonl") if dist.is_main else state.history
    plot = None
    if dist.is_main and records:
        drawn = write_plot(out / "loss.png", curves(records), f"{options.strategy}: {out.name}")
        plot = str(drawn) if drawn else None  # None: matplotlib (the plot extra) is not installed
    finish(dist)  # final/ is on disk before any rank returns; and see distributed.finish
    f = figures(records)
    return {"output": str(out), "final": str(final) if state.stopped is None else None,
            "steps": state.global_step, "loss": f.get("loss"), "val_loss": f.get("val_loss"),
            "stopped": state.stopped, "skipped_nonfinite": state.skipped_nonfinite, "precision": trainer.precision.name,
            "seconds": time.perf_counter() - began, "figures": f, "plot": plot,
            "val_data": options.val_data, "strategy": options.strategy, "online": options.rollout is not None,
            "ref_model": options.ref_model or (options.model if options.model not in PRESETS else None),
            "tensorboard": str(out / "runs") if "tensorboard" in options.reporters else None}
