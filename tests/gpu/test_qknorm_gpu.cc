// allreduce_qk_rmsnorm on real GPUs (in-process team over every visible GPU, at least 2): the
// shared QK-norm properties, MiniMax-M2 shapes, and CUDA-graph replay on fresh inputs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "cuda_harness.h"
#include "mixed_properties.h"
#include "qknorm_properties.h"

namespace tpfuse::testing {
namespace {

using GpuQkNorm = MultiGpuTest;

TEST_F(GpuQkNorm, MatchesFloat64ReferenceOfTheUnfusedPattern) {
  CudaHarness harness(gpus());
  check_qk_random_cases(harness, 500, 80);
}

// The NCCL path: qk_sum_squares, ncclAllReduce of the [tokens, 2] sums, qk_rmsnorm_from_sums.
TEST_F(GpuQkNorm, NcclPathMatchesFloat64Reference) {
  CudaHarness harness(gpus());
  harness.algorithm = Algorithm::kNccl;
  check_qk_random_cases(harness, 550, 30);
  check_qk_adversarial(harness, 551);
}

TEST_F(GpuQkNorm, IdenticalSlicesGiveIdenticalBitsOnEveryRank) {
  CudaHarness harness(gpus());
  check_qk_identical_across_ranks(harness, 501);
}

TEST_F(GpuQkNorm, LocalHalvesGiveTheFusedBits) {
  CudaHarness harness(gpus());
  check_qk_halves_match_fused(harness, 505);
}

TEST_F(GpuQkNorm, ZerosNaNAndInfinities) {
  CudaHarness harness(gpus());
  check_qk_adversarial(harness, 502);
}

TEST_F(GpuQkNorm, UnalignedCosSinCache) {
  CudaHarness harness(gpus());
  check_qk_unaligned_cache(harness, 506);
}

TEST_F(GpuQkNorm, InterleavedWithAddRmsNormOnOneTeam) {
  CudaHarness harness(gpus());
  check_ops_interleaved(harness, 590, 80);
}

// MiniMax-M2's heads in bf16 (one vector a thread), the same in fp32 (two: the kernel loads a
// token ahead) and twice the query heads in fp32 (four: it does not); 2048 tokens is more than
// the grid's resident blocks, so blocks take several tokens each.
TEST_F(GpuQkNorm, MiniMaxShapesManyTokens) {
  CudaHarness harness(gpus());
  std::mt19937_64 rng(503);
  const std::pair<DType, int> layouts[] = {
      {DType::kBFloat16, 48}, {DType::kFloat32, 48}, {DType::kFloat32, 96}};
  for (const auto& [dtype, heads] : layouts) {
    for (int64_t tokens : {1, 64, 2048}) {
      for (RopeStyle rope : {RopeStyle::kNone, RopeStyle::kNeox, RopeStyle::kInterleaved}) {
        QkSpec s;
        s.dtype = dtype;
        s.heads = heads / harness.world_size();
        s.kv_heads = std::max(1, 8 / harness.world_size());
        s.rope = rope;
        s.tokens = tokens;
        const QkData d = random_qk_data(rng, s, harness.world_size());
        expect_qk_correct(s, d, run_qk(harness, s, d), harness.world_size());
      }
    }
  }
}

TEST_F(GpuQkNorm, ManyTokensReferenceHalvesAndRepeats) {
  CudaHarness harness(gpus());
  check_qk_many_tokens(harness, 507);
}

// Each rank captures a QK-norm call with RoPE (in place) followed by one without RoPE (into
// separate outputs) into a CUDA graph; 1,000 replays on fresh inputs, every replay checked.
TEST_F(GpuQkNorm, CudaGraphReplaysOnFreshInputs) {
  const int world = gpus();
  CudaHarness harness(world);
  std::mt19937_64 rng(504);
  QkSpec with_rope, plain;
  with_rope.heads = plain.heads = 48 / world;
  with_rope.kv_heads = plain.kv_heads = std::max(1, 8 / world);
  with_rope.tokens = 3;
  with_rope.in_place = true;
  with_rope.rope = RopeStyle::kNeox;
  plain.tokens = 5;
  const size_t element = dtype_size(plain.dtype);
  struct RankBuffers {
    void *qkv1, *qkv2, *q_out, *k_out, *q_gamma, *k_gamma, *positions, *cos_sin;
  };
  const QkData base = random_qk_data(rng, with_rope, world);
  std::vector<RankBuffers> b(world);
  for (int r = 0; r < world; ++r) {
    b[r].qkv1 = harness.allocate(r, size_t(with_rope.tokens * with_rope.row()) * element);
    b[r].qkv2 = harness.allocate(r, size_t(plain.tokens * plain.row()) * element);
    b[r].q_out = harness.allocate(r, size_t(plain.tokens * plain.q_size()) * element);
    b[r].k_out = harness.allocate(r, size_t(plain.tokens * plain.kv_size()) * element);
    b[r].q_gamma = harness.allocate(r, size_t(plain.q_size()) * element);
    b[r].k_gamma = harness.allocate(r, size_t(plain.kv_size()) * element);
    b[r].positions = harness.allocate(r, size_t(with_rope.tokens) * 8);
    b[r].cos_sin = harness.allocate(r, base.cos_sin.size() * 4);
    harness.upload(r, b[r].q_gamma, base.q_gamma[r].data(), size_t(plain.q_size()) * element);
    harness.upload(r, b[r].k_gamma, base.k_gamma[r].data(), size_t(plain.kv_size()) * element);
    harness.upload(r, b[r].cos_sin, base.cos_sin.data(), base.cos_sin.size() * 4);
  }
  const auto args_for = [&](const QkSpec& s, int r) {
    QkNormArgs a;
    a.q_gamma = b[r].q_gamma;
    a.k_gamma = b[r].k_gamma;
    a.tokens = s.tokens;
    a.q_size = s.q_size();
    a.kv_size = s.kv_size();
    a.q_global_size = s.q_size() * world;
    a.k_global_size = s.kv_size() * world;
    a.dtype = s.dtype;
    a.eps = s.eps;
    return a;
  };
  std::vector<cudaGraphExec_t> graphs(world);
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
    cudaStream_t stream = harness.stream(r);
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    QkNormArgs first = args_for(with_rope, r);
    first.qkv = b[r].qkv1;
    first.rope = RopeStyle::kNeox;
    first.head_dim = with_rope.head_dim;
    first.rotary_dim = with_rope.rotary_dim;
    first.positions = static_cast<const int64_t*>(b[r].positions);
    first.cos_sin_cache = static_cast<const float*>(b[r].cos_sin);
    first.max_position = base.max_position;
    allreduce_qk_rmsnorm(harness.team()[r], first, stream);
    QkNormArgs second = args_for(plain, r);
    second.qkv = b[r].qkv2;
    second.q_out = b[r].q_out;
    second.k_out = b[r].k_out;
    allreduce_qk_rmsnorm(harness.team()[r], second, stream);
    cudaGraph_t graph;
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&graphs[r], graph, 0), cudaSuccess);
    cudaGraphDestroy(graph);
  }
  for (int replay = 0; replay < 1000 && !HasFailure(); ++replay) {
    QkData d1 = random_qk_data(rng, with_rope, world);
    QkData d2 = random_qk_data(rng, plain, world);
    d1.q_gamma = d2.q_gamma = base.q_gamma;
    d1.k_gamma = d2.k_gamma = base.k_gamma;
    d1.cos_sin = base.cos_sin;
    d1.max_position = base.max_position;
    const HostTensor poison = poisoned(plain.dtype, size_t(plain.tokens * plain.row()));
    for (int r = 0; r < world; ++r) {
      harness.upload(r, b[r].qkv1, d1.qkv[r].data(), d1.qkv[r].bytes.size());
      harness.upload(r, b[r].positions, d1.positions.data(), d1.positions.size() * 8);
      harness.upload(r, b[r].qkv2, d2.qkv[r].data(), d2.qkv[r].bytes.size());
      harness.upload(r, b[r].q_out, poison.data(), size_t(plain.tokens * plain.q_size()) * element);
      harness.upload(r, b[r].k_out, poison.data(),
                     size_t(plain.tokens * plain.kv_size()) * element);
    }
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(cudaSetDevice(r), cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(graphs[r], harness.stream(r)), cudaSuccess);
    }
    harness.synchronize();
    QkResult r1, r2;
    for (int r = 0; r < world; ++r) {
      HostTensor all(with_rope.dtype, size_t(with_rope.tokens * with_rope.row()));
      harness.download(r, all.data(), b[r].qkv1, all.bytes.size());
      HostTensor q(with_rope.dtype, size_t(with_rope.tokens * with_rope.q_size()));
      HostTensor k(with_rope.dtype, size_t(with_rope.tokens * with_rope.kv_size()));
      for (int64_t t = 0; t < with_rope.tokens; ++t) {
        for (int64_t e = 0; e < with_rope.q_size(); ++e) {
          q.set(size_t(t * with_rope.q_size() + e), all.get(size_t(t * with_rope.row() + e)));
        }
        for (int64_t e = 0; e < with_rope.kv_size(); ++e) {
          k.set(size_t(t * with_rope.kv_size() + e),
                all.get(size_t(t * with_rope.row() + with_rope.q_size() + e)));
        }
      }
      r1.q.push_back(q);
      r1.k.push_back(k);
      HostTensor q2(plain.dtype, size_t(plain.tokens * plain.q_size()));
      HostTensor k2(plain.dtype, size_t(plain.tokens * plain.kv_size()));
      harness.download(r, q2.data(), b[r].q_out, q2.bytes.size());
      harness.download(r, k2.data(), b[r].k_out, k2.bytes.size());
      r2.q.push_back(q2);
      r2.k.push_back(k2);
    }
    SCOPED_TRACE("replay " + std::to_string(replay));
    expect_qk_correct(with_rope, d1, r1, world);
    expect_qk_correct(plain, d2, r2, world);
  }
  for (int r = 0; r < world; ++r) {
    cudaSetDevice(r);
    cudaGraphExecDestroy(graphs[r]);
  }
}

}  // namespace
}  // namespace tpfuse::testing
