// Argument checks shared by every backend: each throws tpfuse::Error naming the argument and what
// was expected, before any work is queued.
#include "core/validate.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include "core/backend.h"
#include "core/error.h"
#include "tpfuse/impl/lamport.h"

namespace tpfuse::impl {

namespace {

bool is_aligned(const void* pointer) {
  return reinterpret_cast<uintptr_t>(pointer) % 16 == 0;
}

// Two ranges share no byte (empty ranges overlap nothing).
bool disjoint(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a);
  const auto y = reinterpret_cast<uintptr_t>(b);
  return a_bytes == 0 || b_bytes == 0 || x + a_bytes <= y || y + b_bytes <= x;
}

// Two [bytes]-long ranges either coincide (in-place use) or do not overlap at all.
bool same_or_disjoint(const void* a, const void* b, size_t bytes) {
  return a == b || disjoint(a, bytes, b, bytes);
}

// Bytes of the dynamic scales a call writes (none for a static scale or no FP8 output).
size_t scales_bytes_of(const AddRmsNormArgs& args) {
  return size_t(output_scale_count(args.quant, args.tokens, args.hidden)) * sizeof(float);
}

}  // namespace

// The FP8 output's arguments: present as its mode needs, aligned, and apart from every tensor
// the call reads or writes (the scales too: each is written once per token or group).
void validate_quant(const AddRmsNormArgs& args, const RowEpilogueKind& epilogue, size_t bytes,
                    const char* op) {
  TPF_CHECK_ARG(is_known(args.quant), op, "quant " << int(args.quant) << " is not a QuantMode");
  if (args.quant == QuantMode::kNone) {
    TPF_CHECK_ARG(
        args.quant_out == nullptr && args.quant_scale == nullptr && args.scales_out == nullptr, op,
        "quant_out, quant_scale or scales_out given but quant is none");
    return;
  }
  TPF_CHECK_ARG(epilogue.norm, op, "an FP8 output quantizes the norm: a plain sum has none");
  const bool rows = args.tokens > 0;
  TPF_CHECK_ARG(args.quant_out != nullptr || !rows, op,
                "quant_out is null but quant is " << quant_mode_name(args.quant));
  TPF_CHECK_ARG(args.quant_out == nullptr || is_aligned(args.quant_out), op,
                "quant_out must be 16-byte aligned, got " << args.quant_out);
  // What the output policy's scope asks (epilogue/output.h).
  const OutputScope scope = output_scope(args.quant);
  const bool static_scale = scope == OutputScope::kCall;
  TPF_CHECK_ARG(!static_scale || args.quant_scale != nullptr, op,
                "quant_scale is null: quant " << quant_mode_name(args.quant) << " needs the scale");
  TPF_CHECK_ARG(static_scale || args.quant_scale == nullptr, op,
                "quant_scale is given but quant is " << quant_mode_name(args.quant)
                                                     << " (the scales are computed)");
  TPF_CHECK_ARG(
      static_scale || args.scales_out != nullptr || !rows, op,
      "scales_out is null: quant " << quant_mode_name(args.quant) << " writes its scales there");
  TPF_CHECK_ARG(
      !static_scale || args.scales_out == nullptr, op,
      "scales_out is given but quant " << quant_mode_name(args.quant) << " computes no scales");
  TPF_CHECK_ARG(!args.scales_column_major || scope == OutputScope::kGroup, op,
                "scales_column_major is a layout of quant "
                    << quant_mode_name(QuantMode::kPerTokenGroup128)
                    << "'s scales (and the other group modes'), but quant is "
                    << quant_mode_name(args.quant));
  if (scope == OutputScope::kGroup) {
    TPF_CHECK_ARG(args.hidden % kQuantGroupSize == 0, op,
                  "hidden must be a multiple of " << kQuantGroupSize << " for quant "
                                                  << quant_mode_name(args.quant) << ", got "
                                                  << args.hidden);
  }
  for (const auto& [name, pointer] :
       {std::pair<const char*, const void*>{"quant_scale", args.quant_scale},
        {"scales_out", args.scales_out}}) {
    TPF_CHECK_ARG(pointer == nullptr || reinterpret_cast<uintptr_t>(pointer) % 4 == 0, op,
                  name << " must be 4-byte aligned, got " << pointer);
  }
  const size_t quant_bytes = size_t(args.tokens) * size_t(args.hidden);
  const size_t scales_bytes = scales_bytes_of(args);
  const size_t gamma_bytes = size_t(args.hidden) * dtype_size(args.dtype);
  struct Region {
    const char* name;
    const void* pointer;
    size_t bytes;
  };
  const Region others[] = {{"input", args.input, bytes},
                           {"residual", args.residual, bytes},
                           {"gamma", args.gamma, gamma_bytes},
                           {"residual_out", args.residual_out, bytes},
                           {"norm_out", args.norm_out, bytes}};
  const Region written[] = {{"quant_out", args.quant_out, quant_bytes},
                            {"scales_out", args.scales_out, scales_bytes}};
  for (const Region& out : written) {
    if (out.pointer == nullptr) continue;
    for (const Region& other : others) {
      TPF_CHECK_ARG(
          other.pointer == nullptr || disjoint(out.pointer, out.bytes, other.pointer, other.bytes),
          op,
          out.name << " overlaps " << other.name << ": the FP8 outputs must be "
                   << "apart from every other tensor");
    }
  }
  if (args.quant_out != nullptr && args.scales_out != nullptr) {
    TPF_CHECK_ARG(disjoint(args.quant_out, quant_bytes, args.scales_out, scales_bytes), op,
                  "scales_out overlaps quant_out");
  }
  if (args.quant_scale != nullptr) {
    for (const Region& out : {Region{"residual_out", args.residual_out, bytes},
                              Region{"norm_out", args.norm_out, bytes},
                              Region{"quant_out", args.quant_out, quant_bytes}}) {
      TPF_CHECK_ARG(out.pointer == nullptr ||
                        disjoint(out.pointer, out.bytes, args.quant_scale, sizeof(float)),
                    op, out.name << " overlaps quant_scale: outputs may not touch it");
    }
  }
}

// The MoE finalize's arguments: all or none, in the epilogue it is built for, aligned, and apart
// from every output.
void validate_moe(const AddRmsNormArgs& args, const RowEpilogueKind& epilogue, size_t bytes,
                  const char* op) {
  if (args.moe_expert_rows == nullptr) {
    TPF_CHECK_ARG(args.moe_weights == nullptr && args.moe_shared == nullptr, op,
                  "moe_weights or moe_shared given but moe_expert_rows is null");
    TPF_CHECK_ARG(args.moe_topk == 0 && !args.moe_weights_in_dtype, op,
                  "moe_topk or moe_weights_in_dtype set but moe_expert_rows is null");
    return;
  }
  TPF_CHECK_ARG(args.input == nullptr, op,
                "input must be null with moe_expert_rows: the rank's contribution is the MoE "
                "combine of its expert rows");
  TPF_CHECK_ARG(args.moe_topk >= 1 && args.moe_topk <= kMaxMoeTopK, op,
                "moe_topk must be in [1, " << kMaxMoeTopK << "], got " << args.moe_topk);
  TPF_CHECK_ARG(args.moe_weights != nullptr, op, "moe_weights is null (moe_expert_rows given)");
  TPF_CHECK_ARG(epilogue.residual, op, "the MoE finalize needs a residual (residual is null)");
  TPF_CHECK_ARG(args.norm_weight == NormWeight::kGamma, op,
                "the MoE finalize is built for norm_weight gamma, got "
                    << norm_weight_name(args.norm_weight));
  TPF_CHECK_ARG(is_aligned(args.moe_expert_rows), op,
                "moe_expert_rows must be 16-byte aligned, got " << args.moe_expert_rows);
  TPF_CHECK_ARG(args.moe_shared == nullptr || is_aligned(args.moe_shared), op,
                "moe_shared must be 16-byte aligned, got " << args.moe_shared);
  const size_t weight_size = args.moe_weights_in_dtype ? dtype_size(args.dtype) : sizeof(float);
  TPF_CHECK_ARG(reinterpret_cast<uintptr_t>(args.moe_weights) % weight_size == 0, op,
                "moe_weights must be " << weight_size << "-byte aligned, got " << args.moe_weights);
  const size_t topk = size_t(args.moe_topk);
  struct Region {
    const char* name;
    const void* pointer;
    size_t bytes;
  };
  const Region read[] = {
      {"moe_expert_rows", args.moe_expert_rows, bytes * topk},
      {"moe_weights", args.moe_weights, size_t(args.tokens) * topk * weight_size},
      {"moe_shared", args.moe_shared, bytes}};
  const Region written[] = {{"residual_out", args.residual_out, bytes},
                            {"norm_out", args.norm_out, bytes},
                            {"quant_out", args.quant_out, size_t(args.tokens * args.hidden)},
                            {"scales_out", args.scales_out, scales_bytes_of(args)}};
  for (const Region& out : written) {
    for (const Region& in : read) {
      TPF_CHECK_ARG(out.pointer == nullptr || in.pointer == nullptr ||
                        disjoint(out.pointer, out.bytes, in.pointer, in.bytes),
                    op,
                    out.name << " overlaps " << in.name << ": outputs may not touch the MoE "
                             << "inputs");
    }
  }
}

void validate_add_rmsnorm(const AddRmsNormArgs& args, const RowEpilogueKind& epilogue,
                          const char* op) {
  TPF_CHECK_ARG(is_known(args.dtype), op,
                "dtype " << int(args.dtype) << " is not one of float32, float16, bfloat16");
  TPF_CHECK_ARG(args.tokens >= 0, op, "tokens must be >= 0, got " << args.tokens);
  TPF_CHECK_ARG(args.hidden > 0 && args.hidden % kHiddenMultiple == 0 && args.hidden <= kMaxHidden,
                op,
                (epilogue.norm ? "hidden" : "count")
                    << " must be a positive multiple of " << kHiddenMultiple << " and at most "
                    << kMaxHidden << ", got " << args.hidden);
  // With no rows the row tensors may be empty (null: torch's data_ptr of an empty tensor).
  const bool rows = args.tokens > 0;
  TPF_CHECK_ARG(args.input != nullptr || epilogue.moe || !rows, op, "input is null");
  // With an FP8 output the bf16 norm is optional (quant_out is then the norm's only copy).
  const bool fp8_only = epilogue.norm && args.quant != QuantMode::kNone;
  TPF_CHECK_ARG(args.norm_out != nullptr || fp8_only || !rows, op,
                (epilogue.norm ? "norm_out" : "out") << " is null");
  if (epilogue.norm) {
    TPF_CHECK_ARG(args.gamma != nullptr, op, "gamma is null");
    TPF_CHECK_ARG(std::isfinite(args.eps) && args.eps >= 0.0f, op,
                  "eps must be finite and >= 0, got " << args.eps);
  }
  TPF_CHECK_ARG(is_known(args.norm_weight), op,
                "norm_weight " << int(args.norm_weight) << " is not a NormWeight");
  if (epilogue.residual) {
    TPF_CHECK_ARG(args.residual_out != nullptr || !rows, op,
                  "residual_out is null but a residual was given (it receives sum + residual)");
  }
  const std::pair<const char*, const void*> pointers[] = {{"input", args.input},
                                                          {"residual", args.residual},
                                                          {"gamma", args.gamma},
                                                          {"residual_out", args.residual_out},
                                                          {"norm_out", args.norm_out}};
  for (const auto& [name, pointer] : pointers) {
    TPF_CHECK_ARG(pointer == nullptr || is_aligned(pointer), op,
                  name << " must be 16-byte aligned, got " << pointer);
  }
  const size_t bytes = size_t(args.tokens) * size_t(args.hidden) * dtype_size(args.dtype);
  const std::pair<const char*, const void*> inputs[] = {{"input", args.input},
                                                        {"residual", args.residual}};
  const std::pair<const char*, void*> outputs[] = {{"residual_out", args.residual_out},
                                                   {"norm_out", args.norm_out}};
  for (const auto& [out_name, out] : outputs) {
    if (out == nullptr) continue;
    for (const auto& [in_name, in] : inputs) {
      TPF_CHECK_ARG(in == nullptr || same_or_disjoint(out, in, bytes), op,
                    out_name << " partially overlaps " << in_name
                             << ": an output must be the same tensor as an input or disjoint");
    }
  }
  // The weight is read by every row: an output over it (even exactly) would change it mid-call.
  const size_t gamma_bytes = size_t(args.hidden) * dtype_size(args.dtype);
  for (const auto& [out_name, out] : outputs) {
    TPF_CHECK_ARG(out == nullptr || !epilogue.norm || disjoint(out, bytes, args.gamma, gamma_bytes),
                  op, out_name << " overlaps gamma (the norm's weight): outputs may not touch it");
  }
  if (args.residual_out != nullptr && args.norm_out != nullptr) {
    TPF_CHECK_ARG(args.residual_out == args.norm_out ||
                      same_or_disjoint(args.residual_out, args.norm_out, bytes),
                  op, "residual_out partially overlaps norm_out");
    TPF_CHECK_ARG(args.residual_out != args.norm_out, op,
                  "residual_out and norm_out are the same tensor");
  }
  validate_quant(args, epilogue, bytes, op);
  validate_moe(args, epilogue, bytes, op);
}

void validate_positions_on_host(const QkNormArgs& a, const char* op) {
  if (a.rope == RopeStyle::kNone || a.positions == nullptr) return;
  for (int64_t token = 0; token < a.tokens; ++token) {
    TPF_CHECK_ARG(a.positions[token] >= 0 && a.positions[token] < a.max_position, op,
                  "positions[" << token << "] = " << a.positions[token]
                               << " is outside [0, max_position = " << a.max_position << ")");
  }
}

Algorithm choose_qk_algorithm(const TeamState& team, const QkNormArgs& a, const char* op) {
  TPF_CHECK_ARG(is_known(a.algorithm), op,
                "algorithm " << int(a.algorithm) << " is not an Algorithm");
  TPF_CHECK_ARG(a.algorithm != Algorithm::kTwoShot, op,
                "algorithm twoshot is not offered for the QK norm (its packets are 16 bytes a "
                "token): use auto, oneshot or nccl");
  const bool has_nccl = team.ops->has_nccl_path(team);
  const bool fits = a.tokens >= 0 && size_t(a.tokens) * sizeof(Vec16) <= team.packet_bytes();
  if (a.algorithm == Algorithm::kNccl) {
    TPF_CHECK_ARG(has_nccl, op,
                  "algorithm nccl needs NCCL, which this build or team does not have");
    return Algorithm::kNccl;
  }
  if (a.algorithm == Algorithm::kOneShot || !has_nccl) {
    TPF_CHECK_ARG(team.fused, op,
                  "the fused kernel needs peer stores, which this team does not use: "
                      << team.fallback_reason);
    TPF_CHECK_ARG(fits, op,
                  "tokens " << a.tokens << " need " << size_t(a.tokens) * sizeof(Vec16)
                            << " packet bytes, over the team's " << team.packet_bytes());
    return Algorithm::kOneShot;
  }
  return team.fused && fits ? Algorithm::kOneShot : Algorithm::kNccl;
}

void validate_qk_rmsnorm(const TeamState& team, const QkNormArgs& a, const char* op) {
  TPF_CHECK_ARG(
      a.kv_replicas >= 1 && team.world_size() % a.kv_replicas == 0, op,
      "kv_replicas must divide the world size " << team.world_size() << ", got " << a.kv_replicas);
}

void validate_qk_args(const QkNormArgs& a, const char* op) {
  TPF_CHECK_ARG(is_known(a.dtype), op,
                "dtype " << int(a.dtype) << " is not one of float32, float16, bfloat16");
  TPF_CHECK_ARG(a.tokens >= 0, op, "tokens must be >= 0, got " << a.tokens);
  TPF_CHECK_ARG(
      a.q_size > 0 && a.q_size % kHiddenMultiple == 0, op,
      "q_size must be a positive multiple of " << kHiddenMultiple << ", got " << a.q_size);
  TPF_CHECK_ARG(
      a.kv_size > 0 && a.kv_size % kHiddenMultiple == 0, op,
      "kv_size must be a positive multiple of " << kHiddenMultiple << ", got " << a.kv_size);
  TPF_CHECK_ARG((a.q_size + a.kv_size) * int64_t(dtype_size(a.dtype)) <= kMaxQkWidth * 2, op,
                "q_size + kv_size must be at most "
                    << kMaxQkWidth * 2 / int64_t(dtype_size(a.dtype)) << " elements of "
                    << dtype_name(a.dtype) << ", got " << a.q_size + a.kv_size);
  TPF_CHECK_ARG(a.q_global_size >= a.q_size, op,
                "q_global_size must be >= q_size (" << a.q_size << "), got " << a.q_global_size);
  TPF_CHECK_ARG(a.k_global_size >= a.kv_size, op,
                "k_global_size must be >= kv_size (" << a.kv_size << "), got " << a.k_global_size);
  TPF_CHECK_ARG(std::isfinite(a.eps) && a.eps >= 0.0f, op,
                "eps must be finite and >= 0, got " << a.eps);
  TPF_CHECK_ARG(a.qkv != nullptr || a.tokens == 0, op, "qkv is null");
  TPF_CHECK_ARG(a.q_gamma != nullptr, op, "q_gamma is null");
  TPF_CHECK_ARG(a.k_gamma != nullptr, op, "k_gamma is null");
  const std::pair<const char*, const void*> pointers[] = {{"qkv", a.qkv},
                                                          {"q_out", a.q_out},
                                                          {"k_out", a.k_out},
                                                          {"q_gamma", a.q_gamma},
                                                          {"k_gamma", a.k_gamma}};
  for (const auto& [name, pointer] : pointers) {
    TPF_CHECK_ARG(pointer == nullptr || is_aligned(pointer), op,
                  name << " must be 16-byte aligned, got " << pointer);
  }
  const size_t element = dtype_size(a.dtype);
  const size_t qkv_bytes = size_t(a.tokens) * size_t(a.q_size + 2 * a.kv_size) * element;
  const size_t q_bytes = size_t(a.tokens) * size_t(a.q_size) * element;
  const size_t k_bytes = size_t(a.tokens) * size_t(a.kv_size) * element;
  TPF_CHECK_ARG(a.q_out == nullptr || disjoint(a.q_out, q_bytes, a.qkv, qkv_bytes), op,
                "q_out overlaps qkv: pass q_out = nullptr to write in place");
  TPF_CHECK_ARG(a.k_out == nullptr || disjoint(a.k_out, k_bytes, a.qkv, qkv_bytes), op,
                "k_out overlaps qkv: pass k_out = nullptr to write in place");
  TPF_CHECK_ARG(
      a.q_out == nullptr || a.k_out == nullptr || disjoint(a.q_out, q_bytes, a.k_out, k_bytes), op,
      "q_out overlaps k_out");
  // What the call writes (q_out / k_out, or qkv in place) may not touch what it only reads.
  const std::pair<const char*, std::pair<const void*, size_t>> written[] = {
      {a.q_out != nullptr ? "q_out" : "qkv (in place)",
       {a.q_out != nullptr ? a.q_out : a.qkv, a.q_out != nullptr ? q_bytes : qkv_bytes}},
      {a.k_out != nullptr ? "k_out" : "qkv (in place)",
       {a.k_out != nullptr ? a.k_out : a.qkv, a.k_out != nullptr ? k_bytes : qkv_bytes}}};
  const bool rope = a.rope != RopeStyle::kNone;
  const std::pair<const char*, std::pair<const void*, size_t>> read_only[] = {
      {"q_gamma", {a.q_gamma, size_t(a.q_size) * element}},
      {"k_gamma", {a.k_gamma, size_t(a.kv_size) * element}},
      {"positions", {rope ? a.positions : nullptr, size_t(a.tokens) * sizeof(int64_t)}},
      {"cos_sin_cache",
       {rope ? a.cos_sin_cache : nullptr, size_t(std::max<int64_t>(a.max_position, 0)) *
                                              size_t(std::max<int64_t>(a.rotary_dim, 0)) *
                                              sizeof(float)}}};
  for (const auto& [out_name, out] : written) {
    for (const auto& [in_name, in] : read_only) {
      TPF_CHECK_ARG(in.first == nullptr || disjoint(out.first, out.second, in.first, in.second), op,
                    out_name << " overlaps " << in_name << ": outputs may not touch it");
    }
  }
  TPF_CHECK_ARG(is_known(a.rope), op, "rope " << int(a.rope) << " is not a RopeStyle");
  if (a.rope != RopeStyle::kNone) {
    TPF_CHECK_ARG(a.head_dim > 0 && a.q_size % a.head_dim == 0 && a.kv_size % a.head_dim == 0, op,
                  "head_dim must divide q_size (" << a.q_size << ") and kv_size (" << a.kv_size
                                                  << "), got " << a.head_dim);
    TPF_CHECK_ARG(a.rotary_dim >= 2 && a.rotary_dim % 2 == 0 && a.rotary_dim <= a.head_dim, op,
                  "rotary_dim must be even and in [2, head_dim = " << a.head_dim << "], got "
                                                                   << a.rotary_dim);
    TPF_CHECK_ARG(a.q_size + a.kv_size <= kMaxQkRopeWidth, op,
                  "q_size + kv_size must be at most " << kMaxQkRopeWidth << " with RoPE, got "
                                                      << a.q_size + a.kv_size);
    TPF_CHECK_ARG(a.positions != nullptr, op, "positions is null but rope is set");
    TPF_CHECK_ARG(a.cos_sin_cache != nullptr, op, "cos_sin_cache is null but rope is set");
    TPF_CHECK_ARG(a.max_position > 0, op, "max_position must be > 0, got " << a.max_position);
    TPF_CHECK_ARG(reinterpret_cast<uintptr_t>(a.positions) % 8 == 0, op,
                  "positions must be 8-byte aligned");
    TPF_CHECK_ARG(reinterpret_cast<uintptr_t>(a.cos_sin_cache) % 4 == 0, op,
                  "cos_sin_cache must be 4-byte aligned");
  }
}

void validate_team_options(const TeamOptions& options, const char* op) {
  // 16 bytes hold the smallest row a call carries (kHiddenMultiple 16-bit elements) and one QK
  // token's packet; the upper bound keeps every workspace size (3 x world x packet) exact.
  constexpr size_t kMostPacketBytes = size_t{1} << 40;
  TPF_CHECK_ARG(
      options.packet_bytes >= 16 && options.packet_bytes % 16 == 0 &&
          options.packet_bytes <= kMostPacketBytes,
      op,
      "options.packet_bytes must be a multiple of 16 in [16, 2^40], got " << options.packet_bytes);
  // Seconds become nanoseconds in a 64-bit count: at most a year (0 waits forever).
  constexpr double kMostSeconds = 365.0 * 24 * 3600;
  TPF_CHECK_ARG(options.peer_timeout_seconds >= 0 && options.peer_timeout_seconds <= kMostSeconds,
                op,
                "options.peer_timeout_seconds must be in [0, " << kMostSeconds << "], got "
                                                               << options.peer_timeout_seconds);
  TPF_CHECK_ARG(
      options.handshake_timeout_seconds >= 0 && options.handshake_timeout_seconds <= kMostSeconds,
      op,
      "options.handshake_timeout_seconds must be in [0, " << kMostSeconds << "], got "
                                                          << options.handshake_timeout_seconds);
}

}  // namespace tpfuse::impl
