// The one-shot kernel on real GPUs (in-process team over every visible GPU, at least 2): the
// same properties as the CPU backend, plus CUDA-graph capture and replay, back-to-back calls
// under programmatic dependent launch, a missing peer, and wrong-device arguments.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "core/calls.h"
#include "cuda/kernels.h"
#include "cuda_harness.h"
#include "misuse_properties.h"
#include "oneshot_properties.h"
#include "qknorm_properties.h"

#define EXPECT_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call

namespace tpfuse::testing {
namespace {

int gpus() {
  return std::min(cuda_device_count(), 8);
}

using GpuOneShot = MultiGpuTest;

TEST_F(GpuOneShot, MatchesFloat64ReferenceOnRandomCases) {
  CudaHarness harness(gpus());
  check_random_cases(harness, 11, 150, 300);
}

TEST_F(GpuOneShot, RepeatedCallsGiveIdenticalBits) {
  CudaHarness harness(gpus());
  check_repeatable(harness, 12);
}

TEST_F(GpuOneShot, AdversarialPayloads) {
  CudaHarness harness(gpus());
  check_adversarial(harness, 13);
}

TEST_F(GpuOneShot, BackToBackCallsUnderPdlWithAlternatingScales) {
  CudaHarness harness(gpus());
  check_consecutive_calls(harness, 14, 3000, 32, 1024);
}

TEST_F(GpuOneShot, BackToBackOneShotOnly) {
  CudaHarness harness(gpus());
  harness.algorithm = Algorithm::kOneShot;
  check_consecutive_calls(harness, 24, 1000, 32, 1024);
}

TEST_F(GpuOneShot, BackToBackTwoShotOnly) {
  CudaHarness harness(gpus());
  harness.algorithm = Algorithm::kTwoShot;
  check_consecutive_calls(harness, 25, 1000, 32, 1024);
}

TEST_F(GpuOneShot, WorldSizesBelowAllGpus) {
  for (int world = 2; world < gpus(); ++world) {
    CudaHarness harness(world);
    check_random_cases(harness, 15 + world, 20, 64);
  }
}

TEST_F(GpuOneShot, LargestMessageTheWorkspaceHolds) {
  CudaHarness harness(gpus());
  std::mt19937_64 rng(16);
  OneShotRunner runner(harness);
  CaseSpec spec;
  spec.tokens = harness.team()[0].max_tokens(3072, DType::kBFloat16);
  const CaseData data = random_case(rng, spec, harness.world_size());
  expect_correct(spec, data, runner.run(spec, data));
  spec.tokens += 1;
  spec.algorithm = Algorithm::kOneShot;
  EXPECT_THROW(runner.run(spec, random_case(rng, spec, harness.world_size())), Error);
  // Not forced: another algorithm carries it.
  spec.algorithm = Algorithm::kAuto;
  const CaseData over = random_case(rng, spec, harness.world_size());
  const CaseResult result = runner.run(spec, over);
  EXPECT_NE(result.algorithm, Algorithm::kOneShot);
  expect_correct(spec, over, result);
}

// Two-shot and the NCCL path, forced: the same properties as one-shot.
class GpuAlgorithms : public MultiGpuTest, public ::testing::WithParamInterface<Algorithm> {};

TEST_P(GpuAlgorithms, MatchesFloat64ReferenceOnRandomCases) {
  CudaHarness harness(gpus());
  harness.algorithm = GetParam();
  check_random_cases(harness, 40 + int(GetParam()), 80, 1024);
}

TEST_P(GpuAlgorithms, RepeatedCallsGiveIdenticalBits) {
  CudaHarness harness(gpus());
  harness.algorithm = GetParam();
  check_repeatable(harness, 50 + int(GetParam()));
}

TEST_P(GpuAlgorithms, OnePlusGammaWeight) {
  CudaHarness harness(gpus());
  harness.algorithm = GetParam();
  check_one_plus_gamma(harness, 65 + int(GetParam()), 30, 512);
}

TEST_P(GpuAlgorithms, Fp8OutputsMatchTheirDefinition) {
  CudaHarness harness(gpus());
  harness.algorithm = GetParam();
  check_fp8_outputs(harness, 68 + int(GetParam()), 30);
}

TEST_P(GpuAlgorithms, Fp8PowerOfTwoScalesAtTheirEdges) {
  CudaHarness harness(gpus());
  harness.algorithm = GetParam();
  check_fp8_power_of_two_scales(harness, 70 + int(GetParam()));
}

TEST_P(GpuAlgorithms, MoeFinalizeMatchesItsDefinition) {
  CudaHarness harness(gpus());
  harness.algorithm = GetParam();
  check_moe_finalize(harness, 69 + int(GetParam()), 16);
}

// The FP8 outputs and the MoE finalize captured in CUDA graphs and replayed on fresh inputs.
TEST_P(GpuAlgorithms, Fp8AndMoeCallsReplayedFromCudaGraphs) {
  CudaHarness harness(gpus());
  harness.algorithm = GetParam();
  check_graph_replays(harness, 72 + int(GetParam()));
}

TEST_P(GpuAlgorithms, AdversarialPayloads) {
  CudaHarness harness(gpus());
  harness.algorithm = GetParam();
  check_adversarial(harness, 60 + int(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Forced, GpuAlgorithms,
                         ::testing::Values(Algorithm::kTwoShot, Algorithm::kNccl),
                         [](const auto& info) { return algorithm_name(info.param); });

TEST_F(GpuOneShot, OnePlusGammaWeight) {
  CudaHarness harness(gpus());
  check_one_plus_gamma(harness, 71, 30, 512);
}

TEST_F(GpuOneShot, TwoShotGivesOneShotBitsWhateverTheBatch) {
  CudaHarness harness(gpus());
  check_batch_invariance(harness, 70);
}

TEST_F(GpuOneShot, CreationHandshakeProvesPeerStores) {
  CudaHarness harness(gpus());
  for (const Team& team : harness.team()) {
    EXPECT_EQ(team.fallback_reason(), "");
    EXPECT_EQ(team.peer_memory(), "cuda peer access");
  }
}

// A peer whose stores never arrive (simulated: rank 1 skips its handshake store into rank 0):
// the team says why and runs every op through NCCL, correctly, instead of hanging.
TEST_F(GpuOneShot, FailedHandshakeFallsBackToNccl) {
  TeamOptions options;
  options.handshake_timeout_seconds = 0.5;
  setenv("TPFUSE_TEST_HANDSHAKE_DROP", "1>0", 1);
  std::unique_ptr<CudaHarness> harness;
  try {
    harness = std::make_unique<CudaHarness>(gpus(), options);
  } catch (...) {
    unsetenv("TPFUSE_TEST_HANDSHAKE_DROP");
    throw;
  }
  unsetenv("TPFUSE_TEST_HANDSHAKE_DROP");
  for (const Team& team : harness->team()) {
    EXPECT_NE(team.fallback_reason().find("rank 0 did not see rank 1's store"), std::string::npos)
        << team.fallback_reason();
    EXPECT_EQ(team.choose(1, 3072, DType::kBFloat16), Algorithm::kNccl);
  }
  check_random_cases(*harness, 80, 10, 64);
}

TEST_F(GpuOneShot, TeamWithoutPeerStoresUsesNccl) {
  TeamOptions options;
  options.peer_stores = false;
  CudaHarness harness(gpus(), options);
  EXPECT_EQ(harness.team()[0].peer_memory(), "none");
  EXPECT_THROW(harness.team()[0].choose(1, 3072, DType::kBFloat16, Algorithm::kOneShot), Error);
  check_random_cases(harness, 81, 10, 64);
}

// Each rank captures two back-to-back calls into a CUDA graph (different sizes and buffers);
// the graphs are replayed 10,000 times on fresh inputs, every replay checked.
TEST_F(GpuOneShot, CudaGraphReplaysOnFreshInputs) {
  const int world = gpus();
  CudaHarness harness(world);
  std::mt19937_64 rng(17);
  CaseSpec first, second;
  first.tokens = 4;
  second.tokens = 1;
  second.residual = false;
  const size_t bytes_first = size_t(first.tokens * first.hidden) * 2;
  const size_t bytes_second = size_t(second.tokens * second.hidden) * 2;
  struct RankBuffers {
    void *input1, *residual1, *gamma, *residual_out1, *norm_out1, *input2, *norm_out2;
  };
  std::vector<RankBuffers> buffers(world);
  CaseData data1 = random_case(rng, first, world);
  for (int r = 0; r < world; ++r) {
    RankBuffers& b = buffers[r];
    b.input1 = harness.allocate(r, bytes_first);
    b.residual1 = harness.allocate(r, bytes_first);
    b.residual_out1 = harness.allocate(r, bytes_first);
    b.norm_out1 = harness.allocate(r, bytes_first);
    b.gamma = harness.allocate(r, 3072 * 2);
    b.input2 = harness.allocate(r, bytes_second);
    b.norm_out2 = harness.allocate(r, bytes_second);
    harness.upload(r, b.gamma, data1.gamma.data(), 3072 * 2);
  }
  std::vector<cudaGraphExec_t> graphs(world);
  for (int r = 0; r < world; ++r) {
    EXPECT_CUDA(cudaSetDevice(r));
    cudaStream_t stream = harness.stream(r);
    const RankBuffers& b = buffers[r];
    EXPECT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    AddRmsNormArgs args;
    args.input = b.input1;
    args.residual = b.residual1;
    args.gamma = b.gamma;
    args.residual_out = b.residual_out1;
    args.norm_out = b.norm_out1;
    args.tokens = first.tokens;
    args.hidden = first.hidden;
    allreduce_add_rmsnorm(harness.team()[r], args, stream);
    AddRmsNormArgs args2;
    args2.input = b.input2;
    args2.gamma = b.gamma;
    args2.norm_out = b.norm_out2;
    args2.tokens = second.tokens;
    args2.hidden = second.hidden;
    allreduce_add_rmsnorm(harness.team()[r], args2, stream);
    cudaGraph_t graph;
    EXPECT_CUDA(cudaStreamEndCapture(stream, &graph));
    EXPECT_CUDA(cudaGraphInstantiate(&graphs[r], graph, 0));
    EXPECT_CUDA(cudaGraphDestroy(graph));
  }
  const int replays = 10000;
  for (int replay = 0; replay < replays; ++replay) {
    const double scale = replay % 2 ? 1000.0 : 0.001;
    CaseData d1 = random_case(rng, first, world, scale);
    d1.gamma = data1.gamma;
    CaseData d2 = random_case(rng, second, world, 1.0 / scale);
    d2.gamma = data1.gamma;
    const HostTensor poison1 = poisoned(first.dtype, size_t(first.tokens * first.hidden));
    const HostTensor poison2 = poisoned(second.dtype, size_t(second.hidden));
    for (int r = 0; r < world; ++r) {
      const RankBuffers& b = buffers[r];
      harness.upload(r, b.input1, d1.inputs[r].data(), bytes_first);
      harness.upload(r, b.residual1, d1.residuals[r].data(), bytes_first);
      harness.upload(r, b.input2, d2.inputs[r].data(), bytes_second);
      harness.upload(r, b.norm_out1, poison1.data(), bytes_first);
      harness.upload(r, b.residual_out1, poison1.data(), bytes_first);
      harness.upload(r, b.norm_out2, poison2.data(), bytes_second);
    }
    for (int r = 0; r < world; ++r) {
      EXPECT_CUDA(cudaSetDevice(r));
      EXPECT_CUDA(cudaGraphLaunch(graphs[r], harness.stream(r)));
    }
    harness.synchronize();
    CaseResult result1, result2;
    for (int r = 0; r < world; ++r) {
      const RankBuffers& b = buffers[r];
      HostTensor norm1(first.dtype, bytes_first / 2), residual1(first.dtype, bytes_first / 2);
      HostTensor norm2(second.dtype, bytes_second / 2);
      harness.download(r, norm1.data(), b.norm_out1, bytes_first);
      harness.download(r, residual1.data(), b.residual_out1, bytes_first);
      harness.download(r, norm2.data(), b.norm_out2, bytes_second);
      result1.norm_out.push_back(norm1);
      result1.residual_out.push_back(residual1);
      result2.norm_out.push_back(norm2);
      result2.residual_out.push_back(HostTensor(second.dtype, bytes_second / 2));
    }
    second.residual_out = false;
    SCOPED_TRACE("replay " + std::to_string(replay));
    expect_correct(first, d1, result1);
    expect_correct(second, d2, result2);
    if (HasFailure()) break;
  }
  for (int r = 0; r < world; ++r) {
    cudaSetDevice(r);
    cudaGraphExecDestroy(graphs[r]);
  }
}

TEST_F(GpuOneShot, MissingPeerIsReportedNotWaitedFor) {
  TeamOptions options;
  options.peer_timeout_seconds = 0.5;
  CudaHarness harness(2, options);
  void* input = harness.allocate(0, 4096);
  void* out = harness.allocate(0, 4096);
  const auto start = std::chrono::steady_clock::now();
  allreduce(harness.team()[0], input, out, 1024, DType::kBFloat16, harness.stream(0));
  try {
    harness.team()[0].check();
    FAIL() << "rank 0 finished although rank 1 never called";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("rank 1"), std::string::npos) << error.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_THROW(allreduce(harness.team()[0], input, out, 1024, DType::kBFloat16, harness.stream(0)),
               Error);
}

// Rejected and disagreeing calls at random on every path, NCCL's included (its call headers,
// src/cuda/nccl_headers.cu: a rejected call's turn, NaN outputs, the mismatch told), and the
// next call correct.
TEST_F(GpuOneShot, MisuseOnEveryPathReportedAndTheNextCallCorrect) {
  TeamOptions options;
  options.peer_timeout_seconds = 5.0;
  std::vector<int> devices(static_cast<size_t>(gpus()));
  for (int r = 0; r < gpus(); ++r) devices[size_t(r)] = r;
  CudaHarness harness(gpus(), options);
  const MisuseCounts counts =
      check_misuse(harness, 1020, 300, 8, [&] { return create_cuda_team(devices, options); });
  EXPECT_GT(counts.rejected, 10);
  EXPECT_GT(counts.disagreeing, 10);
  std::printf("%d GPUs: %d good, %d rejected, %d disagreeing calls\n", gpus(), counts.good,
              counts.rejected, counts.disagreeing);
}

TEST_F(GpuOneShot, WrongDeviceArgumentsAreRejected) {
  CudaHarness harness(2);
  void* on_device0 = harness.allocate(0, 4096);
  void* on_device1 = harness.allocate(1, 4096);
  std::vector<uint16_t> host(2048);
  try {
    allreduce(harness.team()[0], on_device1, on_device0, 1024, DType::kBFloat16, harness.stream(0));
    FAIL() << "memory of device 1 accepted by rank 0";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("input must be device memory on device 0"),
              std::string::npos)
        << error.what();
  }
  EXPECT_THROW(allreduce(harness.team()[0], host.data(), on_device0, 1024, DType::kBFloat16,
                         harness.stream(0)),
               Error);
  try {
    allreduce(harness.team()[0], on_device0, on_device0, 1024, DType::kBFloat16, harness.stream(1));
    FAIL() << "a stream of device 1 accepted by rank 0";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("stream belongs to device 1"), std::string::npos)
        << error.what();
  }
}

TEST(GpuOneRankTeam, EveryAlgorithmGivesTheLocalEpiloguesBits) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  CudaHarness harness(1);
  check_one_rank_team_is_local(harness, 6200);
}

// The local kernel's FP8 outputs (a one-rank team runs it).
TEST(GpuOneRankTeam, Fp8OutputsMatchTheirDefinition) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  CudaHarness harness(1);
  check_fp8_outputs(harness, 6300, 30);
}

// The local kernel's power-of-two group scales at their edges.
TEST(GpuOneRankTeam, Fp8PowerOfTwoScalesAtTheirEdges) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  CudaHarness harness(1);
  check_fp8_power_of_two_scales(harness, 6330);
}

// The local kernel's MoE combine (a one-rank team runs it).
TEST(GpuOneRankTeam, MoeFinalizeMatchesItsDefinition) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  CudaHarness harness(1);
  check_moe_finalize(harness, 6350, 16);
}

// The local kernel's FP8 outputs and MoE combine captured in a CUDA graph and replayed.
TEST(GpuOneRankTeam, Fp8AndMoeCallsReplayedFromCudaGraphs) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  CudaHarness harness(1);
  check_graph_replays(harness, 6370);
}

// A one-rank team runs the fused QK kernel (its exchange with itself only): with more tokens
// than resident blocks, its many-token form.
TEST(GpuOneRankTeam, QkNormManyTokens) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  CudaHarness harness(1);
  check_qk_many_tokens(harness, 6400);
}

// The many-token QK kernel with a position outside the cos/sin cache: that token's outputs are
// NaN, Team::check names it, and every other token has the bits of a call without the bad
// position. MiniMax-M2's width on one rank (two vectors a thread) and its TP-2 slice (one), the
// cache 16-byte aligned and not; the bad token in a block's first group and in a later one (whose
// cos/sin rows the block copied while it finished the group before).
TEST(GpuOneRankTeam, QkNormManyTokensBadPosition) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  CudaHarness harness(1);
  std::mt19937_64 rng(6410);
  for (const int64_t heads : {48, 24}) {
    for (const int64_t cache_offset : {0, 1}) {
      QkSpec s;
      s.heads = heads;
      s.kv_heads = heads / 6;
      s.rope = RopeStyle::kNeox;
      s.tokens = 1500;
      s.cache_offset = cache_offset;
      QkData d = random_qk_data(rng, s, 1);
      const QkResult good = run_qk(harness, s, d);
      for (const int64_t bad_token : {700, 1300}) {
        SCOPED_TRACE(describe(s) + " bad token " + std::to_string(bad_token));
        QkData bad_data = d;
        bad_data.positions[bad_token] = d.max_position + 3;
        // The harness checks the team after the call: the report comes from there.
        const std::vector<QkBuffers> b = upload_qk(harness, s, bad_data);
        const std::string expected = "positions[" + std::to_string(bad_token) +
                                     "] = " + std::to_string(d.max_position + 3) + " is outside";
        try {
          harness.run([&](int rank, Stream stream) {
            allreduce_qk_rmsnorm(harness.team()[rank], qk_args(s, b[rank], d.max_position, 1),
                                 stream);
          });
          harness.team()[0].check();
          ADD_FAILURE() << "the bad position was not reported";
        } catch (const Error& error) {
          EXPECT_NE(std::string(error.what()).find(expected), std::string::npos) << error.what();
        }
        EXPECT_NO_THROW(harness.team()[0].check()) << "reported once";
        const QkResult bad = download_qk(harness, s, bad_data, b);
        const auto expect_rows = [&](const HostTensor& got, const HostTensor& want, int64_t width,
                                     const char* what) {
          const size_t row_bytes = size_t(width) * dtype_size(s.dtype);
          for (int64_t t = 0; t < s.tokens; ++t) {
            if (t == bad_token) {
              for (int64_t e = 0; e < width; ++e) {
                ASSERT_TRUE(std::isnan(got.get(size_t(t * width + e))))
                    << what << " token " << t << " element " << e;
              }
            } else {
              ASSERT_EQ(std::memcmp(got.bytes.data() + t * row_bytes,
                                    want.bytes.data() + t * row_bytes, row_bytes),
                        0)
                  << what << " token " << t;
            }
          }
        };
        expect_rows(bad.q[0], good.q[0], s.q_size(), "q");
        expect_rows(bad.k[0], good.k[0], s.kv_size(), "k");
      }
    }
  }
}

TEST(GpuLocalAddRmsNorm, MatchesFloat64Reference) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  CudaHarness harness(1);
  std::mt19937_64 rng(18);
  for (DType dtype : kDTypes) {
    for (int64_t hidden : {8, 136, 3072, 7168, 16384}) {
      for (int64_t tokens : {1, 5, 300}) {
        CaseSpec spec;
        spec.dtype = dtype;
        spec.hidden = hidden;
        spec.tokens = tokens;
        spec.norm_weight = tokens == 5 ? NormWeight::kOnePlusGamma : NormWeight::kGamma;
        const CaseData data = random_case(rng, spec, 1);
        const size_t bytes = size_t(tokens * hidden) * dtype_size(dtype);
        void* input = harness.allocate(0, bytes);
        void* residual = harness.allocate(0, bytes);
        void* gamma = harness.allocate(0, size_t(hidden) * dtype_size(dtype));
        void* residual_out = harness.allocate(0, bytes);
        void* norm_out = harness.allocate(0, bytes);
        harness.upload(0, input, data.inputs[0].data(), bytes);
        harness.upload(0, residual, data.residuals[0].data(), bytes);
        harness.upload(0, gamma, data.gamma.data(), data.gamma.bytes.size());
        const HostTensor poison = poisoned(dtype, size_t(tokens * hidden));
        harness.upload(0, residual_out, poison.data(), bytes);
        harness.upload(0, norm_out, poison.data(), bytes);
        AddRmsNormArgs args;
        args.input = input;
        args.residual = residual;
        args.gamma = gamma;
        args.residual_out = residual_out;
        args.norm_out = norm_out;
        args.tokens = tokens;
        args.hidden = hidden;
        args.dtype = dtype;
        args.norm_weight = spec.norm_weight;
        add_rmsnorm(Backend::kCuda, args, harness.stream(0));
        CaseResult result;
        result.norm_out.emplace_back(dtype, size_t(tokens * hidden));
        result.residual_out.emplace_back(dtype, size_t(tokens * hidden));
        harness.download(0, result.norm_out[0].data(), norm_out, bytes);
        harness.download(0, result.residual_out[0].data(), residual_out, bytes);
        expect_correct(spec, data, result);
      }
    }
  }
}

// Where one block of the local kernel's two-vector form fits a multiprocessor, past one wave each
// block stages its next row in shared memory (local.cu): every row of a staged call has the bits
// the same row gets from calls of at most 100 tokens (never staged: one block a row), for every
// epilogue, dtype, FP8 mode and launch shape that stages, out of place and in place; outputs
// poisoned first. The calls go through a one-rank team (the local kernel), which also takes a call
// without residual.
TEST(GpuLocalAddRmsNorm, StagedRowsGiveTheBitsOfOneWaveCalls) {
  if (cuda_device_count() < 1) GTEST_SKIP() << "needs a GPU";
  CudaHarness harness(1);
  const Team& team = harness.team()[0];
  std::mt19937_64 rng(19);
  constexpr int64_t kChunk = 100;
  int staged_cases = 0;
  std::string staged_forms;  // dtype/hidden/form of each, for the log
  for (DType dtype : kDTypes) {
    for (int64_t hidden : {136, 3072, 4224, 7168, 16384}) {
      for (int form = 0; form < 7; ++form) {
        const bool residual = form != 1;
        const bool in_place = form == 2 || form == 6;
        const NormWeight weight = form == 3 ? NormWeight::kOnePlusGamma : NormWeight::kGamma;
        const QuantMode quant = form == 4                ? QuantMode::kPerToken
                                : form == 5              ? QuantMode::kPerTokenGroup128
                                : form == 1 || form == 6 ? QuantMode::kStatic
                                                         : QuantMode::kNone;
        if (quant != QuantMode::kNone && hidden % 128 != 0) continue;
        AddRmsNormArgs shape;
        shape.hidden = hidden;
        shape.dtype = dtype;
        shape.norm_weight = weight;
        shape.quant = quant;
        // The fewest tokens of these that the kernel stages (more than one wave).
        int64_t tokens = 0;
        for (int64_t candidate : {300, 1500}) {
          shape.tokens = candidate;
          const impl::RowCall call = impl::make_row_call(nullptr, shape);
          impl::RowEpilogueKind kind{residual, true, weight, quant != QuantMode::kNone, false};
          if (impl::cuda_local_epilogue_stages(call, dtype, kind)) {
            tokens = candidate;
            break;
          }
        }
        if (tokens == 0) continue;  // no staging form fits this shape's shared memory
        ++staged_cases;
        staged_forms += std::string(" ") + dtype_name(dtype) + "/" + std::to_string(hidden) + "/" +
                        std::to_string(form);
        const size_t count = size_t(tokens * hidden), bytes = count * dtype_size(dtype);
        const HostTensor input = random_tensor(rng, dtype, count);
        const HostTensor residual_in = random_tensor(rng, dtype, count);
        const HostTensor gamma = random_tensor(rng, dtype, size_t(hidden), 0.5);
        const HostTensor poison = poisoned(dtype, count);
        const std::vector<uint8_t> byte_poison(count, 0x5a);
        const size_t scale_count =
            quant == QuantMode::kPerTokenGroup128 ? count / 128 : size_t(tokens);
        const std::vector<float> scale_poison(scale_count, -1.0f);
        const float static_scale = 0.03f;
        void* device_gamma = harness.allocate(0, gamma.bytes.size());
        harness.upload(0, device_gamma, gamma.data(), gamma.bytes.size());
        auto* device_static = static_cast<float*>(harness.allocate(0, sizeof(float)));
        harness.upload(0, device_static, &static_scale, sizeof(float));
        struct Outputs {
          HostTensor residual_out, norm_out;
          std::vector<uint8_t> quant_out;
          std::vector<float> scales;
        };
        // One call of `tokens` tokens, or calls of kChunk tokens, on fresh buffers.
        const auto run = [&](int64_t chunk) {
          void* in = harness.allocate(0, bytes);
          void* res = harness.allocate(0, bytes);
          void* res_out = in_place ? res : harness.allocate(0, bytes);
          void* norm = in_place ? in : harness.allocate(0, bytes);
          void* q = harness.allocate(0, count);
          auto* scales = static_cast<float*>(harness.allocate(0, scale_count * sizeof(float)));
          harness.upload(0, in, input.data(), bytes);
          harness.upload(0, res, residual_in.data(), bytes);
          if (!in_place) {
            harness.upload(0, res_out, poison.data(), bytes);
            harness.upload(0, norm, poison.data(), bytes);
          }
          harness.upload(0, q, byte_poison.data(), count);
          harness.upload(0, scales, scale_poison.data(), scale_count * sizeof(float));
          const size_t row_bytes = size_t(hidden) * dtype_size(dtype);
          const size_t scales_per_token = scale_count / size_t(tokens);
          for (int64_t first = 0; first < tokens; first += chunk) {
            AddRmsNormArgs args = shape;
            args.tokens = std::min(chunk, tokens - first);
            const auto at = [&](void* base) {
              return static_cast<char*>(base) + first * row_bytes;
            };
            args.input = at(in);
            args.residual = residual ? at(res) : nullptr;
            args.residual_out = residual ? at(res_out) : nullptr;
            args.norm_out = at(norm);
            args.gamma = device_gamma;
            if (quant != QuantMode::kNone)
              args.quant_out = static_cast<uint8_t*>(q) + first * hidden;
            if (quant == QuantMode::kStatic) args.quant_scale = device_static;
            if (quant == QuantMode::kPerToken || quant == QuantMode::kPerTokenGroup128) {
              args.scales_out = scales + size_t(first) * scales_per_token;
            }
            allreduce_add_rmsnorm(team, args, harness.stream(0));
          }
          Outputs out{HostTensor(dtype, count), HostTensor(dtype, count),
                      std::vector<uint8_t>(count), std::vector<float>(scale_count)};
          harness.download(0, out.norm_out.data(), norm, bytes);
          if (residual) harness.download(0, out.residual_out.data(), res_out, bytes);
          harness.download(0, out.quant_out.data(), q, count);
          harness.download(0, out.scales.data(), scales, scale_count * sizeof(float));
          return out;
        };
        const Outputs staged = run(tokens);
        const Outputs chunked = run(kChunk);
        const std::string where = std::string(dtype_name(dtype)) + " hidden " +
                                  std::to_string(hidden) + " tokens " + std::to_string(tokens) +
                                  " form " + std::to_string(form);
        EXPECT_TRUE(staged.norm_out.bytes == chunked.norm_out.bytes) << where << ": norm_out";
        EXPECT_NE(
            std::memcmp(staged.norm_out.data(), poison.data(), size_t(hidden) * dtype_size(dtype)),
            0)
            << where << ": norm_out row 0 left poisoned";
        EXPECT_TRUE(staged.residual_out.bytes == chunked.residual_out.bytes)
            << where << ": residual_out";
        if (quant != QuantMode::kNone) {
          EXPECT_TRUE(staged.quant_out == chunked.quant_out) << where << ": quant_out";
          if (quant != QuantMode::kStatic) {
            EXPECT_EQ(std::memcmp(staged.scales.data(), chunked.scales.data(),
                                  scale_count * sizeof(float)),
                      0)
                << where << ": scales_out";
          }
        }
      }
    }
  }
  // Which forms stage follows the plain kernels' registers (a form whose plain kernel fits two
  // blocks a multiprocessor never stages): at 7168 in bf16 and fp16 (two vectors a thread) at least
  // four of the FP8 forms' plain kernels fit one block.
  std::printf("staged (dtype/hidden/form):%s\n", staged_forms.c_str());
  EXPECT_GE(staged_cases, 4) << "staging forms run:" << staged_forms;
}

}  // namespace
}  // namespace tpfuse::testing
