// The row epilogues, written once for the GPU kernels and the CPU backend. An epilogue is a traits
// type (RowEpilogue: residual or not, norm or not, the norm's weight) whose steps work on one
// 16-byte vector of a token row in fp32; the row-wide sum of squares is reduced by the caller (a
// block reduction on the GPU, a loop on the CPU). RowEpilogues lists those the kernels are built
// for: a new epilogue is a traits type, its reference in the tests, and a line there.
//
// Rounding: the rank sum and the residual add are done in fp32 and rounded once to the output
// type (residual_out). The norm is computed from residual_out as stored, so norm_out is exactly
// rmsnorm(residual_out) * gamma evaluated in fp32 and rounded once.
//
// Canonical zeros: a rounded output word whose bits equal the Lamport sentinel (-0.0f; a 16-bit
// pair of +0 low, -0 high) is stored as +0, and the norm is computed from that. The two-shot
// all-gather carries rounded outputs as Lamport packets, which cannot hold the sentinel; doing
// the same in every epilogue keeps one-shot, two-shot and the local kernel bit-identical.
#pragma once

#include <cmath>

#include "tpfuse/impl/config.h"
#include "tpfuse/impl/epilogue/contributions.h"
#include "tpfuse/impl/epilogue/outputs.h"
#include "tpfuse/impl/lamport.h"
#include "tpfuse/impl/numeric.h"
#include "tpfuse/limits.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse::impl {

// acc = packet (the first rank's contribution): starting from the packet instead of 0 keeps
// -0 sums as -0, as in a plain left-to-right sum.
template <typename T>
TPF_HOST_DEVICE void accumulate_first(float (&acc)[Packed<T>::kElements], const Vec16& packet) {
  unpack<T>(packet, acc);
}

template <typename T>
TPF_HOST_DEVICE void accumulate(float (&acc)[Packed<T>::kElements], const Vec16& packet) {
  float lanes[Packed<T>::kElements];
  unpack<T>(packet, lanes);
  TPF_UNROLL
  for (int i = 0; i < Packed<T>::kElements; ++i) acc[i] += lanes[i];
}

// Rounds fp32 lanes once to T, with canonical zeros (above).
template <typename T>
TPF_HOST_DEVICE Vec16 round_output(const float (&acc)[Packed<T>::kElements]) {
  return rewrite_sentinel(pack<T>(acc));
}

// Adds the residual (if any), rounds once to T, and leaves in `acc` the rounded values as fp32
// (what the norm must see). Returns the rounded vector and adds its squares to `sum_squares`.
// Given acc = the lanes of an already rounded vector and no residual, it returns that vector:
// how two-shot ranks finish rows they receive rounded.
template <typename T, bool kHasResidual>
TPF_HOST_DEVICE Vec16 residual_round(float (&acc)[Packed<T>::kElements], const Vec16& residual,
                                     float& sum_squares) {
  if constexpr (kHasResidual) {
    float lanes[Packed<T>::kElements];
    unpack<T>(residual, lanes);
    TPF_UNROLL
    for (int i = 0; i < Packed<T>::kElements; ++i) acc[i] += lanes[i];
  }
  const Vec16 rounded = round_output<T>(acc);
  unpack<T>(rounded, acc);
  TPF_UNROLL
  for (int i = 0; i < Packed<T>::kElements; ++i) sum_squares += acc[i] * acc[i];
  return rounded;
}

TPF_HOST_DEVICE float rms_scale(float sum_squares, int64_t hidden, float eps) {
  return reciprocal_sqrt(sum_squares / float(hidden) + eps);
}

// (x * scale) * w per element, rounded once, where w is gamma or 1 + gamma (in fp32).
template <typename T, NormWeight kWeight>
TPF_HOST_DEVICE Vec16 normalize(const float (&x)[Packed<T>::kElements], const Vec16& gamma,
                                float scale) {
  float g[Packed<T>::kElements];
  unpack<T>(gamma, g);
  float out[Packed<T>::kElements];
  TPF_UNROLL
  for (int i = 0; i < Packed<T>::kElements; ++i) {
    const float weight = kWeight == NormWeight::kOnePlusGamma ? 1.0f + g[i] : g[i];
    out[i] = (x[i] * scale) * weight;
  }
  return pack<T>(out);
}

// What a row epilogue does, as values: the key a call's arguments give and the traits match.
struct RowEpilogueKind {
  bool residual;       // the sum plus a residual (else the sum alone)
  bool norm;           // an RMSNorm of that (else the rounded sum is the output)
  NormWeight weight;   // the norm's weight
  bool quant = false;  // an FP8 output of the norm too (its policy is the call's: RowCall::quant)
  bool moe = false;    // a rank's contribution is its MoE combine (RowCall::moe_*), not input
  constexpr bool operator==(const RowEpilogueKind& other) const {
    return residual == other.residual && norm == other.norm && weight == other.weight &&
           quant == other.quant && moe == other.moe;
  }
};

// A row epilogue. Steps, per vector of a row whose rank sum is in `acc`:
//   round_sum:  (+ residual), one rounding to T (residual_out, or out without a norm); `acc`
//               becomes the rounded values and their squares are added to sum_squares;
//   normalize:  the norm of the rounded values with the row's scale (kHasNorm only).
//   quantize:   (kHasQuant) the FP8 output of the normalized vectors: the Output policy of the
//               call's mode (epilogue/outputs.h), picked at run time (RowCall::quant).
// kMoe: what a rank contributes is its MoE combine (the MoeContribution policy's steps,
// epilogue/contribution_moe.h, rounded once to T), read where other epilogues read input.
template <bool kResidual, bool kNorm, NormWeight kWeight = NormWeight::kGamma, bool kQuant = false,
          bool kMoe = false>
struct RowEpilogue {
  static_assert(kNorm || (!kResidual && kWeight == NormWeight::kGamma && !kQuant && !kMoe),
                "no norm: a plain sum");
  static constexpr bool kHasResidual = kResidual;
  static constexpr bool kHasNorm = kNorm;
  static constexpr bool kHasQuant = kQuant;
  static constexpr bool kHasMoe = kMoe;
  using Contribution = ContributionOf<kMoe>;
  static constexpr RowEpilogueKind kKind{kResidual, kNorm, kWeight, kQuant, kMoe};
  // How a row that arrives already rounded (the two-shot all-gather) is finished.
  using Gathered = RowEpilogue<false, kNorm, kWeight, kQuant>;

  template <typename T>
  TPF_HOST_DEVICE static Vec16 round_sum(float (&acc)[Packed<T>::kElements], const Vec16& residual,
                                         float& sum_squares) {
    if constexpr (kNorm) {
      return residual_round<T, kResidual>(acc, residual, sum_squares);
    } else {
      return round_output<T>(acc);
    }
  }

  template <typename T>
  TPF_HOST_DEVICE static Vec16 normalize(const float (&x)[Packed<T>::kElements], const Vec16& gamma,
                                         float scale) {
    return impl::normalize<T, kWeight>(x, gamma, scale);
  }
};

using SumEpilogue = RowEpilogue<false, false>;

template <typename... Epilogues>
struct EpilogueList {};

// Every row epilogue the kernels are instantiated for.
using RowEpilogues = EpilogueList<SumEpilogue, RowEpilogue<false, true>, RowEpilogue<true, true>,
                                  RowEpilogue<false, true, NormWeight::kOnePlusGamma>,
                                  RowEpilogue<true, true, NormWeight::kOnePlusGamma>,
                                  RowEpilogue<false, true, NormWeight::kGamma, true>,
                                  RowEpilogue<true, true, NormWeight::kGamma, true>,
                                  RowEpilogue<false, true, NormWeight::kOnePlusGamma, true>,
                                  RowEpilogue<true, true, NormWeight::kOnePlusGamma, true>,
                                  RowEpilogue<true, true, NormWeight::kGamma, false, true>,
                                  RowEpilogue<true, true, NormWeight::kGamma, true, true>>;

// Calls fn(Epilogue{}) with the listed epilogue whose kind is `kind`; false if none is.
template <typename Fn, typename... Epilogues>
bool dispatch_epilogue_in(EpilogueList<Epilogues...>, const RowEpilogueKind& kind, Fn&& fn) {
  bool found = false;
  ((!found && Epilogues::kKind == kind ? (found = true, fn(Epilogues{}), 0) : 0), ...);
  return found;
}

template <typename Fn, typename... Epilogues>
void for_each_epilogue_in(EpilogueList<Epilogues...>, Fn&& fn) {
  (fn(Epilogues{}), ...);
}

}  // namespace tpfuse::impl
