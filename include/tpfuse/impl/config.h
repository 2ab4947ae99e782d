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
#elif defined(__SYCL_DEVICE_ONLY__)
// SYCL device code: the SYCL backend's kernels, compiled at run time from these headers by the
// SYCL runtime's kernel compiler (src/sycl/). TPF_ON_DEVICE stays 0 there: it selects CUDA's
// intrinsics, and a SYCL device takes the host's forms instead (portable C++, written without
// branches, the same bits as the CPU backend by construction). TPF_SYCL_DEVICE (below) tells the
// SYCL device pass apart.
#define TPF_ON_DEVICE 0
#define TPF_UNROLL _Pragma("unroll")
#else
#define TPF_ON_DEVICE 0
#define TPF_UNROLL  // host compilers (nvcc's host pass included) do not know the pragma
#endif

// 1 in the device pass of SYCL code (the kernel compiler's), 0 elsewhere (host code that
// includes sycl/sycl.hpp included).
#if defined(__SYCL_DEVICE_ONLY__)
#define TPF_SYCL_DEVICE 1
#else
#define TPF_SYCL_DEVICE 0
#endif
