// Device primitives of the one-shot protocol: packet stores and polls, PDL, block reduction.
// Each memory-ordering choice says why it is enough.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "tpfuse/impl/lamport.h"

namespace tpfuse::impl {

// Packet store into a peer's (or this rank's) slot. Volatile: the store goes out to L2 / over
// NVLink now rather than sitting in L1, and is not merged or reordered away by the compiler. No
// release is needed: the packet is its own flag (a receiver consumes exactly the words it saw
// change from the sentinel) and nothing else is published with it. (Measured on an H200 pair:
// plain weak stores time the same, 3.40 us at 1 token either way.)
__device__ __forceinline__ void store_packet(Vec16* address, const Vec16& v) {
  asm volatile("st.volatile.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(address), "r"(v.word[0]),
               "r"(v.word[1]), "r"(v.word[2]), "r"(v.word[3])
               : "memory");
}

// Poll of this rank's own slot. Volatile: every iteration reads L2 (where peers' NVLink stores
// land) instead of a stale L1 line, and the loop is not hoisted.
__device__ __forceinline__ Vec16 load_packet(const Vec16* address) {
  Vec16 v;
  asm volatile("ld.volatile.global.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.word[0]), "=r"(v.word[1]), "=r"(v.word[2]), "=r"(v.word[3])
               : "l"(address)
               : "memory");
  return v;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Programmatic dependent launch. wait: blocks until every prerequisite grid has completed and
// its memory is visible (PTX griddepcontrol.wait). launch_dependents: lets the next kernel in
// the stream be scheduled (it still waits for our completion before touching memory).
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

__device__ __forceinline__ Vec16 load_vector(const void* base, int64_t index) {
  return reinterpret_cast<const Vec16*>(base)[index];
}

__device__ __forceinline__ void store_vector(void* base, int64_t index, const Vec16& v) {
  reinterpret_cast<Vec16*>(base)[index] = v;
}

// Sum over the block, in a fixed order (butterfly within warps, then warp 0 over the warp
// sums): the same launch shape gives the same bits on every rank and every call.
__device__ __forceinline__ float block_sum(float value, float* shared_warp_sums) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = (blockDim.x + 31) / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  if (lane == 0) shared_warp_sums[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < warps ? shared_warp_sums[lane] : 0.0f;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      value += __shfl_xor_sync(0xffffffffu, value, offset);
    }
    if (lane == 0) shared_warp_sums[32] = value;
  }
  __syncthreads();
  const float total = shared_warp_sums[32];
  __syncthreads();  // shared_warp_sums may be reused by the next row
  return total;
}

// block_sum of two values at once (one pass, one set of barriers): each component gets exactly
// the additions, in the same order, that block_sum would give it alone.
__device__ __forceinline__ float2 block_sum2(float2 value, float2* shared_warp_sums) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = (blockDim.x + 31) / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    value.x += __shfl_xor_sync(0xffffffffu, value.x, offset);
    value.y += __shfl_xor_sync(0xffffffffu, value.y, offset);
  }
  if (lane == 0) shared_warp_sums[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < warps ? shared_warp_sums[lane] : make_float2(0.0f, 0.0f);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      value.x += __shfl_xor_sync(0xffffffffu, value.x, offset);
      value.y += __shfl_xor_sync(0xffffffffu, value.y, offset);
    }
    if (lane == 0) shared_warp_sums[32] = value;
  }
  __syncthreads();
  const float2 total = shared_warp_sums[32];
  __syncthreads();  // shared_warp_sums may be reused by the next row
  return total;
}

// The slow path of a poll: spins until every word of a packet vector holds data, with the
// bounded wait. On timeout (or when another thread of this rank already timed out) it records
// the missing sender in the control block (device memory, which later calls read cheaply) and
// in the host-mapped error flag (which the host reads without synchronizing), and returns what
// it has: the outputs of a failed call are garbage, and Team::check reports it.
// Inlined: a call would make the caller save its live registers (spills) around it.
__device__ __forceinline__ Vec16 wait_for_packet(const Vec16* address, uint64_t timeout_ns,
                                                 uint32_t* device_error, uint32_t* host_error,
                                                 int sender) {
  uint64_t deadline = 0;
  for (uint32_t spins = 1;; ++spins) {
    const Vec16 v = load_packet(address);
    if (has_arrived(v)) return v;
    if (timeout_ns != 0 && spins % 256 == 0) {
      const uint64_t now = global_timer_ns();
      if (deadline == 0) {
        deadline = now + timeout_ns;
      } else if (now > deadline || *reinterpret_cast<volatile uint32_t*>(device_error) != 0) {
        const uint32_t code = uint32_t(1 + sender);
        atomicCAS(device_error, 0u, code);
        // System scope: the host reads this flag while the kernel may still run.
        atomicCAS_system(host_error, 0u, code);
        return v;
      }
    }
  }
}

// What a call needs from its rank's control block: the slot it uses, the bytes per sender the
// slot before it received (to clear), and whether the team has failed.
struct CallState {
  uint32_t slot;
  uint32_t failed;
  uint64_t clear_bytes;
};

// Thread 0's read of the control block at the start of a call (after griddepcontrol.wait).
// Volatile loads: the writer was a previous grid, complete and flushed (the wait), and L1 must
// not serve an older copy.
__device__ __forceinline__ CallState read_call_state(const ControlBlock* control) {
  CallState state;
  state.slot = *reinterpret_cast<const volatile uint32_t*>(&control->slot);
  state.failed = *reinterpret_cast<const volatile uint32_t*>(&control->error);
  state.clear_bytes =
      *reinterpret_cast<const volatile uint64_t*>(&control->slot_bytes[slot_to_clear(state.slot)]);
  return state;
}

// The last block of a call to arrive advances the slot index (every block read it before it
// arrived) and records the bytes each sender stored into this call's slot, which the next call
// clears. Called by one thread of each block, after the block has read the call state (thread 0
// in the row kernels; a thread of the second warp in the QK kernel, whose thread 0 polls: there
// the atomic's round trip measured 0.2 us on the critical path. In the row kernels, where every
// thread polls its own vectors, consuming the result at the end of the kernel measured the same).
__device__ __forceinline__ void arrive(ControlBlock* control, uint32_t slot, uint64_t bytes) {
  const uint32_t arrived = atomicAdd(&control->arrivals, 1u);
  if (arrived == gridDim.x - 1) {
    control->arrivals = 0;
    control->slot_bytes[slot] = bytes;
    control->slot = next_slot(slot);
  }
}

// Re-fills slot `clear_slot` of this rank's workspace, `clear_bytes` per sender, with the
// sentinel, spread over the whole grid. Plain stores suffice: the slot is next polled two calls
// (two kernel boundaries) later, and a peer stores into it only after it has seen a packet this
// rank sends later. This rank's own sender region (`rank`) is left as it is: nothing reads a word
// of it that the same call did not store (tpfuse/impl/lamport.h).
__device__ __forceinline__ void clear_slot(char* workspace, uint32_t clear_slot,
                                           uint64_t clear_bytes, int world, size_t packet_bytes,
                                           int rank) {
  const int64_t per_sender = int64_t(clear_bytes / 16);
  const int64_t total = per_sender * (world - 1);
  char* base = workspace + packet_offset(clear_slot, 0, world, packet_bytes);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t region = i / per_sender;
    const int64_t sender = region >= rank ? region + 1 : region;
    reinterpret_cast<Vec16*>(base + sender * packet_bytes)[i - region * per_sender] =
        sentinel_vector();
  }
}

}  // namespace tpfuse::impl
