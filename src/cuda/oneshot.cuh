// The Lamport one-shot fused all-reduce kernel.
//
// Protocol: tpfuse/impl/lamport.h tells what is stored where and why no barrier is needed; the
// call's steps are a session (tpfuse/impl/session.h). This kernel, one launch per call and rank:
//
//   [before griddepcontrol.wait]  nothing that reads or writes memory: only registers from the
//                                 kernel parameters. The previous kernel in the stream (another
//                                 tpfuse call, or whatever wrote our inputs) may still run.
//   [after the wait]              the previous grid has completed and its writes are visible.
//   1. thread 0 reads the slot index s = k%3 and the bytes slot (k+2)%3 last received.
//   2. send: block 0 stores the call's header into every other rank (session.h), then each
//      block stores its tokens' packets (input, sentinel rewritten) into slot k%3, sender index
//      `rank`, of every other rank's workspace (a rank's own contribution is read from its
//      input in step 6: it never goes through its slot).
//   3. arrival: thread 0 counts its block in; the last block to arrive resets the count and
//      advances the slot index (every block has read it by then), and records this call's
//      packet bytes for slot k%3, so call k+1 knows what to clear.
//   4. launch_dependents: the next kernel may be scheduled now. It cannot disturb us: every
//      tpfuse kernel waits (griddepcontrol.wait waits for this whole grid to complete and
//      flush) before it touches the slot index or any slot. And since the trigger takes effect only
//      once every block of this grid has issued it, all our blocks are resident before a
//      dependent can take SM space: the co-residency the cross-rank polling needs.
//   5. clear: slot (k+2)%3 of this rank (what call k-1 read) is re-filled with the sentinel.
//   6. receive: each block polls its tokens' vectors in this rank's slot k%3 for every other
//      sender, sums them and its own input (sentinel rewritten) in rank order 0..W-1 in fp32,
//      and runs the epilogue. A wait that takes long reads the sender's header (a rejected or
//      disagreeing call ends it, with NaN); block 0 checks every peer's header at the end.
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
//
// Compiled in the shards of row_launch.cuh; cuda_oneshot (row_launch.cu) launches it.
#pragma once

#include <cuda_runtime.h>

#include "core/calls.h"
#include "cuda/device_ops.cuh"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"
#include "cuda/row_launch.cuh"
#include "cuda/row_shard.cuh"
#include "cuda/rows.cuh"
#include "tpfuse/impl/epilogue.h"

namespace tpfuse::impl {
namespace {

template <typename T, int kWorldSize, typename Epilogue, int kVecsPerThread>
__global__ void __launch_bounds__(kMaxThreads) oneshot_kernel(const RowCall p) {
  using Session = GpuSession<kWorldSize>;
  constexpr int kElements = Packed<T>::kElements;
  ControlBlock* const control = p.exchange.control;
  const int world = Session::world(p.exchange);
  const int rank = p.exchange.rank;
  const int64_t vectors = p.hidden / kElements;
  __shared__ float shared_sums[33];
  __shared__ EarlyHeaders early_headers;

  grid_dependency_wait();

  // 1. The control block and the first input row (begin_call).
  Vec16 input[kVecsPerThread];
  const Session session(begin_call<T, Epilogue, kVecsPerThread>(p, vectors, input));
  // A failed team sends nothing, so its peers time out too and every rank reports the failure.
  if (session.failed()) return;

  // 2. Send: the call header (block 0), then the packets.
  send_header(session, p.exchange, p.signature);
  const size_t send_offset = session.send_offset(p.exchange);
  for (int64_t token = blockIdx.x; token < p.tokens; token += gridDim.x) {
    if (token != blockIdx.x)
      load_contribution<T, Epilogue, kVecsPerThread>(p, token, vectors, input);
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      if (!owns<kVecsPerThread>(i, vectors)) continue;
      const int64_t index = token * vectors + owned(i);
      const Vec16 packet = rewrite_sentinel(input[i]);
#pragma unroll
      for (int r = 0; r < (kWorldSize > 0 ? kWorldSize : kMaxWorldSize); ++r) {
        if (kWorldSize == 0 && r >= world) break;
        if (r == rank) continue;  // its own rows the rank reads from its input
        store_packet(reinterpret_cast<Vec16*>(p.exchange.workspace[r] + send_offset) + index,
                     packet);
      }
    }
  }

  // 3. Arrival; block 0 fetches its peers' headers (checked after the receive).
  if (threadIdx.x == 0) session.arrive(control, uint64_t(p.tokens * p.hidden) * sizeof(T));
  fetch_headers(session, p.exchange, early_headers);

  // 4.
  launch_dependents();

  // 5. Clear.
  session.clear_previous(p.exchange);

  // 6. Receive and finish. The residual and gamma loads are issued before the polls.
  Vec16 gamma[kVecsPerThread];
  if constexpr (Epilogue::kHasNorm) load_row<kVecsPerThread>(p.gamma, 0, vectors, gamma);
  const Vec16* slot_base = reinterpret_cast<const Vec16*>(session.receive_region(p.exchange, 0));
  for (int64_t token = blockIdx.x; token < p.tokens; token += gridDim.x) {
    Vec16 residual[kVecsPerThread];
    if constexpr (Epilogue::kHasResidual)
      load_row<kVecsPerThread>(p.residual, token * vectors, vectors, residual);
    float acc[kVecsPerThread][kElements];
    // A block with a single token still holds its contribution in registers; a MoE combine is
    // computed again rather than read from memory (it is in none).
    const bool own_in_registers = gridDim.x >= p.tokens;
    if constexpr (Epilogue::kHasMoe) {
      if (!own_in_registers)
        load_contribution<T, Epilogue, kVecsPerThread>(p, token, vectors, input);
    }
    receive_row<T, kWorldSize, kVecsPerThread>(
        acc, slot_base + token * vectors, p.exchange.packet_bytes,
        reinterpret_cast<const Vec16*>(p.input) + token * vectors, input,
        own_in_registers || Epilogue::kHasMoe, world, vectors, session, p);
    finish_row<T, kVecsPerThread, Epilogue>(acc, residual, gamma, p, token, vectors, shared_sums,
                                            NoSend{});
  }
  check_header(session, p.exchange, p.signature, early_headers);
  end_call(session, p.exchange, [&] { return row_outputs(p, sizeof(T), Epilogue::kHasQuant); });
}

template <typename Tag>
constexpr auto oneshot_kernel_of(Tag) {
  return oneshot_kernel<typename Tag::T, Tag::kWorld, typename Tag::Epilogue, Tag::kVecs>;
}

}  // namespace

// The one-shot kernel's part of a shard (row_launch.cuh).
struct OneShotKernel {
  template <typename Epilogue>
  static void launch_call(const RowLaunch& row) {
    launch_row_collective_in_shard<Epilogue>(
        row, [](auto kernel_tag) { return oneshot_kernel_of(kernel_tag); });
  }

  template <typename Epilogue>
  static void preload_kernels(int world_size) {
    for_each_row_kernel<Epilogue>(world_size,
                                  [](auto kernel_tag) { preload(oneshot_kernel_of(kernel_tag)); });
  }
};

}  // namespace tpfuse::impl
