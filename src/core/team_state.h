// Internal: what a Team handle points to.
#pragma once

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

// One rank's state, as every backend has it. A backend that keeps more per rank (CUDA: its
// grids' share of the device, its NCCL path's communicator and buffers) derives its own state from
// this one (new_team_state<State>) and reads it back in its own calls.
struct TeamState {
  TeamState() = default;
  TeamState(const TeamState&) = delete;
  TeamState& operator=(const TeamState&) = delete;
  virtual ~TeamState() = default;

  const BackendOps* ops = nullptr;  // the backend every call of this team runs on
  Exchange exchange{};              // rank, world size, workspace, control block, timeout
  int device = -1;                  // the backend's device ordinal (-1 on the CPU)
  std::string device_name;          // e.g. "NVIDIA H200": the selection table's key
  // The table's rows for this device and world size, in order (matched once, at creation).
  std::vector<SelectionStep> selection;
  // false when the fused kernels may not run (no proven peer stores): every op takes the NCCL
  // path, and fallback_reason says why. The same on every rank.
  bool fused = true;
  std::string fallback_reason;
  std::string peer_memory;
  std::shared_ptr<TeamMemory> memory;
  // Teams whose ranks are processes: what is known of a peer's process, appended to the report of
  // a timeout waiting for it (e.g. " (its process, pid 123, has exited)"; empty if nothing is).
  std::function<std::string(int peer)> peer_status;

  int rank() const { return exchange.rank; }
  int world_size() const { return exchange.world_size; }
  size_t packet_bytes() const { return exchange.packet_bytes; }
};

// Sets what every team kind sets alike: the exchange from `options`, the selection rows of
// `device_name`, and the fallback (fused when `fallback_reason` is empty).
void init_team_state(TeamState& state, const BackendOps& ops, int rank, int world_size,
                     const TeamOptions& options, const std::string& device_name,
                     const std::string& fallback_reason, const std::string& peer_memory);

// A rank's state (the backend's own State, derived from TeamState), set up by init_team_state.
template <typename State = TeamState>
std::shared_ptr<State> new_team_state(const BackendOps& ops, int rank, int world_size,
                                      const TeamOptions& options, const std::string& device_name,
                                      const std::string& fallback_reason,
                                      const std::string& peer_memory) {
  auto state = std::make_shared<State>();
  init_team_state(*state, ops, rank, world_size, options, device_name, fallback_reason,
                  peer_memory);
  return state;
}

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
