// The CPU backend: ranks are threads of one process, workspaces are host memory, and each call
// runs the Lamport one-shot protocol of tpfuse/impl/lamport.h with the epilogues of
// tpfuse/impl/epilogue.h: the same code the CUDA kernel runs, with a thread in place of a grid.
// Packet stores, polls and their memory ordering: cpu/cpu_exchange.h.
#include <algorithm>
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

// The epilogue over one row whose rank sum (fp32) is in `acc`, vector by vector. on_rounded(v,
// vector) sees each rounded output vector (residual_out, or out for kSum) as it is stored: the
// two-shot owner sends it to its peers.
template <typename T, typename OnRounded>
void finish_row(std::vector<float>& acc, const OneShotParams& p, Epilogue epilogue, int64_t token,
                OnRounded&& on_rounded) {
  constexpr int kElements = Packed<T>::kElements;
  using Lanes = float[kElements];
  const int64_t vectors = p.hidden / kElements;
  const int64_t row = token * vectors;
  if (epilogue == Epilogue::kSum) {
    for (int64_t v = 0; v < vectors; ++v) {
      const Vec16 out = round_output<T>(*reinterpret_cast<Lanes*>(&acc[v * kElements]));
      store_plain(p.norm_out, row + v, out);
      on_rounded(v, out);
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
    on_rounded(v, rounded);
  }
  const float scale = rms_scale(sum_squares, p.hidden, p.eps);
  for (int64_t v = 0; v < vectors; ++v) {
    const Lanes& lanes = *reinterpret_cast<const Lanes*>(&acc[v * kElements]);
    store_plain(p.norm_out, row + v, normalize<T>(lanes, load_plain(p.gamma, v), scale));
  }
}

template <typename T>
void finish_row(std::vector<float>& acc, const OneShotParams& p, Epilogue epilogue, int64_t token) {
  finish_row<T>(acc, p, epilogue, token, [](int64_t, const Vec16&) {});
}

// Sums, in rank order into acc, `vectors` packet vectors at `offset` of every other sender's
// region of this rank's slot (polling each until it has arrived) and this rank's own row, read
// from its input at vector `own_vector` with sentinel words rewritten as a peer receives them.
template <typename T>
void receive_row(const OneShotParams& p, uint32_t slot, size_t offset, int64_t own_vector,
                 int64_t vectors, std::vector<float>& acc) {
  constexpr int kElements = Packed<T>::kElements;
  using Lanes = float[kElements];
  for (int64_t v = 0; v < vectors; ++v) {
    Lanes& lanes = *reinterpret_cast<Lanes*>(&acc[v * kElements]);
    for (int r = 0; r < p.world_size; ++r) {
      const char* base = p.workspace[p.rank] + packet_offset(slot, r, p.world_size, p.packet_bytes);
      const Vec16 packet =
          r == p.rank ? rewrite_sentinel(load_plain(p.input, own_vector + v))
                      : poll_vector(base + offset + v * 16, p.timeout_ns, p.error_flag, p.rank, r);
      if (r == 0) {
        accumulate_first<T>(lanes, packet);
      } else {
        accumulate<T>(lanes, packet);
      }
    }
  }
}

// Stores `vectors` vectors of `source` (sentinel words rewritten) at `offset` of this rank's
// sender region of `slot` in rank `receiver`'s workspace.
void send_row(const OneShotParams& p, uint32_t slot, int receiver, size_t offset,
              const void* source, int64_t first_vector, int64_t vectors) {
  char* base = p.workspace[receiver] + packet_offset(slot, p.rank, p.world_size, p.packet_bytes);
  for (int64_t v = 0; v < vectors; ++v) {
    store_vector(base + offset + v * 16, rewrite_sentinel(load_plain(source, first_vector + v)));
  }
}

template <typename T>
void oneshot(const OneShotParams& p, Epilogue epilogue) {
  ControlBlock& control = *p.control;
  check_not_failed(p.error_flag, p.rank);
  const uint32_t slot = control.slot;
  const int64_t vectors = p.hidden / Packed<T>::kElements;
  const size_t row_bytes = size_t(p.hidden) * sizeof(T);

  // Send: this rank's packet, sentinel words rewritten, into every other rank's slot.
  for (int r = 0; r < p.world_size; ++r) {
    if (r != p.rank) send_row(p, slot, r, 0, p.input, 0, p.tokens * vectors);
  }

  clear_previous_slot(p.workspace[p.rank], control, p.world_size, p.packet_bytes, p.rank);

  // Receive: sum every rank's packet in rank order, then the epilogue, row by row.
  std::vector<float> acc(size_t(p.hidden));
  for (int64_t token = 0; token < p.tokens; ++token) {
    receive_row<T>(p, slot, size_t(token) * row_bytes, token * vectors, vectors, acc);
    finish_row<T>(acc, p, epilogue, token);
  }
  control.slot_bytes[slot] = uint64_t(p.tokens) * row_bytes;
  control.slot = next_slot(slot);
}

// Two-shot (tpfuse/impl/lamport.h): reduce-scatter the input rows to their owners, finish the
// owned rows and all-gather them rounded, finish the rows received rounded.
template <typename T>
void twoshot(const OneShotParams& p, Epilogue epilogue) {
  constexpr int kElements = Packed<T>::kElements;
  using Lanes = float[kElements];
  ControlBlock& control = *p.control;
  check_not_failed(p.error_flag, p.rank);
  const uint32_t slot = control.slot;
  const int64_t vectors = p.hidden / kElements;
  const size_t row_bytes = size_t(p.hidden) * sizeof(T);
  const TwoShotLayout layout(p.tokens, p.world_size);

  // Reduce-scatter: each input row to the rank that owns its token (its own rows stay in its
  // input).
  for (int owner = 0; owner < p.world_size; ++owner) {
    if (owner == p.rank) continue;
    for (int64_t local = 0; local < layout.count(owner); ++local) {
      send_row(p, slot, owner, layout.scatter_row(local, row_bytes), p.input,
               (layout.begin(owner) + local) * vectors, vectors);
    }
  }

  clear_previous_slot(p.workspace[p.rank], control, p.world_size, p.packet_bytes, p.rank);

  // Owned rows: rank-ordered sum, epilogue, and the rounded row to every other rank.
  std::vector<float> acc(size_t(p.hidden));
  for (int64_t local = 0; local < layout.count(p.rank); ++local) {
    receive_row<T>(p, slot, layout.scatter_row(local, row_bytes),
                   (layout.begin(p.rank) + local) * vectors, vectors, acc);
    finish_row<T>(acc, p, epilogue, layout.begin(p.rank) + local,
                  [&](int64_t v, const Vec16& rounded) {
                    for (int r = 0; r < p.world_size; ++r) {
                      if (r == p.rank) continue;
                      char* base = p.workspace[r] +
                                   packet_offset(slot, p.rank, p.world_size, p.packet_bytes) +
                                   layout.gather_row(local, row_bytes);
                      store_vector(base + v * 16, rounded);
                    }
                  });
  }

  // Rows other ranks own arrive rounded: finish them exactly as their owner did.
  const Epilogue gathered = epilogue == Epilogue::kSum ? Epilogue::kSum : Epilogue::kRmsNorm;
  for (int owner = 0; owner < p.world_size; ++owner) {
    if (owner == p.rank) continue;
    const char* base =
        p.workspace[p.rank] + packet_offset(slot, owner, p.world_size, p.packet_bytes);
    for (int64_t local = 0; local < layout.count(owner); ++local) {
      for (int64_t v = 0; v < vectors; ++v) {
        const Vec16 packet = poll_vector(base + layout.gather_row(local, row_bytes) + v * 16,
                                         p.timeout_ns, p.error_flag, p.rank, owner);
        accumulate_first<T>(*reinterpret_cast<Lanes*>(&acc[v * kElements]), packet);
      }
      finish_row<T>(acc, p, gathered, layout.begin(owner) + local);
    }
  }
  control.slot_bytes[slot] = layout.sender_bytes(row_bytes);
  control.slot = next_slot(slot);
}

template <typename T>
void local_epilogue(const OneShotParams& p, Epilogue epilogue) {
  constexpr int kElements = Packed<T>::kElements;
  using Lanes = float[kElements];
  const int64_t vectors = p.hidden / kElements;
  std::vector<float> acc(size_t(p.hidden));
  for (int64_t token = 0; token < p.tokens; ++token) {
    for (int64_t v = 0; v < vectors; ++v) {
      accumulate_first<T>(*reinterpret_cast<Lanes*>(&acc[v * kElements]),
                          load_plain(p.input, token * vectors + v));
    }
    finish_row<T>(acc, p, epilogue, token);
  }
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

void cpu_twoshot(const TeamState& team, const OneShotParams& params, DType dtype,
                 Epilogue epilogue) {
  (void)team;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    twoshot<T>(params, epilogue);
  });
}

void cpu_local_epilogue(const OneShotParams& params, DType dtype, Epilogue epilogue) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    local_epilogue<T>(params, epilogue);
  });
}

void cpu_allreduce_rows(const TeamState& team, const void* input, void* out, int64_t rows,
                        int64_t row_elements, DType dtype) {
  const size_t row_bytes = size_t(row_elements) * dtype_size(dtype);
  const int64_t chunk = std::max<int64_t>(1, int64_t(team.packet_bytes / row_bytes));
  for (int64_t first = 0; first < rows; first += chunk) {
    OneShotParams sum = make_oneshot_params(team, AddRmsNormArgs{});
    sum.input = static_cast<const char*>(input) + size_t(first) * row_bytes;
    sum.norm_out = static_cast<char*>(out) + size_t(first) * row_bytes;
    sum.tokens = std::min(chunk, rows - first);
    sum.hidden = row_elements;
    cpu_oneshot(team, sum, dtype, Epilogue::kSum);
  }
}

void cpu_nccl_path(const TeamState& team, const OneShotParams& params, DType dtype,
                   Epilogue epilogue) {
  if (epilogue == Epilogue::kSum) {
    cpu_allreduce_rows(team, params.input, params.norm_out, params.tokens, params.hidden, dtype);
    return;
  }
  // The sum, rounded to dtype as NCCL delivers it, then the local epilogue on it.
  std::vector<Vec16> sum(size_t(params.tokens * params.hidden) * dtype_size(dtype) / 16);
  cpu_allreduce_rows(team, params.input, sum.data(), params.tokens, params.hidden, dtype);
  OneShotParams local = params;
  local.input = sum.data();
  cpu_local_epilogue(local, dtype, epilogue);
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
    state->device_name = "cpu";
    state->selection = impl::selection_for(state->device_name, world_size);
    state->peer_memory = "host memory";
    state->fused = options.peer_stores;
    if (!options.peer_stores) {
      state->fallback_reason =
          "TeamOptions::peer_stores is false (CPU backend: ops run the NCCL path's stand-in)";
    }
    state->memory = memory;
    team.emplace_back(std::move(state));
  }
  return team;
}

}  // namespace tpfuse
