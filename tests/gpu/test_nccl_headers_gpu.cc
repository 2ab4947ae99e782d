// The NCCL path's call headers (src/cuda/nccl_headers.cu) on one GPU: each rank's header
// kernel, then the sum NCCL would make of the header vectors (done here on the host: NCCL does
// not run two ranks on one GPU), then each rank's check kernel. A good call leaves its outputs
// alone; a peer that rejected, disagreed, made another call or had failed makes every byte of
// every output NaN (and nothing past them), and the right error is recorded. The real NCCL group
// runs in the multi-GPU tests (test_oneshot_gpu: GpuOneShot.MisuseOnEveryPath...).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/calls.h"
#include "cuda/kernels.h"
#include "cuda/team_state.h"
#include "tpfuse/impl/session.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse::testing {
namespace {

using impl::CallError;
using impl::CallOp;
using impl::CallSignature;
using impl::ControlBlock;
using impl::ErrorRecord;

#define ASSERT_CUDA(call) ASSERT_EQ((call), cudaSuccess) << #call

int gpus() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

// One output of each kind the check fills, with a guard band after each row.
constexpr int64_t kRows = 3;
constexpr uint64_t kRowBytes = 6;  // not a whole number of words: the byte path too
constexpr uint64_t kStride = 16;
constexpr unsigned char kUntouched = 0x5a;

// W ranks of one team on GPU 0 without peer stores (as an NCCL-only team): control blocks,
// error records and header vectors of their own.
class Ranks {
 public:
  explicit Ranks(int world) : world_(world), states_(world) {
    for (int r = 0; r < world; ++r) {
      impl::CudaTeamState& s = states_[r];
      s.exchange.rank = r;
      s.exchange.world_size = world;
      s.device = 0;
      void* pointer = nullptr;
      check(cudaMalloc(&pointer, sizeof(ControlBlock)));
      check(cudaMemset(pointer, 0, sizeof(ControlBlock)));
      s.exchange.control = static_cast<ControlBlock*>(pointer);
      check(cudaHostAlloc(&pointer, sizeof(ErrorRecord), cudaHostAllocMapped));
      std::memset(pointer, 0, sizeof(ErrorRecord));
      s.exchange.errors = static_cast<ErrorRecord*>(pointer);
      check(cudaMalloc(&s.nccl_headers, impl::kNcclHeaderBytes));
      check(cudaMalloc(&pointer, kRows * kStride));
      outputs_.push_back(static_cast<unsigned char*>(pointer));
    }
  }
  ~Ranks() {
    for (int r = 0; r < world_; ++r) {
      cudaFree(states_[r].exchange.control);
      cudaFreeHost(states_[r].exchange.errors);
      cudaFree(states_[r].nccl_headers);
      cudaFree(outputs_[r]);
    }
  }

  impl::CudaTeamState& state(int r) { return states_[r]; }
  ErrorRecord& errors(int r) { return *states_[r].exchange.errors; }
  ControlBlock control(int r) {
    ControlBlock block{};
    check(cudaMemcpy(&block, states_[r].exchange.control, sizeof(block), cudaMemcpyDeviceToHost));
    return block;
  }
  void set_control(int r, const ControlBlock& block) {
    check(cudaMemcpy(states_[r].exchange.control, &block, sizeof(block), cudaMemcpyHostToDevice));
  }

  // One call: every rank's header kernel with its signature, NCCL's sum, every rank's check.
  void call(const std::vector<CallSignature>& signatures) {
    for (int r = 0; r < world_; ++r) {
      check(cudaMemset(outputs_[r], kUntouched, kRows * kStride));
      impl::cuda_nccl_headers(states_[r], signatures[r], nullptr);
    }
    check(cudaDeviceSynchronize());
    std::vector<uint32_t> sum(size_t(world_) * 4, 0), one(size_t(world_) * 4);
    for (int r = 0; r < world_; ++r) {
      check(
          cudaMemcpy(one.data(), states_[r].nccl_headers, one.size() * 4, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += one[i];
    }
    for (int r = 0; r < world_; ++r) {
      check(
          cudaMemcpy(states_[r].nccl_headers, sum.data(), sum.size() * 4, cudaMemcpyHostToDevice));
      impl::CallOutputs outputs{};
      outputs.rows[outputs.count++] = {outputs_[r], kRows, kRowBytes, kStride, impl::kNanWord};
      outputs.rows[outputs.count++] = {nullptr, kRows, kRowBytes, kStride, impl::kNanWord};
      impl::cuda_nccl_check(states_[r], outputs, nullptr);
    }
    check(cudaDeviceSynchronize());
  }

  // Rank r's output: every row's bytes NaN (poisoned) or untouched, and the guard bands
  // untouched either way.
  void expect_output(int r, bool poisoned) {
    std::vector<unsigned char> bytes(kRows * kStride);
    check(cudaMemcpy(bytes.data(), outputs_[r], bytes.size(), cudaMemcpyDeviceToHost));
    const uint32_t word = impl::kNanWord;
    for (int64_t row = 0; row < kRows; ++row) {
      for (uint64_t b = 0; b < kStride; ++b) {
        const unsigned char expected = poisoned && b < kRowBytes
                                           ? static_cast<unsigned char>(word >> (8 * (b % 4)))
                                           : kUntouched;
        EXPECT_EQ(bytes[row * kStride + b], expected)
            << "rank " << r << ", row " << row << ", byte " << b;
      }
    }
  }

 private:
  static void check(cudaError_t status) {
    if (status != cudaSuccess) throw std::runtime_error(cudaGetErrorString(status));
  }
  int world_;
  std::vector<impl::CudaTeamState> states_;
  std::vector<unsigned char*> outputs_;
};

CallSignature signature(int64_t tokens, float eps = 1e-6f) {
  impl::RowEpilogueKind epilogue{};
  epilogue.residual = epilogue.norm = true;
  return impl::row_signature(CallOp::kNccl, DType::kBFloat16, epilogue, tokens, 4096, eps);
}

class NcclHeaders : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (gpus() < 1) GTEST_SKIP() << "needs a GPU";
  }
};

TEST_P(NcclHeaders, AlikeCallsLeaveTheirOutputsAndCountCalls) {
  const int world = GetParam();
  Ranks ranks(world);
  for (int call = 0; call < 3; ++call) {
    ranks.call(std::vector<CallSignature>(world, signature(7)));
    for (int r = 0; r < world; ++r) {
      ranks.expect_output(r, false);
      EXPECT_EQ(ranks.errors(r).failure, 0u);
      EXPECT_EQ(ranks.errors(r).call_error, 0u);
      EXPECT_EQ(ranks.control(r).sequence, uint32_t(call + 1));
    }
  }
}

TEST_P(NcclHeaders, DisagreementPoisonsEveryRankAndNamesTheField) {
  const int world = GetParam();
  Ranks ranks(world);
  std::vector<CallSignature> signatures(world, signature(7));
  signatures[world - 1] = signature(8);
  ranks.call(signatures);
  for (int r = 0; r < world; ++r) {
    ranks.expect_output(r, true);
    EXPECT_EQ(CallError(ranks.errors(r).failure), CallError::kMismatch) << "rank " << r;
    const std::string text = impl::describe_failure(ranks.errors(r), r, 0, "");
    EXPECT_NE(text.find("tokens"), std::string::npos) << text;
  }
  // The team is failed: the next call's header says so, and every peer fails too.
  ranks.call(std::vector<CallSignature>(world, signature(7)));
  for (int r = 0; r < world; ++r) ranks.expect_output(r, true);
}

TEST_P(NcclHeaders, AnotherCallNumberIsAMismatchThatSaysSo) {
  const int world = GetParam();
  Ranks ranks(world);
  // The last rank made a call its peers did not (a rejection that took no turn, say).
  ControlBlock block = ranks.control(world - 1);
  block.sequence = 1;
  ranks.set_control(world - 1, block);
  ranks.call(std::vector<CallSignature>(world, signature(7)));
  const std::string text = impl::describe_failure(ranks.errors(0), 0, 0, "");
  EXPECT_NE(text.find("this rank's call 0 met rank " + std::to_string(world - 1) + "'s call 1"),
            std::string::npos)
      << text;
  for (int r = 0; r < world; ++r) ranks.expect_output(r, true);
}

TEST_P(NcclHeaders, RejectedTurnPoisonsThePeersAndTheTeamGoesOn) {
  const int world = GetParam();
  Ranks ranks(world);
  std::vector<CallSignature> signatures(world, signature(7));
  signatures[0] = impl::rejected_signature();
  ranks.call(signatures);
  EXPECT_EQ(ranks.errors(0).call_error, 0u);  // the rejecting rank reports its own error
  for (int r = 1; r < world; ++r) {
    ranks.expect_output(r, true);
    EXPECT_EQ(CallError(ranks.errors(r).call_error), CallError::kPeerRejected);
    EXPECT_EQ(ranks.errors(r).call_peer, 0u);
    EXPECT_EQ(ranks.errors(r).failure, 0u);
  }
  ranks.call(std::vector<CallSignature>(world, signature(7)));
  for (int r = 0; r < world; ++r) ranks.expect_output(r, false);
}

TEST_P(NcclHeaders, FailedPeerFailsTheTeamEverywhere) {
  const int world = GetParam();
  Ranks ranks(world);
  // Rank 0's team failed earlier (it timed out waiting for the last rank).
  ControlBlock block = ranks.control(0);
  block.error = 1 + uint32_t(world - 1);
  ranks.set_control(0, block);
  ranks.errors(0).failure_peer = uint32_t(world - 1);
  ranks.errors(0).failure = uint32_t(CallError::kTimeout);
  ranks.call(std::vector<CallSignature>(world, signature(7)));
  for (int r = 1; r < world; ++r) {
    ranks.expect_output(r, true);
    EXPECT_EQ(CallError(ranks.errors(r).failure), CallError::kPeerFailed);
    const std::string text = impl::describe_failure(ranks.errors(r), r, 0, "");
    EXPECT_NE(text.find("rank 0 failed the team"), std::string::npos) << text;
    EXPECT_NE(text.find("timed out waiting for rank " + std::to_string(world - 1)),
              std::string::npos)
        << text;
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, NcclHeaders, ::testing::Values(2, 3, 8));

}  // namespace
}  // namespace tpfuse::testing
