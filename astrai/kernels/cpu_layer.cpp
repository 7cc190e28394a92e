// The dense decoder layers of a decode step in one operator (astrai::decode_layers): what
// astrai.infer.fused.FusedModel._layer computes for a decode step of up to 16 rows on a CPU, as one call instead
// of about 30 of torch's a layer. A batch-1 step of a small model spends about as long between torch's operations
// (the Python that calls them, their dispatch, their allocations) as in the weights' stream; here the layers' work
// runs back to back in C++ on astrai's kernels (cpu_kernels.h), all the layers of a step in one call.
//
//   h = norm(x) (rounded to the weights' dtype)   qkv = h @ Wqkv^T (+ b)   q/k norms (Qwen3, Gemma 3)
//   RoPE on q, k; k, v written at the step's slots; attention over each request's slots
//   x += [norm](attn @ Wo^T (+ b))                h = norm(x)   gu = h @ Wgu^T (+ b)
//   a = act(gate) * up                            x += [norm](a @ Wdown^T (+ b))
//
// The same operations and roundings as the Python forward: activations in the weights' dtype (bf16 rounded
// after each operation as torch rounds them; float32 for float32 and quantized weights), the residual x in
// float32; sums in float32 in the kernels' order. Arguments (astrai.infer.native_layer.layer_spec builds them
// once per packed layer): t = [attn_norm, qk_norm?, attn_out_norm?, ffn_norm, ffn_out_norm?, the four biases
// (qkv, o, gate_up, down)?, then each projection's parts' tensors], cfg = [Hq, Hkv, D, act, bf16 isa, int8 isa,
// offset norms, kind, parts of qkv, o, gate_up, down], fc = [eps, softmax scale].

#include <torch/library.h>
#include <ATen/ATen.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"

namespace {

enum Kind { F32 = 0, BF16 = 1, INT8 = 2, INT4 = 3 };
constexpr int64_t TENSORS_PER_PART[] = {1, 1, 2, 3};
enum Act { SILU = 0, GELU_TANH = 1 };
constexpr int64_t FIRST_PART = 9;  // t: 5 norms and 4 biases, then the projections' parts
constexpr int64_t GEMV_ROWS = 4;  // astrai.infer.native.GEMV_ROWS: float32 and bf16 steps of more rows use torch's product

extern "C" __attribute__((target("avx512f"))) __m512 Sleef_expf16_u10(__m512);
extern "C" __attribute__((target("avx512f"))) __m512 Sleef_tanhf16_u10(__m512);
extern "C" __attribute__((target("avx2,fma"))) __m256 Sleef_expf8_u10avx2(__m256);
extern "C" __attribute__((target("avx2,fma"))) __m256 Sleef_tanhf8_u10avx2(__m256);

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

// act(gate) rounded to T_, for n float32 inputs: torch's formulas (silu: x / (1 + exp(-x)); gelu tanh:
// 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))), exp and tanh by Sleef as torch's vectorized kernels
constexpr float GELU_BETA = 0.7978845608028654f, GELU_KAPPA = 0.044715f;

__attribute__((target("avx512f"))) void act_512(float* v, int64_t n, int64_t act) {
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t left = n - i;
    const __mmask16 mask = astrai::tail_mask16(left);
    const __m512 x = _mm512_maskz_loadu_ps(mask, v + i), one = _mm512_set1_ps(1.f);
    __m512 y;
    if (act == SILU) {
      y = _mm512_div_ps(x, _mm512_add_ps(one, Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), x))));
    } else {
      const __m512 inner = _mm512_mul_ps(_mm512_set1_ps(GELU_BETA),
          _mm512_add_ps(x, _mm512_mul_ps(_mm512_set1_ps(GELU_KAPPA), _mm512_mul_ps(x, _mm512_mul_ps(x, x)))));
      y = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x), _mm512_add_ps(one, Sleef_tanhf16_u10(inner)));
    }
    _mm512_mask_storeu_ps(v + i, mask, y);
  }
}

__attribute__((target("avx2,fma"))) void act_256(float* v, int64_t n, int64_t act) {
  int64_t i = 0;
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(v + i);
    __m256 y;
    if (act == SILU) {
      y = _mm256_div_ps(x, _mm256_add_ps(one, Sleef_expf8_u10avx2(_mm256_sub_ps(_mm256_setzero_ps(), x))));
    } else {
      const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(GELU_BETA),
          _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(GELU_KAPPA), _mm256_mul_ps(x, _mm256_mul_ps(x, x)))));
      y = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, Sleef_tanhf8_u10avx2(inner)));
    }
    _mm256_storeu_ps(v + i, y);
  }
  for (; i < n; ++i) {
    const float x = v[i];
    v[i] = act == SILU ? x / (1.f + std::exp(-x))
                       : 0.5f * x * (1.f + std::tanh(GELU_BETA * (x + GELU_KAPPA * x * x * x)));
  }
}

// gu [T, 2I] -> out [T, I]: act(gate) rounded to T_, times up, rounded (torch's act(...).mul_(up))
template <typename T_>
void gated(const T_* gu, int64_t T, int64_t I, int64_t act, int64_t isa, T_* out) {
  std::vector<float> g(I);
  for (int64_t t = 0; t < T; ++t) {
    const T_* row = gu + t * 2 * I;
    for (int64_t i = 0; i < I; ++i) g[i] = to_float(row[i]);
    if (isa >= 2) act_512(g.data(), I, act); else act_256(g.data(), I, act);
    for (int64_t i = 0; i < I; ++i) out[t * I + i] = static_cast<T_>(to_float(static_cast<T_>(g[i])) * to_float(row[I + i]));
  }
}

// RMSNorm in place of `rows` rows of D (row r at p + r * stride), the model's formula in the activations'
// dtype (astrai.infer.fused.rms_norm): r = rsqrt(mean(x^2) + eps) in float32; float32: x * r * w; bf16 with
// `offset` (Gemma's float32 1 + w): round(x * r * w); bf16 otherwise: round(round(x * r) * w), w bf16. w has
// D values, or D per row (`w_rows`: q/k norms stacked per head).
template <typename T_, typename W>
void norm_rows(T_* p, int64_t rows, int64_t stride, int64_t D, const W* w, bool w_rows, float eps, bool offset) {
  for (int64_t r = 0; r < rows; ++r) {
    T_* x = p + r * stride;
    const W* wr = w + (w_rows ? r * D : 0);
    float ss = 0.f;
    for (int64_t d = 0; d < D; ++d) ss += to_float(x[d]) * to_float(x[d]);
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
    for (int64_t d = 0; d < D; ++d) {
      const float h = to_float(x[d]) * inv;
      if (std::is_same<T_, float>::value || offset) {
        x[d] = static_cast<T_>(h * static_cast<float>(wr[d]));
      } else {
        x[d] = static_cast<T_>(to_float(static_cast<T_>(h)) * static_cast<float>(wr[d]));
      }
    }
  }
}

template <typename T_>
void norm_with(T_* p, int64_t rows, int64_t stride, int64_t D, const at::Tensor& w, bool w_rows, float eps, bool offset) {
  if (w.scalar_type() == at::kFloat) {
    norm_rows(p, rows, stride, D, w.data_ptr<float>(), w_rows, eps, offset);
  } else {
    norm_rows(p, rows, stride, D, w.data_ptr<at::BFloat16>(), w_rows, eps, offset);
  }
}

struct Layer {
  const c10::List<std::optional<at::Tensor>>& t;
  int64_t base;  // the layer's first tensor in t
  int64_t kind, bf16_isa, int8_isa;
  at::Tensor get(int64_t i) const { return t.get(base + i).value(); }
  bool has(int64_t i) const { return t.get(base + i).has_value(); }

  // out [T, N] (rows N apart, in the activations' dtype) = in @ the parts' rows stacked, + bias
  template <typename T_>
  void project(const T_* in, int64_t T, int64_t K, int64_t first, int64_t parts, int64_t bias, T_* out, int64_t N) const {
    int64_t col = 0;
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t at_ = first + p * TENSORS_PER_PART[kind];
      const at::Tensor w = get(at_);
      const int64_t n = w.size(0);
      TORCH_CHECK(w.is_contiguous() && (kind == INT4 ? w.size(1) * 2 : w.size(1)) == K,
                  "astrai::decode_layers: a weight of another shape than its input");
      if ((kind == F32 || kind == BF16) && T > GEMV_ROWS) {  // many rows: torch's blocked product reuses W better
        const at::Tensor y = at::linear(at::from_blob(const_cast<T_*>(in), {T, K}, w.options()), w);
        const T_* yp = y.data_ptr<T_>();
        for (int64_t r = 0; r < T; ++r) std::memcpy(out + r * N + col, yp + r * n, n * sizeof(T_));
      } else if constexpr (std::is_same<T_, at::BFloat16>::value) {
        astrai::gemv_bf16_into(in, T, K, w.data_ptr<at::BFloat16>(), n, out + col, N, bf16_isa);
      } else if (kind == F32) {
        astrai::gemv_f32_into(in, T, K, w.data_ptr<float>(), n, out + col, N, int8_isa);
      } else if (kind == INT8) {
        astrai::gemv_int8_into(in, T, K, w.data_ptr<int8_t>(), get(at_ + 1).data_ptr<float>(), n, out + col, N,
                               int8_isa);
      } else {
        astrai::gemv_int4_into(in, T, K, w.data_ptr<uint8_t>(), get(at_ + 1).data_ptr<float>(),
                               get(at_ + 2).data_ptr<float>(), n, out + col, N);
      }
      col += n;
    }
    TORCH_CHECK(col == N, "astrai::decode_layers: the parts' rows do not add up to the projection's");
    if (has(bias)) {
      const at::Tensor b = get(bias);
      TORCH_CHECK(b.numel() == N && b.scalar_type() == (std::is_same<T_, float>::value ? at::kFloat : at::kBFloat16),
                  "astrai::decode_layers: a bias of another size or dtype");
      const T_* bp = b.data_ptr<T_>();
      for (int64_t r = 0; r < T; ++r)
        for (int64_t j = 0; j < N; ++j) out[r * N + j] = static_cast<T_>(to_float(out[r * N + j]) + to_float(bp[j]));
    }
  }
};

template <typename T_>
at::Tensor run_layer(const at::Tensor& x, const Layer& L, at::IntArrayRef cfg, float eps, float scale,
                     const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& write_slots, const at::Tensor& slots,
                     const at::Tensor& counts, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t T = x.size(0), H = x.size(1), hq = cfg[0], hkv = cfg[1], d = cfg[2], act = cfg[3];
  const bool offset = cfg[6] != 0, bf16 = std::is_same<T_, at::BFloat16>::value;
  const int64_t n_qkv = cfg[8], n_o = cfg[9], n_gu = cfg[10], n_down = cfg[11];
  const int64_t per = TENSORS_PER_PART[L.kind];
  const int64_t p_qkv = FIRST_PART, p_o = p_qkv + n_qkv * per, p_gu = p_o + n_o * per, p_down = p_gu + n_gu * per;
  const at::ScalarType st = bf16 ? at::kBFloat16 : at::kFloat;
  const int64_t nqkv = (hq + 2 * hkv) * d, nq = hq * d;
  const int64_t I = L.get(p_down).size(1) * (L.kind == INT4 ? 2 : 1);
  const int64_t isa = L.int8_isa;
  auto opt = x.options().dtype(st);

  at::Tensor h = at::empty({T, H}, opt), qkv = at::empty({T, nqkv}, opt), attn = at::empty({T, nq}, opt);
  astrai::rms_norm_into(x.data_ptr<float>(), L.get(0), T, H, eps, h.data_ptr(), bf16);
  T_* qp = qkv.data_ptr<T_>();
  L.project(h.data_ptr<T_>(), T, H, p_qkv, n_qkv, 5, qp, nqkv);
  if (L.has(1)) {  // q/k norms: each head's D values, the weights stacked per head
    for (int64_t t = 0; t < T; ++t) norm_with(qp + t * nqkv, hq + hkv, d, d, L.get(1), true, eps, offset);
  }
  astrai::rope_into(qp, bf16, T, hq + hkv, d, nqkv, d, cos.data_ptr(), sin.data_ptr());
  const int64_t* ws = write_slots.data_ptr<int64_t>();
  T_ *kp = kc.data_ptr<T_>(), *vp = vc.data_ptr<T_>();
  const int64_t row = hkv * d, S = kc.size(0);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(ws[t] >= 0 && ws[t] < S, "astrai::decode_layers: a write slot past the cache");
    std::memcpy(kp + ws[t] * row, qp + t * nqkv + nq, row * sizeof(T_));
    std::memcpy(vp + ws[t] * row, qp + t * nqkv + nq + row, row * sizeof(T_));
  }
  astrai::decode_attention_into(qp, nqkv, T, hq, d, kc, vc, slots.data_ptr<int64_t>(), counts.data_ptr<int64_t>(),
                                slots.size(1), scale, attn.data_ptr(), isa);

  at::Tensor y = at::empty({T, H}, opt), out = at::empty({T, H}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  T_* yp = y.data_ptr<T_>();
  L.project(attn.data_ptr<T_>(), T, nq, p_o, n_o, 6, yp, H);
  if (L.has(2)) norm_with(yp, T, H, H, L.get(2), false, eps, offset);
  for (int64_t i = 0; i < T * H; ++i) op[i] = xp[i] + to_float(yp[i]);

  astrai::rms_norm_into(op, L.get(3), T, H, eps, h.data_ptr(), bf16);
  at::Tensor gu = at::empty({T, 2 * I}, opt), a = at::empty({T, I}, opt);
  L.project(h.data_ptr<T_>(), T, H, p_gu, n_gu, 7, gu.data_ptr<T_>(), 2 * I);
  gated(gu.data_ptr<T_>(), T, I, act, isa, a.data_ptr<T_>());
  L.project(a.data_ptr<T_>(), T, I, p_down, n_down, 8, yp, H);
  if (L.has(4)) norm_with(yp, T, H, H, L.get(4), false, eps, offset);
  for (int64_t i = 0; i < T * H; ++i) op[i] += to_float(yp[i]);
  return out;
}

// checks one layer's arguments (cfg: its 12 values) against x; returns how many tensors of t it takes
int64_t check_layer(const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& t, int64_t base, at::IntArrayRef cfg,
                    const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& slots, const at::Tensor& counts,
                    const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t kind = cfg[7];
  TORCH_CHECK(kind >= F32 && kind <= INT4 && cfg[3] >= SILU && cfg[3] <= GELU_TANH, "astrai::decode_layers: kind, act");
  const int64_t used = FIRST_PART + (cfg[8] + cfg[9] + cfg[10] + cfg[11]) * TENSORS_PER_PART[kind];
  TORCH_CHECK(base + used <= static_cast<int64_t>(t.size()), "astrai::decode_layers: fewer tensors than cfg says");
  const at::ScalarType st = kind == BF16 ? at::kBFloat16 : at::kFloat;
  TORCH_CHECK(kc.scalar_type() == st && vc.scalar_type() == st && kc.is_contiguous() && vc.is_contiguous() &&
              kc.dim() == 3 && kc.size(1) == cfg[1] && kc.size(2) == cfg[2] && kc.sizes() == vc.sizes(),
              "astrai::decode_layers: caches [S, Hkv, D] contiguous, in the activations' dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && counts.scalar_type() == at::kLong && slots.is_contiguous() &&
              counts.is_contiguous() && slots.dim() == 2 && slots.size(0) == x.size(0) && counts.numel() == x.size(0),
              "astrai::decode_layers: int64 slots [T, L] and counts [T]");
  TORCH_CHECK(cos.scalar_type() == st && sin.scalar_type() == st && cos.is_contiguous() && sin.is_contiguous() &&
              cos.numel() == x.size(0) * cfg[2] && sin.numel() == cos.numel(),
              "astrai::decode_layers: cos and sin [T, 1, D] in the activations' dtype");
  TORCH_CHECK(kind != INT4 || cfg[5] >= 2, "astrai::decode_layers: int4 needs AVX-512");
  return used;
}

// layers i = 0.. of k_caches' count in turn, layer i with cfg[12 i: 12 i + 12], its tensors next in t, its caches,
// its read slots and counts, its RoPE tables
at::Tensor decode_layers(const at::Tensor& x, const c10::List<std::optional<at::Tensor>>& t, at::IntArrayRef cfg,
                         at::ArrayRef<double> fc, at::TensorList k_caches, at::TensorList v_caches,
                         const at::Tensor& write_slots, at::TensorList slots, at::TensorList counts, at::TensorList cos,
                         at::TensorList sin) {
  const int64_t n = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(cfg.size()) == 12 * n && fc.size() == 2 && v_caches.size() == k_caches.size() &&
              slots.size() == k_caches.size() && counts.size() == k_caches.size() && cos.size() == k_caches.size() &&
              sin.size() == k_caches.size(), "astrai::decode_layers: 12 cfg values, caches, slots, counts and "
              "tables per layer; fc [eps, scale]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(0) == write_slots.numel() &&
              write_slots.scalar_type() == at::kLong && write_slots.is_contiguous(),
              "astrai::decode_layers: x float32 [T, H] contiguous, an int64 write slot per row");
  const float eps = static_cast<float>(fc[0]), scale = static_cast<float>(fc[1]);
  at::Tensor h = x;
  int64_t base = 0;
  for (int64_t i = 0; i < n; ++i) {
    const at::IntArrayRef c = cfg.slice(12 * i, 12);
    const int64_t used = check_layer(h, t, base, c, k_caches[i], v_caches[i], slots[i], counts[i], cos[i], sin[i]);
    const Layer L{t, base, c[7], c[4], c[5]};
    if (c[7] == BF16) {
      h = run_layer<at::BFloat16>(h, L, c, eps, scale, k_caches[i], v_caches[i], write_slots, slots[i], counts[i],
                                  cos[i], sin[i]);
    } else {
      h = run_layer<float>(h, L, c, eps, scale, k_caches[i], v_caches[i], write_slots, slots[i], counts[i], cos[i],
                           sin[i]);
    }
    base += used;
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(astrai, m) {
  m.def("decode_layers(Tensor x, Tensor?[] t, int[] cfg, float[] fc, Tensor[] k_caches, Tensor[] v_caches, "
        "Tensor write_slots, Tensor[] slots, Tensor[] counts, Tensor[] cos, Tensor[] sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(astrai, CPU, m) {
  m.impl("decode_layers", &decode_layers);
}
