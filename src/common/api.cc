// The public entry points: validate, then hand the call to the team's backend.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>

#include "common/error.h"
#include "common/team_state.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
  }
  return "unknown";
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat16:
      return 2;
    case DType::kBFloat16:
      return 2;
  }
  return 0;
}

namespace {
const impl::TeamState& state_of(const Team& team) {
  if (team.state() == nullptr)
    throw Error("tpfuse: the Team handle is empty (default-constructed)");
  return *team.state();
}
}  // namespace

int Team::rank() const {
  return state_of(*this).rank;
}
int Team::world_size() const {
  return state_of(*this).world_size;
}
Backend Team::backend() const {
  return state_of(*this).backend;
}
int Team::device() const {
  return state_of(*this).device;
}
size_t Team::packet_bytes() const {
  return state_of(*this).packet_bytes;
}

int64_t Team::max_tokens(int64_t hidden, DType dtype, Algorithm algorithm) const {
  const impl::TeamState& state = state_of(*this);
  if (hidden <= 0) return 0;
  const size_t row_bytes = size_t(hidden) * dtype_size(dtype);
  const int64_t oneshot = int64_t(state.packet_bytes / row_bytes);
  const int64_t twoshot = impl::twoshot_max_tokens(state.world_size, state.packet_bytes, row_bytes);
  switch (algorithm) {
    case Algorithm::kOneShot:
      return state.fused ? oneshot : 0;
    case Algorithm::kTwoShot:
      return state.fused ? twoshot : 0;
    case Algorithm::kNccl:
    case Algorithm::kAuto:
      if (state.backend == Backend::kCpu || state.nccl_comm != nullptr) {
        return std::numeric_limits<int64_t>::max();
      }
      return algorithm == Algorithm::kNccl || !state.fused ? 0 : std::max(oneshot, twoshot);
  }
  return 0;
}

Algorithm Team::choose(int64_t tokens, int64_t hidden, DType dtype, Algorithm requested) const {
  const char* op = "Team::choose";
  TPF_CHECK_ARG(tokens >= 0, op, "tokens must be >= 0, got " << tokens);
  TPF_CHECK_ARG(hidden > 0, op, "hidden must be > 0, got " << hidden);
  TPF_CHECK_ARG(int(dtype) >= 0 && int(dtype) <= 2, op, "dtype " << int(dtype) << " is unknown");
  return impl::choose_algorithm(state_of(*this), tokens, hidden, dtype, requested, op);
}

const std::string& Team::fallback_reason() const {
  return state_of(*this).fallback_reason;
}

const std::string& Team::peer_memory() const {
  return state_of(*this).peer_memory;
}

void Team::check() const {
  const impl::TeamState& state = state_of(*this);
  if (state.backend == Backend::kCuda) {
    impl::cuda_check(state);
  } else {
    impl::cpu_check(state);
  }
}

namespace impl {

void validate_team(const Team& team, const char* op) {
  TPF_CHECK_ARG(team.state() != nullptr, op, "team is an empty handle");
}

namespace {

bool is_aligned(const void* pointer) {
  return reinterpret_cast<uintptr_t>(pointer) % 16 == 0;
}

// Two [bytes]-long ranges either coincide (in-place use) or do not overlap at all.
bool same_or_disjoint(const void* a, const void* b, size_t bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a);
  const auto y = reinterpret_cast<uintptr_t>(b);
  return x == y || x + bytes <= y || y + bytes <= x;
}

}  // namespace

void validate_add_rmsnorm(const AddRmsNormArgs& args, Epilogue epilogue, const char* op) {
  const int dtype = int(args.dtype);
  TPF_CHECK_ARG(dtype >= 0 && dtype <= 2, op,
                "dtype " << dtype << " is not one of float32, float16, bfloat16");
  TPF_CHECK_ARG(args.tokens >= 0, op, "tokens must be >= 0, got " << args.tokens);
  TPF_CHECK_ARG(args.hidden > 0 && args.hidden % kHiddenMultiple == 0 && args.hidden <= kMaxHidden,
                op,
                (epilogue == Epilogue::kSum ? "count" : "hidden")
                    << " must be a positive multiple of " << kHiddenMultiple << " and at most "
                    << kMaxHidden << ", got " << args.hidden);
  TPF_CHECK_ARG(args.input != nullptr, op, "input is null");
  TPF_CHECK_ARG(args.norm_out != nullptr, op,
                (epilogue == Epilogue::kSum ? "out" : "norm_out") << " is null");
  const bool has_norm = epilogue != Epilogue::kSum;
  if (has_norm) {
    TPF_CHECK_ARG(args.gamma != nullptr, op, "gamma is null");
    TPF_CHECK_ARG(std::isfinite(args.eps) && args.eps >= 0.0f, op,
                  "eps must be finite and >= 0, got " << args.eps);
  }
  if (epilogue == Epilogue::kAddRmsNorm) {
    TPF_CHECK_ARG(args.residual_out != nullptr, op,
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
  if (args.residual_out != nullptr) {
    TPF_CHECK_ARG(args.residual_out == args.norm_out ||
                      same_or_disjoint(args.residual_out, args.norm_out, bytes),
                  op, "residual_out partially overlaps norm_out");
    TPF_CHECK_ARG(args.residual_out != args.norm_out, op,
                  "residual_out and norm_out are the same tensor");
  }
}

OneShotParams make_local_params(const AddRmsNormArgs& args) {
  OneShotParams params{};
  params.input = args.input;
  params.residual = args.residual;
  params.gamma = args.gamma;
  params.residual_out = args.residual_out;
  params.norm_out = args.norm_out;
  params.tokens = args.tokens;
  params.hidden = args.hidden;
  params.eps = args.eps;
  return params;
}

OneShotParams make_oneshot_params(const TeamState& team, const AddRmsNormArgs& args) {
  OneShotParams params = make_local_params(args);
  for (int r = 0; r < kMaxWorld; ++r) params.workspace[r] = team.workspace[r];
  params.control = team.control;
  params.error_flag = team.error_flag;
  params.rank = team.rank;
  params.world_size = team.world_size;
  params.packet_bytes = team.packet_bytes;
  params.timeout_ns = team.timeout_ns;
  return params;
}

ExchangeParams make_exchange_params(const TeamState& team) {
  ExchangeParams exchange{};
  for (int r = 0; r < kMaxWorld; ++r) exchange.workspace[r] = team.workspace[r];
  exchange.control = team.control;
  exchange.error_flag = team.error_flag;
  exchange.rank = team.rank;
  exchange.world_size = team.world_size;
  exchange.packet_bytes = team.packet_bytes;
  exchange.timeout_ns = team.timeout_ns;
  return exchange;
}

QkNormParams make_qk_params(const TeamState& team, const QkNormArgs& args) {
  QkNormParams params = make_qk_local_params(args);
  params.exchange = make_exchange_params(team);
  params.counts_k = team.rank % args.kv_replicas == 0;
  return params;
}

QkNormParams make_qk_local_params(const QkNormArgs& args) {
  QkNormParams params{};
  const int64_t row = args.q_size + 2 * args.kv_size;
  const size_t element = dtype_size(args.dtype);
  params.qkv = args.qkv;
  params.q_out = args.q_out != nullptr ? args.q_out : const_cast<void*>(args.qkv);
  params.q_out_stride = args.q_out != nullptr ? args.q_size : row;
  params.k_out = args.k_out != nullptr
                     ? args.k_out
                     : static_cast<char*>(const_cast<void*>(args.qkv)) + args.q_size * element;
  params.k_out_stride = args.k_out != nullptr ? args.kv_size : row;
  params.q_gamma = args.q_gamma;
  params.k_gamma = args.k_gamma;
  params.tokens = args.tokens;
  params.q_size = args.q_size;
  params.kv_size = args.kv_size;
  params.q_global_size = args.q_global_size;
  params.k_global_size = args.k_global_size;
  params.counts_k = 1;
  params.eps = args.eps;
  params.rope = int(args.rope);
  params.head_dim = args.head_dim;
  params.rotary_dim = args.rotary_dim;
  params.positions = args.positions;
  params.cos_sin_cache = args.cos_sin_cache;
  return params;
}

Algorithm choose_qk_algorithm(const TeamState& team, const QkNormArgs& a, const char* op) {
  const int requested = int(a.algorithm);
  TPF_CHECK_ARG(requested >= 0 && requested <= 3, op,
                "algorithm " << requested << " is not an Algorithm");
  TPF_CHECK_ARG(a.algorithm != Algorithm::kTwoShot, op,
                "algorithm twoshot is not offered for the QK norm (its packets are 16 bytes a "
                "token): use auto, oneshot or nccl");
  const bool has_nccl = team.backend == Backend::kCpu || team.nccl_comm != nullptr;
  const bool fits = a.tokens >= 0 && size_t(a.tokens) * sizeof(Vec16) <= team.packet_bytes;
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
                            << " packet bytes, over the team's " << team.packet_bytes);
    return Algorithm::kOneShot;
  }
  return team.fused && fits ? Algorithm::kOneShot : Algorithm::kNccl;
}

void validate_qk_rmsnorm(const TeamState& team, const QkNormArgs& a, Algorithm algorithm,
                         const char* op) {
  TPF_CHECK_ARG(
      a.kv_replicas >= 1 && team.world_size % a.kv_replicas == 0, op,
      "kv_replicas must divide the world size " << team.world_size << ", got " << a.kv_replicas);
  if (algorithm == Algorithm::kNccl && team.backend == Backend::kCuda) {
    TPF_CHECK_ARG(size_t(a.tokens) * 8 <= team.packet_bytes, op,
                  "tokens " << a.tokens << " need " << size_t(a.tokens) * 8
                            << " bytes of sums, over the team's NCCL scratch of "
                            << team.packet_bytes);
  }
}

void validate_qk_args(const QkNormArgs& a, const char* op) {
  const int dtype = int(a.dtype);
  TPF_CHECK_ARG(dtype >= 0 && dtype <= 2, op,
                "dtype " << dtype << " is not one of float32, float16, bfloat16");
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
  TPF_CHECK_ARG(a.qkv != nullptr, op, "qkv is null");
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
  const auto disjoint = [](const void* x, size_t x_bytes, const void* y, size_t y_bytes) {
    const auto p = reinterpret_cast<uintptr_t>(x);
    const auto q = reinterpret_cast<uintptr_t>(y);
    return p + x_bytes <= q || q + y_bytes <= p;
  };
  const size_t q_bytes = size_t(a.tokens) * size_t(a.q_size) * element;
  const size_t k_bytes = size_t(a.tokens) * size_t(a.kv_size) * element;
  TPF_CHECK_ARG(a.q_out == nullptr || disjoint(a.q_out, q_bytes, a.qkv, qkv_bytes), op,
                "q_out overlaps qkv: pass q_out = nullptr to write in place");
  TPF_CHECK_ARG(a.k_out == nullptr || disjoint(a.k_out, k_bytes, a.qkv, qkv_bytes), op,
                "k_out overlaps qkv: pass k_out = nullptr to write in place");
  TPF_CHECK_ARG(
      a.q_out == nullptr || a.k_out == nullptr || disjoint(a.q_out, q_bytes, a.k_out, k_bytes), op,
      "q_out overlaps k_out");
  const int rope = int(a.rope);
  TPF_CHECK_ARG(rope >= 0 && rope <= 2, op, "rope " << rope << " is not a RopeStyle");
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
  TPF_CHECK_ARG(
      options.packet_bytes >= 16 && options.packet_bytes % 16 == 0, op,
      "options.packet_bytes must be a positive multiple of 16, got " << options.packet_bytes);
  TPF_CHECK_ARG(options.peer_timeout_seconds >= 0, op,
                "options.peer_timeout_seconds must be >= 0, got " << options.peer_timeout_seconds);
}

namespace {

Algorithm run_add_rmsnorm(const Team& team, const AddRmsNormArgs& args, Epilogue epilogue,
                          cudaStream_t stream, const char* op) {
  validate_team(team, op);
  const TeamState& state = *team.state();
  validate_add_rmsnorm(args, epilogue, op);
  const Algorithm algorithm =
      choose_algorithm(state, args.tokens, args.hidden, args.dtype, args.algorithm, op);
  if (state.backend == Backend::kCuda) {
    cuda_validate_call(state, args, stream, op);
  } else {
    TPF_CHECK_ARG(stream == nullptr, op, "stream must be null for a CPU-backend team");
  }
  if (args.tokens == 0) return algorithm;  // every rank skips alike, no slot is used
  const OneShotParams params = make_oneshot_params(state, args);
  const bool cuda = state.backend == Backend::kCuda;
  switch (algorithm) {
    case Algorithm::kOneShot:
      cuda ? cuda_oneshot(state, params, args.dtype, epilogue, stream)
           : cpu_oneshot(state, params, args.dtype, epilogue);
      break;
    case Algorithm::kTwoShot:
      cuda ? cuda_twoshot(state, params, args.dtype, epilogue, stream)
           : cpu_twoshot(state, params, args.dtype, epilogue);
      break;
    default:
      cuda ? cuda_nccl_path(state, params, args.dtype, epilogue, stream)
           : cpu_nccl_path(state, params, args.dtype, epilogue);
      break;
  }
  return algorithm;
}

}  // namespace
}  // namespace impl

Algorithm allreduce_add_rmsnorm(const Team& team, const AddRmsNormArgs& args, cudaStream_t stream) {
  const impl::Epilogue epilogue =
      args.residual != nullptr ? impl::Epilogue::kAddRmsNorm : impl::Epilogue::kRmsNorm;
  return impl::run_add_rmsnorm(team, args, epilogue, stream, "allreduce_add_rmsnorm");
}

Algorithm allreduce(const Team& team, const void* input, void* out, int64_t count, DType dtype,
                    cudaStream_t stream, Algorithm algorithm) {
  AddRmsNormArgs args;
  args.input = input;
  args.norm_out = out;
  args.tokens = 1;
  args.hidden = count;
  args.dtype = dtype;
  args.algorithm = algorithm;
  // A flat message is carried as rows so that it spreads over many blocks: the widest row of
  // at most kFlatRow elements (a multiple of kHiddenMultiple) that divides count. The sum does
  // not depend on how rows are cut.
  constexpr int64_t kFlatRow = 2048;
  if (count > kFlatRow && count % kHiddenMultiple == 0) {
    int64_t row = kFlatRow;
    while (count % row != 0) row -= kHiddenMultiple;
    args.hidden = row;
    args.tokens = count / row;
  }
  return impl::run_add_rmsnorm(team, args, impl::Epilogue::kSum, stream, "allreduce");
}

Algorithm allreduce_qk_rmsnorm(const Team& team, const QkNormArgs& args, cudaStream_t stream) {
  const char* op = "allreduce_qk_rmsnorm";
  impl::validate_team(team, op);
  const impl::TeamState& state = *team.state();
  impl::validate_qk_args(args, op);
  const Algorithm algorithm = impl::choose_qk_algorithm(state, args, op);
  impl::validate_qk_rmsnorm(state, args, algorithm, op);
  if (state.backend == Backend::kCuda) {
    impl::cuda_validate_pointers(state,
                                 {{"qkv", args.qkv},
                                  {"q_out", args.q_out},
                                  {"k_out", args.k_out},
                                  {"q_gamma", args.q_gamma},
                                  {"k_gamma", args.k_gamma},
                                  {"positions", args.positions},
                                  {"cos_sin_cache", args.cos_sin_cache}},
                                 stream, op);
  } else {
    TPF_CHECK_ARG(stream == nullptr, op, "stream must be null for a CPU-backend team");
  }
  if (args.tokens == 0) return algorithm;
  const impl::QkNormParams params = impl::make_qk_params(state, args);
  const bool cuda = state.backend == Backend::kCuda;
  if (algorithm == Algorithm::kOneShot) {
    cuda ? impl::cuda_qk_rmsnorm(state, params, args.dtype, stream)
         : impl::cpu_qk_rmsnorm(params, args.dtype, impl::QkPass::kFused);
  } else {
    cuda ? impl::cuda_qk_nccl_path(state, params, args.dtype, stream)
         : impl::cpu_qk_nccl_path(state, params, args.dtype);
  }
  return algorithm;
}

namespace {

void run_qk_local(Backend backend, const QkNormArgs& args, impl::QkNormParams params,
                  impl::QkPass pass, cudaStream_t stream, const char* op) {
  impl::validate_qk_args(args, op);
  TPF_CHECK_ARG(params.sums != nullptr, op, "sums is null");
  TPF_CHECK_ARG(reinterpret_cast<uintptr_t>(params.sums) % 8 == 0, op,
                "sums must be 8-byte aligned");
  if (backend != Backend::kCuda) {
    TPF_CHECK_ARG(stream == nullptr, op, "stream must be null for the CPU backend");
  }
  if (args.tokens == 0) return;
  if (backend == Backend::kCuda) {
    impl::cuda_qk_local(params, args.dtype, pass, stream);
  } else {
    impl::cpu_qk_rmsnorm(params, args.dtype, pass);
  }
}

}  // namespace

void qk_sum_squares(Backend backend, const QkNormArgs& args, bool count_k, float* sums,
                    cudaStream_t stream) {
  impl::QkNormParams params = impl::make_qk_local_params(args);
  params.sums = sums;
  params.counts_k = count_k;
  run_qk_local(backend, args, params, impl::QkPass::kSums, stream, "qk_sum_squares");
}

void qk_rmsnorm_from_sums(Backend backend, const QkNormArgs& args, const float* sums,
                          cudaStream_t stream) {
  impl::QkNormParams params = impl::make_qk_local_params(args);
  params.sums = const_cast<float*>(sums);  // only read in this pass
  run_qk_local(backend, args, params, impl::QkPass::kNormFromSums, stream, "qk_rmsnorm_from_sums");
}

void add_rmsnorm(Backend backend, const AddRmsNormArgs& args, cudaStream_t stream) {
  TPF_CHECK_ARG(args.residual != nullptr, "add_rmsnorm", "residual is null");
  impl::validate_add_rmsnorm(args, impl::Epilogue::kAddRmsNorm, "add_rmsnorm");
  if (args.tokens == 0) return;
  const impl::OneShotParams params = impl::make_local_params(args);
  if (backend == Backend::kCuda) {
    impl::cuda_local_epilogue(params, args.dtype, impl::Epilogue::kAddRmsNorm, stream);
  } else {
    TPF_CHECK_ARG(stream == nullptr, "add_rmsnorm", "stream must be null for the CPU backend");
    impl::cpu_local_epilogue(params, args.dtype, impl::Epilogue::kAddRmsNorm);
  }
}

}  // namespace tpfuse
