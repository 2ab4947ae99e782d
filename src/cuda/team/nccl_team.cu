// Teams of one rank per process over an NCCL communicator (the caller's, or one made from a
// bootstrap id).
//
// Peer memory of a multi-process team (TeamOptions::peer_memory):
//   * NCCL symmetric window (kAuto's choice when every rank's NCCL is 2.28 or newer): ncclMemAlloc
//   + ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC); each peer's
//     address comes from the NCCL device API (ncclGetLsaPointer, read once by a small kernel at
//     creation and then passed to the kernels as plain pointers). NCCL maps the peers' memory,
//     knows which ranks share load/store memory (its LSA team) and frees it all with the
//     communicator.
//   * CUDA IPC (kCudaIpc, or kAuto where windows are missing): cudaMalloc +
//     cudaIpcGetMemHandle, handles all-gathered over NCCL, cudaIpcOpenMemHandle on each peer's
//     (cuda/team/ipc.h, shared with the teams made without NCCL). Works with any NCCL; needs P2P
//     between every pair.
// Either way the team then runs the store-then-poll handshake (cuda/team/handshake.h); if it fails,
// or if NCCL's LSA team does not hold every rank (another host), every op takes the NCCL path.
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
#include <nccl_device.h>
#define TPFUSE_NCCL_WINDOWS 1
#else
#define TPFUSE_NCCL_WINDOWS 0
#endif

#include "core/backend.h"
#include "cuda/check.h"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"
#include "cuda/team/handshake.h"
#include "cuda/team/ipc.h"
#include "cuda/team/teams.h"
#include "cuda/team_state.h"
#include "tpfuse/cuda.h"
#include "tpfuse/impl/lamport.h"

namespace tpfuse {
namespace impl {
namespace {

#if TPFUSE_NCCL_WINDOWS
struct LsaRanks {
  int rank[kMaxWorldSize];
};

// Each rank's window base as this rank addresses it (ncclGetLsaPointer is device-side only).
__global__ void lsa_pointers_kernel(ncclWindow_t window, int world, LsaRanks lsa, char** out) {
  const int r = threadIdx.x;
  if (r < world) out[r] = static_cast<char*>(ncclGetLsaPointer(window, 0, lsa.rank[r]));
}
#endif

// One rank's resources of a multi-process team. Destroyed on every rank together: the window
// deregistration is collective.
struct NcclTeamMemory : TeamMemory {
  int device = 0;
  ncclComm_t comm = nullptr;
  bool owns_comm = false;
  void* workspace = nullptr;
  bool window_memory = false;  // workspace from ncclMemAlloc (else cudaMalloc)
#if TPFUSE_NCCL_WINDOWS
  ncclWindow_t window = nullptr;
#endif
  std::vector<void*> ipc_peers;
  std::vector<void*> device_allocations;
  uint32_t* host_flags = nullptr;

  ~NcclTeamMemory() override {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device);
    cudaDeviceSynchronize();
    ipc_close(ipc_peers);
#if TPFUSE_NCCL_WINDOWS
    if (window != nullptr) ncclCommWindowDeregister(comm, window);
#endif
    if (workspace != nullptr)
      window_memory ? (void)ncclMemFree(workspace) : (void)cudaFree(workspace);
    for (void* pointer : device_allocations) cudaFree(pointer);
    if (host_flags != nullptr) cudaFreeHost(host_flags);
    if (owns_comm && comm != nullptr) ncclCommDestroy(comm);
    cudaSetDevice(previous);
  }
};

// All-gathers one 64-bit word per rank through NCCL (device scratch `exchange`, [world]).
std::vector<uint64_t> all_gather_words(ncclComm_t comm, uint64_t* exchange, int world, int rank,
                                       uint64_t word, cudaStream_t stream) {
  TPF_CHECK_CUDA(
      cudaMemcpyAsync(exchange + rank, &word, sizeof(word), cudaMemcpyHostToDevice, stream));
  TPF_CHECK_NCCL(ncclAllGather(exchange + rank, exchange, 1, ncclUint64, comm, stream));
  std::vector<uint64_t> words(world);
  TPF_CHECK_CUDA(cudaMemcpyAsync(words.data(), exchange, sizeof(uint64_t) * world,
                                 cudaMemcpyDeviceToHost, stream));
  TPF_CHECK_CUDA(cudaStreamSynchronize(stream));
  return words;
}

// Whether the NCCL loaded at run time has symmetric windows (the headers built against had them).
bool windows_supported() {
#if TPFUSE_NCCL_WINDOWS
  int version = 0;
  return ncclGetVersion(&version) == ncclSuccess && version >= NCCL_VERSION(2, 28, 0);
#else
  return false;
#endif
}

}  // namespace

Team create_team_over_nccl(ncclComm_t comm, bool owns_comm, const TeamOptions& options) {
  const char* op = "create_nccl_team";
  TPF_CHECK_ARG(comm != nullptr, op, "comm is null");
  validate_team_options(options, op);
  int world = 0, rank = 0, device = 0;
  TPF_CHECK_NCCL(ncclCommCount(comm, &world));
  TPF_CHECK_NCCL(ncclCommUserRank(comm, &rank));
  TPF_CHECK_NCCL(ncclCommCuDevice(comm, &device));
  TPF_CHECK_ARG(
      world >= 1 && world <= kMaxWorldSize, op,
      "the communicator has " << world << " ranks; at most " << kMaxWorldSize << " are supported");
  DeviceGuard guard(device);
  auto memory = std::make_shared<NcclTeamMemory>();
  memory->device = device;
  memory->comm = comm;

  cudaStream_t stream = nullptr;
  TPF_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct StreamOwner {
    cudaStream_t stream;
    ~StreamOwner() { cudaStreamDestroy(stream); }
  } stream_owner{stream};
  uint64_t* exchange = nullptr;
  TPF_CHECK_CUDA(cudaMalloc(&exchange, sizeof(uint64_t) * kMaxWorldSize));
  memory->device_allocations.push_back(exchange);

  // The rank's error record, then the handshake's per-peer results.
  const size_t host_bytes = sizeof(ErrorRecord) + sizeof(uint32_t) * kMaxWorldSize;
  TPF_CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&memory->host_flags), host_bytes,
                               cudaHostAllocMapped));
  std::memset(memory->host_flags, 0, host_bytes);
  uint32_t* arrived = memory->host_flags + sizeof(ErrorRecord) / sizeof(uint32_t);

  const size_t bytes = allocation_bytes(world, options.packet_bytes);
  std::array<char*, kMaxWorldSize> workspace{};
  std::string reason;
  std::string peer_memory = "none";
  if (!options.peer_stores) reason = "TeamOptions::peer_stores is false";
#if TPFUSE_NCCL_WINDOWS
  if (reason.empty() && world > 1) {
    const ncclTeam_t lsa = ncclTeamLsa(comm);
    if (lsa.nRanks != world) {
      reason = "only " + std::to_string(lsa.nRanks) + " of the " + std::to_string(world) +
               " ranks share load/store memory (NCCL's LSA team): ranks on other hosts or "
               "without P2P";
    }
  }
#endif
  if (reason.empty()) {
    // The same choice on every rank: windows only where every rank supports them.
    PeerMemory method = options.peer_memory;
    if (method == PeerMemory::kAuto) {
      const auto support =
          all_gather_words(comm, exchange, world, rank, windows_supported(), stream);
      bool all = true;
      for (uint64_t word : support) all = all && word != 0;
      method = all ? PeerMemory::kNcclWindow : PeerMemory::kCudaIpc;
    }
    if (method == PeerMemory::kNcclWindow) {
#if TPFUSE_NCCL_WINDOWS
      TPF_CHECK_ARG(windows_supported(), op,
                    "options.peer_memory is kNcclWindow but NCCL symmetric windows are not "
                    "available here (the NCCL loaded is older than 2.28)");
      TPF_CHECK_NCCL(ncclMemAlloc(&memory->workspace, bytes));
      memory->window_memory = true;
      TPF_CHECK_NCCL(ncclCommWindowRegister(comm, memory->workspace, bytes, &memory->window,
                                            NCCL_WIN_COLL_SYMMETRIC));
      LsaRanks lsa{};
      const ncclTeam_t world_team = ncclTeamWorld(comm);
      for (int r = 0; r < world; ++r) lsa.rank[r] = ncclTeamRankToLsa(comm, world_team, r);
      char** pointers = nullptr;
      TPF_CHECK_CUDA(cudaMalloc(&pointers, sizeof(char*) * kMaxWorldSize));
      memory->device_allocations.push_back(pointers);
      lsa_pointers_kernel<<<1, 32, 0, stream>>>(memory->window, world, lsa, pointers);
      TPF_CHECK_CUDA(cudaGetLastError());
      TPF_CHECK_CUDA(cudaMemcpyAsync(workspace.data(), pointers, sizeof(char*) * world,
                                     cudaMemcpyDeviceToHost, stream));
      TPF_CHECK_CUDA(cudaStreamSynchronize(stream));
      peer_memory = "nccl window";
#else
      TPF_CHECK_ARG(false, op,
                    "options.peer_memory is kNcclWindow but tpfuse was built with NCCL < 2.28");
#endif
    } else {
      const cudaIpcMemHandle_t handle = ipc_export(bytes, &memory->workspace);
      // 64-byte handles, all-gathered as bytes.
      uint64_t* handles = nullptr;
      TPF_CHECK_CUDA(cudaMalloc(&handles, 64 * size_t(world)));
      memory->device_allocations.push_back(handles);
      TPF_CHECK_CUDA(cudaMemcpyAsync(reinterpret_cast<char*>(handles) + 64 * rank, &handle, 64,
                                     cudaMemcpyHostToDevice, stream));
      TPF_CHECK_NCCL(ncclAllGather(reinterpret_cast<char*>(handles) + 64 * rank, handles, 64,
                                   ncclUint8, comm, stream));
      std::vector<cudaIpcMemHandle_t> all(world);
      TPF_CHECK_CUDA(
          cudaMemcpyAsync(all.data(), handles, 64 * size_t(world), cudaMemcpyDeviceToHost, stream));
      TPF_CHECK_CUDA(cudaStreamSynchronize(stream));
      const std::string open_error =
          ipc_open_peers(all, rank, memory->workspace, workspace, memory->ipc_peers);
      // Every rank learns whether every rank mapped every peer, before any store.
      const auto opened = all_gather_words(comm, exchange, world, rank, open_error.empty(), stream);
      reason = ipc_open_verdict(opened, rank, open_error);
      peer_memory = "cuda ipc";
    }
  }

  void* control = nullptr;
  TPF_CHECK_CUDA(cudaMalloc(&control, sizeof(ControlBlock)));
  memory->device_allocations.push_back(control);
  TPF_CHECK_CUDA(cudaMemsetAsync(control, 0, sizeof(ControlBlock), stream));
  if (reason.empty()) {
    fill_sentinel(memory->workspace, bytes, stream);
    // A barrier (an all-gather of one word) so that no rank's handshake store can land before its
    // peer has filled the workspace.
    all_gather_words(comm, exchange, world, rank, 0, stream);
    if (world > 1) {
      launch_handshake(workspace, rank, world, workspace_bytes(world, options.packet_bytes),
                       uint64_t(options.handshake_timeout_seconds * 1e9), arrived, stream);
      TPF_CHECK_CUDA(cudaStreamSynchronize(stream));
      const auto masks =
          all_gather_words(comm, exchange, world, rank, arrived_mask(arrived, world), stream);
      std::vector<uint32_t> narrow(masks.begin(), masks.end());
      reason = handshake_verdict(narrow.data(), world, options.handshake_timeout_seconds);
    }
  }
  cuda_preload_kernels(world);
  float* qk_sums = nullptr;
  TPF_CHECK_CUDA(cudaMalloc(&qk_sums, options.packet_bytes));
  memory->device_allocations.push_back(qk_sums);
  void* nccl_headers = nullptr;
  TPF_CHECK_CUDA(cudaMalloc(&nccl_headers, kNcclHeaderBytes));
  memory->device_allocations.push_back(nccl_headers);
  TPF_CHECK_CUDA(cudaStreamSynchronize(stream));

  cudaDeviceProp properties{};
  TPF_CHECK_CUDA(cudaGetDeviceProperties(&properties, device));
  auto state = new_team_state<CudaTeamState>(cuda_backend(), rank, world, options, properties.name,
                                             reason, reason.empty() ? peer_memory : "none");
  // A team without proven peer stores has no workspace to store into (nccl_headers.cu).
  for (int r = 0; r < world; ++r)
    state->exchange.workspace[r] = reason.empty() ? workspace[r] : nullptr;
  state->exchange.control = static_cast<ControlBlock*>(control);
  state->exchange.errors = reinterpret_cast<ErrorRecord*>(memory->host_flags);
  state->device = device;
  TPF_CHECK_CUDA(
      cudaDeviceGetAttribute(&state->multiprocessors, cudaDevAttrMultiProcessorCount, device));
  state->nccl_comm = comm;
  state->qk_sums = qk_sums;
  state->nccl_headers = nccl_headers;
  state->memory = memory;
  memory->owns_comm = owns_comm;  // only now: on a throw above, the caller still owns comm
  return Team(std::move(state));
}

}  // namespace impl

bool nccl_available() {
  return true;
}

UniqueId create_unique_id() {
  static_assert(sizeof(ncclUniqueId) == sizeof(UniqueId), "UniqueId must hold an ncclUniqueId");
  ncclUniqueId id;
  TPF_CHECK_NCCL(ncclGetUniqueId(&id));
  UniqueId out;
  std::memcpy(out.bytes, id.internal, sizeof(out.bytes));
  return out;
}

Team create_nccl_team(ncclComm_t comm, const TeamOptions& options) {
  return impl::create_team_over_nccl(comm, false, options);
}

Team create_nccl_team(const UniqueId& id, int rank, int world_size, int device,
                      const TeamOptions& options) {
  const char* op = "create_nccl_team";
  TPF_CHECK_ARG(world_size >= 1 && world_size <= kMaxWorldSize, op,
                "world_size must be in [1, " << kMaxWorldSize << "], got " << world_size);
  TPF_CHECK_ARG(rank >= 0 && rank < world_size, op,
                "rank must be in [0, world_size = " << world_size << "), got " << rank);
  const int count = cuda_device_count();
  TPF_CHECK_ARG(device >= 0 && device < count, op,
                "device " << device << " but this process sees " << count << " CUDA device(s)");
  impl::DeviceGuard guard(device);
  ncclUniqueId nccl_id;
  std::memcpy(nccl_id.internal, id.bytes, sizeof(id.bytes));
  ncclComm_t comm = nullptr;
  TPF_CHECK_NCCL(ncclCommInitRank(&comm, world_size, nccl_id, rank));
  try {
    return impl::create_team_over_nccl(comm, true, options);
  } catch (...) {
    ncclCommDestroy(comm);
    throw;
  }
}

}  // namespace tpfuse
