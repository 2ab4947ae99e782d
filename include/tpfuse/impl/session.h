// One call of the Lamport protocol (lamport.h) as a session: the steps every fused kernel and
// the CPU backend take, written once. A backend supplies only a Coop: how its threads read and
// write the control block, store the sentinel, spread work and count arrivals.
//
//   1. read the call state (slot, bytes to clear, failure) from this rank's control block;
//   2. send into sender region `rank` of the call's slot of each receiver (the caller's loops,
//      at send_offset() of each receiver's workspace);
//   3. arrive: each participant, once done with the call state; the last one records what
//      this call's slot received per sender and advances the slot index;
//   4. clear the previous call's slot (every sender region but this rank's own);
//   5. receive from this rank's slot (the caller's polls).
// On the GPU a participant is a block: each arrives right after its send, then the grid triggers
// its dependents (launch_dependents) and clears. On the CPU the rank's one thread is the only
// participant and arrives last, after its receive: the next call reads the state only then.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tpfuse/impl/config.h"
#include "tpfuse/impl/lamport.h"
#include "tpfuse/limits.h"

namespace tpfuse::impl {

// The team side of every call: what a rank needs to exchange packets with its peers.
struct Exchange {
  // Base of every rank's workspace as this rank addresses it (peer pointers over NVLink on CUDA).
  char* workspace[kMaxWorldSize];
  ControlBlock* control;  // this rank's control block
  // Nonzero once a call of this rank timed out: 1 + the rank that did not arrive. Readable by the
  // host without synchronizing (host memory, mapped into the device on CUDA).
  uint32_t* error_flag;
  int rank;
  int world_size;
  size_t packet_bytes;  // one sender region of one slot
  uint64_t timeout_ns;  // 0: wait forever
};

// What a call reads of its control block before it touches a slot.
struct CallState {
  uint32_t slot;
  uint32_t failed;
  uint64_t clear_bytes;  // bytes per sender the previous call's slot received
};

// Reads the call state. Coop::load picks the loads: volatile on the GPU (a previous grid wrote
// the block), plain on the CPU (only this rank's thread touches it).
template <typename Coop>
TPF_HOST_DEVICE CallState read_call_state(const ControlBlock* control) {
  CallState state;
  state.slot = Coop::load(&control->slot);
  state.failed = Coop::load(&control->error);
  state.clear_bytes = Coop::load(&control->slot_bytes[slot_to_clear(state.slot)]);
  return state;
}

// One call of one rank: the call state it read, and the steps that use it. kWorldSize > 0 binds
// the world size at compile time (0: the exchange's). The steps take the call's Exchange where
// they use it rather than holding a copy or a pointer: a kernel's parameters are then read
// where each step needs them, as if the steps were written out in the kernel.
template <typename Coop, int kWorldSize = 0>
class LamportSession {
 public:
  TPF_HOST_DEVICE explicit LamportSession(const CallState& state) : state_(state) {}

  TPF_HOST_DEVICE static int world(const Exchange& x) {
    return kWorldSize > 0 ? kWorldSize : x.world_size;
  }
  TPF_HOST_DEVICE bool failed() const { return state_.failed != 0; }
  // Where this rank's packets go in any receiver's workspace: workspace[receiver] + this.
  TPF_HOST_DEVICE size_t send_offset(const Exchange& x) const { return region_offset(x, x.rank); }
  // Where sender `sender`'s packet arrives in this rank's workspace.
  TPF_HOST_DEVICE const char* receive_region(const Exchange& x, int sender) const {
    return x.workspace[x.rank] + region_offset(x, sender);
  }

  // Step 3, by one thread of each participant after it has read the call state (`control`:
  // this rank's control block, Exchange::control).
  TPF_HOST_DEVICE void arrive(ControlBlock* control, uint64_t bytes_per_sender) const {
    if (Coop::add_arrival(&control->arrivals) == Coop::participants() - 1) {
      Coop::store(&control->arrivals, 0u);
      Coop::store(&control->slot_bytes[state_.slot], bytes_per_sender);
      Coop::store(&control->slot, next_slot(state_.slot));
    }
  }

  // Step 4: re-fills the previous call's slot with the sentinel, spread over the Coop's
  // threads. This rank's own region is left alone: nothing reads a word of it that the same
  // call did not store (lamport.h).
  TPF_HOST_DEVICE void clear_previous(const Exchange& x) const {
    const int64_t per_sender = int64_t(state_.clear_bytes / 16);
    const int64_t total = per_sender * (world(x) - 1);
    char* base = x.workspace[x.rank] +
                 packet_offset(slot_to_clear(state_.slot), 0, world(x), x.packet_bytes);
    const int64_t stride = Coop::thread_count();
    for (int64_t i = Coop::thread_index(); i < total; i += stride) {
      const int64_t region = i / per_sender;
      const int64_t sender = region >= x.rank ? region + 1 : region;
      Coop::store_sentinel(reinterpret_cast<Vec16*>(base + sender * x.packet_bytes) +
                           (i - region * per_sender));
    }
  }

 private:
  // Byte offset, inside any rank's workspace, of sender `sender`'s region of this call's slot.
  TPF_HOST_DEVICE size_t region_offset(const Exchange& x, int sender) const {
    return packet_offset(state_.slot, sender, world(x), x.packet_bytes);
  }

  CallState state_;
};

}  // namespace tpfuse::impl
