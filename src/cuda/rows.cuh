// Row-level device helpers of the add-RMSNorm kernels (one-shot, two-shot, local): a block holds
// one token row, each thread kVecsPerThread 16-byte vectors of it in registers (vector i of
// thread t is element vector t + i * blockDim.x of the row).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/team_state.h"
#include "cuda/device_ops.cuh"
#include "cuda/launch.cuh"
#include "tpfuse/impl/dispatch.h"
#include "tpfuse/impl/epilogue.h"

namespace tpfuse::impl {

template <int kVecsPerThread>
__device__ __forceinline__ bool owns(int i, int64_t vectors) {
  return threadIdx.x + int64_t(i) * blockDim.x < vectors;
}
__device__ __forceinline__ int64_t owned(int i) {
  return threadIdx.x + int64_t(i) * blockDim.x;
}

// Loads this thread's vectors of row `row` of `base` (nothing where the thread owns none).
template <int kVecsPerThread>
__device__ __forceinline__ void load_row(const void* base, int64_t row, int64_t vectors,
                                         Vec16 (&out)[kVecsPerThread]) {
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    if (owns<kVecsPerThread>(i, vectors)) out[i] = load_vector(base, row + owned(i));
  }
}

// The start of a one-shot or two-shot call, after griddepcontrol.wait: thread 0 reads the control
// block while every thread loads its block's first input row (the two latencies overlap); the
// barrier gives every thread what thread 0 read.
template <int kVecsPerThread>
__device__ __forceinline__ CallState begin_call(const ControlBlock* control, const void* input,
                                                int64_t vectors, Vec16 (&row)[kVecsPerThread]) {
  __shared__ CallState shared_state;
  if (threadIdx.x == 0) shared_state = read_call_state(control);
  load_row<kVecsPerThread>(input, int64_t(blockIdx.x) * vectors, vectors, row);
  __syncthreads();
  return shared_state;
}

// Sums this thread's vectors of a row over the `world` ranks in rank order in fp32: the peers'
// packets polled at `address` (vector index 0 of the row) in sender regions `sender_stride`
// bytes apart, this rank's own contribution (sentinel words rewritten as a peer receives them)
// from `own_row` (registers) when `own_in_registers`, else from `own` (its input row in memory):
// a rank's own rows never go through its slot.
template <typename T, int kWorldSize, int kVecsPerThread>
__device__ __forceinline__ void receive_row(float (&acc)[kVecsPerThread][Packed<T>::kElements],
                                            const Vec16* address, size_t sender_stride,
                                            const Vec16* own,
                                            const Vec16 (&own_row)[kVecsPerThread],
                                            bool own_in_registers, int world, int64_t vectors,
                                            const OneShotParams& p) {
  ControlBlock* const control = p.control;
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    if (!owns<kVecsPerThread>(i, vectors)) continue;
    const auto own_vector = [&] {
      return rewrite_sentinel(own_in_registers ? own_row[i] : load_vector(own, owned(i)));
    };
    const Vec16* vector = address + owned(i);
    const auto sender_address = [&](int r) {
      return reinterpret_cast<const Vec16*>(reinterpret_cast<const char*>(vector) +
                                            r * sender_stride);
    };
    if constexpr (kWorldSize > 0) {
      // All W loads in flight before the first use.
      Vec16 packets[kWorldSize];
#pragma unroll
      for (int r = 0; r < kWorldSize; ++r) {
        packets[r] = r == p.rank ? own_vector() : load_packet(sender_address(r));
      }
#pragma unroll
      for (int r = 0; r < kWorldSize; ++r) {
        if (!has_arrived(packets[r])) {
          packets[r] =
              wait_for_packet(sender_address(r), p.timeout_ns, &control->error, p.error_flag, r);
        }
      }
      accumulate_first<T>(acc[i], packets[0]);
#pragma unroll
      for (int r = 1; r < kWorldSize; ++r) accumulate<T>(acc[i], packets[r]);
    } else {
      for (int r = 0; r < world; ++r) {
        Vec16 packet = r == p.rank ? own_vector() : load_packet(sender_address(r));
        if (!has_arrived(packet)) {
          packet =
              wait_for_packet(sender_address(r), p.timeout_ns, &control->error, p.error_flag, r);
        }
        if (r == 0) {
          accumulate_first<T>(acc[i], packet);
        } else {
          accumulate<T>(acc[i], packet);
        }
      }
    }
  }
}

// The epilogue for one token row whose fp32 rank sum each thread holds in `acc`; the residual
// and gamma vectors were loaded earlier, while the packets were in flight. on_rounded(i, vector)
// sees each rounded output vector (residual_out's, or out's for kSum): the two-shot owner sends
// it to its peers there.
template <typename T, int kVecsPerThread, Epilogue kEpilogue, typename OnRounded>
__device__ __forceinline__ void finish_row(float (&acc)[kVecsPerThread][Packed<T>::kElements],
                                           const Vec16 (&residual)[kVecsPerThread],
                                           const Vec16 (&gamma)[kVecsPerThread],
                                           const OneShotParams& p, int64_t token, int64_t vectors,
                                           float* shared_sums, OnRounded&& on_rounded) {
  const int64_t row = token * vectors;
  if constexpr (kEpilogue == Epilogue::kSum) {
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      if (owns<kVecsPerThread>(i, vectors)) {
        const Vec16 out = round_output<T>(acc[i]);
        store_vector(p.norm_out, row + owned(i), out);
        on_rounded(i, out);
      }
    }
  } else {
    constexpr bool kHasResidual = kEpilogue == Epilogue::kAddRmsNorm;
    float sum_squares = 0.0f;
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      if (owns<kVecsPerThread>(i, vectors)) {
        const Vec16 rounded = residual_round<T, kHasResidual>(acc[i], residual[i], sum_squares);
        if (p.residual_out != nullptr) store_vector(p.residual_out, row + owned(i), rounded);
        on_rounded(i, rounded);
      }
    }
    const float scale = rms_scale(block_sum(sum_squares, shared_sums), p.hidden, p.eps);
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      if (owns<kVecsPerThread>(i, vectors)) {
        store_vector(p.norm_out, row + owned(i), normalize<T>(acc[i], gamma[i], scale));
      }
    }
  }
}

struct NoSend {
  __device__ __forceinline__ void operator()(int, const Vec16&) const {}
};

// The grid of a collective kernel: at most what is resident at once (its blocks poll for
// packets that other blocks of the peers' grids send), at most `work` blocks.
template <typename Kernel>
int collective_blocks(const TeamState& team, Kernel kernel, int threads, int64_t work) {
  const int resident =
      team.multiprocessors * resident_blocks_per_multiprocessor(kernel, threads, 0);
  return int(std::max<int64_t>(1, std::min<int64_t>(work, resident)));
}

template <typename Fn>
void dispatch_epilogue(Epilogue epilogue, Fn&& fn) {
  switch (epilogue) {
    case Epilogue::kSum:
      return fn(std::integral_constant<Epilogue, Epilogue::kSum>{});
    case Epilogue::kRmsNorm:
      return fn(std::integral_constant<Epilogue, Epilogue::kRmsNorm>{});
    case Epilogue::kAddRmsNorm:
      return fn(std::integral_constant<Epilogue, Epilogue::kAddRmsNorm>{});
  }
}

// The compile-time parameters of one row kernel instantiation.
template <typename Type, int kWorldSize, Epilogue kEpilogueValue, int kVecsValue>
struct RowKernelTag {
  using T = Type;
  static constexpr int kWorld = kWorldSize;
  static constexpr Epilogue kEpilogue = kEpilogueValue;
  static constexpr int kVecs = kVecsValue;
};

// Whether a row kernel with kVecs vectors per thread exists for elements of `element_size` bytes
// (launch_shape never picks a shape a narrower one would do).
constexpr bool row_shape_exists(size_t element_size, int vecs) {
  return !(vecs > 1 && int64_t(vecs / 2) * int64_t(16 / element_size) * kMaxThreads >= kMaxHidden);
}

// Calls fn(dtype, epilogue, shape) for every row kernel instantiation of a world size.
template <typename Fn>
void for_each_row_kernel(Fn&& fn) {
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (Epilogue epilogue : {Epilogue::kSum, Epilogue::kRmsNorm, Epilogue::kAddRmsNorm}) {
      for (int vecs : {1, 2, 4, 8}) {
        if (row_shape_exists(dtype_size(dtype), vecs)) fn(dtype, epilogue, LaunchShape{vecs, 32});
      }
    }
  }
}

// Binds dtype, world size, epilogue and vectors per thread, and calls fn(RowKernelTag<...>{}).
// Shapes launch_shape never picks (a narrower one would do) are not instantiated.
template <typename Fn>
void dispatch_row_kernel(DType dtype, int world_size, Epilogue epilogue, const LaunchShape& shape,
                         Fn&& fn) {
  dispatch_dtype(dtype, [&](auto type_tag) {
    // std::decay_t: inside nested generic lambdas of a template, g++ sees a captured tag's
    // decltype as a reference.
    using T = typename std::decay_t<decltype(type_tag)>::type;
    dispatch_world_size(world_size, [&](auto world_tag) {
      constexpr int kWorld = std::decay_t<decltype(world_tag)>::value;
      dispatch_epilogue(epilogue, [&](auto epilogue_tag) {
        constexpr Epilogue kEpilogue = std::decay_t<decltype(epilogue_tag)>::value;
        dispatch_vecs(shape.vecs_per_thread, [&](auto vecs_tag) {
          constexpr int kVecs = std::decay_t<decltype(vecs_tag)>::value;
          if constexpr (kVecs > 1 &&
                        (kVecs / 2) * Packed<T>::kElements * kMaxThreads >= kMaxHidden) {
            TPF_FAIL("no launch shape with " << kVecs << " vectors per thread");  // never chosen
          } else {
            fn(RowKernelTag<T, kWorld, kEpilogue, kVecs>{});
          }
        });
      });
    });
  });
}

// Launches a call of a row collective (one-shot or two-shot): kernel_of(RowKernelTag) names the
// instantiation; the team's earlier failure is reported first, the grid is all resident.
template <typename KernelOf>
void launch_row_collective(const TeamState& team, const OneShotParams& params, DType dtype,
                           Epilogue epilogue, cudaStream_t stream, KernelOf&& kernel_of) {
  if (*reinterpret_cast<volatile uint32_t*>(team.error_flag) != 0) cuda_check(team);
  DeviceGuard guard(team.device);
  const LaunchShape shape = launch_shape(params.hidden, dtype_size(dtype));
  dispatch_row_kernel(dtype, params.world_size, epilogue, shape, [&](auto kernel_tag) {
    const auto kernel = kernel_of(kernel_tag);
    launch(kernel, collective_blocks(team, kernel, shape.threads, params.tokens), shape.threads, 0,
           stream, params);
  });
}

}  // namespace tpfuse::impl
