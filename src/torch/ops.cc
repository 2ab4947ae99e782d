// tpfuse's torch ops, registered from C++ (no Python on the per-call path): the fused ops with
// CPU (the CPU backend), CUDA and Meta (shape-only, for torch.compile's fake tensors) kernels,
// and the team ops that make, describe and release teams. A team is passed to the fused ops as
// an int handle (a registry here owns the Team): an int traces through torch.compile and CUDA
// graphs like any constant.
//
// Load with torch.ops.load_library(<path of libtpfuse_torch.so>) (python/tpfuse does).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#if TPFUSE_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "tpfuse/cuda.h"
#include "tpfuse/impl/enums.h"
#include "tpfuse/tpfuse.h"
#include "tpfuse/version.h"

namespace tpfuse::torch_ops {
namespace {

// Teams by handle. Handles are never reused; release_team drops the registry's reference.
class Registry {
 public:
  // Never destroyed: releasing a multi-process team is collective (NCCL window deregistration),
  // and static destructors at interpreter exit run on each rank alone. Teams still registered
  // then go with the process.
  static Registry& instance() {
    static Registry* registry = new Registry;
    return *registry;
  }
  int64_t add(Team team) {
    std::lock_guard<std::mutex> lock(mutex_);
    const int64_t handle = next_++;
    teams_.emplace(handle, std::move(team));
    return handle;
  }
  Team get(int64_t handle, const char* op) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto found = teams_.find(handle);
    TORCH_CHECK(found != teams_.end(), "tpfuse::", op, ": team ", handle,
                " is not a live team handle (released, or never made)");
    return found->second;
  }
  void release(int64_t handle) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(teams_.erase(handle) == 1, "tpfuse::release_team: team ", handle,
                " is not a live team handle");
  }

 private:
  std::mutex mutex_;
  std::unordered_map<int64_t, Team> teams_;
  int64_t next_ = 1;
};

// A tensor argument given as None arrives as an undefined tensor (the in-place ops' residual is
// not optional in their schemas, but the dispatcher lets None through).
void check_defined(const at::Tensor& tensor, const char* op, const char* name) {
  TORCH_CHECK(tensor.defined(), "tpfuse::", op, ": ", name, " is None, expected a tensor");
}

DType dtype_of(const at::Tensor& tensor, const char* op, const char* name) {
  check_defined(tensor, op, name);
  switch (tensor.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK(false, "tpfuse::", op, ": ", name, " must be float32, float16 or bfloat16, got ",
                  tensor.scalar_type());
  }
}

void check_like(const at::Tensor& tensor, const at::Tensor& reference, const char* op,
                const char* name) {
  check_defined(tensor, op, name);
  TORCH_CHECK(tensor.scalar_type() == reference.scalar_type(), "tpfuse::", op, ": ", name,
              " must have dtype ", reference.scalar_type(), ", got ", tensor.scalar_type());
  TORCH_CHECK(tensor.device() == reference.device(), "tpfuse::", op, ": ", name, " must be on ",
              reference.device(), ", got ", tensor.device());
  TORCH_CHECK(tensor.is_contiguous(), "tpfuse::", op, ": ", name, " must be contiguous");
}

TeamOptions team_options(int64_t packet_bytes, double peer_timeout_seconds) {
  TeamOptions options;
  TORCH_CHECK(packet_bytes > 0, "tpfuse: packet_bytes must be > 0, got ", packet_bytes);
  options.packet_bytes = size_t(packet_bytes);
  options.peer_timeout_seconds = peer_timeout_seconds;
  return options;
}

// The stream a call on `tensor` queues on: torch's current stream of its device (CUDA), none
// for CPU tensors. Checks that the tensor is where the team is.
cudaStream_t stream_for(const Team& team, const at::Tensor& tensor, const char* op) {
  if (team.backend() == Backend::kCpu) {
    TORCH_CHECK(tensor.device().is_cpu(), "tpfuse::", op,
                ": a CPU-backend team takes CPU tensors, got ", tensor.device());
    return nullptr;
  }
#if TPFUSE_TORCH_CUDA
  TORCH_CHECK(tensor.device().is_cuda() && tensor.device().index() == team.device(), "tpfuse::", op,
              ": team rank ", team.rank(), " is on cuda:", team.device(), ", got a tensor on ",
              tensor.device());
  return c10::cuda::getCurrentCUDAStream(team.device()).stream();
#else
  TORCH_CHECK(false, "tpfuse::", op, ": this build of the torch ops has no CUDA");
#endif
}

// Runs `call` with the team's device current (CUDA).
template <typename Fn>
void on_device(const Team& team, Fn&& call) {
#if TPFUSE_TORCH_CUDA
  if (team.backend() == Backend::kCuda) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(team.device()));
    call();
    return;
  }
#endif
  call();
}

NormWeight norm_weight_of(int64_t value, const char* op) {
  TORCH_CHECK(impl::is_known_value<NormWeight>(value), "tpfuse::", op,
              ": norm_weight must be 0 (weight) or 1 (one plus weight), got ", value);
  return NormWeight(value);
}

Algorithm algorithm_of(int64_t value, const char* op) {
  TORCH_CHECK(impl::is_known_value<Algorithm>(value), "tpfuse::", op,
              ": algorithm must be 0 (auto), 1 (oneshot), ", "2 (twoshot) or 3 (nccl), got ",
              value);
  return Algorithm(value);
}

// --- the fused ops: real kernels ---

// The stream a rank's turn goes on when the call's own tensors cannot say (they were what was
// wrong): torch's current stream of the team's device, none on the CPU.
cudaStream_t turn_stream(const Team& team) {
#if TPFUSE_TORCH_CUDA
  if (team.backend() == Backend::kCuda) {
    return c10::cuda::getCurrentCUDAStream(team.device()).stream();
  }
#endif
  return nullptr;
}

// Runs a fused op's torch-side checks (`checks`, which fill in the call); if they reject the
// call, this rank still takes its turn (tpfuse::reject_call), as tpfuse's own checks do, so its
// peers' call ends at once with an error naming it and the team goes on. Then `call`.
template <typename Checks, typename Call>
void checked_call(const Team& team, Checks&& checks, Call&& call) {
  try {
    checks();
  } catch (...) {
    try {
      on_device(team, [&] { reject_call(team, turn_stream(team)); });
    } catch (...) {
      // Already reporting the rejection; the peers then time out instead.
    }
    throw;
  }
  on_device(team, call);
}

// The FP8 output of an add-RMSNorm call, when it has one: the mode (QuantMode's value), the
// static scale, and the outputs the op allocated (quant_out float8_e4m3fn, scales fp32).
struct Fp8Outputs {
  int64_t quant = 0;
  bool column_major = false;
  const at::Tensor* scale = nullptr;
  at::Tensor quant_out;
  at::Tensor scales;
};

QuantMode quant_of(int64_t value, const char* op) {
  // The FP8 ops' quant: any QuantMode but kNone (the bf16 ops are the ones without).
  TORCH_CHECK(impl::is_known_value<QuantMode>(value) && QuantMode(value) != QuantMode::kNone,
              "tpfuse::", op,
              ": quant must be 1 (static scale), 2 (per token) or 3 (per token group of 128), got ",
              value);
  return QuantMode(value);
}

// The shapes of an FP8 call's outputs: quant_out as the input, the scales by mode (none for a
// static scale).
// Symbolic sizes, so that the Meta kernels leave a dynamic token count symbolic (size() would
// specialize the compiled graph to the count it was traced at).
std::vector<c10::SymInt> scales_shape(int64_t quant, const at::Tensor& input, const char* op) {
  const QuantMode mode = quant_of(quant, op);
  TORCH_CHECK(input.dim() == 2, "tpfuse::", op, ": input must be [tokens, hidden], got ",
              input.sym_sizes());
  if (mode == QuantMode::kPerToken) return {input.sym_size(0)};
  if (mode == QuantMode::kPerTokenGroup128) {
    // The width is fixed in a compiled graph, and so is the group count: guard on it alone
    // (size() would fix every size of the tensor).
    const int64_t hidden = input.sym_size(1).guard_int(__FILE__, __LINE__);
    TORCH_CHECK(hidden % kQuantGroupSize == 0, "tpfuse::", op, ": hidden must be a multiple of ",
                kQuantGroupSize, " for quant 3 (per token group of 128), got ", hidden);
    return {input.sym_size(0), c10::SymInt(hidden / kQuantGroupSize)};
  }
  return {c10::SymInt(0)};
}

// The scales an FP8 call writes, by mode (none for a static scale): [tokens], or [tokens,
// hidden / 128] row-major or, column_major, a [hidden / 128, tokens] tensor's transpose.
at::Tensor empty_scales(int64_t quant, bool column_major, const at::Tensor& input, const char* op) {
  const QuantMode mode = quant_of(quant, op);
  TORCH_CHECK(!column_major || mode == QuantMode::kPerTokenGroup128, "tpfuse::", op,
              ": column_major_scales is a layout of quant 3 (per token group of 128), got quant ",
              quant);
  const std::vector<c10::SymInt> shape = scales_shape(quant, input, op);
  const at::TensorOptions options = input.options().dtype(at::kFloat);
  if (column_major) return at::empty_symint({shape[1], shape[0]}, options).t();
  return at::empty_symint(shape, options);
}

// The FP8 ops' norm_out: [tokens, hidden] like `like`, or [0, hidden] when the caller keeps only
// the FP8 output (keep_norm false: the call writes no bf16 norm).
at::Tensor norm_output(const at::Tensor& like, bool keep_norm) {
  if (keep_norm) return at::empty_like(like);
  return at::empty_symint({c10::SymInt(0), like.dim() == 2 ? like.sym_size(1) : c10::SymInt(0)},
                          like.options());
}

Fp8Outputs fp8_outputs(int64_t quant, const std::optional<at::Tensor>& scale, bool column_major,
                       const at::Tensor& input, const char* op) {
  Fp8Outputs out;
  out.quant = quant;
  out.column_major = column_major;
  out.scale = scale ? &*scale : nullptr;
  out.quant_out = at::empty_symint(input.sym_sizes(), input.options().dtype(at::kFloat8_e4m3fn));
  out.scales = empty_scales(quant, column_major, input, op);
  return out;
}

// Whether two contiguous tensors share any byte.
bool overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.nbytes() == 0 || b.nbytes() == 0) return false;
  const auto* a_begin = static_cast<const char*>(a.data_ptr());
  const auto* b_begin = static_cast<const char*>(b.data_ptr());
  return a_begin < b_begin + b.nbytes() && b_begin < a_begin + a.nbytes();
}

// The in-place ops write the norm into input (unless an FP8 call keeps no norm) and the sum into
// residual: the two must be apart, and neither written one may touch the weight every row reads.
// Checked here so that the message names the op's own arguments (the library's check would name
// norm_out, residual_out and gamma).
void check_in_place(const at::Tensor& input, const at::Tensor& residual, const at::Tensor& weight,
                    const char* op, bool writes_input = true) {
  TORCH_CHECK(!input.is_same(residual) && !overlap(input, residual), "tpfuse::", op,
              input.is_same(residual) ? ": input and residual are the same tensor"
                                      : ": input and residual overlap",
              "; the in-place op reads input (and writes the norm there unless keep_norm is "
              "false) and writes the sum into residual, so they must be two tensors apart");
  TORCH_CHECK(!writes_input || !overlap(input, weight), "tpfuse::", op,
              ": input overlaps weight; the in-place op writes the norm into input, and every "
              "row reads weight");
  TORCH_CHECK(!overlap(residual, weight), "tpfuse::", op,
              ": residual overlaps weight; the in-place op writes the sum into residual, and "
              "every row reads weight");
}

// The MoE finalize's tensors, in place of input (AddRmsNormArgs::moe_*).
struct MoeInputs {
  const at::Tensor& expert_rows;      // [tokens, topk, hidden]
  const at::Tensor& routing_weights;  // [tokens, topk], float32 or the rows' dtype
  const at::Tensor* shared_expert;    // [tokens, hidden] or null
};

// Checks an add-RMSNorm call's tensors and runs it into the given outputs. With `moe`, `input`
// is the residual, the tensor the others are checked against, and the call's input is the MoE
// combine.
void run_add_rmsnorm(
    int64_t team_handle, const at::Tensor& input, const at::Tensor* residual,
    const at::Tensor& weight, double eps, int64_t algorithm, int64_t norm_weight,
    const at::Tensor& norm_out, const at::Tensor& residual_out, const char* op,
    const std::function<void()>& op_checks = [] {}, const Fp8Outputs* fp8 = nullptr,
    const MoeInputs* moe = nullptr) {
  const Team team = Registry::instance().get(team_handle, op);
  AddRmsNormArgs args;
  cudaStream_t stream = nullptr;
  checked_call(
      team,
      [&] {
        const DType dtype = dtype_of(input, op, "input");
        TORCH_CHECK(input.dim() == 2, "tpfuse::", op, ": input must be [tokens, hidden], got ",
                    input.sizes());
        check_like(input, input, op, "input");
        check_like(weight, input, op, "weight");
        TORCH_CHECK(weight.dim() == 1 && weight.size(0) == input.size(1), "tpfuse::", op,
                    ": weight must be [hidden = ", input.size(1), "], got ", weight.sizes());
        if (residual != nullptr) {
          check_like(*residual, input, op, "residual");
          TORCH_CHECK(residual->sizes() == input.sizes(), "tpfuse::", op, ": residual must be ",
                      input.sizes(), ", got ", residual->sizes());
        }
        op_checks();
        args.input = moe != nullptr ? nullptr : input.data_ptr();
        if (moe != nullptr) {
          const at::Tensor& rows = moe->expert_rows;
          check_like(rows, input, op, "expert_rows");
          TORCH_CHECK(
              rows.dim() == 3 && rows.size(0) == input.size(0) && rows.size(2) == input.size(1),
              "tpfuse::", op, ": expert_rows must be [tokens = ", input.size(0),
              ", topk, hidden = ", input.size(1), "], got ", rows.sizes());
          const at::Tensor& weights = moe->routing_weights;
          TORCH_CHECK(
              weights.scalar_type() == at::kFloat || weights.scalar_type() == rows.scalar_type(),
              "tpfuse::", op, ": routing_weights must be float32 or ", rows.scalar_type(), ", got ",
              weights.scalar_type());
          TORCH_CHECK(weights.device() == input.device() && weights.is_contiguous(), "tpfuse::", op,
                      ": routing_weights must be contiguous and on ", input.device());
          TORCH_CHECK(weights.dim() == 2 && weights.size(0) == rows.size(0) &&
                          weights.size(1) == rows.size(1),
                      "tpfuse::", op, ": routing_weights must be [tokens, topk] = [", rows.size(0),
                      ", ", rows.size(1), "], got ", weights.sizes());
          if (moe->shared_expert != nullptr) {
            check_like(*moe->shared_expert, input, op, "shared_expert");
            TORCH_CHECK(moe->shared_expert->sizes() == input.sizes(), "tpfuse::", op,
                        ": shared_expert must be ", input.sizes(), ", got ",
                        moe->shared_expert->sizes());
          }
          args.moe_expert_rows = rows.data_ptr();
          args.moe_weights = weights.data_ptr();
          args.moe_shared =
              moe->shared_expert != nullptr ? moe->shared_expert->data_ptr() : nullptr;
          args.moe_topk = int(std::min<int64_t>(rows.size(1), kMaxMoeTopK + 1));
          args.moe_weights_in_dtype = weights.scalar_type() != at::kFloat;
        }
        args.residual = residual != nullptr ? residual->data_ptr() : nullptr;
        args.gamma = weight.data_ptr();
        args.residual_out = residual_out.data_ptr();
        args.norm_out = norm_out.defined() ? norm_out.data_ptr() : nullptr;
        args.tokens = input.size(0);
        args.hidden = input.size(1);
        args.dtype = dtype;
        args.eps = float(eps);
        args.algorithm = algorithm_of(algorithm, op);
        args.norm_weight = norm_weight_of(norm_weight, op);
        if (fp8 != nullptr) {
          args.quant = quant_of(fp8->quant, op);
          args.quant_out = fp8->quant_out.data_ptr();
          if (args.quant == QuantMode::kStatic) {
            TORCH_CHECK(fp8->scale != nullptr, "tpfuse::", op,
                        ": quant 1 (static scale) needs scale, a float32 tensor of one element");
            const at::Tensor& scale = *fp8->scale;
            TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == 1, "tpfuse::", op,
                        ": scale must be a float32 tensor of one element, got ",
                        scale.scalar_type(), " of ", scale.sizes());
            TORCH_CHECK(scale.device() == input.device(), "tpfuse::", op, ": scale is on ",
                        scale.device(), ", input on ", input.device());
            args.quant_scale = scale.data_ptr<float>();
          } else {
            TORCH_CHECK(fp8->scale == nullptr, "tpfuse::", op, ": scale is given but quant ",
                        fp8->quant, " computes its scales (only quant 1 takes one)");
            args.scales_out = fp8->scales.data_ptr<float>();
            args.scales_column_major = fp8->column_major;
          }
        }
        stream = stream_for(team, input, op);
      },
      [&] { allreduce_add_rmsnorm(team, args, stream); });
}

// The norm's FP8 output too (tpfuse::QuantMode): (norm_out, residual_out, quant_out, scales).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> allreduce_add_rmsnorm_fp8(
    int64_t team_handle, const at::Tensor& input, const std::optional<at::Tensor>& residual,
    const at::Tensor& weight, double eps, int64_t quant, const std::optional<at::Tensor>& scale,
    bool column_major_scales, int64_t algorithm, int64_t norm_weight, bool keep_norm) {
  const char* op = "allreduce_add_rmsnorm_fp8";
  const Fp8Outputs fp8 = fp8_outputs(quant, scale, column_major_scales, input, op);
  at::Tensor norm_out = norm_output(input, keep_norm);
  at::Tensor residual_out = at::empty_like(input);
  run_add_rmsnorm(
      team_handle, input, residual ? &*residual : nullptr, weight, eps, algorithm, norm_weight,
      keep_norm ? norm_out : at::Tensor(), residual_out, op, [] {}, &fp8);
  return {norm_out, residual_out, fp8.quant_out, fp8.scales};
}

// MoE finalize + all-reduce + add + RMSNorm: this rank's contribution is the routing-weighted sum
// of its expert rows (and the shared expert's row), AddRmsNormArgs::moe_*.
std::tuple<at::Tensor, at::Tensor> allreduce_moe_finalize_add_rmsnorm(
    int64_t team_handle, const at::Tensor& expert_rows, const at::Tensor& routing_weights,
    const at::Tensor& residual, const at::Tensor& weight, double eps,
    const std::optional<at::Tensor>& shared_expert, int64_t algorithm) {
  const char* op = "allreduce_moe_finalize_add_rmsnorm";
  at::Tensor norm_out = at::empty_like(residual);
  at::Tensor residual_out = at::empty_like(residual);
  const MoeInputs moe{expert_rows, routing_weights, shared_expert ? &*shared_expert : nullptr};
  run_add_rmsnorm(
      team_handle, residual, &residual, weight, eps, algorithm, 0, norm_out, residual_out, op,
      [] {}, nullptr, &moe);
  return {norm_out, residual_out};
}

// The same, and the norm's FP8 output: (norm_out, residual_out, quant_out, scales).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> allreduce_moe_finalize_add_rmsnorm_fp8(
    int64_t team_handle, const at::Tensor& expert_rows, const at::Tensor& routing_weights,
    const at::Tensor& residual, const at::Tensor& weight, double eps, int64_t quant,
    const std::optional<at::Tensor>& scale, bool column_major_scales,
    const std::optional<at::Tensor>& shared_expert, int64_t algorithm, bool keep_norm) {
  const char* op = "allreduce_moe_finalize_add_rmsnorm_fp8";
  const Fp8Outputs fp8 = fp8_outputs(quant, scale, column_major_scales, residual, op);
  at::Tensor norm_out = norm_output(residual, keep_norm);
  at::Tensor residual_out = at::empty_like(residual);
  const MoeInputs moe{expert_rows, routing_weights, shared_expert ? &*shared_expert : nullptr};
  run_add_rmsnorm(
      team_handle, residual, &residual, weight, eps, algorithm, 0,
      keep_norm ? norm_out : at::Tensor(), residual_out, op, [] {}, &fp8, &moe);
  return {norm_out, residual_out, fp8.quant_out, fp8.scales};
}

// In place as allreduce_add_rmsnorm_ (input <- norm, residual <- sum + residual), and the
// norm's FP8 output: (quant_out, scales). With keep_norm false input is left as it was.
std::tuple<at::Tensor, at::Tensor> allreduce_add_rmsnorm_fp8_(
    int64_t team_handle, at::Tensor& input, at::Tensor& residual, const at::Tensor& weight,
    double eps, int64_t quant, const std::optional<at::Tensor>& scale, bool column_major_scales,
    int64_t algorithm, int64_t norm_weight, bool keep_norm) {
  const char* op = "allreduce_add_rmsnorm_fp8_";
  const Fp8Outputs fp8 = fp8_outputs(quant, scale, column_major_scales, input, op);
  run_add_rmsnorm(
      team_handle, input, &residual, weight, eps, algorithm, norm_weight,
      keep_norm ? input : at::Tensor(), residual, op,
      [&] { check_in_place(input, residual, weight, op, keep_norm); }, &fp8);
  return {fp8.quant_out, fp8.scales};
}

std::tuple<at::Tensor, at::Tensor> allreduce_add_rmsnorm(int64_t team_handle,
                                                         const at::Tensor& input,
                                                         const std::optional<at::Tensor>& residual,
                                                         const at::Tensor& weight, double eps,
                                                         int64_t algorithm, int64_t norm_weight) {
  at::Tensor norm_out = at::empty_like(input);
  at::Tensor residual_out = at::empty_like(input);
  run_add_rmsnorm(team_handle, input, residual ? &*residual : nullptr, weight, eps, algorithm,
                  norm_weight, norm_out, residual_out, "allreduce_add_rmsnorm");
  return {norm_out, residual_out};
}

// In place, as engines call their fused add + RMSNorm: input <- norm, residual <- sum + residual.
void allreduce_add_rmsnorm_(int64_t team_handle, at::Tensor& input, at::Tensor& residual,
                            const at::Tensor& weight, double eps, int64_t algorithm,
                            int64_t norm_weight) {
  const char* op = "allreduce_add_rmsnorm_";
  run_add_rmsnorm(team_handle, input, &residual, weight, eps, algorithm, norm_weight, input,
                  residual, op, [&] { check_in_place(input, residual, weight, op); });
}

at::Tensor allreduce(int64_t team_handle, const at::Tensor& input, int64_t algorithm) {
  const char* op = "allreduce";
  const Team team = Registry::instance().get(team_handle, op);
  at::Tensor out;
  DType dtype = DType::kBFloat16;
  Algorithm chosen = Algorithm::kAuto;
  cudaStream_t stream = nullptr;
  checked_call(
      team,
      [&] {
        dtype = dtype_of(input, op, "input");
        check_like(input, input, op, "input");
        chosen = algorithm_of(algorithm, op);
        stream = stream_for(team, input, op);
        out = at::empty_like(input);
      },
      [&] {
        tpfuse::allreduce(team, input.data_ptr(), out.data_ptr(), input.numel(), dtype, stream,
                          chosen);
      });
  return out;
}

std::tuple<at::Tensor, at::Tensor> allreduce_qk_rmsnorm(
    int64_t team_handle, const at::Tensor& qkv, const at::Tensor& q_weight,
    const at::Tensor& k_weight, int64_t q_size, int64_t kv_size, int64_t q_global_size,
    int64_t k_global_size, int64_t kv_replicas, double eps,
    const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& cos_sin_cache,
    int64_t head_dim, int64_t rotary_dim, int64_t rope_style, int64_t algorithm) {
  const char* op = "allreduce_qk_rmsnorm";
  const Team team = Registry::instance().get(team_handle, op);
  at::Tensor q, k;
  QkNormArgs args;
  cudaStream_t stream = nullptr;
  checked_call(
      team,
      [&] {
        TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == q_size + 2 * kv_size, "tpfuse::", op,
                    ": qkv must be [tokens, q_size + 2 * kv_size = ", q_size + 2 * kv_size,
                    "], got ", qkv.sizes());
        const DType dtype = dtype_of(qkv, op, "qkv");
        check_like(qkv, qkv, op, "qkv");
        check_like(q_weight, qkv, op, "q_weight");
        check_like(k_weight, qkv, op, "k_weight");
        TORCH_CHECK(q_weight.dim() == 1 && q_weight.size(0) == q_size, "tpfuse::", op,
                    ": q_weight must be [q_size = ", q_size, "] (this rank's slice), got ",
                    q_weight.sizes());
        TORCH_CHECK(k_weight.dim() == 1 && k_weight.size(0) == kv_size, "tpfuse::", op,
                    ": k_weight must be [kv_size = ", kv_size, "] (this rank's slice), got ",
                    k_weight.sizes());
        TORCH_CHECK(impl::is_known_value<RopeStyle>(rope_style), "tpfuse::", op,
                    ": rope_style must be 0 (none), 1 (neox) or 2 (interleaved), got ", rope_style);
        q = at::empty({qkv.size(0), q_size}, qkv.options());
        k = at::empty({qkv.size(0), kv_size}, qkv.options());
        args.qkv = qkv.data_ptr();
        args.q_out = q.data_ptr();
        args.k_out = k.data_ptr();
        args.q_gamma = q_weight.data_ptr();
        args.k_gamma = k_weight.data_ptr();
        args.tokens = qkv.size(0);
        args.q_size = q_size;
        args.kv_size = kv_size;
        args.q_global_size = q_global_size;
        args.k_global_size = k_global_size;
        args.kv_replicas = int(kv_replicas);
        args.dtype = dtype;
        args.eps = float(eps);
        args.algorithm = algorithm_of(algorithm, op);
        args.rope = RopeStyle(rope_style);
        if (args.rope != RopeStyle::kNone) {
          TORCH_CHECK(positions && cos_sin_cache, "tpfuse::", op,
                      ": rope_style is set but positions or cos_sin_cache is missing");
          TORCH_CHECK(positions->scalar_type() == at::kLong && positions->is_contiguous() &&
                          positions->numel() == qkv.size(0),
                      "tpfuse::", op, ": positions must be contiguous int64 [tokens]");
          TORCH_CHECK(cos_sin_cache->scalar_type() == at::kFloat, "tpfuse::", op,
                      ": cos_sin_cache must be float32 (cos and sin in fp32), got ",
                      cos_sin_cache->scalar_type());
          TORCH_CHECK(cos_sin_cache->device() == qkv.device(), "tpfuse::", op,
                      ": cos_sin_cache must be on ", qkv.device(), ", got ",
                      cos_sin_cache->device());
          TORCH_CHECK(positions->device() == qkv.device(), "tpfuse::", op,
                      ": positions must be on ", qkv.device(), ", got ", positions->device());
          TORCH_CHECK(cos_sin_cache->dim() == 2 && cos_sin_cache->size(1) == rotary_dim &&
                          cos_sin_cache->is_contiguous(),
                      "tpfuse::", op, ": cos_sin_cache must be contiguous float32 [max_position, ",
                      rotary_dim, "], got ", cos_sin_cache->sizes());
          args.head_dim = head_dim;
          args.rotary_dim = rotary_dim;
          args.positions = positions->data_ptr<int64_t>();
          args.cos_sin_cache = cos_sin_cache->data_ptr<float>();
          args.max_position = cos_sin_cache->size(0);
        }
        stream = stream_for(team, qkv, op);
      },
      [&] { allreduce_qk_rmsnorm(team, args, stream); });
  return {q, k};
}

// --- the same ops on Meta tensors: shapes only ---

// A call lands here when any of its tensors is a meta tensor: all of them must be, or real
// tensors would get no work done and garbage back.
void check_meta(const char* op,
                std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors) {
  for (const auto& [name, tensor] : tensors) {
    TORCH_CHECK(tensor == nullptr || tensor->is_meta(), "tpfuse::", op, ": ", name, " is on ",
                tensor->device(),
                " but another argument is a meta tensor: all must be on one "
                "device");
  }
}

const at::Tensor* optional_of(const std::optional<at::Tensor>& tensor) {
  return tensor ? &*tensor : nullptr;
}

std::tuple<at::Tensor, at::Tensor> allreduce_add_rmsnorm_meta(
    int64_t, const at::Tensor& input, const std::optional<at::Tensor>& residual,
    const at::Tensor& weight, double, int64_t, int64_t) {
  check_meta("allreduce_add_rmsnorm",
             {{"input", &input}, {"residual", optional_of(residual)}, {"weight", &weight}});
  return {at::empty_like(input), at::empty_like(input)};
}

void allreduce_add_rmsnorm__meta(int64_t, at::Tensor& input, at::Tensor& residual,
                                 const at::Tensor& weight, double, int64_t, int64_t) {
  check_meta("allreduce_add_rmsnorm_",
             {{"input", &input}, {"residual", &residual}, {"weight", &weight}});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> allreduce_add_rmsnorm_fp8_meta(
    int64_t, const at::Tensor& input, const std::optional<at::Tensor>& residual,
    const at::Tensor& weight, double, int64_t quant, const std::optional<at::Tensor>& scale,
    bool column_major_scales, int64_t, int64_t, bool keep_norm) {
  const char* op = "allreduce_add_rmsnorm_fp8";
  check_meta(op, {{"input", &input},
                  {"residual", optional_of(residual)},
                  {"weight", &weight},
                  {"scale", optional_of(scale)}});
  return {norm_output(input, keep_norm), at::empty_like(input),
          at::empty_symint(input.sym_sizes(), input.options().dtype(at::kFloat8_e4m3fn)),
          empty_scales(quant, column_major_scales, input, op)};
}

std::tuple<at::Tensor, at::Tensor> allreduce_add_rmsnorm_fp8__meta(
    int64_t, at::Tensor& input, at::Tensor& residual, const at::Tensor& weight, double,
    int64_t quant, const std::optional<at::Tensor>& scale, bool column_major_scales, int64_t,
    int64_t, bool) {
  const char* op = "allreduce_add_rmsnorm_fp8_";
  check_meta(op, {{"input", &input},
                  {"residual", &residual},
                  {"weight", &weight},
                  {"scale", optional_of(scale)}});
  return {at::empty_symint(input.sym_sizes(), input.options().dtype(at::kFloat8_e4m3fn)),
          empty_scales(quant, column_major_scales, input, op)};
}

std::tuple<at::Tensor, at::Tensor> allreduce_moe_finalize_add_rmsnorm_meta(
    int64_t, const at::Tensor& expert_rows, const at::Tensor& routing_weights,
    const at::Tensor& residual, const at::Tensor& weight, double,
    const std::optional<at::Tensor>& shared_expert, int64_t) {
  check_meta("allreduce_moe_finalize_add_rmsnorm", {{"expert_rows", &expert_rows},
                                                    {"routing_weights", &routing_weights},
                                                    {"residual", &residual},
                                                    {"weight", &weight},
                                                    {"shared_expert", optional_of(shared_expert)}});
  return {at::empty_like(residual), at::empty_like(residual)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
allreduce_moe_finalize_add_rmsnorm_fp8_meta(
    int64_t, const at::Tensor& expert_rows, const at::Tensor& routing_weights,
    const at::Tensor& residual, const at::Tensor& weight, double, int64_t quant,
    const std::optional<at::Tensor>& scale, bool column_major_scales,
    const std::optional<at::Tensor>& shared_expert, int64_t, bool keep_norm) {
  const char* op = "allreduce_moe_finalize_add_rmsnorm_fp8";
  check_meta(op, {{"expert_rows", &expert_rows},
                  {"routing_weights", &routing_weights},
                  {"residual", &residual},
                  {"weight", &weight},
                  {"scale", optional_of(scale)},
                  {"shared_expert", optional_of(shared_expert)}});
  return {norm_output(residual, keep_norm), at::empty_like(residual),
          at::empty_symint(residual.sym_sizes(), residual.options().dtype(at::kFloat8_e4m3fn)),
          empty_scales(quant, column_major_scales, residual, op)};
}

at::Tensor allreduce_meta(int64_t, const at::Tensor& input, int64_t) {
  return at::empty_like(input);
}

std::tuple<at::Tensor, at::Tensor> allreduce_qk_rmsnorm_meta(
    int64_t, const at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight,
    int64_t q_size, int64_t kv_size, int64_t, int64_t, int64_t, double,
    const std::optional<at::Tensor>& positions, const std::optional<at::Tensor>& cos_sin_cache,
    int64_t, int64_t, int64_t, int64_t) {
  check_meta("allreduce_qk_rmsnorm", {{"qkv", &qkv},
                                      {"q_weight", &q_weight},
                                      {"k_weight", &k_weight},
                                      {"positions", optional_of(positions)},
                                      {"cos_sin_cache", optional_of(cos_sin_cache)}});
  // The token count symbolic (sym_size), so that a dynamic count stays dynamic.
  return {at::empty_symint({qkv.sym_size(0), c10::SymInt(q_size)}, qkv.options()),
          at::empty_symint({qkv.sym_size(0), c10::SymInt(kv_size)}, qkv.options())};
}

// --- team ops ---

std::vector<int64_t> handles_of(std::vector<Team> teams) {
  std::vector<int64_t> handles;
  for (Team& team : teams) handles.push_back(Registry::instance().add(std::move(team)));
  return handles;
}

std::vector<int64_t> create_cpu_team_op(int64_t world_size, int64_t packet_bytes,
                                        double peer_timeout_seconds) {
  return handles_of(
      create_cpu_team(int(world_size), team_options(packet_bytes, peer_timeout_seconds)));
}

std::vector<int64_t> create_cuda_team_op(std::vector<int64_t> devices, int64_t packet_bytes,
                                         double peer_timeout_seconds) {
  return handles_of(create_cuda_team(std::vector<int>(devices.begin(), devices.end()),
                                     team_options(packet_bytes, peer_timeout_seconds)));
}

// A bootstrap id (UniqueId, CpuTeamId) as the CPU uint8 tensor a process group broadcasts, and
// back, checked: `what` names the op and its argument, `maker` the function that makes it.
template <typename Id>
at::Tensor id_tensor(const Id& id) {
  at::Tensor bytes = at::empty({int64_t(sizeof(id.bytes))}, at::kByte);
  std::memcpy(bytes.data_ptr(), id.bytes, sizeof(id.bytes));
  return bytes;
}

template <typename Id>
Id id_of(const at::Tensor& bytes, const char* what, const char* maker) {
  Id id;
  TORCH_CHECK(bytes.scalar_type() == at::kByte && bytes.numel() == sizeof(id.bytes) &&
                  bytes.device().is_cpu(),
              "tpfuse::", what, " must be a CPU uint8 tensor of ", sizeof(id.bytes),
              " bytes (from ", maker, ")");
  std::memcpy(id.bytes, bytes.contiguous().data_ptr(), sizeof(id.bytes));
  return id;
}

at::Tensor create_unique_id_op() {
  return id_tensor(create_unique_id());
}

int64_t create_nccl_team_op(const at::Tensor& unique_id, int64_t rank, int64_t world_size,
                            int64_t device, int64_t packet_bytes, double peer_timeout_seconds) {
  const auto id = id_of<UniqueId>(unique_id, "create_nccl_team: unique_id", "create_unique_id");
  return Registry::instance().add(
      create_nccl_team(id, int(rank), int(world_size), int(device),
                       team_options(packet_bytes, peer_timeout_seconds)));
}

at::Tensor create_cpu_team_id_op() {
  return id_tensor(create_cpu_team_id());
}

int64_t create_cpu_process_team_op(const at::Tensor& team_id, int64_t rank, int64_t world_size,
                                   int64_t packet_bytes, double peer_timeout_seconds) {
  const auto id =
      id_of<CpuTeamId>(team_id, "create_cpu_process_team: team_id", "create_cpu_team_id");
  return Registry::instance().add(create_cpu_team(
      id, int(rank), int(world_size), team_options(packet_bytes, peer_timeout_seconds)));
}

// This rank will not make the fused call its peers are making (tpfuse.reject_call).
void reject_call_op(int64_t handle) {
  const Team team = Registry::instance().get(handle, "reject_call");
  on_device(team, [&] { reject_call(team, turn_stream(team)); });
}

void release_team_op(int64_t handle) {
  Registry::instance().release(handle);
}

std::tuple<int64_t, int64_t, int64_t, std::string, std::string> team_info_op(int64_t handle) {
  const Team team = Registry::instance().get(handle, "team_info");
  return {team.rank(), team.world_size(), team.device(), team.peer_memory(),
          team.fallback_reason()};
}

std::string choose_op(int64_t handle, int64_t tokens, int64_t hidden, at::ScalarType dtype) {
  const Team team = Registry::instance().get(handle, "choose");
  const at::Tensor probe = at::empty({0}, at::TensorOptions().dtype(dtype).device(at::kMeta));
  return algorithm_name(team.choose(tokens, hidden, dtype_of(probe, "choose", "dtype")));
}

std::string version_op() {
  return version();
}

}  // namespace
}  // namespace tpfuse::torch_ops

TORCH_LIBRARY(tpfuse, m) {
  using namespace tpfuse::torch_ops;
  m.def(
      "allreduce_add_rmsnorm(int team, Tensor input, Tensor? residual, Tensor weight, float eps, "
      "int algorithm=0, int norm_weight=0) -> (Tensor norm_out, Tensor residual_out)");
  m.def(
      "allreduce_add_rmsnorm_(int team, Tensor(a!) input, Tensor(b!) residual, Tensor weight, "
      "float eps, int algorithm=0, int norm_weight=0) -> ()");
  m.def(
      "allreduce_add_rmsnorm_fp8(int team, Tensor input, Tensor? residual, Tensor weight, "
      "float eps, int quant, Tensor? scale=None, bool column_major_scales=False, int algorithm=0, "
      "int norm_weight=0, bool keep_norm=True) -> "
      "(Tensor norm_out, Tensor residual_out, Tensor quant_out, Tensor scales)");
  m.def(
      "allreduce_add_rmsnorm_fp8_(int team, Tensor(a!) input, Tensor(b!) residual, Tensor weight, "
      "float eps, int quant, Tensor? scale=None, bool column_major_scales=False, int algorithm=0, "
      "int norm_weight=0, bool keep_norm=True) -> "
      "(Tensor quant_out, Tensor scales)");
  m.def(
      "allreduce_moe_finalize_add_rmsnorm(int team, Tensor expert_rows, Tensor routing_weights, "
      "Tensor residual, Tensor weight, float eps, Tensor? shared_expert=None, int algorithm=0) "
      "-> (Tensor norm_out, Tensor residual_out)");
  m.def(
      "allreduce_moe_finalize_add_rmsnorm_fp8(int team, Tensor expert_rows, "
      "Tensor routing_weights, Tensor residual, Tensor weight, float eps, int quant, "
      "Tensor? scale=None, bool column_major_scales=False, Tensor? shared_expert=None, "
      "int algorithm=0, bool keep_norm=True) -> (Tensor norm_out, Tensor residual_out, "
      "Tensor quant_out, "
      "Tensor scales)");
  m.def("allreduce(int team, Tensor input, int algorithm=0) -> Tensor");
  m.def(
      "allreduce_qk_rmsnorm(int team, Tensor qkv, Tensor q_weight, Tensor k_weight, int q_size, "
      "int kv_size, int q_global_size, int k_global_size, int kv_replicas, float eps, "
      "Tensor? positions=None, Tensor? cos_sin_cache=None, int head_dim=0, int rotary_dim=0, "
      "int rope_style=0, int algorithm=0) -> (Tensor q, Tensor k)");
  m.def("create_cpu_team(int world_size, int packet_bytes, float peer_timeout_seconds) -> int[]",
        &create_cpu_team_op);
  m.def("create_cuda_team(int[] devices, int packet_bytes, float peer_timeout_seconds) -> int[]",
        &create_cuda_team_op);
  m.def("create_cpu_team_id() -> Tensor", &create_cpu_team_id_op);
  m.def(
      "create_cpu_process_team(Tensor team_id, int rank, int world_size, int packet_bytes, "
      "float peer_timeout_seconds) -> int",
      &create_cpu_process_team_op);
  m.def("create_unique_id() -> Tensor", &create_unique_id_op);
  m.def(
      "create_nccl_team(Tensor unique_id, int rank, int world_size, int device, int packet_bytes, "
      "float peer_timeout_seconds) -> int",
      &create_nccl_team_op);
  m.def("release_team(int team) -> ()", &release_team_op);
  m.def("reject_call(int team) -> ()", &reject_call_op);
  m.def("team_info(int team) -> (int, int, int, str, str)", &team_info_op);
  m.def("choose(int team, int tokens, int hidden, ScalarType dtype) -> str", &choose_op);
  m.def("version() -> str", &version_op);
}

TORCH_LIBRARY_IMPL(tpfuse, CPU, m) {
  using namespace tpfuse::torch_ops;
  m.impl("allreduce_add_rmsnorm", &allreduce_add_rmsnorm);
  m.impl("allreduce_add_rmsnorm_", &allreduce_add_rmsnorm_);
  m.impl("allreduce_add_rmsnorm_fp8", &allreduce_add_rmsnorm_fp8);
  m.impl("allreduce_add_rmsnorm_fp8_", &allreduce_add_rmsnorm_fp8_);
  m.impl("allreduce_moe_finalize_add_rmsnorm", &allreduce_moe_finalize_add_rmsnorm);
  m.impl("allreduce_moe_finalize_add_rmsnorm_fp8", &allreduce_moe_finalize_add_rmsnorm_fp8);
  m.impl("allreduce", &allreduce);
  m.impl("allreduce_qk_rmsnorm", &allreduce_qk_rmsnorm);
}

#if TPFUSE_TORCH_CUDA
TORCH_LIBRARY_IMPL(tpfuse, CUDA, m) {
  using namespace tpfuse::torch_ops;
  m.impl("allreduce_add_rmsnorm", &allreduce_add_rmsnorm);
  m.impl("allreduce_add_rmsnorm_", &allreduce_add_rmsnorm_);
  m.impl("allreduce_add_rmsnorm_fp8", &allreduce_add_rmsnorm_fp8);
  m.impl("allreduce_add_rmsnorm_fp8_", &allreduce_add_rmsnorm_fp8_);
  m.impl("allreduce_moe_finalize_add_rmsnorm", &allreduce_moe_finalize_add_rmsnorm);
  m.impl("allreduce_moe_finalize_add_rmsnorm_fp8", &allreduce_moe_finalize_add_rmsnorm_fp8);
  m.impl("allreduce", &allreduce);
  m.impl("allreduce_qk_rmsnorm", &allreduce_qk_rmsnorm);
}
#endif

TORCH_LIBRARY_IMPL(tpfuse, Meta, m) {
  using namespace tpfuse::torch_ops;
  m.impl("allreduce_add_rmsnorm", &allreduce_add_rmsnorm_meta);
  m.impl("allreduce_add_rmsnorm_", &allreduce_add_rmsnorm__meta);
  m.impl("allreduce_add_rmsnorm_fp8", &allreduce_add_rmsnorm_fp8_meta);
  m.impl("allreduce_add_rmsnorm_fp8_", &allreduce_add_rmsnorm_fp8__meta);
  m.impl("allreduce_moe_finalize_add_rmsnorm", &allreduce_moe_finalize_add_rmsnorm_meta);
  m.impl("allreduce_moe_finalize_add_rmsnorm_fp8", &allreduce_moe_finalize_add_rmsnorm_fp8_meta);
  m.impl("allreduce", &allreduce_meta);
  m.impl("allreduce_qk_rmsnorm", &allreduce_qk_rmsnorm_meta);
}
