// Internal: what a Team handle points to.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tpfuse/impl/session.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse::impl {

class BackendOps;

// Owner of a team's memory (every rank's for in-process teams); frees it with the last handle.
struct TeamMemory {
  virtual ~TeamMemory() = default;
};

// One row of the selection table as it applies to a team: messages of at most max_bytes run
// `algorithm`.
struct SelectionStep {
  uint64_t max_bytes;
  Algorithm algorithm;
};

// A rank's share of its device's multiprocessors: the device's, divided among the team's ranks
// on that device. A collective's blocks poll for packets that the peers' grids send, so every
// rank's grid must be resident at once; ranks that share a device and each sized their grid to
// the whole device could wait on a peer's grid that cannot start (the suspected cause of a
// timeout with 4 ranks on one H100, two-shot, 30 tokens x 16384; CHANGELOG, Known issue).
inline int share_of_multiprocessors(int device_multiprocessors, int ranks_on_device) {
  return ranks_on_device > 1 ? std::max(1, device_multiprocessors / ranks_on_device)
                             : device_multiprocessors;
}

constexpr size_t kNcclHeaderBytes = 16 * kMaxWorldSize;

struct TeamState {
  const BackendOps* ops = nullptr;  // the backend every call of this team runs on
  Exchange exchange{};              // rank, world size, workspace, control block, timeout
  int device = -1;                  // CUDA device ordinal (-1 on the CPU)
  // CUDA: the multiprocessors this rank's grids may fill (share_of_multiprocessors).
  int multiprocessors = 0;
  std::string device_name;  // e.g. "NVIDIA H200": the selection table's key
  // The table's rows for this device and world size, in order (matched once, at creation).
  std::vector<SelectionStep> selection;
  // false when the fused kernels may not run (no proven peer stores): every op takes the NCCL
  // path, and fallback_reason says why. The same on every rank.
  bool fused = true;
  std::string fallback_reason;
  std::string peer_memory;
  // CUDA teams with NCCL: this rank's communicator (ncclComm_t), and a [packet_bytes / 8, 2]
  // fp32 device buffer for the QK norm's NCCL path.
  void* nccl_comm = nullptr;
  float* qk_sums = nullptr;
  // CUDA teams with NCCL: the NCCL path's call headers, one 16-byte header a rank
  // (src/cuda/nccl_headers.cu), kNcclHeaderBytes of device memory.
  void* nccl_headers = nullptr;
  std::shared_ptr<TeamMemory> memory;
  // Teams whose ranks are processes: what is known of a peer's process, appended to the report of
  // a timeout waiting for it (e.g. " (its process, pid 123, has exited)"; empty if nothing is).
  std::function<std::string(int peer)> peer_status;

  int rank() const { return exchange.rank; }
  int world_size() const { return exchange.world_size; }
  size_t packet_bytes() const { return exchange.packet_bytes; }
};

// A rank's state with what every team kind sets alike: the exchange from `options`, the
// selection rows of `device_name`, and the fallback (fused when `fallback_reason` is empty).
std::shared_ptr<TeamState> new_team_state(const BackendOps& ops, int rank, int world_size,
                                          const TeamOptions& options,
                                          const std::string& device_name,
                                          const std::string& fallback_reason,
                                          const std::string& peer_memory);

void validate_team_options(const TeamOptions& options, const char* op);

// Whether a call of this rank failed the team (timeout, disagreeing peer): read without
// synchronizing with the device.
inline bool team_failed(const TeamState& team) {
  return __atomic_load_n(&team.exchange.errors->failure, __ATOMIC_ACQUIRE) != 0;
}

// Team::check's report (src/core/call_errors.cc), after the backend has synchronized with the
// rank's work: throws naming the peer and the field for a failure (which stays), or for a peer's
// rejected call (reported once: the team goes on).
void report_call_errors(const TeamState& team);
// The message for a failure of the team, as report_call_errors and the CPU backend throw it
// (`device` -1 on the CPU); `peer_note` follows the missing rank of a timeout.
std::string describe_failure(const ErrorRecord& errors, int rank, int device,
                             const std::string& peer_note = "");
// What the team knows of the peer a timeout names (TeamState::peer_status), else empty.
std::string peer_note(const TeamState& team);

}  // namespace tpfuse::impl
