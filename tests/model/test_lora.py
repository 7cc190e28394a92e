"""LoRA adapters (astrai.model.lora, adapter_files): PEFT's math, initialisation and file format.

References: the formula by hand, and peft itself (PeftModel.from_pretrained on transformers' model
of the same base gives our logits; peft's own save loads here). Adapters that do not fit a base are
refused with one line before any weight is loaded."""

import json
import math

import pytest
import torch

from lora_random import random_adapter

from astrai.model import CausalContext, CausalLM, ModelConfig, load_model, save_model
from astrai.model.adapter_files import (AdapterError, check_adapter, load_checkpoint, read_adapter, resolve_base,
                                        save_adapter)
from astrai.model.lora import (BaseView, LoraLinear, LoraSpec, adapters_disabled, apply_lora, cast, lora_layers,
                               merged_state)

CFG = ModelConfig.preset("tiny", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2)


def _base(tmp_path, cfg=CFG, seed=0, name="base"):
    torch.manual_seed(seed)
    path = tmp_path / name
    save_model(CausalLM(cfg), path)
    return path


def _logits(model, ids):
    with torch.no_grad():
        return model.logits(model(ids, torch.arange(len(ids)), CausalContext()))


def test_lora_linear_is_the_formula_and_starts_as_the_base():
    torch.manual_seed(0)
    base = torch.nn.Linear(20, 12, bias=False)
    layer = LoraLinear(base, LoraSpec(rank=3, alpha=6.0))
    x = torch.randn(5, 20)
    # peft's init: A kaiming-uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)), B = 0: no change at first
    assert layer.lora_A.weight.shape == (3, 20) and layer.lora_B.weight.shape == (12, 3)
    a0 = layer.lora_A.weight.detach()
    assert float(a0.abs().max()) <= 1 / math.sqrt(20) and float(a0.std()) > 0.05
    assert torch.equal(layer.lora_B.weight, torch.zeros(12, 3))
    torch.testing.assert_close(layer(x), base(x), atol=0, rtol=0)
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    a, b, w = layer.lora_A.weight, layer.lora_B.weight, base.weight
    torch.testing.assert_close(layer(x), x @ w.T + 2.0 * (x @ a.T @ b.T), atol=1e-5, rtol=1e-5)
    layer.enabled = False
    torch.testing.assert_close(layer(x), base(x), atol=0, rtol=0)


def test_only_targets_are_wrapped_and_everything_else_is_frozen():
    model = CausalLM(CFG)
    names = apply_lora(model, LoraSpec(targets=("q_proj", "down_proj")))
    assert sorted(names) == sorted(f"model.layers.{i}.{m}" for i in range(2)
                                   for m in ("self_attn.q_proj", "mlp.down_proj"))
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(f"{n}.lora_{x}.weight" for n in names for x in "AB")
    with pytest.raises(ValueError, match=r"\['w1'\] match no linear layer"):
        apply_lora(CausalLM(CFG), LoraSpec(targets=("q_proj", "w1")))


def test_peft_loads_our_adapter_with_our_logits(tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base = _base(tmp_path)
    ours = random_adapter(base, LoraSpec(4, 8.0, targets=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")))
    save_adapter(ours, tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM" and cfg["r"] == 4
    assert cfg["lora_alpha"] == 8.0 and cfg["base_model_name_or_path"] == str(base)
    assert cfg["target_modules"] == ["down_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = torch.randint(0, CFG.vocab_size, (14,))
    with torch.no_grad():
        ref = pm(input_ids=ids[None]).logits[0]
        with pm.disable_adapter():
            plain = pm(input_ids=ids[None]).logits[0]
    got = _logits(ours, ids)
    assert float((ref - plain).abs().max()) > 1e-2  # the adapter changes the logits visibly
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_a_peft_saved_adapter_loads_here(tmp_path):
    """The other direction: peft's own save_pretrained (its `.lora_A.weight` keys) merged by load_checkpoint."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    base = _base(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(3)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=5, target_modules=["k_proj", "gate_proj"],
                                                 use_rslora=True))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    pm.save_pretrained(tmp_path / "peft")
    ids = torch.randint(0, CFG.vocab_size, (9,))
    with torch.no_grad():
        ref = pm.eval()(input_ids=ids[None]).logits[0]
    model = load_checkpoint(tmp_path / "peft", base=base)  # peft wrote no base path: --base gives it
    torch.testing.assert_close(_logits(model, ids), ref, atol=1e-4, rtol=0)


def test_merged_state_is_a_plain_checkpoint_with_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    base = _base(tmp_path)
    ours = random_adapter(base)
    merged = merged_state(ours.state_dict(), ours.adapter.spec.scaling)
    assert not any("lora_" in k or "base_layer" in k for k in merged)
    save_model(ours, tmp_path / "merged", merged)
    plain = load_model(tmp_path / "merged")
    ids = torch.randint(0, CFG.vocab_size, (11,))
    torch.testing.assert_close(_logits(plain, ids), _logits(ours, ids), atol=1e-5, rtol=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids[None]).logits[0], _logits(ours, ids), atol=1e-4, rtol=0)
    # and the adapter directory itself loads merged into its base, found by base_model_name_or_path
    save_adapter(ours, tmp_path / "adapter")
    torch.testing.assert_close(_logits(load_checkpoint(tmp_path / "adapter"), ids), _logits(ours, ids),
                               atol=1e-5, rtol=0)


def test_adapters_off_is_the_base_and_the_view_shares_its_weights(tmp_path):
    base = _base(tmp_path)
    ours = random_adapter(base)
    ids = torch.randint(0, CFG.vocab_size, (8,))
    with adapters_disabled(ours):
        off = _logits(ours, ids)
    torch.testing.assert_close(off, _logits(load_model(base), ids), atol=0, rtol=0)
    view = BaseView(ours)
    with torch.no_grad():
        got = ours.logits(view(ids, torch.arange(8), CausalContext()))
    torch.testing.assert_close(got, off, atol=0, rtol=0)
    assert all(layer.enabled for layer in lora_layers(ours).values())  # switched back on
    assert view.lm_head is ours.lm_head


def test_cast_keeps_adapters_float32_under_a_bfloat16_base(tmp_path):
    model = random_adapter(_base(tmp_path))
    a = {n: m.lora_A.weight.clone() for n, m in lora_layers(model).items()}
    cast(model, "cpu", torch.bfloat16)
    for n, m in lora_layers(model).items():
        assert m.base_layer.weight.dtype == torch.bfloat16
        assert m.lora_A.weight.dtype == m.lora_B.weight.dtype == torch.float32
        assert torch.equal(m.lora_A.weight, a[n])  # not rounded through bfloat16 on the way
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = torch.randint(0, CFG.vocab_size, (6,))
    out = model.logits(model(ids, torch.arange(6), CausalContext()))
    out.float().sum().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)
    assert all(p.grad.dtype == torch.float32 for n, p in model.named_parameters() if p.grad is not None)


def test_base_resolution_relative_absolute_and_override(tmp_path, monkeypatch):
    base = _base(tmp_path)
    ours = random_adapter(base)
    save_adapter(ours, tmp_path / "run" / "final")
    assert resolve_base(tmp_path / "run" / "final") == base
    cfg_file = tmp_path / "run" / "final" / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps({**cfg, "base_model_name_or_path": "../../base"}))  # relative to the adapter
    assert resolve_base(tmp_path / "run" / "final").resolve() == base.resolve()
    monkeypatch.chdir(tmp_path)
    cfg_file.write_text(json.dumps({**cfg, "base_model_name_or_path": "base"}))  # relative to the working dir
    assert resolve_base(tmp_path / "run" / "final").resolve() == base.resolve()
    cfg_file.write_text(json.dumps({**cfg, "base_model_name_or_path": "gone"}))
    with pytest.raises(AdapterError, match="not found.*--base DIR"):
        resolve_base(tmp_path / "run" / "final")
    assert resolve_base(tmp_path / "run" / "final", base=base) == base


def test_a_base_that_does_not_fit_is_refused_in_one_line(tmp_path):
    base = _base(tmp_path)
    save_adapter(random_adapter(base), tmp_path / "adapter")
    wider = _base(tmp_path, CFG.replace(hidden_size=48), name="wider")
    # down_proj's B is [hidden, r]: 32 rows here, 48 in the wider base
    with pytest.raises(AdapterError, match=r"tensor base_model\.model\.model\.layers\.0\.mlp\.down_proj\.lora_B\.weight "
                                           r"is \[32, 4\], but base .*wider needs \[48, 4\]") as e:
        load_checkpoint(tmp_path / "adapter", base=wider)
    assert "\n" not in str(e.value)
    shallower = _base(tmp_path, CFG.replace(num_hidden_layers=1), name="shallow")
    with pytest.raises(AdapterError, match=r"layers\.1\..*names no linear layer"):
        check_adapter(tmp_path / "adapter", shallower)
    moe = _base(tmp_path, CFG.replace(num_local_experts=2, num_experts_per_tok=1), name="moe")
    with pytest.raises(AdapterError, match=r"trained on a LlamaForCausalLM, but base .* is a MixtralForCausalLM"):
        check_adapter(tmp_path / "adapter", moe)
    cfg_file = tmp_path / "adapter" / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps({**cfg, "target_modules": ["q_proj", "qkv_proj"]}))
    with pytest.raises(AdapterError, match=r"adapter_config.json: target_modules: \['qkv_proj'\] do not exist in base"):
        check_adapter(tmp_path / "adapter", base)
    cfg_file.write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(AdapterError, match="DoRA"):
        check_adapter(tmp_path / "adapter", base)
    with pytest.raises(AdapterError, match="full checkpoint, not an adapter"):
        load_checkpoint(base, base=base)


def test_moe_experts_can_be_targets(tmp_path):
    cfg = CFG.replace(num_local_experts=2, num_experts_per_tok=1)
    base = _base(tmp_path, cfg)
    ours = random_adapter(base, LoraSpec(2, 4.0, targets=("q_proj", "w1", "w2", "w3")))
    assert len(lora_layers(ours)) == 2 * (1 + 2 * 3)
    save_adapter(ours, tmp_path / "adapter")
    tensors, _ = read_adapter(tmp_path / "adapter")
    assert "model.layers.0.block_sparse_moe.experts.1.w2.lora_B.weight" in tensors
    ids = torch.randint(0, cfg.vocab_size, (7,))
    torch.testing.assert_close(_logits(load_checkpoint(tmp_path / "adapter"), ids), _logits(ours, ids),
                               atol=1e-5, rtol=0)
