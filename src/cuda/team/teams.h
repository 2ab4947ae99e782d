// The CUDA teams' creation inside the library (src/cuda/team/): the public create_cuda_team and
// create_nccl_team forms go through these, and the tests reach what the public ones do not offer.
#pragma once

#include <vector>

#include "tpfuse/cuda.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse::impl {

// shared_devices (tests only): ranks may share a device, so that multi-rank kernels run on a
// machine with one GPU. All ranks' grids must then fit on the device at once (few tokens), and
// such a team has no NCCL path.
std::vector<Team> create_in_process_cuda_team(const std::vector<int>& devices,
                                              const TeamOptions& options,
                                              bool shared_devices = false);
// Over a communicator the caller owns (owns_comm false) or the team owns (destroyed with it).
Team create_team_over_nccl(ncclComm_t comm, bool owns_comm, const TeamOptions& options);
// One rank per process over CUDA IPC, no NCCL (create_cuda_team(id, ...); cuda/team/ipc_team.cu).
Team create_ipc_process_team(const CpuTeamId& id, int rank, int world_size, int device,
                             const TeamOptions& options);

}  // namespace tpfuse::impl
