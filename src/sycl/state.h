// The SYCL backend's side of a team (src/sycl/team.cc makes it, src/sycl/backend.cc runs its
// calls): its kernels for a device, and what a rank keeps beside the core's TeamState.
#pragma once

#include <sycl/sycl.hpp>

#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

#include "core/team_state.h"
#include "tpfuse/impl/epilogue.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse::impl {

class BackendOps;
const BackendOps& sycl_backend();

// The row epilogues the SYCL kernels are built for (epilogue.h's RowEpilogues), in the order of
// SyclKernels::rows.
constexpr int kSyclRowEpilogues = 11;
int sycl_epilogue_index(const RowEpilogueKind& epilogue);

// The backend's kernels (src/sycl/device/rows.h, qknorm.h) for one device of one context, compiled
// once, with their bundle, by the process's kernel compiler (memory and disk caches).
struct SyclKernels {
  std::vector<sycl::kernel> rows;  // [DType][sycl_epilogue_index]
  std::vector<sycl::kernel> qk;    // [DType]: the QK norm, every pass (qknorm.h)
  std::optional<sycl::kernel> absent;
  std::optional<sycl::kernel> calibrate;
  std::optional<sycl::kernel> clock_rate;
  bool clock;         // the waits' bound is in device clock ticks (else in looks): rows.h
  size_t group_size;  // work-items of a call's one work-group
  double seconds;     // what getting them took (compile, disk or memory)
  const sycl::kernel& row(DType dtype, int epilogue) const {
    return rows[size_t(dtype) * kSyclRowEpilogues + size_t(epilogue)];
  }
};

// The kernels for `device` of `context`: compiled on first use (a few seconds, or milliseconds
// from the disk cache), then kept for the process (never released: src/sycl/compiler.h says why).
const SyclKernels& sycl_kernels(const sycl::context& context, const sycl::device& device);

struct SyclTeamState : TeamState {
  std::optional<sycl::context> context;
  std::optional<sycl::device> sycl_device;
  mutable std::optional<sycl::queue> queue;  // in order: the calls made with an empty Stream
  const SyclKernels* kernels = nullptr;
  uint64_t bound = 0;  // the waits' bound (rows.h): peer_timeout_seconds as ticks or looks

  // The rank's last call, whichever queue it went to: what Team::check waits for.
  mutable std::mutex mutex;
  mutable std::optional<sycl::event> last;

  ~SyclTeamState() override {
    try {
      if (queue) queue->wait();
      if (last) last->wait();
    } catch (...) {
    }
  }
};

inline const SyclTeamState& sycl_state(const TeamState& team) {
  return static_cast<const SyclTeamState&>(team);
}

}  // namespace tpfuse::impl
