// The SYCL backend's BackendOps: per-call checks of the queue and the memory, and each call as
// one kernel submission (src/sycl/device/rows.h, qknorm.h) on the call's queue, with no host
// wait. A call's Stream carries a sycl::queue* (tpfuse/sycl.h); an empty one is the rank's own
// in-order queue. What the backend does not run (an NCCL path) is an error naming it, never a
// silent fallback.
#include <sstream>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/error.h"
#include "sycl/compiler.h"
#include "sycl/device/calls.h"
#include "sycl/state.h"

namespace tpfuse {

bool sycl_available() {
  return true;
}

namespace impl {

int sycl_epilogue_index(const RowEpilogueKind& epilogue) {
  if (epilogue.moe) return epilogue.quant ? 10 : 9;  // with a residual and gamma (validated)
  if (!epilogue.norm) return 0;
  const int weight = epilogue.weight == NormWeight::kOnePlusGamma ? 2 : 0;
  return 1 + weight + (epilogue.residual ? 1 : 0) + (epilogue.quant ? 4 : 0);
}

namespace {

// The kernels' names: tpf_sycl_rows_<dtype>_<epilogue> (rows.h), by DType and epilogue index.
const char* const kDtypeNames[3] = {"f32", "f16", "bf16"};
const char* const kEpilogueNames[kSyclRowEpilogues] = {"sum",
                                                       "norm",
                                                       "residual_norm",
                                                       "norm_1pg",
                                                       "residual_norm_1pg",
                                                       "norm_q",
                                                       "residual_norm_q",
                                                       "norm_1pg_q",
                                                       "residual_norm_1pg_q",
                                                       "residual_norm_moe",
                                                       "residual_norm_q_moe"};

// Work-items of a call's work-group: enough to spread a row, within what the device allows.
constexpr size_t kGroupSize = 128;

struct KernelEntry {
  sycl::context context;
  sycl::device device;
  SyclKernels kernels;
};

}  // namespace

const SyclKernels& sycl_kernels(const sycl::context& context, const sycl::device& device) {
  // Never destroyed: a kernel keeps its JIT-compiled bundle, which must not be released at exit.
  static std::mutex* const mutex = new std::mutex;
  static std::vector<KernelEntry*>* const entries = new std::vector<KernelEntry*>;
  std::lock_guard<std::mutex> lock(*mutex);
  for (const KernelEntry* entry : *entries) {
    if (entry->context == context && entry->device == device) return entry->kernels;
  }
  // The waits read the device's clock where it has one (rows.h).
  const bool clock = device.has(sycl::aspect::ext_oneapi_clock_device);
  const sycl_backend::KernelSource source{"the SYCL backend's kernels (tpfuse/sycl/rows.h)",
                                          "#include <tpfuse/sycl/rows.h>\n",
                                          {},
                                          {clock ? "-DTPF_SYCL_CLOCK=1" : "-DTPF_SYCL_CLOCK=0"}};
  const sycl_backend::Build build = sycl_backend::kernel_compiler().build(context, device, source);
  // The QK norm's, a bundle of its own: one source of every kernel compiles slower than two.
  const sycl_backend::KernelSource qk_source{
      "the SYCL backend's QK-norm kernels (tpfuse/sycl/qknorm.h)",
      "#include <tpfuse/sycl/qknorm.h>\n",
      {},
      source.options};
  const sycl_backend::Build qk_build =
      sycl_backend::kernel_compiler().build(context, device, qk_source);
  SyclKernels kernels;
  for (int d = 0; d < 3; ++d) {
    for (int e = 0; e < kSyclRowEpilogues; ++e) {
      kernels.rows.push_back(
          build.kernel(std::string("tpf_sycl_rows_") + kDtypeNames[d] + "_" + kEpilogueNames[e]));
    }
  }
  for (int d = 0; d < 3; ++d) {
    kernels.qk.push_back(qk_build.kernel(std::string("tpf_sycl_qk_") + kDtypeNames[d]));
  }
  kernels.absent = build.kernel("tpf_sycl_absent");
  kernels.calibrate = build.kernel("tpf_sycl_calibrate");
  kernels.clock_rate = build.kernel("tpf_sycl_clock_rate");
  kernels.clock = clock;
  kernels.group_size =
      std::min(kGroupSize, device.get_info<sycl::info::device::max_work_group_size>());
  kernels.seconds = build.seconds + qk_build.seconds;
  entries->push_back(new KernelEntry{context, device, kernels});
  return entries->back()->kernels;
}

namespace {

sycl::queue* queue_of(Stream stream) {
  return static_cast<sycl::queue*>(stream.handle);
}

sycl::queue& rank_queue(const SyclTeamState& team, Stream stream) {
  sycl::queue* queue = queue_of(stream);
  return queue != nullptr ? *queue : *team.queue;
}

// Submits one kernel of one work-group; a runtime error is a tpfuse::Error naming the call.
template <typename Params>
sycl::event submit(sycl::queue& queue, const sycl::kernel& kernel, size_t group_size,
                   const Params& params, const char* what) {
  try {
    return queue.submit([&](sycl::handler& handler) {
      handler.set_args(params);
      handler.parallel_for(sycl::nd_range<1>{group_size, group_size}, kernel);
    });
  } catch (const sycl::exception& error) {
    TPF_FAIL(what << ": the SYCL runtime refused the kernel: " << error.what());
  }
}

void remember(const SyclTeamState& team, const sycl::event& event) {
  std::lock_guard<std::mutex> lock(team.mutex);
  team.last = event;
}

SyclRowCall row_params(const RowCall& call, bool local, bool twoshot, uint64_t bound) {
  SyclRowCall p{};
  p.exchange = call.exchange;
  p.signature = call.signature;
  p.input = call.input;
  p.residual = call.residual;
  p.gamma = call.gamma;
  p.residual_out = call.residual_out;
  p.norm_out = call.norm_out;
  p.tokens = call.tokens;
  p.hidden = call.hidden;
  p.eps = call.eps;
  p.quant = int(call.quant);
  p.quant_out = call.quant_out;
  p.quant_scale = call.quant_scale;
  p.scales_out = call.scales_out;
  p.scales_column_major = call.scales_column_major ? 1 : 0;
  p.moe_rows = call.moe_rows;
  p.moe_weights = call.moe_weights;
  p.moe_shared = call.moe_shared;
  p.moe_topk = call.moe_topk;
  p.moe_weights_in_dtype = call.moe_weights_in_dtype ? 1 : 0;
  p.local = local ? 1 : 0;
  p.twoshot = twoshot ? 1 : 0;
  p.bound = bound;
  return p;
}

SyclQkCall qk_params(const QkCall& call, int pass, uint64_t bound) {
  SyclQkCall p{};
  p.exchange = call.exchange;
  p.signature = call.signature;
  p.qkv = call.qkv;
  p.q_out = call.q_out;
  p.k_out = call.k_out;
  p.q_out_stride = call.q_out_stride;
  p.k_out_stride = call.k_out_stride;
  p.q_gamma = call.q_gamma;
  p.k_gamma = call.k_gamma;
  p.tokens = call.tokens;
  p.q_size = call.q_size;
  p.kv_size = call.kv_size;
  p.q_global_size = call.q_global_size;
  p.k_global_size = call.k_global_size;
  p.counts_k = call.counts_k;
  p.eps = call.eps;
  p.rope = int(call.rope);
  p.head_dim = call.head_dim;
  p.rotary_dim = call.rotary_dim;
  p.positions = call.positions;
  p.cos_sin_cache = call.cos_sin_cache;
  p.max_position = call.max_position;
  p.sums = call.sums;
  p.pass = pass;
  p.bound = bound;
  return p;
}

const sycl::kernel& row_kernel(const SyclKernels& kernels, DType dtype,
                               const RowEpilogueKind& epilogue, const char* op) {
  const int index = sycl_epilogue_index(epilogue);
  TPF_CHECK_ARG(index >= 0, op, "the SYCL backend has no kernel for this epilogue");
  return kernels.row(dtype, index);
}

class SyclBackend final : public BackendOps {
 public:
  Backend kind() const override { return Backend::kSycl; }

  // The queue: in order (a rank's calls run one after another: rows.h), of the team's context
  // and the rank's device; a local call needs one. Every pointer: USM of that context (device
  // memory of the rank's device, shared or host memory).
  void validate_call(const TeamState* team, std::initializer_list<NamedPointer> pointers,
                     Stream stream, const char* op) const override {
    sycl::queue* queue = queue_of(stream);
    TPF_CHECK_ARG(team != nullptr || queue != nullptr, op,
                  "a local call of the SYCL backend needs the sycl::queue to run on "
                  "(tpfuse/sycl.h)");
    if (queue != nullptr) {
      TPF_CHECK_ARG(queue->is_in_order(), op,
                    "the sycl::queue must be in order (sycl::property::queue::in_order): a rank's "
                    "calls must run one after another");
    }
    const sycl::context context =
        team != nullptr ? *sycl_state(*team).context : queue->get_context();
    const sycl::device device =
        team != nullptr ? *sycl_state(*team).sycl_device : queue->get_device();
    if (team != nullptr && queue != nullptr) {
      TPF_CHECK_ARG(queue->get_context() == context && queue->get_device() == device, op,
                    "the sycl::queue must belong to the team's context and to rank "
                        << team->rank() << "'s device ("
                        << device.get_info<sycl::info::device::name>() << ")");
    }
    for (const NamedPointer& argument : pointers) {
      if (argument.pointer == nullptr) continue;
      const sycl::usm::alloc type = sycl::get_pointer_type(argument.pointer, context);
      TPF_CHECK_ARG(type != sycl::usm::alloc::unknown, op,
                    argument.name << " must be USM memory of the "
                                  << (team != nullptr ? "team's" : "queue's")
                                  << " SYCL context (sycl::malloc_device, malloc_shared or "
                                     "malloc_host), got memory that context does not know");
      if (type == sycl::usm::alloc::device) {
        TPF_CHECK_ARG(sycl::get_pointer_device(argument.pointer, context) == device, op,
                      argument.name << " is device memory of another device than "
                                    << device.get_info<sycl::info::device::name>());
      }
    }
  }

  void oneshot(const TeamState& rank, const RowCall& call, DType dtype,
               const RowEpilogueKind& epilogue, Stream stream) const override {
    const SyclTeamState& team = sycl_state(rank);
    const sycl::kernel& kernel = row_kernel(*team.kernels, dtype, epilogue, "one-shot");
    remember(team, submit(rank_queue(team, stream), kernel, team.kernels->group_size,
                          row_params(call, false, false, team.bound), "one-shot"));
  }
  void twoshot(const TeamState& rank, const RowCall& call, DType dtype,
               const RowEpilogueKind& epilogue, Stream stream) const override {
    const SyclTeamState& team = sycl_state(rank);
    const sycl::kernel& kernel = row_kernel(*team.kernels, dtype, epilogue, "two-shot");
    remember(team, submit(rank_queue(team, stream), kernel, team.kernels->group_size,
                          row_params(call, false, true, team.bound), "two-shot"));
  }
  void nccl_path(const TeamState&, const RowCall&, DType, const RowEpilogueKind&,
                 Stream) const override {
    TPF_FAIL("the SYCL backend has no NCCL path");
  }
  void local_epilogue(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue,
                      Stream stream) const override {
    sycl::queue& queue = *queue_of(stream);  // validate_call: a local call has one
    if (epilogue.quant && call.norm_out == nullptr && call.residual_out == nullptr) {
      TPF_FAIL(
          "add_rmsnorm: the SYCL backend's local FP8 output needs norm_out or residual_out "
          "(where the row is staged) yet");
    }
    const SyclKernels& kernels = sycl_kernels(queue.get_context(), queue.get_device());
    submit(queue, row_kernel(kernels, dtype, epilogue, "add_rmsnorm"), kernels.group_size,
           row_params(call, true, false, 0), "add_rmsnorm");
  }

  // The QK norm (qknorm.h). Its positions are not read on the host (device memory, which the
  // host cannot read without waiting): the kernel bounds them, making that token's outputs NaN,
  // and Team::check reports the token, as on the GPU.
  void qk_oneshot(const TeamState& rank, const QkCall& call, DType dtype,
                  Stream stream) const override {
    const SyclTeamState& team = sycl_state(rank);
    remember(team, submit(rank_queue(team, stream), team.kernels->qk[size_t(dtype)],
                          team.kernels->group_size, qk_params(call, kSyclQkFused, team.bound),
                          "allreduce_qk_rmsnorm"));
  }
  void qk_nccl_path(const TeamState&, const QkCall&, DType, Stream) const override {
    TPF_FAIL("the SYCL backend has no NCCL path");
  }
  // A local pass checks the memory it reads and writes itself (the core checks only the queue of
  // a local call): USM of the queue's context.
  void qk_local(const QkCall& call, DType dtype, QkPass pass, Stream stream) const override {
    const bool sums = pass == QkPass::kSums;
    const char* op = sums ? "qk_sum_squares" : "qk_rmsnorm_from_sums";
    const bool rope = !sums && call.rope != RopeStyle::kNone;
    validate_call(nullptr,
                  {{"qkv", call.qkv},
                   {"sums", call.sums},
                   {"q_out", sums ? nullptr : call.q_out},
                   {"k_out", sums ? nullptr : call.k_out},
                   {"q_gamma", sums ? nullptr : call.q_gamma},
                   {"k_gamma", sums ? nullptr : call.k_gamma},
                   {"positions", rope ? call.positions : nullptr},
                   {"cos_sin_cache", rope ? call.cos_sin_cache : nullptr}},
                  stream, op);
    sycl::queue& queue = *queue_of(stream);
    const SyclKernels& kernels = sycl_kernels(queue.get_context(), queue.get_device());
    submit(queue, kernels.qk[size_t(dtype)], kernels.group_size,
           qk_params(call, sums ? kSyclQkSums : kSyclQkNormFromSums, 0), op);
  }

  void absent_call(const TeamState& rank, const CallSignature& signature,
                   Stream stream) const override {
    const SyclTeamState& team = sycl_state(rank);
    remember(team, submit(rank_queue(team, stream), *team.kernels->absent, team.kernels->group_size,
                          SyclAbsentCall{rank.exchange, signature, team.bound}, "an absent call"));
  }
  void nccl_turn(const TeamState&, const CallSignature&, size_t, DType, Stream) const override {
    TPF_FAIL("the SYCL backend has no NCCL path");
  }
  bool has_nccl_path(const TeamState&) const override { return false; }
  bool nccl_path_takes_turns() const override { return false; }

  Stream rank_stream(const TeamState& rank, Stream stream) const override {
    return stream.handle != nullptr ? stream : Stream{&*sycl_state(rank).queue};
  }

  // Waits for the rank's last call (whichever queue it went to; a team of one rank, whose calls
  // run the local kernel: the rank's own queue too), then reports.
  void check(const TeamState& rank) const override {
    const SyclTeamState& team = sycl_state(rank);
    std::optional<sycl::event> last;
    {
      std::lock_guard<std::mutex> lock(team.mutex);
      last = team.last;
    }
    try {
      if (rank.world_size() == 1) team.queue->wait_and_throw();
      if (last) last->wait_and_throw();
    } catch (const sycl::exception& error) {
      TPF_FAIL("rank " << rank.rank() << ": a call failed in the SYCL runtime: " << error.what());
    }
    report_call_errors(rank);
  }
};

}  // namespace

const BackendOps& sycl_backend() {
  static const SyclBackend backend;
  return backend;
}

const BackendOps* sycl_backend_ops() {
  return &sycl_backend();
}

}  // namespace impl
}  // namespace tpfuse
