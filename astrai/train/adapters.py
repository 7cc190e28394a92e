"""LoRA in the train stage: which base, the adapters on it, the reference model, and what final/ holds.

With `lora:` the model source must be a full checkpoint directory: adapters on random weights teach
nothing, and a resumed run (or generate, or PEFT) must find the same frozen base again by the path
the adapters record. An adapter directory is refused with the checkpoint to use instead (its
merged/ directory when it has one, else its base): new adapters on it would record a base that is
itself an adapter, which neither astrai nor PEFT loads. (Without `lora:`, an adapter directory is a
model source like any checkpoint: merged into its base, whose weights then all train.) The base is
never copied: checkpoints and final/ hold the adapters in PEFT's
format (astrai.model.adapter_files) naming it in base_model_name_or_path, plus the optimizer state
of the adapters only; a resume rebuilds the base from `model` and loads the adapters into it.

final/ = adapter_config.json + adapter_model.safetensors + the data's tokenizer, and unless
`lora.merge: false`, final/merged/ = the base with the adapters merged in (config.json +
model.safetensors + tokenizer: a plain checkpoint for transformers, or for a later train stage).
DPO and GRPO use the base with the adapters off as their reference (lora.BaseView): no second
copy of the weights.

QLoRA (`lora.quantize_base: nf4`): the train stage reads the checkpoint straight into an NF4 base, one
layer at a time (astrai.train.run.build_model -> load_model(quantize=)); the adapters then wrap the
quantized projections (add_adapters quantizes any projection still in full precision, for a model
built otherwise). The codes follow deterministically from the same checkpoint, so a resume
rebuilds the very same frozen base (and every DDP rank the same one: the NF4 codes are buffers DDP
does not broadcast). Under torchrun with parallel: fsdp it is refused (FSDP2 would shard and
broadcast the NF4 tensors, which torchao does not implement for them). The files are those of LoRA: the adapters load over the
full-precision base named in adapter_config.json (PEFT), and final/merged/ is the dequantized base
with the adapters merged in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

from astrai.config.train import TrainOptions
from astrai.model.adapter_files import save_adapter
from astrai.model.hf_checkpoint import save_model
from astrai.model.lora import BaseView, LoraSpec, apply_lora, has_adapters, merged_state, quantize_base
from astrai.model.transformer import CausalLM

MERGED = "merged"


def lora_spec(options: TrainOptions) -> LoraSpec:
    lo = options.lora
    return LoraSpec(lo.rank, float(lo.alpha), lo.dropout, tuple(lo.target_modules))


def base_problem(options: TrainOptions, is_checkpoint: bool) -> Optional[str]:
    from astrai.errors import ModelFileError
    from astrai.model.adapter_files import is_adapter, resolve_base
    from astrai.model.checkpoint_files import CONFIG

    if options.lora is None:
        return None
    if not is_checkpoint:
        return (f"lora trains adapters on a pretrained model, but model {options.model!r} is not a checkpoint "
                f"directory; set model to one (a size preset or a config.json starts from random weights)")
    if is_adapter(options.model):
        merged = Path(options.model) / MERGED
        try:
            base = f"its base {str(resolve_base(options.model))!r}"
        except ModelFileError:  # no base to be found: say so without naming one
            base = "its base"
        instead = (f"set model to {str(merged)!r}, the adapter merged into its base" if (merged / CONFIG).is_file() else
                   f"set model to {base} or to the adapter merged into it (a LoRA run with lora.merge: true writes "
                   f"final/merged/)")
        return (f"model {options.model!r} is a LoRA adapter directory; new adapters need a full checkpoint as "
                f"their base, one they can name to be loaded again: {instead}")
    return None


def add_adapters(model: CausalLM, options: TrainOptions) -> CausalLM:
    """Freeze `model` and wrap its target layers; the adapters' initialisation follows the run's seed."""
    torch.manual_seed(options.seed)
    apply_lora(model, lora_spec(options), base=str(Path(options.model).resolve()))
    if options.lora.quantize_base:
        from astrai.model.quant import QuantError
        from astrai.train.run import TrainConfigError

        if options.parallel == "fsdp" and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # FSDP2 would broadcast and shard the NF4 tensors, which torchao's NF4Tensor does not implement
            raise TrainConfigError("train config: lora.quantize_base runs under parallel: ddp (each rank holds the "
                                   "4-bit base, a fifth of float32's bytes), not fsdp; set parallel: ddp")
        try:
            quantize_base(model, options.lora.quantize_base)
        except QuantError as e:  # a dimension that does not divide the block, or torchao missing
            raise TrainConfigError(f"train config: lora.quantize_base: {e}") from None
    return model


def reference(model: CausalLM, options: TrainOptions):
    """The frozen model DPO (and GRPO's KL) compares against, or None when the objective needs none."""
    if not (options.strategy == "dpo" or (options.strategy == "grpo" and options.grpo_kl_coef > 0)):
        return None
    if options.ref_model is None and has_adapters(model):
        return BaseView(model)
    import copy

    from astrai.model.adapter_files import load_checkpoint

    ref = load_checkpoint(options.ref_model) if options.ref_model else copy.deepcopy(model)
    return ref.requires_grad_(False).eval()


def write_final(model: CausalLM, final: Path, state: Optional[dict], write_tokenizer: Callable[[Path], None],
                merge: bool = True):
    """`state`: the full state dict when it was gathered from a sharded model."""
    if not has_adapters(model):
        save_model(model, final, state)
        write_tokenizer(final)
        return
    save_adapter(model, final, state)
    write_tokenizer(final)
    if merge:
        save_model(model, final / MERGED, merged_state(model.state_dict() if state is None else state,
                                                       model.adapter.spec.scaling))
        write_tokenizer(final / MERGED)
