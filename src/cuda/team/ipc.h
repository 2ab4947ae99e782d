// CUDA IPC peer memory for teams whose ranks are processes: create_nccl_team's kCudaIpc (handles
// all-gathered over NCCL, cuda/team/nccl_team.cu) and create_cuda_team(id, ...) (over a CPU team,
// cuda/team/ipc_team.cu). A rank exports its workspace as a handle; each rank opens its peers'
// handles into its own address space. How the handles travel is the caller's.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "tpfuse/impl/lamport.h"

namespace tpfuse::impl {

static_assert(sizeof(cudaIpcMemHandle_t) == 64, "unexpected IPC handle size");

// cudaMalloc of `bytes` on the current device (*allocation) and its IPC handle.
cudaIpcMemHandle_t ipc_export(size_t bytes, void** allocation);

// Opens every peer's handle (handles[r] for r != rank) with peer access enabled lazily, and sets
// workspace[r] to each mapping (workspace[rank] = own). Each mapping made is appended to
// `opened` (ipc_close releases them). Returns "" or the first failure, naming this rank and the
// peer; the ranks it could not map keep a null workspace.
std::string ipc_open_peers(const std::vector<cudaIpcMemHandle_t>& handles, int rank, void* own,
                           std::array<char*, kMaxWorldSize>& workspace, std::vector<void*>& opened);

// The verdict every rank reaches from every rank's result: opened[r] is whether rank r mapped
// every peer; own_error is this rank's message from ipc_open_peers. "" if all did.
std::string ipc_open_verdict(const std::vector<uint64_t>& opened, int rank,
                             const std::string& own_error);

// Closes the mappings ipc_open_peers made (current device: the rank's).
void ipc_close(std::vector<void*>& opened);

}  // namespace tpfuse::impl
