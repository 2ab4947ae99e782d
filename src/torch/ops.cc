// tpfuse's torch ops, registered from C++ (no Python on the per-call path): the fused ops, each
// declared once (an Op, op_description.h) from which its schema, its CPU / CUDA / Meta kernels
// and its Python wrapper follow, and the team ops that make, describe and release teams. A team
// is passed to the fused ops as an int handle (a registry here owns the Team): an int traces
// through torch.compile and CUDA graphs like any constant.
//
// One call, from Python to the backend:
//   tpfuse.allreduce_add_rmsnorm (python/tpfuse/ops.py, made from the op's description: enum
//   names to values, team to handle) -> the dispatcher -> RealKernel (parse: Call from the stack,
//   enums checked) -> the op's run function (torch's checks: dtypes, devices, contiguity, shapes;
//   outputs; tensors to pointers) -> Launch -> tpfuse::allreduce_add_rmsnorm (core/api.cc: the
//   library's checks, then the backend). Each check lives in one of these: the library checks
//   what its arguments say, the torch layer only what tensors say.
//
// Load with torch.ops.load_library(<path of libtpfuse_torch.so>) (python/tpfuse does).
#include <ATen/ATen.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <charconv>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#if TPFUSE_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "op_description.h"
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

// Runs `call` with the team's device current (CUDA).
template <typename Fn>
void on_device([[maybe_unused]] const Team& team, Fn&& call) {
#if TPFUSE_TORCH_CUDA
  if (team.backend() == Backend::kCuda) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(team.device()));
    call();
    return;
  }
#endif
  call();
}

// The stream a rank's turn goes on when the call's own tensors cannot say (they were what was
// wrong): torch's current stream of the team's device, none on the CPU.
cudaStream_t turn_stream([[maybe_unused]] const Team& team) {
#if TPFUSE_TORCH_CUDA
  if (team.backend() == Backend::kCuda) {
    return c10::cuda::getCurrentCUDAStream(team.device()).stream();
  }
#endif
  return nullptr;
}

}  // namespace

// A fused op's call of the library, and what the op does before it. Until the op launches, a
// failure (a None, an unknown enum value, torch's checks) is a rejected call: the kernel still
// takes this rank's turn (tpfuse::reject_call), as the library does for its own checks, so that
// the peers' call ends at once with an error naming this rank and the team goes on.
class Launch {
 public:
  explicit Launch(Team team) : team_(std::move(team)) {}

  const Team& team() const { return team_; }

  // The stream a call on `tensor` queues on: torch's current stream of its device (CUDA), none
  // for CPU tensors. Checks that the tensor is where the team is.
  cudaStream_t stream_for(const at::Tensor& tensor, const char* op) const {
    if (team_.backend() == Backend::kCpu) {
      TORCH_CHECK(tensor.device().is_cpu(), "tpfuse::", op,
                  ": a CPU-backend team takes CPU tensors, got ", tensor.device());
      return nullptr;
    }
#if TPFUSE_TORCH_CUDA
    TORCH_CHECK(tensor.device().is_cuda() && tensor.device().index() == team_.device(),
                "tpfuse::", op, ": team rank ", team_.rank(), " is on cuda:", team_.device(),
                ", got a tensor on ", tensor.device());
    return c10::cuda::getCurrentCUDAStream(team_.device()).stream();
#else
    TORCH_CHECK(false, "tpfuse::", op, ": this build of the torch ops has no CUDA");
#endif
  }

  // The library call, with the team's device current.
  template <typename LibraryCall>
  void operator()(LibraryCall&& call) {
    started_ = true;
    on_device(team_, call);
  }

  bool started() const {
    return started_;
  }

  // This rank's turn without data, for a call rejected before it launched.
  void reject() const {
    try {
      on_device(team_, [&] { reject_call(team_, turn_stream(team_)); });
    } catch (...) {
      // Already reporting the rejection; the peers then time out instead.
    }
  }

 private:
  Team team_;
  bool started_ = false;
};

namespace {

// --- torch's checks: what the tensors say (the library checks what its arguments say) ---

DType dtype_of(const at::Tensor& tensor, const char* op, const char* name) {
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

// `tensor` has the dtype and device of `reference` and is contiguous.
void check_like(const at::Tensor& tensor, const at::Tensor& reference, const char* op,
                const char* name) {
  TORCH_CHECK(tensor.scalar_type() == reference.scalar_type(), "tpfuse::", op, ": ", name,
              " must have dtype ", reference.scalar_type(), ", got ", tensor.scalar_type());
  TORCH_CHECK(tensor.device() == reference.device(), "tpfuse::", op, ": ", name, " must be on ",
              reference.device(), ", got ", tensor.device());
  TORCH_CHECK(tensor.is_contiguous(), "tpfuse::", op, ": ", name, " must be contiguous");
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
// The library checks the same of its norm_out, residual_out and gamma, which this op's caller
// never named: checked here, in the op's own arguments, where the op maps them.
void check_in_place(const at::Tensor& input, const at::Tensor& residual, const at::Tensor& weight,
                    const char* op, bool writes_input) {
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

// --- the add + RMSNorm family: allreduce_add_rmsnorm, its in-place, FP8 and MoE finalize forms
// (one AddRmsNormArgs in the library). An op without one of these arguments leaves its default.

struct RowsCall {
  at::Tensor input;  // [tokens, hidden]; the MoE forms have expert_rows instead
  std::optional<at::Tensor> residual;
  at::Tensor weight;
  double eps = 0;
  QuantMode quant = QuantMode::kNone;  // the FP8 forms take any but kNone
  std::optional<at::Tensor> scale;
  bool column_major_scales = false;
  Algorithm algorithm = Algorithm::kAuto;
  NormWeight norm_weight = NormWeight::kGamma;
  bool keep_norm = true;
  at::Tensor expert_rows;      // [tokens, topk, hidden]
  at::Tensor routing_weights;  // [tokens, topk], float32 or the rows' dtype
  std::optional<at::Tensor> shared_expert;

  bool moe() const { return expert_rows.defined(); }
  // The [tokens, hidden] tensor the outputs are shaped and typed like, and its name.
  const at::Tensor& rows() const { return moe() ? *residual : input; }
  const char* rows_name() const { return moe() ? "residual" : "input"; }
};

// Outputs, in the schemas' order: (norm_out, residual_out) unless in place, then (quant_out,
// scales) with an FP8 output. norm_out is [0, hidden] without keep_norm; scales is quant's:
// [tokens], [tokens, hidden / 128] (column_major_scales: a [hidden / 128, tokens] tensor's
// transpose) or, for a static scale, empty. Symbolic sizes, so that the Meta kernels leave a
// dynamic token count symbolic (size() would specialize the compiled graph to the count it was
// traced at).
std::vector<at::Tensor> rows_shapes(const RowsCall& call, const OpForm& form) {
  const at::Tensor& rows = call.rows();
  TORCH_CHECK(rows.dim() == 2, "tpfuse::", form.name, ": ", call.rows_name(),
              " must be [tokens, hidden], got ", rows.sym_sizes());
  std::vector<at::Tensor> outputs;
  if (!form.in_place) {
    outputs.push_back(call.keep_norm
                          ? at::empty_like(rows)
                          : at::empty_symint({c10::SymInt(0), rows.sym_size(1)}, rows.options()));
    outputs.push_back(at::empty_like(rows));
  }
  if (call.quant == QuantMode::kNone) return outputs;
  outputs.push_back(at::empty_symint(rows.sym_sizes(), rows.options().dtype(at::kFloat8_e4m3fn)));
  const at::TensorOptions scales = rows.options().dtype(at::kFloat);
  // The scales' shape follows the output policy's scope (tpfuse/impl/epilogue/output.h).
  const impl::OutputScope scope = impl::output_scope(call.quant);
  if (scope == impl::OutputScope::kToken) {
    outputs.push_back(at::empty_symint({rows.sym_size(0)}, scales));
  } else if (scope == impl::OutputScope::kGroup) {
    // The width is fixed in a compiled graph, and so is the group count: guard on it alone
    // (size() would fix every size of the tensor). A width the groups do not divide has no
    // scales' shape.
    const int64_t hidden = rows.sym_size(1).guard_int(__FILE__, __LINE__);
    TORCH_CHECK(hidden % kQuantGroupSize == 0, "tpfuse::", form.name,
                ": hidden must be a multiple of ", kQuantGroupSize, " for quant ", int(call.quant),
                " (", impl::enumerator_name(call.quant), "), got ", hidden);
    const c10::SymInt groups(hidden / kQuantGroupSize);
    outputs.push_back(call.column_major_scales
                          ? at::empty_symint({groups, rows.sym_size(0)}, scales).t()
                          : at::empty_symint({rows.sym_size(0), groups}, scales));
  } else {
    outputs.push_back(at::empty_symint({c10::SymInt(0)}, scales));
  }
  return outputs;
}

// The MoE forms' contribution, checked against their rows (the residual): AddRmsNormArgs::moe_*.
void set_moe_arguments(const RowsCall& call, const char* op, AddRmsNormArgs& args) {
  const at::Tensor& rows = call.rows();
  const at::Tensor& experts = call.expert_rows;
  check_like(experts, rows, op, "expert_rows");
  TORCH_CHECK(
      experts.dim() == 3 && experts.size(0) == rows.size(0) && experts.size(2) == rows.size(1),
      "tpfuse::", op, ": expert_rows must be [tokens = ", rows.size(0),
      ", topk, hidden = ", rows.size(1), "], got ", experts.sizes());
  const at::Tensor& weights = call.routing_weights;
  TORCH_CHECK(weights.scalar_type() == at::kFloat || weights.scalar_type() == experts.scalar_type(),
              "tpfuse::", op, ": routing_weights must be float32 or ", experts.scalar_type(),
              ", got ", weights.scalar_type());
  TORCH_CHECK(weights.device() == rows.device() && weights.is_contiguous(), "tpfuse::", op,
              ": routing_weights must be contiguous and on ", rows.device());
  TORCH_CHECK(weights.dim() == 2 && weights.size(0) == experts.size(0) &&
                  weights.size(1) == experts.size(1),
              "tpfuse::", op, ": routing_weights must be [tokens, topk] = [", experts.size(0), ", ",
              experts.size(1), "], got ", weights.sizes());
  if (call.shared_expert) {
    check_like(*call.shared_expert, rows, op, "shared_expert");
    TORCH_CHECK(call.shared_expert->sizes() == rows.sizes(), "tpfuse::", op,
                ": shared_expert must be ", rows.sizes(), ", got ", call.shared_expert->sizes());
  }
  args.moe_expert_rows = experts.data_ptr();
  args.moe_weights = weights.data_ptr();
  args.moe_shared = call.shared_expert ? call.shared_expert->data_ptr() : nullptr;
  // Past the library's limit, but not wrapped: its check names the count.
  args.moe_topk = int(std::min<int64_t>(experts.size(1), kMaxMoeTopK + 1));
  args.moe_weights_in_dtype = weights.scalar_type() != at::kFloat;
}

std::vector<at::Tensor> run_rows(const RowsCall& call, const OpForm& form, Launch& launch) {
  const char* op = form.name;
  const at::Tensor& rows = call.rows();
  const DType dtype = dtype_of(rows, op, call.rows_name());
  std::vector<at::Tensor> outputs = rows_shapes(call, form);
  check_like(rows, rows, op, call.rows_name());
  check_like(call.weight, rows, op, "weight");
  TORCH_CHECK(call.weight.dim() == 1 && call.weight.size(0) == rows.size(1), "tpfuse::", op,
              ": weight must be [hidden = ", rows.size(1), "], got ", call.weight.sizes());
  if (call.residual && !call.moe()) {
    check_like(*call.residual, rows, op, "residual");
    TORCH_CHECK(call.residual->sizes() == rows.sizes(), "tpfuse::", op, ": residual must be ",
                rows.sizes(), ", got ", call.residual->sizes());
  }
  if (form.in_place) check_in_place(call.input, *call.residual, call.weight, op, call.keep_norm);

  AddRmsNormArgs args;
  if (call.moe()) {
    set_moe_arguments(call, op, args);
  } else {
    args.input = call.input.data_ptr();
  }
  if (call.scale) {
    const at::Tensor& scale = *call.scale;
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == 1, "tpfuse::", op,
                ": scale must be a float32 tensor of one element, got ", scale.scalar_type(),
                " of ", scale.sizes());
    TORCH_CHECK(scale.device() == rows.device(), "tpfuse::", op, ": scale is on ", scale.device(),
                ", ", call.rows_name(), " on ", rows.device());
    args.quant_scale = scale.data_ptr<float>();
  }
  // The in-place forms write the norm into input (without keep_norm, nowhere) and the sum into
  // residual; the others into their first two outputs.
  const at::Tensor* norm_out = form.in_place ? &call.input : &outputs[0];
  args.norm_out = call.keep_norm ? norm_out->data_ptr() : nullptr;
  args.residual_out = form.in_place ? call.residual->data_ptr() : outputs[1].data_ptr();
  args.residual = call.residual ? call.residual->data_ptr() : nullptr;
  args.gamma = call.weight.data_ptr();
  args.tokens = rows.size(0);
  args.hidden = rows.size(1);
  args.dtype = dtype;
  args.eps = float(call.eps);
  args.algorithm = call.algorithm;
  args.norm_weight = call.norm_weight;
  args.quant = call.quant;
  if (call.quant != QuantMode::kNone) {
    const size_t quant_out = form.in_place ? 0 : 2;
    args.quant_out = outputs[quant_out].data_ptr();
    at::Tensor& scales = outputs[quant_out + 1];
    args.scales_out = scales.numel() > 0 ? scales.data_ptr<float>() : nullptr;
    args.scales_column_major = call.column_major_scales;
  }
  cudaStream_t stream = launch.stream_for(rows, op);
  launch([&] { allreduce_add_rmsnorm(launch.team(), args, stream); });
  return outputs;
}

// --- allreduce ---

struct AllreduceCall {
  at::Tensor input;
  Algorithm algorithm = Algorithm::kAuto;
};

std::vector<at::Tensor> allreduce_shapes(const AllreduceCall& call, const OpForm&) {
  return {at::empty_like(call.input)};
}

std::vector<at::Tensor> run_allreduce(const AllreduceCall& call, const OpForm& form,
                                      Launch& launch) {
  const DType dtype = dtype_of(call.input, form.name, "input");
  check_like(call.input, call.input, form.name, "input");
  std::vector<at::Tensor> outputs = allreduce_shapes(call, form);
  cudaStream_t stream = launch.stream_for(call.input, form.name);
  launch([&] {
    tpfuse::allreduce(launch.team(), call.input.data_ptr(), outputs[0].data_ptr(),
                      call.input.numel(), dtype, stream, call.algorithm);
  });
  return outputs;
}

// --- allreduce_qk_rmsnorm ---

struct QkCall {
  at::Tensor qkv;  // [tokens, q_size + 2 * kv_size]
  at::Tensor q_weight;
  at::Tensor k_weight;
  int64_t q_size = 0;
  int64_t kv_size = 0;
  int64_t q_global_size = 0;
  int64_t k_global_size = 0;
  int64_t kv_replicas = 1;
  double eps = 0;
  std::optional<at::Tensor> positions;      // int64 [tokens]
  std::optional<at::Tensor> cos_sin_cache;  // float32 [max_position, rotary_dim]
  int64_t head_dim = 0;
  int64_t rotary_dim = 0;
  RopeStyle rope_style = RopeStyle::kNone;
  Algorithm algorithm = Algorithm::kAuto;
};

// (q [tokens, q_size], k [tokens, kv_size]), the token count symbolic (sym_size), so that a
// dynamic count stays dynamic.
std::vector<at::Tensor> qk_shapes(const QkCall& call, const OpForm&) {
  const at::Tensor& qkv = call.qkv;
  return {at::empty_symint({qkv.sym_size(0), c10::SymInt(call.q_size)}, qkv.options()),
          at::empty_symint({qkv.sym_size(0), c10::SymInt(call.kv_size)}, qkv.options())};
}

std::vector<at::Tensor> run_qk(const QkCall& call, const OpForm& form, Launch& launch) {
  const char* op = form.name;
  const at::Tensor& qkv = call.qkv;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == call.q_size + 2 * call.kv_size, "tpfuse::", op,
              ": qkv must be [tokens, q_size + 2 * kv_size = ", call.q_size + 2 * call.kv_size,
              "], got ", qkv.sizes());
  const DType dtype = dtype_of(qkv, op, "qkv");
  check_like(qkv, qkv, op, "qkv");
  check_like(call.q_weight, qkv, op, "q_weight");
  check_like(call.k_weight, qkv, op, "k_weight");
  TORCH_CHECK(call.q_weight.dim() == 1 && call.q_weight.size(0) == call.q_size, "tpfuse::", op,
              ": q_weight must be [q_size = ", call.q_size, "] (this rank's slice), got ",
              call.q_weight.sizes());
  TORCH_CHECK(call.k_weight.dim() == 1 && call.k_weight.size(0) == call.kv_size, "tpfuse::", op,
              ": k_weight must be [kv_size = ", call.kv_size, "] (this rank's slice), got ",
              call.k_weight.sizes());
  std::vector<at::Tensor> outputs = qk_shapes(call, form);
  QkNormArgs args;
  args.qkv = qkv.data_ptr();
  args.q_out = outputs[0].data_ptr();
  args.k_out = outputs[1].data_ptr();
  args.q_gamma = call.q_weight.data_ptr();
  args.k_gamma = call.k_weight.data_ptr();
  args.tokens = qkv.size(0);
  args.q_size = call.q_size;
  args.kv_size = call.kv_size;
  args.q_global_size = call.q_global_size;
  args.k_global_size = call.k_global_size;
  args.kv_replicas = int(call.kv_replicas);
  args.dtype = dtype;
  args.eps = float(call.eps);
  args.algorithm = call.algorithm;
  args.rope = call.rope_style;
  if (args.rope != RopeStyle::kNone) {
    // Without positions or the cache the library names the missing one.
    args.head_dim = call.head_dim;
    args.rotary_dim = call.rotary_dim;
    if (call.positions) {
      const at::Tensor& positions = *call.positions;
      TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                      positions.numel() == qkv.size(0),
                  "tpfuse::", op, ": positions must be contiguous int64 [tokens]");
      TORCH_CHECK(positions.device() == qkv.device(), "tpfuse::", op, ": positions must be on ",
                  qkv.device(), ", got ", positions.device());
      args.positions = positions.data_ptr<int64_t>();
    }
    if (call.cos_sin_cache) {
      const at::Tensor& cache = *call.cos_sin_cache;
      TORCH_CHECK(cache.scalar_type() == at::kFloat, "tpfuse::", op,
                  ": cos_sin_cache must be float32 (cos and sin in fp32), got ",
                  cache.scalar_type());
      TORCH_CHECK(cache.device() == qkv.device(), "tpfuse::", op, ": cos_sin_cache must be on ",
                  qkv.device(), ", got ", cache.device());
      TORCH_CHECK(cache.dim() == 2 && cache.size(1) == call.rotary_dim && cache.is_contiguous(),
                  "tpfuse::", op, ": cos_sin_cache must be contiguous float32 [max_position, ",
                  call.rotary_dim, "], got ", cache.sizes());
      args.cos_sin_cache = cache.data_ptr<float>();
      args.max_position = cache.size(0);
    }
  }
  cudaStream_t stream = launch.stream_for(qkv, op);
  launch([&] { allreduce_qk_rmsnorm(launch.team(), args, stream); });
  return outputs;
}

// --- the fused ops, each declared once ---

const auto& fused_ops() {
  using R = RowsCall;
  using Q = QkCall;
  static const auto ops = std::make_tuple(
      Op<R>{"allreduce_add_rmsnorm",
            {arg<&R::input>("input"), arg<&R::residual>("residual"), arg<&R::weight>("weight"),
             arg<&R::eps>("eps"), arg<&R::algorithm>("algorithm", Algorithm::kAuto),
             arg<&R::norm_weight>("norm_weight", NormWeight::kGamma)},
            {"norm_out", "residual_out"},
            &rows_shapes,
            &run_rows},
      // In place, as engines call their fused add + RMSNorm: input <- norm, residual <- sum.
      Op<R>{"allreduce_add_rmsnorm_",
            {arg<&R::input>("input").written(), arg<&R::residual>("residual").required().written(),
             arg<&R::weight>("weight"), arg<&R::eps>("eps"),
             arg<&R::algorithm>("algorithm", Algorithm::kAuto),
             arg<&R::norm_weight>("norm_weight", NormWeight::kGamma)},
            {},
            &rows_shapes,
            &run_rows},
      // The norm's FP8 output too (tpfuse::QuantMode).
      Op<R>{"allreduce_add_rmsnorm_fp8",
            {arg<&R::input>("input"), arg<&R::residual>("residual"), arg<&R::weight>("weight"),
             arg<&R::eps>("eps"), arg<&R::quant>("quant").except(QuantMode::kNone),
             arg<&R::scale>("scale", std::nullopt),
             arg<&R::column_major_scales>("column_major_scales", false),
             arg<&R::algorithm>("algorithm", Algorithm::kAuto),
             arg<&R::norm_weight>("norm_weight", NormWeight::kGamma),
             arg<&R::keep_norm>("keep_norm", true)},
            {"norm_out", "residual_out", "quant_out", "scales"},
            &rows_shapes,
            &run_rows,
            "input residual weight eps quant scale algorithm norm_weight column_major_scales "
            "keep_norm"},
      // In place, and the norm's FP8 output; without keep_norm input is left as it was.
      Op<R>{
          "allreduce_add_rmsnorm_fp8_",
          {arg<&R::input>("input").written(), arg<&R::residual>("residual").required().written(),
           arg<&R::weight>("weight"), arg<&R::eps>("eps"),
           arg<&R::quant>("quant").except(QuantMode::kNone), arg<&R::scale>("scale", std::nullopt),
           arg<&R::column_major_scales>("column_major_scales", false),
           arg<&R::algorithm>("algorithm", Algorithm::kAuto),
           arg<&R::norm_weight>("norm_weight", NormWeight::kGamma),
           arg<&R::keep_norm>("keep_norm", true)},
          {"quant_out", "scales"},
          &rows_shapes,
          &run_rows,
          "input residual weight eps quant scale algorithm norm_weight column_major_scales "
          "keep_norm"},
      // This rank's contribution is the routing-weighted sum of its expert rows (and the shared
      // expert's row): AddRmsNormArgs::moe_*.
      Op<R>{"allreduce_moe_finalize_add_rmsnorm",
            {arg<&R::expert_rows>("expert_rows"), arg<&R::routing_weights>("routing_weights"),
             arg<&R::residual>("residual").required(), arg<&R::weight>("weight"),
             arg<&R::eps>("eps"), arg<&R::shared_expert>("shared_expert", std::nullopt),
             arg<&R::algorithm>("algorithm", Algorithm::kAuto)},
            {"norm_out", "residual_out"},
            &rows_shapes,
            &run_rows},
      // Python's allreduce_moe_finalize_add_rmsnorm with quant (this order) is this op.
      Op<R>{
          "allreduce_moe_finalize_add_rmsnorm_fp8",
          {arg<&R::expert_rows>("expert_rows"), arg<&R::routing_weights>("routing_weights"),
           arg<&R::residual>("residual").required(), arg<&R::weight>("weight"), arg<&R::eps>("eps"),
           arg<&R::quant>("quant").except(QuantMode::kNone), arg<&R::scale>("scale", std::nullopt),
           arg<&R::column_major_scales>("column_major_scales", false),
           arg<&R::shared_expert>("shared_expert", std::nullopt),
           arg<&R::algorithm>("algorithm", Algorithm::kAuto),
           arg<&R::keep_norm>("keep_norm", true)},
          {"norm_out", "residual_out", "quant_out", "scales"},
          &rows_shapes,
          &run_rows,
          "expert_rows routing_weights residual weight eps shared_expert quant scale algorithm "
          "column_major_scales keep_norm"},
      Op<AllreduceCall>{"allreduce",
                        {arg<&AllreduceCall::input>("input"),
                         arg<&AllreduceCall::algorithm>("algorithm", Algorithm::kAuto)},
                        {nullptr},
                        &allreduce_shapes,
                        &run_allreduce},
      Op<Q>{"allreduce_qk_rmsnorm",
            {arg<&Q::qkv>("qkv"), arg<&Q::q_weight>("q_weight"), arg<&Q::k_weight>("k_weight"),
             arg<&Q::q_size>("q_size"), arg<&Q::kv_size>("kv_size"),
             arg<&Q::q_global_size>("q_global_size"), arg<&Q::k_global_size>("k_global_size"),
             arg<&Q::kv_replicas>("kv_replicas").python_default(1), arg<&Q::eps>("eps"),
             arg<&Q::positions>("positions", std::nullopt),
             arg<&Q::cos_sin_cache>("cos_sin_cache", std::nullopt),
             arg<&Q::head_dim>("head_dim", 0), arg<&Q::rotary_dim>("rotary_dim", 0),
             arg<&Q::rope_style>("rope_style", RopeStyle::kNone),
             arg<&Q::algorithm>("algorithm", Algorithm::kAuto)},
            {"q", "k"},
            &qk_shapes,
            &run_qk,
            "qkv q_weight k_weight q_size kv_size q_global_size k_global_size eps kv_replicas "
            "positions cos_sin_cache head_dim rotary_dim rope_style algorithm"});
  return ops;
}

template <typename Fn>
void for_each_fused_op(Fn&& fn) {
  std::apply([&](const auto&... op) { (fn(op), ...); }, fused_ops());
}

// The kernels every fused op registers, boxed: they read its arguments off the dispatcher's
// stack (parse) and push its outputs.
template <typename Call>
class RealKernel final : public c10::OperatorKernel {
 public:
  explicit RealKernel(const Op<Call>& op) : op_(op), form_(op.form()) {}

  void operator()(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack* stack) {
    const size_t count = op_.arguments.size() + 1;
    const auto arguments = torch::jit::last(*stack, count);
    Launch launch(Registry::instance().get(arguments[0].toInt(), op_.name));
    std::vector<at::Tensor> outputs;
    try {
      outputs = op_.run(parse(op_, arguments), form_, launch);
    } catch (...) {
      if (!launch.started()) launch.reject();
      throw;
    }
    torch::jit::drop(*stack, count);
    for (at::Tensor& output : outputs) torch::jit::push(*stack, std::move(output));
  }

 private:
  const Op<Call>& op_;
  const OpForm form_;
};

// Shapes only, for torch.compile's fake tensors. A call lands here when any of its tensors is a
// meta tensor: all of them must be, or real tensors would get no work done and garbage back.
template <typename Call>
class MetaKernel final : public c10::OperatorKernel {
 public:
  explicit MetaKernel(const Op<Call>& op) : op_(op), form_(op.form()) {}

  void operator()(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack* stack) {
    const size_t count = op_.arguments.size() + 1;
    const auto arguments = torch::jit::last(*stack, count);
    for (size_t i = 1; i < count; ++i) {
      if (!arguments[i].isTensor()) continue;
      const at::Tensor& tensor = arguments[i].toTensor();
      TORCH_CHECK(!tensor.defined() || tensor.is_meta(), "tpfuse::", op_.name, ": ",
                  op_.arguments[i - 1].name, " is on ", tensor.device(),
                  " but another argument is a meta tensor: all must be on one device");
    }
    std::vector<at::Tensor> outputs = op_.shapes(parse(op_, arguments), form_);
    torch::jit::drop(*stack, count);
    for (at::Tensor& output : outputs) torch::jit::push(*stack, std::move(output));
  }

 private:
  const Op<Call>& op_;
  const OpForm form_;
};

template <template <typename> class Kernel>
void register_kernels(torch::Library& library) {
  for_each_fused_op([&](const auto& op) {
    using Call = typename std::decay_t<decltype(op)>::CallType;
    library.impl(op.name,
                 torch::CppFunction::makeFromBoxedFunctor(std::make_unique<Kernel<Call>>(op)));
  });
}

// What python/tpfuse/ops.py builds the package's enums, constants and op wrappers from (JSON;
// with each op's schema): {"enums": {C++ type: {name: value}}, "constants": {...}, "ops":
// {name: write_op_json's}}.
std::string describe() {
  std::vector<const EnumDescription*> enums;
  for_each_fused_op([&](const auto& op) {
    for (const auto& argument : op.arguments) {
      if (argument.enumeration != nullptr &&
          std::find(enums.begin(), enums.end(), argument.enumeration) == enums.end()) {
        enums.push_back(argument.enumeration);
      }
    }
  });
  std::ostringstream out;
  out << "{\"enums\": {";
  for (size_t i = 0; i < enums.size(); ++i) {
    if (i > 0) out << ", ";
    write_enum_json(out, *enums[i]);
  }
  // The shortest decimal that reads back as the float (1e-10, as Python writes the patterns).
  char floor[32];
  const auto written = std::to_chars(floor, floor + sizeof(floor), kQuantMinAmax);
  out << "}, \"constants\": {\"kQuantGroupSize\": " << kQuantGroupSize
      << ", \"kQuantMinAmax\": " << std::string(floor, written.ptr) << "}, \"ops\": {";
  const char* separator = "";
  for_each_fused_op([&](const auto& op) {
    out << separator;
    write_op_json(out, op);
    separator = ", ";
  });
  out << "}}";
  return out.str();
}

// --- team ops ---

TeamOptions team_options(int64_t packet_bytes, double peer_timeout_seconds) {
  TeamOptions options;
  // The size_t would wrap; the library checks the rest.
  TORCH_CHECK(packet_bytes > 0, "tpfuse: packet_bytes must be > 0, got ", packet_bytes);
  options.packet_bytes = size_t(packet_bytes);
  options.peer_timeout_seconds = peer_timeout_seconds;
  return options;
}

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
  for_each_fused_op([&](const auto& op) {
    python_order(op);  // checked here, when the library loads
    m.def(schema_of(op).c_str());
  });
  m.def("describe() -> str", &describe);
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
  tpfuse::torch_ops::register_kernels<tpfuse::torch_ops::RealKernel>(m);
}

#if TPFUSE_TORCH_CUDA
TORCH_LIBRARY_IMPL(tpfuse, CUDA, m) {
  tpfuse::torch_ops::register_kernels<tpfuse::torch_ops::RealKernel>(m);
}
#endif

TORCH_LIBRARY_IMPL(tpfuse, Meta, m) {
  tpfuse::torch_ops::register_kernels<tpfuse::torch_ops::MetaKernel>(m);
}
