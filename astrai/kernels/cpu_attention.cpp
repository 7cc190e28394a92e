// The backward of causal attention in bf16 for training, on CPUs whose oneDNN multiplies bf16 into float32
// with AMX or AVX-512 BF16: torch.ops.astrai.causal_attention_backward, called by astrai.model.cpu_ops
// after torch's flash forward (whose backward computes every score of each query block, the masked half
// included, at a fraction of the rate of these products).
//
// q [S, Hq, D], k/v [S, Hkv, D] (rows of each tensor `stride(0)` apart, heads D apart), out and dout [S, Hq, D],
// lse [Hq, S] float32 (the forward's log-sum-exp of the scaled scores per head and query); Hq a multiple of
// Hkv (grouped-query attention: query head h reads K/V head h / (Hq / Hkv)). Returns dq, dk, dv [S, H, D] bf16.
//
// The sequence goes in blocks of `block` positions. Every product is oneDNN's bf16 x bf16 -> float32 matrix
// product (at::native::cpublas::brgemm on plain operands), over the keys the causal mask leaves, up to 512
// columns at a time:
// - pass 1, per (K/V head, key block j), for each query head of the group, over the queries from j on:
//   S^T = K_j Q^T, P^T = exp(scale S^T - lse), dV_j += P^T dO, dP^T = V_j dO^T,
//   dS^T = P^T (dP^T - rowsum(dO o O)), dK_j += dS^T Q; dK = scale dK.
// - pass 2, per (query head, query block i), over the keys up to i's last: the same S, P, dP, dS,
//   dQ_i += dS K; dQ = scale dQ.
// P and dS are rounded to bf16 for the products that take them (as torch's flash backward rounds them); dQ,
// dK and dV are summed in float32 and rounded once. Each output block is one thread's: deterministic.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#include <immintrin.h>

#include "cpu_kernels.h"

namespace {

using bf16 = at::BFloat16;
namespace blas = at::native::cpublas;

// c [M, N] (ldc) (+)= a [M, K] (lda) @ b [K, N] (ldb): bf16 operands, float32 sums (brgemm on plain, not
// pair-interleaved, operands: oneDNN's bf16 x bf16 -> float32 matrix product)
inline void gemm(int64_t M, int64_t N, int64_t K, const bf16* a, int64_t lda, const bf16* b, int64_t ldb, float* c,
                 int64_t ldc, bool add) {
  blas::brgemm(M, N, K, lda, ldb, ldc, add, a, b, c, false);
}

// dst [rows, cols] bf16 (ld_dst) <- src [rows, cols] float32 (ld_src) * mul, rounded as torch rounds
__attribute__((target("avx512f,avx512bw,avx512vl"))) void to_bf16(const float* src, int64_t ld_src, bf16* dst,
                                                                   int64_t ld_dst, int64_t rows, int64_t cols,
                                                                   float mul) {
  const __m512 m = _mm512_set1_ps(mul);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 mask = astrai::tail_mask16(cols - c);
      const __m512 x = _mm512_maskz_loadu_ps(mask, src + r * ld_src + c);
      astrai::store_bf16x16(dst + r * ld_dst + c, mask, _mm512_mul_ps(x, m));
    }
  }
}

// dst [cols, rows] (ld_dst) <- src [rows, cols] (ld_src) transposed, bf16; 32 rows at a time, so each
// written run is one cache line
void transpose(const bf16* src, int64_t ld_src, bf16* dst, int64_t ld_dst, int64_t rows, int64_t cols) {
  for (int64_t r0 = 0; r0 < rows; r0 += 32) {
    const int64_t r1 = std::min(rows, r0 + 32);
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t r = r0; r < r1; ++r) dst[c * ld_dst + r] = src[r * ld_src + c];
  }
}

// sum over d of a[d] * b[d], bf16 vectors of n
__attribute__((target("avx512f,avx512bw,avx512vl"))) float dot_bf16(const bf16* a, const bf16* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += 16) {
    const __mmask16 mask = astrai::tail_mask16(n - d);
    acc = _mm512_fmadd_ps(astrai::load_bf16x16(a + d, mask), astrai::load_bf16x16(b + d, mask), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// p [n_r, n_c] (ld) <- exp(scale * p - lse), lse per row (`lse_rows`, one per row) or per column (`lse_cols`,
// contiguous); entries of a key past the query (causal) <- 0. Positions: rows from row_pos, columns from col_pos;
// rows_are_queries says which of the two holds the queries.
__attribute__((target("avx512f,avx512bw"))) void probabilities(float* p, int64_t ld, int64_t n_r, int64_t n_c,
                                                                float scale, const float* lse_rows,
                                                                const float* lse_cols, int64_t row_pos,
                                                                int64_t col_pos, bool rows_are_queries) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < n_r; ++r) {
    float* pr = p + r * ld;
    const __m512 row_lse = _mm512_set1_ps(lse_rows ? lse_rows[r] : 0.f);
    for (int64_t c = 0; c < n_c; c += 16) {
      const __mmask16 mask = astrai::tail_mask16(n_c - c);
      const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, pr + c), s);
      const __m512 l = lse_rows ? row_lse : _mm512_maskz_loadu_ps(mask, lse_cols + c);
      _mm512_mask_storeu_ps(pr + c, mask, astrai::exp16(_mm512_sub_ps(x, l)));
    }
    // causal: query q sees keys k <= q (only blocks on the diagonal hold keys past a query)
    if (rows_are_queries) {
      for (int64_t c = std::max<int64_t>(0, row_pos + r + 1 - col_pos); c < n_c; ++c) pr[c] = 0.f;
    } else {
      for (int64_t c = 0; c < std::min<int64_t>(n_c, row_pos + r - col_pos); ++c) pr[c] = 0.f;
    }
  }
}

// dp [n_r, n_c] (ld) <- p * (dp - dsum), dsum per row (`per_row`) or per column (contiguous)
__attribute__((target("avx512f,avx512bw"))) void score_grads(float* dp, const float* p, int64_t ld, int64_t n_r,
                                                              int64_t n_c, const float* dsum, bool per_row) {
  for (int64_t r = 0; r < n_r; ++r) {
    for (int64_t c = 0; c < n_c; c += 16) {
      const __mmask16 mask = astrai::tail_mask16(n_c - c);
      const __m512 d = per_row ? _mm512_set1_ps(dsum[r]) : _mm512_maskz_loadu_ps(mask, dsum + c);
      const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, p + r * ld + c),
                                     _mm512_sub_ps(_mm512_maskz_loadu_ps(mask, dp + r * ld + c), d));
      _mm512_mask_storeu_ps(dp + r * ld + c, mask, v);
    }
  }
}

std::vector<at::Tensor> causal_attention_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                                  double scale_, int64_t BLOCK) {
  for (const at::Tensor* t : {&dout, &q, &k, &v, &out}) {
    // (a single head's stride is whatever torch left it: it is never stepped over)
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == at::kBFloat16 && t->stride(2) == 1 &&
                    (t->size(1) == 1 || t->stride(1) == t->size(2)),
                "causal_attention_backward: bf16 [S, H, D] tensors with rows of H x D contiguous");
  }
  TORCH_CHECK(BLOCK >= 16 && BLOCK <= 256, "causal_attention_backward: block of 16 to 256 positions");
  TORCH_CHECK(lse.dim() == 2 && lse.scalar_type() == at::kFloat, "causal_attention_backward: lse [Hq, S] float32");
  const int64_t S = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0 && k.size(0) == S && v.size(0) == S && k.size(2) == D &&
                  v.sizes() == k.sizes() && out.sizes() == q.sizes() && dout.sizes() == q.sizes() &&
                  lse.size(0) == Hq && lse.size(1) == S,
              "causal_attention_backward: shapes do not agree");
  const float scale = static_cast<float>(scale_);
  const int64_t G = Hq / Hkv, nb = (S + BLOCK - 1) / BLOCK;
  const int64_t CH = std::max<int64_t>(BLOCK, (512 / BLOCK) * BLOCK);  // columns per product: whole blocks
  const int64_t ldq = q.stride(0), ldk = k.stride(0), ldv = v.stride(0), ldo = out.stride(0), lddo = dout.stride(0);
  const bf16 *Q = q.const_data_ptr<bf16>(), *K = k.const_data_ptr<bf16>(), *V = v.const_data_ptr<bf16>();
  const bf16 *O = out.const_data_ptr<bf16>(), *dO = dout.const_data_ptr<bf16>();

  // per head: rowsum(dO o O) and the log-sum-exp, [H, S]; the transposed operands [H, D, S] the products read
  // as B matrices
  auto opts = q.options();
  at::Tensor dsum = at::empty({Hq, S}, opts.dtype(at::kFloat));
  at::Tensor lset = lse.contiguous();
  at::Tensor qt = at::empty({Hq, D, S}, opts), dot = at::empty({Hq, D, S}, opts);
  at::Tensor kt = at::empty({Hkv, D, S}, opts), vt = at::empty({Hkv, D, S}, opts);
  float *DS = dsum.data_ptr<float>(), *LT = lset.data_ptr<float>();
  bf16 *QT = qt.data_ptr<bf16>(), *DOT = dot.data_ptr<bf16>(), *KT = kt.data_ptr<bf16>(), *VT = vt.data_ptr<bf16>();
  at::parallel_for(0, Hq, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      for (int64_t s = 0; s < S; ++s) DS[h * S + s] = dot_bf16(dO + s * lddo + h * D, O + s * ldo + h * D, D);
      transpose(Q + h * D, ldq, QT + h * D * S, S, S, D);
      transpose(dO + h * D, lddo, DOT + h * D * S, S, S, D);
      if (h < Hkv) {
        transpose(K + h * D, ldk, KT + h * D * S, S, S, D);
        transpose(V + h * D, ldv, VT + h * D * S, S, S, D);
      }
    }
  });

  at::Tensor dq = at::empty({S, Hq, D}, opts), dk = at::empty({S, Hkv, D}, opts), dv = at::empty({S, Hkv, D}, opts);
  bf16 *dQ = dq.data_ptr<bf16>(), *dK = dk.data_ptr<bf16>(), *dV = dv.data_ptr<bf16>();
  const int threads = at::get_num_threads();

#pragma omp parallel num_threads(threads)
  {
    std::vector<float> sc(BLOCK * CH), dp(BLOCK * CH), acc1(BLOCK * D), acc2(BLOCK * D);
    std::vector<bf16> pb(BLOCK * CH), dsb(BLOCK * CH);

    // pass 1: dK, dV per (K/V head, key block j) over the queries from j on; the heaviest (first) blocks first
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < Hkv * nb; ++item) {
      const int64_t hk = item % Hkv, j0 = (item / Hkv) * BLOCK, nk = std::min(BLOCK, S - j0);
      std::fill(acc1.begin(), acc1.end(), 0.f);  // dV
      std::fill(acc2.begin(), acc2.end(), 0.f);  // dK / scale
      for (int64_t h = hk * G; h < (hk + 1) * G; ++h) {
        for (int64_t c0 = j0; c0 < S; c0 += CH) {
          const int64_t nc = std::min(CH, S - c0);
          // S^T [nk, nc] = K_j Q^T, P^T, dV += P^T dO
          gemm(nk, nc, D, K + j0 * ldk + hk * D, ldk, QT + h * D * S + c0, S, sc.data(), CH, false);
          probabilities(sc.data(), CH, nk, nc, scale, nullptr, LT + h * S + c0, j0, c0, false);
          to_bf16(sc.data(), CH, pb.data(), CH, nk, nc, 1.f);
          gemm(nk, D, nc, pb.data(), CH, dO + c0 * lddo + h * D, lddo, acc1.data(), D, true);
          // dP^T = V_j dO^T, dS^T = P^T (dP^T - dsum), dK += dS^T Q
          gemm(nk, nc, D, V + j0 * ldv + hk * D, ldv, DOT + h * D * S + c0, S, dp.data(), CH, false);
          score_grads(dp.data(), sc.data(), CH, nk, nc, DS + h * S + c0, false);
          to_bf16(dp.data(), CH, dsb.data(), CH, nk, nc, 1.f);
          gemm(nk, D, nc, dsb.data(), CH, Q + c0 * ldq + h * D, ldq, acc2.data(), D, true);
        }
      }
      to_bf16(acc1.data(), D, dV + j0 * Hkv * D + hk * D, Hkv * D, nk, D, 1.f);
      to_bf16(acc2.data(), D, dK + j0 * Hkv * D + hk * D, Hkv * D, nk, D, scale);
    }

    // pass 2: dQ per (query head, query block i) over the keys up to i's last; the heaviest (last) blocks first
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < Hq * nb; ++item) {
      const int64_t h = item % Hq, hk = h / G, i0 = (nb - 1 - item / Hq) * BLOCK, nq = std::min(BLOCK, S - i0);
      std::fill(acc1.begin(), acc1.end(), 0.f);
      for (int64_t c0 = 0; c0 < i0 + nq; c0 += CH) {
        const int64_t nc = std::min(CH, i0 + nq - c0);
        gemm(nq, nc, D, Q + i0 * ldq + h * D, ldq, KT + hk * D * S + c0, S, sc.data(), CH, false);  // S
        probabilities(sc.data(), CH, nq, nc, scale, LT + h * S + i0, nullptr, i0, c0, true);
        gemm(nq, nc, D, dO + i0 * lddo + h * D, lddo, VT + hk * D * S + c0, S, dp.data(), CH, false);  // dP
        score_grads(dp.data(), sc.data(), CH, nq, nc, DS + h * S + i0, true);
        to_bf16(dp.data(), CH, dsb.data(), CH, nq, nc, 1.f);
        gemm(nq, D, nc, dsb.data(), CH, K + c0 * ldk + hk * D, ldk, acc1.data(), D, true);  // dQ += dS K
      }
      to_bf16(acc1.data(), D, dQ + i0 * Hq * D + h * D, Hq * D, nq, D, scale);
    }
  }
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(astrai, m) {
  m.def("causal_attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale, "
        "int block) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(astrai, CPU, m) { m.impl("causal_attention_backward", &causal_attention_backward); }
