// Few-row products of the CPU engine's decode steps: y [M, N] = x [M, K] @ W[N, K]^T, W in bfloat16, int8
// (one float32 scale per output row) or int4 (a scale and an offset per group of 32 input columns), for M
// of a handful of rows (a decode step of one or a few requests). Built at first use with cpu_decode.cpp by
// astrai.infer.native (torch.utils.cpp_extension) and registered as the torch operators
// astrai::gemv_bf16, astrai::gemv_int8 and astrai::gemv_int4.
//
// Why: at one row a step is a stream of the weights through the cores, and torch's bf16 and int8
// one-row kernels (oneDNN's, _weight_int8pack_mm) run far below the memory's speed on a 2-core CPU
// (bench/RESULTS.md). Here each thread takes a contiguous range of output rows and streams them, four
// rows at a time, each row's K weights read once for all M rows of x.
//
// Arithmetic: the sums accumulate in float32 in an order of our own (8 or 16 lanes, then the lanes
// added). A bf16 times a bf16 is exact in float32; a float32 activation times an int8 weight is
// rounded once, as any float32 product. The bf16 result is rounded once to bf16 (nearest even); the
// int8 result is the float32 sum times the row's scale, as torch's _weight_int8pack_mm computes it.
//
// Instruction sets, chosen by the caller (`isa`): 2 = AVX-512 BF16 (VDPBF16PS multiplies bf16 pairs and
// adds in float32), 1 = AVX2 + FMA (bf16 widened to float32 by a shift: a bf16 is a float32's upper
// half). int8 uses AVX-512F at isa 2 and AVX2 at isa 1.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"

namespace {

constexpr int64_t NR = 4;  // output rows per tile
constexpr int64_t MR = 4;  // rows of x per pass over a tile
// each weight load also prefetches the same line 32 rows on (eight tiles ahead): without it the 30 layers' bf16
// products of SmolLM2 took 12.1 ms a step on a 2-core Sapphire Rapids, with it 8.3-9.9 ms for distances of
// 4 to 32 rows (within that machine's noise; bench/RESULTS.md)
constexpr int64_t PREFETCH_ROWS = 32;
// float32 rows are twice as long: 8 rows ahead
constexpr int64_t PREFETCH_ROWS_F32 = 8;

inline float bf16_to_float(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---------------------------------------------------------------- AVX-512
// Tiles are templates on their row counts, so the M x N accumulators stay in registers.

template <int M, int N>
__attribute__((target("avx512f"))) inline void zero_512(__m512 (&acc)[M][N]) {
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < N; ++r) acc[m][r] = _mm512_setzero_ps();
}

// out[m, r] = the lanes of acc[m][r] added, converted to Out (bf16: rounded to nearest even)
template <int M, int N, typename Out>
__attribute__((target("avx512f"))) inline void store_512(__m512 (&acc)[M][N], Out* out, int64_t ldo) {
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < N; ++r) out[m * ldo + r] = static_cast<Out>(_mm512_reduce_add_ps(acc[m][r]));
}

template <int M, int N, typename Out>
__attribute__((target("avx512f,avx512bw,avx512bf16")))
void bf16_tile_512(const uint16_t* x, int64_t K, const uint16_t* w, Out* out, int64_t ldo) {
  __m512 acc[M][N];
  zero_512(acc);
  for (int64_t k = 0; k < K; k += 32) {
    const int64_t left = K - k;
    const __mmask32 mask = left >= 32 ? 0xffffffffu : ((1u << left) - 1u);
    __m512i wv[N];
    for (int r = 0; r < N; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (r + PREFETCH_ROWS) * K + k), _MM_HINT_T0);
      wv[r] = _mm512_maskz_loadu_epi16(mask, w + r * K + k);
    }
    for (int m = 0; m < M; ++m) {
      const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + m * K + k);
      for (int r = 0; r < N; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], (__m512bh)xv, (__m512bh)wv[r]);
    }
  }
  store_512(acc, out, ldo);
}

template <int M, int N>
__attribute__((target("avx512f")))
void f32_tile_512(const float* x, int64_t K, const float* w, float* out, int64_t ldo) {
  __m512 acc[M][N];
  zero_512(acc);
  for (int64_t k = 0; k < K; k += 16) {
    const int64_t left = K - k;
    const __mmask16 mask = astrai::tail_mask16(left);
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_maskz_loadu_ps(mask, x + m * K + k);
    for (int r = 0; r < N; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (r + PREFETCH_ROWS_F32) * K + k), _MM_HINT_T0);
      const __m512 wv = _mm512_maskz_loadu_ps(mask, w + r * K + k);
      for (int m = 0; m < M; ++m) acc[m][r] = _mm512_fmadd_ps(xv[m], wv, acc[m][r]);
    }
  }
  store_512(acc, out, ldo);
}

template <int M, int N>
__attribute__((target("avx512f,avx512bw,avx512vl")))
void int8_tile_512(const float* x, int64_t K, const int8_t* w, float* out, int64_t ldo) {
  __m512 acc[M][N];
  zero_512(acc);
  for (int64_t k = 0; k < K; k += 16) {
    const int64_t left = K - k;
    const __mmask16 mask = astrai::tail_mask16(left);
    __m512 wv[N];
    for (int r = 0; r < N; ++r) {
      if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (r + PREFETCH_ROWS) * K + k), _MM_HINT_T0);
      wv[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w + r * K + k)));
    }
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
      for (int r = 0; r < N; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  store_512(acc, out, ldo);
}

// int4, groups of 32 input columns: codes [N, K / 2] bytes, byte j of a group holding q[k = j] (low nibble)
// and q[k = j + 16] (high); w = scale * q + offset per (row, group). The kernel sums
// scale[n, g] * sum_{k in g} x[k] q[n, k] in the lanes; the offsets' part (offset[n, g] times the group's
// sum of x) is added once per row by the caller.
template <int M, int N>
__attribute__((target("avx512f,avx512bw,avx512vl")))
void int4_tile_512(const float* x, int64_t K, const uint8_t* codes, const float* scales, float* out, int64_t ldo) {
  const int64_t G = K / 32, row_bytes = K / 2;
  __m512 acc[M][N];
  zero_512(acc);
  const __m512i low4 = _mm512_set1_epi32(0xf);
  for (int64_t g = 0; g < G; ++g) {
    __m512 lo[N], hi[N];
    for (int r = 0; r < N; ++r) {
      const uint8_t* at = codes + r * row_bytes + g * 16;
      if ((g & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(at + PREFETCH_ROWS * row_bytes), _MM_HINT_T0);
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
      lo[r] = _mm512_cvtepi32_ps(_mm512_and_si512(v, low4));
      hi[r] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
    }
    for (int m = 0; m < M; ++m) {
      const __m512 xl = _mm512_loadu_ps(x + m * K + g * 32), xh = _mm512_loadu_ps(x + m * K + g * 32 + 16);
      for (int r = 0; r < N; ++r) {
        const __m512 part = _mm512_fmadd_ps(xl, lo[r], _mm512_mul_ps(xh, hi[r]));
        acc[m][r] = _mm512_fmadd_ps(part, _mm512_set1_ps(scales[r * G + g]), acc[m][r]);
      }
    }
  }
  store_512(acc, out, ldo);
}

// ---------------------------------------------------------------- AVX2 + FMA

__attribute__((target("avx2,fma")))
inline float hsum_256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// x is float32 here (the caller widens bf16 x once); W's rows are widened 8 at a time by `Rows::load`
template <int M, int N, typename Rows, typename Out>
__attribute__((target("avx2,fma")))
void tile_256(const float* x, int64_t K, const Rows& w, Out* out, int64_t ldo) {
  __m256 acc[M][N];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < N; ++r) acc[m][r] = _mm256_setzero_ps();
  const int64_t K8 = K - K % 8;
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 wv[N];
    for (int r = 0; r < N; ++r) {
      if ((k & w.per_line) == 0) _mm_prefetch(reinterpret_cast<const char*>(w.row(r + PREFETCH_ROWS) + k), _MM_HINT_T0);
      wv[r] = w.load(r, k);
    }
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < N; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < N; ++r) {
      float s = hsum_256(acc[m][r]);
      for (int64_t k = K8; k < K; ++k) s += x[m * K + k] * w.at(r, k);
      out[m * ldo + r] = static_cast<Out>(s);
    }
}

struct Bf16Rows {  // rows of bf16 weights from `w`, K each
  const uint16_t* w;
  int64_t K;
  static constexpr int64_t per_line = 31;  // k & per_line == 0: a new 64-byte line
  const uint16_t* row(int64_t r) const { return w + r * K; }
  __attribute__((target("avx2,fma"))) __m256 load(int64_t r, int64_t k) const {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * K + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  float at(int64_t r, int64_t k) const { return bf16_to_float(w[r * K + k]); }
};

struct F32Rows {
  const float* w;
  int64_t K;
  static constexpr int64_t per_line = 15;
  const float* row(int64_t r) const { return w + r * K; }
  __attribute__((target("avx2,fma"))) __m256 load(int64_t r, int64_t k) const { return _mm256_loadu_ps(w + r * K + k); }
  float at(int64_t r, int64_t k) const { return w[r * K + k]; }
};

struct Int8Rows {
  const int8_t* w;
  int64_t K;
  static constexpr int64_t per_line = 63;
  const int8_t* row(int64_t r) const { return w + r * K; }
  __attribute__((target("avx2,fma"))) __m256 load(int64_t r, int64_t k) const {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + r * K + k));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
  float at(int64_t r, int64_t k) const { return static_cast<float>(w[r * K + k]); }
};

// ---------------------------------------------------------------- the operators

void check(const at::Tensor& x, const at::Tensor& w, at::ScalarType xt, at::ScalarType wt, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, op, ": x [M, K] and w [N, K]");
  TORCH_CHECK(x.size(1) == w.size(1), op, ": x has ", x.size(1), " columns, w ", w.size(1));
  TORCH_CHECK(x.scalar_type() == xt && w.scalar_type() == wt, op, ": wrong dtypes");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), op, ": contiguous tensors only");
}

// calls f.operator()<M, N>() for runtime row counts 1 <= mr <= MR, 1 <= nr <= NR
template <int M, typename F>
void with_n(int64_t nr, F& f) {
  switch (nr) {
    case 1: f.template operator()<M, 1>(); break;
    case 2: f.template operator()<M, 2>(); break;
    case 3: f.template operator()<M, 3>(); break;
    default: f.template operator()<M, 4>();
  }
}

template <typename F>
void with_rows(int64_t mr, int64_t nr, F&& f) {
  switch (mr) {
    case 1: with_n<1>(nr, f); break;
    case 2: with_n<2>(nr, f); break;
    case 3: with_n<3>(nr, f); break;
    default: with_n<4>(nr, f);
  }
}

// runs tile(m0, m_rows, n0, n_rows, out + m0 * ldo + n0) over the output, threads splitting N
template <typename Out, typename Tile>
void over_tiles(int64_t M, int64_t N, Out* out, int64_t ldo, Tile tile) {
  const int64_t tiles = (N + NR - 1) / NR;
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
      const int64_t m_rows = std::min(MR, M - m0);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * NR;
        tile(m0, m_rows, n0, std::min(NR, N - n0), out + m0 * ldo + n0);
      }
    }
  });
}

}  // namespace

namespace astrai {

void gemv_bf16_into(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* w, int64_t N, at::BFloat16* out,
                    int64_t ldo, int64_t isa) {
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w);
  if (isa >= 2) {
    over_tiles(M, N, out, ldo, [&](int64_t m0, int64_t mr, int64_t n0, int64_t nr, at::BFloat16* o) {
      with_rows(mr, nr, [&]<int M_, int N_>() { bf16_tile_512<M_, N_>(xp + m0 * K, K, wp + n0 * K, o, ldo); });
    });
  } else {
    std::vector<float> xf(M * K);  // x widened once
    for (int64_t i = 0; i < M * K; ++i) xf[i] = bf16_to_float(xp[i]);
    const float* xfp = xf.data();
    over_tiles(M, N, out, ldo, [&](int64_t m0, int64_t mr, int64_t n0, int64_t nr, at::BFloat16* o) {
      with_rows(mr, nr, [&]<int M_, int N_>() { tile_256<M_, N_>(xfp + m0 * K, K, Bf16Rows{wp + n0 * K, K}, o, ldo); });
    });
  }
}

void gemv_f32_into(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* out, int64_t ldo,
                   int64_t isa) {
  over_tiles(M, N, out, ldo, [&](int64_t m0, int64_t mr, int64_t n0, int64_t nr, float* o) {
    if (isa >= 2) {
      with_rows(mr, nr, [&]<int M_, int N_>() { f32_tile_512<M_, N_>(x + m0 * K, K, w + n0 * K, o, ldo); });
    } else {
      with_rows(mr, nr, [&]<int M_, int N_>() { tile_256<M_, N_>(x + m0 * K, K, F32Rows{w + n0 * K, K}, o, ldo); });
    }
  });
}

void gemv_int8_into(const float* x, int64_t M, int64_t K, const int8_t* w, const float* scales, int64_t N, float* out,
                    int64_t ldo, int64_t isa) {
  over_tiles(M, N, out, ldo, [&](int64_t m0, int64_t mr, int64_t n0, int64_t nr, float* o) {
    if (isa >= 2) {
      with_rows(mr, nr, [&]<int M_, int N_>() { int8_tile_512<M_, N_>(x + m0 * K, K, w + n0 * K, o, ldo); });
    } else {
      with_rows(mr, nr, [&]<int M_, int N_>() { tile_256<M_, N_>(x + m0 * K, K, Int8Rows{w + n0 * K, K}, o, ldo); });
    }
    for (int64_t m = 0; m < mr; ++m)
      for (int64_t r = 0; r < nr; ++r) o[m * ldo + r] *= scales[n0 + r];
  });
}

void gemv_int4_into(const float* x, int64_t M, int64_t K, const uint8_t* codes, const float* scales,
                    const float* offsets, int64_t N, float* out, int64_t ldo) {
  const int64_t G = K / 32;
  std::vector<float> xs(M * G, 0.f);  // [M, G]: each group's sum of x, for the offsets
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xs[m * G + k / 32] += x[m * K + k];
  const float* xsp = xs.data();
  over_tiles(M, N, out, ldo, [&](int64_t m0, int64_t mr, int64_t n0, int64_t nr, float* o) {
    with_rows(mr, nr, [&]<int M_, int N_>() {
      int4_tile_512<M_, N_>(x + m0 * K, K, codes + n0 * (K / 2), scales + n0 * G, o, ldo);
    });
    for (int64_t m = 0; m < mr; ++m)
      for (int64_t r = 0; r < nr; ++r) {
        float add = 0.f;
        for (int64_t g = 0; g < G; ++g) add += offsets[(n0 + r) * G + g] * xsp[(m0 + m) * G + g];
        o[m * ldo + r] += add;
      }
  });
}

}  // namespace astrai

namespace {

at::Tensor gemv_bf16(const at::Tensor& x, const at::Tensor& w, int64_t isa, int64_t max_rows) {
  check(x, w, at::kBFloat16, at::kBFloat16, "astrai::gemv_bf16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (M > max_rows) return at::linear(x, w);  // many rows: torch's blocked product (oneDNN, AMX) reuses W better
  at::Tensor out = at::empty({M, N}, x.options());  // each sum rounded to nearest even, once, as it is stored
  astrai::gemv_bf16_into(x.data_ptr<at::BFloat16>(), M, K, w.data_ptr<at::BFloat16>(), N, out.data_ptr<at::BFloat16>(),
                         N, isa);
  return out;
}

at::Tensor gemv_f32(const at::Tensor& x, const at::Tensor& w, int64_t isa, int64_t max_rows) {
  check(x, w, at::kFloat, at::kFloat, "astrai::gemv_f32");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (M > max_rows) return at::linear(x, w);
  at::Tensor out = at::empty({M, N}, x.options());
  astrai::gemv_f32_into(x.data_ptr<float>(), M, K, w.data_ptr<float>(), N, out.data_ptr<float>(), N, isa);
  return out;
}

at::Tensor gemv_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales, int64_t isa) {
  check(x, w, at::kFloat, at::kChar, "astrai::gemv_int8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == w.size(0) && scales.is_contiguous(),
              "astrai::gemv_int8: scales float32 [N]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  astrai::gemv_int8_into(x.data_ptr<float>(), M, K, w.data_ptr<int8_t>(), scales.data_ptr<float>(), N,
                         out.data_ptr<float>(), N, isa);
  return out;
}

at::Tensor gemv_int4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const at::Tensor& offsets) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && codes.scalar_type() == at::kByte && x.dim() == 2 && codes.dim() == 2,
              "astrai::gemv_int4: x float32 [M, K], codes uint8 [N, K / 2]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0), G = K / 32;
  TORCH_CHECK(K % 32 == 0 && codes.size(1) == K / 2, "astrai::gemv_int4: K a multiple of 32, codes [N, K / 2]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && offsets.scalar_type() == at::kFloat && scales.numel() == N * G &&
              offsets.numel() == N * G, "astrai::gemv_int4: scales and offsets float32 [N, K / 32]");
  TORCH_CHECK(x.is_contiguous() && codes.is_contiguous() && scales.is_contiguous() && offsets.is_contiguous(),
              "astrai::gemv_int4: contiguous tensors only");
  at::Tensor out = at::empty({M, N}, x.options());
  astrai::gemv_int4_into(x.data_ptr<float>(), M, K, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                         offsets.data_ptr<float>(), N, out.data_ptr<float>(), N);
  return out;
}

}  // namespace

TORCH_LIBRARY(astrai, m) {
  m.def("gemv_bf16(Tensor x, Tensor w, int isa, int max_rows) -> Tensor");
  m.def("gemv_f32(Tensor x, Tensor w, int isa, int max_rows) -> Tensor");
  m.def("gemv_int8(Tensor x, Tensor w, Tensor scales, int isa) -> Tensor");
  m.def("gemv_int4(Tensor x, Tensor codes, Tensor scales, Tensor offsets) -> Tensor");
}

TORCH_LIBRARY_IMPL(astrai, CPU, m) {
  m.impl("gemv_bf16", &gemv_bf16);
  m.impl("gemv_f32", &gemv_f32);
  m.impl("gemv_int8", &gemv_int8);
  m.impl("gemv_int4", &gemv_int4);
}
