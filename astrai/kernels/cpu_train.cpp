// Elementwise operations of a training step on AVX-512 CPUs, each forward and backward in one pass, called by
// astrai.model.cpu_ops. torch runs each as several passes over the activations, widening bf16 to float32 and
// rounding back at every one; these compute the same operations in the same order, rounded to the inputs'
// dtype where torch's separate operations round (R below; nothing for float32), so their results are torch's.
//
// The gated MLP's activation: torch.ops.astrai.swiglu(gate, up) -> silu(gate) * up and
// torch.ops.astrai.swiglu_backward(dh, gate, up) -> (d gate, d up). gate, up and dh: contiguous, one shape,
// float32 or bf16 alike. torch's CPU silu and silu_backward formulas, exp by the same Sleef function:
//   s = R(g / (1 + exp(-g)));  h = R(s u);  d up = R(dh s);
//   sig = 1 / (1 + exp(-g));  d gate = R(R(dh u) sig (1 + g (1 - sig))).
//
// Rotary embedding: torch.ops.astrai.rotary(x, cos, sin, transposed) for x [T, H, D] contiguous, cos and sin
// [T, D] contiguous, all of one dtype (float32 or bf16); with rot(x) = (-x2, x1) for the halves x1, x2:
//   forward (transposed false):  R(R(x cos) + R(rot(x) sin))       (astrai.model.rope's x * cos + rotate_half(x) * sin)
//   backward (transposed true):  R(R(g cos) + rot^T(R(g sin)))     with rot^T(y1, y2) = (y2, -y1)
//
// RMSNorm of float32 rows: torch.ops.astrai.rms_norm(x [N, H], w [H], eps) -> (y = w (x r), r [N]) with
// r = 1 / sqrt(sum(x^2) / H + eps), and torch.ops.astrai.rms_norm_backward(g, x, w, r, weight_grad) ->
// (dx = r (w g - x r^2 sum(w g x) / H), dw = sum over rows of g x r, or an empty tensor). float32 throughout;
// the sums in another order than torch's reductions, so within a few units of float32 of torch's results.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <vector>
#include <immintrin.h>

#include "cpu_kernels.h"

namespace {

using bf16 = at::BFloat16;

__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load(const float* p, __mmask16 m) {
  return _mm512_maskz_loadu_ps(m, p);
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load(const bf16* p, __mmask16 m) {
  return astrai::load_bf16x16(p, m);
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void store(float* p, __mmask16 m, __m512 x) {
  _mm512_mask_storeu_ps(p, m, x);
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void store(bf16* p, __mmask16 m, __m512 x) {
  astrai::store_bf16x16(p, m, x);
}

__attribute__((target("avx512f"))) inline __m512 one_plus_exp_neg(__m512 g) {
  return _mm512_add_ps(_mm512_set1_ps(1.f), astrai::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
}

// x rounded to T and widened back (nothing for float32)
// (for float32 the value is kept as it is, and the compiler may not fuse the operation that made it into the
// next one: torch's separate operations round each product before a sum, so no multiply-add may contract them)
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 round_to(float*, __m512 x) {
  __asm__("" : "+v"(x));
  return x;
}
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 round_to(bf16*, __m512 x) {
  return _mm512_castsi512_ps(astrai::bf16_rounded_bits(x));
}

// elements [b, e) of h = silu(g) u
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void forward_range(const T* g, const T* u, T* h, int64_t b,
                                                                         int64_t e) {
  for (int64_t i = b; i < e; i += 16) {
    const __mmask16 m = astrai::tail_mask16(e - i);
    const __m512 gv = load(g + i, m);
    const __m512 s = round_to(static_cast<T*>(nullptr), _mm512_div_ps(gv, one_plus_exp_neg(gv)));
    store(h + i, m, _mm512_mul_ps(s, load(u + i, m)));
  }
}

// elements [b, e) of d gate and d up
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void backward_range(const T* dh, const T* g, const T* u, T* dg,
                                                                          T* du, int64_t b, int64_t e) {
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = b; i < e; i += 16) {
    const __mmask16 m = astrai::tail_mask16(e - i);
    const __m512 gv = load(g + i, m), dv = load(dh + i, m), denom = one_plus_exp_neg(gv);
    const __m512 s = round_to(static_cast<T*>(nullptr), _mm512_div_ps(gv, denom));
    store(du + i, m, _mm512_mul_ps(dv, s));
    const __m512 t = round_to(static_cast<T*>(nullptr), _mm512_mul_ps(dv, load(u + i, m)));
    const __m512 sig = _mm512_div_ps(one, denom);
    const __m512 tail = _mm512_add_ps(one, _mm512_mul_ps(gv, _mm512_sub_ps(one, sig)));
    store(dg + i, m, _mm512_mul_ps(_mm512_mul_ps(t, sig), tail));
  }
}

template <typename T>
void forward(const T* g, const T* u, T* h, int64_t n) {
  at::parallel_for(0, n, 16384, [&](int64_t b, int64_t e) { forward_range(g, u, h, b, e); });
}

template <typename T>
void backward(const T* dh, const T* g, const T* u, T* dg, T* du, int64_t n) {
  at::parallel_for(0, n, 16384, [&](int64_t b, int64_t e) { backward_range(dh, g, u, dg, du, b, e); });
}

// rows [b, e) of x [rows, D] (row t / H of cos and sin [T, D]) rotated; see the file's comment
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void rotary_range(const T* x, const T* cos, const T* sin, T* out,
                                                                        int64_t H, int64_t D, bool transposed,
                                                                        int64_t b, int64_t e) {
  const int64_t half = D / 2;
  for (int64_t row = b; row < e; ++row) {
    const T* xr = x + row * D;
    const T* c = cos + (row / H) * D;
    const T* sn = sin + (row / H) * D;
    T* o = out + row * D;
    for (int64_t j = 0; j < half; j += 16) {
      const __mmask16 m = astrai::tail_mask16(half - j);
      const __m512 x1 = load(xr + j, m), x2 = load(xr + half + j, m);
      const __m512 c1 = load(c + j, m), c2 = load(c + half + j, m);
      const __m512 s1 = load(sn + j, m), s2 = load(sn + half + j, m);
      T* nothing = nullptr;
      const __m512 a1 = round_to(nothing, _mm512_mul_ps(x1, c1)), a2 = round_to(nothing, _mm512_mul_ps(x2, c2));
      __m512 b1, b2;
      if (!transposed) {  // rot(x) sin: (-x2 s1, x1 s2)
        b1 = round_to(nothing, _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), s1));
        b2 = round_to(nothing, _mm512_mul_ps(x1, s2));
      } else {  // rot^T(g sin): ((g sin)2, -(g sin)1)
        b1 = round_to(nothing, _mm512_mul_ps(x2, s2));
        b2 = _mm512_sub_ps(_mm512_setzero_ps(), round_to(nothing, _mm512_mul_ps(x1, s1)));
      }
      store(o + j, m, _mm512_add_ps(a1, b1));
      store(o + half + j, m, _mm512_add_ps(a2, b2));
    }
  }
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool transposed) {
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) &&
                  x.size(2) % 2 == 0 && cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "rotary: contiguous x [T, H, D] (D even), cos and sin [T, D], one dtype (float32 or bf16)");
  at::Tensor out = at::empty_like(x);
  const int64_t H = x.size(1), D = x.size(2), rows = x.size(0) * H;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)), [&](int64_t b, int64_t e) {
    if (x.scalar_type() == at::kFloat)
      rotary_range(x.const_data_ptr<float>(), cos.const_data_ptr<float>(), sin.const_data_ptr<float>(),
                   out.data_ptr<float>(), H, D, transposed, b, e);
    else
      rotary_range(x.const_data_ptr<bf16>(), cos.const_data_ptr<bf16>(), sin.const_data_ptr<bf16>(),
                   out.data_ptr<bf16>(), H, D, transposed, b, e);
  });
  return out;
}

// rows [b, e) of y = w (x r), r = 1 / sqrt(mean(x^2) + eps)
__attribute__((target("avx512f,avx512bw,avx512vl"))) void rms_norm_range(const float* x, const float* w, float eps,
                                                                          int64_t H, float* y, float* r, int64_t b,
                                                                          int64_t e) {
  for (int64_t row = b; row < e; ++row) {
    const float* xr = x + row * H;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < H; j += 16) {
      const __m512 v = _mm512_maskz_loadu_ps(astrai::tail_mask16(H - j), xr + j);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    const float rs = 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(H) + eps);
    r[row] = rs;
    const __m512 rv = _mm512_set1_ps(rs);
    for (int64_t j = 0; j < H; j += 16) {
      const __mmask16 m = astrai::tail_mask16(H - j);
      const __m512 h = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, xr + j), rv);
      _mm512_mask_storeu_ps(y + row * H + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + j), h));
    }
  }
}

// rows [b, e) of dx; dw_part (H floats, or null) += sum over the rows of g x r
__attribute__((target("avx512f,avx512bw,avx512vl"))) void rms_norm_backward_range(
    const float* g, const float* x, const float* w, const float* r, int64_t H, float* dx, float* dw_part, int64_t b,
    int64_t e) {
  for (int64_t row = b; row < e; ++row) {
    const float *gr = g + row * H, *xr = x + row * H;
    const __m512 rv = _mm512_set1_ps(r[row]);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < H; j += 16) {
      const __mmask16 m = astrai::tail_mask16(H - j);
      const __m512 wg = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + j), _mm512_maskz_loadu_ps(m, gr + j));
      acc = _mm512_fmadd_ps(wg, _mm512_maskz_loadu_ps(m, xr + j), acc);
    }
    const float rr = r[row];
    const __m512 k = _mm512_set1_ps(rr * rr * _mm512_reduce_add_ps(acc) / static_cast<float>(H));
    for (int64_t j = 0; j < H; j += 16) {
      const __mmask16 m = astrai::tail_mask16(H - j);
      const __m512 gv = _mm512_maskz_loadu_ps(m, gr + j), xv = _mm512_maskz_loadu_ps(m, xr + j);
      const __m512 wg = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + j), gv);
      _mm512_mask_storeu_ps(dx + row * H + j, m, _mm512_mul_ps(rv, _mm512_fnmadd_ps(xv, k, wg)));
      if (dw_part) {
        const __m512 d = _mm512_maskz_loadu_ps(m, dw_part + j);
        _mm512_mask_storeu_ps(dw_part + j, m, _mm512_fmadd_ps(gv, _mm512_mul_ps(xv, rv), d));
      }
    }
  }
}

std::vector<at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && w.dim() == 1 &&
                  w.is_contiguous() && w.scalar_type() == at::kFloat && w.size(0) == x.size(1),
              "rms_norm: contiguous float32 x [N, H] and w [H]");
  const int64_t N = x.size(0), H = x.size(1);
  at::Tensor y = at::empty_like(x), r = at::empty({N}, x.options());
  at::parallel_for(0, N, std::max<int64_t>(1, 8192 / std::max<int64_t>(H, 1)), [&](int64_t b, int64_t e) {
    rms_norm_range(x.const_data_ptr<float>(), w.const_data_ptr<float>(), static_cast<float>(eps), H,
                   y.data_ptr<float>(), r.data_ptr<float>(), b, e);
  });
  return {y, r};
}

std::vector<at::Tensor> rms_norm_backward(const at::Tensor& g, const at::Tensor& x, const at::Tensor& w,
                                          const at::Tensor& r, bool weight_grad) {
  TORCH_CHECK(g.sizes() == x.sizes() && g.is_contiguous() && g.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous() && x.scalar_type() == at::kFloat && w.is_contiguous() &&
                  w.scalar_type() == at::kFloat && w.size(0) == x.size(1) && r.is_contiguous() &&
                  r.size(0) == x.size(0),
              "rms_norm_backward: contiguous float32 g, x [N, H], w [H], r [N]");
  const int64_t N = x.size(0), H = x.size(1);
  const int threads = at::get_num_threads();
  at::Tensor dx = at::empty_like(x);
  // one partial weight gradient per thread, summed in thread order: the same bits for the same thread count
  at::Tensor parts = weight_grad ? at::zeros({threads, H}, x.options()) : at::Tensor();
  at::parallel_for(0, N, std::max<int64_t>(1, 8192 / std::max<int64_t>(H, 1)), [&](int64_t b, int64_t e) {
    float* part = weight_grad ? parts.data_ptr<float>() + at::get_thread_num() * H : nullptr;
    rms_norm_backward_range(g.const_data_ptr<float>(), x.const_data_ptr<float>(), w.const_data_ptr<float>(),
                            r.const_data_ptr<float>(), H, dx.data_ptr<float>(), part, b, e);
  });
  return {dx, weight_grad ? parts.sum(0) : at::empty({0}, x.options())};
}

void check(const std::vector<const at::Tensor*>& ts) {
  for (const at::Tensor* t : ts) {
    TORCH_CHECK(t->is_contiguous() && t->sizes() == ts[0]->sizes() && t->scalar_type() == ts[0]->scalar_type() &&
                    (t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16),
                "swiglu: contiguous float32 or bf16 tensors of one shape and dtype");
  }
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  check({&gate, &up});
  at::Tensor h = at::empty_like(gate);
  if (gate.scalar_type() == at::kFloat)
    forward(gate.const_data_ptr<float>(), up.const_data_ptr<float>(), h.data_ptr<float>(), gate.numel());
  else
    forward(gate.const_data_ptr<bf16>(), up.const_data_ptr<bf16>(), h.data_ptr<bf16>(), gate.numel());
  return h;
}

std::vector<at::Tensor> swiglu_backward(const at::Tensor& dh, const at::Tensor& gate, const at::Tensor& up) {
  check({&dh, &gate, &up});
  at::Tensor dg = at::empty_like(gate), du = at::empty_like(up);
  if (gate.scalar_type() == at::kFloat)
    backward(dh.const_data_ptr<float>(), gate.const_data_ptr<float>(), up.const_data_ptr<float>(),
             dg.data_ptr<float>(), du.data_ptr<float>(), gate.numel());
  else
    backward(dh.const_data_ptr<bf16>(), gate.const_data_ptr<bf16>(), up.const_data_ptr<bf16>(), dg.data_ptr<bf16>(),
             du.data_ptr<bf16>(), gate.numel());
  return {dg, du};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(astrai, m) {
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_backward(Tensor dh, Tensor gate, Tensor up) -> Tensor[]");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, bool transposed) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor[]");
  m.def("rms_norm_backward(Tensor g, Tensor x, Tensor w, Tensor r, bool weight_grad) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(astrai, CPU, m) {
  m.impl("swiglu", &swiglu);
  m.impl("swiglu_backward", &swiglu_backward);
  m.impl("rotary", &rotary);
  m.impl("rms_norm", &rms_norm);
  m.impl("rms_norm_backward", &rms_norm_backward);
}
