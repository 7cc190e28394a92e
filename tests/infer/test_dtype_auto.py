"""The engine's `dtype: auto`: bfloat16 only where bf16 products are faster, float32 elsewhere; the choice
is said; a bf16 engine's weights, K/V and greedy tokens against float32's."""

import pytest
import torch

from astrai.config.infer import EngineOptions, SamplingParams
from astrai.infer.budget import resolve_dtype
from astrai.infer.engine import Engine
from astrai.model.config import ModelConfig
from astrai.model.transformer import CausalLM
from astrai.runtime import hardware

CPU = torch.device("cpu")


@pytest.mark.parametrize("flags, want", [
    (frozenset({"avx2", "avx512f"}), torch.float32),
    (frozenset({"avx2", "avx512f", "avx512_bf16"}), torch.bfloat16),
    (frozenset({"avx2", "amx_tile", "amx_bf16"}), torch.bfloat16),
])
def test_auto_takes_bf16_only_on_a_cpu_with_bf16_dot_products(monkeypatch, flags, want):
    monkeypatch.setattr(hardware, "cpu_flags", lambda *a, **k: flags)
    dtype, why = resolve_dtype("auto", CPU, torch.float32)
    assert dtype == want and why.startswith("dtype auto: ")
    assert ("cpu has avx512_bf16" in why or "cpu has amx_bf16" in why) == (want == torch.bfloat16), why


def test_an_explicit_dtype_is_kept_whatever_the_cpu(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_flags", lambda *a, **k: frozenset({"avx512_bf16"}))
    assert resolve_dtype("float32", CPU, torch.bfloat16) == (torch.float32, "dtype float32 as asked")
    monkeypatch.setattr(hardware, "cpu_flags", lambda *a, **k: None)  # flags unreadable: no bf16 assumed
    assert resolve_dtype("auto", CPU, torch.bfloat16)[0] == torch.float32


def _model():
    torch.manual_seed(0)
    c = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return CausalLM(c).eval()


def test_a_bf16_engine_computes_in_bf16_and_follows_fp32_greedy(monkeypatch):
    # a CPU with bf16 dot products (faked: this test runs anywhere; bf16 products are only slower without them)
    monkeypatch.setattr(hardware, "cpu_flags", lambda *a, **k: frozenset({"avx512_bf16"}))
    ref = Engine(_model(), options=EngineOptions(device="cpu", dtype="float32", kv_cache_tokens=512))
    eng = Engine(_model(), options=EngineOptions(device="cpu", kv_cache_tokens=512))
    assert eng.dtype == torch.bfloat16 and "avx512_bf16" in eng.dtype_reason
    assert eng.backend.k_cache[0].dtype == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 for t in (eng.runner.fused.layers[0].qkv_t, eng.runner.fused.packed.head_t))
    prompts = [[1, 5, 9, 13, 2], [7, 7, 3], [40, 41, 42, 43, 44, 45, 46]]
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    a = [c.token_ids for c in ref.generate(prompts, [p] * 3)]
    b = [c.token_ids for c in eng.generate(prompts, [p] * 3)]
    # bf16 keeps 8 bits of mantissa: greedy may part where two logits are within ~2^-8 relative of each other,
    # never at the first token of these random-weight prompts (their top two logits are far apart)
    for x, y in zip(a, b):
        assert x[0] == y[0], (x, y)


def test_bf16_weights_keep_a_float32_residual_stream_on_the_cpu(monkeypatch):
    """Every layer's input and output (the residual) is float32 under bf16 weights on the CPU, while the
    weights, K/V and the returned hidden state are bf16; the greedy token and its log-prob follow float32's
    (the real model's case, where a bf16 residual flipped an answer: tests/model/test_real_model.py)."""
    from astrai.infer.fused import FusedModel

    ref = Engine(_model(), options=EngineOptions(device="cpu", dtype="float32", kv_cache_tokens=512))
    eng = Engine(_model(), options=EngineOptions(device="cpu", dtype="bfloat16", kv_cache_tokens=512))
    fused = eng.runner.fused
    assert fused.stream == torch.float32 and fused.wdtype == torch.bfloat16
    assert eng.backend.k_cache[0].dtype == torch.bfloat16
    seen, layer, forward, native = [], FusedModel._layer, FusedModel.__call__, FusedModel._native_layers

    def spy_layer(self, i, w, x, *rest):
        out = layer(self, i, w, x, *rest)
        seen.append((x.dtype, out.dtype))
        return out

    def spy_native(self, x, *rest):  # a decode step's layers in one call of astrai's CPU operator, where built
        out = native(self, x, *rest)
        if out is not None:
            seen.append((x.dtype, out.dtype))
        return out

    def spy_forward(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        seen.append(("hidden", out.dtype))
        return out

    prompt = [3, 5, 9, 13, 2, 3, 40, 41]
    p = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, ignore_eos=True)
    monkeypatch.setattr(FusedModel, "_layer", spy_layer)
    monkeypatch.setattr(FusedModel, "_native_layers", spy_native)
    monkeypatch.setattr(FusedModel, "__call__", spy_forward)
    got = eng.generate([prompt], p)[0]
    monkeypatch.undo()
    layers = [d for d in seen if d[0] != "hidden"]
    # the prefill's 2 layers, then 3 decode steps: 2 layers each, or one call of the operator each
    assert len(layers) in (2 * 4, 2 + 3) and all(d == (torch.float32, torch.float32) for d in layers), seen
    assert [d for d in seen if d[0] == "hidden"] == [("hidden", torch.bfloat16)] * 4
    want = ref.generate([prompt], p)[0]
    assert got.token_ids[0] == want.token_ids[0]
    # one bf16 rounding of the weights, the products' inputs and outputs: a few 2^-9 relative on logits of
    # size ~1 (the whole model is two layers), far below the gap to a wrong token here
    assert abs(got.logprobs[0].logprob - want.logprobs[0].logprob) < 0.05
