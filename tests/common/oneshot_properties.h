// The properties every backend of allreduce_add_rmsnorm / allreduce must have, written once and
// run by tests/cpu (CPU backend) and tests/gpu (CUDA backend):
//   - matches a float64 reference on fresh random inputs, every output element written;
//   - bitwise-identical outputs on every rank, and the same bits when a call is repeated;
//   - adversarial payloads (+-0, the sentinel's bits, denormals, huge values, Inf/NaN);
//   - long runs of back-to-back calls whose shapes and scales change from call to call.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "harness.h"
#include "reference.h"

namespace tpfuse::testing {

struct CaseSpec {
  DType dtype = DType::kBFloat16;
  int64_t tokens = 1;
  int64_t hidden = 3072;
  bool residual = true;
  bool residual_out = true;        // without a residual: whether the sum is written too
  bool norm_in_place = false;      // norm_out is the input tensor
  bool residual_in_place = false;  // residual_out is the residual tensor
  float eps = 1e-6f;
  bool plain_allreduce = false;            // tpfuse::allreduce of tokens * hidden elements
  Algorithm algorithm = Algorithm::kAuto;  // kAuto: the harness's algorithm
  NormWeight norm_weight = NormWeight::kGamma;
  QuantMode quant = QuantMode::kNone;  // an FP8 output of the norm too
  bool norm_out = true;                // with an FP8 output: whether the bf16 norm is kept
  float static_scale = 0.01f;          // QuantMode::kStatic's scale
  bool scales_column_major = false;    // the group modes' layout
  int moe_topk = 0;                    // > 0: the MoE finalize (CaseData::moe_*) in place of input
  bool moe_shared = false;             // with a shared expert's rows
  bool moe_weights_in_dtype = false;   // routing weights in dtype (else fp32)
};

struct CaseData {
  std::vector<HostTensor> inputs;     // per rank (the MoE finalize: each rank's contribution)
  std::vector<HostTensor> residuals;  // per rank (identical on every rank, as in TP)
  HostTensor gamma;
  // The MoE finalize, per rank: expert rows [tokens, topk, hidden], weights [tokens, topk],
  // the shared expert's rows [tokens, hidden].
  std::vector<HostTensor> moe_rows, moe_weights, moe_shared;
};

struct CaseResult {
  std::vector<HostTensor> residual_out;         // per rank
  std::vector<HostTensor> norm_out;             // per rank
  std::vector<std::vector<uint8_t>> quant_out;  // per rank, spec.quant only
  std::vector<std::vector<float>> scales;       // per rank, the dynamic modes only
  Algorithm algorithm = Algorithm::kAuto;       // what rank 0's call reported it ran
};

inline std::string describe(const CaseSpec& spec) {
  std::ostringstream out;
  out << dtype_name(spec.dtype) << " tokens=" << spec.tokens << " hidden=" << spec.hidden
      << (spec.plain_allreduce ? " allreduce" : "") << (spec.residual ? " residual" : "")
      << (spec.residual_out ? " residual_out" : "") << (spec.norm_in_place ? " norm_in_place" : "")
      << (spec.quant != QuantMode::kNone ? std::string(" quant=") + quant_mode_name(spec.quant)
                                         : "")
      << (spec.residual_in_place ? " residual_in_place" : "")
      << (spec.norm_out ? "" : " no_norm_out");
  if (spec.moe_topk > 0) {
    out << " moe_topk=" << spec.moe_topk << (spec.moe_shared ? " shared" : "")
        << (spec.moe_weights_in_dtype ? " weights_in_dtype" : " weights_fp32");
  }
  if (spec.norm_weight != NormWeight::kGamma) out << " " << norm_weight_name(spec.norm_weight);
  if (spec.algorithm != Algorithm::kAuto) out << " " << algorithm_name(spec.algorithm);
  return out.str();
}

inline CaseData random_case(std::mt19937_64& rng, const CaseSpec& spec, int world_size,
                            double scale = 1.0) {
  const size_t count = size_t(spec.tokens * spec.hidden);
  CaseData data;
  for (int r = 0; r < world_size; ++r)
    data.inputs.push_back(random_tensor(rng, spec.dtype, count, scale));
  const HostTensor residual = random_tensor(rng, spec.dtype, count, scale);
  for (int r = 0; r < world_size; ++r) data.residuals.push_back(residual);
  data.gamma = random_tensor(rng, spec.dtype, size_t(spec.hidden));
  for (size_t i = 0; i < data.gamma.count(); ++i) data.gamma.set(i, 1.0 + 0.25 * data.gamma.get(i));
  return data;
}

// Runs cases on a harness; keeps `sets` groups of per-rank buffers so that up to `sets` calls
// can be queued back to back, each on its own buffers, before any is checked.
class OneShotRunner {
 public:
  explicit OneShotRunner(Harness& harness, int sets = 1) : harness_(harness), sets_(sets) {}

  // Queues `specs.size()` (at most `sets`) calls back to back on every rank, then waits.
  std::vector<CaseResult> run_batch(const std::vector<CaseSpec>& specs,
                                    const std::vector<CaseData>& data) {
    std::vector<std::vector<Buffers>> buffers(specs.size());
    for (size_t c = 0; c < specs.size(); ++c) {
      buffers[c] = buffers_of(int(c), specs[c]);
      upload(specs[c], data[c], buffers[c]);
    }
    std::vector<Algorithm> ran(specs.size());
    try {
      harness_.enqueue([&](int rank, Stream stream) {
        for (size_t c = 0; c < specs.size(); ++c) {
          const Algorithm algorithm = call(specs[c], buffers[c][rank], rank, stream);
          if (rank == 0) ran[c] = algorithm;
        }
      });
      harness_.synchronize();
    } catch (...) {
      // Which calls were in flight: the first thing to know about a hang or a lost packet. (A
      // printout, not a failure: some tests expect the throw.)
      for (size_t c = 0; c < specs.size(); ++c) {
        std::fprintf(stderr, "in flight when the batch threw: call %zu: %s, rank 0 ran %s\n", c,
                     describe(specs[c]).c_str(), algorithm_name(ran[c]));
      }
      throw;
    }
    std::vector<CaseResult> results(specs.size());
    for (size_t c = 0; c < specs.size(); ++c) results[c] = download(specs[c], buffers[c], ran[c]);
    return results;
  }

  // One call captured once (a CUDA graph a rank on the GPU) and replayed on each of `data`'s
  // inputs, outputs poisoned before every replay: a result a replay.
  std::vector<CaseResult> run_replays(const CaseSpec& spec, const std::vector<CaseData>& data) {
    const std::vector<Buffers> buffers = buffers_of(0, spec);
    std::vector<Algorithm> ran(size_t(harness_.world_size()));
    std::vector<CaseResult> results(data.size());
    harness_.replay(
        [&](int rank, Stream stream) {
          ran[size_t(rank)] = call(spec, buffers[size_t(rank)], rank, stream);
        },
        int(data.size()), [&](int i) { upload(spec, data[size_t(i)], buffers); },
        [&](int i) { results[size_t(i)] = download(spec, buffers, ran[0]); });
    return results;
  }

  CaseResult run(const CaseSpec& spec, const CaseData& data) {
    return run_batch({spec}, {data}).front();
  }

  static bool writes_residual_out(const CaseSpec& spec) {
    return !spec.plain_allreduce && (spec.residual || spec.residual_out);
  }
  static size_t quant_bytes(const CaseSpec& spec) { return size_t(spec.tokens * spec.hidden); }
  // The dynamic scales a call writes: one a token, or one a group of kQuantGroupSize.
  static size_t scale_count(const CaseSpec& spec) {
    switch (spec.quant) {
      case QuantMode::kPerToken:
        return size_t(spec.tokens);
      case QuantMode::kPerTokenGroup128:
      case QuantMode::kPerTokenGroup128Ue8m0:
        return size_t(spec.tokens * (spec.hidden / kQuantGroupSize));
      default:
        return 0;
    }
  }

 private:
  struct Buffers {
    void* input = nullptr;
    void* residual = nullptr;
    void* gamma = nullptr;
    void* residual_out = nullptr;
    void* norm_out = nullptr;
    void* quant_out = nullptr;  // bytes / 2 of them: E4M3 of a 16-bit (or wider) element each
    void* scales = nullptr;     // fp32 scales: at most one per 8 elements
    void* scale = nullptr;      // the static scale
    void* moe_rows = nullptr;   // MoE finalize: topk rows a token
    void* moe_weights = nullptr;
    void* moe_shared = nullptr;
    size_t bytes = 0;
    size_t gamma_bytes = 0;
    size_t moe_bytes = 0;
    size_t moe_shared_bytes = 0;
  };

  // Every rank's buffers of set `set`, large enough for `spec`.
  std::vector<Buffers> buffers_of(int set, const CaseSpec& spec) {
    const size_t bytes = size_t(spec.tokens * spec.hidden) * dtype_size(spec.dtype);
    std::vector<Buffers> buffers(size_t(harness_.world_size()));
    for (int r = 0; r < harness_.world_size(); ++r) {
      buffers[size_t(r)] = buffers_for(set, r, bytes, spec.hidden, spec.moe_topk);
    }
    return buffers;
  }

  // A case's inputs into every rank's buffers, its outputs poisoned.
  void upload(const CaseSpec& spec, const CaseData& data, const std::vector<Buffers>& buffers) {
    const size_t bytes = size_t(spec.tokens * spec.hidden) * dtype_size(spec.dtype);
    const HostTensor poison = poisoned(spec.dtype, size_t(spec.tokens * spec.hidden));
    for (int r = 0; r < harness_.world_size(); ++r) {
      const Buffers& b = buffers[size_t(r)];
      if (spec.moe_topk > 0) {
        harness_.upload(r, b.moe_rows, data.moe_rows[r].data(), bytes * spec.moe_topk);
        harness_.upload(r, b.moe_weights, data.moe_weights[r].data(),
                        data.moe_weights[r].bytes.size());
        if (spec.moe_shared) harness_.upload(r, b.moe_shared, data.moe_shared[r].data(), bytes);
        // The input buffer (norm_out in place) starts poisoned: the call must not read it.
        harness_.upload(r, b.input, poison.data(), bytes);
      } else {
        harness_.upload(r, b.input, data.inputs[r].data(), bytes);
      }
      if (spec.residual) harness_.upload(r, b.residual, data.residuals[r].data(), bytes);
      harness_.upload(r, b.gamma, data.gamma.data(), data.gamma.bytes.size());
      if (!spec.norm_in_place) harness_.upload(r, b.norm_out, poison.data(), bytes);
      if (!spec.residual_in_place) harness_.upload(r, b.residual_out, poison.data(), bytes);
      if (spec.quant != QuantMode::kNone) {
        const std::vector<uint8_t> poison_bytes(quant_bytes(spec), 0x5a);
        harness_.upload(r, b.quant_out, poison_bytes.data(), poison_bytes.size());
        const std::vector<float> poison_scales(scale_count(spec) + 1, std::nanf(""));
        harness_.upload(r, b.scales, poison_scales.data(), poison_scales.size() * 4);
        harness_.upload(r, b.scale, &spec.static_scale, 4);
      }
    }
  }

  // A case's outputs from every rank.
  CaseResult download(const CaseSpec& spec, const std::vector<Buffers>& buffers, Algorithm ran) {
    CaseResult result;
    result.algorithm = ran;
    const size_t count = size_t(spec.tokens * spec.hidden);
    for (int r = 0; r < harness_.world_size(); ++r) {
      const Buffers& b = buffers[size_t(r)];
      HostTensor norm(spec.dtype, count), residual_out(spec.dtype, count);
      harness_.download(r, norm.data(), spec.norm_in_place ? b.input : b.norm_out,
                        norm.bytes.size());
      if (writes_residual_out(spec)) {
        harness_.download(r, residual_out.data(),
                          spec.residual_in_place ? b.residual : b.residual_out,
                          residual_out.bytes.size());
      }
      result.norm_out.push_back(std::move(norm));
      result.residual_out.push_back(std::move(residual_out));
      if (spec.quant != QuantMode::kNone) {
        std::vector<uint8_t> quant(quant_bytes(spec));
        std::vector<float> scales(scale_count(spec));
        harness_.download(r, quant.data(), b.quant_out, quant.size());
        if (!scales.empty()) harness_.download(r, scales.data(), b.scales, scales.size() * 4);
        result.quant_out.push_back(std::move(quant));
        result.scales.push_back(std::move(scales));
      }
    }
    return result;
  }

  Buffers buffers_for(int set, int rank, size_t bytes, int64_t hidden, int topk) {
    if (pool_.empty()) pool_.assign(sets_, std::vector<Buffers>(harness_.world_size()));
    Buffers& b = pool_[set][rank];
    if (topk > 0 && b.moe_bytes < bytes * size_t(topk)) {
      b.moe_bytes = std::max(bytes * size_t(topk), b.moe_bytes * 2);
      b.moe_rows = harness_.allocate(rank, b.moe_bytes);
      // Weights: tokens * topk of at most 4 bytes, fewer than the rows' bytes / 2 (hidden >= 8).
      b.moe_weights = harness_.allocate(rank, b.moe_bytes / 2 + 16);
    }
    if (topk > 0 && b.moe_shared_bytes < bytes) {
      b.moe_shared_bytes = std::max(bytes, b.moe_shared_bytes * 2);
      b.moe_shared = harness_.allocate(rank, b.moe_shared_bytes);
    }
    const size_t gamma_bytes = size_t(hidden) * 4;
    if (b.bytes < bytes || b.gamma_bytes < gamma_bytes) {
      b.bytes = std::max(bytes, b.bytes * 2);
      b.gamma_bytes = std::max(gamma_bytes, b.gamma_bytes);
      b.input = harness_.allocate(rank, b.bytes);
      b.residual = harness_.allocate(rank, b.bytes);
      b.residual_out = harness_.allocate(rank, b.bytes);
      b.norm_out = harness_.allocate(rank, b.bytes);
      b.gamma = harness_.allocate(rank, b.gamma_bytes);
      b.quant_out = harness_.allocate(rank, b.bytes / 2);
      b.scales = harness_.allocate(rank, b.bytes / 4 + 16);
      b.scale = harness_.allocate(rank, 16);
    }
    return b;
  }

  Algorithm call(const CaseSpec& spec, const Buffers& b, int rank, Stream stream) {
    const Team& team = harness_.team()[rank];
    const Algorithm algorithm =
        spec.algorithm != Algorithm::kAuto ? spec.algorithm : harness_.algorithm;
    if (spec.plain_allreduce) {
      return allreduce(team, b.input, spec.norm_in_place ? b.input : b.norm_out,
                       spec.tokens * spec.hidden, spec.dtype, stream, algorithm);
    }
    AddRmsNormArgs args;
    args.input = spec.moe_topk > 0 ? nullptr : b.input;
    if (spec.moe_topk > 0) {
      args.moe_expert_rows = b.moe_rows;
      args.moe_weights = b.moe_weights;
      args.moe_shared = spec.moe_shared ? b.moe_shared : nullptr;
      args.moe_topk = spec.moe_topk;
      args.moe_weights_in_dtype = spec.moe_weights_in_dtype;
    }
    args.residual = spec.residual ? b.residual : nullptr;
    args.gamma = b.gamma;
    args.norm_out = !spec.norm_out ? nullptr : spec.norm_in_place ? b.input : b.norm_out;
    if (writes_residual_out(spec)) {
      args.residual_out = spec.residual_in_place ? b.residual : b.residual_out;
    }
    args.tokens = spec.tokens;
    args.hidden = spec.hidden;
    args.dtype = spec.dtype;
    args.eps = spec.eps;
    args.norm_weight = spec.norm_weight;
    args.algorithm = algorithm;
    args.quant = spec.quant;
    if (spec.quant != QuantMode::kNone) {
      args.quant_out = b.quant_out;
      if (spec.quant == QuantMode::kStatic) {
        args.quant_scale = static_cast<const float*>(b.scale);
      } else {
        args.scales_out = static_cast<float*>(b.scales);
        args.scales_column_major = spec.scales_column_major;
      }
    }
    return allreduce_add_rmsnorm(team, args, stream);
  }

  Harness& harness_;
  int sets_;
  std::vector<std::vector<Buffers>> pool_;
};

// Checks one call's outputs against the float64 reference and across ranks (bitwise).
// Whether a mode has a scale a group of kQuantGroupSize.
inline bool group_mode(QuantMode mode) {
  return mode == QuantMode::kPerTokenGroup128 || mode == QuantMode::kPerTokenGroup128Ue8m0;
}

// The FP8 output against its definition (tpfuse.h, QuantMode), computed here from each rank's
// norm_out as stored: the scales bit for bit (max |n| of the token or group, floored at
// kQuantMinAmax, / 448 in fp32; for kPerTokenGroup128Ue8m0 2^ceil(log2(that quotient)) in
// float64), every byte the independent E4M3 reference of n / scale (fp32 division), identical
// bits on every rank. norm_out itself is checked against float64 above.
inline void expect_quant_correct(const CaseSpec& spec, const CaseResult& result) {
  const int64_t groups = spec.hidden / kQuantGroupSize;
  for (size_t r = 0; r < result.norm_out.size(); ++r) {
    const HostTensor& norm = result.norm_out[r];
    const std::vector<uint8_t>& quant = result.quant_out.at(r);
    const std::vector<float>& scales = result.scales.at(r);
    int wrong = 0;
    for (int64_t t = 0; t < spec.tokens && wrong < 5; ++t) {
      const auto n = [&](int64_t i) { return float(norm.get(size_t(t * spec.hidden + i))); };
      const auto scale_over = [&](int64_t begin, int64_t end) {
        float amax = 0.0f;
        for (int64_t i = begin; i < end; ++i) {
          if (!std::isnan(n(i))) amax = std::max(amax, std::fabs(n(i)));
        }
        if (spec.quant == QuantMode::kPerTokenGroup128Ue8m0) {
          const double quotient = std::max(double(amax), double(kQuantMinAmax)) / 448.0;
          return float(std::pow(2.0, std::ceil(std::log2(quotient))));
        }
        return std::max(amax, kQuantMinAmax) / 448.0f;
      };
      // The token's scale, or its group's (each taken once, at the token's or group's start).
      float scale = spec.static_scale;
      for (int64_t i = 0; i < spec.hidden && wrong < 5; ++i) {
        if (spec.quant == QuantMode::kPerToken && i == 0) {
          scale = scale_over(0, spec.hidden);
          if (impl::float_bits(scales[size_t(t)]) != impl::float_bits(scale)) {
            ADD_FAILURE() << describe(spec) << " rank " << r << ": scale of token " << t << " is "
                          << scales[size_t(t)] << ", expected " << scale;
            ++wrong;
          }
        } else if (group_mode(spec.quant) && i % kQuantGroupSize == 0) {
          const int64_t g = i / kQuantGroupSize;
          scale = scale_over(g * kQuantGroupSize, (g + 1) * kQuantGroupSize);
          const size_t at = size_t(spec.scales_column_major ? g * spec.tokens + t : t * groups + g);
          if (impl::float_bits(scales[at]) != impl::float_bits(scale)) {
            ADD_FAILURE() << describe(spec) << " rank " << r << ": scale of token " << t
                          << " group " << g << " is " << scales[at] << ", expected " << scale
                          << (spec.scales_column_major ? " (column-major)" : "");
            ++wrong;
          }
        }
        const uint8_t expected = reference_e4m3(n(i) / scale);
        const uint8_t got = quant[size_t(t * spec.hidden + i)];
        if (got != expected) {
          ADD_FAILURE() << describe(spec) << " rank " << r << ": quant_out[" << t << ", " << i
                        << "] = 0x" << std::hex << int(got) << ", expected 0x" << int(expected)
                        << std::dec << " (norm " << n(i) << " / scale " << scale << ")";
          ++wrong;
        }
      }
    }
  }
  for (size_t r = 1; r < result.quant_out.size(); ++r) {
    EXPECT_TRUE(result.quant_out[r] == result.quant_out[0])
        << describe(spec) << ": quant_out of rank " << r << " differs in bits from rank 0";
    EXPECT_TRUE(result.scales[r] == result.scales[0])
        << describe(spec) << ": the scales of rank " << r << " differ from rank 0's";
  }
}

inline void expect_correct(const CaseSpec& spec, const CaseData& data, const CaseResult& result) {
  const double u = unit_roundoff(spec.dtype);
  const double accumulation = std::ldexp(1.0, -20);  // fp32 sums of <= 17 terms
  // One ulp of the dtype's subnormals: the absolute rounding error floor.
  const double tiny16 = spec.dtype == DType::kFloat16    ? std::ldexp(1.0, -24)
                        : spec.dtype == DType::kBFloat16 ? std::ldexp(1.0, -133)
                                                         : std::ldexp(1.0, -149);
  const Reference ref = reference_add_rmsnorm(
      data.inputs, spec.residual && !spec.plain_allreduce ? &data.residuals[0] : nullptr,
      data.gamma, spec.tokens, spec.hidden, spec.eps, spec.norm_weight);
  const size_t count = ref.residual_out.size();
  // The NCCL path rounds the rank sum to the dtype before the residual add: one more rounding
  // of a value at most `magnitude`.
  const double extra = result.algorithm == Algorithm::kNccl ? u : 0.0;
  std::vector<double> residual_tolerance(count), norm_tolerance(count);
  for (size_t i = 0; i < count; ++i) {
    residual_tolerance[i] =
        u * std::fabs(ref.residual_out[i]) + (accumulation + extra) * ref.magnitude[i] + tiny16;
    // The norm sees residual_out rounded (u), the rms of rounded values, and its own rounding;
    // the fp32 sum of squares over the row adds up to hidden * 2^-24 relative to the variance.
    const double variance_error = 0.5 * double(spec.hidden) * std::ldexp(1.0, -24);
    norm_tolerance[i] = (4 * u + variance_error) * std::fabs(ref.norm_out[i]) +
                        (2 * u + accumulation + 2 * extra) * ref.norm_scale[i] + tiny16;
  }
  for (size_t r = 0; r < result.norm_out.size(); ++r) {
    const std::string where = describe(spec) + " rank " + std::to_string(r);
    if (spec.plain_allreduce) {
      EXPECT_EQ(compare(result.norm_out[r], ref.residual_out, residual_tolerance, "out"), "")
          << where;
      continue;
    }
    EXPECT_EQ(compare(result.norm_out[r], ref.norm_out, norm_tolerance, "norm_out"), "") << where;
    if (OneShotRunner::writes_residual_out(spec)) {
      EXPECT_EQ(
          compare(result.residual_out[r], ref.residual_out, residual_tolerance, "residual_out"), "")
          << where;
    }
  }
  for (size_t r = 1; r < result.norm_out.size(); ++r) {
    EXPECT_TRUE(result.norm_out[r].bytes == result.norm_out[0].bytes)
        << describe(spec) << ": norm_out of rank " << r << " differs in bits from rank 0";
    EXPECT_TRUE(result.residual_out[r].bytes == result.residual_out[0].bytes)
        << describe(spec) << ": residual_out of rank " << r << " differs in bits from rank 0";
  }
  if (spec.quant != QuantMode::kNone) expect_quant_correct(spec, result);
}

inline constexpr std::array<int64_t, 12> kHiddenSizes = {8,    24,   40,   136,  1000,  3072,
                                                         4096, 5120, 7168, 8192, 12288, 16384};
inline constexpr std::array<DType, 3> kDTypes = {DType::kBFloat16, DType::kFloat16,
                                                 DType::kFloat32};

inline CaseSpec random_spec(std::mt19937_64& rng, int64_t max_tokens) {
  CaseSpec spec;
  spec.dtype = kDTypes[rng() % kDTypes.size()];
  spec.hidden = kHiddenSizes[rng() % kHiddenSizes.size()];
  spec.tokens = 1 + int64_t(rng() % uint64_t(max_tokens));
  spec.residual = rng() % 4 != 0;
  spec.residual_out = spec.residual || rng() % 2 == 0;
  spec.norm_in_place = rng() % 4 == 0;
  spec.residual_in_place = spec.residual && rng() % 4 == 0;
  spec.plain_allreduce = rng() % 8 == 0;
  if (spec.plain_allreduce) spec.residual_in_place = false;
  spec.eps = rng() % 2 ? 1e-6f : 1e-5f;
  return spec;
}

// Most tokens the harness's algorithm carries for this spec.
inline int64_t max_tokens_of(Harness& harness, const CaseSpec& spec) {
  return harness.team()[0].max_tokens(spec.hidden, spec.dtype, harness.algorithm);
}

// Random shapes, dtypes, residual forms and in-place use.
inline void check_random_cases(Harness& harness, uint64_t seed, int cases, int64_t max_tokens) {
  std::mt19937_64 rng(seed);
  OneShotRunner runner(harness);
  for (int c = 0; c < cases; ++c) {
    CaseSpec spec = random_spec(rng, max_tokens);
    spec.tokens = std::min(spec.tokens, max_tokens_of(harness, spec));
    const CaseData data = random_case(rng, spec, harness.world_size());
    expect_correct(spec, data, runner.run(spec, data));
    if (::testing::Test::HasFailure()) return;
  }
}

// The same inputs twice give the same bits.
inline void check_repeatable(Harness& harness, uint64_t seed) {
  std::mt19937_64 rng(seed);
  OneShotRunner runner(harness);
  for (DType dtype : kDTypes) {
    CaseSpec spec;
    spec.dtype = dtype;
    spec.tokens = 7;
    spec.hidden = 4096;
    const CaseData data = random_case(rng, spec, harness.world_size());
    const CaseResult first = runner.run(spec, data);
    for (int repeat = 0; repeat < 4; ++repeat) {
      const CaseResult again = runner.run(spec, data);
      for (int r = 0; r < harness.world_size(); ++r) {
        EXPECT_TRUE(again.norm_out[r].bytes == first.norm_out[r].bytes)
            << describe(spec) << " repeat " << repeat << " rank " << r;
        EXPECT_TRUE(again.residual_out[r].bytes == first.residual_out[r].bytes)
            << describe(spec) << " repeat " << repeat << " rank " << r;
      }
    }
  }
}

// Payloads built to break a Lamport implementation or an epilogue.
inline void check_adversarial(Harness& harness, uint64_t seed) {
  std::mt19937_64 rng(seed);
  OneShotRunner runner(harness);
  const int world = harness.world_size();
  enum Kind { kSignedZeros, kSentinelBits, kDenormals, kHuge, kInfinities, kNaN, kMixed };
  for (DType dtype : kDTypes) {
    for (int kind = kSignedZeros; kind <= kMixed; ++kind) {
      CaseSpec spec;
      spec.dtype = dtype;
      spec.tokens = 5;
      spec.hidden = 1000;
      CaseData data = random_case(rng, spec, world);
      const size_t count = size_t(spec.tokens * spec.hidden);
      for (int r = 0; r < world; ++r) {
        HostTensor& in = data.inputs[r];
        for (size_t i = 0; i < count; ++i) {
          const bool token_even = (i / size_t(spec.hidden)) % 2 == 0;
          switch (kind) {
            case kSignedZeros:
              in.set(i, (i + r) % 2 ? -0.0 : 0.0);
              break;
            case kSentinelBits:
              // Words equal to 0x80000000: -0.0f in fp32; (+0 low, -0 high) pairs in 16 bits.
              // Tokens alternate between all-sentinel rows and half-sentinel rows.
              if (token_even || i % 16 < 8) {
                if (dtype == DType::kFloat32) {
                  in.set_bits32(i, 0x80000000u);
                } else {
                  in.set_bits16(i, i % 2 ? 0x8000 : 0x0000);
                }
              }
              break;
            case kDenormals:
              in.set(i, (dtype == DType::kFloat16 ? 3e-6 : 3e-39) * (in.get(i) > 0 ? 1 : -1) *
                            double(1 + i % 7));
              break;
            case kHuge:
              in.set(i, in.get(i) * (dtype == DType::kFloat16 ? 1e3 : 1e15));
              break;
            case kInfinities:
              if (i % 97 == size_t(r)) in.set(i, (i / 97) % 2 ? INFINITY : -INFINITY);
              break;
            case kNaN:
              if (i == size_t(3 * spec.hidden + 17 + r)) in.set(i, NAN);
              break;
            case kMixed:
              if (i % 5 == 0) in.set(i, 0.0);
              if (i % 5 == 1) in.set(i, -0.0);
              if (i % 11 == 2) in.set(i, 1e-40);
              break;
          }
        }
      }
      if (kind == kSignedZeros || kind == kDenormals) {
        for (int r = 0; r < world; ++r) data.residuals[r] = data.inputs[0];
      }
      if (kind == kHuge) {
        for (int r = 0; r < world; ++r) {
          for (size_t i = 0; i < count; ++i) data.residuals[r].set(i, data.inputs[0].get(i));
        }
      }
      SCOPED_TRACE("adversarial kind " + std::to_string(kind));
      for (bool residual : {true, false}) {
        spec.residual = residual;
        expect_correct(spec, data, runner.run(spec, data));
      }
      spec.residual = true;
      spec.plain_allreduce = true;
      expect_correct(spec, data, runner.run(spec, data));
      if (::testing::Test::HasFailure()) return;
    }
  }
}

// Back-to-back calls in batches of `batch` (queued without waiting between them on the GPU),
// shapes growing and shrinking and input scales alternating 1 / 1000 from call to call, so a
// call that read a stale slot, or a slot not cleared after a bigger call, gets caught.
inline void check_consecutive_calls(Harness& harness, uint64_t seed, int calls, int batch,
                                    int64_t max_tokens) {
  std::mt19937_64 rng(seed);
  OneShotRunner runner(harness, batch);
  int done = 0;
  while (done < calls) {
    std::vector<CaseSpec> specs;
    std::vector<CaseData> data;
    for (int c = 0; c < batch && done < calls; ++c, ++done) {
      CaseSpec spec;
      spec.dtype = done % 50 < 25 ? DType::kBFloat16 : kDTypes[rng() % kDTypes.size()];
      spec.hidden = done % 3 == 0 ? 3072 : kHiddenSizes[rng() % kHiddenSizes.size()];
      // Every few calls a large one, then small ones: the clear must cover the large one.
      spec.tokens = done % 7 == 0 ? max_tokens : 1 + int64_t(rng() % 9);
      spec.tokens = std::min<int64_t>(spec.tokens, 65536 / spec.hidden + 1);
      spec.residual = done % 5 != 4;
      // With no algorithm forced, one-shot and two-shot alternate at random: they share the
      // slots, so each must clear what the other wrote.
      if (harness.algorithm == Algorithm::kAuto) {
        spec.algorithm = rng() % 2 ? Algorithm::kOneShot : Algorithm::kTwoShot;
      }
      specs.push_back(spec);
      data.push_back(random_case(rng, spec, harness.world_size(), done % 2 ? 1000.0 : 1.0));
    }
    const std::vector<CaseResult> results = runner.run_batch(specs, data);
    for (size_t c = 0; c < specs.size(); ++c) {
      SCOPED_TRACE("call " + std::to_string(done - int(specs.size()) + int(c)));
      expect_correct(specs[c], data[c], results[c]);
    }
    if (::testing::Test::HasFailure()) return;
  }
}

// Batch invariance: a token's outputs have the same bits whichever fused algorithm ran and
// whatever batch the token came in (one-shot and two-shot, the whole batch and its first half).
inline void check_batch_invariance(Harness& harness, uint64_t seed) {
  std::mt19937_64 rng(seed);
  OneShotRunner runner(harness);
  for (DType dtype : kDTypes) {
    for (int64_t hidden : {int64_t(40), int64_t(3072)}) {
      CaseSpec spec;
      spec.dtype = dtype;
      spec.hidden = hidden;
      spec.tokens = 2 * harness.world_size() + 3;  // owned ranges of unequal length
      spec.residual = rng() % 2 == 0;
      spec.residual_out = true;
      const CaseData data = random_case(rng, spec, harness.world_size());
      spec.algorithm = Algorithm::kOneShot;
      const CaseResult oneshot = runner.run(spec, data);
      expect_correct(spec, data, oneshot);
      spec.algorithm = Algorithm::kTwoShot;
      const CaseResult twoshot = runner.run(spec, data);
      expect_correct(spec, data, twoshot);
      EXPECT_EQ(twoshot.algorithm, Algorithm::kTwoShot);
      for (int r = 0; r < harness.world_size(); ++r) {
        EXPECT_TRUE(twoshot.norm_out[r].bytes == oneshot.norm_out[r].bytes)
            << describe(spec) << ": two-shot norm_out differs in bits from one-shot, rank " << r;
        EXPECT_TRUE(twoshot.residual_out[r].bytes == oneshot.residual_out[r].bytes)
            << describe(spec) << ": two-shot residual_out differs from one-shot, rank " << r;
      }
      // The first half of the batch alone, two-shot: the same bits for those tokens.
      CaseSpec half = spec;
      half.tokens = spec.tokens / 2;
      CaseData half_data = data;
      const size_t half_bytes = size_t(half.tokens * hidden) * dtype_size(dtype);
      for (auto* tensors : {&half_data.inputs, &half_data.residuals}) {
        for (HostTensor& tensor : *tensors) tensor.bytes.resize(half_bytes);
      }
      const CaseResult alone = runner.run(half, half_data);
      for (int r = 0; r < harness.world_size(); ++r) {
        EXPECT_TRUE(std::equal(alone.norm_out[r].bytes.begin(), alone.norm_out[r].bytes.end(),
                               oneshot.norm_out[r].bytes.begin()))
            << describe(half) << ": a token's bits depend on its batch, rank " << r;
      }
      if (::testing::Test::HasFailure()) return;
    }
  }
}

// The (1 + gamma) weight (NormWeight::kOnePlusGamma): random cases against the float64
// reference; then, with gamma on a grid where 1 + gamma is exact in every dtype, the same bits as
// the plain weight given 1 + gamma (the one-plus is done in fp32 before the one rounding); and,
// where the team runs the fused kernels, one-shot and two-shot agree bit for bit.
inline void check_one_plus_gamma(Harness& harness, uint64_t seed, int cases, int64_t max_tokens) {
  std::mt19937_64 rng(seed);
  OneShotRunner runner(harness);
  for (int c = 0; c < cases; ++c) {
    CaseSpec spec = random_spec(rng, max_tokens);
    spec.plain_allreduce = false;
    spec.norm_weight = NormWeight::kOnePlusGamma;
    spec.tokens = std::min(spec.tokens, max_tokens_of(harness, spec));
    CaseData data = random_case(rng, spec, harness.world_size());
    // Gemma-style weights are centered on zero: gamma near 0, some exactly -1 (a zero weight).
    for (size_t i = 0; i < data.gamma.count(); ++i) {
      data.gamma.set(i, i % 17 == 0 ? -1.0 : 0.25 * (data.gamma.get(i) - 1.0));
    }
    expect_correct(spec, data, runner.run(spec, data));
    if (::testing::Test::HasFailure()) return;
  }
  for (DType dtype : kDTypes) {
    CaseSpec spec;
    spec.dtype = dtype;
    spec.tokens = 2 * harness.world_size() + 3;
    spec.hidden = 3072;
    spec.norm_weight = NormWeight::kOnePlusGamma;
    CaseData data = random_case(rng, spec, harness.world_size());
    CaseData shifted = data;
    for (size_t i = 0; i < data.gamma.count(); ++i) {
      const double g = double(int64_t(rng() % 33) - 16) / 8.0;  // -2 .. 2 in steps of 1/8
      data.gamma.set(i, g);
      shifted.gamma.set(i, 1.0 + g);
    }
    const CaseResult one_plus = runner.run(spec, data);
    expect_correct(spec, data, one_plus);
    CaseSpec plain = spec;
    plain.norm_weight = NormWeight::kGamma;
    const CaseResult reference = runner.run(plain, shifted);
    for (int r = 0; r < harness.world_size(); ++r) {
      EXPECT_TRUE(one_plus.norm_out[r].bytes == reference.norm_out[r].bytes)
          << describe(spec) << ": (1 + gamma) differs from gamma' = 1 + gamma, rank " << r;
      EXPECT_TRUE(one_plus.residual_out[r].bytes == reference.residual_out[r].bytes)
          << describe(spec) << ": residual_out depends on the weight, rank " << r;
    }
    if (harness.team()[0].fallback_reason().empty() && harness.algorithm == Algorithm::kAuto) {
      spec.algorithm = Algorithm::kOneShot;
      const CaseResult oneshot = runner.run(spec, data);
      spec.algorithm = Algorithm::kTwoShot;
      const CaseResult twoshot = runner.run(spec, data);
      for (int r = 0; r < harness.world_size(); ++r) {
        EXPECT_TRUE(twoshot.norm_out[r].bytes == oneshot.norm_out[r].bytes)
            << describe(spec) << ": two-shot differs in bits from one-shot, rank " << r;
      }
    }
    if (::testing::Test::HasFailure()) return;
  }
}

// A one-rank team has nothing to exchange: every algorithm gives the bits of add_rmsnorm (the
// local epilogue) on the same inputs, with and without a residual, in place or not, and matches
// the float64 reference.
inline void check_one_rank_team_is_local(Harness& harness, uint64_t seed) {
  ASSERT_EQ(harness.world_size(), 1);
  std::mt19937_64 rng(seed);
  OneShotRunner runner(harness);
  const Team& team = harness.team()[0];
  for (int c = 0; c < 24; ++c) {
    CaseSpec spec = random_spec(rng, 300);
    spec.algorithm = Algorithm::kAuto;
    const CaseData data = random_case(rng, spec, 1);
    const CaseResult automatic = runner.run(spec, data);
    expect_correct(spec, data, automatic);
    for (const Algorithm algorithm : {Algorithm::kOneShot, Algorithm::kTwoShot, Algorithm::kNccl}) {
      if (spec.tokens > team.max_tokens(spec.hidden, spec.dtype, algorithm)) continue;
      CaseSpec forced = spec;
      forced.algorithm = algorithm;
      const CaseResult result = runner.run(forced, data);
      EXPECT_TRUE(result.norm_out[0].bytes == automatic.norm_out[0].bytes)
          << describe(forced) << ": " << algorithm_name(algorithm) << " vs auto";
      EXPECT_TRUE(result.residual_out[0].bytes == automatic.residual_out[0].bytes)
          << describe(forced) << ": " << algorithm_name(algorithm) << " vs auto";
    }
    if (!spec.residual || spec.plain_allreduce) continue;
    // add_rmsnorm on the same inputs, into fresh outputs.
    const size_t count = size_t(spec.tokens * spec.hidden);
    const size_t bytes = count * dtype_size(spec.dtype);
    void* input = harness.allocate(0, bytes);
    void* residual = harness.allocate(0, bytes);
    void* gamma = harness.allocate(0, data.gamma.bytes.size());
    void* residual_out = harness.allocate(0, bytes);
    void* norm_out = harness.allocate(0, bytes);
    harness.upload(0, input, data.inputs[0].data(), bytes);
    harness.upload(0, residual, data.residuals[0].data(), bytes);
    harness.upload(0, gamma, data.gamma.data(), data.gamma.bytes.size());
    AddRmsNormArgs args;
    args.input = input;
    args.residual = residual;
    args.gamma = gamma;
    args.residual_out = residual_out;
    args.norm_out = norm_out;
    args.tokens = spec.tokens;
    args.hidden = spec.hidden;
    args.dtype = spec.dtype;
    args.eps = spec.eps;
    args.norm_weight = spec.norm_weight;
    harness.run([&](int, Stream stream) { add_rmsnorm(team.backend(), args, stream); });
    HostTensor local_norm(spec.dtype, count), local_residual(spec.dtype, count);
    harness.download(0, local_norm.data(), norm_out, bytes);
    harness.download(0, local_residual.data(), residual_out, bytes);
    EXPECT_TRUE(local_norm.bytes == automatic.norm_out[0].bytes) << describe(spec);
    if (spec.residual_out) {
      EXPECT_TRUE(local_residual.bytes == automatic.residual_out[0].bytes) << describe(spec);
    }
    if (::testing::Test::HasFailure()) return;
  }
}

// A call that left the bf16 norm out (`bare`, spec.norm_out false, norm not in place) against
// the same call keeping it: the same bits in every other output, and nothing written where the
// norm would have gone (its buffer still poisoned).
inline void expect_same_bits_without_norm(const CaseSpec& bare, const CaseResult& with_norm,
                                          const CaseResult& result) {
  const HostTensor poison = poisoned(bare.dtype, size_t(bare.tokens * bare.hidden));
  for (size_t r = 0; r < result.norm_out.size(); ++r) {
    EXPECT_TRUE(result.norm_out[r].bytes == poison.bytes)
        << describe(bare) << ": rank " << r << " wrote its norm_out buffer";
    EXPECT_TRUE(result.residual_out[r].bytes == with_norm.residual_out[r].bytes)
        << describe(bare) << ": residual_out of rank " << r << " differs from the call keeping "
        << "the norm";
  }
  EXPECT_TRUE(result.quant_out == with_norm.quant_out)
      << describe(bare) << ": quant_out differs from the call keeping the norm";
  EXPECT_TRUE(result.scales == with_norm.scales)
      << describe(bare) << ": the scales differ from the call keeping the norm";
}

// The FP8 output in each mode: random shapes (hidden a multiple of 128 with an odd number of
// groups among them, widths whose 16-bit rows take two vectors a thread on the GPU among them,
// tokens not a multiple of 4), residual or not, both weights, in place or
// not; static scales small enough to saturate some elements (0.004: norms past 1.8), and every
// fifth case a token of zeros on every rank (the dynamic scales' floor, zero bytes), every
// seventh a NaN in one rank's input. Every check of expect_correct and expect_quant_correct, and
// norm_out the same bits as without FP8.
inline void check_fp8_outputs(Harness& harness, uint64_t seed, int cases) {
  std::mt19937_64 rng(seed);
  OneShotRunner runner(harness);
  const QuantMode modes[] = {QuantMode::kStatic, QuantMode::kPerToken, QuantMode::kPerTokenGroup128,
                             QuantMode::kPerTokenGroup128Ue8m0};
  const int64_t widths[] = {128, 384, 1152, 3072, 4096, 4224, 7168};
  for (int c = 0; c < cases; ++c) {
    CaseSpec spec;
    spec.dtype = kDTypes[rng() % kDTypes.size()];
    spec.hidden = widths[rng() % std::size(widths)];
    spec.tokens = 1 + int64_t(rng() % 23);
    spec.residual = rng() % 4 != 0;
    spec.residual_out = spec.residual || rng() % 2 == 0;
    spec.norm_in_place = rng() % 4 == 0;
    spec.residual_in_place = spec.residual && rng() % 4 == 0;
    spec.norm_weight = rng() % 3 == 0 ? NormWeight::kOnePlusGamma : NormWeight::kGamma;
    spec.quant = modes[c % std::size(modes)];
    spec.static_scale = rng() % 2 ? 0.004f : 0.02f;
    spec.scales_column_major = group_mode(spec.quant) && rng() % 2 == 0;
    spec.tokens = std::min(spec.tokens, max_tokens_of(harness, spec));
    CaseData data = random_case(rng, spec, harness.world_size());
    if (c % 5 == 4) {
      // Token 0 all zeros on every rank (residual too): the scale's floor, zero bytes.
      for (int r = 0; r < harness.world_size(); ++r) {
        std::memset(data.inputs[r].data(), 0, size_t(spec.hidden) * dtype_size(spec.dtype));
      }
      if (spec.residual) {
        for (auto& residual : data.residuals) {
          std::memset(residual.data(), 0, size_t(spec.hidden) * dtype_size(spec.dtype));
        }
      }
    }
    if (c % 7 == 6) {
      // A NaN in one rank's input: its token's row is NaN in every output on every rank, the
      // scale of a NaN row is taken over its numbers (none: the floor), its bytes E4M3's NaN.
      data.inputs[0].set(size_t(spec.hidden / 2), std::nan(""));
    }
    const CaseResult result = runner.run(spec, data);
    expect_correct(spec, data, result);
    if (c % 7 == 6) {
      for (size_t r = 0; r < result.norm_out.size(); ++r) {
        EXPECT_TRUE(std::isnan(result.norm_out[r].get(0))) << describe(spec) << " rank " << r;
        EXPECT_EQ(result.quant_out[r][0] & 0x7f, 0x7f) << describe(spec) << " rank " << r;
      }
    }
    // norm_out is the call's without the FP8 output, bit for bit (a kernel's FP8 form may hold a
    // row in other threads: not in another order of the sum of squares).
    CaseSpec plain = spec;
    plain.quant = QuantMode::kNone;
    const CaseResult without = runner.run(plain, data);
    for (size_t r = 0; r < result.norm_out.size(); ++r) {
      EXPECT_TRUE(result.norm_out[r].bytes == without.norm_out[r].bytes)
          << describe(spec) << ": rank " << r << "'s norm_out differs from the call without FP8";
    }
    // The FP8 output alone (no bf16 norm): the same bits, nothing written to the norm's buffer.
    // Its residual_out stays in place where the spec has it so (the NCCL path then sums into
    // scratch of its own).
    CaseSpec bare = spec;
    bare.norm_out = false;
    bare.norm_in_place = false;
    expect_same_bits_without_norm(bare, result, runner.run(bare, data));
    if (::testing::Test::HasFailure()) return;
  }
}

// The power-of-two (UE8M0) group scales at their edges. Rank 0's rows are +-1 and every other
// rank's +-0 (the sentinel's bits in 16 bits among them), no residual, eps 0: the rank sum is
// exactly +-1, its mean square exactly 1, so the norm is exactly +-gamma and each group's amax is
// built from gamma: exactly 448 * 2^-10 (the scale exactly 2^-10: no rounding up), exactly a
// power of two (1: 2^-8), just above 448 * 2^3 (2^4), zeros (the floor: 2^-42), the dtype's
// subnormals (the floor, but fp16's lie above it), an Inf (an infinite scale: its byte NaN, the
// others zero), a NaN beside numbers (not the amax), and a tiny normal one (448 * 2^-20: 2^-20).
// Every dtype, both layouts, on the harness's algorithm: the scales and bytes against the float64
// definition (expect_quant_correct), the scales each a power of two, and each group's the one it
// was built for.
inline void check_fp8_power_of_two_scales(Harness& harness, uint64_t seed) {
  std::mt19937_64 rng(seed);
  OneShotRunner runner(harness);
  constexpr int64_t kGroups = 8;
  const double subnormal[] = {std::ldexp(1.0, -149), std::ldexp(1.0, -24), std::ldexp(1.0, -133)};
  for (const DType dtype : kDTypes) {
    for (const bool column_major : {false, true}) {
      CaseSpec spec;
      spec.dtype = dtype;
      spec.hidden = kGroups * kQuantGroupSize;
      spec.tokens = std::min<int64_t>(5, max_tokens_of(harness, spec));
      spec.residual = false;
      spec.residual_out = false;
      spec.eps = 0.0f;
      spec.quant = QuantMode::kPerTokenGroup128Ue8m0;
      spec.scales_column_major = column_major;
      CaseData data = random_case(rng, spec, harness.world_size());
      const size_t count = size_t(spec.tokens * spec.hidden);
      for (int r = 0; r < harness.world_size(); ++r) {
        for (size_t i = 0; i < count; ++i) {
          const bool negative = rng() % 2 == 0;
          data.inputs[size_t(r)].set(i, r == 0 ? (negative ? -1.0 : 1.0) : (negative ? -0.0 : 0.0));
        }
      }
      // gamma by group: the largest magnitude at a random element, the others below it.
      const double tiny = subnormal[dtype == DType::kFloat32   ? 0
                                    : dtype == DType::kFloat16 ? 1
                                                               : 2];
      const double amax[kGroups] = {448.0 * std::ldexp(1.0, -10),
                                    1.0,
                                    448.0 * 8.0 * (1.0 + 1.0 / 128.0),
                                    0.0,
                                    3.0 * tiny,
                                    INFINITY,
                                    2.0,
                                    448.0 * std::ldexp(1.0, -20)};
      // fp16's subnormals (3 * 2^-24 / 448 = 1.67 * 2^-32) lie above the floor, bf16's and fp32's
      // below it.
      const float subnormal_scale = dtype == DType::kFloat16 ? 0x1p-31f : 0x1p-42f;
      const float expected_scale[kGroups] = {0x1p-10f,        0x1p-8f,  0x1p4f,  0x1p-42f,
                                             subnormal_scale, INFINITY, 0x1p-7f, 0x1p-20f};
      std::uniform_real_distribution<double> below(0.0, 0.5);
      for (int64_t g = 0; g < kGroups; ++g) {
        const int64_t top = g * kQuantGroupSize + int64_t(rng() % kQuantGroupSize);
        for (int64_t i = g * kQuantGroupSize; i < (g + 1) * kQuantGroupSize; ++i) {
          const double magnitude = i == top              ? amax[g]
                                   : std::isinf(amax[g]) ? below(rng)
                                   : g == 4              ? tiny * double(rng() % 3)
                                                         : amax[g] * below(rng);
          data.gamma.set(size_t(i), rng() % 2 == 0 ? -magnitude : magnitude);
        }
        if (g == 6) data.gamma.set(size_t(top == g * kQuantGroupSize ? top + 1 : top - 1), NAN);
      }
      const CaseResult result = runner.run(spec, data);
      expect_quant_correct(spec, result);
      for (size_t r = 0; r < result.norm_out.size(); ++r) {
        for (int64_t t = 0; t < spec.tokens; ++t) {
          for (int64_t g = 0; g < kGroups; ++g) {
            const size_t at = size_t(column_major ? g * spec.tokens + t : t * kGroups + g);
            const float scale = result.scales[r][at];
            EXPECT_EQ(impl::float_bits(scale) & 0x007fffffu, 0u)
                << describe(spec) << " rank " << r << ": scale " << scale << " of token " << t
                << " group " << g << " is not a power of two";
            EXPECT_EQ(impl::float_bits(scale), impl::float_bits(expected_scale[g]))
                << describe(spec) << " rank " << r << ": scale of token " << t << " group " << g
                << " is " << scale << ", built to be " << expected_scale[g]
                << " (norm_out[t, 0] = " << result.norm_out[r].get(size_t(t * spec.hidden))
                << ", gamma[0] = " << data.gamma.get(0) << ")";
          }
        }
      }
      if (::testing::Test::HasFailure()) return;
    }
  }
}

// Each rank's MoE contribution computed here as the interface defines it (independently of the
// library's code): fp32 products w * x summed in expert order, the shared row added last,
// rounded once to the dtype, into data.inputs.
inline void moe_contributions(const CaseSpec& spec, CaseData& data) {
  const size_t k = size_t(spec.moe_topk);
  const size_t hidden = size_t(spec.hidden);
  for (size_t r = 0; r < data.inputs.size(); ++r) {
    for (size_t t = 0; t < size_t(spec.tokens); ++t) {
      for (size_t h = 0; h < hidden; ++h) {
        float acc = 0.0f;
        for (size_t j = 0; j < k; ++j) {
          const float w = float(data.moe_weights[r].get(t * k + j));
          const float x = float(data.moe_rows[r].get((t * k + j) * hidden + h));
          const float product = w * x;
          acc = j == 0 ? product : acc + product;
        }
        if (spec.moe_shared) acc = acc + float(data.moe_shared[r].get(t * hidden + h));
        data.inputs[r].set(t * hidden + h, acc);
      }
    }
  }
}

// The MoE finalize's inputs for a case (weights in [0, 1)), with the contributions
// (moe_contributions) as data.inputs: expect_correct checks the call against the float64
// reference of their sum, and the call with them as its input must give the same bits.
inline CaseData moe_case(std::mt19937_64& rng, const CaseSpec& spec, int world_size) {
  CaseData data = random_case(rng, spec, world_size);
  const size_t count = size_t(spec.tokens * spec.hidden);
  const size_t k = size_t(spec.moe_topk);
  const DType weight_type = spec.moe_weights_in_dtype ? spec.dtype : DType::kFloat32;
  std::uniform_real_distribution<double> weight(0.0, 1.0);
  for (int r = 0; r < world_size; ++r) {
    data.moe_rows.push_back(random_tensor(rng, spec.dtype, count * k));
    HostTensor weights(weight_type, size_t(spec.tokens) * k);
    for (size_t i = 0; i < weights.count(); ++i) weights.set(i, weight(rng));
    data.moe_weights.push_back(std::move(weights));
    data.moe_shared.push_back(random_tensor(rng, spec.dtype, count));
  }
  moe_contributions(spec, data);
  return data;
}

// Whether two results are the same bits in every output.
inline void expect_same_bits(const CaseSpec& spec, const CaseResult& a, const CaseResult& b,
                             const char* what) {
  for (size_t r = 0; r < a.norm_out.size(); ++r) {
    EXPECT_TRUE(a.norm_out[r].bytes == b.norm_out[r].bytes)
        << describe(spec) << ": norm_out of rank " << r << " differs from " << what;
    EXPECT_TRUE(a.residual_out[r].bytes == b.residual_out[r].bytes)
        << describe(spec) << ": residual_out of rank " << r << " differs from " << what;
  }
  EXPECT_TRUE(a.quant_out == b.quant_out) << describe(spec) << ": quant_out differs from " << what;
  EXPECT_TRUE(a.scales == b.scales) << describe(spec) << ": the scales differ from " << what;
}

// The MoE finalize: random top-k (1 to kMaxMoeTopK), shared expert or not, weights in fp32 or
// the dtype, every dtype, widths, tokens not a multiple of 4, an FP8 output or not, outputs in
// place or not. Every check of expect_correct against the float64 reference of the
// contributions (moe_case), identical bits on every rank, and the same bits as the call given
// those contributions as input. Every fourth case is adversarial: token 0's expert rows
// alternate +0 and -0 (in 16 bits each word of its contribution is then the protocol's
// sentinel) and the last element of the last token's last expert row is Inf.
inline void check_moe_finalize(Harness& harness, uint64_t seed, int cases) {
  std::mt19937_64 rng(seed);
  OneShotRunner runner(harness);
  const int topks[] = {1, 2, 3, 6, 8, kMaxMoeTopK};
  const int64_t widths[] = {8, 136, 384, 1152, 3072};
  const QuantMode modes[] = {QuantMode::kNone,
                             QuantMode::kNone,
                             QuantMode::kStatic,
                             QuantMode::kPerToken,
                             QuantMode::kPerTokenGroup128,
                             QuantMode::kPerTokenGroup128Ue8m0};
  for (int c = 0; c < cases; ++c) {
    CaseSpec spec;
    spec.dtype = kDTypes[rng() % kDTypes.size()];
    spec.hidden = widths[rng() % std::size(widths)];
    spec.tokens = 1 + int64_t(rng() % 11);
    spec.moe_topk = topks[rng() % std::size(topks)];
    spec.moe_shared = rng() % 2 == 0;
    spec.moe_weights_in_dtype = rng() % 3 == 0;
    spec.norm_in_place = rng() % 4 == 0;
    spec.residual_in_place = rng() % 4 == 0;
    spec.quant =
        spec.hidden % kQuantGroupSize == 0 ? modes[rng() % std::size(modes)] : QuantMode::kNone;
    spec.tokens = std::min(spec.tokens, max_tokens_of(harness, spec));
    CaseData data = moe_case(rng, spec, harness.world_size());
    if (c % 4 == 3) {
      for (HostTensor& rows : data.moe_rows) {
        for (size_t i = 0; i < size_t(spec.moe_topk * spec.hidden); ++i) {
          rows.set(i, i % 2 ? -0.0 : 0.0);
        }
        rows.set(rows.count() - 1, INFINITY);
      }
      moe_contributions(spec, data);
    }
    const CaseResult moe = runner.run(spec, data);
    expect_correct(spec, data, moe);
    CaseSpec plain = spec;
    plain.moe_topk = 0;
    plain.moe_shared = false;
    plain.moe_weights_in_dtype = false;
    expect_same_bits(spec, moe, runner.run(plain, data),
                     "the call with its contributions as input");
    if (spec.quant != QuantMode::kNone) {
      CaseSpec bare = spec;
      bare.norm_out = false;
      bare.norm_in_place = false;
      expect_same_bits_without_norm(bare, moe, runner.run(bare, data));
    }
    if (::testing::Test::HasFailure()) return;
  }
}

// The FP8 outputs and the MoE finalize replayed from one capture (a CUDA graph a rank on the
// GPU, as engines run their decode step) on fresh inputs, outputs poisoned before every replay:
// every replay matches the float64 reference and the FP8 definition (expect_correct), plain
// inputs alternate a million times apart in scale, and the first replay gives the bits of the
// same call made eagerly.
inline void check_graph_replays(Harness& harness, uint64_t seed) {
  std::mt19937_64 rng(seed);
  OneShotRunner runner(harness);
  std::vector<CaseSpec> specs(5);
  specs[0].quant = QuantMode::kStatic;
  specs[0].tokens = 5;
  specs[0].static_scale = 0.004f;
  specs[1].dtype = DType::kFloat16;
  specs[1].hidden = 4096;
  specs[1].tokens = 3;
  specs[1].quant = QuantMode::kPerToken;
  specs[1].norm_weight = NormWeight::kOnePlusGamma;
  specs[2].hidden = 7168;
  specs[2].tokens = 7;
  specs[2].quant = QuantMode::kPerTokenGroup128;
  specs[2].scales_column_major = true;
  specs[2].residual_in_place = true;
  specs[2].norm_in_place = true;
  specs[3].hidden = 1152;
  specs[3].tokens = 6;
  specs[3].moe_topk = 6;
  specs[3].moe_shared = true;
  specs[3].quant = QuantMode::kPerTokenGroup128;
  specs[4].dtype = DType::kFloat32;
  specs[4].hidden = 384;
  specs[4].tokens = 2;
  specs[4].moe_topk = 2;
  specs[4].moe_weights_in_dtype = true;
  constexpr int kReplays = 12;
  for (CaseSpec& spec : specs) {
    spec.tokens = std::min(spec.tokens, max_tokens_of(harness, spec));
    std::vector<CaseData> data;
    for (int i = 0; i < kReplays; ++i) {
      const double scale = i % 2 ? 1000.0 : 0.001;
      data.push_back(spec.moe_topk > 0 ? moe_case(rng, spec, harness.world_size())
                                       : random_case(rng, spec, harness.world_size(), scale));
      data.back().gamma = data.front().gamma;  // the weight is part of the capture's inputs
    }
    const std::vector<CaseResult> replays = runner.run_replays(spec, data);
    for (int i = 0; i < kReplays; ++i) {
      SCOPED_TRACE("replay " + std::to_string(i));
      expect_correct(spec, data[size_t(i)], replays[size_t(i)]);
    }
    expect_same_bits(spec, replays[0], runner.run(spec, data[0]), "the call made eagerly");
    if (spec.quant != QuantMode::kNone) {
      // The same capture without the bf16 norm (in place where the spec's residual is: the NCCL
      // path's scratch is then allocated within the graph).
      CaseSpec bare = spec;
      bare.norm_out = false;
      bare.norm_in_place = false;
      const std::vector<CaseResult> bare_replays = runner.run_replays(bare, data);
      for (int i = 0; i < kReplays; ++i) {
        SCOPED_TRACE("replay " + std::to_string(i) + " without the norm");
        expect_same_bits_without_norm(bare, replays[size_t(i)], bare_replays[size_t(i)]);
      }
    }
    if (::testing::Test::HasFailure()) return;
  }
}

}  // namespace tpfuse::testing
