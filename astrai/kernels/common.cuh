// Helpers shared by every astrai kernel: dtype widening/narrowing, warp reductions, 16-byte loads.
// Included by the .cu sources both under NVRTC and under the CPU emulation harness (tests/kernels),
// so it uses only intrinsics the emulation provides.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// Dynamic shared memory goes through this one macro so the CPU emulation can hand each block
// its own (NaN-poisoned) buffer instead of an `extern __shared__` array.
#ifndef ASTRAI_DYNAMIC_SMEM
#define ASTRAI_DYNAMIC_SMEM(type, name) extern __shared__ __align__(16) type name[]
#endif

namespace astrai {

constexpr int kWarpSize = 32;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1)
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Elements of T in one 16-byte vector: the unit of every K/V load (head_dim is a multiple of 8).
template <typename T> struct Vec16 { static constexpr int kElems = 16 / sizeof(T); };

// One 16-byte load from global memory, widened to float. `src` must be 16-byte aligned.
template <typename T>
__device__ __forceinline__ void load16_as_float(const T* __restrict__ src, float* dst) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const T* elems = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < Vec16<T>::kElems; ++i) dst[i] = to_float(elems[i]);
}

}  // namespace astrai

namespace astrai {
// -inf without <cmath>'s INFINITY macro, which NVRTC does not define.
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }
}  // namespace astrai
