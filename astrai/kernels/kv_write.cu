// KV write: scatter the new tokens' k, v [T, Hkv, D] into the paged cache [num_slots, Hkv, D].
//
// Token t goes to slot slots[t] (= page * page_size + offset); a negative slot means "padding,
// write nothing". k and v may be strided views into a fused qkv buffer (token and head strides
// in elements, last dim contiguous). Grid (T), any block size; a plain element copy, no rounding.
#include "common.cuh"

template <typename T>
__global__ void __launch_bounds__(128)
kv_write_kernel(const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ k_cache,
                T* __restrict__ v_cache, const long long* __restrict__ slots, int num_kv_heads,
                int head_dim, long long k_stride_tok, long long k_stride_head,
                long long v_stride_tok, long long v_stride_head) {
  const int t = blockIdx.x;
  const long long slot = slots[t];
  if (slot < 0) return;
  const int row = num_kv_heads * head_dim;
  T* k_dst = k_cache + slot * row;
  T* v_dst = v_cache + slot * row;
  for (int i = threadIdx.x; i < row; i += blockDim.x) {
    const int h = i / head_dim;
    const int d = i % head_dim;
    k_dst[i] = k[t * k_stride_tok + h * k_stride_head + d];
    v_dst[i] = v[t * v_stride_tok + h * v_stride_head + d];
  }
}
