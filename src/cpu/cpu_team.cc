// The CPU backend: ranks are threads of one process, workspaces are host memory, and each call
// runs the Lamport one-shot protocol of tpfuse/impl/lamport.h with the epilogues of
// tpfuse/impl/epilogue.h: the same code the CUDA kernel runs, with a thread in place of a grid.
// Packet stores, polls and their memory ordering: cpu/cpu_exchange.h.
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "common/error.h"
#include "common/team_state.h"
#include "cpu/cpu_exchange.h"
#include "tpfuse/impl/dispatch.h"
#include "tpfuse/impl/epilogue.h"
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

Vec16 load_plain(const void* base, int64_t vector_index) {
  Vec16 v;
  std::memcpy(&v, static_cast<const char*>(base) + vector_index * 16, 16);
  return v;
}

void store_plain(void* base, int64_t vector_index, const Vec16& v) {
  std::memcpy(static_cast<char*>(base) + vector_index * 16, &v, 16);
}

// The epilogue over one row whose rank sum (fp32) is in `acc`, vector by vector.
template <typename T>
void finish_row(std::vector<float>& acc, const OneShotParams& p, Epilogue epilogue, int64_t token) {
  constexpr int kElements = Packed<T>::kElements;
  using Lanes = float[kElements];
  const int64_t vectors = p.hidden / kElements;
  const int64_t row = token * vectors;
  if (epilogue == Epilogue::kSum) {
    for (int64_t v = 0; v < vectors; ++v) {
      store_plain(p.norm_out, row + v, pack<T>(*reinterpret_cast<Lanes*>(&acc[v * kElements])));
    }
    return;
  }
  float sum_squares = 0.0f;
  for (int64_t v = 0; v < vectors; ++v) {
    Lanes& lanes = *reinterpret_cast<Lanes*>(&acc[v * kElements]);
    Vec16 rounded;
    if (epilogue == Epilogue::kAddRmsNorm) {
      rounded = residual_round<T, true>(lanes, load_plain(p.residual, row + v), sum_squares);
    } else {
      rounded = residual_round<T, false>(lanes, Vec16{}, sum_squares);
    }
    if (p.residual_out != nullptr) store_plain(p.residual_out, row + v, rounded);
  }
  const float scale = rms_scale(sum_squares, p.hidden, p.eps);
  for (int64_t v = 0; v < vectors; ++v) {
    const Lanes& lanes = *reinterpret_cast<const Lanes*>(&acc[v * kElements]);
    store_plain(p.norm_out, row + v, normalize<T>(lanes, load_plain(p.gamma, v), scale));
  }
}

template <typename T>
void oneshot(const OneShotParams& p, Epilogue epilogue) {
  constexpr int kElements = Packed<T>::kElements;
  using Lanes = float[kElements];
  ControlBlock& control = *p.control;
  check_not_failed(p.error_flag, p.rank);
  const uint32_t slot = control.slot;
  const int64_t vectors = p.hidden / kElements;
  const size_t bytes = size_t(p.tokens * p.hidden) * sizeof(T);

  // Send: this rank's packet, sentinel words rewritten, into every rank's slot.
  for (int64_t v = 0; v < p.tokens * vectors; ++v) {
    const Vec16 packet = rewrite_sentinel(load_plain(p.input, v));
    for (int r = 0; r < p.world_size; ++r) {
      char* base = p.workspace[r] + packet_offset(slot, p.rank, p.world_size, p.packet_bytes);
      store_vector(base + v * 16, packet);
    }
  }

  clear_previous_slot(p.workspace[p.rank], control, p.world_size, p.packet_bytes);

  // Receive: sum every rank's packet in rank order, then the epilogue, row by row.
  std::vector<float> acc(size_t(p.hidden));
  for (int64_t token = 0; token < p.tokens; ++token) {
    for (int64_t v = 0; v < vectors; ++v) {
      Lanes& lanes = *reinterpret_cast<Lanes*>(&acc[v * kElements]);
      const int64_t index = token * vectors + v;
      for (int r = 0; r < p.world_size; ++r) {
        const char* base =
            p.workspace[p.rank] + packet_offset(slot, r, p.world_size, p.packet_bytes);
        const Vec16 packet = poll_vector(base + index * 16, p.timeout_ns, p.error_flag, p.rank, r);
        if (r == 0) {
          accumulate_first<T>(lanes, packet);
        } else {
          accumulate<T>(lanes, packet);
        }
      }
    }
    finish_row<T>(acc, p, epilogue, token);
  }
  control.slot_bytes[slot] = bytes;
  control.slot = next_slot(slot);
}

}  // namespace

void cpu_oneshot(const TeamState& team, const OneShotParams& params, DType dtype,
                 Epilogue epilogue) {
  (void)team;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    oneshot<T>(params, epilogue);
  });
}

void cpu_add_rmsnorm(const AddRmsNormArgs& args) {
  const OneShotParams p = make_local_params(args);
  dispatch_dtype(args.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr int kElements = Packed<T>::kElements;
    using Lanes = float[kElements];
    const int64_t vectors = p.hidden / kElements;
    std::vector<float> acc(size_t(p.hidden));
    for (int64_t token = 0; token < p.tokens; ++token) {
      for (int64_t v = 0; v < vectors; ++v) {
        accumulate_first<T>(*reinterpret_cast<Lanes*>(&acc[v * kElements]),
                            load_plain(p.input, token * vectors + v));
      }
      finish_row<T>(acc, p, Epilogue::kAddRmsNorm, token);
    }
  });
}

void cpu_check(const TeamState& team) {
  const uint32_t error = __atomic_load_n(team.error_flag, __ATOMIC_ACQUIRE);
  if (error != 0) {
    TPF_FAIL("rank " << team.rank << ": a call timed out waiting for rank " << error - 1
                     << "; the team is failed");
  }
}

}  // namespace impl

std::vector<Team> create_cpu_team(int world_size, const TeamOptions& options) {
  const char* op = "create_cpu_team";
  TPF_CHECK_ARG(world_size >= 1 && world_size <= kMaxWorldSize, op,
                "world_size must be in [1, " << kMaxWorldSize << "], got " << world_size);
  impl::validate_team_options(options, op);
  auto memory = std::make_shared<impl::CpuTeamMemory>();
  const size_t bytes = impl::workspace_bytes(world_size, options.packet_bytes);
  std::array<char*, impl::kMaxWorld> workspace{};
  std::vector<impl::ControlBlock*> controls;
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
  }
  // No fence needed: the caller's rank threads start after this returns, and starting a thread
  // orders everything before it (the sentinel fill included) before the thread's first step.
  std::vector<Team> team;
  for (int r = 0; r < world_size; ++r) {
    auto state = std::make_shared<impl::TeamState>();
    state->backend = Backend::kCpu;
    state->rank = r;
    state->world_size = world_size;
    state->packet_bytes = options.packet_bytes;
    state->timeout_ns = uint64_t(options.peer_timeout_seconds * 1e9);
    state->workspace = workspace;
    state->control = controls[r];
    state->error_flag = &controls[r]->error;
    state->memory = memory;
    team.emplace_back(std::move(state));
  }
  return team;
}

}  // namespace tpfuse
