"""Our decoder against transformers' LlamaForCausalLM / MixtralForCausalLM on the same random weights,
in both directions (HF save -> our load; our save -> HF from_pretrained), float32, within 1e-4."""

import json

import pytest
import torch

from astrai.model import CausalContext, CausalLM, ModelConfig, load_model, save_model
from astrai.model.hf_config import config_from_hf, config_to_hf

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0)
CASES = {
    "gqa-linear": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama3-tied": dict(tie_word_embeddings=True, num_key_value_heads=1, rope_theta=50000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mha-default": dict(num_key_value_heads=4),
    "moe": dict(num_local_experts=4, num_experts_per_tok=2),
}


def _randomize(module: torch.nn.Module, seed: int):
    # larger than the init scale, so a wrong norm, rotation or routing shows up well above 1e-4
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "norm" in name else 0.08) + ("norm" in name))


def _hf_model(cfg: ModelConfig):
    d = config_to_hf(cfg)
    cls = transformers.MixtralConfig if cfg.is_moe else transformers.LlamaConfig
    hcfg = cls(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    arch = transformers.MixtralForCausalLM if cfg.is_moe else transformers.LlamaForCausalLM
    return arch(hcfg).float().eval()


def _inputs(vocab, t=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (t,), generator=g)
    pos = torch.arange(t) + 90  # past the llama3 original context, so the scaling matters
    return ids, pos


def _ours_logits(model, ids, pos):
    with torch.no_grad():
        return model.logits(model(ids, pos, CausalContext()))


def _hf_logits(hf, ids, pos):
    with torch.no_grad():
        return hf(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0]


@pytest.mark.parametrize("case", list(CASES))
def test_hf_saved_loads_here_with_equal_logits(case, tmp_path):
    cfg = ModelConfig(**{**BASE, **CASES[case]})
    torch.manual_seed(0)
    hf = _hf_model(cfg)
    _randomize(hf, 1)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path).eval()
    assert ours.config.rope_scaling == (cfg.rope_scaling and {**cfg.rope_scaling})
    ids, pos = _inputs(cfg.vocab_size)
    ref = _hf_logits(hf, ids, pos)
    got = _ours_logits(ours, ids, pos)
    assert ref.abs().max() > 1.0  # the weights are big enough that a mistake would show
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_ours_saved_loads_in_transformers_with_equal_logits(case, tmp_path):
    cfg = ModelConfig(**{**BASE, **CASES[case]})
    ours = CausalLM(cfg).eval()
    _randomize(ours, 2)
    save_model(ours, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == (["MixtralForCausalLM"] if cfg.is_moe else ["LlamaForCausalLM"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == written["architectures"][0]
    ids, pos = _inputs(cfg.vocab_size, seed=3)
    torch.testing.assert_close(_ours_logits(ours, ids, pos), _hf_logits(hf, ids, pos), atol=1e-4, rtol=0)


def test_moe_aux_loss_equals_transformers(tmp_path):
    cfg = ModelConfig(**{**BASE, **CASES["moe"]})
    ours = CausalLM(cfg).eval()
    _randomize(ours, 4)
    save_model(ours, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids, pos = _inputs(cfg.vocab_size, seed=5)
    with torch.no_grad():
        _, aux = ours(ids, pos, CausalContext(), return_aux=True)
        ref = hf(input_ids=ids[None], position_ids=pos[None], use_cache=False, output_router_logits=True).aux_loss
    torch.testing.assert_close(aux, ref, atol=1e-6, rtol=1e-6)
    assert aux > 1.0  # E * sum f*P >= 1 with equality only for perfectly balanced routing


def test_sharded_checkpoint_loads(tmp_path):
    cfg = ModelConfig(**BASE)
    torch.manual_seed(0)
    hf = _hf_model(cfg)
    _randomize(hf, 6)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ours = load_model(tmp_path)
    ids, pos = _inputs(cfg.vocab_size)
    torch.testing.assert_close(_ours_logits(ours, ids, pos), _hf_logits(hf, ids, pos), atol=1e-4, rtol=0)


def test_load_casts_dtype_and_keeps_tied_head(tmp_path):
    cfg = ModelConfig(**{**BASE, "tie_word_embeddings": True})
    save_model(CausalLM(cfg), tmp_path)
    m = load_model(tmp_path, dtype=torch.bfloat16)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert m.model.embed_tokens.weight.dtype == torch.bfloat16


def test_config_round_trip_and_refusals():
    cfg = ModelConfig.preset("tiny-moe", rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert config_from_hf(config_to_hf(cfg)) == cfg
    with pytest.raises(ValueError, match="hidden_act: 'relu' is not modelled"):
        config_from_hf({**config_to_hf(ModelConfig.preset("tiny")), "hidden_act": "relu"})
    with pytest.raises(ValueError, match="unknown model preset"):
        ModelConfig.preset("huge")


def test_config_does_not_import_hf_config():
    """The dependency runs one way: hf_config reads and writes config.json from config's records."""
    import ast
    from pathlib import Path

    import astrai.model.config as mc

    tree = ast.parse(Path(mc.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m and m.startswith("astrai.")}, imported


def test_a_new_family_is_one_record(monkeypatch):
    """A family's reading rules live in its Family record: a copy of Qwen2's under another name reads and
    writes config.json the way Qwen2's does, with no code naming it."""
    import dataclasses

    import astrai.model.config as mc

    monkeypatch.setitem(mc.FAMILIES, "myqwen", dataclasses.replace(mc.FAMILIES["qwen2"],
                                                                    architecture="MyQwenForCausalLM"))
    monkeypatch.setitem(mc.ARCHITECTURES, "MyQwenForCausalLM", "myqwen")
    types = ("full_attention", "sliding_attention")
    for family in ("qwen2", "myqwen"):
        cfg = ModelConfig.preset("tiny", family=family, sliding_window=16, layer_types=types)
        d = config_to_hf(cfg)
        assert d["architectures"] == [mc.FAMILIES[family].architecture] and d["model_type"] == family
        assert config_from_hf(d) == cfg
        del d["layer_types"]  # read back from max_window_layers, as Qwen2's config class does
        assert config_from_hf(d) == cfg
    mine = config_to_hf(ModelConfig.preset("tiny", family="myqwen", sliding_window=16, layer_types=types))
    theirs = config_to_hf(ModelConfig.preset("tiny", family="qwen2", sliding_window=16, layer_types=types))
    assert {k: v for k, v in mine.items() if k not in ("architectures", "model_type")} == \
        {k: v for k, v in theirs.items() if k not in ("architectures", "model_type")}
    with pytest.raises(ValueError, match="attention_bias does not apply to the myqwen family"):
        ModelConfig.preset("tiny", family="myqwen", attention_bias=True)
