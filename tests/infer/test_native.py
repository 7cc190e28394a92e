"""astrai's CPU product kernels (astrai.infer.native, astrai/kernels/cpu_gemv.cpp) against float64 products of
the same values, on every instruction set this machine runs, and how the engine uses them."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from astrai.cache import cache_root
from astrai.infer import native
from astrai.model import quant
from astrai.runtime.hardware import cpu_flags

KERNELS = native.kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="astrai's CPU kernels do not run here (not x86 AVX2, "
                                                          "no compiler, or ASTRAI_NATIVE=0)")
FLAGS = cpu_flags() or frozenset()
# the instruction sets to test: AVX2 everywhere the kernels run, AVX-512 (BF16 for bf16) where the CPU has it
BF16_ISAS = [native.ISA_AVX2] + ([native.ISA_AVX512] if KERNELS and KERNELS.bf16_isa == 2 else [])
INT8_ISAS = [native.ISA_AVX2] + ([native.ISA_AVX512] if KERNELS and KERNELS.int8_isa == 2 else [])
# (M rows, K, N): one row to more than a tile of rows (4), K and N with tails past every vector width
SHAPES = [(1, 576, 960), (2, 1536, 576), (3, 37, 13), (4, 100, 6), (5, 64, 7), (9, 33, 17)]


def _bound(x, w, ref, k, out_bits=None):
    """What float32 sums of k products may be off by (k * 2^-24 of the sum of |terms|, twice for safety),
    plus half an ulp of the result's format when it is rounded (bf16: 2^-8 relative)."""
    slack = 2 * k * 2.0 ** -24 * (x.abs() @ w.abs().t())
    return slack + (ref.abs() * 2.0 ** -out_bits if out_bits else 0) + 1e-30


@needs_kernels
@pytest.mark.parametrize("isa", BF16_ISAS)
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_bf16_product_is_the_float64_product_rounded_once(isa, m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    ref = x.double() @ w.double().t()
    y = torch.ops.astrai.gemv_bf16(x, w, isa, 4)  # more than 4 rows: torch's product, the same contract
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert ((y.double() - ref).abs() <= _bound(x.double(), w.double(), ref, k, 8)).all()


@needs_kernels
@pytest.mark.parametrize("isa", INT8_ISAS)
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_float32_product_is_the_float64_product_to_float32_sums(isa, m, k, n):
    g = torch.Generator().manual_seed(m * 31 + k + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    ref = x.double() @ w.double().t()
    y = torch.ops.astrai.gemv_f32(x, w, isa, 4)  # more than 4 rows: torch's product, the same contract
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert ((y.double() - ref).abs() <= _bound(x.double(), w.double(), ref, k)).all()


@needs_kernels
@pytest.mark.parametrize("isa", INT8_ISAS)
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_int8_product_is_torchs_weight_only_product(isa, m, k, n):
    g = torch.Generator().manual_seed(m + k * 7 + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, generator=g) + 0.01
    ref = (x.double() @ w.double().t()) * scales.double()
    y = torch.ops.astrai.gemv_int8(x, w, scales, isa)
    assert y.dtype == torch.float32
    assert ((y.double() - ref).abs() <= _bound(x.double(), w.double(), ref, k) * scales.double() + 1e-6 * ref.abs()).all()
    # and torch's own kernel agrees to the same bound (the reference the engine used before)
    t = torch._weight_int8pack_mm(x, w, scales)
    assert ((t.double() - ref).abs() <= _bound(x.double(), w.double(), ref, k) * scales.double() + 1e-6 * ref.abs()).all()


@needs_kernels
@pytest.mark.skipif(not (KERNELS and KERNELS.int4), reason="the int4 kernel needs AVX-512")
@pytest.mark.parametrize("m", [1, 2, 4, 7])
def test_int4_product_multiplies_the_weights_torch_dequantizes(m):
    g = torch.Generator().manual_seed(m)
    w = torch.randn(48, 96, generator=g)
    shell = nn.Linear(96, 48, bias=False)
    shell.weight.data = w
    deq = quant.Int4Linear(shell, "t", 32).dequantize().double()  # torch's reading of the same codes
    codes, scales, offsets = native.int4_layout(*quant.int4_grid(w, 32, "t"))
    x = torch.randn(m, 96, generator=g)
    ref = x.double() @ deq.t()
    y = torch.ops.astrai.gemv_int4(x, codes, scales, offsets)
    assert ((y.double() - ref).abs() <= _bound(x.double(), deq, ref, 96) + 1e-5 * deq.abs().max()).all()


@pytest.mark.parametrize("flags, bf16, int8", [
    ({"avx2", "fma"}, native.ISA_AVX2, native.ISA_AVX2),
    ({"avx2", "fma", "avx512f", "avx512bw"}, native.ISA_AVX2, native.ISA_AVX512),  # AVX-512 without BF16
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16"}, native.ISA_AVX512, native.ISA_AVX512),
])
def test_instruction_sets_follow_the_cpu_flags(flags, bf16, int8):
    k = native.isa_for(frozenset(flags))
    assert (k.bf16_isa, k.int8_isa) == (bf16, int8)
    assert native.isa_for(frozenset({"sse4_2"})) is None and native.isa_for(None) is None


def _run(code: str, cache, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ASTRAI_CACHE": str(cache), **env})


def test_switched_off_the_engine_keeps_torchs_products(tmp_path):
    r = _run("from astrai.infer import native; print(native.kernels())", tmp_path, ASTRAI_NATIVE="0")
    assert r.returncode == 0 and r.stdout.strip() == "None"
    assert not (tmp_path / "kernels").exists()  # nothing built, nothing written


@needs_kernels
def test_avx2_mode_takes_the_avx2_paths_on_any_avx2_cpu():
    r = _run("from astrai.infer import native; k = native.kernels(); print(k.bf16_isa, k.int8_isa, k.int4)",
             cache_root(), ASTRAI_NATIVE="avx2")
    assert r.stdout.split() == [str(native.ISA_AVX2), str(native.ISA_AVX2), "False"], r.stderr


@needs_kernels
def test_a_linked_build_directory_is_refused_and_nothing_is_written_through_it(tmp_path):
    cache, elsewhere = tmp_path / "cache", tmp_path / "users"
    elsewhere.mkdir()
    where = _run("from astrai.kernels.cpu_build import build_dir; print(build_dir())", cache).stdout.strip()
    os.makedirs(os.path.dirname(where))
    os.symlink(elsewhere, where)
    r = _run("from astrai.infer import native; print(native.kernels())", cache)
    assert r.stdout.strip() == "None", r.stderr
    assert "did not build" in r.stderr and "not a directory astrai made (a link)" in r.stderr
    assert list(elsewhere.iterdir()) == []


@needs_kernels
@pytest.mark.parametrize("isa", BF16_ISAS)
def test_a_bf16_engine_multiplies_with_the_kernels_and_matches_torchs_products(monkeypatch, isa):
    from astrai.infer.fused import FusedModel

    monkeypatch.setitem(native._STATE, "kernels", native.Kernels(isa, KERNELS.int8_isa, "test"))
    from astrai.model.config import ModelConfig
    from astrai.model.transformer import CausalLM

    torch.manual_seed(0)
    c = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = CausalLM(c).eval().to(torch.bfloat16)
    fused = FusedModel(model)
    w = fused.layers[0]
    assert all(isinstance(t, native.RowsWeight) for t in (w.qkv_t, w.o_t, w.gate_up_t, w.down_t, fused.packed.head_t))
    assert w.down_t.w.data_ptr() == model.model.layers[0].mlp.down_proj.weight.data_ptr()  # no copy
    h = torch.randn(3, 64).bfloat16()
    for t, parts in ((w.qkv_t, ("q_proj", "k_proj", "v_proj")), (w.o_t, ("o_proj",))):
        ref = torch.cat([getattr(model.model.layers[0].self_attn, p)(h) for p in parts], 1)  # torch's bf16 products
        y = t.product(h)
        assert y.dtype == torch.bfloat16 and torch.allclose(y.float(), ref.float(), rtol=2 ** -7, atol=1e-3)


@needs_kernels
@pytest.mark.parametrize("to_bf16", [False, True])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_cast_is_the_norm_times_the_weight_rounded_once(to_bf16, w_dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 576, generator=g) * torch.tensor([1.0, 1e3, 1e-3, 2.5e4, 7.0])[:, None]  # SmolLM2-sized spikes
    w = (torch.randn(576, generator=g) + 1).to(w_dtype)
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    y = torch.ops.astrai.rms_norm_cast(x, w, 1e-5, to_bf16)
    assert y.dtype == (torch.bfloat16 if to_bf16 else torch.float32)
    # float32 arithmetic (a few roundings of 2^-24) then, for bf16, one rounding of half a bf16 ulp
    tol = ref.abs() * (2.0 ** -8 + 2.0 ** -21 if to_bf16 else 2.0 ** -21) + 1e-30
    assert ((y.double() - ref).abs() <= tol).all()
    # and torch's three operations give the same within that bound
    t = (torch.nn.functional.rms_norm(x, (576,), None, 1e-5) * w).to(y.dtype)
    assert ((t.double() - ref).abs() <= tol).all()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_rotates_as_the_torch_formula(dtype):
    from astrai.infer.fused import rope_in_place

    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(3, 15, 64, generator=g).to(dtype)
    cos, sin = (torch.randn(3, 1, 64, generator=g).to(dtype) for _ in range(2))
    ref = qkv[:, :12].clone()
    rope_in_place(ref, cos, sin)  # torch's four operations
    out = qkv.clone()
    torch.ops.astrai.rope_in_place(out[:, :12], cos, sin)  # a strided view, as the engine passes q/k
    assert torch.equal(out[:, 12:], qkv[:, 12:])  # v untouched
    if dtype == torch.float32:
        assert torch.equal(out[:, :12], ref)  # the same products and sum, rounded as torch rounds them
    else:  # float32 arithmetic rounded once against the float64 formula: half a bf16 ulp
        x = qkv[:, :12].double()
        exact = x * cos.double() + x.roll(32, -1) * sin.double()
        assert ((out[:, :12].double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-6).all()


@needs_kernels
@pytest.mark.parametrize("isa", INT8_ISAS)
@pytest.mark.parametrize("d", [64, 48])  # 64: AVX-512's register path; 48: the general loops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_is_sdpa_over_each_requests_slots(dtype, d, isa):
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(6)
    s, hkv, hq = 80, 3, 9
    kc, vc = (torch.randn(s, hkv, d, generator=g).to(dtype) for _ in range(2))
    slots = torch.randperm(s, generator=g)[:3 * 25].view(3, 25)
    counts = torch.tensor([25, 1, 13])  # the first counts[b] slots of each row are the request's
    q = torch.randn(3, hq, d, generator=g).to(dtype)
    out = torch.ops.astrai.decode_attention(q, kc, vc, slots, counts, 0.1, isa)
    for b, n in enumerate(counts.tolist()):
        k, v = (c[slots[b, :n]].transpose(0, 1).double() for c in (kc, vc))
        ref = F.scaled_dot_product_attention(q[b, :, None].double(), k, v, scale=0.1, enable_gqa=True)[:, 0]
        tol = 2.0 ** -8 if dtype == torch.bfloat16 else 1e-5  # bf16: the output's rounding
        assert ((out[b].double() - ref).abs() <= tol * ref.abs() + tol).all()
    bad = slots.clone()
    bad[2, 3] = s  # one past the cache: refused, not read
    with pytest.raises(RuntimeError, match="a slot past the cache"):
        torch.ops.astrai.decode_attention(q, kc, vc, bad, counts, 0.1, isa)


@needs_kernels
def test_a_first_build_says_so_and_a_later_start_loads_it_quietly(tmp_path):
    code = "from astrai.infer import native; print(native.kernels() is not None)"
    first, again = _run(code, tmp_path), _run(code, tmp_path)
    assert first.stdout.strip() == again.stdout.strip() == "True", first.stderr
    assert "building the CPU kernels once" in first.stderr and "building" not in again.stderr
    [built] = (tmp_path / "kernels").iterdir()
    assert built.name.startswith("cpu_gemv-") and (built / "astrai_cpu_gemv.so").is_file()
