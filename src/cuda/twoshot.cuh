// The two-shot fused all-reduce kernel: reduce-scatter by whole tokens, the epilogue on the owned
// tokens, all-gather of the rounded rows, every rank finishing the rows it receives. One launch
// per call and rank; the layout is tpfuse/impl/lamport.h's (same slots, sentinel and clearing as
// one-shot, so the two may alternate from call to call).
//
//   [before griddepcontrol.wait]  nothing that reads or writes memory (as in one-shot).
//   1. thread 0 reads the slot index, the bytes to clear and the error word.
//   2. scatter: block 0 stores the call's header into every other rank (session.h), then each
//      block stores input rows (sentinel words rewritten) into the slot of the
//      rank that owns their token, sender index `rank`, rows [0, per); rows this rank owns stay
//      in its input (a rank's own rows never go through its slot).
//   3. arrival (the last block advances the slot index), launch_dependents, clear the previous
//      call's slot: as in one-shot, for the same reasons (src/cuda/oneshot.cuh).
//   4. owned rows: poll the other senders' rows, sum them and this rank's input row in rank
//      order in fp32, residual add, one
//      rounding (canonical zeros), residual_out and norm_out; each rounded vector also goes to
//      every other rank's slot, sender index `rank`, rows [per, 2 per).
//   5. gathered rows: poll the rounded rows other ranks own and finish them as their owner did
//      (residual_out as received; the norm from it with the same block shape and reduction).
//
// Batch invariance: a token's rank sum, rounding and block reduction are those of the one-shot
// kernel with the same launch shape (which depends on hidden and dtype only), so one-shot and
// two-shot give the same bits for every token. Deadlock freedom: step 4 waits only on step 2 of
// the peers, step 5 only on step 4 of the owners, and every block of a grid is resident (the grid
// is sized by occupancy), so every store that is waited on is eventually made.
//
// Compiled in the shards of row_launch.cuh; cuda_twoshot (row_launch.cu) launches it.
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
#include "tpfuse/impl/lamport.h"

namespace tpfuse::impl {
namespace {

template <typename T, int kWorldSize, typename Epilogue, int kVecsPerThread>
__global__ void __launch_bounds__(kMaxThreads) twoshot_kernel(const RowCall p) {
  using Session = GpuSession<kWorldSize>;
  constexpr int kElements = Packed<T>::kElements;
  ControlBlock* const control = p.exchange.control;
  const int world = Session::world(p.exchange);
  const int64_t vectors = p.hidden / kElements;
  const size_t row_bytes = size_t(p.hidden) * sizeof(T);
  const TwoShotLayout layout(p.tokens, world);
  __shared__ float shared_sums[33];
  __shared__ EarlyHeaders early_headers;

  grid_dependency_wait();

  // 1. The control block and the first input row (begin_call).
  Vec16 input[kVecsPerThread];
  const Session session(begin_call<T, Epilogue, kVecsPerThread>(p, vectors, input));
  if (session.failed()) return;  // a failed team sends nothing (see oneshot.cuh)
  const size_t my_sender_offset = session.send_offset(p.exchange);
  send_header(session, p.exchange, p.signature);

  // 2. Scatter (rows this rank owns stay in its input: step 4 reads them there).
  for (int64_t token = blockIdx.x; token < p.tokens; token += gridDim.x) {
    const int owner = layout.owner(token);
    if (owner == p.exchange.rank) continue;
    if (token != blockIdx.x)
      load_contribution<T, Epilogue, kVecsPerThread>(p, token, vectors, input);
    Vec16* destination =
        reinterpret_cast<Vec16*>(p.exchange.workspace[owner] + my_sender_offset +
                                 layout.scatter_row(token - layout.begin(owner), row_bytes));
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      if (owns<kVecsPerThread>(i, vectors)) {
        store_packet(destination + owned(i), rewrite_sentinel(input[i]));
      }
    }
  }

  // 3.
  if (threadIdx.x == 0) session.arrive(control, layout.sender_bytes(row_bytes));
  fetch_headers(session, p.exchange, early_headers);
  launch_dependents();
  session.clear_previous(p.exchange);

  Vec16 gamma[kVecsPerThread];
  if constexpr (Epilogue::kHasNorm) load_row<kVecsPerThread>(p.gamma, 0, vectors, gamma);
  const char* my_slot = session.receive_region(p.exchange, 0);

  // 4. Owned rows.
  const int64_t own_begin = layout.begin(p.exchange.rank);
  const int64_t own_count = layout.count(p.exchange.rank);
  for (int64_t local = blockIdx.x; local < own_count; local += gridDim.x) {
    const int64_t token = own_begin + local;
    Vec16 residual[kVecsPerThread];
    if constexpr (Epilogue::kHasResidual)
      load_row<kVecsPerThread>(p.residual, token * vectors, vectors, residual);
    float acc[kVecsPerThread][kElements];
    // This rank's own row from its input, or a MoE combine computed again (it is in no memory).
    if constexpr (Epilogue::kHasMoe)
      load_contribution<T, Epilogue, kVecsPerThread>(p, token, vectors, input);
    receive_row<T, kWorldSize, kVecsPerThread>(
        acc, reinterpret_cast<const Vec16*>(my_slot + layout.scatter_row(local, row_bytes)),
        p.exchange.packet_bytes, reinterpret_cast<const Vec16*>(p.input) + token * vectors, input,
        Epilogue::kHasMoe, world, vectors, session, p);
    const size_t gather_offset = my_sender_offset + layout.gather_row(local, row_bytes);
    finish_row<T, kVecsPerThread, Epilogue>(
        acc, residual, gamma, p, token, vectors, shared_sums, [&](int i, const Vec16& rounded) {
#pragma unroll
          for (int r = 0; r < (kWorldSize > 0 ? kWorldSize : kMaxWorldSize); ++r) {
            if (kWorldSize == 0 && r >= world) break;
            if (r == p.exchange.rank) continue;
            store_packet(
                reinterpret_cast<Vec16*>(p.exchange.workspace[r] + gather_offset) + owned(i),
                rounded);
          }
        });
  }

  // 5. Gathered rows: the tokens before and after this rank's own range.
  const int64_t others = p.tokens - own_count;
  for (int64_t index = blockIdx.x; index < others; index += gridDim.x) {
    const int64_t token = index < own_begin ? index : index + own_count;
    const int owner = layout.owner(token);
    const Vec16* address =
        reinterpret_cast<const Vec16*>(my_slot + size_t(owner) * p.exchange.packet_bytes +
                                       layout.gather_row(token - layout.begin(owner), row_bytes));
    float acc[kVecsPerThread][kElements];
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      if (!owns<kVecsPerThread>(i, vectors)) continue;
      Vec16 packet = load_packet(address + owned(i));
      if (!has_arrived(packet)) {
        packet = wait_for_packet(address + owned(i), session, p.exchange, p.signature, owner);
      }
      accumulate_first<T>(acc[i], packet);
    }
    Vec16 no_residual[kVecsPerThread];
    // Rows received rounded are finished without a residual add.
    finish_row<T, kVecsPerThread, typename Epilogue::Gathered>(acc, no_residual, gamma, p, token,
                                                               vectors, shared_sums, NoSend{});
  }
  check_header(session, p.exchange, p.signature, early_headers);
  end_call(session, p.exchange, [&] { return row_outputs(p, sizeof(T), Epilogue::kHasQuant); });
}

template <typename Tag>
constexpr auto twoshot_kernel_of(Tag) {
  return twoshot_kernel<typename Tag::T, Tag::kWorld, typename Tag::Epilogue, Tag::kVecs>;
}

}  // namespace

// The two-shot kernel's part of a shard (row_launch.cuh).
struct TwoShotKernel {
  template <typename Epilogue>
  static void launch_call(const RowLaunch& row) {
    launch_row_collective_in_shard<Epilogue>(
        row, [](auto kernel_tag) { return twoshot_kernel_of(kernel_tag); });
  }

  template <typename Epilogue>
  static void preload_kernels(int world_size) {
    for_each_row_kernel<Epilogue>(world_size,
                                  [](auto kernel_tag) { preload(twoshot_kernel_of(kernel_tag)); });
  }
};

}  // namespace tpfuse::impl
