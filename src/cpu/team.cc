// CPU-backend teams of one process: every rank's workspace and control block in its host memory.
#include <array>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/error.h"
#include "core/team_state.h"
#include "cpu/kernels.h"
#include "tpfuse/impl/lamport.h"

namespace tpfuse {
namespace impl {
namespace {

struct CpuTeamMemory : TeamMemory {
  std::vector<void*> blocks;
  ~CpuTeamMemory() override {
    for (void* block : blocks) std::free(block);
  }
};

void* allocate_aligned(size_t bytes) {
  const size_t rounded = (bytes + 63) / 64 * 64;
  void* pointer = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
  if (pointer == nullptr) TPF_FAIL("out of host memory allocating " << bytes << " bytes");
  return pointer;
}

}  // namespace
}  // namespace impl

std::vector<Team> create_cpu_team(int world_size, const TeamOptions& options) {
  const char* op = "create_cpu_team";
  TPF_CHECK_ARG(world_size >= 1 && world_size <= kMaxWorldSize, op,
                "world_size must be in [1, " << kMaxWorldSize << "], got " << world_size);
  impl::validate_team_options(options, op);
  auto memory = std::make_shared<impl::CpuTeamMemory>();
  const size_t bytes = impl::workspace_bytes(world_size, options.packet_bytes);
  std::array<char*, kMaxWorldSize> workspace{};
  std::vector<impl::ControlBlock*> controls;
  std::vector<impl::ErrorRecord*> records;
  for (int r = 0; r < world_size; ++r) {
    workspace[r] = static_cast<char*>(impl::allocate_aligned(bytes));
    memory->blocks.push_back(workspace[r]);
    auto* words = reinterpret_cast<uint32_t*>(workspace[r]);
    for (size_t i = 0; i < bytes / 4; ++i) words[i] = impl::kSentinel;
    auto* control =
        static_cast<impl::ControlBlock*>(impl::allocate_aligned(sizeof(impl::ControlBlock)));
    memory->blocks.push_back(control);
    *control = impl::ControlBlock{};
    controls.push_back(control);
    auto* record =
        static_cast<impl::ErrorRecord*>(impl::allocate_aligned(sizeof(impl::ErrorRecord)));
    memory->blocks.push_back(record);
    *record = impl::ErrorRecord{};
    records.push_back(record);
  }
  // No fence needed: the caller's rank threads start after this returns, and starting a thread
  // orders everything before it (the sentinel fill included) before the thread's first step.
  const std::string fallback =
      options.peer_stores
          ? ""
          : "TeamOptions::peer_stores is false (CPU backend: ops run the NCCL path's stand-in)";
  std::vector<Team> team;
  for (int r = 0; r < world_size; ++r) {
    auto state = impl::new_team_state(impl::cpu_backend(), r, world_size, options, "cpu", fallback,
                                      "host memory");
    for (int p = 0; p < world_size; ++p) state->exchange.workspace[p] = workspace[p];
    state->exchange.control = controls[r];
    state->exchange.errors = records[r];
    state->memory = memory;
    team.emplace_back(std::move(state));
  }
  return team;
}

}  // namespace tpfuse
