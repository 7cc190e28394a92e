"""Weight-only quantization (astrai.model.quant): NF4 against a slow reference written from the QLoRA
paper (code book, block absmax, double-quantized scales) and against torchao's own `to_nf4`; int8 and
int4 against hand-computed scales and torchao's dequantizer; forwards equal dequantized @ x; sizes
that do not divide the block or group are refused by name; `.to(dtype)` never dequantizes the codes."""

import pytest
import torch
import torch.nn as nn

pytest.importorskip("torchao")

from astrai.model.quant import (NF4_CODE_BOOK, Int4Linear, Int8Linear, NF4Linear, QuantError, nf4_dequantize,  # noqa: E402
                                quantize_layers, quantize_linear, quantized_bytes, to_nf4)


def _slow_nf4(w: torch.Tensor, block=64, scaler_block=None):
    """QLoRA's NF4, element by element: per block of 64 the absmax c; each weight's code is the nearest
    code-book value to w / c; the block absmaxes are double-quantized: their mean m is taken out and each
    group of scaler_block of them is scaled by 256 / (2 * max |c - m|) and rounded to int8."""
    flat = w.flatten().tolist()
    n_blocks = len(flat) // block
    absmax = [max(abs(v) for v in flat[b * block:(b + 1) * block]) for b in range(n_blocks)]
    scaler_block = scaler_block or n_blocks
    mean = sum(absmax) / n_blocks
    centred = [a - mean for a in absmax]
    scales = []
    for g in range(n_blocks // scaler_block):
        part = centred[g * scaler_block:(g + 1) * scaler_block]
        factor = 256 / (2 * max(abs(c) for c in part))
        scales += [max(-128, min(127, round(c * factor))) / factor + mean for c in part]
    out = []
    for i, v in enumerate(flat):
        b = i // block
        code = min(range(16), key=lambda k: (abs(v / absmax[b] - NF4_CODE_BOOK[k]), k))
        out.append(NF4_CODE_BOOK[code] * scales[b])
    return torch.tensor(out, dtype=torch.float64).view(w.shape)


def test_nf4_dequantization_equals_the_papers_slow_reference():
    torch.manual_seed(0)
    w = torch.randn(8, 128) * 0.05  # 16 blocks of 64: one group of 16 scales
    got = nf4_dequantize(to_nf4(w))
    torch.testing.assert_close(got.double(), _slow_nf4(w), atol=1e-6, rtol=1e-6)
    # the error of 4 bits: at most half the widest code-book gap times the block absmax (plus the scale's rounding)
    gap = max(b - a for a, b in zip(NF4_CODE_BOOK, NF4_CODE_BOOK[1:]))
    assert float((got - w).abs().max()) <= gap / 2 * float(w.abs().max()) * 1.05


def test_nf4_codes_are_torchaos():
    from torchao.quantization import to_nf4 as torchao_to_nf4

    torch.manual_seed(1)
    for shape, scaler_block in (((192, 576), 216), ((64, 256), 256)):  # 1728 blocks: 256 does not divide them
        w = torch.randn(*shape) * 0.02
        ours, theirs = to_nf4(w), torchao_to_nf4(w, 64, scaler_block)
        assert ours.scaler_block_size == scaler_block
        assert torch.equal(ours.quantized_data, theirs.quantized_data)
        assert torch.equal(ours.quantized_scalers, theirs.quantized_scalers)
        assert torch.equal(nf4_dequantize(ours), theirs.get_original_weight())


@pytest.mark.parametrize("kind", ["nf4", "int8", "int4"])
def test_forward_is_dequantized_weight_times_x_and_grads_flow_to_x(kind):
    torch.manual_seed(2)
    lin = nn.Linear(128, 48, bias=True)
    q = quantize_linear(lin, kind, "layer")
    x = torch.randn(2, 5, 128, requires_grad=True)
    y = q(x)
    w = q.dequantize()
    assert w.shape == (48, 128) and w.dtype == torch.float32
    torch.testing.assert_close(y, x @ w.T + lin.bias, atol=1e-4, rtol=1e-4)
    if kind == "nf4":  # the QLoRA path trains through the frozen layer
        y.sum().backward()
        torch.testing.assert_close(x.grad, torch.ones(2, 5, 48) @ w, atol=1e-4, rtol=1e-4)
    assert not any(p.requires_grad for p in q.parameters())


def test_int8_is_symmetric_per_channel():
    torch.manual_seed(3)
    lin = nn.Linear(64, 16, bias=False)
    w = lin.weight.detach()
    scale = w.abs().amax(1, keepdim=True) / 127.5  # by hand: absmax over half the int8 range, per output row
    expect = (w * (1 / scale)).round().clamp(-128, 127) * scale  # times the reciprocal, as torchao rounds
    torch.testing.assert_close(Int8Linear(lin, "l").dequantize(), expect, atol=1e-7, rtol=1e-6)


def test_int4_dequantizes_as_torchao_and_within_half_a_step():
    from torchao.quantization.utils import groupwise_affine_dequantize_tensor, groupwise_affine_quantize_tensor

    torch.manual_seed(4)
    lin = nn.Linear(128, 32, bias=False)
    w = lin.weight.detach()
    q = Int4Linear(lin, "l", group_size=64)
    codes, sz = groupwise_affine_quantize_tensor(w, 4, 64, torch.float32)
    torch.testing.assert_close(q.dequantize(), groupwise_affine_dequantize_tensor(codes, sz, 4, 64), atol=1e-6, rtol=0)
    step = (w.view(32, 2, 64).amax(-1) - w.view(32, 2, 64).amin(-1)) / 15  # the grid spacing of each group
    err = (q.dequantize() - w).abs().view(32, 2, 64).amax(-1)
    assert bool((err <= step / 2 + 1e-6).all())


@pytest.mark.parametrize("kind,size", [("nf4", 100), ("int4", 96)])
def test_a_size_that_does_not_divide_is_refused_by_name(kind, size):
    with pytest.raises(QuantError, match=rf"model\.layers\.0\.mlp\.down_proj: input dimension {size} .*"
                                         rf"{64 if kind == 'nf4' else 64}"):
        quantize_linear(nn.Linear(size, 8), kind, "model.layers.0.mlp.down_proj")


def test_quantize_layers_checks_every_layer_before_changing_any():
    from astrai.model import CausalLM, ModelConfig

    m = CausalLM(ModelConfig.preset("tiny", intermediate_size=96))  # down_proj's input 96: not a multiple of 64
    with pytest.raises(QuantError, match=r"model\.layers\.0\.mlp\.down_proj: input dimension 96"):
        quantize_layers(m, "nf4", ("q_proj", "down_proj"))
    assert isinstance(m.model.layers[0].self_attn.q_proj, nn.Linear)  # untouched
    names = quantize_layers(m, "int4", ("q_proj", "o_proj"), group_size=32)
    assert names == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "o_proj")]
    assert isinstance(m.lm_head, nn.Linear) and isinstance(m.model.embed_tokens, nn.Embedding)  # left as they are


def test_module_to_dtype_keeps_the_nf4_codes_and_storage_is_counted():
    torch.manual_seed(5)
    lin = nn.Linear(256, 64, bias=False)
    q = NF4Linear(lin, "l")
    before = q.dequantize().clone()
    q.to(torch.float64)
    assert type(q.weight).__name__ == "NF4Tensor" and torch.equal(q.dequantize(), before)
    assert q(torch.randn(3, 256, dtype=torch.float64)).dtype == torch.float64
    # 4 bits per weight + an int8 scale per 64 + a float32 factor per scale group + the mean + the code book
    assert quantized_bytes(nn.Sequential(q)) == 256 * 64 // 2 + 256 + 4 + 4 + 16 * 4
