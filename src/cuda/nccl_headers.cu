// The NCCL path's call headers. NCCL's all-reduce carries nothing but the data, so a call there
// carries its header beside it, with the same meaning as a fused call's (session.h):
//
//   1. header kernel (one warp): reads this rank's call number and whether its team has failed
//      (its control block, and the failure mark where the team has a workspace), advances the
//      number, and writes a [world] vector of headers: this rank's slot its signature with the
//      call number folded in (sequenced_signature), or failed_signature when its team has
//      failed; every other slot zero;
//   2. NCCL sums that vector in the same group as the call's data (NcclSupport::allreduce_headed):
//      each slot has one contributor, so the sum is every rank's header;
//   3. the call's own work (the local epilogue, or the QK norm's second half);
//   4. check kernel: compares each peer's header with this rank's. Alike (every good call): it
//      returns after reading them. This rank's team failed (its header said so): NaN. Else a
//      differing header means what it means on the fused paths (session.h's header_verdict,
//      recorded by record_header): a peer that rejected its call: this rank's outputs of the call
//      are NaN and the per-call error is recorded (the team goes on). A peer whose team had
//      failed: NaN, and this rank's team fails too (kPeerFailed). Anything else (another op,
//      shape or call number): NaN, and the team fails (kMismatch), naming the peer and both
//      headers.
//
// A rank that rejects a well-formed call, or refuses one because its team has failed, still takes
// its turn (cuda_nccl_turn): the header (kRejected or kFailed) and an all-reduce of the call's
// count from scratch, so its peers' NCCL call completes and they are told. NCCL itself cannot
// complete a call whose peers pass different counts: ranks that disagree on the count can wait in
// NCCL (README, Limits); the header then tells them at the next call that does complete.
#include <cuda_runtime.h>

#include "core/backend.h"
#include "core/calls.h"
#include "core/error.h"
#include "cuda/device_ops.cuh"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"

namespace tpfuse::impl {
namespace {

constexpr int kCheckThreads = 256;
constexpr int kCheckBlocks = 32;  // what a poison fill spreads over; a good call reads only

__global__ void __launch_bounds__(32)
    nccl_header_kernel(const Exchange x, const CallSignature mine, Vec16* headers) {
  grid_dependency_wait();
  __shared__ Vec16 sent;
  if (threadIdx.x == 0) {
    ControlBlock* control = x.control;
    const uint32_t sequence = *reinterpret_cast<volatile uint32_t*>(&control->sequence);
    uint32_t failed = *reinterpret_cast<volatile uint32_t*>(&control->error);
    if (failed == 0 && x.workspace[x.rank] != nullptr) {
      const Vec16 mark = load_packet(x.mark());
      if (has_arrived(mark)) {
        record_mark(x, mark);
        failed = 1;
      }
    }
    if (failed != 0) {
      // The rank its own failure names (control->error is 1 + that rank), and the failure's
      // kind as its record says it.
      const uint32_t named = *reinterpret_cast<volatile uint32_t*>(&control->error) - 1;
      const uint32_t kind = *reinterpret_cast<volatile uint32_t*>(&x.errors->failure);
      sent = failed_signature(CallError(kind), int(named)).header;
    } else {
      sent = sequenced_signature(mine, sequence).header;
    }
    *reinterpret_cast<volatile uint32_t*>(&control->sequence) = next_sequence(sequence);
  }
  __syncthreads();
  for (int r = int(threadIdx.x); r < x.world_size; r += 32) {
    headers[r] = r == x.rank ? sent : Vec16{};
  }
}

__global__ void __launch_bounds__(kCheckThreads)
    nccl_check_kernel(const Exchange x, const Vec16* headers, const CallOutputs outputs) {
  grid_dependency_wait();
  const Vec16 mine = headers[x.rank];
  bool alike = true;
  for (int r = 0; r < x.world_size; ++r) alike = alike && same_signature(headers[r], mine);
  // A call this rank made on a failed team (queued before the host could see the failure) is
  // NaN even where every peer's team failed alike.
  const CallOp own = CallSignature{mine}.op();
  if (alike && own != CallOp::kFailed) return;

  // This rank's failure is recorded already; a rejected call's caller reports its own error.
  const int peer = int(threadIdx.x);
  if (blockIdx.x == 0 && peer < x.world_size && peer != x.rank && own != CallOp::kRejected &&
      own != CallOp::kFailed && !same_signature(headers[peer], mine)) {
    const uint32_t sequence =
        (*reinterpret_cast<volatile uint32_t*>(&x.control->sequence) - 1u) & 0x7fffffffu;
    record_header(DeviceRecorder{}, x, mine, headers[peer], peer, sequence);
  }

  // NaN into every output (outputs_of, core/calls.h), spread over the grid.
  fill_with_nan(outputs, blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x);
}

}  // namespace

void cuda_nccl_headers(const TeamState& team, const CallSignature& signature, cudaStream_t stream) {
  launch(nccl_header_kernel, 1, 32, 0, stream, team.exchange, signature,
         reinterpret_cast<Vec16*>(cuda_state(team).nccl_headers));
}

void cuda_nccl_check(const TeamState& team, const CallOutputs& outputs, cudaStream_t stream) {
  launch(nccl_check_kernel, kCheckBlocks, kCheckThreads, 0, stream, team.exchange,
         reinterpret_cast<const Vec16*>(cuda_state(team).nccl_headers), outputs);
}

void cuda_preload_nccl_header_kernels() {
  preload(nccl_header_kernel);
  preload(nccl_check_kernel);
}

}  // namespace tpfuse::impl
