// Paged decode attention: one new query token per request against its paged K/V.
//
// Grid (num_splits, num_kv_heads, batch), kAttnThreads threads. A block serves all query heads
// of one KV head (grouped-query attention: K/V read once per group) over one split of the K/V
// positions it can see, [base + split * split_len, base + (split + 1) * split_len), where base is
// max(0, kv_len - window) (0 without a sliding window: window = 2^30). With one split the
// block writes the normalised output directly; with more it writes an fp32 partial output and its
// log-sum-exp (base 2) and merge_splits_kernel combines them. A request with kv_len 0 gets zeros.
// q may be a strided view (token and head strides in elements, last dim contiguous); out is
// contiguous [batch, num_q_heads, head_dim]. head_dim is a multiple of 8 and 16-byte aligned rows.
#include "paged_attention.cuh"

template <typename T>
__global__ void __launch_bounds__(astrai::kAttnThreads)
paged_decode_kernel(const T* __restrict__ q, long long q_stride_tok, long long q_stride_head,
                    const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                    const int* __restrict__ kv_indptr, const int* __restrict__ page_indices,
                    const int* __restrict__ kv_lens, T* __restrict__ out,
                    float* __restrict__ out_part, float* __restrict__ lse_part, int num_q_heads,
                    int num_kv_heads, int head_dim, int page_size, int split_len, int window,
                    float scale_log2) {
  using namespace astrai;
  ASTRAI_DYNAMIC_SMEM(float, smem);
  const int split = blockIdx.x;
  const int num_splits = gridDim.x;
  const int kv_head = blockIdx.y;
  const int b = blockIdx.z;
  const int group = num_q_heads / num_kv_heads;
  const AttnSmem s = carve_attn_smem(smem, group, head_dim);

  const int kv_len = kv_lens[b];
  const int kv_begin = max(0, kv_len - window) + split * split_len;
  const int kv_end = min(kv_len, kv_begin + split_len);
  const T* q_b = q + b * q_stride_tok;
  for (int i = threadIdx.x; i < group * head_dim; i += kAttnThreads) {
    const int h = kv_head * group + i / head_dim;
    s.q[i] = to_float(q_b[h * q_stride_head + i % head_dim]) * scale_log2;
  }
  for (int r = threadIdx.x; r < group; r += kAttnThreads) s.limit[r] = kv_len - 1;

  attend_paged<T>(k_cache, v_cache, page_indices + kv_indptr[b], page_size, num_kv_heads,
                  head_dim, kv_head, kv_begin, kv_end, group, window, s);

  for (int i = threadIdx.x; i < group * head_dim; i += kAttnThreads) {
    const int r = i / head_dim;
    const int d = i % head_dim;
    const long long bh = (long long)b * num_q_heads + kv_head * group + r;
    const float l = s.l[r];
    const float o = l > 0.f ? s.acc[i] / l : 0.f;
    if (num_splits == 1) {
      out[bh * head_dim + d] = from_float<T>(o);
    } else {
      out_part[(bh * num_splits + split) * head_dim + d] = o;
      if (d == 0) lse_part[bh * num_splits + split] = l > 0.f ? s.m[r] + log2f(l) : neg_inf();
    }
  }
}

// Combines the splits of paged_decode_kernel: grid (batch * num_q_heads), any block size.
// Each split's normalised output is weighted by 2^(lse_split - lse_max).
template <typename T>
__global__ void __launch_bounds__(astrai::kAttnThreads)
merge_splits_kernel(const float* __restrict__ out_part, const float* __restrict__ lse_part,
                    T* __restrict__ out, int num_splits, int head_dim) {
  using namespace astrai;
  const long long bh = blockIdx.x;
  const float* lse = lse_part + bh * num_splits;
  float lse_max = neg_inf();
  for (int sp = 0; sp < num_splits; ++sp) lse_max = fmaxf(lse_max, lse[sp]);
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float num = 0.f, den = 0.f;
    for (int sp = 0; sp < num_splits; ++sp) {
      const float w = lse[sp] == neg_inf() ? 0.f : exp2f(lse[sp] - lse_max);
      num = fmaf(w, out_part[(bh * num_splits + sp) * head_dim + d], num);
      den += w;
    }
    out[bh * head_dim + d] = from_float<T>(den > 0.f ? num / den : 0.f);
  }
}
