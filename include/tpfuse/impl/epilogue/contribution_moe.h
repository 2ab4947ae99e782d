// Contribution policy: the MoE combine (AddRmsNormArgs::moe_*), what a rank contributes to the
// sum in place of its input. Its parameters (MoeRows), its per-element steps (products and adds
// rounded on their own) and its per-vector step (combine_vector), host and device. The CPU
// backend (cpu/moe.cc) and the CUDA NCCL path (moe_combine_kernel, cuda/local.cu) materialize the
// combine through combine_vector; the fused CUDA kernels combine where they load input
// (load_contribution, cuda/rows.cuh), a row's vectors at a time, with the same steps in the same
// order: the same bits everywhere.
#pragma once

#include <cstdint>

#include "tpfuse/impl/config.h"
#include "tpfuse/impl/numeric.h"

namespace tpfuse::impl {

// MoE finalize (AddRmsNormArgs::moe_*): a rank's contribution to the sum is its top-k expert
// rows combined, sum_j w_j * x_j in fp32 in j order, plus a shared expert's row, rounded once.
// On the GPU each product and each add is rounded on its own (no fused multiply-add), as on the
// host, so the combine has the same bits on both.
TPF_HOST_DEVICE float moe_product(float w, float x) {
#if TPF_ON_DEVICE
  return __fmul_rn(w, x);
#else
  return w * x;
#endif
}

TPF_HOST_DEVICE float moe_add(float a, float b) {
#if TPF_ON_DEVICE
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// acc (+)= w * row, per lane: the first expert's product starts the sum.
template <typename T>
TPF_HOST_DEVICE void moe_accumulate(float (&acc)[Packed<T>::kElements], const Vec16& row, float w,
                                    bool first) {
  float lanes[Packed<T>::kElements];
  unpack<T>(row, lanes);
  TPF_UNROLL
  for (int i = 0; i < Packed<T>::kElements; ++i) {
    const float product = moe_product(w, lanes[i]);
    acc[i] = first ? product : moe_add(acc[i], product);
  }
}

// acc += the shared expert's row, per lane.
template <typename T>
TPF_HOST_DEVICE void moe_add_shared(float (&acc)[Packed<T>::kElements], const Vec16& shared) {
  float lanes[Packed<T>::kElements];
  unpack<T>(shared, lanes);
  TPF_UNROLL
  for (int i = 0; i < Packed<T>::kElements; ++i) acc[i] = moe_add(acc[i], lanes[i]);
}

// Routing weight `index` of [tokens, topk]: fp32, or T (in_dtype).
template <typename T>
TPF_HOST_DEVICE float moe_weight(const void* weights, bool in_dtype, int64_t index) {
  return in_dtype ? to_float(static_cast<const T*>(weights)[index])
                  : static_cast<const float*>(weights)[index];
}

// The MoE combine's arguments as a call carries them.
struct MoeRows {
  const void* rows;     // [tokens, topk, hidden] T
  const void* weights;  // [tokens, topk] fp32, or T (weights_in_dtype)
  const void* shared;   // [tokens, hidden] T, or null
  int topk;
  bool weights_in_dtype;
};

struct MoeContribution {
  static constexpr bool kCombines = true;
  static constexpr const char* kDescription = "a MoE combine";

  // The rank's contribution at vector `v` of token `token`'s row of `vectors` vectors: the top-k
  // products in expert order, the shared row last, rounded once to T. load(base, index) reads
  // vector `index` of `base`. The rows are loaded kChunk at a time, all in flight before the
  // first is added.
  template <typename T, typename Load>
  TPF_HOST_DEVICE static Vec16 combine_vector(const MoeRows& m, int64_t token, int64_t vectors,
                                              int64_t v, Load&& load) {
    constexpr int kChunk = 4;
    float acc[Packed<T>::kElements] = {};
    for (int first = 0; first < m.topk; first += kChunk) {
      Vec16 rows[kChunk] = {};
      float weights[kChunk] = {};
      TPF_UNROLL
      for (int c = 0; c < kChunk; ++c) {
        if (first + c < m.topk) {
          const int64_t row = token * m.topk + first + c;
          weights[c] = moe_weight<T>(m.weights, m.weights_in_dtype, row);
          rows[c] = load(m.rows, row * vectors + v);
        }
      }
      TPF_UNROLL
      for (int c = 0; c < kChunk; ++c) {
        if (first + c < m.topk) moe_accumulate<T>(acc, rows[c], weights[c], first + c == 0);
      }
    }
    if (m.shared != nullptr) moe_add_shared<T>(acc, load(m.shared, token * vectors + v));
    return pack<T>(acc);
  }
};

}  // namespace tpfuse::impl
