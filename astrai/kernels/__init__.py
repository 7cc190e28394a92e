"""CUDA C++ kernels for generation, compiled at run time by CuPy (NVRTC) and launched on torch tensors.

The `.cu`/`.cuh` files next to this module are package data. `catalog` names every kernel, its
template instantiations (NVRTC name expressions) and its register budget; `launch` plans grids and
launches them. Importing this package needs neither torch nor CuPy.

`cpu_gemv.cpp` (the few-row products: bf16, int8, int4) and `cpu_decode.cpp` (a decode step's norm, RoPE
and attention) are the CPU engine's kernels, one torch C++ extension built and loaded by
astrai.infer.native.
"""
