// The launchers of the row collectives, one-shot (oneshot.cuh) and two-shot (twoshot.cuh): each
// binds a call's epilogue to the shard that holds its instantiations (row_launch.cuh), where the
// kernels are compiled.
#include <cuda_runtime.h>

#include "core/calls.h"
#include "cuda/kernels.h"
#include "cuda/row_launch.cuh"
#include "tpfuse/impl/epilogue.h"

namespace tpfuse::impl {

void cuda_oneshot(const TeamState& team, const RowCall& call, DType dtype,
                  const RowEpilogueKind& epilogue, cudaStream_t stream) {
  launch_row_collective<OneShotKernel>(team, call, dtype, epilogue, stream);
}

void cuda_twoshot(const TeamState& team, const RowCall& call, DType dtype,
                  const RowEpilogueKind& epilogue, cudaStream_t stream) {
  launch_row_collective<TwoShotKernel>(team, call, dtype, epilogue, stream);
}

void cuda_preload_oneshot_kernels(int world_size) {
  preload_row_collective<OneShotKernel>(world_size);
}

void cuda_preload_twoshot_kernels(int world_size) {
  preload_row_collective<TwoShotKernel>(world_size);
}

}  // namespace tpfuse::impl
