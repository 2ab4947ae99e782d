// What the CUDA backend keeps per rank beyond core/team_state.h's TeamState, and the NCCL it
// uses (src/cuda/nccl.cu where the build has NCCL, else src/cuda/without_nccl.cc).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "core/team_state.h"
#include "tpfuse/impl/session.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse::impl {

// The NCCL path's call headers: one 16-byte header a rank (src/cuda/nccl_headers.cu).
constexpr size_t kNcclHeaderBytes = 16 * kMaxWorldSize;

// A CUDA rank's state: every CUDA team's ranks are made with new_team_state<CudaTeamState>.
struct CudaTeamState : TeamState {
  // The multiprocessors this rank's grids may fill (share_of_multiprocessors).
  int multiprocessors = 0;
  // Teams with NCCL: this rank's communicator (ncclComm_t), a [packet_bytes / 8, 2] fp32 device
  // buffer for the QK norm's NCCL path, and the NCCL path's call headers (kNcclHeaderBytes of
  // device memory).
  void* nccl_comm = nullptr;
  float* qk_sums = nullptr;
  void* nccl_headers = nullptr;
};

// The CUDA state of a rank of a CUDA team (its BackendOps is the CUDA backend's).
inline const CudaTeamState& cuda_state(const TeamState& team) {
  return static_cast<const CudaTeamState&>(team);
}

// A rank's share of its device's multiprocessors: the device's, divided among the team's ranks
// on that device. A collective's blocks poll for packets that the peers' grids send, so every
// rank's grid must be resident at once; ranks that share a device and each sized their grid to
// the whole device could wait on a peer's grid that cannot start (the suspected cause of a
// timeout with 4 ranks on one H100, two-shot, 30 tokens x 16384; CHANGELOG, Known issue).
inline int share_of_multiprocessors(int device_multiprocessors, int ranks_on_device) {
  return ranks_on_device > 1 ? std::max(1, device_multiprocessors / ranks_on_device)
                             : device_multiprocessors;
}

// Where a call's Stream is the CUDA stream it carries.
inline cudaStream_t cuda_stream_of(Stream stream) {
  return static_cast<cudaStream_t>(stream.handle);
}

// The CUDA backend (src/cuda/backend.cu).
const BackendOps& cuda_backend();

// Everything the CUDA backend takes from NCCL (src/cuda/nccl.cu): the all-reduce of the NCCL path
// and the communicators of in-process teams.
class NcclSupport {
 public:
  virtual ~NcclSupport() = default;
  virtual void allreduce(void* comm, const void* input, void* out, size_t count, DType dtype,
                         cudaStream_t stream) const = 0;
  // The NCCL path's all-reduce: the call headers (`world` 16-byte headers, summed in place as
  // 32-bit integers; src/cuda/nccl_headers.cu) and the data, in one NCCL group.
  virtual void allreduce_headed(void* comm, void* headers, int world, const void* input, void* out,
                                size_t count, DType dtype, cudaStream_t stream) const = 0;
  // One communicator per device (ncclCommInitAll), connected; and their release.
  virtual std::vector<void*> in_process_comms(const std::vector<int>& devices) const = 0;
  virtual void destroy_comms(std::vector<void*>& comms) const = 0;
};

// NCCL, or null in a build without it.
const NcclSupport* nccl_support();

}  // namespace tpfuse::impl
