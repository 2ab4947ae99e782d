// The waits of the SYCL backend's kernels and what ends them (src/sycl/device/rows.h and
// qknorm.h, embedded as "tpfuse/sycl/waits.h"): the bound (the device clock, or looks), the
// records of a failure of the team and of a peer's rejection (record_header's Recorder), the
// vector wait, and the call state a work-group takes from its work-item 0.
//
// Waits are bounded by the device's clock where it has one (sycl_ext_oneapi_clock, device scope:
// the host compiles with -DTPF_SYCL_CLOCK=1): a call's `bound` is TeamOptions::
// peer_timeout_seconds in its ticks, at a rate the team measured when it was made
// (tpf_sycl_clock_rate, src/sycl/team.cc). A device without one counts looks instead, at a rate
// measured by one work-item (tpf_sycl_calibrate): approximate, as a look's cost depends on how
// the device runs a group's work-items.
#pragma once

#include <sycl/sycl.hpp>

#include <cstdint>

#include "tpfuse/impl/lamport.h"
#include "tpfuse/impl/session.h"
#include "tpfuse/sycl/exchange.h"

#ifndef TPF_SYCL_CLOCK
#define TPF_SYCL_CLOCK 0
#endif

namespace tpfuse::impl::sycl_device {

// The device clock's ticks (0 without one).
inline uint64_t device_ticks() {
#if TPF_SYCL_CLOCK
  namespace syclex = sycl::ext::oneapi::experimental;
  return syclex::clock<syclex::clock_scope::device>();
#else
  return 0;
#endif
}

// The waits' bound (a call's `bound`; 0: none): whether it has passed at this check, `looks`
// looks into the wait, whose first check read the clock into `start`.
inline bool bound_passed(uint64_t bound, uint64_t looks, uint64_t& start) {
  if (bound == 0) return false;
#if TPF_SYCL_CLOCK
  (void)looks;
  const uint64_t now = device_ticks();
  if (start == 0) {
    start = now | 1u;
    return false;
  }
  return now - start > bound;
#else
  (void)start;
  return looks >= bound;
#endif
}

// Looks at a vector between two checks of the slow path (the header, the error word, the mark,
// the bound).
constexpr uint64_t kCheckEvery = 64;

// A per-call error (a peer's rejection, a QK position outside the cache): the first since the
// last Team::check claims the record (call_claims moves from the record's call_generation to one
// past it, as on the GPU), then writes its details and, last, the kind with release.
inline bool claim_call_error(const Exchange& x) {
  const uint32_t generation = load_acquire(&x.errors->call_generation);
  uint32_t expected = generation;
  return ProtocolAtomic<uint32_t>(x.control->call_claims)
      .compare_exchange_strong(expected, generation + 1, sycl::memory_order::acq_rel);
}

inline void record_rejection(const Exchange& x, int sender) {
  if (claim_call_error(x)) {
    x.errors->call_peer = uint32_t(sender);
    store_release(&x.errors->call_error, uint32_t(CallError::kPeerRejected));
  }
}

// record_header's Recorder (session.h).
struct Recorder {
  void on_rejection(const Exchange& x, int sender) const { record_rejection(x, sender); }
  void on_failure(const Exchange& x, CallError kind, int sender, const Vec16& mine,
                  const Vec16& theirs, uint32_t sequence) const {
    record_team_failure(x, kind, sender, mine, theirs, sequence);
  }
};

// Whether this rank's team has failed: its error word, or a peer's failure mark (recorded then).
inline bool team_stopped(const Exchange& x) {
  if (load_acquire(&x.control->error) != 0) return true;
  const Vec16* mark = x.mark();
  if (load_acquire(&mark->word[0]) == kSentinel) return false;
  const Vec16 m = load_vector(mark);
  if (!has_arrived(m)) return false;
  WorkGroupCoop::record_mark(x, m);
  return true;
}

// Waits for a vector (a header; a packet, read only once its sender's header agreed; a packet
// an absent call drains): false if the team failed or the bound passed (a timeout naming
// `sender`, recorded).
inline bool wait_vector(const Vec16* address, const Exchange& x, const CallSignature& mine,
                        int sender, uint32_t sequence, uint64_t bound, Vec16& v) {
  uint64_t start = 0;
  v = load_vector(address);
  for (uint64_t looks = 1; !has_arrived(v); ++looks) {
    if (looks % kCheckEvery == 0) {
      if (team_stopped(x)) return false;
      if (bound_passed(bound, looks, start)) {
        record_team_failure(x, CallError::kTimeout, sender, mine.header, v, sequence);
        return false;
      }
    }
    v = load_vector(address);
  }
  return true;
}

// The headers before any packet is used: work-item r (r < world, not this rank) waits for rank
// r's header and checks it (record_header: a rejection, a disagreement, a failed peer). True on
// the work-item whose peer's header differs or whose wait ended without it; the kernels take
// any_of_group of it and then read no packet.
template <typename Session>
inline bool peer_header_differs(const Session& session, const Exchange& x,
                                const CallSignature& mine, uint32_t sequence, uint64_t bound,
                                size_t first) {
  if (first >= size_t(x.world_size) || int(first) == x.rank) return false;
  Vec16 header;
  return !wait_vector(session.received_header(x, int(first)), x, mine, int(first), sequence, bound,
                      header) ||
         record_header(Recorder{}, x, mine.header, header, int(first), sequence) !=
             CallError::kNone;
}

// Step 1: work-item 0 reads the call state, the group takes it.
inline CallState group_call_state(const sycl::group<1>& group, const Exchange& x, bool first) {
  CallState read{};
  if (first) read = read_call_state<WorkGroupCoop>(x);
  CallState state;
  state.slot = sycl::group_broadcast(group, read.slot, 0);
  state.failed = sycl::group_broadcast(group, read.failed, 0);
  state.sequence = sycl::group_broadcast(group, read.sequence, 0);
  state.clear_bytes = sycl::group_broadcast(group, read.clear_bytes, 0);
  return state;
}

}  // namespace tpfuse::impl::sycl_device
