// Ragged paged prefill attention: the new tokens of many requests in one launch.
//
// Request b's new tokens are rows qo_indptr[b] .. qo_indptr[b+1] of q [T, Hq, D]; its K/V (the
// new tokens included, already written) are the first kv_lens[b] positions of the pages
// page_indices[kv_indptr[b] ..]. New token i sits at position kv_lens[b] - q_len + i and sees
// positions <= that (cached prefix + causal over its own tokens), and > that - window (a sliding
// window; 2^30 for none): the tile then starts reading at its first token's window.
// Grid (q_tiles, num_kv_heads, batch), kAttnThreads threads: a block takes tile_tokens new tokens
// of one request times the query heads of one KV head, so each K/V tile feeds tile_tokens * group
// rows. Blocks past a request's q_len exit at once (the grid is sized by the longest request).
#include "paged_attention.cuh"

template <typename T>
__global__ void __launch_bounds__(astrai::kAttnThreads)
paged_prefill_kernel(const T* __restrict__ q, long long q_stride_tok, long long q_stride_head,
                     const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                     const int* __restrict__ qo_indptr, const int* __restrict__ kv_indptr,
                     const int* __restrict__ page_indices, const int* __restrict__ kv_lens,
                     T* __restrict__ out, int num_q_heads, int num_kv_heads, int head_dim,
                     int page_size, int tile_tokens, int window, float scale_log2) {
  using namespace astrai;
  ASTRAI_DYNAMIC_SMEM(float, smem);
  const int kv_head = blockIdx.y;
  const int b = blockIdx.z;
  const int q_begin = qo_indptr[b];
  const int q_len = qo_indptr[b + 1] - q_begin;
  const int tok0 = blockIdx.x * tile_tokens;
  if (tok0 >= q_len) return;  // uniform across the block: no barrier is skipped by a subset

  const int group = num_q_heads / num_kv_heads;
  const AttnSmem s = carve_attn_smem(smem, tile_tokens * group, head_dim);
  const int ntok = min(tile_tokens, q_len - tok0);
  const int rows = ntok * group;  // row r = token tok0 + r / group, head kv_head * group + r % group
  const int kv_len = kv_lens[b];
  const int first_pos = kv_len - q_len;

  for (int i = threadIdx.x; i < rows * head_dim; i += kAttnThreads) {
    const int r = i / head_dim;
    const int h = kv_head * group + r % group;
    const T* q_row = q + (long long)(q_begin + tok0 + r / group) * q_stride_tok + h * q_stride_head;
    s.q[i] = to_float(q_row[i % head_dim]) * scale_log2;
  }
  for (int r = threadIdx.x; r < rows; r += kAttnThreads) s.limit[r] = first_pos + tok0 + r / group;

  // No row of this tile sees past its last token's position, nor before its first token's window.
  const int kv_end = min(kv_len, first_pos + tok0 + ntok);
  const int kv_begin = max(0, first_pos + tok0 - window + 1);
  attend_paged<T>(k_cache, v_cache, page_indices + kv_indptr[b], page_size, num_kv_heads,
                  head_dim, kv_head, kv_begin, kv_end, rows, window, s);

  for (int i = threadIdx.x; i < rows * head_dim; i += kAttnThreads) {
    const int r = i / head_dim;
    const int h = kv_head * group + r % group;
    const float l = s.l[r];
    const long long row = (long long)(q_begin + tok0 + r / group) * num_q_heads + h;
    out[row * head_dim + i % head_dim] = from_float<T>(l > 0.f ? s.acc[i] / l : 0.f);
  }
}
