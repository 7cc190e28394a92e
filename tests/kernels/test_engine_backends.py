"""The engine on the emulated CUDA kernels agrees with the engine on the torch backend (tiny model, CPU).

Also the backend wiring: on a machine without CuPy or a device the automatic choice is torch, and
forcing `cuda` raises BackendUnavailable with the reason.
"""

from __future__ import annotations

import random

import pytest
import torch

from astrai.infer import backend as backend_mod
from astrai.infer.backend import BackendUnavailable, attn_backend, select_backend
from astrai.infer.backends.cuda import CudaBackend
from astrai.infer.backends.torch_native import TorchBackend
from astrai.infer.engine import Engine, EngineOptions
from astrai.infer.request import SamplingParams
from astrai.model import CausalLM, ModelConfig

VOCAB = 512


@pytest.fixture
def emu_registered(monkeypatch, emu):
    monkeypatch.setitem(backend_mod.BACKENDS, "emu", "emu_backend:EmuBackend")
    monkeypatch.delenv(backend_mod.ENV_VAR, raising=False)


def _prompts(seed, n=4):
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(19)]
    return [shared + [rng.randrange(VOCAB) for _ in range(rng.choice([1, 6, 17]))] if i % 2 else
            [rng.randrange(VOCAB) for _ in range(rng.choice([2, 16, 33]))] for i in range(n)]


@pytest.mark.parametrize("page_size,chunk", [(1, None), (16, 16)])
def test_engine_greedy_on_emulated_kernels_equals_torch_backend(emu_registered, page_size, chunk):
    torch.manual_seed(2)
    model = CausalLM(ModelConfig.preset("tiny", initializer_range=0.2, eos_token_id=None, bos_token_id=None,
                                        max_position_embeddings=512)).eval()
    opts = dict(device="cpu", dtype="float32", page_size=page_size)
    if chunk:
        opts.update(max_step_tokens=chunk, max_running=4)  # chunked prefill: cached prefix + new tokens
    prompts = _prompts(page_size)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    with attn_backend("torch"):
        ref_engine = Engine(model, options=EngineOptions(**opts))
        ref = [o.token_ids for o in ref_engine.generate(prompts, params)]
    with attn_backend("emu"):
        engine = Engine(model, options=EngineOptions(**opts))
        assert type(engine.backend).__name__ == "EmuBackend"
        for _ in range(2):  # the second round hits the radix prefix cache
            assert [o.token_ids for o in engine.generate(prompts, params)] == ref


def test_prefill_logits_on_emulated_kernels_match_torch_backend(emu_registered):
    torch.manual_seed(3)
    model = CausalLM(ModelConfig.preset("tiny", max_position_embeddings=512)).eval()
    prompts = _prompts(9)
    logits = {}
    for name in ("torch", "emu"):
        with attn_backend(name):
            engine = Engine(model, options=EngineOptions(device="cpu", dtype="float32", page_size=4))
        reqs = [engine.add_request(p, SamplingParams(max_tokens=1)) for p in prompts]
        batch = engine.scheduler.schedule()  # deterministic: the same ragged batch for both backends
        assert len(batch.reqs) >= 2 and len(set(batch.q_lens)) > 1 and all(r in reqs for r in batch.reqs)
        logits[name] = engine.runner.forward(batch)
    torch.testing.assert_close(logits["emu"], logits["torch"], atol=2e-5, rtol=1e-5)


def test_auto_choice_without_a_device_is_torch_and_forcing_cuda_explains(monkeypatch):
    monkeypatch.delenv(backend_mod.ENV_VAR, raising=False)
    assert select_backend("cpu", torch.float16) is TorchBackend
    assert not CudaBackend.supports(torch.device("cpu"), torch.float16)[0]
    with attn_backend("cuda"), pytest.raises(BackendUnavailable, match="forces attention backend 'cuda'.*CUDA device"):
        select_backend("cpu", torch.float16)
    monkeypatch.setenv(backend_mod.ENV_VAR, "cuda")
    with pytest.raises(BackendUnavailable, match="ASTRAI_ATTN_BACKEND"):
        select_backend("cpu", torch.float32)
    if torch.cuda.is_available():
        assert CudaBackend.supports(torch.device("cuda"), torch.float64)[0] is False


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_greedy_on_cuda_equals_torch_backend(page_size, dtype):
    torch.manual_seed(4)
    model = CausalLM(ModelConfig.preset("tiny", initializer_range=0.2, eos_token_id=None, bos_token_id=None,
                                        max_position_embeddings=512)).eval()
    prompts = _prompts(page_size + 1, n=8)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    outs = {}
    for name in ("torch", "cuda"):
        with attn_backend(name):
            engine = Engine(model, options=EngineOptions(device="cuda", dtype=dtype, page_size=page_size))
            assert engine.backend.name == name
            outs[name] = [o.token_ids for o in engine.generate(prompts, params)]
    if dtype == "float32":
        assert outs["cuda"] == outs["torch"]
    else:  # bf16 rounding differs between SDPA and the kernels: allow a late divergence at a near-tie
        agree = sum(a[:8] == b[:8] for a, b in zip(outs["cuda"], outs["torch"]))
        assert agree >= len(prompts) - 1, outs


def test_a_head_dim_the_kernels_cannot_serve_is_refused_up_front(emu):
    caches = [torch.zeros(16, 2, 12)]
    with pytest.raises(BackendUnavailable, match="head_dim multiples of 8 up to 256, not 12"):
        CudaBackend(caches, caches, executor=emu)


def _wide_heads_model(heads: int, kv_heads: int, seed: int = 5):
    torch.manual_seed(seed)
    cfg = ModelConfig.preset("tiny", hidden_size=64, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             head_dim=256, initializer_range=0.2, eos_token_id=None, bos_token_id=None,
                             max_position_embeddings=256)
    return CausalLM(cfg).eval()


def test_head_dim_256_on_emulated_kernels_equals_torch_backend(emu_registered):
    """head_dim 256 with 8 query heads per KV head: the largest group whose block fits; prefill runs
    one token per block (8 rows), decode the 8 rows; greedy tokens equal the torch backend's."""
    from astrai.kernels.launch import prefill_tile_tokens

    assert prefill_tile_tokens(8, 256) == 1
    model = _wide_heads_model(8, 1)
    prompts = [p[:12] for p in _prompts(11, n=2)]
    params = SamplingParams(max_tokens=3, temperature=0.0)
    outs = {}
    for name in ("torch", "emu"):
        with attn_backend(name):
            engine = Engine(model, options=EngineOptions(device="cpu", dtype="float32", page_size=4))
            assert engine.backend.name == name
            outs[name] = [o.token_ids for o in engine.generate(prompts, params)]
    assert outs["emu"] == outs["torch"]


GEMMA_FULL = dict(family="gemma3_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="gelu_pytorch_tanh",
                  query_pre_attn_scalar=40.0, final_logit_softcapping=8.0, tie_word_embeddings=True,
                  initializer_range=0.2, eos_token_id=None, bos_token_id=None, max_position_embeddings=512)


def _per_backend(model, prompts, params) -> dict:
    """Greedy token ids of the same chunked, paged engine run on the torch backend and the emulated kernels."""
    outs = {}
    for name in ("torch", "emu"):
        with attn_backend(name):
            engine = Engine(model, options=EngineOptions(device="cpu", dtype="float32", page_size=4, max_step_tokens=16, max_running=4))
            outs[name] = [o.token_ids for o in engine.generate(prompts, params)]
    return outs


def test_the_kernels_take_a_models_softmax_scale(emu_registered):
    # Gemma 3 with only global layers: softmax scale query_pre_attn_scalar^-0.5, q/k norms, soft-capped logits
    torch.manual_seed(6)
    model = CausalLM(ModelConfig(**GEMMA_FULL)).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(0.0, 0.3)
    prompts = _prompts(5)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outs = _per_backend(model, prompts, params)
    assert outs["emu"] == outs["torch"]
    plain = CausalLM(model.config.replace(query_pre_attn_scalar=None)).eval()
    plain.load_state_dict(model.state_dict())
    with attn_backend("torch"):
        engine = Engine(plain, options=EngineOptions(device="cpu", dtype="float32", page_size=4))
        assert [o.token_ids for o in engine.generate(prompts, params)] != outs["torch"]  # the scale matters here


def test_sliding_windows_on_the_emulated_kernels_equal_the_torch_backend(emu_registered):
    # Gemma 3 local (window 6) and global layers, decode well past the window, chunked prefill
    torch.manual_seed(7)
    cfg = ModelConfig(**GEMMA_FULL).replace(sliding_window=6, layer_types=("sliding_attention", "full_attention"),
                                            local_rope={"rope_theta": 500.0, "rope_type": "default"})
    model = CausalLM(cfg).eval()
    prompts = _prompts(8)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    outs = _per_backend(model, prompts, params)
    assert outs["emu"] == outs["torch"]


def test_a_group_whose_block_does_not_fit_is_decided_at_engine_construction(emu_registered, monkeypatch):
    """16 query heads per KV head at head_dim 256 need 101,120 B of shared memory per block: the
    kernels are never launched for it. Forced, the engine refuses before any request; chosen
    automatically, the engine takes the torch backend; the launch plans refuse it too."""
    from astrai.kernels.launch import MAX_ATTN_SMEM, attention_shape_problem, attn_smem_bytes

    assert attn_smem_bytes(16, 256) == 101_120 > MAX_ATTN_SMEM >= attn_smem_bytes(8, 256)
    assert "16 query heads per KV head at head_dim 256 need 101120 B" in attention_shape_problem(16, 1, 256)
    assert attention_shape_problem(8, 1, 256) is None and attention_shape_problem(32, 2, 256) is not None
    model = _wide_heads_model(16, 1)
    with attn_backend("emu"), pytest.raises(BackendUnavailable, match="forces attention backend 'emu'.*101120 B"):
        Engine(model, options=EngineOptions(device="cpu", dtype="float32"))
    # the automatic order with the (emulated) cuda kernels first: wide groups fall back, others do not
    monkeypatch.setattr(backend_mod, "BACKENDS", {"emu": "emu_backend:EmuBackend", **backend_mod.BACKENDS})
    assert Engine(model, options=EngineOptions(device="cpu", dtype="float32")).backend.name == "torch"
    assert Engine(_wide_heads_model(8, 1), options=EngineOptions(device="cpu", dtype="float32")).backend.name == "emu"


def test_launch_plans_refuse_a_block_above_the_shared_memory_limit(emu):
    from astrai.kernels import launch

    hkv, d = 1, 256
    caches = torch.zeros(8, hkv, d)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    q = torch.zeros(2, 16, d)
    with pytest.raises(ValueError, match="16 query heads per KV head at head_dim 256 need 101120 B"):
        launch.prefill_launch(q, caches, caches, i32([0, 2]), i32([0, 1]), i32([0]), i32([2]), 8, 2, q)
    with pytest.raises(ValueError, match="need 101120 B"):
        launch.decode_launches(q[:1], caches, caches, i32([0, 1]), i32([0]), i32([2]), 8, 2, q[:1], emu)
    with pytest.raises(ValueError, match="need .* B of shared memory per block \\(64 rows\\)"):
        launch.prefill_launch(q[:, :8], caches, caches, i32([0, 2]), i32([0, 1]), i32([0]), i32([2]), 8, 2, q[:, :8],
                              tile_tokens=8)


def test_a_model_the_kernels_cannot_serve_goes_to_torch(emu_registered, monkeypatch):
    monkeypatch.setattr(backend_mod, "BACKENDS", {"emu": backend_mod.BACKENDS["emu"], "torch": backend_mod.BACKENDS["torch"]})
    assert select_backend("cpu", torch.float32, ModelConfig(**GEMMA_FULL)).name == "emu"  # the kernels first
    odd = ModelConfig.preset("tiny", head_dim=12)
    assert select_backend("cpu", torch.float32, odd) is TorchBackend
    with attn_backend("emu"), pytest.raises(BackendUnavailable, match="head_dim multiples of 8 up to 256, not 12"):
        select_backend("cpu", torch.float32, odd)
    assert Engine(CausalLM(odd).eval(), options=EngineOptions(device="cpu", dtype="float32")).backend.name == "torch"
