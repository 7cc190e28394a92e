"""Frozen weights' casts under bf16-mixed (astrai.model.casts) and the LoRA forward that uses them, against
autocast's own products."""

import torch
import torch.nn as nn

from astrai.model.casts import frozen_cast
from astrai.model.lora import LoraLinear, LoraSpec


def test_a_frozen_cast_is_made_once_and_again_when_the_weight_changes():
    w = torch.randn(8, 4)
    a = frozen_cast(w, torch.bfloat16)
    assert a.dtype == torch.bfloat16 and torch.equal(a, w.to(torch.bfloat16))
    assert frozen_cast(w, torch.bfloat16) is a  # held, not cast again
    w.mul_(3)  # changed in place: the version counter moved
    b = frozen_cast(w, torch.bfloat16)
    assert b is not a and torch.equal(b, w.to(torch.bfloat16))
    w.data = torch.randn(8, 4)  # replaced: the data pointer moved
    assert torch.equal(frozen_cast(w, torch.bfloat16), w.to(torch.bfloat16))
    assert frozen_cast(w, torch.float32) is w


def test_lora_under_autocast_is_autocasts_product_of_the_same_bf16_operands():
    """The bf16-mixed LoRA forward (cast base kept, scale on the rank-r product, addmm) against PEFT's formula run
    by autocast itself, in float64 from the same bf16-rounded operands: within bf16's rounding of the results; the
    gradients of A and B likewise."""
    torch.manual_seed(0)
    base = nn.Linear(64, 48, bias=True).requires_grad_(False)
    layer = LoraLinear(base, LoraSpec(rank=8, alpha=16.0, targets=("q_proj",)))
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    x = torch.randn(2, 5, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 5, 48)
    bf = lambda t: t.detach().to(torch.bfloat16).double()  # noqa: E731
    a = bf(x) @ bf(layer.lora_A.weight).t()
    ref = bf(x) @ bf(base.weight).t() + bf(base.bias) + (bf(a) * 2.0) @ bf(layer.lora_B.weight).t()
    assert ((y.double() - ref).abs() <= 2.0 ** -7 * ref.abs() + 1e-2).all()
    y.float().sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # PEFT's formula under autocast: the same gradients
        ga, gb = layer.lora_A.weight.grad.clone(), layer.lora_B.weight.grad.clone()
        layer.zero_grad()
        (base(x) + layer.lora_B(layer.lora_A(x)) * layer.scaling).float().sum().backward()
    torch.testing.assert_close(ga, layer.lora_A.weight.grad, rtol=2.0 ** -6, atol=1e-2)
    torch.testing.assert_close(gb, layer.lora_B.weight.grad, rtol=2.0 ** -6, atol=1e-2)


def test_lora_outside_autocast_keeps_peft_order():
    torch.manual_seed(1)
    base = nn.Linear(16, 12).requires_grad_(False)
    layer = LoraLinear(base, LoraSpec(rank=4, alpha=8.0, targets=("q_proj",)))
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    x = torch.randn(3, 16)
    torch.testing.assert_close(layer(x), base(x) + layer.lora_B(layer.lora_A(x)) * 2.0, rtol=0, atol=0)
