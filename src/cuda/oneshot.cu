// The Lamport one-shot fused all-reduce kernel and the local fused add + RMSNorm kernel.
//
// Protocol: tpfuse/impl/lamport.h tells what is stored where and why no barrier is needed.
// This kernel, one launch per call and rank:
//
//   [before griddepcontrol.wait]  nothing that reads or writes memory: only registers from the
//                                 kernel parameters. The previous kernel in the stream (another
//                                 tpfuse call, or whatever wrote our inputs) may still run.
//   [after the wait]              the previous grid has completed and its writes are visible.
//   1. thread 0 reads the slot index s = k%3 and the bytes slot (k+2)%3 last received.
//   2. send: each block stores its tokens' packets (input, sentinel rewritten) into slot k%3,
//      sender index `rank`, of every rank's workspace.
//   3. arrival: thread 0 counts its block in; the last block to arrive resets the count and
//      advances the slot index (every block has read it by then), and records this call's
//      packet bytes for slot k%3, so call k+1 knows what to clear.
//   4. launch_dependents: the next kernel may be scheduled now. It cannot disturb us: every
//      tpfuse kernel waits (griddepcontrol.wait waits for this whole grid to complete and
//      flush) before it touches the slot index or any slot. And since the trigger takes effect only
//      once every block of this grid has issued it, all our blocks are resident before a
//      dependent can take SM space: the co-residency the cross-rank polling needs.
//   5. clear: slot (k+2)%3 of this rank (what call k-1 read) is re-filled with the sentinel.
//   6. receive: each block polls its tokens' vectors in this rank's slot k%3 for every sender,
//      sums them in rank order 0..W-1 in fp32, and runs the epilogue.
//
// Grid: no more blocks than can be resident together (occupancy, at most 4 per multiprocessor),
// so every block of the grid is resident at once;
// a block that polls for a peer's packet never waits on one of its own grid's blocks that has
// not started. Block: one token row at a time, each thread holding kVecsPerThread 16-byte
// vectors of it in registers (at most kMaxThreads threads).
//
// Bitwise identity across ranks: every rank sums the same packets (after the sentinel rewrite)
// in the same order with the same launch shape (grid and block depend only on tokens, hidden and
// the device's SM count), so the epilogue's block reduction sees the same values in the same
// order. This holds between ranks on GPUs of the same model; the CPU backend reduces the row in
// another order and may differ from the GPU in the last bit of the norm.
#include <cuda_runtime.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <utility>

#include "common/error.h"
#include "common/team_state.h"
#include "cuda/device_ops.cuh"
#include "cuda/launch.cuh"
#include "tpfuse/impl/dispatch.h"
#include "tpfuse/impl/epilogue.h"

namespace tpfuse::impl {
namespace {

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

// The epilogue for one token row whose fp32 rank sum each thread holds in `acc`; the residual
// and gamma vectors were loaded earlier, while the packets were in flight.
template <typename T, int kVecsPerThread, Epilogue kEpilogue>
__device__ __forceinline__ void finish_row(float (&acc)[kVecsPerThread][Packed<T>::kElements],
                                           const Vec16 (&residual)[kVecsPerThread],
                                           const Vec16 (&gamma)[kVecsPerThread],
                                           const OneShotParams& p, int64_t token, int64_t vectors,
                                           float* shared_sums) {
  const int64_t row = token * vectors;
  if constexpr (kEpilogue == Epilogue::kSum) {
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      if (owns<kVecsPerThread>(i, vectors)) {
        store_vector(p.norm_out, row + owned(i), pack<T>(acc[i]));
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

template <typename T, int kWorldSize, Epilogue kEpilogue, int kVecsPerThread>
__global__ void __launch_bounds__(kMaxThreads) oneshot_kernel(const OneShotParams p) {
  constexpr int kElements = Packed<T>::kElements;
  constexpr bool kNorm = kEpilogue != Epilogue::kSum;
  constexpr bool kHasResidual = kEpilogue == Epilogue::kAddRmsNorm;
  ControlBlock* const control = p.control;
  const int world = kWorldSize > 0 ? kWorldSize : p.world_size;
  const int64_t vectors = p.hidden / kElements;
  __shared__ float shared_sums[33];
  __shared__ uint32_t shared_slot;
  __shared__ uint64_t shared_clear_bytes;
  __shared__ uint32_t shared_failed;

  grid_dependency_wait();

  // 1. Thread 0 reads the control block while every thread loads its first row of input: the
  // two latencies overlap. Volatile loads: the writer was a previous grid, complete and flushed
  // (the wait), and L1 must not serve an older copy.
  if (threadIdx.x == 0) {
    const uint32_t slot = *reinterpret_cast<volatile uint32_t*>(&control->slot);
    shared_slot = slot;
    shared_clear_bytes =
        *reinterpret_cast<volatile uint64_t*>(&control->slot_bytes[slot_to_clear(slot)]);
    shared_failed = *reinterpret_cast<volatile uint32_t*>(&control->error);
  }
  Vec16 input[kVecsPerThread];
  load_row<kVecsPerThread>(p.input, int64_t(blockIdx.x) * vectors, vectors, input);
  __syncthreads();
  // A failed team sends nothing, so its peers time out too and every rank reports the failure.
  if (shared_failed != 0) return;
  const uint32_t slot = shared_slot;

  // 2. Send.
  const size_t send_offset = packet_offset(slot, p.rank, world, p.packet_bytes);
  for (int64_t token = blockIdx.x; token < p.tokens; token += gridDim.x) {
    if (token != blockIdx.x) load_row<kVecsPerThread>(p.input, token * vectors, vectors, input);
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      if (!owns<kVecsPerThread>(i, vectors)) continue;
      const int64_t index = token * vectors + owned(i);
      const Vec16 packet = rewrite_sentinel(input[i]);
#pragma unroll
      for (int r = 0; r < (kWorldSize > 0 ? kWorldSize : kMaxWorld); ++r) {
        if (kWorldSize == 0 && r >= world) break;
        store_packet(reinterpret_cast<Vec16*>(p.workspace[r] + send_offset) + index, packet);
      }
    }
  }

  // 3. Arrival.
  if (threadIdx.x == 0) arrive(control, slot, uint64_t(p.tokens * p.hidden) * sizeof(T));

  // 4.
  launch_dependents();

  // 5. Clear.
  clear_slot(p.workspace[p.rank], slot_to_clear(slot), shared_clear_bytes, world, p.packet_bytes);

  // 6. Receive and finish. The residual and gamma loads are issued before the polls.
  Vec16 gamma[kVecsPerThread];
  if constexpr (kNorm) load_row<kVecsPerThread>(p.gamma, 0, vectors, gamma);
  const size_t sender_stride = p.packet_bytes;
  const char* slot_base = p.workspace[p.rank] + packet_offset(slot, 0, world, p.packet_bytes);
  for (int64_t token = blockIdx.x; token < p.tokens; token += gridDim.x) {
    Vec16 residual[kVecsPerThread];
    if constexpr (kHasResidual)
      load_row<kVecsPerThread>(p.residual, token * vectors, vectors, residual);
    float acc[kVecsPerThread][kElements];
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      if (!owns<kVecsPerThread>(i, vectors)) continue;
      const Vec16* address = reinterpret_cast<const Vec16*>(slot_base) + token * vectors + owned(i);
      if constexpr (kWorldSize > 0) {
        // All W loads in flight before the first use.
        Vec16 packets[kWorldSize];
#pragma unroll
        for (int r = 0; r < kWorldSize; ++r) {
          packets[r] = load_packet(reinterpret_cast<const Vec16*>(
              reinterpret_cast<const char*>(address) + r * sender_stride));
        }
#pragma unroll
        for (int r = 0; r < kWorldSize; ++r) {
          if (!has_arrived(packets[r])) {
            packets[r] =
                wait_for_packet(reinterpret_cast<const Vec16*>(
                                    reinterpret_cast<const char*>(address) + r * sender_stride),
                                p.timeout_ns, &control->error, p.error_flag, r);
          }
        }
        accumulate_first<T>(acc[i], packets[0]);
#pragma unroll
        for (int r = 1; r < kWorldSize; ++r) accumulate<T>(acc[i], packets[r]);
      } else {
        for (int r = 0; r < world; ++r) {
          const Vec16* sender_address = reinterpret_cast<const Vec16*>(
              reinterpret_cast<const char*>(address) + r * sender_stride);
          Vec16 packet = load_packet(sender_address);
          if (!has_arrived(packet))
            packet =
                wait_for_packet(sender_address, p.timeout_ns, &control->error, p.error_flag, r);
          if (r == 0) {
            accumulate_first<T>(acc[i], packet);
          } else {
            accumulate<T>(acc[i], packet);
          }
        }
      }
    }
    finish_row<T, kVecsPerThread, kEpilogue>(acc, residual, gamma, p, token, vectors, shared_sums);
  }
}

template <typename T, int kVecsPerThread>
__global__ void __launch_bounds__(kMaxThreads) add_rmsnorm_kernel(const OneShotParams p) {
  constexpr int kElements = Packed<T>::kElements;
  const int64_t vectors = p.hidden / kElements;
  __shared__ float shared_sums[33];
  grid_dependency_wait();
  launch_dependents();
  Vec16 gamma[kVecsPerThread];
  load_row<kVecsPerThread>(p.gamma, 0, vectors, gamma);
  for (int64_t token = blockIdx.x; token < p.tokens; token += gridDim.x) {
    Vec16 input[kVecsPerThread], residual[kVecsPerThread];
    load_row<kVecsPerThread>(p.input, token * vectors, vectors, input);
    load_row<kVecsPerThread>(p.residual, token * vectors, vectors, residual);
    float acc[kVecsPerThread][kElements];
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      if (owns<kVecsPerThread>(i, vectors)) accumulate_first<T>(acc[i], input[i]);
    }
    finish_row<T, kVecsPerThread, Epilogue::kAddRmsNorm>(acc, residual, gamma, p, token, vectors,
                                                         shared_sums);
  }
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

}  // namespace

void cuda_oneshot(const TeamState& team, const OneShotParams& params, DType dtype,
                  Epilogue epilogue, cudaStream_t stream) {
  if (*reinterpret_cast<volatile uint32_t*>(team.error_flag) != 0) cuda_check(team);
  DeviceGuard guard(team.device);
  const LaunchShape shape = launch_shape(params.hidden, dtype_size(dtype));
  dispatch_dtype(dtype, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    dispatch_world_size(params.world_size, [&](auto world_tag) {
      constexpr int kWorld = decltype(world_tag)::value;
      dispatch_epilogue(epilogue, [&](auto epilogue_tag) {
        constexpr Epilogue kEpilogue = decltype(epilogue_tag)::value;
        dispatch_vecs(shape.vecs_per_thread, [&](auto vecs_tag) {
          constexpr int kVecs = decltype(vecs_tag)::value;
          if constexpr (kVecs > 1 &&
                        (kVecs / 2) * Packed<T>::kElements * kMaxThreads >= kMaxHidden) {
            TPF_FAIL("no launch shape for hidden " << params.hidden);  // never chosen
          } else {
            const auto kernel = oneshot_kernel<T, kWorld, kEpilogue, kVecs>;
            const int resident =
                team.multiprocessors * resident_blocks_per_multiprocessor(kernel, shape.threads, 0);
            const int blocks = int(std::min<int64_t>(params.tokens, resident));
            launch(kernel, blocks, shape.threads, 0, stream, params);
          }
        });
      });
    });
  });
}

void cuda_add_rmsnorm(const AddRmsNormArgs& args, cudaStream_t stream) {
  const OneShotParams params = make_local_params(args);
  const LaunchShape shape = launch_shape(args.hidden, dtype_size(args.dtype));
  const int blocks = int(std::min<int64_t>(args.tokens, 65535));
  dispatch_dtype(args.dtype, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    dispatch_vecs(shape.vecs_per_thread, [&](auto vecs_tag) {
      constexpr int kVecs = decltype(vecs_tag)::value;
      if constexpr (kVecs > 1 && (kVecs / 2) * Packed<T>::kElements * kMaxThreads >= kMaxHidden) {
        TPF_FAIL("no launch shape for hidden " << args.hidden);  // never chosen
      } else {
        launch(add_rmsnorm_kernel<T, kVecs>, blocks, shape.threads, 0, stream, params);
      }
    });
  });
}

}  // namespace tpfuse::impl
