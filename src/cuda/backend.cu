// The CUDA backend's BackendOps: per-call checks of devices and streams, the fused kernels, and
// the NCCL path (ncclAllReduce through cuda/team_state.h's NcclSupport, then the local kernels).
// A call's Stream is the cudaStream_t it carries (cuda_stream_of).
#include <cuda_runtime.h>

#include <string>

#include "core/backend.h"
#include "cuda/check.h"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"
#include "cuda/team_state.h"

namespace tpfuse::impl {

void cuda_check(const TeamState& team) {
  int previous = 0;
  TPF_CHECK_CUDA(cudaGetDevice(&previous));
  TPF_CHECK_CUDA(cudaSetDevice(team.device));
  const cudaError_t status = cudaDeviceSynchronize();
  cudaSetDevice(previous);
  TPF_CHECK_CUDA(status);
  report_call_errors(team);
}

void cuda_preload_kernels(int world_size) {
  cuda_preload_oneshot_kernels(world_size);
  cuda_preload_twoshot_kernels(world_size);
  cuda_preload_local_kernels();
  cuda_preload_qk_kernels(world_size);
  cuda_preload_absent_kernel();
  cuda_preload_nccl_header_kernels();
}

namespace {

const NcclSupport& nccl_of(const CudaTeamState& team, const char* op) {
  if (nccl_support() == nullptr || team.nccl_comm == nullptr) {
    TPF_FAIL(op << ": the NCCL path needs NCCL, which this build or team does not have");
  }
  return *nccl_support();
}

// Device memory for one call, in the stream's order: freed on the stream when the call's work
// is queued (or when queuing it throws).
class StreamScratch {
 public:
  StreamScratch() = default;
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  ~StreamScratch() {
    if (pointer_ != nullptr) cudaFreeAsync(pointer_, stream_);  // nothing to report it to
  }
  void* allocate(size_t bytes, cudaStream_t stream) {
    TPF_CHECK_CUDA(cudaMallocAsync(&pointer_, bytes, stream));
    stream_ = stream;
    return pointer_;
  }

 private:
  void* pointer_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

class CudaBackend final : public BackendOps {
 public:
  Backend kind() const override { return Backend::kCuda; }

  // Local calls (no team) are not checked here: they run on whatever device is current.
  void validate_call(const TeamState* team, std::initializer_list<NamedPointer> pointers,
                     Stream queue, const char* op) const override {
    if (team == nullptr) return;
    const cudaStream_t stream = cuda_stream_of(queue);
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (stream != nullptr) TPF_CHECK_CUDA(cudaStreamIsCapturing(stream, &capture));
    // A capturing stream cannot be asked its device; the launch onto it (made on the team's
    // device) fails with a CUDA error if the stream belongs to another device.
    if (stream != nullptr && capture == cudaStreamCaptureStatusNone) {
      int stream_device = -1;
      TPF_CHECK_CUDA(cudaStreamGetDevice(stream, &stream_device));
      TPF_CHECK_ARG(stream_device == team->device, op,
                    "stream belongs to device " << stream_device << " but team rank "
                                                << team->rank() << " is on device "
                                                << team->device);
    }
    for (const NamedPointer& argument : pointers) {
      if (argument.pointer == nullptr) continue;
      cudaPointerAttributes attributes{};
      TPF_CHECK_CUDA(cudaPointerGetAttributes(&attributes, argument.pointer));
      const bool device_memory =
          attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
      TPF_CHECK_ARG(
          device_memory &&
              (attributes.type == cudaMemoryTypeManaged || attributes.device == team->device),
          op,
          argument.name << " must be device memory on device " << team->device << " (rank "
                        << team->rank() << "), got "
                        << (device_memory ? "memory of device " + std::to_string(attributes.device)
                                          : std::string("host memory")));
    }
  }

  // The QK norm's NCCL path sums into the team's scratch of packet_bytes (CudaTeamState::qk_sums).
  void validate_qk(const TeamState* team, const QkNormArgs& args, Algorithm algorithm,
                   const char* op) const override {
    if (team == nullptr || algorithm != Algorithm::kNccl) return;
    if (cuda_state(*team).qk_sums == nullptr) return;
    TPF_CHECK_ARG(size_t(args.tokens) * 8 <= team->packet_bytes(), op,
                  "tokens " << args.tokens << " need " << size_t(args.tokens) * 8
                            << " bytes of sums, over the team's NCCL scratch of "
                            << team->packet_bytes());
  }

  void oneshot(const TeamState& team, const RowCall& call, DType dtype,
               const RowEpilogueKind& epilogue, Stream stream) const override {
    cuda_oneshot(team, call, dtype, epilogue, cuda_stream_of(stream));
  }
  void twoshot(const TeamState& team, const RowCall& call, DType dtype,
               const RowEpilogueKind& epilogue, Stream stream) const override {
    cuda_twoshot(team, call, dtype, epilogue, cuda_stream_of(stream));
  }

  void nccl_path(const TeamState& rank, const RowCall& call, DType dtype,
                 const RowEpilogueKind& epilogue, Stream queue) const override {
    const CudaTeamState& team = cuda_state(rank);
    const cudaStream_t stream = cuda_stream_of(queue);
    const NcclSupport& nccl = nccl_of(team, "allreduce_add_rmsnorm");
    DeviceGuard guard(team.device);
    const size_t count = size_t(call.tokens) * size_t(call.hidden);
    // The call's header beside its data (nccl_headers.cu), checked after the call's work.
    cuda_nccl_headers(team, call.signature, stream);
    const auto allreduce = [&](const void* input, void* out) {
      nccl.allreduce_headed(team.nccl_comm, team.nccl_headers, team.world_size(), input, out, count,
                            dtype, stream);
    };
    if (!epilogue.norm) {
      allreduce(call.input, call.norm_out);
      cuda_nccl_check(team, outputs_of(call, dtype, epilogue), stream);
      return;
    }
    // The sum lands in an output that is not the residual (outputs coincide with an input or are
    // disjoint from it, and residual_out != norm_out), then the local epilogue reads it from
    // there: each thread reads its vectors of a row before it writes them. An FP8 call without
    // the bf16 norm whose residual_out is the residual has no such output: its sum goes to
    // stream-ordered scratch (allocated within a CUDA graph when captured).
    const auto apart_from_residual = [&](void* out) {
      return out != nullptr && out != call.residual ? out : nullptr;
    };
    void* sum = apart_from_residual(call.norm_out);
    if (sum == nullptr) sum = apart_from_residual(call.residual_out);
    StreamScratch scratch;
    if (sum == nullptr) sum = scratch.allocate(count * dtype_size(dtype), stream);
    RowEpilogueKind local_epilogue = epilogue;
    if (epilogue.moe) {
      // The MoE combine (a kernel of its own) is this rank's contribution, summed in place.
      cuda_moe_combine(call, dtype, epilogue, sum, stream);
      allreduce(sum, sum);
      local_epilogue.moe = false;
    } else {
      allreduce(call.input, sum);
    }
    RowCall local = call;
    local.input = sum;
    cuda_local_epilogue(local, dtype, local_epilogue, stream);
    cuda_nccl_check(team, outputs_of(call, dtype, epilogue), stream);
  }

  void local_epilogue(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue,
                      Stream stream) const override {
    cuda_local_epilogue(call, dtype, epilogue, cuda_stream_of(stream));
  }

  void qk_oneshot(const TeamState& team, const QkCall& call, DType dtype,
                  Stream stream) const override {
    cuda_qk_rmsnorm(team, call, dtype, cuda_stream_of(stream));
  }

  void qk_nccl_path(const TeamState& rank, const QkCall& call, DType dtype,
                    Stream queue) const override {
    const CudaTeamState& team = cuda_state(rank);
    const cudaStream_t stream = cuda_stream_of(queue);
    const NcclSupport& nccl = nccl_of(team, "allreduce_qk_rmsnorm");
    DeviceGuard guard(team.device);
    QkCall pass = call;
    pass.sums = team.qk_sums;
    cuda_nccl_headers(team, call.signature, stream);
    cuda_qk_local(pass, dtype, QkPass::kSums, stream);
    nccl.allreduce_headed(team.nccl_comm, team.nccl_headers, team.world_size(), pass.sums,
                          pass.sums, size_t(2 * call.tokens), DType::kFloat32, stream);
    cuda_qk_local(pass, dtype, QkPass::kNormFromSums, stream);
    cuda_nccl_check(team, outputs_of(call, dtype), stream);
  }

  void nccl_turn(const TeamState& rank, const CallSignature& signature, size_t count, DType dtype,
                 Stream queue) const override {
    const CudaTeamState& team = cuda_state(rank);
    const cudaStream_t stream = cuda_stream_of(queue);
    const NcclSupport& nccl = nccl_of(team, "a rejected call's turn");
    DeviceGuard guard(team.device);
    cuda_nccl_headers(team, signature, stream);
    // What the data is does not matter: the header tells the peers the call has none.
    StreamScratch scratch;
    void* data = scratch.allocate(count * dtype_size(dtype), stream);
    nccl.allreduce_headed(team.nccl_comm, team.nccl_headers, team.world_size(), data, data, count,
                          dtype, stream);
  }

  void qk_local(const QkCall& call, DType dtype, QkPass pass, Stream stream) const override {
    cuda_qk_local(call, dtype, pass, cuda_stream_of(stream));
  }

  void absent_call(const TeamState& team, const CallSignature& signature,
                   Stream stream) const override {
    cuda_absent_call(team, signature, cuda_stream_of(stream));
  }

  bool has_nccl_path(const TeamState& team) const override {
    return cuda_state(team).nccl_comm != nullptr;
  }
  bool nccl_path_takes_turns() const override { return false; }

  void check(const TeamState& team) const override { cuda_check(team); }
};

}  // namespace

const BackendOps& cuda_backend() {
  static const CudaBackend backend;
  return backend;
}

const BackendOps* cuda_backend_ops() {
  return &cuda_backend();
}

}  // namespace tpfuse::impl
