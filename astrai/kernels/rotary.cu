// Fused rotary position embedding, in place on q [T, Hq, D] and k [T, Hkv, D].
//
// Token t is rotated by angle table row positions[t]: cos/sin are fp32 [max_pos, >= rot_dim / 2]
// and num_positions rows, with row stride table_stride (computed on the host, so any RoPE scaling variant is a different
// table, not a new kernel; Hugging Face-style [max_pos, head_dim] tables are read in place).
// Pair i (0 <= i < rot_dim / 2) is (x[i], x[i + rot_dim / 2]) in the half-split layout of
// Llama / Hugging Face, or (x[2i], x[2i + 1]) when INTERLEAVED; dims >= rot_dim are untouched.
// q and k may be strided views into one fused qkv buffer (token and head strides in elements,
// last dim contiguous). Grid (T), any block size; each pair is read and written by one thread.
// A position outside the table turns that token's rotated dims into NaN instead of reading
// out of bounds: loud, and the host need not synchronise to check positions first.
#include "common.cuh"

template <typename T, bool INTERLEAVED>
__global__ void __launch_bounds__(128)
rotary_kernel(T* __restrict__ q, T* __restrict__ k, const long long* __restrict__ positions,
              const float* __restrict__ cos_table, const float* __restrict__ sin_table,
              long long table_stride, long long num_positions, int num_q_heads, int num_kv_heads, int rot_dim, long long q_stride_tok,
              long long q_stride_head, long long k_stride_tok, long long k_stride_head) {
  using namespace astrai;
  const int t = blockIdx.x;
  const int half = rot_dim / 2;
  const long long pos = positions[t];
  const bool in_table = pos >= 0 && pos < num_positions;
  const float* cos_row = cos_table + (in_table ? pos : 0) * table_stride;
  const float* sin_row = sin_table + (in_table ? pos : 0) * table_stride;
  const float nan = __int_as_float(0x7fc00000u);
  const int pairs = (num_q_heads + num_kv_heads) * half;
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
    const int h = i / half;
    const int j = i % half;
    T* x = h < num_q_heads ? q + t * q_stride_tok + h * q_stride_head
                           : k + t * k_stride_tok + (h - num_q_heads) * k_stride_head;
    const int i1 = INTERLEAVED ? 2 * j : j;
    const int i2 = INTERLEAVED ? 2 * j + 1 : j + half;
    const float x1 = to_float(x[i1]);
    const float x2 = to_float(x[i2]);
    const float c = in_table ? cos_row[j] : nan;
    const float sn = in_table ? sin_row[j] : nan;
    x[i1] = from_float<T>(x1 * c - x2 * sn);
    x[i2] = from_float<T>(x2 * c + x1 * sn);
  }
}
