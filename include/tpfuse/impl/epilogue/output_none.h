// Output policy: none (output.h). The norm's output is norm_out alone.
#pragma once

#include "tpfuse/impl/epilogue/output.h"

namespace tpfuse::impl {

struct NoOutput {
  static constexpr QuantMode kMode = QuantMode::kNone;
  static constexpr const char* kName = "none";
  static constexpr const char* kDescription = "none";
  static constexpr OutputScope kScope = OutputScope::kNone;
};

}  // namespace tpfuse::impl
