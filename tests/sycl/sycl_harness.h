// The SYCL test harness: a team made by create_sycl_team (ranks sharing Intel's OpenCL CPU
// device here), device memory a rank, each rank's calls on its own in-order queue. Calls only
// queue work, so one thread submits every rank's in turn; synchronize is Team::check (which
// waits for the rank's last call and reports its errors).
#pragma once

#include <sycl/sycl.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "harness.h"
#include "reference.h"
#include "tpfuse/sycl.h"

namespace tpfuse::testing {

// The CPU device, or why there is none (a failure where TPFUSE_SYCL_REQUIRE_DEVICE is set, as
// ctest sets it; a skip by hand without the environment fetch-sycl.sh prints).
inline bool find_cpu_device(std::optional<sycl::device>& device, std::string& why) {
  try {
    device = sycl::device(sycl::cpu_selector_v);
    return true;
  } catch (const sycl::exception& error) {
    why = std::string(
              "no SYCL CPU device (set OCL_ICD_FILENAMES and LD_LIBRARY_PATH as "
              "scripts/fetch-sycl.sh prints): ") +
          error.what();
    return false;
  }
}

#define TPF_REQUIRE_DEVICE(device)                                       \
  std::optional<sycl::device> tpf_device_;                               \
  {                                                                      \
    std::string tpf_why_;                                                \
    if (!find_cpu_device(tpf_device_, tpf_why_)) {                       \
      if (std::getenv("TPFUSE_SYCL_REQUIRE_DEVICE")) FAIL() << tpf_why_; \
      GTEST_SKIP() << tpf_why_;                                          \
    }                                                                    \
  }                                                                      \
  const sycl::device device = *tpf_device_

// Two ranks spin at once: a device of fewer compute units refuses the team (the refusal test
// checks that); the tests of two ranks skip it, saying why.
#define TPF_REQUIRE_TWO_COMPUTE_UNITS(device)                                 \
  if (device.get_info<sycl::info::device::max_compute_units>() < 2) {         \
    GTEST_SKIP() << "two ranks need 2 compute units, the device has "         \
                 << device.get_info<sycl::info::device::max_compute_units>(); \
  }

inline std::vector<Team> two_ranks(const sycl::device& device, const TeamOptions& options = {}) {
  return create_sycl_team(std::vector<sycl::device>{device, device}, options);
}

// Whether two outputs have the same bits, element by element, NaN payloads aside (where two NaNs
// meet, which payload survives is the compiler's choice, as on the CPU backend).
inline size_t differing_elements(const HostTensor& a, const HostTensor& b) {
  size_t differ = 0;
  for (size_t i = 0; i < a.count(); ++i) {
    const bool both_nan = std::isnan(a.get(i)) && std::isnan(b.get(i));
    const size_t size = dtype_size(a.dtype);
    differ += !both_nan && std::memcmp(a.bytes.data() + i * size, b.bytes.data() + i * size, size);
  }
  return differ;
}

class SyclHarness : public Harness {
 public:
  explicit SyclHarness(std::vector<Team> team) : team_(std::move(team)) {}
  ~SyclHarness() override {
    // Every rank's last call has ended (Team::check waits for it) before its memory goes.
    for (Team& rank : team_) {
      try {
        rank.check();
      } catch (const Error&) {
      }
    }
    for (size_t r = 0; r < blocks_.size(); ++r) {
      for (void* block : blocks_[r]) sycl::free(block, queue(int(r)));
    }
  }
  std::vector<Team>& team() override { return team_; }
  sycl::queue& queue(int rank) { return sycl_queue(team_[size_t(rank)]); }
  void* allocate(int rank, size_t bytes) override {
    void* block = sycl::malloc_device(bytes + 64, queue(rank));
    if (block == nullptr) throw Error("sycl::malloc_device of " + std::to_string(bytes) + " bytes");
    if (blocks_.size() < team_.size()) blocks_.resize(team_.size());
    blocks_[size_t(rank)].push_back(block);
    return block;
  }
  void upload(int rank, void* destination, const void* source, size_t bytes) override {
    queue(rank).memcpy(destination, source, bytes).wait();
  }
  void download(int rank, void* destination, const void* source, size_t bytes) override {
    queue(rank).memcpy(destination, source, bytes).wait();
  }
  void run(const std::function<void(int, Stream)>& call) override {
    enqueue(call);
    synchronize();
  }
  // Every rank's call, rank by rank (a call returns once its kernel is queued); the first error
  // is rethrown after every rank has made its call.
  void enqueue(const std::function<void(int, Stream)>& call) override {
    std::exception_ptr first_error;
    for (int r = 0; r < world_size(); ++r) {
      try {
        call(r, sycl_stream(queue(r)));
      } catch (...) {
        if (!first_error) first_error = std::current_exception();
      }
    }
    if (first_error) std::rethrow_exception(first_error);
  }
  void synchronize() override {
    std::exception_ptr first_error;
    for (int r = 0; r < world_size(); ++r) {
      try {
        team_[size_t(r)].check();
      } catch (...) {
        if (!first_error) first_error = std::current_exception();
      }
    }
    if (first_error) std::rethrow_exception(first_error);
  }

 private:
  std::vector<Team> team_;
  std::vector<std::vector<void*>> blocks_;
};

}  // namespace tpfuse::testing
