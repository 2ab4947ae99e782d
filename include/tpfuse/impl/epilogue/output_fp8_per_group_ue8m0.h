// Output policy: FP8 E4M3 with one power-of-two scale a group of kQuantGroupSize elements
// (output.h), the DeepSeek-V3 form that DeepGEMM's UE8M0 scale factors hold:
//   scale[t, g] = 2^ceil(log2(max(amax(n[t, 128 g : 128 g + 128]), kQuantMinAmax) / 448)),
// written as fp32 to scales_out [tokens, hidden / 128], row- or column-major, as vLLM's and
// SGLang's per-token-group quantization with scale_ue8m0 returns them (the fp32 holds the
// power of two; its exponent byte is the UE8M0 byte, which a GEMM wanting packed UE8M0 takes
// from it). A scale is never below the amax's: the group's bytes do not saturate.
//
// The rounding up is done on the bits of the fp32 quotient m = max(amax, floor) / 448: m is
// normal (the floor keeps it above 2^-43), and a quotient correctly rounded to fp32 lies on the
// same side of every power of two as the exact one (448 = 7 * 2^6: an fp32 amax above
// 448 * 2^k exceeds it by more than 2^-24 relative, more than half an ulp of the quotient), so
// rounding m's bits up to its binade's top gives 2^ceil(log2) of the exact quotient. An infinite
// amax gives an infinite scale, as the other dynamic modes do.
#pragma once

#include "tpfuse/impl/epilogue/output.h"

namespace tpfuse::impl {

// The least power of two >= x, for a positive normal or infinite fp32 x.
TPF_HOST_DEVICE float power_of_two_at_least(float x) {
  const uint32_t bits = float_bits(x);
  const uint32_t binade = bits & 0xff800000u;
  return bits_float((bits & 0x007fffffu) != 0 ? binade + 0x00800000u : binade);
}

struct Fp8PerGroupUe8m0Output {
  static constexpr QuantMode kMode = QuantMode::kPerTokenGroup128Ue8m0;
  static constexpr const char* kName = "per_token_group_128_ue8m0";
  static constexpr const char* kDescription = "fp8 per token group of 128 with power-of-two scales";
  static constexpr OutputScope kScope = OutputScope::kGroup;
  TPF_HOST_DEVICE static float scale(float quotient) { return power_of_two_at_least(quotient); }
};

}  // namespace tpfuse::impl
