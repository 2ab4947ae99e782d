// Output policy: FP8 E4M3 with one scale a group of kQuantGroupSize elements (output.h),
// scale[t, g] = max(amax(n[t, 128 g : 128 g + 128]), kQuantMinAmax) / 448, written to scales_out
// [tokens, hidden / 128], row- or column-major.
#pragma once

#include "tpfuse/impl/epilogue/output.h"

namespace tpfuse::impl {

struct Fp8PerGroupOutput {
  static constexpr QuantMode kMode = QuantMode::kPerTokenGroup128;
  static constexpr const char* kName = "per_token_group_128";
  static constexpr const char* kDescription = "fp8 per token group of 128";
  static constexpr OutputScope kScope = OutputScope::kGroup;
  TPF_HOST_DEVICE static float scale(float quotient) { return quotient; }
};

}  // namespace tpfuse::impl
