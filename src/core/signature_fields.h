// The fields of a call signature's word[0] (tpfuse/impl/session.h's CallSignature): the one table
// that row_signature and qk_signature encode with (api.cc), that the NCCL path's stand-in copies
// the epilogue's fields from (cpu/rows.cc), and that a disagreement between ranks is decoded and
// named with (call_errors.cc), in the order its message checks them.
#pragma once

#include <cstdint>
#include <string>

#include "tpfuse/impl/enums.h"
#include "tpfuse/impl/epilogue/contributions.h"
#include "tpfuse/impl/epilogue/outputs.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse::impl {

// Which signatures carry a field.
enum class SignatureOf : int { kAll, kRows, kQk };

struct SignatureField {
  const char* name;  // as a message names it
  int shift;
  int width;  // bits
  SignatureOf of;
  // A value as a message writes it.
  std::string (*describe)(uint32_t value);

  constexpr uint32_t mask() const { return ((1u << width) - 1u) << shift; }
  constexpr uint32_t encode(uint32_t value) const { return (value << shift) & mask(); }
  constexpr uint32_t decode(uint32_t word) const { return (word & mask()) >> shift; }
  constexpr bool fits(uint32_t value) const { return value < (1u << width); }
};

namespace signature_field_names {
inline std::string dtype(uint32_t code) {
  return code <= 2 ? dtype_name(DType(int(code))) : "unknown";
}
inline std::string residual(uint32_t given) {
  return given ? "given" : "none";
}
inline std::string norm(uint32_t norm) {
  return norm ? "add + RMSNorm" : "a plain sum";
}
inline std::string weight(uint32_t weight) {
  return norm_weight_name(NormWeight(int(weight)));
}
inline std::string moe(uint32_t moe) {
  return moe ? MoeContribution::kDescription : InputContribution::kDescription;
}
inline std::string output(uint32_t mode) {
  return quant_mode_name(QuantMode(int(mode)));
}
inline std::string rope(uint32_t style) {
  return "style " + std::to_string(style);
}
inline std::string op(uint32_t op) {
  return std::to_string(op);  // call_errors.cc names ops itself
}
}  // namespace signature_field_names

// Bits 0-3: the op (CallOp), named by call_errors.cc with its stand-in distinction.
inline constexpr SignatureField kOpField{"the op / algorithm", 0, 4, SignatureOf::kAll,
                                         signature_field_names::op};
inline constexpr SignatureField kDTypeField{"dtype", 4, 4, SignatureOf::kAll,
                                            signature_field_names::dtype};
inline constexpr SignatureField kResidualField{"residual", 8, 1, SignatureOf::kRows,
                                               signature_field_names::residual};
inline constexpr SignatureField kNormField{"the epilogue", 9, 1, SignatureOf::kRows,
                                           signature_field_names::norm};
inline constexpr SignatureField kWeightField{"norm_weight", 10, 2, SignatureOf::kRows,
                                             signature_field_names::weight};
inline constexpr SignatureField kMoeField{"the input", 16, 1, SignatureOf::kRows,
                                          signature_field_names::moe};
// The Output policy's mode (epilogue/outputs.h); the QK norm keeps its RoPE style there.
inline constexpr SignatureField kOutputField{"quant", 12, 3, SignatureOf::kRows,
                                             signature_field_names::output};
inline constexpr SignatureField kRopeField{"rope", 12, 3, SignatureOf::kQk,
                                           signature_field_names::rope};

// The fields after the op, in the order a disagreement is looked for and named.
inline constexpr SignatureField kSignatureFields[] = {
    kDTypeField, kResidualField, kNormField, kWeightField, kMoeField, kOutputField, kRopeField};

// A row call's epilogue fields: what the NCCL path's stand-in headers carry of the user call.
inline constexpr uint32_t kRowEpilogueBits = kResidualField.mask() | kNormField.mask() |
                                             kWeightField.mask() | kOutputField.mask() |
                                             kMoeField.mask();

// Every listed output's code fits its field.
constexpr bool outputs_fit_signature() {
  for (const OutputInfo& info : RowOutputs::kInfos) {
    if (!kOutputField.fits(uint32_t(info.mode))) return false;
  }
  return true;
}
static_assert(outputs_fit_signature(), "an output's QuantMode does not fit the signature's field");

}  // namespace tpfuse::impl
