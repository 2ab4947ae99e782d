// The parameters of the SYCL backend's kernels, passed by value (src/sycl/device/rows.h): the
// host side (src/sycl/backend.cc) fills them from the core's RowCall, the device side reads
// them. Host and device code, no SYCL header: embedded as "tpfuse/sycl/calls.h".
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

// An absent call (session.h): this rank's turn without data.
struct SyclAbsentCall {
  Exchange exchange;
  CallSignature signature;
  uint64_t bound;
};

}  // namespace tpfuse::impl
