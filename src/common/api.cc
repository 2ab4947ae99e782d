// The public entry points: validate, then hand the call to the team's backend.
#include <cmath>
#include <cstdint>
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

int64_t Team::max_tokens(int64_t hidden, DType dtype) const {
  if (hidden <= 0) return 0;
  return int64_t(state_of(*this).packet_bytes / (size_t(hidden) * dtype_size(dtype)));
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

void validate_capacity(const TeamState& team, const AddRmsNormArgs& args, const char* op) {
  const size_t bytes = size_t(args.tokens) * size_t(args.hidden) * dtype_size(args.dtype);
  TPF_CHECK_ARG(bytes <= team.packet_bytes, op,
                "tokens " << args.tokens << " x hidden " << args.hidden << " of "
                          << dtype_name(args.dtype) << " needs " << bytes
                          << " bytes, over the team's packet capacity of " << team.packet_bytes
                          << " bytes (at most "
                          << team.packet_bytes / (size_t(args.hidden) * dtype_size(args.dtype))
                          << " tokens; raise TeamOptions::packet_bytes)");
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

void validate_team_options(const TeamOptions& options, const char* op) {
  TPF_CHECK_ARG(
      options.packet_bytes >= 16 && options.packet_bytes % 16 == 0, op,
      "options.packet_bytes must be a positive multiple of 16, got " << options.packet_bytes);
  TPF_CHECK_ARG(options.peer_timeout_seconds >= 0, op,
                "options.peer_timeout_seconds must be >= 0, got " << options.peer_timeout_seconds);
}

namespace {

void run_oneshot(const Team& team, const AddRmsNormArgs& args, Epilogue epilogue,
                 cudaStream_t stream, const char* op) {
  validate_team(team, op);
  const TeamState& state = *team.state();
  validate_add_rmsnorm(args, epilogue, op);
  validate_capacity(state, args, op);
  if (state.backend == Backend::kCuda) {
    cuda_validate_call(state, args, stream, op);
  } else {
    TPF_CHECK_ARG(stream == nullptr, op, "stream must be null for a CPU-backend team");
  }
  if (args.tokens == 0) return;  // an empty batch: every rank skips alike, no slot is used
  const OneShotParams params = make_oneshot_params(state, args);
  if (state.backend == Backend::kCuda) {
    cuda_oneshot(state, params, args.dtype, epilogue, stream);
  } else {
    cpu_oneshot(state, params, args.dtype, epilogue);
  }
}

}  // namespace
}  // namespace impl

void allreduce_add_rmsnorm(const Team& team, const AddRmsNormArgs& args, cudaStream_t stream) {
  const impl::Epilogue epilogue =
      args.residual != nullptr ? impl::Epilogue::kAddRmsNorm : impl::Epilogue::kRmsNorm;
  impl::run_oneshot(team, args, epilogue, stream, "allreduce_add_rmsnorm");
}

void allreduce(const Team& team, const void* input, void* out, int64_t count, DType dtype,
               cudaStream_t stream) {
  AddRmsNormArgs args;
  args.input = input;
  args.norm_out = out;
  args.tokens = 1;
  args.hidden = count;
  args.dtype = dtype;
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
  impl::run_oneshot(team, args, impl::Epilogue::kSum, stream, "allreduce");
}

void add_rmsnorm(Backend backend, const AddRmsNormArgs& args, cudaStream_t stream) {
  TPF_CHECK_ARG(args.residual != nullptr, "add_rmsnorm", "residual is null");
  impl::validate_add_rmsnorm(args, impl::Epilogue::kAddRmsNorm, "add_rmsnorm");
  if (args.tokens == 0) return;
  if (backend == Backend::kCuda) {
    impl::cuda_add_rmsnorm(args, stream);
  } else {
    TPF_CHECK_ARG(stream == nullptr, "add_rmsnorm", "stream must be null for the CPU backend");
    impl::cpu_add_rmsnorm(args);
  }
}

}  // namespace tpfuse
