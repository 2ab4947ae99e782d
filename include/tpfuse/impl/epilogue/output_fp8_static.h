// Output policy: FP8 E4M3 at one static scale (output.h), q = e4m3(n / quant_scale), the
// scale calibrated and given (this rank's device memory on CUDA).
#pragma once

#include "tpfuse/impl/epilogue/output.h"

namespace tpfuse::impl {

struct Fp8StaticOutput {
  static constexpr QuantMode kMode = QuantMode::kStatic;
  static constexpr const char* kName = "static";
  static constexpr const char* kDescription = "fp8 static";
  static constexpr OutputScope kScope = OutputScope::kCall;
};

}  // namespace tpfuse::impl
