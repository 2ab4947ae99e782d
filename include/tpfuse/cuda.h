// tpfuse with CUDA's and NCCL's types: the entry points of tpfuse.h with a cudaStream_t in place
// of the Stream (each forwards, the stream as the Stream's handle), and the team over an NCCL
// communicator the caller already has.
//
// Compiles without the CUDA and NCCL headers: their two types are declared here as those headers
// declare them (either may come first), so that code built with or without CUDA (the torch ops)
// includes this one header. The cudaStream_t forms take the stream without a default: a call
// that passes none takes tpfuse.h's form (an empty Stream), and a literal nullptr this one.
#pragma once

#include <cstdint>

#include "tpfuse/tpfuse.h"

typedef struct CUstream_st* cudaStream_t;
typedef struct ncclComm* ncclComm_t;

namespace tpfuse {

// The Stream that carries a CUDA stream.
inline Stream cuda_stream(cudaStream_t stream) {
  return Stream{stream};
}

inline Algorithm allreduce_add_rmsnorm(const Team& team, const AddRmsNormArgs& args,
                                       cudaStream_t stream) {
  return allreduce_add_rmsnorm(team, args, cuda_stream(stream));
}

inline Algorithm allreduce(const Team& team, const void* input, void* out, int64_t count,
                           DType dtype, cudaStream_t stream,
                           Algorithm algorithm = Algorithm::kAuto) {
  return allreduce(team, input, out, count, dtype, cuda_stream(stream), algorithm);
}

inline Algorithm allreduce_qk_rmsnorm(const Team& team, const QkNormArgs& args,
                                      cudaStream_t stream) {
  return allreduce_qk_rmsnorm(team, args, cuda_stream(stream));
}

inline void qk_sum_squares(Backend backend, const QkNormArgs& args, bool count_k, float* sums,
                           cudaStream_t stream) {
  qk_sum_squares(backend, args, count_k, sums, cuda_stream(stream));
}

inline void qk_rmsnorm_from_sums(Backend backend, const QkNormArgs& args, const float* sums,
                                 cudaStream_t stream) {
  qk_rmsnorm_from_sums(backend, args, sums, cuda_stream(stream));
}

inline void reject_call(const Team& team, cudaStream_t stream) {
  reject_call(team, cuda_stream(stream));
}

inline void add_rmsnorm(Backend backend, const AddRmsNormArgs& args, cudaStream_t stream) {
  add_rmsnorm(backend, args, cuda_stream(stream));
}

// A team of one rank per process over an NCCL communicator the caller already has: the team
// lives on the communicator's device, uses it for its symmetric workspace, the creation
// handshake and the NCCL path, and must be destroyed (last handle dropped) before it, on every
// rank (deregistering NCCL windows is collective). Collective: every rank of comm calls it.
Team create_nccl_team(ncclComm_t comm, const TeamOptions& options = {});

}  // namespace tpfuse
