// What an Output policy is (the last family of a row epilogue: what the norm's output becomes
// besides norm_out). A policy is a struct in a header of its own, listed once in outputs.h:
//   kMode         its QuantMode (tpfuse.h): the C++ argument, the torch ops' enum value, and the
//                 code the call signature carries (signature_fields.h: the "quant" field);
//   kName         the enumerator's name (Python's tpfuse.Quant, the torch ops' enum);
//   kDescription  its name in messages ("quant is fp8 static");
//   kScope        where its scale comes from, which decides its arguments (validate.cc):
//                   kNone   no FP8 output: quant_out, quant_scale and scales_out are null;
//                   kCall   one scale given (quant_scale), none written;
//                   kToken  one scale a token computed and written to scales_out [tokens];
//                   kGroup  one a group of kQuantGroupSize elements, written to scales_out
//                           [tokens, hidden / 128] row- or column-major (hidden a multiple of
//                           128);
//   scale(q)      (kToken, kGroup) the scale of a token or group from the quotient
//                 q = max(amax, kQuantMinAmax) / 448 of its largest magnitude (fp8.h's
//                 dynamic_scale, computed by the caller: one IEEE division however many policies
//                 a kernel may pick from), a host+device step: the CUDA kernels (cuda/rows.cuh)
//                 and the CPU backend (cpu/rows.cc) call it, so a scale has the same bits on both.
// The bytes are quantize_vector's (fp8.h) at that scale on every backend. A policy adds no kernel:
// the kernels with an FP8 output pick the policy of the call's mode at run time (dispatch_output),
// so the instantiation count does not grow with the list.
#pragma once

#include <cstdint>

#include "tpfuse/impl/config.h"
#include "tpfuse/impl/epilogue/fp8.h"
#include "tpfuse/limits.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse::impl {

enum class OutputScope : int { kNone, kCall, kToken, kGroup };

// A policy's facts as values: what the host side (validation, messages, the outputs a call
// writes, the torch ops' shapes) asks of a mode.
struct OutputInfo {
  QuantMode mode;
  const char* name;
  const char* description;
  OutputScope scope;
};

template <typename Output>
constexpr OutputInfo output_info_of() {
  return {Output::kMode, Output::kName, Output::kDescription, Output::kScope};
}

// Where the scale of token `token`'s group `group` is stored (kGroup): row-major
// [tokens, groups] or column-major (index group * tokens + token).
TPF_HOST_DEVICE int64_t group_scale_index(int64_t token, int64_t group, int64_t tokens,
                                          int64_t groups, bool column_major) {
  return column_major ? group * tokens + token : token * groups + group;
}

}  // namespace tpfuse::impl
