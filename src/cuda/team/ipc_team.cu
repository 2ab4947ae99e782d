// CUDA teams of one rank per process on this host, made without NCCL: create_cuda_team(id, rank,
// world_size, device). Peer memory is CUDA IPC (cuda/team/ipc.h, as create_nccl_team's kCudaIpc);
// several processes may share one device, which is what lets the faults between processes be
// tested on one GPU.
//
// Bootstrap: a CPU-backend team of the same id (create_cpu_team(id, ...): a shared-memory
// segment; its join names a rank that never comes) carries every exchange of creation. One
// exchange is an fp32 all-reduce in which each rank writes its Record's bytes as the integers
// 0..255 in its own part and zeros elsewhere: every sum has one nonzero term, so it is exact, and
// the all-reduce is an all-gather of bytes. Each rank first does its own CUDA setup (workspace
// exported and filled with the sentinel, control block, error record, every kernel loaded), then:
//   1. records: whether the setup worked, the workspace's IPC handle, the device's UUID, the
//      options. Every rank checks the same records alike, so every rank throws the same error
//      (the first rank whose setup failed, or whose options differ from rank 0's).
//   2. each rank checks P2P between its device and each peer's (ranks on one device need none)
//      and opens the peers' handles; the round is also the barrier after which every workspace
//      holds the sentinel, so no handshake store can be overwritten by a late fill.
//   3. the store-then-poll handshake's arrival masks (cuda/team/handshake.h): the same verdict on
//      every rank. A failure is an error here: this team has no NCCL to fall back on.
// A rank's own failure inside a step travels in its next record, so its peers throw naming it
// at once instead of timing out in the next exchange.
//
// The team has no NCCL path: the selection never picks it, Algorithm::kNccl is refused, and a
// call the workspace cannot carry is refused before any work (core/selection.cc).
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "core/backend.h"
#include "cuda/check.h"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"
#include "cuda/team/handshake.h"
#include "cuda/team/ipc.h"
#include "cuda/team_state.h"
#include "tpfuse/impl/lamport.h"

namespace tpfuse {
namespace impl {
namespace {

constexpr const char* kOp = "create_cuda_team";

// What a rank tells its peers in one exchange of creation (unused fields zero).
struct Record {
  uint32_t failed;  // 1: this rank's own step failed; `message` says why
  int32_t pid;
  uint64_t packet_bytes;
  uint32_t peer_stores;
  uint32_t peer_memory;
  uint32_t arrived_mask;  // exchange 3: the handshake's, bit p: rank p's store arrived here
  uint32_t unused;
  unsigned char uuid[16];     // the rank's device
  cudaIpcMemHandle_t handle;  // its workspace
  char message[144];
};
static_assert(sizeof(Record) == 256, "Record is all-gathered as 256 floats");

// The bootstrap team's packet: one exchange of the largest team, as floats.
constexpr size_t kBootstrapPacketBytes = sizeof(Record) * 4 * kMaxWorldSize;

// This rank's resources. Its peers' mappings are closed before its own memory is freed.
struct IpcTeamMemory : TeamMemory {
  int device = 0;
  void* workspace = nullptr;
  void* control = nullptr;
  uint32_t* host_flags = nullptr;  // ErrorRecord, then the handshake's [kMaxWorldSize] results
  cudaStream_t stream = nullptr;
  std::vector<void*> ipc_peers;
  Team bootstrap;  // kept for peer_status: whether a missing peer's process has exited

  ~IpcTeamMemory() override {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device);
    cudaDeviceSynchronize();
    ipc_close(ipc_peers);
    if (workspace != nullptr) cudaFree(workspace);
    if (control != nullptr) cudaFree(control);
    if (host_flags != nullptr) cudaFreeHost(host_flags);
    if (stream != nullptr) cudaStreamDestroy(stream);
    cudaSetDevice(previous);
  }
};

void set_message(Record& record, const std::string& message) {
  record.failed = 1;
  std::snprintf(record.message, sizeof(record.message), "%s", message.c_str());
}

// Runs one step of this rank's own work; a failure goes into `record` (and `own`, in full).
template <typename Step>
void run_step(Record& record, std::string& own, Step&& step) {
  try {
    step();
  } catch (const std::exception& error) {
    own = error.what();
    set_message(record, own);
  }
}

// Every rank's record of one exchange, through the bootstrap team (see the top of the file).
std::vector<Record> all_gather(const Team& bootstrap, const Record& mine, const char* what) {
  const int world = bootstrap.world_size(), rank = bootstrap.rank();
  constexpr size_t kBytes = sizeof(Record);
  std::vector<float> in(kBytes * size_t(world), 0.0f), out(in.size());
  const auto* bytes = reinterpret_cast<const unsigned char*>(&mine);
  for (size_t i = 0; i < kBytes; ++i) in[size_t(rank) * kBytes + i] = float(bytes[i]);
  try {
    allreduce(bootstrap, in.data(), out.data(), int64_t(in.size()), DType::kFloat32, Stream{},
              Algorithm::kOneShot);
  } catch (const Error& error) {
    TPF_FAIL(kOp << ": rank " << rank << ": the exchange of " << what
                 << " with the other ranks failed: " << error.what());
  }
  std::vector<Record> all(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    auto* record = reinterpret_cast<unsigned char*>(&all[size_t(r)]);
    for (size_t i = 0; i < kBytes; ++i) record[i] = (unsigned char)(out[size_t(r) * kBytes + i]);
  }
  return all;
}

// Throws on every rank alike if any rank's step failed: the first such rank, with its message
// (this rank's own in full).
void agree(const std::vector<Record>& records, int rank, const std::string& own, const char* step) {
  for (int r = 0; r < int(records.size()); ++r) {
    if (records[size_t(r)].failed == 0) continue;
    if (r == rank) TPF_FAIL(kOp << ": rank " << rank << ": " << step << " failed: " << own);
    TPF_FAIL(kOp << ": rank " << rank << ": rank " << r << "'s " << step
                 << " failed: " << records[size_t(r)].message);
  }
}

// The local ordinal of the device with this UUID, or -1 if this process does not see it.
int device_of(const unsigned char (&uuid)[16], int device_count) {
  for (int d = 0; d < device_count; ++d) {
    cudaDeviceProp properties{};
    if (cudaGetDeviceProperties(&properties, d) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    if (std::memcmp(properties.uuid.bytes, uuid, 16) == 0) return d;
  }
  return -1;
}

std::string uuid_text(const unsigned char (&uuid)[16]) {
  char text[40];
  std::snprintf(text, sizeof(text),
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", uuid[0],
                uuid[1], uuid[2], uuid[3], uuid[4], uuid[5], uuid[6], uuid[7], uuid[8], uuid[9],
                uuid[10], uuid[11], uuid[12], uuid[13], uuid[14], uuid[15]);
  return text;
}

}  // namespace

Team create_ipc_process_team(const CpuTeamId& id, int rank, int world_size, int device,
                             const TeamOptions& options) {
  TPF_CHECK_ARG(world_size >= 1 && world_size <= kMaxWorldSize, kOp,
                "world_size must be in [1, " << kMaxWorldSize << "], got " << world_size);
  TPF_CHECK_ARG(rank >= 0 && rank < world_size, kOp,
                "rank must be in [0, world_size = " << world_size << "), got " << rank);
  validate_team_options(options, kOp);
  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess) {
    cudaGetLastError();
    device_count = 0;
  }
  TPF_CHECK_ARG(
      device >= 0 && device < device_count, kOp,
      "device " << device << " but this process sees " << device_count << " CUDA device(s)");
  DeviceGuard guard(device);
  auto memory = std::make_shared<IpcTeamMemory>();
  memory->device = device;
  const size_t bytes = allocation_bytes(world_size, options.packet_bytes);
  cudaDeviceProp properties{};

  // This rank's own setup: its failure is told to the peers in the first exchange.
  Record record{};
  std::string own;
  record.pid = int32_t(::getpid());
  record.packet_bytes = options.packet_bytes;
  record.peer_stores = options.peer_stores ? 1 : 0;
  record.peer_memory = uint32_t(options.peer_memory);
  run_step(record, own, [&] {
    TPF_CHECK_CUDA(cudaGetDeviceProperties(&properties, device));
    std::memcpy(record.uuid, properties.uuid.bytes, sizeof(record.uuid));
    TPF_CHECK_CUDA(cudaStreamCreateWithFlags(&memory->stream, cudaStreamNonBlocking));
    const size_t host_bytes = sizeof(ErrorRecord) + sizeof(uint32_t) * kMaxWorldSize;
    TPF_CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&memory->host_flags), host_bytes,
                                 cudaHostAllocMapped));
    std::memset(memory->host_flags, 0, host_bytes);
    TPF_CHECK_CUDA(cudaMalloc(&memory->control, sizeof(ControlBlock)));
    TPF_CHECK_CUDA(cudaMemsetAsync(memory->control, 0, sizeof(ControlBlock), memory->stream));
    if (options.peer_stores) {
      record.handle = ipc_export(bytes, &memory->workspace);
      fill_sentinel(memory->workspace, bytes, memory->stream);
    }
    cuda_preload_kernels(world_size);
    TPF_CHECK_CUDA(cudaStreamSynchronize(memory->stream));
  });

  // The bootstrap team. Ranks reach each wait of the creation after CUDA work of their own (a
  // context, the fill, the kernels' loading: seconds apart for processes sharing a GPU), and the
  // last exchange after a handshake that may take its whole timeout, so each wait lasts both.
  TeamOptions bootstrap_options;
  bootstrap_options.packet_bytes = kBootstrapPacketBytes;
  bootstrap_options.peer_timeout_seconds =
      options.peer_timeout_seconds > 0
          ? options.peer_timeout_seconds + options.handshake_timeout_seconds
          : 0.0;
  try {
    memory->bootstrap = create_cpu_team(id, rank, world_size, bootstrap_options);
  } catch (const Error& error) {
    TPF_FAIL(kOp << ": rank " << rank
                 << ": the ranks did not all join the bootstrap over the CPU team of this id: "
                 << error.what());
  }
  const Team& bootstrap = memory->bootstrap;

  // 1. The records: every rank's setup, and the same options everywhere.
  const std::vector<Record> records = all_gather(bootstrap, record, "the setup records");
  agree(records, rank, own, "setup");
  for (int r = 1; r < world_size; ++r) {
    const Record& first = records[0];
    const Record& other = records[size_t(r)];
    std::ostringstream differs;
    if (other.packet_bytes != first.packet_bytes) {
      differs << "options.packet_bytes: " << first.packet_bytes << " on rank 0, "
              << other.packet_bytes << " on rank " << r;
    } else if (other.peer_stores != first.peer_stores) {
      differs << "options.peer_stores: " << first.peer_stores << " on rank 0, " << other.peer_stores
              << " on rank " << r;
    } else if (other.peer_memory != first.peer_memory) {
      differs << "options.peer_memory: " << first.peer_memory << " on rank 0, " << other.peer_memory
              << " on rank " << r;
    }
    if (!differs.str().empty()) {
      TPF_FAIL(kOp << ": rank " << rank << ": the ranks were not given the same options, in "
                   << differs.str() << "; every rank must pass the same world_size and options");
    }
  }
  TPF_CHECK_ARG(options.peer_stores, kOp,
                "options.peer_stores is false, but a team made without NCCL has no NCCL path "
                "to run its ops on (use create_nccl_team, or peer_stores true)");
  TPF_CHECK_ARG(
      options.peer_memory == PeerMemory::kAuto || options.peer_memory == PeerMemory::kCudaIpc, kOp,
      "options.peer_memory must be kAuto or kCudaIpc for a team made without NCCL, got "
          << int(options.peer_memory));

  // 2. P2P between this rank's device and each peer's, then the peers' workspaces mapped.
  std::array<char*, kMaxWorldSize> workspace{};
  record = Record{};
  own.clear();
  run_step(record, own, [&] {
    std::string error;
    for (int r = 0; r < world_size && error.empty(); ++r) {
      const Record& peer = records[size_t(r)];
      if (r == rank || std::memcmp(peer.uuid, records[size_t(rank)].uuid, 16) == 0) continue;
      const int peer_device = device_of(peer.uuid, device_count);
      if (peer_device < 0) {
        error = "rank " + std::to_string(r) + "'s device (" + uuid_text(peer.uuid) +
                ") is not visible to rank " + std::to_string(rank) +
                "'s process (CUDA_VISIBLE_DEVICES?)";
        break;
      }
      int can_access = 0;
      TPF_CHECK_CUDA(cudaDeviceCanAccessPeer(&can_access, device, peer_device));
      if (!can_access) {
        error = "device " + std::to_string(device) + " (rank " + std::to_string(rank) +
                ") cannot access device " + std::to_string(peer_device) + " (rank " +
                std::to_string(r) + ") as a peer (no P2P between them)";
      }
    }
    if (error.empty()) {
      std::vector<cudaIpcMemHandle_t> handles(static_cast<size_t>(world_size));
      for (int r = 0; r < world_size; ++r) handles[size_t(r)] = records[size_t(r)].handle;
      error = ipc_open_peers(handles, rank, memory->workspace, workspace, memory->ipc_peers);
    }
    if (!error.empty()) TPF_FAIL(error);
  });
  agree(all_gather(bootstrap, record, "the peer mappings"), rank, own, "mapping of the peers");

  // 3. The handshake: proof that every rank's stores arrive in every rank.
  if (world_size > 1) {
    uint32_t* arrived = memory->host_flags + sizeof(ErrorRecord) / sizeof(uint32_t);
    record = Record{};
    own.clear();
    run_step(record, own, [&] {
      launch_handshake(workspace, rank, world_size,
                       workspace_bytes(world_size, options.packet_bytes),
                       uint64_t(options.handshake_timeout_seconds * 1e9), arrived, memory->stream);
      TPF_CHECK_CUDA(cudaStreamSynchronize(memory->stream));
      record.arrived_mask = arrived_mask(arrived, world_size);
    });
    const std::vector<Record> masks = all_gather(bootstrap, record, "the handshake's results");
    agree(masks, rank, own, "handshake");
    std::vector<uint32_t> seen(static_cast<size_t>(world_size));
    for (int r = 0; r < world_size; ++r) seen[size_t(r)] = masks[size_t(r)].arrived_mask;
    const std::string verdict =
        handshake_verdict(seen.data(), world_size, options.handshake_timeout_seconds);
    if (!verdict.empty()) {
      TPF_FAIL(kOp << ": rank " << rank << ": " << verdict
                   << "; a team made without NCCL has nothing to fall back on");
    }
  }

  auto state = new_team_state<CudaTeamState>(cuda_backend(), rank, world_size, options,
                                             properties.name, "", "cuda ipc");
  for (int r = 0; r < world_size; ++r) state->exchange.workspace[r] = workspace[r];
  state->exchange.control = static_cast<ControlBlock*>(memory->control);
  state->exchange.errors = reinterpret_cast<ErrorRecord*>(memory->host_flags);
  state->device = device;
  int multiprocessors = 0;
  TPF_CHECK_CUDA(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device));
  const int ranks_on_device =
      int(std::count_if(records.begin(), records.end(), [&](const Record& peer) {
        return std::memcmp(peer.uuid, records[size_t(rank)].uuid, 16) == 0;
      }));
  state->multiprocessors = share_of_multiprocessors(multiprocessors, ranks_on_device);
  const Team bootstrap_handle = bootstrap;
  state->peer_status = [bootstrap_handle](int peer) {
    const TeamState* bootstrap_state = bootstrap_handle.state();
    return bootstrap_state->peer_status ? bootstrap_state->peer_status(peer) : std::string();
  };
  state->memory = memory;
  return Team(std::move(state));
}

}  // namespace impl

Team create_cuda_team(const CpuTeamId& id, int rank, int world_size, int device,
                      const TeamOptions& options) {
  return impl::create_ipc_process_team(id, rank, world_size, device, options);
}

}  // namespace tpfuse
