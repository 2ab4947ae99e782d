// Properties of allreduce_qk_rmsnorm that every backend must have, run by tests/cpu and
// tests/gpu: the float64 reference of the unfused pattern (split -> per-rank sums of squares ->
// all-reduce -> rsqrt -> scale -> RoPE), replicated KV heads counted once, identical bits on
// every rank when the ranks hold identical slices, poisoned outputs, in-place use.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "harness.h"
#include "reference.h"

namespace tpfuse::testing {

struct QkSpec {
  DType dtype = DType::kBFloat16;
  int64_t tokens = 1;
  int64_t heads = 24;    // this rank's query heads
  int64_t kv_heads = 4;  // this rank's KV heads
  int64_t head_dim = 128;
  int kv_replicas = 1;
  bool in_place = false;
  RopeStyle rope = RopeStyle::kNone;
  int64_t rotary_dim = 64;
  // Where the cos/sin cache starts past its allocation, in floats: 1 makes it 4-byte aligned but
  // not 16-byte aligned (a view into a larger tensor), which the GPU kernel's vector loads avoid.
  int64_t cache_offset = 0;
  float eps = 1e-6f;
  int64_t q_size() const { return heads * head_dim; }
  int64_t kv_size() const { return kv_heads * head_dim; }
  int64_t row() const { return q_size() + 2 * kv_size(); }
};

struct QkData {
  std::vector<HostTensor> qkv, q_gamma, k_gamma;  // per rank
  std::vector<int64_t> positions;
  std::vector<float> cos_sin;  // [max_position, rotary_dim]
  int64_t max_position = 0;
};

struct QkResult {
  std::vector<HostTensor> q, k;  // per rank
};

inline std::string describe(const QkSpec& s) {
  std::ostringstream out;
  out << dtype_name(s.dtype) << " tokens=" << s.tokens << " heads=" << s.heads
      << " kv_heads=" << s.kv_heads << " head_dim=" << s.head_dim
      << " kv_replicas=" << s.kv_replicas << (s.in_place ? " in_place" : "")
      << " rope=" << int(s.rope) << " rotary_dim=" << s.rotary_dim
      << (s.cache_offset != 0 ? " cache_offset=" + std::to_string(s.cache_offset) : "");
  return out.str();
}

// MiniMax-M2's heads (48 query, 8 KV of 128) for this world size: KV heads replicated past 8.
inline QkSpec minimax_qk_spec(int world, DType dtype, RopeStyle rope, int64_t tokens) {
  QkSpec s;
  s.dtype = dtype;
  s.heads = std::max(1, 48 / world);
  s.kv_heads = std::max(1, 8 / world);
  s.kv_replicas = world > 8 ? world / 8 : 1;
  s.rope = rope;
  s.tokens = tokens;
  return s;
}

inline QkData random_qk_data(std::mt19937_64& rng, const QkSpec& s, int world,
                             bool identical_ranks = false) {
  QkData d;
  for (int r = 0; r < world; ++r) {
    if (identical_ranks && r > 0) {
      d.qkv.push_back(d.qkv[0]);
      d.q_gamma.push_back(d.q_gamma[0]);
      d.k_gamma.push_back(d.k_gamma[0]);
      continue;
    }
    HostTensor qkv = random_tensor(rng, s.dtype, size_t(s.tokens * s.row()), 2.0);
    HostTensor qg = random_tensor(rng, s.dtype, size_t(s.q_size()));
    HostTensor kg = random_tensor(rng, s.dtype, size_t(s.kv_size()));
    for (size_t i = 0; i < qg.count(); ++i) qg.set(i, 1.0 + 0.25 * qg.get(i));
    for (size_t i = 0; i < kg.count(); ++i) kg.set(i, 1.0 + 0.25 * kg.get(i));
    // Ranks that hold the same KV heads hold the same k (and v) values and weights.
    if (r % s.kv_replicas != 0) {
      const int first = r - r % s.kv_replicas;
      for (int64_t t = 0; t < s.tokens; ++t) {
        for (int64_t e = s.q_size(); e < s.row(); ++e) {
          qkv.set(size_t(t * s.row() + e), d.qkv[first].get(size_t(t * s.row() + e)));
        }
      }
      kg = d.k_gamma[first];
    }
    d.qkv.push_back(qkv);
    d.q_gamma.push_back(qg);
    d.k_gamma.push_back(kg);
  }
  if (s.rope != RopeStyle::kNone) {
    d.max_position = 4096;
    const int64_t half = s.rotary_dim / 2;
    d.cos_sin.resize(size_t(d.max_position * s.rotary_dim));
    for (int64_t p = 0; p < d.max_position; ++p) {
      for (int64_t i = 0; i < half; ++i) {
        const double angle = double(p) * std::pow(5e6, -2.0 * double(i) / double(s.rotary_dim));
        d.cos_sin[size_t(p * s.rotary_dim + i)] = float(std::cos(angle));
        d.cos_sin[size_t(p * s.rotary_dim + half + i)] = float(std::sin(angle));
      }
    }
    std::uniform_int_distribution<int64_t> position(0, d.max_position - 1);
    for (int64_t t = 0; t < s.tokens; ++t) d.positions.push_back(position(rng));
  }
  return d;
}

// One rank's copies of a case: qkv, outputs (null in place), weights, RoPE position and cache.
struct QkBuffers {
  void *qkv, *q_out, *k_out, *q_gamma, *k_gamma, *positions, *cos_sin;
};

// Uploads every rank's inputs to fresh buffers; separate outputs (unless in place) are poisoned.
inline std::vector<QkBuffers> upload_qk(Harness& h, const QkSpec& s, const QkData& d) {
  const size_t element = dtype_size(s.dtype);
  const HostTensor poison = poisoned(s.dtype, size_t(s.tokens * s.row()));
  std::vector<QkBuffers> b(size_t(h.world_size()));
  const auto copy = [&](int r, const void* data, size_t bytes) {
    void* pointer = h.allocate(r, bytes);
    h.upload(r, pointer, data, bytes);
    return pointer;
  };
  for (int r = 0; r < h.world_size(); ++r) {
    b[r].qkv = copy(r, d.qkv[r].data(), d.qkv[r].bytes.size());
    b[r].q_out =
        s.in_place ? nullptr : copy(r, poison.data(), size_t(s.tokens * s.q_size()) * element);
    b[r].k_out =
        s.in_place ? nullptr : copy(r, poison.data(), size_t(s.tokens * s.kv_size()) * element);
    b[r].q_gamma = copy(r, d.q_gamma[r].data(), d.q_gamma[r].bytes.size());
    b[r].k_gamma = copy(r, d.k_gamma[r].data(), d.k_gamma[r].bytes.size());
    b[r].positions = b[r].cos_sin = nullptr;
    if (s.rope != RopeStyle::kNone) {
      b[r].positions = copy(r, d.positions.data(), d.positions.size() * 8);
      const size_t offset = size_t(s.cache_offset) * 4;
      char* cache = static_cast<char*>(h.allocate(r, d.cos_sin.size() * 4 + offset)) + offset;
      h.upload(r, cache, d.cos_sin.data(), d.cos_sin.size() * 4);
      b[r].cos_sin = cache;
    }
  }
  return b;
}

inline QkNormArgs qk_args(const QkSpec& s, const QkBuffers& b, int64_t max_position, int world) {
  QkNormArgs a;
  a.qkv = b.qkv;
  a.q_out = b.q_out;
  a.k_out = b.k_out;
  a.q_gamma = b.q_gamma;
  a.k_gamma = b.k_gamma;
  a.tokens = s.tokens;
  a.q_size = s.q_size();
  a.kv_size = s.kv_size();
  a.q_global_size = s.q_size() * world;
  a.k_global_size = s.kv_size() * world / s.kv_replicas;
  a.kv_replicas = s.kv_replicas;
  a.dtype = s.dtype;
  a.eps = s.eps;
  a.rope = s.rope;
  a.head_dim = s.head_dim;
  a.rotary_dim = s.rotary_dim;
  a.positions = static_cast<const int64_t*>(b.positions);
  a.cos_sin_cache = static_cast<const float*>(b.cos_sin);
  a.max_position = max_position;
  return a;
}

// Downloads every rank's q and k (out of qkv when in place, checking v was left alone).
inline QkResult download_qk(Harness& h, const QkSpec& s, const QkData& d,
                            const std::vector<QkBuffers>& b) {
  const int world = h.world_size();
  const size_t element = dtype_size(s.dtype);
  const size_t qkv_bytes = size_t(s.tokens * s.row()) * element;
  const size_t q_bytes = size_t(s.tokens * s.q_size()) * element;
  const size_t k_bytes = size_t(s.tokens * s.kv_size()) * element;
  QkResult result;
  for (int r = 0; r < world; ++r) {
    HostTensor q(s.dtype, size_t(s.tokens * s.q_size())),
        k(s.dtype, size_t(s.tokens * s.kv_size()));
    if (s.in_place) {
      HostTensor all(s.dtype, size_t(s.tokens * s.row()));
      h.download(r, all.data(), b[r].qkv, qkv_bytes);
      for (int64_t t = 0; t < s.tokens; ++t) {
        for (int64_t e = 0; e < s.q_size(); ++e) {
          q.set(size_t(t * s.q_size() + e), all.get(size_t(t * s.row() + e)));
        }
        for (int64_t e = 0; e < s.kv_size(); ++e) {
          k.set(size_t(t * s.kv_size() + e), all.get(size_t(t * s.row() + s.q_size() + e)));
        }
        // v passes through untouched
        for (int64_t e = s.q_size() + s.kv_size(); e < s.row(); ++e) {
          const size_t i = size_t(t * s.row() + e);
          EXPECT_EQ(std::memcmp(&all.bytes[i * element], &d.qkv[r].bytes[i * element], element), 0)
              << "v changed at token " << t << " element " << e;
        }
      }
    } else {
      h.download(r, q.data(), b[r].q_out, q_bytes);
      h.download(r, k.data(), b[r].k_out, k_bytes);
    }
    result.q.push_back(std::move(q));
    result.k.push_back(std::move(k));
  }
  return result;
}

// Runs one fused call on every rank of the harness (fresh buffers; outputs poisoned).
inline QkResult run_qk(Harness& h, const QkSpec& s, const QkData& d) {
  const std::vector<QkBuffers> b = upload_qk(h, s, d);
  h.run([&](int rank, Stream stream) {
    QkNormArgs args = qk_args(s, b[rank], d.max_position, h.world_size());
    args.algorithm = h.algorithm;
    const Algorithm ran = allreduce_qk_rmsnorm(h.team()[rank], args, stream);
    if (h.algorithm != Algorithm::kAuto) EXPECT_EQ(ran, h.algorithm);
  });
  return download_qk(h, s, d, b);
}

// float64 reference and comparison for every rank's q and k.
inline void expect_qk_correct(const QkSpec& s, const QkData& d, const QkResult& result, int world) {
  const double u = unit_roundoff(s.dtype);
  // The absolute rounding floor: one ulp of the dtype's subnormals.
  const double subnormal_ulp = s.dtype == DType::kFloat16    ? std::ldexp(1.0, -24)
                               : s.dtype == DType::kBFloat16 ? std::ldexp(1.0, -133)
                                                             : std::ldexp(1.0, -149);
  const double fp32_sum = 0.5 * double(s.q_size() + s.kv_size() + world) * std::ldexp(1.0, -24);
  for (int64_t t = 0; t < s.tokens; ++t) {
    double sum_q = 0, sum_k = 0;
    for (int r = 0; r < world; ++r) {
      for (int64_t e = 0; e < s.q_size(); ++e) {
        const double x = d.qkv[r].get(size_t(t * s.row() + e));
        sum_q += x * x;
      }
      if (r % s.kv_replicas != 0) continue;
      for (int64_t e = 0; e < s.kv_size(); ++e) {
        const double x = d.qkv[r].get(size_t(t * s.row() + s.q_size() + e));
        sum_k += x * x;
      }
    }
    const double scale_q = 1.0 / std::sqrt(sum_q / double(s.q_size() * world) + s.eps);
    const double scale_k =
        1.0 / std::sqrt(sum_k / double(s.kv_size() * world / s.kv_replicas) + s.eps);
    for (int r = 0; r < world; ++r) {
      const int64_t width = s.q_size() + s.kv_size();
      const size_t n = static_cast<size_t>(width);
      std::vector<double> normalized(n), expected(n), tolerance(n);
      for (int64_t e = 0; e < width; ++e) {
        const double x = d.qkv[r].get(size_t(t * s.row() + e));
        normalized[size_t(e)] = e < s.q_size()
                                    ? x * scale_q * d.q_gamma[r].get(size_t(e))
                                    : x * scale_k * d.k_gamma[r].get(size_t(e - s.q_size()));
      }
      for (int64_t e = 0; e < width; ++e) {
        const int64_t head = e / s.head_dim * s.head_dim;
        const int64_t j = e - head;
        double value = normalized[size_t(e)];
        double magnitude = std::fabs(value);
        if (s.rope != RopeStyle::kNone && j < s.rotary_dim) {
          const int64_t half = s.rotary_dim / 2;
          const bool neox = s.rope == RopeStyle::kNeox;
          const int64_t i = neox ? (j < half ? j : j - half) : j / 2;
          const bool first = neox ? j < half : j % 2 == 0;
          const int64_t partner = neox ? (first ? j + half : j - half) : (first ? j + 1 : j - 1);
          const float* row = &d.cos_sin[size_t(d.positions[size_t(t)] * s.rotary_dim)];
          const double c = row[i], sn = row[half + i];
          const double x = normalized[size_t(head + j)], y = normalized[size_t(head + partner)];
          value = first ? x * c - y * sn : x * c + y * sn;
          magnitude = std::fabs(x * c) + std::fabs(y * sn);
        }
        expected[size_t(e)] = value;
        tolerance[size_t(e)] = 2 * u * std::fabs(value) +
                               (fp32_sum + std::ldexp(1.0, -21)) * (magnitude + std::fabs(value)) +
                               subnormal_ulp;
      }
      HostTensor actual(s.dtype, size_t(width));
      for (int64_t e = 0; e < width; ++e) {
        actual.set(size_t(e), e < s.q_size()
                                  ? result.q[r].get(size_t(t * s.q_size() + e))
                                  : result.k[r].get(size_t(t * s.kv_size() + e - s.q_size())));
      }
      EXPECT_EQ(compare(actual, expected, tolerance, "q|k"), "")
          << describe(s) << " token " << t << " rank " << r;
      if (::testing::Test::HasFailure()) return;
    }
  }
}

inline QkSpec random_qk_spec(std::mt19937_64& rng, int world) {
  QkSpec s;
  const DType dtypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};
  s.dtype = dtypes[rng() % 3];
  const int64_t head_dims[] = {64, 128, 8, 256};
  s.head_dim = head_dims[rng() % 4];
  s.heads = 1 + int64_t(rng() % 24);
  // KV heads per rank: 1 with replication when the world is larger than the head count.
  s.kv_replicas = 1;
  for (int replicas : {2, 4, 8}) {
    if (world % replicas == 0 && rng() % 3 == 0) s.kv_replicas = replicas;
  }
  s.kv_heads = s.kv_replicas > 1 ? 1 : 1 + int64_t(rng() % 4);
  if (s.dtype == DType::kFloat32) s.heads = std::min<int64_t>(s.heads, 8);
  s.tokens = 1 + int64_t(rng() % 33);
  s.in_place = rng() % 3 == 0;
  const RopeStyle styles[] = {RopeStyle::kNone, RopeStyle::kNeox, RopeStyle::kInterleaved};
  s.rope = styles[rng() % 3];
  // Full, half (MiniMax-M2's 64 of 128), and an even width that is not a multiple of the vector
  // (halves and heads then straddle 16-byte vectors: the element-by-element RoPE path).
  const int64_t rotary_dims[] = {s.head_dim, s.head_dim / 2, s.head_dim / 4 + 2};
  s.rotary_dim = std::min<int64_t>(s.head_dim, std::max<int64_t>(2, rotary_dims[rng() % 3]));
  if ((s.q_size() + s.kv_size()) > kMaxQkRopeWidth) s.rope = RopeStyle::kNone;
  return s;
}

inline void check_qk_random_cases(Harness& h, uint64_t seed, int cases) {
  std::mt19937_64 rng(seed);
  for (int c = 0; c < cases; ++c) {
    const QkSpec s = random_qk_spec(rng, h.world_size());
    const QkData d = random_qk_data(rng, s, h.world_size());
    expect_qk_correct(s, d, run_qk(h, s, d), h.world_size());
    if (::testing::Test::HasFailure()) return;
  }
}

// A cos/sin cache that is 4-byte but not 16-byte aligned (a view into a larger tensor): the
// RoPE must not change (on GPUs it takes the one-float-at-a-time loads), at MiniMax-M2's shapes
// for this world size, both styles, 16-bit and fp32, in place and not.
inline void check_qk_unaligned_cache(Harness& h, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int world = h.world_size();
  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    for (RopeStyle rope : {RopeStyle::kNeox, RopeStyle::kInterleaved}) {
      for (int64_t offset : {0, 1, 3}) {
        QkSpec s = minimax_qk_spec(world, dtype, rope, 5);
        s.in_place = offset == 1;
        s.cache_offset = offset;
        if (dtype == DType::kFloat32) s.heads = std::min<int64_t>(s.heads, 8);
        const QkData d = random_qk_data(rng, s, world);
        expect_qk_correct(s, d, run_qk(h, s, d), world);
        if (::testing::Test::HasFailure()) return;
      }
    }
  }
}

// With identical slices on every rank, every rank must produce identical bits (the reduced
// variance is the same on every rank), and a repeat gives the same bits again.
inline void check_qk_identical_across_ranks(Harness& h, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (RopeStyle rope : {RopeStyle::kNone, RopeStyle::kNeox}) {
    QkSpec s;
    s.tokens = 9;
    s.rope = rope;
    const QkData d = random_qk_data(rng, s, h.world_size(), /*identical_ranks=*/true);
    const QkResult first = run_qk(h, s, d);
    const QkResult again = run_qk(h, s, d);
    for (int r = 0; r < h.world_size(); ++r) {
      EXPECT_TRUE(first.q[r].bytes == first.q[0].bytes) << describe(s) << " q rank " << r;
      EXPECT_TRUE(first.k[r].bytes == first.k[0].bytes) << describe(s) << " k rank " << r;
      EXPECT_TRUE(again.q[r].bytes == first.q[r].bytes) << describe(s) << " repeat rank " << r;
    }
    expect_qk_correct(s, d, first, h.world_size());
  }
}

// Zeros, NaN and Inf in q and k: rows of zeros normalize to zeros; a NaN or an Inf poisons its
// token's q (or k) exactly as the float64 reference says.
inline void check_qk_adversarial(Harness& h, uint64_t seed) {
  std::mt19937_64 rng(seed);
  QkSpec s;
  s.tokens = 4;
  s.heads = 4;
  s.kv_heads = 2;
  QkData d = random_qk_data(rng, s, h.world_size());
  for (int r = 0; r < h.world_size(); ++r) {
    for (int64_t e = 0; e < s.row(); ++e) d.qkv[r].set(size_t(0 * s.row() + e), r % 2 ? -0.0 : 0.0);
    d.qkv[r].set(size_t(1 * s.row() + 5), r == 0 ? NAN : 1.0);
    d.qkv[r].set(size_t(2 * s.row() + s.q_size() + 3), r == 0 ? INFINITY : 1.0);
    d.qkv[r].set(size_t(3 * s.row() + 7), 1e-40);
  }
  expect_qk_correct(s, d, run_qk(h, s, d), h.world_size());
}

// The local halves (qk_sum_squares on every rank, the sums added in rank order in fp32, then
// qk_rmsnorm_from_sums) give the fused op's bits exactly: the NCCL path's contract.
inline void expect_halves_give_fused_bits(Harness& h, const QkSpec& s, const QkData& d,
                                          const QkResult& fused) {
  const int world = h.world_size();
  const Backend backend = h.team()[0].backend();
  const std::vector<QkBuffers> b = upload_qk(h, s, d);
  std::vector<std::vector<float>> local(world, std::vector<float>(size_t(2 * s.tokens)));
  std::vector<float> global(size_t(2 * s.tokens));
  std::vector<void*> sums(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) sums[r] = h.allocate(r, global.size() * 4);
  h.run([&](int r, Stream stream) {
    qk_sum_squares(backend, qk_args(s, b[r], d.max_position, world), r % s.kv_replicas == 0,
                   static_cast<float*>(sums[r]), stream);
  });
  // The all-reduce, on the host: fp32, rank order 0..W-1, as the fused op's packets.
  for (int r = 0; r < world; ++r) {
    h.download(r, local[r].data(), sums[r], local[r].size() * 4);
    for (size_t i = 0; i < global.size(); ++i) {
      global[i] = r == 0 ? local[0][i] : global[i] + local[r][i];
    }
  }
  for (int r = 0; r < world; ++r) h.upload(r, sums[r], global.data(), global.size() * 4);
  h.run([&](int r, Stream stream) {
    qk_rmsnorm_from_sums(backend, qk_args(s, b[r], d.max_position, world),
                         static_cast<const float*>(sums[r]), stream);
  });
  const QkResult halves = download_qk(h, s, d, b);
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(halves.q[r].bytes == fused.q[r].bytes) << describe(s) << ": q of rank " << r;
    EXPECT_TRUE(halves.k[r].bytes == fused.k[r].bytes) << describe(s) << ": k of rank " << r;
  }
}

inline void check_qk_halves_match_fused(Harness& h, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (int c = 0; c < 6; ++c) {
    QkSpec s = random_qk_spec(rng, h.world_size());
    s.in_place = false;
    const QkData d = random_qk_data(rng, s, h.world_size());
    expect_halves_give_fused_bits(h, s, d, run_qk(h, s, d));
    if (::testing::Test::HasFailure()) return;
  }
}

// More tokens than a GPU's grid holds at once (blocks take several tokens each, the many-token
// kernel, which holds a group of tokens across the exchange): MiniMax-M2's heads for this world
// size in bf16 (one vector a thread) and fp32 (two), token counts that are no multiple of a group,
// every RoPE style, in place and not: the float64 reference, the halves' bits, and a repeat's
// bits; at 1100 tokens the cos/sin cache is not 16-byte aligned. GPU suites only (the CPU
// reference of this many tokens is slow).
inline void check_qk_many_tokens(Harness& h, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int world = h.world_size();
  for (const DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    for (const int64_t tokens : {1100, 2349}) {
      for (const RopeStyle rope : {RopeStyle::kNone, RopeStyle::kNeox, RopeStyle::kInterleaved}) {
        QkSpec s = minimax_qk_spec(world, dtype, rope, tokens);
        s.in_place = tokens == 2349 && rope != RopeStyle::kInterleaved;
        s.cache_offset = tokens == 1100 ? 1 : 0;
        const QkData d = random_qk_data(rng, s, world);
        const QkResult fused = run_qk(h, s, d);
        expect_qk_correct(s, d, fused, world);
        const QkResult again = run_qk(h, s, d);
        for (int r = 0; r < world; ++r) {
          EXPECT_TRUE(again.q[r].bytes == fused.q[r].bytes) << describe(s) << " repeat rank " << r;
          EXPECT_TRUE(again.k[r].bytes == fused.k[r].bytes) << describe(s) << " repeat rank " << r;
        }
        if (!s.in_place) expect_halves_give_fused_bits(h, s, d, fused);
        if (::testing::Test::HasFailure()) return;
      }
    }
  }
}

}  // namespace tpfuse::testing
