// Macros shared by host and device code: one source for the GPU and the CPU backend.
#pragma once

#if defined(__CUDACC__)
#define TPF_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TPF_HOST_DEVICE inline
#endif

#if defined(__CUDA_ARCH__)
#define TPF_ON_DEVICE 1
#define TPF_UNROLL _Pragma("unroll")
#else
#define TPF_ON_DEVICE 0
#define TPF_UNROLL  // host compilers (nvcc's host pass included) do not know the pragma
#endif
