"""The whole-layer CPU decode operator (astrai.infer.native_layer, astrai/kernels/cpu_layer.cpp) against
transformers' forward of every dense family, on every instruction set this machine runs, for float32, bf16,
int8 and int4 weights."""

import pytest
import torch

from astrai.infer import fused, native
from astrai.infer.engine import Engine, EngineOptions
from astrai.infer.request import SamplingParams
from astrai.model import load_model

KERNELS = native.kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="astrai's CPU kernels do not run here")
ISAS = [native.ISA_AVX2] + ([native.ISA_AVX512] if KERNELS and KERNELS.int8_isa == native.ISA_AVX512 else [])
DENSE = ["llama", "mistral", "qwen2", "qwen3", "gemma3_text"]


@pytest.fixture
def isa(request, monkeypatch):
    """Runs the kernels with the instruction set `request.param` (AVX2 on an AVX-512 machine: the AVX2 paths)."""
    k = native.Kernels(min(request.param, KERNELS.bf16_isa), request.param, f"test isa {request.param}")
    monkeypatch.setitem(native._STATE, "kernels", k)
    return request.param


@pytest.fixture
def layer_calls(monkeypatch):
    """(ran, rows) of each decode step's call of the operator (the Python layers run where it returns None)."""
    calls = []
    run = fused.FusedModel._native_layers

    def counted(self, x, *a):
        y = run(self, x, *a)
        calls.append((y is not None, x.shape[0]))
        return y

    monkeypatch.setattr(fused.FusedModel, "_native_layers", counted)
    return calls


def _family(name, tmp_path):
    from families import CASES, hf_model

    model = hf_model(name, seed=80 + list(CASES).index(name))
    model.save_pretrained(tmp_path)
    return model


def _prompts(seed):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 256, (9,), generator=g).tolist()
    return [shared + torch.randint(0, 256, (n,), generator=g).tolist() for n in (2, 8)] + [[7, 3, 5]]


def _engine(path, max_running=4, **opts):
    return Engine(load_model(path), options=EngineOptions(device="cpu", page_size=4, max_running=max_running, **opts))


PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)


def _assert_transformers_greedy(hf, prompts, outs):
    """Each generated token is transformers' argmax over the sequence before it, its log-probability
    transformers' within 1e-4."""
    from families import hf_logits

    for p, o in zip(prompts, outs):
        n = len(o.token_ids)
        ref = torch.log_softmax(hf_logits(hf, p + o.token_ids)[len(p) - 1:len(p) - 1 + n].double(), -1)
        assert ref.argmax(-1).tolist() == o.token_ids
        torch.testing.assert_close(torch.tensor([t.logprob for t in o.logprobs], dtype=torch.double),
                                   ref[range(n), o.token_ids], atol=1e-4, rtol=0)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("name", DENSE)
def test_decode_layer_gives_transformers_logprobs_for_every_dense_family(name, isa, tmp_path, layer_calls):
    """Greedy decode through the operator (biases, q/k norms, Gemma's norms, GELU, softmax scale and local RoPE,
    sliding windows of 8 passed by 20-token sequences; steps of 1 and 3 requests): each token is transformers'
    argmax over the sequence so far and its log-probability is transformers' within 1e-4."""
    hf = _family(name, tmp_path)
    engine = _engine(tmp_path, dtype="float32")
    assert all(s is not None for s in engine.runner.fused.native)
    prompts = _prompts(len(name))
    for batch in ([prompts[0]], prompts):
        outs = engine.generate(batch, PARAMS)
        _assert_transformers_greedy(hf, batch, outs)
    assert layer_calls and all(ran for ran, _ in layer_calls)


@needs_kernels
@pytest.mark.parametrize("name", ["llama", "gemma3_text"])
def test_steps_past_the_kernels_rows_multiply_with_torch_inside_the_operator(name, tmp_path, layer_calls):
    """Steps of 5 to 16 requests run the operator with torch's products (more rows than GEMV_ROWS): each request's
    greedy tokens and log-probabilities are still transformers' (1e-4)."""
    hf = _family(name, tmp_path)
    engine = _engine(tmp_path, max_running=8, dtype="float32")
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 14, 5, 11, 7)]
    outs = engine.generate(prompts, PARAMS)
    assert max(rows for _, rows in layer_calls) == 6 > native.GEMV_ROWS  # decode steps of all 6 requests
    _assert_transformers_greedy(hf, prompts, outs)
    assert layer_calls and all(ran for ran, _ in layer_calls)


def _python_layer(monkeypatch):
    monkeypatch.setattr(fused, "layer_spec", lambda w, model: None)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3_text"])
def test_bf16_decode_layer_follows_the_python_layer(name, isa, tmp_path, layer_calls, monkeypatch):
    """bf16 weights: the operator rounds each operation as torch's bf16 operations round, so its greedy tokens
    follow the Python layer's (the first three of each request held equal: a sum's order can move one bf16 ulp)
    and its log-probabilities stay within bf16's resolution of them."""
    _family(name, tmp_path)
    prompts = _prompts(3) + _prompts(4)  # steps of 6 rows (torch's products inside the operator) down to 1
    ours = _engine(tmp_path, max_running=8, dtype="bfloat16").generate(prompts, PARAMS)
    assert layer_calls and all(ran for ran, _ in layer_calls) and max(rows for _, rows in layer_calls) == 6
    _python_layer(monkeypatch)
    theirs = _engine(tmp_path, max_running=8, dtype="bfloat16").generate(prompts, PARAMS)
    for a, b in zip(ours, theirs):
        assert a.token_ids[:3] == b.token_ids[:3]
        assert abs(a.logprobs[0].logprob - b.logprobs[0].logprob) < 0.05


@needs_kernels
@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_decode_layer_equals_the_python_layer(quantize, tmp_path, layer_calls, monkeypatch):
    """int8 and int4 weights: the operator multiplies with the same kernels as the Python layer, so the greedy
    tokens are the same and the log-probabilities agree to float32 rounding."""
    if quantize == "int4" and not KERNELS.int4:
        pytest.skip("the int4 kernel needs AVX-512")
    _family("llama", tmp_path)
    prompts = _prompts(5)
    opts = dict(dtype="float32", quantize=quantize)
    ours = _engine(tmp_path, **opts).generate(prompts, PARAMS)
    assert layer_calls and all(ran for ran, _ in layer_calls)
    _python_layer(monkeypatch)
    theirs = _engine(tmp_path, **opts).generate(prompts, PARAMS)
    for a, b in zip(ours, theirs):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor([t.logprob for t in a.logprobs]),
                                   torch.tensor([t.logprob for t in b.logprobs]), atol=1e-4, rtol=0)


@needs_kernels
def test_layers_the_operator_does_not_cover_keep_the_python_layer(tmp_path):
    """Experts (Mixtral) have no operator: the spec is None and the engine decodes through the Python layer."""
    _family("mixtral", tmp_path)
    engine = _engine(tmp_path, dtype="float32")
    assert engine.runner.fused.native == [None] * len(engine.runner.fused.layers)
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 3
