// The CPU backend's row calls against epilogue.h's per-vector steps, bit for bit: the backend
// runs each step over whole rows (vectorized loops, rows of a group finished together, packets
// moved in bulk), and this test holds it to the steps as they are written once for the GPU and
// the CPU: per 16-byte vector, the rank sum from rank 0's packet on (sentinel words rewritten as
// a peer receives them; the local epilogue reads its input as it is), round_sum with its
// sequential sum of squares, rms_scale, normalize, the FP8 bytes and scales. NaN payloads aside
// (numeric.h): where two NaNs meet, which payload survives is the compiler's choice; an element
// that is NaN must be NaN in both.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "harness.h"
#include "reference.h"
#include "tpfuse/impl/dispatch.h"
#include "tpfuse/impl/epilogue.h"
#include "tpfuse/impl/lamport.h"

namespace tpfuse::testing {
namespace {

using impl::Packed;
using impl::Vec16;

struct RowCase {
  DType dtype;
  int64_t tokens;
  int64_t hidden;
  bool residual;
  bool norm;
  NormWeight weight;
  QuantMode quant;
  bool column_major;
};

std::string describe(const RowCase& c, Algorithm algorithm, int world) {
  return std::string(dtype_name(c.dtype)) + " tokens " + std::to_string(c.tokens) + " hidden " +
         std::to_string(c.hidden) + (c.residual ? " residual" : "") + (c.norm ? " norm" : " sum") +
         (c.weight == NormWeight::kOnePlusGamma ? " 1+gamma" : "") + " quant " +
         quant_mode_name(c.quant) + (c.column_major ? " column-major" : "") + ", " +
         algorithm_name(algorithm) + " at world " + std::to_string(world);
}

struct RowOutputs {
  std::vector<uint8_t> residual_out, norm_out, quant_out;
  std::vector<float> scales;
};

Vec16 vector_at(const std::vector<uint8_t>& bytes, int64_t index) {
  Vec16 v;
  std::memcpy(&v, bytes.data() + index * 16, 16);
  return v;
}

// The CPU backend's rows as they were written before they were vectorized: epilogue.h's steps,
// vector by vector, in the same order.
template <typename T, typename Epilogue>
RowOutputs expected_rows(const RowCase& c, const std::vector<std::vector<uint8_t>>& packets,
                         const std::vector<uint8_t>& residual, const std::vector<uint8_t>& gamma,
                         float static_scale, float eps) {
  constexpr int kElements = Packed<T>::kElements;
  const int64_t vectors = c.hidden / kElements;
  RowOutputs out;
  const size_t bytes = size_t(c.tokens * c.hidden) * sizeof(T);
  out.residual_out.assign(bytes, 0);
  out.norm_out.assign(bytes, 0);
  out.quant_out.assign(size_t(c.tokens * c.hidden), 0);
  const int64_t groups = c.hidden / kQuantGroupSize;
  out.scales.assign(size_t(c.tokens * std::max<int64_t>(groups, 1)), -1.0f);  // as unwritten
  std::vector<float> acc(size_t(c.hidden));
  std::vector<Vec16> normalized(static_cast<size_t>(vectors));
  for (int64_t token = 0; token < c.tokens; ++token) {
    const int64_t row = token * vectors;
    for (int64_t v = 0; v < vectors; ++v) {
      float(&lanes)[kElements] = *reinterpret_cast<float(*)[kElements]>(&acc[v * kElements]);
      for (size_t r = 0; r < packets.size(); ++r) {
        if (r == 0) {
          impl::accumulate_first<T>(lanes, vector_at(packets[r], row + v));
        } else {
          impl::accumulate<T>(lanes, vector_at(packets[r], row + v));
        }
      }
    }
    float sum_squares = 0.0f;
    for (int64_t v = 0; v < vectors; ++v) {
      float(&lanes)[kElements] = *reinterpret_cast<float(*)[kElements]>(&acc[v * kElements]);
      const Vec16 r = Epilogue::kHasResidual ? vector_at(residual, row + v) : Vec16{};
      const Vec16 rounded = Epilogue::template round_sum<T>(lanes, r, sum_squares);
      std::memcpy((Epilogue::kHasNorm ? out.residual_out : out.norm_out).data() + (row + v) * 16,
                  &rounded, 16);
    }
    if constexpr (Epilogue::kHasNorm) {
      const float scale = impl::rms_scale(sum_squares, c.hidden, eps);
      for (int64_t v = 0; v < vectors; ++v) {
        const auto& lanes = *reinterpret_cast<const float(*)[kElements]>(&acc[v * kElements]);
        normalized[size_t(v)] = Epilogue::template normalize<T>(lanes, vector_at(gamma, v), scale);
        std::memcpy(out.norm_out.data() + (row + v) * 16, &normalized[size_t(v)], 16);
      }
      if constexpr (Epilogue::kHasQuant) {
        const auto store = [&](int64_t v, float s) {
          const auto q = impl::quantize_vector<T>(normalized[size_t(v)], impl::fp8_divisor(s));
          std::memcpy(out.quant_out.data() + token * c.hidden + v * kElements, q.bytes, kElements);
        };
        // The scale of a token or group from its amax: the call's Output policy's step.
        const auto scale_of = [&](float amax) {
          float s = 0.0f;
          impl::dispatch_output(c.quant, [&](auto output) {
            if constexpr (decltype(output)::kScope == impl::OutputScope::kToken ||
                          decltype(output)::kScope == impl::OutputScope::kGroup) {
              s = decltype(output)::scale(impl::dynamic_scale(amax));
            }
          });
          return s;
        };
        if (c.quant == QuantMode::kStatic) {
          for (int64_t v = 0; v < vectors; ++v) store(v, static_scale);
        } else if (c.quant == QuantMode::kPerToken) {
          float amax = 0.0f;
          for (int64_t v = 0; v < vectors; ++v) {
            amax = fmaxf(amax, impl::vector_amax<T>(normalized[size_t(v)]));
          }
          const float s = scale_of(amax);
          out.scales[size_t(token)] = s;
          for (int64_t v = 0; v < vectors; ++v) store(v, s);
        } else {
          const int64_t per_group = kQuantGroupSize / kElements;
          for (int64_t g = 0; g < groups; ++g) {
            float amax = 0.0f;
            for (int64_t v = g * per_group; v < (g + 1) * per_group; ++v) {
              amax = fmaxf(amax, impl::vector_amax<T>(normalized[size_t(v)]));
            }
            const float s = scale_of(amax);
            out.scales[size_t(c.column_major ? g * c.tokens + token : token * groups + g)] = s;
            for (int64_t v = g * per_group; v < (g + 1) * per_group; ++v) store(v, s);
          }
        }
      }
    }
  }
  return out;
}

// Whether two elements of a dtype are the same: equal bits, or both NaN.
bool same_element(DType dtype, const uint8_t* a, const uint8_t* b) {
  if (dtype == DType::kFloat32) {
    uint32_t x, y;
    std::memcpy(&x, a, 4);
    std::memcpy(&y, b, 4);
    const bool nan_x = (x & 0x7fffffffu) > 0x7f800000u, nan_y = (y & 0x7fffffffu) > 0x7f800000u;
    return x == y || (nan_x && nan_y);
  }
  uint16_t x, y;
  std::memcpy(&x, a, 2);
  std::memcpy(&y, b, 2);
  const uint16_t infinity = dtype == DType::kBFloat16 ? 0x7f80 : 0x7c00;
  return x == y || ((x & 0x7fff) > infinity && (y & 0x7fff) > infinity);
}

std::string first_difference(DType dtype, const std::vector<uint8_t>& got,
                             const std::vector<uint8_t>& want, const char* what) {
  const size_t size = dtype_size(dtype);
  for (size_t i = 0; i < want.size(); i += size) {
    if (!same_element(dtype, &got[i], &want[i])) {
      uint32_t g = 0, w = 0;
      std::memcpy(&g, &got[i], size);
      std::memcpy(&w, &want[i], size);
      return std::string(what) + "[" + std::to_string(i / size) + "]: bits " + std::to_string(g) +
             ", expected " + std::to_string(w);
    }
  }
  return "";
}

// A payload element: mostly normal values, with the protocol's and the conversions' edge cases.
void fill(std::vector<uint8_t>& bytes, DType dtype, std::mt19937_64& rng, bool adversarial) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  HostTensor t(dtype, bytes.size() / dtype_size(dtype));
  for (size_t i = 0; i < t.count(); ++i) {
    const uint64_t pick = rng() % 24;
    if (!adversarial || pick >= 12) {
      t.set(i, normal(rng));
      continue;
    }
    const float values[] = {0.0f, -0.0f, 1e-40f, -3e-39f,   INFINITY, -INFINITY,
                            NAN,  3e38f, 6e-5f,  -65504.0f, 1e-7f};
    if (pick < 11) {
      t.set(i, values[pick]);
    } else if (dtype == DType::kFloat32) {
      t.set_bits32(i, rng() % 2 ? impl::kSentinel : uint32_t(rng()));
    } else {
      t.set_bits16(i, rng() % 2 ? uint16_t(i % 2 ? 0x8000 : 0x0000) : uint16_t(rng()));
    }
  }
  bytes = t.bytes;
}

void check_rows(CpuHarness& harness, const RowCase& c, Algorithm algorithm, uint64_t seed,
                bool adversarial) {
  const int world = harness.world_size();
  std::mt19937_64 rng(seed);
  const size_t bytes = size_t(c.tokens * c.hidden) * dtype_size(c.dtype);
  std::vector<std::vector<uint8_t>> inputs(static_cast<size_t>(world), std::vector<uint8_t>(bytes));
  std::vector<uint8_t> residual(bytes), gamma(size_t(c.hidden) * dtype_size(c.dtype));
  for (auto& input : inputs) fill(input, c.dtype, rng, adversarial);
  fill(residual, c.dtype, rng, adversarial);
  fill(gamma, c.dtype, rng, false);
  const float static_scale = 0.0625f, eps = 1e-5f;

  // What each sender's packets hold (the local epilogue: its input as it is).
  std::vector<std::vector<uint8_t>> packets = inputs;
  if (world > 1) {
    for (auto& packet : packets) {
      for (size_t i = 0; i < packet.size(); i += 16) {
        Vec16 v;
        std::memcpy(&v, &packet[i], 16);
        v = impl::rewrite_sentinel(v);
        std::memcpy(&packet[i], &v, 16);
      }
    }
  }
  RowOutputs want;
  const impl::RowEpilogueKind kind{c.residual, c.norm, c.weight, c.quant != QuantMode::kNone};
  impl::dispatch_dtype(c.dtype, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    const bool found = impl::dispatch_epilogue_in(impl::RowEpilogues{}, kind, [&](auto epilogue) {
      using Epilogue = decltype(epilogue);
      if (algorithm != Algorithm::kNccl || world == 1) {
        want = expected_rows<T, Epilogue>(c, packets, residual, gamma, static_scale, eps);
        return;
      }
      // The NCCL path's stand-in: the sum rounded to dtype (a plain one-shot sum), then the
      // local epilogue on it.
      const RowCase sum_case{c.dtype, c.tokens,           c.hidden,         false,
                             false,   NormWeight::kGamma, QuantMode::kNone, false};
      const RowOutputs sum = expected_rows<T, impl::SumEpilogue>(sum_case, packets, residual, gamma,
                                                                 static_scale, eps);
      want = expected_rows<T, Epilogue>(c, {sum.norm_out}, residual, gamma, static_scale, eps);
    });
    ASSERT_TRUE(found);
  });

  std::vector<RowOutputs> got(static_cast<size_t>(world));
  harness.run([&](int rank, Stream) {
    RowOutputs& out = got[size_t(rank)];
    out.residual_out.assign(bytes, 0x5a);
    out.norm_out.assign(bytes, 0x5a);
    out.quant_out.assign(size_t(c.tokens * c.hidden), 0x5a);
    out.scales.assign(want.scales.size(), -1.0f);
    if (!c.norm) {
      allreduce(harness.team()[size_t(rank)], inputs[size_t(rank)].data(), out.norm_out.data(),
                c.tokens * c.hidden, c.dtype, {}, algorithm);
      return;
    }
    AddRmsNormArgs args;
    args.input = inputs[size_t(rank)].data();
    args.residual = c.residual ? residual.data() : nullptr;
    args.gamma = gamma.data();
    args.residual_out = c.residual ? out.residual_out.data() : nullptr;
    args.norm_out = out.norm_out.data();
    args.tokens = c.tokens;
    args.hidden = c.hidden;
    args.dtype = c.dtype;
    args.eps = eps;
    args.norm_weight = c.weight;
    args.algorithm = algorithm;
    args.quant = c.quant;
    if (c.quant != QuantMode::kNone) {
      args.quant_out = out.quant_out.data();
      if (c.quant == QuantMode::kStatic) {
        args.quant_scale = &static_scale;
      } else {
        args.scales_out = out.scales.data();
        args.scales_column_major = c.column_major;
      }
    }
    allreduce_add_rmsnorm(harness.team()[size_t(rank)], args);
  });

  for (int r = 0; r < world; ++r) {
    const RowOutputs& out = got[size_t(r)];
    const std::string where = describe(c, algorithm, world) + ", rank " + std::to_string(r);
    if (c.residual) {
      EXPECT_EQ(first_difference(c.dtype, out.residual_out, want.residual_out, "residual_out"), "")
          << where;
    }
    EXPECT_EQ(first_difference(c.dtype, out.norm_out, want.norm_out, "norm_out"), "") << where;
    if (c.quant != QuantMode::kNone) {
      EXPECT_EQ(out.quant_out, want.quant_out) << where;
      if (c.quant != QuantMode::kStatic) {
        EXPECT_EQ(0, std::memcmp(out.scales.data(), want.scales.data(), 4 * want.scales.size()))
            << where;
      }
    }
  }
}

std::vector<RowCase> cases() {
  std::vector<RowCase> all;
  for (const DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    // Rows of a group of 8 and around it; widths with and without a vector loop's tail.
    for (const int64_t tokens : {1, 3, 8, 9, 17}) {
      for (const int64_t hidden : {8, 24, 136, 384}) {
        all.push_back(
            {dtype, tokens, hidden, false, false, NormWeight::kGamma, QuantMode::kNone, false});
        all.push_back(
            {dtype, tokens, hidden, false, true, NormWeight::kGamma, QuantMode::kNone, false});
        all.push_back(
            {dtype, tokens, hidden, true, true, NormWeight::kGamma, QuantMode::kNone, false});
        all.push_back({dtype, tokens, hidden, true, true, NormWeight::kOnePlusGamma,
                       QuantMode::kNone, false});
        if (tokens % 2 == 1) {
          all.push_back(
              {dtype, tokens, hidden, true, true, NormWeight::kGamma, QuantMode::kStatic, false});
          all.push_back({dtype, tokens, hidden, false, true, NormWeight::kOnePlusGamma,
                         QuantMode::kPerToken, false});
        }
        if (hidden % kQuantGroupSize == 0) {
          all.push_back({dtype, tokens, hidden, true, true, NormWeight::kGamma,
                         QuantMode::kPerTokenGroup128, tokens == 3});
          all.push_back({dtype, tokens, hidden, tokens % 2 == 0, true, NormWeight::kGamma,
                         QuantMode::kPerTokenGroup128Ue8m0, tokens == 9});
        }
      }
    }
  }
  return all;
}

class CpuRowBits : public ::testing::TestWithParam<int> {};

TEST_P(CpuRowBits, EveryAlgorithmGivesTheStepsOfEpilogueH) {
  const int world = GetParam();
  CpuHarness harness(world);
  uint64_t seed = 17 * uint64_t(world);
  for (const RowCase& c : cases()) {
    for (const Algorithm algorithm : {Algorithm::kOneShot, Algorithm::kTwoShot, Algorithm::kNccl}) {
      if (world == 1 && algorithm != Algorithm::kOneShot) continue;  // all are the local epilogue
      for (const bool adversarial : {false, true}) {
        check_rows(harness, c, algorithm, ++seed, adversarial);
        if (::testing::Test::HasFailure()) return;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CpuRowBits, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

}  // namespace
}  // namespace tpfuse::testing
