"""Quantized generation (astrai.infer.quantized, EngineOptions.quantize): each product against a slow
reference (int8: the integer arithmetic of a dynamic int8 linear done by hand; int4: torchao's own
dequantization of the group codes times float32 activations) and within the error its format allows of
the float32 product; the fused forward on quantized weights against the model's own forward on the
dequantized weights; LoRA adapters served over a quantized base; the flag through generate and eval;
refusals naming the tensor and the size."""

import json
import os
import sys

import pytest
import torch

pytest.importorskip("torchao")

from astrai.cli import main  # noqa: E402
from astrai.config.infer import EngineOptions, SamplingParams  # noqa: E402
from astrai.infer.engine import Engine  # noqa: E402
from astrai.infer.fused import FusedModel  # noqa: E402
from astrai.infer.quantized import quantize_weight  # noqa: E402
from astrai.model import CausalLM, ModelConfig, load_model, save_model  # noqa: E402
from astrai.model.quant import QuantError  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "model"))
from test_real_model import smollm2_data  # noqa: E402,F401  (the bundled chats in SmolLM2's template)

# every dimension a multiple of the int4 group (64)
CFG = ModelConfig.preset("tiny", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)


def _weight(out, inp, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, inp, generator=g, dtype=torch.float32) * 0.05


def _int8_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A dynamic int8 linear by hand: x to unsigned 7 bits with one affine scale over the whole input
    (its range widened to hold 0, the zero point rounded to an integer code), exact integer sums with the
    weight's codes, then both scales."""
    lo, hi = min(x.min().item(), 0.0), max(x.max().item(), 0.0)
    s = (hi - lo) / 127
    zp = int(min(max(round(-lo / s), 0), 127))
    xq = (torch.round(x.double() / s) + zp).clamp(0, 127).long()
    acc = (xq - zp) @ codes.long().t()  # int64: exact
    return acc.double() * s * scales.double()[None, :]


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_int8_product_is_the_dequantized_weight_times_float32_within_half_a_step(rows):
    w, bias = _weight(96, 64), torch.randn(96) * 0.1
    q = quantize_weight([(w, None)], "int8", "w")
    codes, scales = q.layer.weight_int8, q.layer.scales
    deq = codes.double() * scales.double()[:, None]  # symmetric per channel, by hand
    x = torch.randn(rows, 64)
    got = q.product(x, bias.clone()).double()
    ref = x.double() @ deq.t() + bias.double()
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert ((w.double() - deq).abs() <= scales.double()[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_int4_product_is_torchaos_dequantized_weight_times_float32(rows):
    from torchao.quantization.utils import groupwise_affine_dequantize_tensor_from_qparams, \
        groupwise_affine_quantize_tensor

    w = _weight(128, 192, seed=1)
    q = quantize_weight([(w[:64], None), (w[64:], None)], "int4", "w")  # two parts, concatenated
    codes, scales_zeros = groupwise_affine_quantize_tensor(w, 4, 32, torch.float32)
    scales, zeros = scales_zeros[..., 0].t(), scales_zeros[..., 1].t()
    deq = groupwise_affine_dequantize_tensor_from_qparams(codes, scales, zeros, 4, 32)  # [out, in]
    x = torch.randn(rows, 192)
    ref = x.double() @ deq.double().t()
    got = q.product(x).double()
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    # the format: a weight is at most half a step of its group from its code's value
    step = scales.double().repeat_interleave(32, dim=1)  # [out, in]
    assert ((w.double() - deq.double()).abs() <= step / 2 + 1e-6).all()
    assert torch.allclose(q.dequantize().double(), deq.double().t(), atol=1e-6)


def test_a_dimension_not_divisible_by_the_group_is_refused_naming_tensor_and_size(tmp_path, capsys):
    with pytest.raises(QuantError, match=r"^w: input dimension 80 is not a multiple of the int4 group size 32"):
        quantize_weight([(_weight(64, 80), None)], "int4", "w")
    odd = ModelConfig.preset("tiny", vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2)
    save_model(CausalLM(odd), tmp_path / "ckpt")
    rc = main(["generate", str(tmp_path / "ckpt"), "--prompt", "hi", "--quantize", "int4", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc != 0
    assert "error: model.layers.0.self_attn.q_proj/k_proj/v_proj: input dimension 48 is not a multiple of the " \
           "int4 group size 32" in err and "Traceback" not in err


def test_an_int4_output_size_torch_cannot_pack_is_refused_naming_tensor_and_size(tmp_path, capsys):
    """torch's CPU int4 packing takes output sizes in tiles of 16: a vocabulary of 32001-style sizes under
    --quantize-head is refused in one line (int8 takes it)."""
    with pytest.raises(QuantError, match=r"^w: output dimension 50 is not a multiple of 16"):
        quantize_weight([(_weight(50, 64), None)], "int4", "w")
    assert quantize_weight([(_weight(50, 64), None)], "int8", "w") is not None
    odd = ModelConfig.preset("tiny", vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2)
    save_model(CausalLM(odd), tmp_path / "ckpt")
    rc = main(["generate", str(tmp_path / "ckpt"), "--prompt", "hi", "--quantize", "int4", "--quantize-head",
               "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc != 0 and "output dimension 97 is not a multiple of 16" in err and "Traceback" not in err, err


def test_what_quantized_weights_cannot_run_on_is_refused():
    with pytest.raises(ValueError, match="quantized weights multiply float32 activations; use dtype float32"):
        EngineOptions(quantize="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="compiled decode"):
        EngineOptions(quantize="int4", compile=True)
    with pytest.raises(ValueError, match="quantize_head needs quantize"):
        EngineOptions(quantize_head=True)
    from astrai.infer.quantized import check_engine

    with pytest.raises(ValueError, match="CPU engine only"):
        check_engine("int8", torch.device("cuda"), torch.float32)


def _dequantized_model(model, fused, ref=None):
    """A copy of `model` (or `ref`, in place) whose projections hold the values the quantized weights
    multiply by (a LoRA projection's base layer, its adapter left as it is)."""
    if ref is None:
        ref = CausalLM(model.config)
        ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        for i, (w, layer) in enumerate(zip(fused.layers, ref.model.layers)):
            a, m = layer.self_attn, layer.mlp
            qkv = w.qkv_t.dequantize().t()
            sizes = [_base(p).out_features for p in (a.q_proj, a.k_proj, a.v_proj)]
            for proj, part in zip((a.q_proj, a.k_proj, a.v_proj), qkv.split(sizes)):
                _base(proj).weight.copy_(part)
            _base(a.o_proj).weight.copy_(w.o_t.dequantize().t())
            gate, up = w.gate_up_t.dequantize().t().chunk(2)
            _base(m.gate_proj).weight.copy_(gate)
            _base(m.up_proj).weight.copy_(up)
            _base(m.down_proj).weight.copy_(w.down_t.dequantize().t())
        if fused.quantize_head:
            ref.lm_head.weight = torch.nn.Parameter(fused.packed.head_t.dequantize().t().contiguous())
    return ref.eval()


def _base(proj):
    return getattr(proj, "base_layer", proj)


def _logits(model, ids):
    from astrai.infer.perplexity import DocumentContext  # causal attention over one document, for both forwards

    with torch.inference_mode():
        return model.logits(model(ids, torch.arange(len(ids)), DocumentContext([len(ids)])))


@pytest.mark.parametrize("rows", [1, 9, 200])  # a decode step, a small batch, more rows than are split
@pytest.mark.parametrize("head", [False, True])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_fused_forward_is_the_model_on_its_dequantized_weights(rows, head, kind):
    torch.manual_seed(0)
    model = CausalLM(CFG).eval()
    fused = FusedModel(model, kind, head)
    ids = torch.randint(0, CFG.vocab_size, (rows,))
    got = _logits(fused, ids)
    want = _logits(_dequantized_model(model, fused), ids)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    assert not torch.allclose(got, _logits(model, ids), atol=1e-4)  # the weights are quantized


def test_lora_adapters_over_a_quantized_base(tmp_path):
    """The adapters' terms are added to the quantized base's products: the same as the model on the
    dequantized base with the adapter merged in float32."""
    from astrai.model.adapter_files import save_adapter
    from astrai.model.lora import LoraSpec, apply_lora, lora_layers

    torch.manual_seed(0)
    save_model(CausalLM(CFG), tmp_path / "base")
    model = load_model(tmp_path / "base")
    apply_lora(model, LoraSpec(4, 8.0), base=str(tmp_path / "base"))
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.weight.normal_(0, 0.3)
    save_adapter(model, tmp_path / "a")
    opts = EngineOptions(device="cpu", dtype="float32", kv_cache_tokens=512, page_size=4, quantize="int4")
    engine = Engine.from_checkpoint(tmp_path / "base", opts, adapters={"a": tmp_path / "a"})
    prompt, params = [1, 5, 9, 13, 2, 7], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = engine.generate([prompt, prompt], params, adapters=["a", None])
    fused = engine.runner.fused
    refs = (_dequantized_model(model, fused, model).eval(), _dequantized_model(engine.model, fused))
    for out, m in zip(got, refs):  # the adapter's own forward (base + s B A x) on the dequantized base
        ids = list(prompt)
        for _ in range(8):
            ids.append(int(_logits(m, torch.tensor(ids))[-1].argmax()))
        assert out.token_ids == ids[len(prompt):]
    assert got[0].token_ids != got[1].token_ids


def test_the_flag_reaches_generate_and_eval(checkpoint, tmp_path, capsys):
    rc = main(["generate", str(checkpoint), "--prompt", "hello world", "--max-tokens", "5", "--temperature", "0",
               "--ignore-eos", "--device", "cpu", "--quantize", "int8", "--quantize-head"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "weights int8 (LM head too)" in err
    engine = Engine.from_checkpoint(checkpoint, EngineOptions(device="cpu", dtype="float32", quantize="int8", quantize_head=True))
    ref = engine.generate(["hello world"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert out == ref.text + "\n"
    assert isinstance(engine.runner.fused.packed.head_t, object) and engine.runner.fused.quantize == "int8"


@pytest.mark.slow
def test_perplexity_of_the_real_model_within_the_bounds(smollm2, smollm2_data):
    """Held-out chats in SmolLM2's template: int8 within 1% of float32's perplexity, int4 within 5%."""
    from astrai.data.load import ShardDataset
    from astrai.infer.perplexity import perplexity

    torch.set_num_threads(2)
    data = ShardDataset(str(smollm2_data["val"]))
    model = load_model(smollm2).float().eval()
    ppl = {q: perplexity(FusedModel(model, q), data)["perplexity"] for q in (None, "int8", "int4")}
    assert ppl["int8"] != ppl[None] and ppl["int4"] != ppl[None]
    assert abs(ppl["int8"] / ppl[None] - 1) <= 0.01, ppl
    assert abs(ppl["int4"] / ppl[None] - 1) <= 0.05, ppl
