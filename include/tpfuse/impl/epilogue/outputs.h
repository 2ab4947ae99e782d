// The Output policies a row epilogue may end with (output.h says what a policy is): the one list,
// and the lookups every layer makes of it. A new output is a header beside these, a line in
// RowOutputs, and its QuantMode enumerator in tpfuse.h.
#pragma once

#include <cstdint>

#include "tpfuse/impl/epilogue/output.h"
#include "tpfuse/impl/epilogue/output_fp8_per_group.h"
#include "tpfuse/impl/epilogue/output_fp8_per_group_ue8m0.h"
#include "tpfuse/impl/epilogue/output_fp8_per_token.h"
#include "tpfuse/impl/epilogue/output_fp8_static.h"
#include "tpfuse/impl/epilogue/output_none.h"

namespace tpfuse::impl {

template <typename... Outputs>
struct OutputList {
  static constexpr int kCount = int(sizeof...(Outputs));
  static constexpr OutputInfo kInfos[sizeof...(Outputs)] = {output_info_of<Outputs>()...};
};

// Every output, NoOutput first.
using RowOutputs = OutputList<NoOutput, Fp8StaticOutput, Fp8PerTokenOutput, Fp8PerGroupOutput,
                              Fp8PerGroupUe8m0Output>;

// Calls fn(Output{}) with the listed output of `mode`; false if none is. Host and device: the
// kernels with an FP8 output pick the call's policy here, at run time.
template <typename Fn, typename... Outputs>
TPF_HOST_DEVICE bool dispatch_output_in(OutputList<Outputs...>, QuantMode mode, Fn&& fn) {
  bool found = false;
  ((!found && Outputs::kMode == mode ? (found = true, fn(Outputs{}), 0) : 0), ...);
  return found;
}

template <typename Fn>
TPF_HOST_DEVICE bool dispatch_output(QuantMode mode, Fn&& fn) {
  return dispatch_output_in(RowOutputs{}, mode, static_cast<Fn&&>(fn));
}

// The scope of `mode`'s output, host and device (kNone for a mode not listed).
TPF_HOST_DEVICE OutputScope output_scope_of(QuantMode mode) {
  OutputScope scope = OutputScope::kNone;
  dispatch_output(mode, [&](auto output) { scope = decltype(output)::kScope; });
  return scope;
}

// The scale step of `mode`'s output, one of those of scope kScope (kToken or kGroup), from the
// quotient (output.h). The GPU's quantize_row runs one code path a scope, the policies of a scope
// differing in this step alone: a path a policy held more registers, and spilled, in the local
// kernels.
template <OutputScope kScope>
TPF_HOST_DEVICE float output_scale(QuantMode mode, float quotient) {
  float scale = quotient;
  dispatch_output(mode, [&](auto output) {
    if constexpr (decltype(output)::kScope == kScope) scale = decltype(output)::scale(quotient);
  });
  return scale;
}

// The listed output of `mode`, or null.
constexpr const OutputInfo* find_output(QuantMode mode) {
  for (const OutputInfo& info : RowOutputs::kInfos) {
    if (info.mode == mode) return &info;
  }
  return nullptr;
}

// Whether `mode` is listed. (Not find_output(mode) != nullptr: under -fsanitize=undefined, g++ 12
// does not take a pointer into a static member array compared with null as a constant
// expression, and these serve static_asserts.)
constexpr bool lists_output(QuantMode mode) {
  for (const OutputInfo& info : RowOutputs::kInfos) {
    if (info.mode == mode) return true;
  }
  return false;
}

constexpr OutputScope output_scope(QuantMode mode) {
  for (const OutputInfo& info : RowOutputs::kInfos) {
    if (info.mode == mode) return info.scope;
  }
  return OutputScope::kNone;
}

// The fp32 scales an output of `scope` writes to scales_out, host and device.
TPF_HOST_DEVICE constexpr int64_t scale_count(OutputScope scope, int64_t tokens, int64_t hidden) {
  switch (scope) {
    case OutputScope::kToken:
      return tokens;
    case OutputScope::kGroup:
      return tokens * (hidden / kQuantGroupSize);
    case OutputScope::kNone:
    case OutputScope::kCall:
      return 0;
  }
  return 0;
}

// The fp32 scales a call of `mode` writes to scales_out. Host only (it reads RowOutputs::kInfos,
// which device code cannot: a GPU read of it faults); device code takes
// scale_count(output_scope_of(mode), ...).
constexpr int64_t output_scale_count(QuantMode mode, int64_t tokens, int64_t hidden) {
  return scale_count(output_scope(mode), tokens, hidden);
}

}  // namespace tpfuse::impl
