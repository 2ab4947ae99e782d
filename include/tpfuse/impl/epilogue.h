// The epilogues, written once for the GPU kernels and the CPU backend. Each works on one 16-byte
// vector of a token row in fp32; the row-wide sum of squares is reduced by the caller (a block
// reduction on the GPU, a loop on the CPU).
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

#include "tpfuse/impl/config.h"
#include "tpfuse/impl/lamport.h"
#include "tpfuse/impl/numeric.h"

namespace tpfuse::impl {

enum class Epilogue : int {
  kSum = 0,         // out = sum
  kRmsNorm = 1,     // residual_out (optional) = sum; norm_out = rmsnorm(sum) * gamma
  kAddRmsNorm = 2,  // residual_out = sum + residual; norm_out = rmsnorm(residual_out) * gamma
};

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

template <typename T>
TPF_HOST_DEVICE Vec16 normalize(const float (&x)[Packed<T>::kElements], const Vec16& gamma,
                                float scale) {
  float g[Packed<T>::kElements];
  unpack<T>(gamma, g);
  float out[Packed<T>::kElements];
  TPF_UNROLL
  for (int i = 0; i < Packed<T>::kElements; ++i) out[i] = (x[i] * scale) * g[i];
  return pack<T>(out);
}

}  // namespace tpfuse::impl
