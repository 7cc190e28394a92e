"""LoRA's model source (astrai.train.adapters.base_problem): an adapter directory is refused with the full
checkpoint to use instead, named by its path."""

from astrai.config.train import TrainOptions
from astrai.model import CausalLM, ModelConfig, save_model
from astrai.model.adapter_files import save_adapter
from astrai.model.lora import LoraSpec, apply_lora
from astrai.train.adapters import base_problem


def test_an_adapter_directory_as_lora_base_names_the_checkpoint_to_use(tmp_path):
    model = CausalLM(ModelConfig.preset("tiny", vocab_size=64))
    save_model(model, tmp_path / "base")
    apply_lora(model, LoraSpec(2, 4.0), base=str(tmp_path / "base"))
    save_adapter(model, tmp_path / "final")
    opts = TrainOptions(model=str(tmp_path / "final"), output=str(tmp_path / "out"), lora={})
    problem = base_problem(opts, True)
    assert "is a LoRA adapter directory" in problem
    assert f"set model to its base '{tmp_path / 'base'}' or to the adapter merged into it" in problem
    save_model(CausalLM(ModelConfig.preset("tiny", vocab_size=64)), tmp_path / "final" / "merged")
    assert f"set model to '{tmp_path / 'final' / 'merged'}', the adapter merged into its base" in \
        base_problem(opts, True)
    assert base_problem(opts.model_copy(update={"model": str(tmp_path / "base")}), True) is None
    assert base_problem(opts.model_copy(update={"lora": None}), True) is None  # full fine-tuning takes it
