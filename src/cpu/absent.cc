// An absent call on the CPU (session.h; src/cuda/absent.cu is the GPU's): the rank's header, the
// wait for every peer's, the drain of what their signatures say they sent, and the slot's clear
// and advance.
#include <algorithm>

#include "core/error.h"
#include "cpu/exchange.h"
#include "cpu/kernels.h"

namespace tpfuse::impl {

void cpu_absent_call(const Exchange& x, const CallSignature& signature) {
  const CpuSession session = begin_session(x);
  CpuCall call = start_call(x, session, signature);
  const CallSignature& mine = call.mine;
  session.clear_previous(x);
  uint64_t clear_bytes = 0;
  for (int sender = 0; sender < x.world_size; ++sender) {
    if (sender == x.rank) continue;
    const Vec16 header = wait_vector(call.header_of(sender), x, mine, sender);
    // An empty call must agree with its peers (header_stops throws if not); a rejected one
    // takes whatever they send.
    if (mine.op() != CallOp::kRejected) call.header_stops(sender, header);
    const SenderExtents extents =
        sender_extents(CallSignature{header}, sender, x.rank, x.world_size);
    clear_bytes = std::max(clear_bytes, extents.clear_bytes);
    const char* region = session.receive_region(x, sender);
    for (int range = 0; range < 2; ++range) {
      for (uint64_t offset = extents.begin[range]; offset < extents.end[range]; offset += 16) {
        wait_vector(region + offset, x, mine, sender);
      }
    }
  }
  session.arrive(x.control, clear_bytes);
  if (mine.op() != CallOp::kRejected) finish_call(call);  // throws for a rejected peer
}

}  // namespace tpfuse::impl
