// Contribution policy: the rank's input row (AddRmsNormArgs::input), what a rank contributes to
// the sum unless it combines MoE rows (contribution_moe.h).
#pragma once

namespace tpfuse::impl {

struct InputContribution {
  static constexpr bool kCombines = false;
  static constexpr const char* kDescription = "input";
};

}  // namespace tpfuse::impl
