// Internal: one parameter struct per call kind, passed by value to the kernels (and to the CPU
// backend). The team side of a call is its Exchange, embedded.
#pragma once

#include <cstdint>

#include "core/team_state.h"
#include "tpfuse/impl/epilogue.h"
#include "tpfuse/impl/session.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse::impl {

// A row call: all-reduce + a row epilogue (allreduce_add_rmsnorm, allreduce), or the epilogue
// alone on one rank (add_rmsnorm, the NCCL path's local kernel: exchange unused).
struct RowCall {
  Exchange exchange;
  CallSignature signature;  // what the call's header carries (collectives only)
  const void* input;
  const void* residual;
  const void* gamma;
  void* residual_out;
  void* norm_out;  // the output of a plain sum
  int64_t tokens;
  int64_t hidden;
  float eps;
  // The FP8 output (epilogues with kHasQuant): AddRmsNormArgs' fields.
  QuantMode quant;
  void* quant_out;
  const float* quant_scale;
  float* scales_out;
  bool scales_column_major;
  // The MoE combine in place of input (epilogues with kHasMoe): AddRmsNormArgs' fields.
  const void* moe_rows;
  const void* moe_weights;
  const void* moe_shared;
  int moe_topk;
  bool moe_weights_in_dtype;
};

// The MoE combine's arguments of a row call (the MoeContribution policy's parameters).
TPF_HOST_DEVICE MoeRows moe_rows_of(const RowCall& call) {
  return {call.moe_rows, call.moe_weights, call.moe_shared, call.moe_topk,
          call.moe_weights_in_dtype};
}

// A QK-norm call (or one of its local halves).
struct QkCall {
  Exchange exchange;
  CallSignature signature;  // what the call's header carries (the fused call only)
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
  RopeStyle rope;
  int64_t head_dim;
  int64_t rotary_dim;
  const int64_t* positions;
  const float* cos_sin_cache;
  int64_t max_position;
  float* sums;  // local halves only: [tokens, 2] written (kSums) or read (kNormFromSums)
};

// kFused: the whole protocol; kSums: this rank's sums into QkCall::sums; kNormFromSums: the norm
// from global sums in QkCall::sums. The three share every arithmetic step.
enum class QkPass : int { kFused = 0, kSums = 1, kNormFromSums = 2 };

// The signatures of a row collective and of the fused QK norm (session.h).
CallSignature row_signature(CallOp op, DType dtype, const RowEpilogueKind& epilogue, int64_t tokens,
                            int64_t hidden, float eps, QuantMode quant = QuantMode::kNone,
                            int moe_topk = 0);
// The epilogue a call's arguments ask for.
RowEpilogueKind row_epilogue_of(const AddRmsNormArgs& args);
CallSignature qk_signature(const QkNormArgs& args);

// Where a call writes: every output as rows of bytes, and the word that makes each element NaN
// (any dtype's NaN; E4M3's NaN byte 0x7f for FP8). A call that fails once it has begun fills
// them all (CPU: cpu/backend.cc; CUDA's NCCL path: its header check), so that nothing of a
// failed call reads as numbers.
struct OutputRows {
  void* base;  // null: the call has no such output
  int64_t rows;
  uint64_t row_bytes;
  uint64_t stride_bytes;
  uint32_t word;
};
struct CallOutputs {
  static constexpr int kMost = 4;
  OutputRows rows[kMost];
  int count;
};
constexpr uint32_t kNanWord = 0x7fc07fc0u;     // fp32 0x7fc07fc0; bf16 and fp16 0x7fc0 twice
constexpr uint32_t kFp8NanWord = 0x7f7f7f7fu;  // E4M3's NaN in every byte
constexpr uint32_t kFloatNanWord = 0x7fc00000u;
// The same lists from a kernel, which knows its element size and whether it quantizes
// (outputs_of below on the host).
TPF_HOST_DEVICE CallOutputs row_outputs(const RowCall& call, uint64_t element_bytes, bool quant) {
  const uint64_t row_bytes = uint64_t(call.hidden) * element_bytes;
  CallOutputs out{};
  out.rows[out.count++] = {call.residual_out, call.tokens, row_bytes, row_bytes, kNanWord};
  out.rows[out.count++] = {call.norm_out, call.tokens, row_bytes, row_bytes, kNanWord};
  if (quant) {
    const uint64_t fp8_bytes = uint64_t(call.hidden);
    out.rows[out.count++] = {call.quant_out, call.tokens, fp8_bytes, fp8_bytes, kFp8NanWord};
    const int64_t scales = scale_count(output_scope_of(call.quant), call.tokens, call.hidden);
    out.rows[out.count++] = {call.scales_out, 1, uint64_t(scales) * 4, 0, kFloatNanWord};
  }
  return out;
}
TPF_HOST_DEVICE CallOutputs qk_outputs(const QkCall& call, uint64_t element_bytes) {
  CallOutputs out{};
  out.rows[out.count++] = {call.q_out, call.tokens, uint64_t(call.q_size) * element_bytes,
                           uint64_t(call.q_out_stride) * element_bytes, kNanWord};
  out.rows[out.count++] = {call.k_out, call.tokens, uint64_t(call.kv_size) * element_bytes,
                           uint64_t(call.k_out_stride) * element_bytes, kNanWord};
  return out;
}
inline CallOutputs outputs_of(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue) {
  return row_outputs(call, dtype_size(dtype), epilogue.quant);
}
inline CallOutputs outputs_of(const QkCall& call, DType dtype) {
  return qk_outputs(call, dtype_size(dtype));
}

// `team` null: the local form (no exchange; counts_k = 1).
RowCall make_row_call(const TeamState* team, const AddRmsNormArgs& args);
QkCall make_qk_call(const TeamState* team, const QkNormArgs& args);

}  // namespace tpfuse::impl
