// The parameters of the SYCL backend's kernels, passed by value (src/sycl/device/rows.h,
// qknorm.h): the host side (src/sycl/backend.cc) fills them from the core's RowCall and QkCall,
// the device side reads them. Host and device code, no SYCL header: embedded as
// "tpfuse/sycl/calls.h".
#pragma once

#include <cstdint>

#include "tpfuse/impl/lamport.h"
#include "tpfuse/impl/session.h"

namespace tpfuse::impl {

// One row call: a one-shot or two-shot collective, or the epilogue alone on one rank (local).
struct SyclRowCall {
  Exchange exchange;
  CallSignature signature;  // without the call number: the kernel folds its own in
  const void* input;
  const void* residual;
  const void* gamma;
  void* residual_out;
  void* norm_out;  // a plain sum's output; with a norm, the rounded row is staged here first
  int64_t tokens;
  int64_t hidden;
  float eps;
  // The FP8 output (epilogues with kHasQuant): AddRmsNormArgs' fields, quant a QuantMode.
  int quant;
  void* quant_out;
  const float* quant_scale;
  float* scales_out;
  int scales_column_major;
  // The MoE finalize in place of input (epilogues with kHasMoe): AddRmsNormArgs' fields.
  const void* moe_rows;
  const void* moe_weights;
  const void* moe_shared;
  int moe_topk;
  int moe_weights_in_dtype;
  int local;       // 1: no exchange (add_rmsnorm, a one-rank team)
  int twoshot;     // 1: two-shot (lamport.h's TwoShotLayout), else one-shot
  uint64_t bound;  // the waits' bound: device clock ticks, or looks without a clock (rows.h)
};

// The passes of a QK call (src/core/calls.h's QkPass, by value): the fused call (the protocol),
// this rank's sums (qk_sum_squares), the norm from global sums (qk_rmsnorm_from_sums).
constexpr int kSyclQkFused = 0;
constexpr int kSyclQkSums = 1;
constexpr int kSyclQkNormFromSums = 2;

// One QK-norm call or one of its local passes: the core's QkCall, enums as ints.
struct SyclQkCall {
  Exchange exchange;
  CallSignature signature;  // without the call number: the kernel folds its own in
  const void* qkv;
  void* q_out;  // row stride q_out_stride elements
  void* k_out;  // row stride k_out_stride elements
  int64_t q_out_stride;
  int64_t k_out_stride;
  const void* q_gamma;
  const void* k_gamma;
  int64_t tokens;
  int64_t q_size;
  int64_t kv_size;
  int64_t q_global_size;
  int64_t k_global_size;
  int counts_k;  // 0 on ranks whose KV heads another rank already counts
  float eps;
  int rope;  // a RopeStyle
  int64_t head_dim;
  int64_t rotary_dim;
  const int64_t* positions;
  const float* cos_sin_cache;
  int64_t max_position;
  float* sums;     // the local passes: [tokens, 2], written (kSyclQkSums) or read
  int pass;        // kSyclQk*
  uint64_t bound;  // the waits' bound (waits.h)
};

// An absent call (session.h): this rank's turn without data.
struct SyclAbsentCall {
  Exchange exchange;
  CallSignature signature;
  uint64_t bound;
};

}  // namespace tpfuse::impl
