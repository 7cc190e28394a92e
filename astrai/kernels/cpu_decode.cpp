// The CPU engine's decode-step work around the products (astrai/kernels/cpu_gemv.cpp has the products):
// a float32 residual's RMSNorm rounded to the projections' dtype, RoPE in place, and one query's attention
// per request read through its K/V slots. Each replaces several of torch's small operations by one
// (a decode step runs each of them once per layer). Built with cpu_gemv.cpp into one extension by
// astrai.infer.native; registered as torch operators of the `astrai` namespace.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#include <immintrin.h>

#include "cpu_kernels.h"

namespace {

// RMSNorm of float32 rows times the weight, rounded to the projections' dtype: out = round(x * r * w), r =
// 1 / sqrt(mean(x^2) + eps) per row of x [T, H] (the mean summed in double), w [H] float32 or bf16 (widened
// exactly), out bf16 when `to_bf16`, else float32. torch's rms_norm, the product by the weight and the cast
// are three operations (about 12 us at H = 576); this is one.
template <typename W>
void rms_norm_rows(const float* xp, const W* wp, int64_t T, int64_t H, float eps, void* out, bool to_bf16) {
  for (int64_t t = 0; t < T; ++t) {
    const float* row = xp + t * H;
    double ss = 0.0;
    for (int64_t i = 0; i < H; ++i) ss += static_cast<double>(row[i]) * row[i];
    const float r = 1.f / std::sqrt(static_cast<float>(ss / static_cast<double>(H)) + eps);
    if (to_bf16) {
      at::BFloat16* op = static_cast<at::BFloat16*>(out) + t * H;
      for (int64_t i = 0; i < H; ++i) op[i] = at::BFloat16(row[i] * r * static_cast<float>(wp[i]));
    } else {
      float* op = static_cast<float*>(out) + t * H;
      for (int64_t i = 0; i < H; ++i) op[i] = row[i] * r * static_cast<float>(wp[i]);
    }
  }
}

}  // namespace

namespace astrai {

void rms_norm_into(const float* x, const at::Tensor& w, int64_t T, int64_t H, float eps, void* out, bool to_bf16) {
  if (w.scalar_type() == at::kFloat) {
    rms_norm_rows(x, w.data_ptr<float>(), T, H, eps, out, to_bf16);
  } else {
    rms_norm_rows(x, w.data_ptr<at::BFloat16>(), T, H, eps, out, to_bf16);
  }
}

}  // namespace astrai

namespace {

at::Tensor rms_norm_cast(const at::Tensor& x, const at::Tensor& w, double eps, bool to_bf16) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && w.dim() == 1 &&
              w.size(0) == x.size(1) && w.is_contiguous() &&
              (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "astrai::rms_norm_cast: x float32 [T, H] contiguous, w float32 or bf16 [H]");
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor out = at::empty({T, H}, x.options().dtype(to_bf16 ? at::kBFloat16 : at::kFloat));
  astrai::rms_norm_into(x.data_ptr<float>(), w, T, H, static_cast<float>(eps), out.data_ptr(), to_bf16);
  return out;
}

// RoPE in place, Hugging Face's half-split rotation: x <- x * cos + swap_halves(x) * sin_signed, for x
// [T, heads, D] (rows of D contiguous, any row and head strides: a view into the packed q/k/v) and
// cos, sin_signed [T, 1, D] contiguous, all float32 or all bf16. float32: the same two products and sum
// as torch's three in-place operations, each rounded as they round; bf16: computed in float32, rounded
// once (torch's bf16 operations round after each).
template <typename T_>
void rope_rows(T_* xp, int64_t T, int64_t Hd, int64_t D, int64_t st, int64_t sh, const T_* cp, const T_* sp) {
  const int64_t half = D / 2;
  float a[512];
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hd; ++h) {
      T_* row = xp + t * st + h * sh;
      const T_ *c = cp + t * D, *s = sp + t * D;
      for (int64_t i = 0; i < D; ++i) a[i] = static_cast<float>(row[i]);
      for (int64_t i = 0; i < D; ++i) {
        const float swapped = a[i < half ? i + half : i - half];
        const float xc = a[i] * static_cast<float>(c[i]), ss = swapped * static_cast<float>(s[i]);
        row[i] = static_cast<T_>(xc + ss);
      }
    }
}

}  // namespace

namespace astrai {

void rope_into(void* x, bool bf16, int64_t T, int64_t Hd, int64_t D, int64_t st, int64_t sh, const void* cos,
               const void* sin) {
  TORCH_CHECK(D <= 512, "astrai: RoPE over heads of at most 512");
  if (bf16) {
    rope_rows(static_cast<at::BFloat16*>(x), T, Hd, D, st, sh, static_cast<const at::BFloat16*>(cos),
              static_cast<const at::BFloat16*>(sin));
  } else {
    rope_rows(static_cast<float*>(x), T, Hd, D, st, sh, static_cast<const float*>(cos), static_cast<const float*>(sin));
  }
}

}  // namespace astrai

namespace {

void rope_in_place(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() &&
              cos.numel() == x.size(0) * x.size(2) && sin.numel() == cos.numel() &&
              cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "astrai::rope_in_place: x [T, H, D] float32 or bf16 with contiguous rows, cos and sin [T, 1, D] of x's dtype");
  astrai::rope_into(x.data_ptr(), x.scalar_type() == at::kBFloat16, x.size(0), x.size(1), x.size(2), x.stride(0),
                    x.stride(1), cos.data_ptr(), sin.data_ptr());
}

// One query per request against its cached K/V (a decode step's attention, torch attention backend):
// q [B, Hq, D] (rows of Hq * D contiguous, `ldq` apart); caches [S, Hkv, D]; slots [B, L] (int64, row-major)
// of which the first counts[b] are request b's positions; out [B, Hq, D] contiguous in q's dtype. Per
// (request, K/V head): the scores of the group's query heads over the positions (float32 dot products),
// softmax with the maximum subtracted (exp by Sleef, the vector math torch itself uses: a scalar exp per
// score was most of the time), the weighted sum of V rows, divided by the sum: what
// scaled_dot_product_attention computes, read through the slots in place of a gathered copy of the K/V.
// Threads split the (request, K/V head) pairs.

struct Exp512 {
  __attribute__((target("avx512f"))) void operator()(float* p, int64_t n) const {
    for (int64_t i = 0; i < n; i += 16) {
      const int64_t left = n - i;
      const __mmask16 mask = astrai::tail_mask16(left);
      _mm512_mask_storeu_ps(p + i, mask, Sleef_expf16_u10(_mm512_maskz_loadu_ps(mask, p + i)));
    }
  }
};

struct Exp256 {
  __attribute__((target("avx2,fma"))) void operator()(float* p, int64_t n) const {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(p + i, Sleef_expf8_u10avx2(_mm256_loadu_ps(p + i)));
    for (; i < n; ++i) p[i] = std::exp(p[i]);
  }
};

// each of the `group` score rows (L apart, n used) <- exp(score - the row's maximum): softmax's numerators
template <typename Exp>
inline void softmax_numerators(float* sc, int64_t group, int64_t L, int64_t n, Exp expn) {
  for (int64_t g = 0; g < group; ++g) {
    float* sg = sc + g * L;
    float m = -INFINITY;
    for (int64_t l = 0; l < n; ++l) m = std::max(m, sg[l]);
    for (int64_t l = 0; l < n; ++l) sg[l] -= m;
    expn(sg, n);
  }
}

// one (request, K/V head) pair: q and out point at the group's first head ([group, D] contiguous)
template <typename T_, typename Exp>
inline void attend_one(const T_* q, const T_* kc, const T_* vc, int64_t Hkv, int64_t kh, int64_t D, int64_t group,
                       const int64_t* sl, int64_t n, float scale, float* qf, float* sc, int64_t L, float* acc, T_* out,
                       Exp expn) {
  for (int64_t i = 0; i < group * D; ++i) qf[i] = static_cast<float>(q[i]);
  for (int64_t l = 0; l < n; ++l) {
    const T_* kr = kc + (sl[l] * Hkv + kh) * D;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qg[d] * static_cast<float>(kr[d]);
      sc[g * L + l] = s * scale;
    }
  }
  for (int64_t i = 0; i < group * D; ++i) acc[i] = 0.f;
  softmax_numerators(sc, group, L, n, expn);
  for (int64_t l = 0; l < n; ++l) {
    const T_* vr = vc + (sl[l] * Hkv + kh) * D;
    for (int64_t g = 0; g < group; ++g) {
      const float p = sc[g * L + l];
      float* a = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<float>(vr[d]);
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float total = 0.f;
    for (int64_t l = 0; l < n; ++l) total += sc[g * L + l];
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<T_>(n ? acc[g * D + d] / total : 0.f);
  }
}

// 16 values of a float32 or bf16 row, as float32
__attribute__((target("avx512f,avx512bw"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f,avx512bw"))) inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// AVX-512 with heads of D = 64 (the common size): the group's queries and accumulators in registers
template <typename T_>
__attribute__((target("avx512f,avx512bw"))) void attend_512_d64(const T_* q, const T_* kc, const T_* vc, int64_t Hkv,
    int64_t kh, int64_t group, const int64_t* sl, int64_t n, float scale, float* sc, int64_t L, T_* out) {
  constexpr int64_t D = 64, V = D / 16;
  for (int64_t g0 = 0; g0 < group; g0 += 4) {  // up to 4 query heads at a time
    const int64_t gn = std::min<int64_t>(4, group - g0);
    __m512 qv[4][V];
    for (int64_t g = 0; g < gn; ++g)
      for (int64_t v = 0; v < V; ++v) qv[g][v] = load16(q + (g0 + g) * D + v * 16);
    for (int64_t l = 0; l < n; ++l) {
      const T_* kr = kc + (sl[l] * Hkv + kh) * D;
      __m512 kv[V];
      for (int64_t v = 0; v < V; ++v) kv[v] = load16(kr + v * 16);
      for (int64_t g = 0; g < gn; ++g) {
        __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int64_t v = 1; v < V; ++v) a = _mm512_fmadd_ps(qv[g][v], kv[v], a);
        sc[(g0 + g) * L + l] = _mm512_reduce_add_ps(a) * scale;
      }
    }
  }
  softmax_numerators(sc, group, L, n, Exp512{});
  for (int64_t g0 = 0; g0 < group; g0 += 4) {
    const int64_t gn = std::min<int64_t>(4, group - g0);
    __m512 acc[4][V];
    for (int64_t g = 0; g < 4; ++g)
      for (int64_t v = 0; v < V; ++v) acc[g][v] = _mm512_setzero_ps();
    for (int64_t l = 0; l < n; ++l) {
      const T_* vr = vc + (sl[l] * Hkv + kh) * D;
      __m512 vv[V];
      for (int64_t v = 0; v < V; ++v) vv[v] = load16(vr + v * 16);
      for (int64_t g = 0; g < gn; ++g) {
        const __m512 p = _mm512_set1_ps(sc[(g0 + g) * L + l]);
        for (int64_t v = 0; v < V; ++v) acc[g][v] = _mm512_fmadd_ps(p, vv[v], acc[g][v]);
      }
    }
    for (int64_t g = 0; g < gn; ++g) {
      float total = 0.f;
      for (int64_t l = 0; l < n; ++l) total += sc[(g0 + g) * L + l];
      alignas(64) float o[D];
      for (int64_t v = 0; v < V; ++v) _mm512_store_ps(o + v * 16, acc[g][v]);
      for (int64_t d = 0; d < D; ++d) out[(g0 + g) * D + d] = static_cast<T_>(n ? o[d] / total : 0.f);
    }
  }
}

template <typename T_>
__attribute__((target("avx512f,avx512bw"))) void attend_512(const T_* q, const T_* kc, const T_* vc, int64_t Hkv,
    int64_t kh, int64_t D, int64_t group, const int64_t* sl, int64_t n, float scale, float* qf, float* sc, int64_t L,
    float* acc, T_* out) {
  if (D == 64) return attend_512_d64(q, kc, vc, Hkv, kh, group, sl, n, scale, sc, L, out);
  attend_one(q, kc, vc, Hkv, kh, D, group, sl, n, scale, qf, sc, L, acc, out, Exp512{});
}

template <typename T_>
__attribute__((target("avx2,fma"))) void attend_256(const T_* q, const T_* kc, const T_* vc, int64_t Hkv, int64_t kh,
    int64_t D, int64_t group, const int64_t* sl, int64_t n, float scale, float* qf, float* sc, int64_t L, float* acc,
    T_* out) {
  attend_one(q, kc, vc, Hkv, kh, D, group, sl, n, scale, qf, sc, L, acc, out, Exp256{});
}

template <typename T_>
void decode_attention_rows(const T_* qp, int64_t ldq, int64_t B, int64_t Hq, int64_t D, const T_* kp, const T_* vp,
                           int64_t Hkv, const int64_t* slots, const int64_t* counts, int64_t L, float scale, T_* op,
                           int64_t isa) {
  const int64_t group = Hq / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qf(group * D), acc(group * D), sc(group * L);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / Hkv, kh = i % Hkv;
      const T_* q = qp + b * ldq + kh * group * D;
      T_* out = op + (b * Hq + kh * group) * D;
      if (isa >= 2) {
        attend_512(q, kp, vp, Hkv, kh, D, group, slots + b * L, counts[b], scale, qf.data(), sc.data(), L, acc.data(),
                   out);
      } else {
        attend_256(q, kp, vp, Hkv, kh, D, group, slots + b * L, counts[b], scale, qf.data(), sc.data(), L, acc.data(),
                   out);
      }
    }
  });
}

}  // namespace

namespace astrai {

void decode_attention_into(const void* q, int64_t ldq, int64_t B, int64_t Hq, int64_t D, const at::Tensor& kc,
                           const at::Tensor& vc, const int64_t* slots, const int64_t* counts, int64_t L, float scale,
                           void* out, int64_t isa) {
  const int64_t Hkv = kc.size(1), S = kc.size(0);
  for (int64_t b = 0; b < B; ++b) {  // plain loops: an ATen max() here cost a few us per layer
    TORCH_CHECK(counts[b] >= 0 && counts[b] <= L, "astrai::decode_attention: a count past the slots");
    for (int64_t l = 0; l < counts[b]; ++l)
      TORCH_CHECK(slots[b * L + l] >= 0 && slots[b * L + l] < S, "astrai::decode_attention: a slot past the cache");
  }
  if (kc.scalar_type() == at::kFloat) {
    decode_attention_rows(static_cast<const float*>(q), ldq, B, Hq, D, kc.data_ptr<float>(), vc.data_ptr<float>(), Hkv,
                          slots, counts, L, scale, static_cast<float*>(out), isa);
  } else {
    decode_attention_rows(static_cast<const at::BFloat16*>(q), ldq, B, Hq, D, kc.data_ptr<at::BFloat16>(),
                          vc.data_ptr<at::BFloat16>(), Hkv, slots, counts, L, scale, static_cast<at::BFloat16*>(out), isa);
  }
}

}  // namespace astrai

namespace {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& slots,
                            const at::Tensor& counts, double scale, int64_t isa) {
  TORCH_CHECK(q.dim() == 3 && kc.dim() == 3 && kc.sizes() == vc.sizes() && q.size(2) == kc.size(2) &&
              q.size(1) % kc.size(1) == 0 && kc.is_contiguous() && vc.is_contiguous() &&
              q.scalar_type() == kc.scalar_type() && vc.scalar_type() == kc.scalar_type() &&
              (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "astrai::decode_attention: q [B, Hq, D], caches [S, Hkv, D] contiguous, one dtype (float32 or bf16)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && counts.scalar_type() == at::kLong && slots.dim() == 2 &&
              slots.size(0) == q.size(0) && counts.numel() == q.size(0),
              "astrai::decode_attention: slots int64 [B, L], counts int64 [B]");
  at::Tensor qc = q.contiguous(), sl = slots.contiguous(), cn = counts.contiguous();
  at::Tensor out = at::empty(qc.sizes(), qc.options());
  astrai::decode_attention_into(qc.data_ptr(), qc.size(1) * qc.size(2), qc.size(0), qc.size(1), qc.size(2), kc, vc,
                                sl.data_ptr<int64_t>(), cn.data_ptr<int64_t>(), sl.size(1), static_cast<float>(scale),
                                out.data_ptr(), isa);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(astrai, m) {
  m.def("rms_norm_cast(Tensor x, Tensor w, float eps, bool to_bf16) -> Tensor");
  m.def("rope_in_place(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor counts, float scale, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(astrai, CPU, m) {
  m.impl("rms_norm_cast", &rms_norm_cast);
  m.impl("rope_in_place", &rope_in_place);
  m.impl("decode_attention", &decode_attention);
}
