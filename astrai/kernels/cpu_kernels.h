// The CPU kernels' entry points that astrai/kernels/cpu_layer.cpp composes into a whole decode layer: the
// products of cpu_gemv.cpp and the norm, RoPE and attention of cpu_decode.cpp, on raw pointers (no tensor is
// made per call). Each writes rows `ldo` elements apart (a column block of a wider output).
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>
#include <cstdint>

// Sleef's float32 exp (u10: 1 ulp), the vector math torch itself links
extern "C" __attribute__((target("avx512f"))) __m512 Sleef_expf16_u10(__m512);
extern "C" __attribute__((target("avx2,fma"))) __m256 Sleef_expf8_u10avx2(__m256);

namespace astrai {

__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) { return Sleef_expf16_u10(x); }

// 16 lanes of bf16 <-> float32 (AVX-512 F/BW/VL). The lanes of `mask` are loaded, widened (the others 0)
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load_bf16x16(const at::BFloat16* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

// x rounded to bf16 as torch rounds (to nearest even; a NaN stays a NaN, made quiet): the bf16 in the upper 16
// bits of each lane, the lower 16 bits zero (the rounded value as a float32)
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512i bf16_rounded_bits(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
  return _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
}

// the lanes of `mask` of x, rounded to bf16, stored at p
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void store_bf16x16(at::BFloat16* p, __mmask16 mask,
                                                                                __m512 x) {
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rounded_bits(x), 16)));
}

// the lanes of a 16-wide vector that hold elements when `left` of them remain (all 16 once 16 or more do)
inline __mmask16 tail_mask16(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
}

// y [M, N] (rows ldo apart) = x [M, K] @ W^T, W [N, K]; isa 2: AVX-512 (bf16: AVX-512 BF16), 1: AVX2 + FMA
void gemv_bf16_into(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* w, int64_t N, at::BFloat16* out,
                    int64_t ldo, int64_t isa);
void gemv_f32_into(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* out, int64_t ldo,
                   int64_t isa);
void gemv_int8_into(const float* x, int64_t M, int64_t K, const int8_t* w, const float* scales, int64_t N, float* out,
                    int64_t ldo, int64_t isa);
// AVX-512F only
void gemv_int4_into(const float* x, int64_t M, int64_t K, const uint8_t* codes, const float* scales,
                    const float* offsets, int64_t N, float* out, int64_t ldo);

// out [T, H] (bf16 when to_bf16, else float32) = x * rsqrt(mean(x^2) + eps) * w, w float32 or bf16 [H]
void rms_norm_into(const float* x, const at::Tensor& w, int64_t T, int64_t H, float eps, void* out, bool to_bf16);
// RoPE in place on x [T, Hd, D] (strides st, sh; rows contiguous), cos and sin_signed [T, D] of x's dtype
void rope_into(void* x, bool bf16, int64_t T, int64_t Hd, int64_t D, int64_t st, int64_t sh, const void* cos,
               const void* sin);
// out [B, Hq * D] = attention of q [B, Hq * D] (rows ldq apart) over the caches through slots [B, L], counts [B]
void decode_attention_into(const void* q, int64_t ldq, int64_t B, int64_t Hq, int64_t D, const at::Tensor& kc,
                           const at::Tensor& vc, const int64_t* slots, const int64_t* counts, int64_t L, float scale,
                           void* out, int64_t isa);

}  // namespace astrai
