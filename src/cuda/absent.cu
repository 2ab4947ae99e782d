// An absent call (session.h): this rank's turn in a call it makes without data, because it
// rejected its arguments or because the call has no tokens. One block:
//
//   1. read the call state; a failed team does nothing (its peers time out, as for any call);
//   2. store this rank's header (the rejection, or the empty call's signature) into every peer;
//   3. clear the previous call's slot, as every call does;
//   4. wait for every peer's header; an empty call compares it with its own (a peer with tokens
//      is a disagreement: the team fails); a rejected peer is recorded;
//   5. drain: wait for every packet each peer's signature says it sends this rank (every sender
//      makes them all, session.h), so that none lands after the clear two calls later;
//   6. arrive with the largest region a peer used (what the next call but one clears).
#include <cuda_runtime.h>

#include "core/calls.h"
#include "cuda/device_ops.cuh"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"

namespace tpfuse::impl {
namespace {

constexpr int kAbsentThreads = 256;

// Waits for one vector of a peer's packets (session.h's bounded_wait; a timeout fails the
// team). Returns false once this rank's team has failed, here or on a peer (its mark).
__device__ bool drain_vector(const Vec16* address, const Exchange& x, int sender) {
  Vec16 v;
  return bounded_wait<GridClock>(
      x.timeout_ns, [&] { return load_packet(address); },
      [&] { return failure_recorded(x) || mark_seen(x); },
      [&](const Vec16&) {
        record_failure(x, CallError::kTimeout, sender, sentinel_vector(), sentinel_vector());
      },
      v);
}

__global__ void __launch_bounds__(kAbsentThreads)
    absent_call_kernel(const Exchange x, const CallSignature mine) {
  using Session = GpuSession<0>;
  __shared__ CallState shared_state;
  __shared__ Vec16 headers[kMaxWorldSize];
  grid_dependency_wait();

  // 1-3.
  if (threadIdx.x == 0) shared_state = read_call_state<GridCoop>(x);
  __syncthreads();
  const Session session(shared_state);
  if (session.failed()) return;
  send_header(session, x, mine);
  session.clear_previous(x);

  // 4. Thread r waits for peer r's header.
  const int world = session.world(x);
  const int peer = int(threadIdx.x);
  if (peer < world && peer != x.rank) {
    const Vec16* address = session.received_header(x, peer);
    Vec16 header = sentinel_vector();
    if (drain_vector(address, x, peer)) {
      header = load_packet(address);
      // A rejecting rank takes whatever its peers send (its caller is reporting its own error);
      // an empty call must agree with them.
      if (mine.op() != CallOp::kRejected) {
        header_differs(x, mine, header, peer);
      }
    }
    headers[peer] = header;
  }
  __syncthreads();
  if (failure_recorded(x)) return;

  // 5. Drain, spread over the block.
  uint64_t clear_bytes = 0;
  for (int sender = 0; sender < world; ++sender) {
    if (sender == x.rank) continue;
    const SenderExtents extents =
        sender_extents(CallSignature{headers[sender]}, sender, x.rank, world);
    clear_bytes = extents.clear_bytes > clear_bytes ? extents.clear_bytes : clear_bytes;
    const char* region = session.receive_region(x, sender);
    for (int range = 0; range < 2; ++range) {
      for (uint64_t offset = extents.begin[range] + 16 * threadIdx.x; offset < extents.end[range];
           offset += 16 * kAbsentThreads) {
        if (!drain_vector(reinterpret_cast<const Vec16*>(region + offset), x, sender)) break;
      }
    }
  }
  __syncthreads();

  // 6. (A team that failed meanwhile is failed for good: its slot index no longer matters.)
  if (threadIdx.x == 0) session.arrive(x.control, clear_bytes);
}

}  // namespace

void cuda_absent_call(const TeamState& team, const CallSignature& signature, cudaStream_t stream) {
  DeviceGuard guard(team.device);
  launch(absent_call_kernel, 1, kAbsentThreads, 0, stream, team.exchange, signature);
}

void cuda_preload_absent_kernel() {
  preload(absent_call_kernel);
}

}  // namespace tpfuse::impl
