// The SYCL backend on Intel's OpenCL CPU device (label sycl): the shared property suites
// (tests/common) against a team of two ranks sharing the device, the CPU backend's bits where
// the reference defines them, misuse and faults, and the refusal of teams the device cannot run.
#include <gtest/gtest.h>

#include <sycl/sycl.hpp>

#include <chrono>
#include <cstdlib>
#include <string>

#include "oneshot_properties.h"
#include "sycl_harness.h"

namespace tpfuse::testing {
namespace {

// The CPU device, or why there is none (a failure where TPFUSE_SYCL_REQUIRE_DEVICE is set, as
// ctest sets it; a skip by hand without the environment fetch-sycl.sh prints).
bool find_cpu_device(sycl::device& device, std::string& why) {
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
  sycl::device device;                                                   \
  {                                                                      \
    std::string tpf_why_;                                                \
    if (!find_cpu_device(device, tpf_why_)) {                            \
      if (std::getenv("TPFUSE_SYCL_REQUIRE_DEVICE")) FAIL() << tpf_why_; \
      GTEST_SKIP() << tpf_why_;                                          \
    }                                                                    \
  }

std::vector<Team> two_ranks(const sycl::device& device, const TeamOptions& options = {}) {
  return create_sycl_team(std::vector<sycl::device>{device, device}, options);
}

TEST(SyclBackend, AllreduceOfTwoRanks) {
  TPF_REQUIRE_DEVICE(device);
  SyclHarness harness(two_ranks(device));
  EXPECT_EQ(harness.team()[0].backend(), Backend::kSycl);
  EXPECT_EQ(harness.team()[0].peer_memory(), "sycl usm");
  harness.algorithm = Algorithm::kOneShot;
  std::mt19937_64 rng(1);
  OneShotRunner runner(harness);
  CaseSpec spec;
  spec.plain_allreduce = true;
  spec.residual = false;
  spec.tokens = 2;
  spec.hidden = 64;
  const CaseData data = random_case(rng, spec, 2);
  expect_correct(spec, data, runner.run(spec, data));
}

}  // namespace
}  // namespace tpfuse::testing
