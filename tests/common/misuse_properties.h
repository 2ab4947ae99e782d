// Misuse, at random (every backend): over many calls, one rank at a time gets a bad argument or
// makes a call that disagrees with its peers'. Every rank that should get an error gets one (the
// rejecting rank names its argument, its peers name it; ranks that disagree name each other and
// the field), the peers' outputs of a rejected call are NaN (never plausible numbers), and the
// next good call matches the float64 reference, bit for bit on every rank.
#pragma once

#include <gtest/gtest.h>
#include <algorithm>

#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "harness.h"
#include "oneshot_properties.h"
#include "reference.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse::testing {

struct MisuseCounts {
  int good = 0;
  int rejected = 0;
  int disagreeing = 0;
};

// A bad argument, and the words its error must contain.
struct BadArgument {
  const char* what;
  std::function<void(AddRmsNormArgs&)> apply;
  bool keeps_count = true;  // the call's count still known: a turn on CUDA's NCCL path
};

inline std::vector<BadArgument> bad_arguments() {
  return {
      {"input is null", [](AddRmsNormArgs& a) { a.input = nullptr; }},
      {"gamma is null", [](AddRmsNormArgs& a) { a.gamma = nullptr; }},
      {"input must be 16-byte aligned",
       [](AddRmsNormArgs& a) { a.input = static_cast<const char*>(a.input) + 2; }},
      {"hidden must be a positive multiple of 8", [](AddRmsNormArgs& a) { a.hidden += 4; }, false},
      {"eps", [](AddRmsNormArgs& a) { a.eps = -1.0f; }},
      {"norm_out overlaps gamma",
       [](AddRmsNormArgs& a) { a.norm_out = const_cast<void*>(a.gamma); }},
      {"dtype 7", [](AddRmsNormArgs& a) { a.dtype = DType(7); }, false},
      {"algorithm 9 is not an Algorithm", [](AddRmsNormArgs& a) { a.algorithm = Algorithm(9); },
       false},
  };
}

// A disagreement one rank brings to an otherwise good call, and the field its error names.
struct Disagreement {
  const char* field;
  std::function<bool(AddRmsNormArgs&, int64_t max_tokens)> apply;  // false: not applicable
  bool keeps_count = false;  // the same count and dtype: NCCL itself completes the call
};

inline std::vector<Disagreement> disagreements() {
  return {
      {"tokens",
       [](AddRmsNormArgs& a, int64_t max_tokens) {
         a.tokens = a.tokens < max_tokens ? a.tokens + 1 : a.tokens - 1;
         return a.tokens > 0;
       }},
      {"width",
       [](AddRmsNormArgs& a, int64_t) {
         a.hidden += 8;
         return true;
       }},
      {"eps",
       [](AddRmsNormArgs& a, int64_t) {
         a.eps *= 2.0f;
         return true;
       },
       true},
      {"norm_weight",
       [](AddRmsNormArgs& a, int64_t) {
         a.norm_weight = NormWeight::kOnePlusGamma;
         return true;
       },
       true},
      {"residual",
       [](AddRmsNormArgs& a, int64_t) {
         a.residual = nullptr;
         return true;
       },
       true},
      {"dtype",
       [](AddRmsNormArgs& a, int64_t) {
         a.dtype = a.dtype == DType::kBFloat16 ? DType::kFloat16 : DType::kBFloat16;
         return true;
       }},
      {"the op / algorithm",
       [](AddRmsNormArgs& a, int64_t) {
         a.algorithm =
             a.algorithm == Algorithm::kOneShot ? Algorithm::kTwoShot : Algorithm::kOneShot;
         return true;
       }},
  };
}

// Runs `calls` calls of add + RMSNorm (one of the `fused` algorithms or, where the team has one,
// the NCCL path; at most `max_tokens` tokens) with faults injected at random; `make_team`
// replaces the harness's team after a disagreement has failed it. Returns what was injected.
inline MisuseCounts check_misuse(Harness& harness, uint64_t seed, int calls, int64_t max_tokens,
                                 const std::function<std::vector<Team>()>& make_team,
                                 const std::vector<Algorithm>& fused = {Algorithm::kOneShot,
                                                                        Algorithm::kTwoShot}) {
  std::mt19937_64 rng(seed);
  const int world = harness.world_size();
  const std::vector<BadArgument> bad = bad_arguments();
  const std::vector<Disagreement> disagree = disagreements();
  constexpr int64_t kMaxHidden = 1024;
  // Buffers with room for the widest disagreement (hidden + 8, one more token, fp32 gamma).
  const size_t bytes = size_t(max_tokens + 1) * (kMaxHidden + 8) * 4;
  struct Buffers {
    void *input, *residual, *gamma, *residual_out, *norm_out;
  };
  std::vector<Buffers> buffers(world);
  for (int r = 0; r < world; ++r) {
    buffers[r] = {harness.allocate(r, bytes), harness.allocate(r, bytes),
                  harness.allocate(r, bytes), harness.allocate(r, bytes),
                  harness.allocate(r, bytes)};
  }
  MisuseCounts counts;
  for (int c = 0; c < calls; ++c) {
    CaseSpec spec;
    spec.dtype = rng() % 2 ? DType::kBFloat16 : DType::kFloat16;
    spec.tokens = 1 + int64_t(rng() % uint64_t(max_tokens));
    spec.hidden = 8 * (1 + int64_t(rng() % (kMaxHidden / 8)));
    // The NCCL path too where the team has one (CPU: its stand-in). NCCL cannot complete a call
    // whose ranks pass different counts, so there only faults that keep the count are drawn.
    const bool nccl =
        harness.team()[0].max_tokens(spec.hidden, spec.dtype, Algorithm::kNccl) >= spec.tokens;
    const int paths = int(fused.size()) + (nccl ? 1 : 0);
    const int path = int(rng() % uint64_t(paths));
    spec.algorithm = path < int(fused.size()) ? fused[size_t(path)] : Algorithm::kNccl;
    const CaseData data = random_case(rng, spec, world);
    const int faulty = int(rng() % uint64_t(world));
    const int kind = int(rng() % 8);  // 0: a bad argument, 1: a disagreement, else good
    std::vector<const BadArgument*> bad_here;
    for (const BadArgument& b : bad) {
      if (b.keeps_count || spec.algorithm != Algorithm::kNccl) bad_here.push_back(&b);
    }
    std::vector<const Disagreement*> disagree_here;
    for (const Disagreement& d : disagree) {
      // With one fused algorithm, none to disagree in (the other is not there to run).
      if (fused.size() < 2 && std::string(d.field) == "the op / algorithm") continue;
      if (d.keeps_count || spec.algorithm != Algorithm::kNccl) disagree_here.push_back(&d);
    }
    const BadArgument& argument = *bad_here[rng() % bad_here.size()];
    const Disagreement& difference = *disagree_here[rng() % disagree_here.size()];
    const size_t count = size_t(spec.tokens * spec.hidden);
    const size_t row_bytes = count * dtype_size(spec.dtype);
    const HostTensor poison = poisoned(spec.dtype, count);
    for (int r = 0; r < world; ++r) {
      harness.upload(r, buffers[r].input, data.inputs[r].data(), row_bytes);
      harness.upload(r, buffers[r].residual, data.residuals[r].data(), row_bytes);
      harness.upload(r, buffers[r].gamma, data.gamma.data(), data.gamma.bytes.size());
      harness.upload(r, buffers[r].residual_out, poison.data(), row_bytes);
      harness.upload(r, buffers[r].norm_out, poison.data(), row_bytes);
    }
    std::vector<AddRmsNormArgs> args(world);
    bool disagrees = false;
    for (int r = 0; r < world; ++r) {
      AddRmsNormArgs& a = args[r];
      a.input = buffers[r].input;
      a.residual = buffers[r].residual;
      a.gamma = buffers[r].gamma;
      a.residual_out = buffers[r].residual_out;
      a.norm_out = buffers[r].norm_out;
      a.tokens = spec.tokens;
      a.hidden = spec.hidden;
      a.dtype = spec.dtype;
      a.eps = spec.eps;
      a.algorithm = spec.algorithm;
      if (r != faulty) continue;
      if (kind == 0) argument.apply(a);
      if (kind == 1) {
        // Only a disagreement the faulty rank's team can carry (else it would be a rejection).
        AddRmsNormArgs changed = a;
        disagrees = difference.apply(changed, max_tokens) &&
                    changed.tokens <= harness.team()[r].max_tokens(changed.hidden, changed.dtype,
                                                                   changed.algorithm);
        if (disagrees) a = changed;
      }
    }
    const bool rejected = kind == 0;
    const std::string what = "call " + std::to_string(c) + " (" + describe(spec) + "), rank " +
                             std::to_string(faulty) +
                             (rejected    ? std::string(" rejects: ") + argument.what
                              : disagrees ? std::string(" disagrees in ") + difference.field
                                          : std::string(" good"));
    std::vector<std::string> errors(world);
    harness.enqueue([&](int rank, Stream stream) {
      try {
        allreduce_add_rmsnorm(harness.team()[rank], args[rank], stream);
      } catch (const Error& error) {
        errors[rank] = error.what();
      }
    });
    // Team::check waits for the rank's device work, then reports (CPU: what the call threw).
    for (int r = 0; r < world; ++r) {
      if (!errors[r].empty()) continue;
      try {
        harness.team()[r].check();
      } catch (const Error& error) {
        errors[r] = error.what();
      }
    }
    const auto contains = [](const std::string& text, const std::string& part) {
      return text.find(part) != std::string::npos;
    };
    if (rejected) {
      ++counts.rejected;
      EXPECT_TRUE(contains(errors[faulty], argument.what)) << what << ": got " << errors[faulty];
      for (int r = 0; r < world; ++r) {
        if (r == faulty) continue;
        EXPECT_TRUE(contains(errors[r], "rank " + std::to_string(faulty) + " rejected"))
            << what << ": rank " << r << " got '" << errors[r] << "'";
        // Its outputs of the call are NaN, every element.
        HostTensor norm(spec.dtype, count), residual_out(spec.dtype, count);
        harness.download(r, norm.data(), buffers[r].norm_out, row_bytes);
        harness.download(r, residual_out.data(), buffers[r].residual_out, row_bytes);
        size_t not_nan = 0;
        for (size_t i = 0; i < count; ++i) {
          not_nan += !std::isnan(norm.get(i)) + !std::isnan(residual_out.get(i));
        }
        EXPECT_EQ(not_nan, 0u) << what << ": rank " << r << " outputs not NaN";
      }
      // The team goes on: the next call is checked like any good one.
    } else if (disagrees) {
      ++counts.disagreeing;
      // Each rank tells the disagreement itself, or (once a rank that saw it has announced the
      // failure: its mark) that rank's failure; either way naming the faulty rank. The first rank
      // to see it tells the field.
      bool field_told = false;
      for (int r = 0; r < world; ++r) {
        const bool own = contains(errors[r], "disagrees with this rank's");
        const bool announced =
            contains(errors[r], "failed the team") && contains(errors[r], "disagreed with rank");
        EXPECT_TRUE(own || announced) << what << ": rank " << r << " got '" << errors[r] << "'";
        if (r != faulty) {
          EXPECT_TRUE(contains(errors[r], "rank " + std::to_string(faulty)))
              << what << ": rank " << r << " got '" << errors[r] << "'";
        }
        field_told = field_told || (own && contains(errors[r], difference.field));
        // Every output of a call that began is NaN, every element (CPU; CUDA's NCCL path, its
        // header check; the GPU's fused kernels, their end_call). A call the team refused wrote
        // nothing: on the CPU the error says so; on the GPU a kernel that sees a peer's failure
        // mark at its start writes nothing, which its host cannot tell (its error is the team's).
        const bool on_cpu = harness.team()[r].backend() == Backend::kCpu;
        // The rank's own call's outputs (the faulty rank's shape may differ).
        const size_t own_count = size_t(args[r].tokens * args[r].hidden);
        const size_t own_bytes = own_count * dtype_size(args[r].dtype);
        HostTensor norm(args[r].dtype, own_count), residual_out(args[r].dtype, own_count);
        harness.download(r, norm.data(), buffers[r].norm_out, own_bytes);
        harness.download(r, residual_out.data(), buffers[r].residual_out, own_bytes);
        const bool refused = contains(errors[r], "wrote nothing");
        // Still the poison where it was uploaded (past it the buffer was never written either).
        size_t not_poison = 0;
        for (size_t i = 0; i < std::min(own_bytes, row_bytes); ++i) {
          not_poison +=
              norm.bytes[i] != poison.bytes[i] || residual_out.bytes[i] != poison.bytes[i];
        }
        size_t not_nan = 0;
        for (size_t i = 0; i < own_count; ++i) {
          not_nan += !std::isnan(norm.get(i)) + !std::isnan(residual_out.get(i));
        }
        const size_t wrong = refused  ? not_poison
                             : on_cpu ? not_nan
                                      : std::min(not_nan, not_poison);
        EXPECT_EQ(wrong, 0u) << what << ": rank " << r
                             << (refused  ? " wrote into a refused call's outputs"
                                 : on_cpu ? " outputs not NaN"
                                          : " outputs neither all NaN nor untouched");
      }
      EXPECT_TRUE(field_told) << what << ": no rank named " << difference.field;
      harness.team() = make_team();
    } else {
      ++counts.good;
      for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << what << ": rank " << r;
      CaseResult result;
      result.algorithm = spec.algorithm;
      for (int r = 0; r < world; ++r) {
        HostTensor norm(spec.dtype, count), residual_out(spec.dtype, count);
        harness.download(r, norm.data(), buffers[r].norm_out, row_bytes);
        harness.download(r, residual_out.data(), buffers[r].residual_out, row_bytes);
        result.norm_out.push_back(std::move(norm));
        result.residual_out.push_back(std::move(residual_out));
      }
      expect_correct(spec, data, result);
    }
    if (::testing::Test::HasFailure()) {
      ADD_FAILURE() << "stopped at " << what;
      break;
    }
  }
  return counts;
}

}  // namespace tpfuse::testing
