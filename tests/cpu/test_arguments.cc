// Every bad argument is rejected before any work, with a message that names it.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "tpfuse/tpfuse.h"

namespace tpfuse {
namespace {

struct Buffers {
  alignas(16) uint16_t input[4096];
  alignas(16) uint16_t residual[4096];
  alignas(16) uint16_t gamma[4096];
  alignas(16) uint16_t residual_out[4096];
  alignas(16) uint16_t norm_out[4096];
};

void expect_error_naming(const std::function<void()>& call, const std::string& name) {
  try {
    call();
    ADD_FAILURE() << "accepted; expected an error naming '" << name << "'";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(name), std::string::npos)
        << "message does not name '" << name << "': " << error.what();
  }
}

class Arguments : public ::testing::Test {
 protected:
  void SetUp() override {
    TeamOptions options;
    options.packet_bytes = 256;  // two tokens of 64 bf16
    team_ = create_cpu_team(2, options);
    args_.input = buffers_.input;
    args_.residual = buffers_.residual;
    args_.gamma = buffers_.gamma;
    args_.residual_out = buffers_.residual_out;
    args_.norm_out = buffers_.norm_out;
    args_.tokens = 2;
    args_.hidden = 64;
    args_.dtype = DType::kBFloat16;
  }
  // Validation runs before the protocol, so one rank alone gets the error and never blocks.
  void expect_rejected(const std::function<void(AddRmsNormArgs&)>& mutate,
                       const std::string& name) {
    AddRmsNormArgs args = args_;
    mutate(args);
    expect_error_naming([&] { allreduce_add_rmsnorm(team_[0], args); }, name);
  }

  Buffers buffers_{};
  std::vector<Team> team_;
  AddRmsNormArgs args_;
};

TEST_F(Arguments, AddRmsNormRejectsEachBadArgument) {
  expect_rejected([](auto& a) { a.input = nullptr; }, "input is null");
  expect_rejected([](auto& a) { a.gamma = nullptr; }, "gamma is null");
  expect_rejected([](auto& a) { a.norm_out = nullptr; }, "norm_out is null");
  expect_rejected([](auto& a) { a.residual_out = nullptr; }, "residual_out is null");
  expect_rejected([](auto& a) { a.tokens = -1; }, "tokens");
  expect_rejected([](auto& a) { a.hidden = 0; }, "hidden");
  expect_rejected([](auto& a) { a.hidden = 20; }, "hidden must be a positive multiple of 8");
  expect_rejected([](auto& a) { a.hidden = 16392; }, "at most 16384");
  expect_rejected([](auto& a) { a.dtype = DType(7); }, "dtype 7");
  expect_rejected([](auto& a) { a.eps = -1.0f; }, "eps");
  expect_rejected([](auto& a) { a.eps = NAN; }, "eps");
  expect_rejected([this](auto& a) { a.input = buffers_.input + 1; },
                  "input must be 16-byte aligned");
  expect_rejected([this](auto& a) { a.residual = buffers_.residual + 4; },
                  "residual must be 16-byte aligned");
  expect_rejected([this](auto& a) { a.gamma = buffers_.gamma + 2; },
                  "gamma must be 16-byte aligned");
  expect_rejected([this](auto& a) { a.norm_out = buffers_.input + 8; },
                  "norm_out partially overlaps input");
  expect_rejected([this](auto& a) { a.residual_out = buffers_.residual + 8; },
                  "residual_out partially overlaps residual");
  expect_rejected([this](auto& a) { a.residual_out = buffers_.norm_out; },
                  "residual_out and norm_out are the same");
  // An output on the weight, exactly or partly: the weight would change mid-call.
  expect_rejected([this](auto& a) { a.norm_out = buffers_.gamma; }, "norm_out overlaps gamma");
  expect_rejected([this](auto& a) { a.residual_out = buffers_.gamma + 8; },
                  "residual_out overlaps gamma");
  expect_rejected(
      [this](auto& a) {
        a.residual = nullptr;
        a.residual_out = nullptr;
        a.norm_out = buffers_.gamma + 56;
      },
      "norm_out overlaps gamma");
  expect_rejected(
      [](auto& a) {
        a.tokens = 3;
        a.algorithm = Algorithm::kOneShot;
      },
      "tokens 3 x hidden 64 of bfloat16 needs 384 bytes, more than oneshot carries in the "
      "team's packet capacity of 256 bytes (at most 2 tokens");
  expect_rejected(
      [](auto& a) {
        a.tokens = 3;
        a.algorithm = Algorithm::kTwoShot;
      },
      "more than twoshot carries in the team's packet capacity of 256 bytes (at most 2 tokens");
  expect_rejected([](auto& a) { a.algorithm = Algorithm(9); }, "algorithm 9 is not an Algorithm");
}

TEST_F(Arguments, InPlaceIsAcceptedAndEmptyBatchIsANoOp) {
  AddRmsNormArgs args = args_;
  args.tokens = 0;  // every rank skips alike; no slot is used, so one rank alone returns
  EXPECT_NO_THROW(allreduce_add_rmsnorm(team_[0], args));
  // An empty batch's row tensors may be null (what an empty torch tensor's data pointer is).
  args.input = nullptr;
  args.residual = nullptr;
  args.residual_out = nullptr;
  args.norm_out = nullptr;
  EXPECT_NO_THROW(allreduce_add_rmsnorm(team_[0], args));
}

TEST_F(Arguments, MessagesNameRepositoryPathsNotTheBuildMachines) {
  AddRmsNormArgs args = args_;
  args.input = nullptr;
  try {
    allreduce_add_rmsnorm(team_[0], args);
    FAIL() << "accepted a null input";
  } catch (const Error& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("(src/core/validate.cc:"), std::string::npos) << message;
    EXPECT_EQ(message.find("(/"), std::string::npos) << message;
  }
}

TEST_F(Arguments, EmptyTeamHandleAndStreamOnCpu) {
  expect_error_naming([&] { allreduce_add_rmsnorm(Team{}, args_); }, "team is an empty handle");
  expect_error_naming([&] { Team{}.rank(); }, "empty");
  expect_error_naming(
      [&] { allreduce_add_rmsnorm(team_[0], args_, reinterpret_cast<cudaStream_t>(0x10)); },
      "stream must be null for a CPU-backend team");
}

TEST_F(Arguments, AllreduceRejectsBadCounts) {
  expect_error_naming(
      [&] { allreduce(team_[0], buffers_.input, buffers_.norm_out, 12, DType::kBFloat16); },
      "count must be a positive multiple of 8, got 12");
  // Larger counts are carried as rows: the message promises no upper bound, and none applies.
  expect_error_naming(
      [&] { allreduce(team_[0], buffers_.input, buffers_.norm_out, 20004, DType::kBFloat16); },
      "count must be a positive multiple of 8, got 20004");
  expect_error_naming(
      [&] { allreduce(team_[0], buffers_.input, buffers_.norm_out, 0, DType::kBFloat16); },
      "count must be a positive multiple of 8, got 0");
  expect_error_naming(
      [&] { allreduce(team_[0], nullptr, buffers_.norm_out, 16, DType::kBFloat16); },
      "input is null");
  expect_error_naming([&] { allreduce(team_[0], buffers_.input, nullptr, 16, DType::kBFloat16); },
                      "out is null");
}

TEST_F(Arguments, LocalAddRmsNormNeedsResidual) {
  AddRmsNormArgs args = args_;
  args.residual = nullptr;
  expect_error_naming([&] { add_rmsnorm(Backend::kCpu, args); }, "residual is null");
}

TEST(TeamCreation, RejectsBadWorldSizesAndOptions) {
  expect_error_naming([] { create_cpu_team(0); }, "world_size must be in [1, 16]");
  expect_error_naming([] { create_cpu_team(17); }, "world_size must be in [1, 16], got 17");
  TeamOptions options;
  options.packet_bytes = 100;
  expect_error_naming([&] { create_cpu_team(2, options); }, "options.packet_bytes");
  options = {};
  options.peer_timeout_seconds = -1;
  expect_error_naming([&] { create_cpu_team(2, options); }, "options.peer_timeout_seconds");
  if (!cuda_available()) {
    expect_error_naming([] { create_cuda_team({0, 1}); }, "has no CUDA backend");
    return;
  }
  if (cuda_device_count() == 0) {
    expect_error_naming([] { create_cuda_team({0, 1}); }, "devices[0] = 0");
  }
  expect_error_naming([] { create_cuda_team({}); }, "devices must name 1 to 16 GPUs");
  expect_error_naming([] { create_nccl_team(nullptr); },
                      nccl_available() ? "comm is null" : "has no NCCL");
}

}  // namespace
}  // namespace tpfuse
