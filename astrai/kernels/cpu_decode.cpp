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

namespace {

// RMSNorm of float32 rows times the weight, rounded to the projections' dtype: out = round(x * r * w), r =
// 1 / sqrt(mean(x^2) + eps) per row of x [T, H] (the mean summed in double), w [H] float32 or bf16 (widened
// exactly), out bf16 when `to_bf16`, else float32. torch's rms_norm, the product by the weight and the cast
// are three operations (about 12 us at H = 576); this is one.
template <typename W>
void rms_norm_rows(const float* xp, const W* wp, int64_t T, int64_t H, float eps, at::Tensor& out, bool to_bf16) {
  for (int64_t t = 0; t < T; ++t) {
    const float* row = xp + t * H;
    double ss = 0.0;
    for (int64_t i = 0; i < H; ++i) ss += static_cast<double>(row[i]) * row[i];
    const float r = 1.f / std::sqrt(static_cast<float>(ss / static_cast<double>(H)) + eps);
    if (to_bf16) {
      at::BFloat16* op = out.data_ptr<at::BFloat16>() + t * H;
      for (int64_t i = 0; i < H; ++i) op[i] = at::BFloat16(row[i] * r * static_cast<float>(wp[i]));
    } else {
      float* op = out.data_ptr<float>() + t * H;
      for (int64_t i = 0; i < H; ++i) op[i] = row[i] * r * static_cast<float>(wp[i]);
    }
  }
}

at::Tensor rms_norm_cast(const at::Tensor& x, const at::Tensor& w, double eps, bool to_bf16) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && w.dim() == 1 &&
              w.size(0) == x.size(1) && w.is_contiguous() &&
              (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "astrai::rms_norm_cast: x float32 [T, H] contiguous, w float32 or bf16 [H]");
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor out = at::empty({T, H}, x.options().dtype(to_bf16 ? at::kBFloat16 : at::kFloat));
  if (w.scalar_type() == at::kFloat) {
    rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), T, H, static_cast<float>(eps), out, to_bf16);
  } else {
    rms_norm_rows(x.data_ptr<float>(), w.data_ptr<at::BFloat16>(), T, H, static_cast<float>(eps), out, to_bf16);
  }
  return out;
}

// RoPE in place, Hugging Face's half-split rotation: x <- x * cos + swap_halves(x) * sin_signed, for x
// [T, heads, D] (rows of D contiguous, any row and head strides: a view into the packed q/k/v) and
// cos, sin_signed [T, 1, D] contiguous, all float32 or all bf16. float32: the same two products and sum
// as torch's three in-place operations, each rounded as they round; bf16: computed in float32, rounded
// once (torch's bf16 operations round after each).
template <typename T_>
void rope_rows(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t T = x.size(0), Hd = x.size(1), D = x.size(2), half = D / 2;
  const int64_t st = x.stride(0), sh = x.stride(1);
  T_* xp = x.data_ptr<T_>();
  const T_ *cp = cos.data_ptr<T_>(), *sp = sin.data_ptr<T_>();
  std::vector<float> a(D);
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

void rope_in_place(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() &&
              cos.numel() == x.size(0) * x.size(2) && sin.numel() == cos.numel() &&
              cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "astrai::rope_in_place: x [T, H, D] with contiguous rows, cos and sin [T, 1, D] of x's dtype");
  if (x.scalar_type() == at::kFloat) {
    rope_rows<float>(x, cos, sin);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "astrai::rope_in_place: float32 or bf16");
    rope_rows<at::BFloat16>(x, cos, sin);
  }
}

// One query per request against its cached K/V (a decode step's attention, torch attention backend):
// q [B, Hq, D] contiguous; caches [S, Hkv, D]; slots [B, L] (int64, row-major) of which the first counts[b]
// are request b's positions; out [B, Hq, D] in q's dtype. Per (request, K/V head): the scores of the
// group's query heads over the positions (float32 dot products), softmax with the maximum subtracted, the
// weighted sum of V rows, divided by the sum: what scaled_dot_product_attention computes, read through the
// slots in place of a gathered copy of the K/V. Threads split the (request, K/V head) pairs.
template <typename T_>
float dot_row(const float* q, const T_* k, int64_t D) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < D; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}

template <typename T_>
void decode_attention_rows(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const int64_t* slots,
                           const int64_t* counts, int64_t L, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = kc.size(1), group = Hq / Hkv;
  const T_ *qp = q.data_ptr<T_>(), *kp = kc.data_ptr<T_>(), *vp = vc.data_ptr<T_>();
  T_* op = out.data_ptr<T_>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qf(group * D), acc(group * D), sc(group * L), total(group);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / Hkv, kh = i % Hkv, n = counts[b];
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(qp[(b * Hq + kh * group + g) * D + d]);
      for (int64_t l = 0; l < n; ++l) {
        const T_* kr = kp + (slots[b * L + l] * Hkv + kh) * D;
        for (int64_t g = 0; g < group; ++g) sc[g * L + l] = dot_row(qf.data() + g * D, kr, D) * static_cast<float>(scale);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(total.begin(), total.end(), 0.f);
      for (int64_t g = 0; g < group; ++g) {
        float m = -INFINITY;
        for (int64_t l = 0; l < n; ++l) m = std::max(m, sc[g * L + l]);
        for (int64_t l = 0; l < n; ++l) {
          sc[g * L + l] = std::exp(sc[g * L + l] - m);
          total[g] += sc[g * L + l];
        }
      }
      for (int64_t l = 0; l < n; ++l) {
        const T_* vr = vp + (slots[b * L + l] * Hkv + kh) * D;
        for (int64_t g = 0; g < group; ++g) {
          const float p = sc[g * L + l];
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<float>(vr[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < D; ++d)
          op[(b * Hq + kh * group + g) * D + d] = static_cast<T_>(n ? acc[g * D + d] / total[g] : 0.f);
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& slots,
                            const at::Tensor& counts, double scale) {
  TORCH_CHECK(q.dim() == 3 && kc.dim() == 3 && kc.sizes() == vc.sizes() && q.size(2) == kc.size(2) &&
              q.size(1) % kc.size(1) == 0 && kc.is_contiguous() && vc.is_contiguous() &&
              q.scalar_type() == kc.scalar_type() && vc.scalar_type() == kc.scalar_type(),
              "astrai::decode_attention: q [B, Hq, D], caches [S, Hkv, D] contiguous, one dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && counts.scalar_type() == at::kLong && slots.dim() == 2 &&
              slots.size(0) == q.size(0) && counts.numel() == q.size(0),
              "astrai::decode_attention: slots int64 [B, L], counts int64 [B]");
  at::Tensor qc = q.contiguous(), sl = slots.contiguous(), cn = counts.contiguous();
  for (int64_t b = 0; b < cn.numel(); ++b)  // a plain loop: an ATen max() here cost a few us per layer
    TORCH_CHECK(cn.data_ptr<int64_t>()[b] <= sl.size(1), "astrai::decode_attention: a count past the slots");
  at::Tensor out = at::empty(qc.sizes(), qc.options());
  if (q.scalar_type() == at::kFloat) {
    decode_attention_rows<float>(qc, kc, vc, sl.data_ptr<int64_t>(), cn.data_ptr<int64_t>(), sl.size(1), scale, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "astrai::decode_attention: float32 or bf16");
    decode_attention_rows<at::BFloat16>(qc, kc, vc, sl.data_ptr<int64_t>(), cn.data_ptr<int64_t>(), sl.size(1), scale,
                                        out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(astrai, m) {
  m.def("rms_norm_cast(Tensor x, Tensor w, float eps, bool to_bf16) -> Tensor");
  m.def("rope_in_place(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor counts, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(astrai, CPU, m) {
  m.impl("rms_norm_cast", &rms_norm_cast);
  m.impl("rope_in_place", &rope_in_place);
  m.impl("decode_attention", &decode_attention);
}
