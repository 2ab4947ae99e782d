// Host side of the row kernels (one-shot, two-shot, local): which instantiations exist, how a
// call binds one, and how a collective is launched.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/calls.h"
#include "core/error.h"
#include "core/team_state.h"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"
#include "tpfuse/impl/dispatch.h"
#include "tpfuse/impl/epilogue.h"

namespace tpfuse::impl {

// The grid of a collective kernel: at most what is resident at once (its blocks poll for
// packets that other blocks of the peers' grids send), at most `work` blocks.
template <typename Kernel>
int collective_blocks(const TeamState& team, Kernel kernel, int threads, int64_t work) {
  const int resident =
      team.multiprocessors * resident_blocks_per_multiprocessor(kernel, threads, 0);
  return int(std::max<int64_t>(1, std::min<int64_t>(work, resident)));
}

// The compile-time parameters of one row kernel instantiation.
template <typename Type, int kWorldSize, typename EpilogueType, int kVecsValue>
struct RowKernelTag {
  using T = Type;
  using Epilogue = EpilogueType;
  static constexpr int kWorld = kWorldSize;
  static constexpr int kVecs = kVecsValue;
};

// Whether a row kernel with `vecs` vectors per thread exists for elements of `element_size`
// bytes (launch_shape never picks a shape a narrower one would do).
constexpr bool row_shape_exists(size_t element_size, int vecs) {
  return !(vecs > 1 && int64_t(vecs / 2) * int64_t(16 / element_size) * kMaxThreads >= kMaxHidden);
}

// Binds dtype, world size, epilogue and vectors per thread, and calls fn(RowKernelTag<...>{}).
// Shapes launch_shape never picks are not instantiated.
template <typename Fn>
void dispatch_row_kernel(DType dtype, int world_size, const RowEpilogueKind& epilogue,
                         const LaunchShape& shape, Fn&& fn) {
  dispatch_dtype(dtype, [&](auto type_tag) {
    // std::decay_t: inside nested generic lambdas of a template, g++ sees a captured tag's
    // decltype as a reference.
    using T = typename std::decay_t<decltype(type_tag)>::type;
    dispatch_world_size(world_size, [&](auto world_tag) {
      constexpr int kWorld = std::decay_t<decltype(world_tag)>::value;
      const bool found = dispatch_epilogue_in(RowEpilogues{}, epilogue, [&](auto epilogue_tag) {
        using Epilogue = std::decay_t<decltype(epilogue_tag)>;
        dispatch_vecs(shape.vecs_per_thread, [&](auto vecs_tag) {
          constexpr int kVecs = std::decay_t<decltype(vecs_tag)>::value;
          if constexpr (!row_shape_exists(sizeof(T), kVecs)) {
            TPF_FAIL("no launch shape with " << kVecs << " vectors per thread");  // never chosen
          } else {
            fn(RowKernelTag<T, kWorld, Epilogue, kVecs>{});
          }
        });
      });
      if (!found) TPF_FAIL("no row epilogue for this combination");  // validate_* rule it out
    });
  });
}

// Calls fn(RowKernelTag<...>{}) for every row kernel instantiation of a world size.
template <typename Fn>
void for_each_row_kernel(int world_size, Fn&& fn) {
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for_each_epilogue_in(RowEpilogues{}, [&](auto epilogue_tag) {
      for (int vecs : {1, 2, 4, 8}) {
        if (!row_shape_exists(dtype_size(dtype), vecs)) continue;
        dispatch_row_kernel(dtype, world_size, decltype(epilogue_tag)::kKind, LaunchShape{vecs, 32},
                            fn);
      }
    });
  }
}

// Launches a call of a row collective (one-shot or two-shot): kernel_of(RowKernelTag) names the
// instantiation; the team's earlier failure is reported first, the grid is all resident.
template <typename KernelOf>
void launch_row_collective(const TeamState& team, const RowCall& call, DType dtype,
                           const RowEpilogueKind& epilogue, cudaStream_t stream,
                           KernelOf&& kernel_of) {
  if (team_failed(team)) cuda_check(team);
  DeviceGuard guard(team.device);
  const LaunchShape shape = launch_shape(call.hidden, dtype_size(dtype));
  dispatch_row_kernel(dtype, team.world_size(), epilogue, shape, [&](auto kernel_tag) {
    const auto kernel = kernel_of(kernel_tag);
    launch(kernel, collective_blocks(team, kernel, shape.threads, call.tokens), shape.threads, 0,
           stream, call);
  });
}

}  // namespace tpfuse::impl
