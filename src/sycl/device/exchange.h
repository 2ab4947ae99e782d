// How SYCL device code stores, polls and takes part in a call session (tpfuse/impl/session.h):
// the SYCL side of the Lamport protocol, for kernels compiled at run time (src/sycl/compiler.h
// embeds this file as "tpfuse/sycl/exchange.h"). A first cut, run so far by the toy exchange of
// tests/sycl/ on Intel's OpenCL CPU device: the backend's kernels will build on it.
//
// Memory ordering: every protocol word (32 bits, lamport.h's unit) is stored with release and
// polled with acquire through sycl::atomic_ref at TPF_SYCL_ATOMIC_SCOPE: system by default
// (peers may be other devices, or other processes), device where the host finds that the device
// supports no wider scope (it passes -DTPF_SYCL_ATOMIC_SCOPE=device). The release on every store
// orders this rank's earlier clear of a slot before any peer's later store into it: a peer
// stores into that slot only after it has acquired a packet this rank sent after the clear (as
// on the CPU backend, src/cpu/exchange.h). Words, not 16-byte vectors: a vector store is not
// guaranteed to land whole, and the protocol checks every word (has_arrived).
//
// A participant of the session is a work-group (one per rank here): its work-items spread the
// sends, the clear and the receives; one of them arrives, after a group barrier.
//
// WARNING: a rank that polls needs its peers to be running at the same time. On the OpenCL CPU
// device a work-group runs on one thread and the device has one compute unit per core: more
// spinning ranks than cores wait for a peer that never gets a core, until the poll bound ends the
// wait. Every poll here is bounded (max_polls): a missing peer is a timeout, never a hang.
#pragma once

#include <sycl/sycl.hpp>

#include <cstdint>

#include "tpfuse/impl/lamport.h"
#include "tpfuse/impl/session.h"

#ifndef TPF_SYCL_ATOMIC_SCOPE
#define TPF_SYCL_ATOMIC_SCOPE system
#endif

namespace tpfuse::impl::sycl_device {

template <typename T>
using ProtocolAtomic =
    sycl::atomic_ref<T, sycl::memory_order::relaxed, sycl::memory_scope::TPF_SYCL_ATOMIC_SCOPE>;

inline uint32_t load_acquire(const uint32_t* word) {
  return ProtocolAtomic<uint32_t>(*const_cast<uint32_t*>(word)).load(sycl::memory_order::acquire);
}
inline uint64_t load_acquire(const uint64_t* word) {
  return ProtocolAtomic<uint64_t>(*const_cast<uint64_t*>(word)).load(sycl::memory_order::acquire);
}
inline void store_release(uint32_t* word, uint32_t value) {
  ProtocolAtomic<uint32_t>(*word).store(value, sycl::memory_order::release);
}
inline void store_release(uint64_t* word, uint64_t value) {
  ProtocolAtomic<uint64_t>(*word).store(value, sycl::memory_order::release);
}

inline void store_vector(Vec16* address, const Vec16& v) {
  TPF_UNROLL
  for (int i = 0; i < 4; ++i) store_release(&address->word[i], v.word[i]);
}

inline Vec16 load_vector(const Vec16* address) {
  Vec16 v;
  TPF_UNROLL
  for (int i = 0; i < 4; ++i) v.word[i] = load_acquire(&address->word[i]);
  return v;
}

// Polls a vector until every word holds data, at most `max_polls` looks (0: no bound), giving up
// early once `failed` (the rank's control-block error word) is set: after one work-item's poll has
// run out, its group's others do not each wait out the bound again. False if it gave up; `out`
// then holds the last look.
inline bool poll_vector(const Vec16* address, uint64_t max_polls, const uint32_t* failed,
                        Vec16& out) {
  out = load_vector(address);
  for (uint64_t polls = 1; !has_arrived(out); ++polls) {
    if (max_polls != 0 && polls >= max_polls) return false;
    if (polls % 1024 == 0 && load_acquire(failed) != 0) return false;
    out = load_vector(address);
  }
  return true;
}

inline sycl::nd_item<1> this_item() {
  return sycl::ext::oneapi::this_work_item::get_nd_item<1>();
}

// A failure of the team seen by this rank (kTimeout, kMismatch, or kPeerFailed from a header):
// the first claims the control block's error word, fills the error record (host memory: the
// details, then the kind with release) and, for a failure of its own, stores its mark into every
// rank's workspace.
inline void record_team_failure(const Exchange& x, CallError kind, int peer, const Vec16& mine,
                                const Vec16& theirs, uint32_t sequence) {
  uint32_t expected = 0;
  if (!ProtocolAtomic<uint32_t>(x.control->error)
           .compare_exchange_strong(expected, uint32_t(1 + peer), sycl::memory_order::acq_rel)) {
    return;
  }
  x.errors->failure_peer = uint32_t(peer);
  x.errors->sequence = sequence;
  x.errors->mine = mine;
  x.errors->theirs = theirs;
  store_release(&x.errors->failure, uint32_t(kind));
  if (kind == CallError::kTimeout || kind == CallError::kMismatch) {
    const Vec16 mark = failure_mark(kind, x.rank, peer, sequence);
    for (int r = 0; r < x.world_size; ++r) store_vector(x.mark_of(r), mark);
  }
}

// The session's Coop (session.h) where a work-group is the rank's one participant.
struct WorkGroupCoop {
  static uint32_t load(const uint32_t* word) { return load_acquire(word); }
  static uint64_t load(const uint64_t* word) { return load_acquire(word); }
  static void store(uint32_t* word, uint32_t value) { store_release(word, value); }
  static void store(uint64_t* word, uint64_t value) { store_release(word, value); }
  static uint32_t add_arrival(uint32_t* count) {
    return ProtocolAtomic<uint32_t>(*count).fetch_add(1u, sycl::memory_order::acq_rel);
  }
  static uint32_t participants() { return 1; }
  static int64_t thread_index() { return int64_t(this_item().get_local_linear_id()); }
  static int64_t thread_count() { return int64_t(this_item().get_local_range(0)); }
  static void store_sentinel(Vec16* address) { store_vector(address, sentinel_vector()); }
  static Vec16 load_mark(const Vec16* address) { return load_vector(address); }
  static void record_mark(const Exchange& x, const Vec16& mark) {
    uint32_t expected = 0;
    const FailureMark failure{mark};
    if (ProtocolAtomic<uint32_t>(x.control->error)
            .compare_exchange_strong(expected, uint32_t(1 + failure.marking_rank()),
                                     sycl::memory_order::acq_rel)) {
      x.errors->failure_peer = uint32_t(failure.marking_rank());
      x.errors->sequence = failure.sequence();
      x.errors->theirs = mark;  // what describe_failure tells of the marking rank's failure
      store_release(&x.errors->failure, uint32_t(CallError::kPeerFailed));
    }
  }
};

}  // namespace tpfuse::impl::sycl_device
