// Output policy: FP8 E4M3 with one scale a token (output.h),
// scale[t] = max(amax(n[t, :]), kQuantMinAmax) / 448, written to scales_out [tokens].
#pragma once

#include "tpfuse/impl/epilogue/output.h"

namespace tpfuse::impl {

struct Fp8PerTokenOutput {
  static constexpr QuantMode kMode = QuantMode::kPerToken;
  static constexpr const char* kName = "per_token";
  static constexpr const char* kDescription = "fp8 per token";
  static constexpr OutputScope kScope = OutputScope::kToken;
  TPF_HOST_DEVICE static float scale(float quotient) { return quotient; }
};

}  // namespace tpfuse::impl
