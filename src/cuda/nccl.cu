// Everything the CUDA backend takes from NCCL, behind cuda/team_state.h's NcclSupport: the
// all-reduce of the NCCL path and the communicators of in-process teams. (Multi-process teams and
// the bootstrap id: src/cuda/team/nccl_team.cu.)
#include <cuda_runtime.h>
#include <nccl.h>

#include <vector>

#include "cuda/check.h"
#include "cuda/nccl_types.h"
#include "cuda/team_state.h"

namespace tpfuse::impl {
namespace {

class Nccl final : public NcclSupport {
 public:
  void allreduce(void* comm, const void* input, void* out, size_t count, DType dtype,
                 cudaStream_t stream) const override {
    TPF_CHECK_NCCL(ncclAllReduce(input, out, count, nccl_type(dtype), ncclSum,
                                 static_cast<ncclComm_t>(comm), stream));
  }

  void allreduce_headed(void* comm, void* headers, int world, const void* input, void* out,
                        size_t count, DType dtype, cudaStream_t stream) const override {
    const ncclComm_t nccl = static_cast<ncclComm_t>(comm);
    TPF_CHECK_NCCL(ncclGroupStart());
    const ncclResult_t header_result =
        ncclAllReduce(headers, headers, size_t(world) * 4, ncclUint32, ncclSum, nccl, stream);
    const ncclResult_t data_result =
        ncclAllReduce(input, out, count, nccl_type(dtype), ncclSum, nccl, stream);
    // The group is closed whatever its calls said, so that NCCL is left with no open group.
    const ncclResult_t end_result = ncclGroupEnd();
    TPF_CHECK_NCCL(header_result);
    TPF_CHECK_NCCL(data_result);
    TPF_CHECK_NCCL(end_result);
  }

  std::vector<void*> in_process_comms(const std::vector<int>& devices) const override {
    std::vector<ncclComm_t> comms(devices.size());
    TPF_CHECK_NCCL(ncclCommInitAll(comms.data(), int(devices.size()), devices.data()));
    // One grouped all-reduce now: NCCL connects its ranks lazily, in the first collective, and a
    // first collective made rank by rank from one host thread would wait forever for the others.
    std::vector<float*> scratch(devices.size());
    int previous = 0;
    TPF_CHECK_CUDA(cudaGetDevice(&previous));
    for (size_t r = 0; r < devices.size(); ++r) {
      TPF_CHECK_CUDA(cudaSetDevice(devices[r]));
      TPF_CHECK_CUDA(cudaMalloc(&scratch[r], 64));
    }
    TPF_CHECK_NCCL(ncclGroupStart());
    for (size_t r = 0; r < devices.size(); ++r) {
      TPF_CHECK_NCCL(
          ncclAllReduce(scratch[r], scratch[r], 16, ncclFloat32, ncclSum, comms[r], nullptr));
    }
    TPF_CHECK_NCCL(ncclGroupEnd());
    for (size_t r = 0; r < devices.size(); ++r) {
      TPF_CHECK_CUDA(cudaSetDevice(devices[r]));
      TPF_CHECK_CUDA(cudaDeviceSynchronize());
      TPF_CHECK_CUDA(cudaFree(scratch[r]));
    }
    TPF_CHECK_CUDA(cudaSetDevice(previous));
    return std::vector<void*>(comms.begin(), comms.end());
  }

  void destroy_comms(std::vector<void*>& comms) const override {
    for (void* comm : comms) ncclCommDestroy(static_cast<ncclComm_t>(comm));
    comms.clear();
  }
};

}  // namespace

const NcclSupport* nccl_support() {
  static const Nccl nccl;
  return &nccl;
}

}  // namespace tpfuse::impl
