// The block-level core shared by paged decode and ragged paged prefill: a set of query rows that
// share one KV head walks a request's K/V through its page table in tiles of kAttnTile positions,
// with an online (running max / running sum) softmax in base 2 and fp32 accumulation.
//
// Guarantees: every K/V position in [kv_begin, kv_end) is read exactly once per block; row r sees
// only positions <= limit[r] (limit -1 masks a padding row); m/l/acc of a row that saw nothing are
// -inf/0/0, so callers can write 0 and lse = -inf for it. Shared memory holds everything in fp32;
// the host computes the same layout size in astrai/kernels/launch.py (attn_smem_bytes).
#pragma once
#include "common.cuh"

namespace astrai {

constexpr int kAttnThreads = 128;
constexpr int kAttnTile = 32;  // one lane per K/V position in the softmax step, so = warp size
static_assert(kAttnTile == kWarpSize, "softmax step maps one lane to one K/V position");

struct AttnSmem {
  float* q;      // [rows, D]   queries, pre-scaled by softmax_scale * log2(e)
  float* k;      // [tile, D+1] padded: lanes read different positions at the same d
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
  s.v = s.k + kAttnTile * (head_dim + 1);
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
                             const AttnSmem& s) {
  constexpr int kVec = Vec16<T>::kElems;
  const int tid = threadIdx.x;
  const int lane = tid % kWarpSize;
  const int warp = tid / kWarpSize;
  const int vecs_per_pos = head_dim / kVec;
  const int k_stride = head_dim + 1;

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
      for (int j = 0; j < kVec; ++j) {
        s.k[t * k_stride + c + j] = kx[j];
        s.v[t * head_dim + c + j] = vx[j];
      }
    }
    __syncthreads();

    for (int i = tid; i < rows * kAttnTile; i += kAttnThreads) {
      const int r = i / kAttnTile;
      const int pos = t0 + i % kAttnTile;
      float score = neg_inf();
      if (pos < kv_end && pos <= s.limit[r]) {
        const float* qr = s.q + r * head_dim;
        const float* kr = s.k + (i % kAttnTile) * k_stride;
        float dot = 0.f;
        for (int d = 0; d < head_dim; ++d) dot = fmaf(qr[d], kr[d], dot);
        score = dot;
      }
      s.p[i] = score;
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

    for (int i = tid; i < rows * head_dim; i += kAttnThreads) {
      const int r = i / head_dim;
      const int d = i % head_dim;
      const float* pr = s.p + r * kAttnTile;
      float a = s.acc[i] * s.alpha[r];
#pragma unroll 8
      for (int t = 0; t < kAttnTile; ++t) a = fmaf(pr[t], s.v[t * head_dim + d], a);
      s.acc[i] = a;
    }
    __syncthreads();  // the next tile overwrites k, v and p
  }
}

}  // namespace astrai
