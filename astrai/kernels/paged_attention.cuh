// The block-level core shared by paged decode and ragged paged prefill: a set of query rows that
// share one KV head walks a request's K/V through its page table in tiles of kAttnTile positions,
// with an online (running max / running sum) softmax in base 2 and fp32 accumulation.
//
// Guarantees: every K/V position in [kv_begin, kv_end) is read exactly once per block; row r sees
// only positions in (limit[r] - window, limit[r]] (limit -1 masks a padding row; the host passes
// window = 2^30, launch.NO_WINDOW, for plain causal attention); m/l/acc of a row that saw nothing are
// -inf/0/0, so callers can write 0 and lse = -inf for it. Shared memory holds everything in fp32;
// the host computes the same layout size in astrai/kernels/launch.py (attn_smem_bytes).
#pragma once
#include "common.cuh"

namespace astrai {

constexpr int kAttnThreads = 128;
constexpr int kAttnTile = 32;  // one lane per K/V position in the softmax step, so = warp size
static_assert(kAttnTile == kWarpSize, "softmax step maps one lane to one K/V position");
// Register tiles: a thread scores one position for kScoreRows rows, and accumulates kAccRows rows
// x 4 dims of the output, so each shared-memory float4 read feeds several FMAs (the naive one-pair-
// per-thread loops issue two shared loads per FMA and are shared-memory bound, not DRAM bound).
constexpr int kScoreRows = 2;
constexpr int kAccRows = 2;

struct AttnSmem {
  float* q;      // [rows, D]   queries, pre-scaled by softmax_scale * log2(e)
  float* k;      // [tile, D+4] padded: lanes read float4s of different positions without conflicts
  float* v;      // [tile, D]
  float* p;      // [rows, tile] scores, then probabilities
  float* acc;    // [rows, D]   unnormalised output
  float* m;      // [rows]      running max (base 2)
  float* l;      // [rows]      running sum
  float* alpha;  // [rows]      rescale of acc for the current tile
  int* limit;    // [rows]      last K/V position the row may see
};

__device__ __forceinline__ AttnSmem carve_attn_smem(float* base, int row_cap, int head_dim) {
  AttnSmem s;
  s.q = base;
  s.k = s.q + row_cap * head_dim;
  s.v = s.k + kAttnTile * (head_dim + 4);
  s.p = s.v + kAttnTile * head_dim;
  s.acc = s.p + row_cap * kAttnTile;
  s.m = s.acc + row_cap * head_dim;
  s.l = s.m + row_cap;
  s.alpha = s.l + row_cap;
  s.limit = reinterpret_cast<int*>(s.alpha + row_cap);
  return s;
}

// Callers fill s.q and s.limit for `rows` rows before calling (the first barrier here publishes
// them). On return every thread may read s.m, s.l, s.acc.
template <typename T>
__device__ void attend_paged(const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                             const int* __restrict__ pages, int page_size, int num_kv_heads,
                             int head_dim, int kv_head, int kv_begin, int kv_end, int rows,
                             int window, const AttnSmem& s) {
  constexpr int kVec = Vec16<T>::kElems;
  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int vecs_per_pos = head_dim / kVec;
  const int k_stride = head_dim + 4;
  const int d4_count = head_dim / 4;

  for (int r = tid; r < rows; r += kAttnThreads) {
    s.m[r] = neg_inf();
    s.l[r] = 0.f;
  }
  for (int i = tid; i < rows * head_dim; i += kAttnThreads) s.acc[i] = 0.f;
  __syncthreads();

  for (int t0 = kv_begin; t0 < kv_end; t0 += kAttnTile) {
    // K/V tile -> shared, 16 bytes per load; positions past kv_end become 0 (never NaN: p * v).
    for (int i = tid; i < kAttnTile * vecs_per_pos; i += kAttnThreads) {
      const int t = i / vecs_per_pos;
      const int c = (i % vecs_per_pos) * kVec;
      const int pos = t0 + t;
      float kx[kVec], vx[kVec];
      if (pos < kv_end) {
        const long long slot = (long long)pages[pos / page_size] * page_size + pos % page_size;
        const long long off = (slot * num_kv_heads + kv_head) * head_dim + c;
        load16_as_float(k_cache + off, kx);
        load16_as_float(v_cache + off, vx);
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j) kx[j] = vx[j] = 0.f;
      }
#pragma unroll
      for (int j = 0; j < kVec; j += 4) {
        *reinterpret_cast<float4*>(s.k + t * k_stride + c + j) = make_float4(kx[j], kx[j + 1], kx[j + 2], kx[j + 3]);
        *reinterpret_cast<float4*>(s.v + t * head_dim + c + j) = make_float4(vx[j], vx[j + 1], vx[j + 2], vx[j + 3]);
      }
    }
    __syncthreads();

    // Scores: item = (block of kScoreRows rows, position). Lanes of a warp take 32 positions of
    // the same rows: k reads are spread over banks by the padding, q reads are broadcasts.
    const int score_blocks = (rows + kScoreRows - 1) / kScoreRows;
    for (int i = tid; i < score_blocks * kAttnTile; i += kAttnThreads) {
      const int t = i % kAttnTile;
      const int r0 = (i / kAttnTile) * kScoreRows;
      const int pos = t0 + t;
      const float4* kr = reinterpret_cast<const float4*>(s.k + t * k_stride);
      const float4* qr[kScoreRows];
      float dot[kScoreRows];
#pragma unroll
      for (int j = 0; j < kScoreRows; ++j) {
        qr[j] = reinterpret_cast<const float4*>(s.q + min(r0 + j, rows - 1) * head_dim);
        dot[j] = 0.f;
      }
      for (int d4 = 0; d4 < d4_count; ++d4) {
        const float4 kv = kr[d4];
#pragma unroll
        for (int j = 0; j < kScoreRows; ++j) {
          const float4 qv = qr[j][d4];
          dot[j] = fmaf(qv.x, kv.x, fmaf(qv.y, kv.y, fmaf(qv.z, kv.z, fmaf(qv.w, kv.w, dot[j]))));
        }
      }
#pragma unroll
      for (int j = 0; j < kScoreRows; ++j) {
        const int r = r0 + j;
        if (r < rows)
          s.p[r * kAttnTile + t] =
              (pos < kv_end && pos <= s.limit[r] && pos > s.limit[r] - window) ? dot[j] : neg_inf();
      }
    }
    __syncthreads();

    // Online softmax, one warp per row. Every lane reads m[r] before the first shuffle, so lane 0
    // may overwrite it after the last one.
    for (int r = warp; r < rows; r += kAttnThreads / kWarpSize) {
      const float score = s.p[r * kAttnTile + lane];
      const float m_old = s.m[r];
      const float m_new = fmaxf(m_old, warp_max(score));
      const float p = score == neg_inf() ? 0.f : exp2f(score - m_new);
      const float total = warp_sum(p);
      s.p[r * kAttnTile + lane] = p;
      if (lane == 0) {
        const float alpha = m_old == neg_inf() ? 0.f : exp2f(m_old - m_new);
        s.alpha[r] = alpha;
        s.l[r] = s.l[r] * alpha + total;
        s.m[r] = m_new;
      }
    }
    __syncthreads();

    // Output: item = (block of kAccRows rows, 4 dims). Lanes take consecutive float4 columns:
    // v reads are contiguous, p reads are broadcasts.
    const int acc_blocks = (rows + kAccRows - 1) / kAccRows;
    for (int i = tid; i < acc_blocks * d4_count; i += kAttnThreads) {
      const int d = (i % d4_count) * 4;
      const int r0 = (i / d4_count) * kAccRows;
      float4 a[kAccRows];
      const float* pr[kAccRows];
#pragma unroll
      for (int j = 0; j < kAccRows; ++j) {
        const int r = min(r0 + j, rows - 1);
        const float alpha = s.alpha[r];
        a[j] = *reinterpret_cast<const float4*>(s.acc + r * head_dim + d);
        a[j].x *= alpha;
        a[j].y *= alpha;
        a[j].z *= alpha;
        a[j].w *= alpha;
        pr[j] = s.p + r * kAttnTile;
      }
#pragma unroll 2
      for (int t = 0; t < kAttnTile; ++t) {
        const float4 vv = *reinterpret_cast<const float4*>(s.v + t * head_dim + d);
#pragma unroll
        for (int j = 0; j < kAccRows; ++j) {
          const float p = pr[j][t];
          a[j].x = fmaf(p, vv.x, a[j].x);
          a[j].y = fmaf(p, vv.y, a[j].y);
          a[j].z = fmaf(p, vv.z, a[j].z);
          a[j].w = fmaf(p, vv.w, a[j].w);
        }
      }
#pragma unroll
      for (int j = 0; j < kAccRows; ++j)
        if (r0 + j < rows) *reinterpret_cast<float4*>(s.acc + (r0 + j) * head_dim + d) = a[j];
    }
    __syncthreads();  // the next tile overwrites k, v and p
  }
}

}  // namespace astrai
