// In-process CUDA teams: one process drives every rank's GPU; peers' workspaces are reached
// through CUDA peer access (unified addressing: a peer's cudaMalloc pointer is valid here).
#include <cuda_runtime.h>

#include <cstring>

#include <algorithm>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "core/backend.h"
#include "cuda/check.h"
#include "cuda/kernels.h"
#include "cuda/team/handshake.h"
#include "cuda/team/teams.h"
#include "cuda/team_state.h"
#include "tpfuse/impl/lamport.h"

namespace tpfuse {
namespace impl {
namespace {

struct CudaTeamMemory : TeamMemory {
  struct Allocation {
    int device;
    void* pointer;
  };
  std::vector<Allocation> device_allocations;
  std::vector<void*> host_allocations;
  std::vector<void*> comms;  // ncclComm_t per rank, or none without NCCL
  ~CudaTeamMemory() override {
    int previous = 0;
    cudaGetDevice(&previous);
    if (!comms.empty()) nccl_support()->destroy_comms(comms);
    for (const auto& allocation : device_allocations) {
      cudaSetDevice(allocation.device);
      cudaDeviceSynchronize();
      cudaFree(allocation.pointer);
    }
    for (void* pointer : host_allocations) cudaFreeHost(pointer);
    cudaSetDevice(previous);
  }
};

// Enables access from `device` (current) to `peer` once per process: enabling it twice is an
// error the runtime reports (and compute-sanitizer flags), so pairs already enabled are skipped.
void enable_peer_access(int device, int peer) {
  static std::mutex mutex;
  static std::set<std::pair<int, int>> enabled;
  std::lock_guard<std::mutex> lock(mutex);
  if (!enabled.insert({device, peer}).second) return;
  const cudaError_t status = cudaDeviceEnablePeerAccess(peer, 0);
  if (status == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();  // enabled by someone else in this process: fine
  } else {
    TPF_CHECK_CUDA(status);
  }
}

int visible_devices() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

}  // namespace

std::vector<Team> create_in_process_cuda_team(const std::vector<int>& devices,
                                              const TeamOptions& options, bool shared_devices) {
  const char* op = "create_cuda_team";
  const int world_size = int(devices.size());
  TPF_CHECK_ARG(world_size >= 1 && world_size <= kMaxWorldSize, op,
                "devices must name 1 to " << kMaxWorldSize << " GPUs, got " << world_size);
  validate_team_options(options, op);
  const int count = visible_devices();
  std::set<int> seen;
  for (int i = 0; i < world_size; ++i) {
    TPF_CHECK_ARG(devices[i] >= 0 && devices[i] < count, op,
                  "devices[" << i << "] = " << devices[i] << " but this process sees " << count
                             << " CUDA device(s)");
    TPF_CHECK_ARG(seen.insert(devices[i]).second || shared_devices, op,
                  "devices[" << i << "] = " << devices[i] << " appears twice");
  }
  const bool devices_repeat = int(seen.size()) < world_size;
  int previous = 0;
  TPF_CHECK_CUDA(cudaGetDevice(&previous));
  auto memory = std::make_shared<CudaTeamMemory>();
  // NCCL communicators for the NCCL path (in-process: one per device, ncclCommInitAll).
  // A team without them still runs its fused kernels: NCCL failing here costs only the NCCL path
  // (calls that need it then say why).
  std::string nccl_error = devices_repeat ? "ranks share a device" : "";
  if (nccl_support() != nullptr && !devices_repeat) {
    try {
      memory->comms = nccl_support()->in_process_comms(devices);
    } catch (const Error& error) {
      nccl_error = error.what();
    }
  }

  std::string fallback_reason;
  if (!options.peer_stores) fallback_reason = "TeamOptions::peer_stores is false";
  for (int i = 0; i < world_size && fallback_reason.empty(); ++i) {
    for (int j = 0; j < world_size && fallback_reason.empty(); ++j) {
      if (devices[i] == devices[j]) continue;
      int can_access = 0;
      TPF_CHECK_CUDA(cudaDeviceCanAccessPeer(&can_access, devices[i], devices[j]));
      if (!can_access) {
        fallback_reason = "device " + std::to_string(devices[i]) + " cannot access device " +
                          std::to_string(devices[j]) + " as a peer (no P2P between them)";
      }
    }
  }
  if (!fallback_reason.empty() && memory->comms.empty()) {
    TPF_CHECK_ARG(false, op,
                  fallback_reason << ", and there is no NCCL to fall back on"
                                  << (nccl_error.empty() ? " in this build" : ": " + nccl_error));
  }
  const bool peer_stores = fallback_reason.empty();
  if (peer_stores) {
    for (int i = 0; i < world_size; ++i) {
      TPF_CHECK_CUDA(cudaSetDevice(devices[i]));
      for (int j = 0; j < world_size; ++j) {
        if (devices[i] != devices[j]) enable_peer_access(devices[i], devices[j]);
      }
    }
  }

  std::array<char*, kMaxWorldSize> workspace{};
  std::vector<ControlBlock*> controls(world_size);
  std::vector<int> multiprocessors(world_size);
  std::vector<float*> qk_sums(world_size);
  std::vector<void*> nccl_headers(world_size);
  // Every rank's error record, then the [world][world] handshake results.
  const size_t host_bytes =
      sizeof(ErrorRecord) * world_size + sizeof(uint32_t) * world_size * world_size;
  void* host = nullptr;
  TPF_CHECK_CUDA(cudaHostAlloc(&host, host_bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  memory->host_allocations.push_back(host);
  std::memset(host, 0, host_bytes);
  ErrorRecord* const errors = static_cast<ErrorRecord*>(host);
  uint32_t* const arrived = reinterpret_cast<uint32_t*>(errors + world_size);
  const size_t bytes = allocation_bytes(world_size, options.packet_bytes);
  for (int r = 0; r < world_size; ++r) {
    TPF_CHECK_CUDA(cudaSetDevice(devices[r]));
    void* pointer = nullptr;
    if (peer_stores) {
      TPF_CHECK_CUDA(cudaMalloc(&pointer, bytes));
      memory->device_allocations.push_back({devices[r], pointer});
      workspace[r] = static_cast<char*>(pointer);
      fill_sentinel(pointer, bytes, nullptr);
    }
    TPF_CHECK_CUDA(cudaMalloc(&pointer, sizeof(ControlBlock)));
    memory->device_allocations.push_back({devices[r], pointer});
    controls[r] = static_cast<ControlBlock*>(pointer);
    TPF_CHECK_CUDA(cudaMemset(pointer, 0, sizeof(ControlBlock)));
    if (!memory->comms.empty()) {
      TPF_CHECK_CUDA(cudaMalloc(&pointer, options.packet_bytes));
      memory->device_allocations.push_back({devices[r], pointer});
      qk_sums[r] = static_cast<float*>(pointer);
      TPF_CHECK_CUDA(cudaMalloc(&pointer, kNcclHeaderBytes));
      memory->device_allocations.push_back({devices[r], pointer});
      nccl_headers[r] = pointer;
    }
    TPF_CHECK_CUDA(
        cudaDeviceGetAttribute(&multiprocessors[r], cudaDevAttrMultiProcessorCount, devices[r]));
    cuda_preload_kernels(world_size);
    TPF_CHECK_CUDA(cudaDeviceSynchronize());
  }
  if (peer_stores && world_size > 1) {
    // Every rank's handshake kernel is queued before any is waited for: they poll each other.
    // A stream per rank: ranks that share a device must not queue behind each other.
    std::vector<cudaStream_t> streams(world_size);
    for (int r = 0; r < world_size; ++r) {
      TPF_CHECK_CUDA(cudaSetDevice(devices[r]));
      TPF_CHECK_CUDA(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
      launch_handshake(workspace, r, world_size, workspace_bytes(world_size, options.packet_bytes),
                       uint64_t(options.handshake_timeout_seconds * 1e9), arrived + r * world_size,
                       streams[r]);
    }
    std::vector<uint32_t> masks(world_size);
    for (int r = 0; r < world_size; ++r) {
      TPF_CHECK_CUDA(cudaSetDevice(devices[r]));
      TPF_CHECK_CUDA(cudaStreamSynchronize(streams[r]));
      TPF_CHECK_CUDA(cudaStreamDestroy(streams[r]));
      masks[r] = arrived_mask(arrived + r * world_size, world_size);
    }
    fallback_reason =
        handshake_verdict(masks.data(), world_size, options.handshake_timeout_seconds);
    if (!fallback_reason.empty() && memory->comms.empty()) {
      TPF_FAIL(op << ": " << fallback_reason << ", and there is no NCCL to fall back on"
                  << (nccl_error.empty() ? " in this build" : ": " + nccl_error));
    }
  }
  std::string device_name;
  {
    cudaDeviceProp properties{};
    TPF_CHECK_CUDA(cudaGetDeviceProperties(&properties, devices[0]));
    device_name = properties.name;
  }
  TPF_CHECK_CUDA(cudaSetDevice(previous));

  std::vector<Team> team;
  for (int r = 0; r < world_size; ++r) {
    auto state = new_team_state<CudaTeamState>(
        cuda_backend(), r, world_size, options, device_name, fallback_reason,
        fallback_reason.empty() ? "cuda peer access" : "none");
    // A team without proven peer stores has no workspace to store into (nccl_headers.cu).
    for (int p = 0; p < world_size; ++p) {
      state->exchange.workspace[p] = fallback_reason.empty() ? workspace[p] : nullptr;
    }
    state->exchange.control = controls[r];
    state->exchange.errors = errors + r;
    state->device = devices[r];
    state->multiprocessors = share_of_multiprocessors(
        multiprocessors[r], int(std::count(devices.begin(), devices.end(), devices[r])));
    state->nccl_comm = memory->comms.empty() ? nullptr : memory->comms[r];
    state->qk_sums = qk_sums[r];
    state->nccl_headers = nccl_headers[r];
    state->memory = memory;
    team.emplace_back(std::move(state));
  }
  return team;
}

}  // namespace impl

bool cuda_available() {
  return true;
}

int cuda_device_count() {
  return impl::visible_devices();
}

std::vector<Team> create_cuda_team(const std::vector<int>& devices, const TeamOptions& options) {
  return impl::create_in_process_cuda_team(devices, options);
}

}  // namespace tpfuse
