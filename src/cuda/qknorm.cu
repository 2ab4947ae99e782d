// The QK-norm launchers: each binds a call's dtype to the kernels of that dtype (QkKernels,
// qknorm.cuh), compiled in a translation unit of their own.
#include <cuda_runtime.h>

#include "core/calls.h"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"
#include "tpfuse/impl/dispatch.h"

namespace tpfuse::impl {

void cuda_qk_rmsnorm(const TeamState& team, const QkCall& params, DType dtype,
                     cudaStream_t stream) {
  if (team_failed(team)) cuda_check(team);
  DeviceGuard guard(team.device);
  dispatch_dtype(dtype, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    QkKernels<T>::launch_fused(team, params, stream);
  });
}

void cuda_preload_qk_kernels(int world_size) {
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    dispatch_dtype(dtype, [&](auto type_tag) {
      using T = typename decltype(type_tag)::type;
      QkKernels<T>::preload_kernels(world_size);
    });
  }
}

void cuda_qk_local(const QkCall& params, DType dtype, QkPass pass, cudaStream_t stream) {
  dispatch_dtype(dtype, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    QkKernels<T>::launch_local(params, pass, stream);
  });
}

}  // namespace tpfuse::impl
