// Error macros: each throws tpfuse::Error with the file, line and what was expected.
#pragma once

#include <sstream>
#include <string>

#include "tpfuse/tpfuse.h"

namespace tpfuse::impl {

[[noreturn]] inline void throw_error(const char* file, int line, const std::string& message) {
  std::ostringstream out;
  out << message << " (" << file << ":" << line << ")";
  throw Error(out.str());
}

}  // namespace tpfuse::impl

// TPF_CHECK_ARG(cond, op, "message" << streamed << values): an argument check.
#define TPF_CHECK_ARG(cond, op, stream_expr)                               \
  do {                                                                     \
    if (!(cond)) {                                                         \
      std::ostringstream tpf_message_;                                     \
      tpf_message_ << "tpfuse::" << (op) << ": " << stream_expr;           \
      ::tpfuse::impl::throw_error(__FILE__, __LINE__, tpf_message_.str()); \
    }                                                                      \
  } while (0)

#define TPF_FAIL(stream_expr)                                            \
  do {                                                                   \
    std::ostringstream tpf_message_;                                     \
    tpf_message_ << "tpfuse: " << stream_expr;                           \
    ::tpfuse::impl::throw_error(__FILE__, __LINE__, tpf_message_.str()); \
  } while (0)

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
