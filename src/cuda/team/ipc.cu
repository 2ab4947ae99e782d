// CUDA IPC peer memory (cuda/team/ipc.h).
#include <string>

#include "cuda/check.h"
#include "cuda/team/ipc.h"

namespace tpfuse::impl {

cudaIpcMemHandle_t ipc_export(size_t bytes, void** allocation) {
  TPF_CHECK_CUDA(cudaMalloc(allocation, bytes));
  cudaIpcMemHandle_t handle;
  TPF_CHECK_CUDA(cudaIpcGetMemHandle(&handle, *allocation));
  return handle;
}

std::string ipc_open_peers(const std::vector<cudaIpcMemHandle_t>& handles, int rank, void* own,
                           std::array<char*, kMaxWorldSize>& workspace,
                           std::vector<void*>& opened) {
  std::string error;
  for (int r = 0; r < int(handles.size()); ++r) {
    if (r == rank) {
      workspace[r] = static_cast<char*>(own);
      continue;
    }
    void* peer = nullptr;
    const cudaError_t status =
        cudaIpcOpenMemHandle(&peer, handles[r], cudaIpcMemLazyEnablePeerAccess);
    if (status != cudaSuccess) {
      cudaGetLastError();
      if (error.empty()) {
        error = "rank " + std::to_string(rank) + " could not map rank " + std::to_string(r) +
                "'s memory (cudaIpcOpenMemHandle: " + cudaGetErrorString(status) + ")";
      }
      continue;
    }
    opened.push_back(peer);
    workspace[r] = static_cast<char*>(peer);
  }
  return error;
}

std::string ipc_open_verdict(const std::vector<uint64_t>& opened, int rank,
                             const std::string& own_error) {
  for (int r = 0; r < int(opened.size()); ++r) {
    if (opened[r] == 0) {
      return r == rank ? own_error : "rank " + std::to_string(r) + " could not map a peer's memory";
    }
  }
  return "";
}

void ipc_close(std::vector<void*>& opened) {
  for (void* peer : opened) cudaIpcCloseMemHandle(peer);
  opened.clear();
}

}  // namespace tpfuse::impl
