// The limits of the kernels: the one place each is defined.
#pragma once

#include <cstdint>

namespace tpfuse {

// Largest team; world sizes 2, 4 and 8 are specialized at compile time, others take a runtime path.
constexpr int kMaxWorldSize = 16;
// Widths: hidden must be a multiple of kHiddenMultiple elements and at most kMaxHidden.
constexpr int64_t kHiddenMultiple = 8;
constexpr int64_t kMaxHidden = 16384;
// FP8 output per token group: elements per group along hidden (hidden must be a multiple).
constexpr int64_t kQuantGroupSize = 128;
// The dynamic scales' floor: scale = max(amax, kQuantMinAmax) / 448 (an all-zero row stays 0).
constexpr float kQuantMinAmax = 1e-10f;
// MoE finalize: at most kMaxMoeTopK expert rows a token.
constexpr int kMaxMoeTopK = 16;
// QK norm: this rank's q_size + kv_size at most kMaxQkWidth 16-bit elements (half as many fp32),
// and at most kMaxQkRopeWidth with RoPE.
constexpr int64_t kMaxQkWidth = 32768;
constexpr int64_t kMaxQkRopeWidth = 12288;

}  // namespace tpfuse
