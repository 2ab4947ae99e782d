// Every bad argument is rejected before any work, with a message that names it.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "tpfuse/cuda.h"
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

// A world-2 team: rank 0 makes the bad call while rank 1 makes a good one on its own thread. A
// rejected call still takes its turn (without data), so rank 1's call ends at once with an error
// naming rank 0, and the team goes on: the next good call on both ranks succeeds.
class Arguments : public ::testing::Test {
 protected:
  void SetUp() override {
    TeamOptions options;
    options.packet_bytes = 256;  // two tokens of 64 bf16
    options.peer_timeout_seconds = 5.0;
    team_ = create_cpu_team(2, options);
    args_ = args_for(buffers_);
    peer_args_ = args_for(peer_buffers_);
  }
  static AddRmsNormArgs args_for(Buffers& b) {
    AddRmsNormArgs args;
    args.input = b.input;
    args.residual = b.residual;
    args.gamma = b.gamma;
    args.residual_out = b.residual_out;
    args.norm_out = b.norm_out;
    args.tokens = 2;
    args.hidden = 64;
    args.dtype = DType::kBFloat16;
    return args;
  }
  // Runs `call` on rank 0 while rank 1 makes a good call; returns rank 1's error ("" if none).
  std::string against_good_peer(const std::function<void()>& call) {
    return against_peer(peer_args_, call);
  }
  // Runs `call` on rank 0 while rank 1 calls with `peer`; returns rank 1's error ("" if none).
  std::string against_peer(const AddRmsNormArgs& peer, const std::function<void()>& call) {
    std::string peer_error;
    std::thread peer_thread([&] {
      try {
        allreduce_add_rmsnorm(team_[1], peer);
      } catch (const Error& error) {
        peer_error = error.what();
      }
    });
    call();
    peer_thread.join();
    return peer_error;
  }
  // Both ranks make a good call: the team went on.
  void expect_team_goes_on() {
    std::thread peer([&] { EXPECT_NO_THROW(allreduce_add_rmsnorm(team_[1], peer_args_)); });
    EXPECT_NO_THROW(allreduce_add_rmsnorm(team_[0], args_));
    peer.join();
  }
  void expect_rejected(const std::function<void(AddRmsNormArgs&)>& mutate,
                       const std::string& name) {
    AddRmsNormArgs args = args_;
    mutate(args);
    const std::string peer_error = against_good_peer(
        [&] { expect_error_naming([&] { allreduce_add_rmsnorm(team_[0], args); }, name); });
    EXPECT_NE(peer_error.find("rank 1: rank 0 rejected its part of this call"), std::string::npos)
        << "rank 1 got: " << peer_error;
    expect_team_goes_on();
  }

  Buffers buffers_{};
  Buffers peer_buffers_{};
  std::vector<Team> team_;
  AddRmsNormArgs args_;
  AddRmsNormArgs peer_args_;
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

TEST_F(Arguments, Fp8OutputArgumentsAreChecked) {
  alignas(16) static uint8_t quant[2 * 128 + 16];
  alignas(16) static float scales[8];
  static const float scale = 0.5f;
  const auto with = [&](QuantMode mode) {
    return [&, mode](AddRmsNormArgs& a) {
      a.quant = mode;
      a.quant_out = quant;
      if (mode == QuantMode::kStatic) {
        a.quant_scale = &scale;
      } else {
        a.scales_out = scales;
      }
    };
  };
  const auto then = [](auto first, auto second) {
    return [=](AddRmsNormArgs& a) {
      first(a);
      second(a);
    };
  };
  expect_rejected([](auto& a) { a.quant = QuantMode(7); }, "quant 7 is not a QuantMode");
  expect_rejected([](auto& a) { a.quant_out = quant; },
                  "quant_out, quant_scale or scales_out given but quant is none");
  expect_rejected(then(with(QuantMode::kStatic), [](auto& a) { a.quant_out = nullptr; }),
                  "quant_out is null but quant is fp8 static");
  expect_rejected(then(with(QuantMode::kStatic), [](auto& a) { a.quant_out = quant + 4; }),
                  "quant_out must be 16-byte aligned");
  expect_rejected(then(with(QuantMode::kStatic), [](auto& a) { a.quant_scale = nullptr; }),
                  "quant_scale is null: quant fp8 static needs the scale");
  expect_rejected(then(with(QuantMode::kStatic), [](auto& a) { a.scales_out = scales; }),
                  "scales_out is given but quant fp8 static computes no scales");
  expect_rejected(then(with(QuantMode::kPerToken), [](auto& a) { a.scales_out = nullptr; }),
                  "scales_out is null: quant fp8 per token writes its scales there");
  expect_rejected(then(with(QuantMode::kPerToken), [](auto& a) { a.quant_scale = &scale; }),
                  "quant_scale is given but quant is fp8 per token");
  expect_rejected(with(QuantMode::kPerTokenGroup128),
                  "hidden must be a multiple of 128 for quant fp8 per token group of 128, got 64");
  expect_rejected(with(QuantMode::kPerTokenGroup128Ue8m0),
                  "hidden must be a multiple of 128 for quant fp8 per token group of 128 with "
                  "power-of-two scales, got 64");
  expect_rejected(
      then(with(QuantMode::kPerTokenGroup128Ue8m0), [](auto& a) { a.scales_out = nullptr; }),
      "scales_out is null: quant fp8 per token group of 128 with power-of-two scales writes its "
      "scales there");
  expect_rejected([](auto& a) { a.quant = QuantMode(5); }, "quant 5 is not a QuantMode");
  expect_rejected(
      then(with(QuantMode::kPerToken), [this](auto& a) { a.quant_out = buffers_.norm_out; }),
      "quant_out overlaps norm_out");
  expect_rejected(
      then(with(QuantMode::kPerToken),
           [this](auto& a) { a.scales_out = reinterpret_cast<float*>(buffers_.gamma); }),
      "scales_out overlaps gamma");
  expect_rejected(then(with(QuantMode::kPerToken),
                       [](auto& a) { a.scales_out = reinterpret_cast<float*>(quant + 64); }),
                  "scales_out overlaps quant_out");
  expect_rejected(
      then(with(QuantMode::kStatic),
           [this](auto& a) { a.quant_scale = reinterpret_cast<const float*>(buffers_.norm_out); }),
      "norm_out overlaps quant_scale");
  expect_rejected(then(with(QuantMode::kPerToken),
                       [](auto& a) { a.scales_out = reinterpret_cast<float*>(quant + 258); }),
                  "scales_out must be 4-byte aligned");
  expect_rejected(then(with(QuantMode::kPerToken), [](auto& a) { a.scales_column_major = true; }),
                  "scales_column_major is a layout of quant fp8 per token group of 128's scales");
  // Ranks whose FP8 outputs differ in mode: both are told, naming the field.
  AddRmsNormArgs args = args_;
  with(QuantMode::kPerToken)(args);
  std::string peer_error;
  std::thread peer([&] {
    try {
      allreduce_add_rmsnorm(team_[1], peer_args_);
    } catch (const Error& error) {
      peer_error = error.what();
    }
  });
  expect_error_naming([&] { allreduce_add_rmsnorm(team_[0], args); },
                      "in quant: fp8 per token here, none on rank 1");
  peer.join();
  EXPECT_NE(peer_error.find("in quant: none here, fp8 per token on rank 0"), std::string::npos)
      << peer_error;
}

// Ranks whose FP8 outputs differ only in the group scale's rule: both are told, the two modes
// named (the signature's quant field, decoded by its table).
TEST_F(Arguments, RanksWhoseGroupScalesDifferInRuleAreTold) {
  struct Fp8Buffers {
    alignas(16) uint8_t quant[128];
    float scales[1];
  };
  Fp8Buffers mine, theirs;
  const auto group_call = [](AddRmsNormArgs args, QuantMode mode, Fp8Buffers& out) {
    args.tokens = 1;
    args.hidden = 128;
    args.quant = mode;
    args.quant_out = out.quant;
    args.scales_out = out.scales;
    return args;
  };
  const AddRmsNormArgs args = group_call(args_, QuantMode::kPerTokenGroup128, mine);
  const AddRmsNormArgs peer = group_call(peer_args_, QuantMode::kPerTokenGroup128Ue8m0, theirs);
  const std::string peer_error = against_peer(peer, [&] {
    expect_error_naming([&] { allreduce_add_rmsnorm(team_[0], args); },
                        "in quant: fp8 per token group of 128 here, fp8 per token group of 128 "
                        "with power-of-two scales on rank 1");
  });
  EXPECT_NE(peer_error.find("in quant: fp8 per token group of 128 with power-of-two scales here, "
                            "fp8 per token group of 128 on rank 0"),
            std::string::npos)
      << peer_error;
}

TEST_F(Arguments, MoeFinalizeArgumentsAreChecked) {
  // Two tokens of 64 bf16, top-2: the expert rows, the weights, a shared row.
  alignas(16) static uint16_t rows[2 * 2 * 64 + 8];
  alignas(16) static float weights[2 * 2 + 4];
  alignas(16) static uint16_t shared[2 * 64 + 8];
  const auto moe = [](AddRmsNormArgs& a) {
    a.input = nullptr;
    a.moe_expert_rows = rows;
    a.moe_weights = weights;
    a.moe_shared = shared;
    a.moe_topk = 2;
  };
  const auto then = [&](auto second) {
    return [=](AddRmsNormArgs& a) {
      moe(a);
      second(a);
    };
  };
  expect_rejected([](auto& a) { a.moe_weights = weights; },
                  "moe_weights or moe_shared given but moe_expert_rows is null");
  expect_rejected([](auto& a) { a.moe_topk = 2; },
                  "moe_topk or moe_weights_in_dtype set but moe_expert_rows is null");
  expect_rejected(then([this](auto& a) { a.input = buffers_.input; }),
                  "input must be null with moe_expert_rows");
  expect_rejected(then([](auto& a) { a.moe_topk = 0; }), "moe_topk must be in [1, 16], got 0");
  expect_rejected(then([](auto& a) { a.moe_topk = 17; }), "moe_topk must be in [1, 16], got 17");
  expect_rejected(then([](auto& a) { a.moe_weights = nullptr; }), "moe_weights is null");
  expect_rejected(then([](auto& a) { a.residual = nullptr; }), "the MoE finalize needs a residual");
  expect_rejected(then([](auto& a) { a.norm_weight = NormWeight::kOnePlusGamma; }),
                  "the MoE finalize is built for norm_weight gamma");
  expect_rejected(then([](auto& a) { a.moe_expert_rows = rows + 1; }),
                  "moe_expert_rows must be 16-byte aligned");
  expect_rejected(then([](auto& a) { a.moe_shared = shared + 4; }),
                  "moe_shared must be 16-byte aligned");
  expect_rejected(then([](auto& a) { a.moe_weights = reinterpret_cast<const char*>(weights) + 2; }),
                  "moe_weights must be 4-byte aligned");
  expect_rejected(then([this](auto& a) {
                    a.moe_expert_rows = buffers_.norm_out;  // [2, 2, 64] over norm_out's rows
                  }),
                  "norm_out overlaps moe_expert_rows");
  expect_rejected(then([this](auto& a) { a.moe_shared = buffers_.residual_out; }),
                  "residual_out overlaps moe_shared");
  // A good MoE call on rank 0 against a peer's plain call: both are told, naming the input.
  AddRmsNormArgs args = args_;
  moe(args);
  std::string peer_error = against_good_peer([&] {
    expect_error_naming(
        [&] {
          allreduce_add_rmsnorm(team_[0], args);
          team_[0].check();
        },
        "the input: a MoE combine here, input on rank 1");
  });
  EXPECT_NE(peer_error.find("the input: input here, a MoE combine on rank 0"), std::string::npos)
      << peer_error;
}

// The CPU backend's NCCL path exchanges its sums through the session too: a fused call against
// it is told that the algorithm differs (not the first epilogue field that happens to).
TEST_F(Arguments, AFusedCallAgainstThePeersNcclPathNamesTheAlgorithm) {
  AddRmsNormArgs args = args_;
  args.algorithm = Algorithm::kOneShot;
  AddRmsNormArgs peer_args = peer_args_;
  peer_args.algorithm = Algorithm::kNccl;
  std::string peer_error;
  std::thread peer([&] {
    try {
      allreduce_add_rmsnorm(team_[1], peer_args);
    } catch (const Error& error) {
      peer_error = error.what();
    }
  });
  expect_error_naming([&] { allreduce_add_rmsnorm(team_[0], args); },
                      "in the op / algorithm: one-shot all-reduce (+ add + RMSNorm) here, the "
                      "NCCL path on rank 1");
  peer.join();
  EXPECT_NE(peer_error.find("in the op / algorithm: the NCCL path here, one-shot all-reduce (+ add "
                            "+ RMSNorm) on rank 0"),
            std::string::npos)
      << peer_error;
}

TEST_F(Arguments, EmptyBatchesTakeTheirTurnAndMustAgree) {
  AddRmsNormArgs args = args_;
  args.tokens = 0;
  // An empty batch's row tensors may be null (what an empty torch tensor's data pointer is).
  args.input = nullptr;
  args.residual = nullptr;
  args.residual_out = nullptr;
  args.norm_out = nullptr;
  AddRmsNormArgs peer_args = args;
  std::thread peer([&] { EXPECT_NO_THROW(allreduce_add_rmsnorm(team_[1], peer_args)); });
  EXPECT_NO_THROW(allreduce_add_rmsnorm(team_[0], args));
  peer.join();
  expect_team_goes_on();
  // A rank with no tokens while its peer has some: both are told, naming the field.
  std::string peer_error;
  std::thread disagreeing([&] {
    try {
      allreduce_add_rmsnorm(team_[1], peer_args_);
    } catch (const Error& error) {
      peer_error = error.what();
    }
  });
  expect_error_naming([&] { allreduce_add_rmsnorm(team_[0], args); },
                      "rank 1's call disagrees with this rank's, in tokens: 0 here, 2 on rank 1");
  disagreeing.join();
  EXPECT_NE(peer_error.find("rank 0's call disagrees with this rank's, in tokens: 2 here, 0 on"),
            std::string::npos)
      << peer_error;
}

TEST_F(Arguments, MessagesNameRepositoryPathsNotTheBuildMachines) {
  AddRmsNormArgs args = args_;
  args.input = nullptr;
  against_good_peer([&] {
    try {
      allreduce_add_rmsnorm(team_[0], args);
      ADD_FAILURE() << "accepted a null input";
    } catch (const Error& error) {
      const std::string message = error.what();
      EXPECT_NE(message.find("(src/core/validate.cc:"), std::string::npos) << message;
      EXPECT_EQ(message.find("(/"), std::string::npos) << message;
    }
  });
}

TEST_F(Arguments, EmptyTeamHandleAndStreamOnCpu) {
  expect_error_naming([&] { allreduce_add_rmsnorm(Team{}, args_); }, "team is an empty handle");
  expect_error_naming([&] { Team{}.rank(); }, "empty");
  const std::string peer_error = against_good_peer([&] {
    expect_error_naming(
        [&] { allreduce_add_rmsnorm(team_[0], args_, Stream{reinterpret_cast<void*>(0x10)}); },
        "stream must be null for a CPU-backend team");
  });
  EXPECT_NE(peer_error.find("rank 0 rejected"), std::string::npos) << peer_error;
  expect_team_goes_on();
}

TEST_F(Arguments, AllreduceRejectsBadCounts) {
  const auto expect_count_rejected = [&](const std::function<void()>& call,
                                         const std::string& name) {
    const std::string peer_error = against_good_peer([&] { expect_error_naming(call, name); });
    EXPECT_NE(peer_error.find("rank 0 rejected"), std::string::npos) << peer_error;
  };
  expect_count_rejected(
      [&] { allreduce(team_[0], buffers_.input, buffers_.norm_out, 12, DType::kBFloat16); },
      "count must be a positive multiple of 8, got 12");
  // Larger counts are carried as rows: the message promises no upper bound, and none applies.
  expect_count_rejected(
      [&] { allreduce(team_[0], buffers_.input, buffers_.norm_out, 20004, DType::kBFloat16); },
      "count must be a positive multiple of 8, got 20004");
  expect_count_rejected(
      [&] { allreduce(team_[0], buffers_.input, buffers_.norm_out, 0, DType::kBFloat16); },
      "count must be a positive multiple of 8, got 0");
  expect_count_rejected(
      [&] { allreduce(team_[0], nullptr, buffers_.norm_out, 16, DType::kBFloat16); },
      "input is null");
  expect_count_rejected([&] { allreduce(team_[0], buffers_.input, nullptr, 16, DType::kBFloat16); },
                        "out is null");
  expect_team_goes_on();
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

// A build without the SYCL runtime says so from every SYCL entry point (src/sycl/not_built.cc);
// one with it checks the world size before it looks for a device.
TEST(TeamCreation, SyclTeamsWithoutTheBackendOrWithBadWorldSizes) {
  if (!sycl_available()) {
    expect_error_naming([] { create_sycl_team(2); }, "has no SYCL backend");
    return;
  }
  expect_error_naming([] { create_sycl_team(0); }, "world_size must be in [1, 16], got 0");
}

}  // namespace
}  // namespace tpfuse
