// The CUDA backend's checks of CUDA's and NCCL's status codes: each throws tpfuse::Error naming
// the call, the status and where (core/error.h). TPF_CHECK_NCCL needs <nccl.h> where it is used.
#pragma once

#include <cuda_runtime.h>

#include "core/error.h"

#define TPF_CHECK_CUDA(call)                                                 \
  do {                                                                       \
    cudaError_t tpf_status_ = (call);                                        \
    if (tpf_status_ != cudaSuccess) {                                        \
      TPF_FAIL(#call << " failed: " << cudaGetErrorName(tpf_status_) << ": " \
                     << cudaGetErrorString(tpf_status_));                    \
    }                                                                        \
  } while (0)

#define TPF_CHECK_NCCL(call)                                             \
  do {                                                                   \
    ncclResult_t tpf_status_ = (call);                                   \
    if (tpf_status_ != ncclSuccess) {                                    \
      TPF_FAIL(#call << " failed: " << ncclGetErrorString(tpf_status_)); \
    }                                                                    \
  } while (0)
