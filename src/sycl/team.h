// What the SYCL backend's two kinds of team share when they are made (src/sycl/team.cc: ranks of
// one process; src/sycl/process_team.cc: a process a rank): the refusal of more spinning ranks
// on a device than it has compute units, and the waits' bound.
#pragma once

#include <sycl/sycl.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "sycl/state.h"

namespace tpfuse::impl {

std::string sycl_device_name(const sycl::device& device);

// One rank's device as the refusal counts it: ranks of one `device_key` share its compute units.
struct RankOnDevice {
  int rank;
  std::string device_key;
  std::string device_name;
  uint32_t compute_units;
};

// Ranks that would spin on one device at once need a compute unit each (rows.h): more is refused,
// naming the ranks, the device and its compute units (the fewest any of its ranks has),
// rather than left to time out (or hang, without a timeout). `note` follows the count.
void refuse_more_ranks_than_compute_units(const std::vector<RankOnDevice>& ranks, const char* op,
                                          const std::string& note = "");

// The waits' bound of SyclRowCall::bound: `timeout_seconds` as clock ticks (or looks, without a
// clock) at the rate measured on `queue`'s device; 0 (no bound) for a timeout of 0.
uint64_t sycl_wait_bound(sycl::queue& queue, const SyclKernels& kernels, double timeout_seconds);

}  // namespace tpfuse::impl
