// The CUDA backend's launchers (src/cuda/*.cu); cuda/backend.cu binds them to BackendOps.
#pragma once

#include <cuda_runtime.h>

#include "core/calls.h"
#include "cuda/team_state.h"
#include "tpfuse/impl/epilogue.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse::impl {

void cuda_oneshot(const TeamState& team, const RowCall& call, DType dtype,
                  const RowEpilogueKind& epilogue, cudaStream_t stream);
void cuda_twoshot(const TeamState& team, const RowCall& call, DType dtype,
                  const RowEpilogueKind& epilogue, cudaStream_t stream);
void cuda_local_epilogue(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue,
                         cudaStream_t stream);
// Whether cuda_local_epilogue takes this call's kernel in its staging form (local.cu), on the
// current device.
bool cuda_local_epilogue_stages(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue);
// The MoE combine of a call (epilogue.moe) alone into out [tokens, hidden], rounded to dtype: the
// NCCL path's contribution.
void cuda_moe_combine(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue, void* out,
                      cudaStream_t stream);
void cuda_qk_rmsnorm(const TeamState& team, const QkCall& call, DType dtype, cudaStream_t stream);
void cuda_qk_local(const QkCall& call, DType dtype, QkPass pass, cudaStream_t stream);

// The QK-norm kernels of one dtype (qknorm.cuh), compiled in a translation unit per dtype
// (CMakeLists.txt): cuda_qk_rmsnorm, cuda_qk_local and cuda_preload_qk_kernels (qknorm.cu) bind
// a call's dtype and call these.
template <typename T>
struct QkKernels {
  // After cuda_qk_rmsnorm has reported the team's earlier failure and set its device.
  static void launch_fused(const TeamState& team, const QkCall& call, cudaStream_t stream);
  static void launch_local(const QkCall& call, QkPass pass, cudaStream_t stream);
  static void preload_kernels(int world_size);
};

// Load every kernel a team of this world size may launch, on the current device: CUDA loads
// kernels lazily, and a load can wait for the device to go idle while a kernel of this rank
// spins on a peer whose host thread is itself blocked loading one (launch.cuh, preload).
// A call this rank makes without data (a rejection, or no tokens): src/cuda/absent.cu.
void cuda_absent_call(const TeamState& team, const CallSignature& signature, cudaStream_t stream);

// The NCCL path's call headers (src/cuda/nccl_headers.cu): this rank's header into
// CudaTeamState::nccl_headers before the all-reduce, and the check of every rank's after it (NaN
// into `outputs` and the error recorded where a peer's differs).
void cuda_nccl_headers(const TeamState& team, const CallSignature& signature, cudaStream_t stream);
void cuda_nccl_check(const TeamState& team, const CallOutputs& outputs, cudaStream_t stream);
void cuda_preload_nccl_header_kernels();

void cuda_preload_kernels(int world_size);
void cuda_preload_absent_kernel();
void cuda_preload_oneshot_kernels(int world_size);
void cuda_preload_twoshot_kernels(int world_size);
void cuda_preload_local_kernels();
void cuda_preload_qk_kernels(int world_size);

// Team::check for a CUDA rank: synchronizes its device, then reports a peer that timed out.
void cuda_check(const TeamState& team);

}  // namespace tpfuse::impl
