// The backend seam: what a team's calls run on. The CPU backend (src/cpu/backend.cc) and the
// CUDA backend (src/cuda/backend.cu) each provide one BackendOps; a team holds the one it was made
// for, and the entry points (core/api.cc) call through it. src/core/registry.cc lists what this
// build has: a build without CUDA or NCCL simply has fewer of them.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <vector>

#include "core/calls.h"
#include "core/team_state.h"
#include "tpfuse/impl/epilogue.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse::impl {

struct NamedPointer {
  const char* name;
  const void* pointer;
};

class BackendOps {
 public:
  virtual ~BackendOps() = default;
  virtual Backend kind() const = 0;

  // Per-call checks of where the memory and the stream are, before any work (`team` null: a
  // local call). Throws naming the argument.
  virtual void validate_call(const TeamState* team, std::initializer_list<NamedPointer> pointers,
                             cudaStream_t stream, const char* op) const = 0;
  // The QK norm's positions where the backend can read them before any work (the CPU's are host
  // memory); the GPU's kernels bound them instead (that token NaN, the call reported).
  virtual void validate_positions(const QkNormArgs&, const char*) const {}

  // Row calls: the two fused algorithms, the NCCL path (the all-reduce engine, then the local
  // epilogue; on the CPU a stand-in with the same rounding), and the local epilogue alone.
  virtual void oneshot(const TeamState& team, const RowCall& call, DType dtype,
                       const RowEpilogueKind& epilogue, cudaStream_t stream) const = 0;
  virtual void twoshot(const TeamState& team, const RowCall& call, DType dtype,
                       const RowEpilogueKind& epilogue, cudaStream_t stream) const = 0;
  virtual void nccl_path(const TeamState& team, const RowCall& call, DType dtype,
                         const RowEpilogueKind& epilogue, cudaStream_t stream) const = 0;
  virtual void local_epilogue(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue,
                              cudaStream_t stream) const = 0;

  // The QK norm: fused, through the NCCL path, and its local halves.
  virtual void qk_oneshot(const TeamState& team, const QkCall& call, DType dtype,
                          cudaStream_t stream) const = 0;
  virtual void qk_nccl_path(const TeamState& team, const QkCall& call, DType dtype,
                            cudaStream_t stream) const = 0;
  virtual void qk_local(const QkCall& call, DType dtype, QkPass pass,
                        cudaStream_t stream) const = 0;

  // This rank's turn in a fused call it makes without data: a rejection (rejected_signature) or
  // a call of zero tokens (its own signature). session.h says why every rank must take it.
  virtual void absent_call(const TeamState& team, const CallSignature& signature,
                           cudaStream_t stream) const = 0;

  // This rank's turn on the NCCL path in a call it makes without data (a rejection, or a call
  // refused because the team failed): its header (`signature`; kFailed where the team failed)
  // and an all-reduce of `count` elements of `dtype` from scratch, so that the peers' call
  // completes and they are told (src/cuda/nccl_headers.cu). The CPU's stand-in takes the same
  // turn as an absent call.
  virtual void nccl_turn(const TeamState& team, const CallSignature& signature, size_t count,
                         DType dtype, cudaStream_t stream) const = 0;
  // Whether the team can run the NCCL path (the CPU's stand-in always can).
  virtual bool has_nccl_path(const TeamState& team) const = 0;
  // Whether the NCCL path's calls carry headers and take turns like the fused calls' (the CPU's
  // stand-in: a rejected call's absent turn reaches peers on it, and disagreeing calls on it are
  // told). NCCL's own all-reduce does not: a rank there must make the same call as its peers.
  virtual bool nccl_path_takes_turns() const = 0;
  // Team::check: synchronizes with the rank's work, then report_call_errors.
  virtual void check(const TeamState& team) const = 0;
};

// Everything tpfuse takes from NCCL (src/cuda/nccl.cu): the all-reduce of the NCCL path, the
// communicators of in-process teams, and multi-process teams (src/team/nccl_team.cu).
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
  virtual UniqueId unique_id() const = 0;
  virtual Team team_over(ncclComm_t comm, const TeamOptions& options) const = 0;
  virtual Team team_from_id(const UniqueId& id, int rank, int world_size, int device,
                            const TeamOptions& options) const = 0;
};

// CUDA teams made without NCCL: in-process (src/team/cuda_team.cu), and one rank per process
// over CUDA IPC, bootstrapped through a CPU team of the same id (src/team/ipc_team.cu).
class CudaTeams {
 public:
  virtual ~CudaTeams() = default;
  virtual int device_count() const = 0;
  virtual std::vector<Team> in_process(const std::vector<int>& devices,
                                       const TeamOptions& options) const = 0;
  virtual Team process_team(const CpuTeamId& id, int rank, int world_size, int device,
                            const TeamOptions& options) const = 0;
};

// Defined only in the builds that have them; src/core/registry.cc is the one place that asks.
const BackendOps& cuda_backend_ops();   // src/cuda/backend.cu
const CudaTeams& cuda_team_factory();   // src/team/cuda_team.cu
const NcclSupport& nccl_support_ops();  // src/cuda/nccl.cu

// What this build has (src/core/registry.cc): null where a part was not built.
const BackendOps& cpu_backend();
const BackendOps* cuda_backend();
const CudaTeams* cuda_teams();
const NcclSupport* nccl_support();
// The backend of `kind`, or an error naming `op` and what the build lacks.
const BackendOps& require_backend(Backend kind, const char* op);

}  // namespace tpfuse::impl
