// How a CPU rank thread stores, polls and takes part in a call session (tpfuse/impl/session.h):
// the CPU backend's side of the protocol, shared by its row and QK-norm paths.
//
// Memory ordering: packet words are stored with release and polled with acquire, two 32-bit
// protocol words at a time (one aligned 64-bit atomic: each word in it is still stored and read
// whole, which is all the protocol asks; every access the CPU backend makes to a workspace has
// this one size, so no two atomics of different sizes ever meet). The release on every store
// orders this rank's earlier clear of a slot before any peer's later store into it: a peer stores
// into that slot only after it has seen (acquired) a packet this rank sent after the clear.
//
// Rows move in bulk: a sender stores a whole row of packets from a plain buffer (store_packets),
// a receiver copies a whole row into a plain buffer (poll_packets) and waits only on the vectors
// that held a sentinel word when it looked; the arithmetic then runs on the plain copy, where the
// compiler vectorizes it.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>

#include "core/error.h"
#include "core/team_state.h"
#include "tpfuse/impl/lamport.h"
#include "tpfuse/impl/session.h"

namespace tpfuse::impl {

// Two protocol words, low word first (little-endian, as the 16-bit elements in a word).
using PacketUnit = uint64_t;

inline void store_vector(char* address, const Vec16& v) {
  auto* units = reinterpret_cast<PacketUnit*>(address);
  PacketUnit unit[2];
  std::memcpy(unit, &v, 16);
  __atomic_store_n(units, unit[0], __ATOMIC_RELEASE);
  __atomic_store_n(units + 1, unit[1], __ATOMIC_RELEASE);
}

inline Vec16 load_vector(const char* address) {
  const auto* units = reinterpret_cast<const PacketUnit*>(address);
  const PacketUnit unit[2] = {__atomic_load_n(units, __ATOMIC_ACQUIRE),
                              __atomic_load_n(units + 1, __ATOMIC_ACQUIRE)};
  Vec16 v;
  std::memcpy(&v, unit, 16);
  return v;
}

// The CPU's side of the error record (session.h); only the rank's own thread writes it. A
// failure of this rank's own (a timeout, a disagreement) is also announced: its mark goes into
// every rank's workspace, so that every peer's next call, wait and check fails at once.
inline void record_failure(const Exchange& x, CallError kind, int peer, const Vec16& mine,
                           const Vec16& theirs) {
  if (x.control->error == 0)
    __atomic_store_n(&x.control->error, uint32_t(1 + peer), __ATOMIC_RELEASE);
  if (x.errors->failure != 0) return;
  const uint32_t sequence = __atomic_load_n(&x.control->sequence, __ATOMIC_ACQUIRE);
  x.errors->failure_peer = uint32_t(peer);
  x.errors->mine = mine;
  x.errors->theirs = theirs;
  x.errors->sequence = sequence;
  __atomic_store_n(&x.errors->failure, uint32_t(kind), __ATOMIC_RELEASE);
  if (kind == CallError::kTimeout || kind == CallError::kMismatch) {
    const Vec16 mark = failure_mark(kind, x.rank, peer, sequence);
    for (int r = 0; r < x.world_size; ++r)
      store_vector(reinterpret_cast<char*>(x.mark_of(r)), mark);
  }
}

// A peer's failure mark, once it has arrived: this rank's failure too (kPeerFailed).
inline bool mark_arrived(const Exchange& x) {
  return has_arrived(load_vector(reinterpret_cast<const char*>(x.mark())));
}
inline void record_mark(const Exchange& x, const Vec16& mark) {
  record_failure(x, CallError::kPeerFailed, FailureMark{mark}.marking_rank(), Vec16{}, mark);
}

[[noreturn]] inline void throw_failure(const Exchange& x) {
  TPF_FAIL(describe_failure(*x.errors, x.rank, -1));
}

// A peer that failed the team (it gave up on a call, or disagreed with another rank) announced it
// (its mark): this rank's failure too, and no wait of this call can end. Throws.
inline void throw_if_marked(const Exchange& x) {
  const Vec16 mark = load_vector(reinterpret_cast<const char*>(x.mark()));
  if (!has_arrived(mark)) return;
  record_mark(x, mark);
  throw_failure(x);
}

// The CPU's clock for bounded_wait (session.h): a steady clock, read every 64 polls. Ranks may
// outnumber cores: after a short spin a poll gives the core to the peer it waits on.
struct ThreadClock {
  static constexpr uint32_t kCheckEvery = 64;
  static uint64_t now_ns() {
    return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now().time_since_epoch())
                        .count());
  }
  static void pause(uint32_t reads) {
    if (reads >= 16) std::this_thread::yield();
  }
};

// What one CPU call has learned from its peers' headers: which peers rejected their call or
// disagree with it (their packets never come, or do not mean what this call reads: the waits on
// them return NaN). The call still makes every store its signature implies, then throws
// (finish_call): a disagreement fails the team, a rejection does not.
struct CpuCall {
  const Exchange& x;
  uint32_t session_slot;
  CallSignature mine;
  uint32_t rejected = 0;     // bit per peer
  uint32_t disagreeing = 0;  // bit per peer whose header failed the team (disagrees, or failed)

  const char* header_of(int sender) const {
    return x.workspace[x.rank] + x.header_area +
           (size_t(session_slot) * size_t(x.world_size) + size_t(sender)) * 16;
  }
  // A peer's header once in (session.h's record_header, this call its Recorder): returns true
  // when the sender's packets are not this call's.
  bool header_stops(int sender, const Vec16& header) {
    return record_header(*this, x, mine.header, header, sender) != CallError::kNone;
  }
  // record_header's Recorder: a rejection is this call's to report (finish_call); a failure is the
  // team's (the error record and the mark; the record keeps the call number itself).
  void on_rejection(const Exchange&, int sender) { rejected |= 1u << sender; }
  void on_failure(const Exchange&, CallError kind, int sender, const Vec16& mine_header,
                  const Vec16& theirs, uint32_t) {
    disagreeing |= 1u << sender;
    record_failure(x, kind, sender, mine_header, theirs);
  }
};

// Waits for one vector (a header, or a packet an absent call drains): session.h's bounded_wait,
// which a peer's failure mark ends (throws) and whose timeout marks the team failed and throws
// naming the missing rank.
inline Vec16 wait_vector(const char* address, const Exchange& x, const CallSignature& mine,
                         int sender) {
  Vec16 v;
  bounded_wait<ThreadClock>(
      x.timeout_ns, [&] { return load_vector(address); },
      [&] {
        throw_if_marked(x);
        return false;
      },
      [&](const Vec16& last) {
        record_failure(x, CallError::kTimeout, sender, mine.header, last);
        throw_failure(x);
      },
      v);
  return v;
}

// Polls one packet vector until every word holds data (session.h's bounded_wait). While it waits
// it reads the sender's header: a rejected peer ends the wait with NaN, a disagreeing one fails
// the team (recorded; the wait ends with NaN, finish_call throws). A peer's failure mark throws;
// a deadline that passes marks the team failed and throws naming the missing rank.
inline Vec16 poll_vector(const char* address, CpuCall& call, int sender) {
  if ((call.rejected | call.disagreeing) & (1u << sender)) return nan_vector();
  const Exchange& x = call.x;
  Vec16 v;
  const bool arrived = bounded_wait<ThreadClock>(
      x.timeout_ns, [&] { return load_vector(address); },
      [&] {
        const Vec16 header = load_vector(call.header_of(sender));
        if (has_arrived(header) && call.header_stops(sender, header)) return true;
        throw_if_marked(x);
        return false;
      },
      [&](const Vec16&) {
        // The rank to name is one that has not begun this call (its header is not in), where
        // there is one: the sender waited on may itself be waiting for it (two-shot's gather).
        int missing = sender;
        for (int r = x.world_size - 1; r >= 0; --r) {
          if (r != x.rank && !has_arrived(load_vector(call.header_of(r)))) missing = r;
        }
        record_failure(x, CallError::kTimeout, missing, call.mine.header,
                       load_vector(call.header_of(missing)));
        throw_failure(x);
      },
      v);
  return arrived ? v : nan_vector();
}

// Stores `bytes` (a multiple of 16) of packets from the plain buffer `source`, sentinel words
// already rewritten, at `address` in a receiver's slot: store_vector's stores, for a whole row.
inline void store_packets(char* address, const void* source, size_t bytes) {
  auto* units = reinterpret_cast<PacketUnit*>(address);
  const auto* from = static_cast<const char*>(source);
  for (size_t i = 0; i < bytes / sizeof(PacketUnit); ++i) {
    PacketUnit unit;
    std::memcpy(&unit, from + i * sizeof(PacketUnit), sizeof(unit));
    __atomic_store_n(units + i, unit, __ATOMIC_RELEASE);
  }
}

// Whether a 32-bit word of plain memory holds the sentinel (bits, never values; a loop without
// an early exit, which the compiler vectorizes).
inline bool holds_sentinel(const void* data, size_t bytes) {
  const auto* from = static_cast<const char*>(data);
  uint32_t found = 0;
  for (size_t i = 0; i < bytes / 4; ++i) {
    uint32_t word;
    std::memcpy(&word, from + i * 4, 4);
    found |= uint32_t(word == kSentinel);
  }
  return found != 0;
}

// Copies `bytes` (a multiple of 16) of sender `sender`'s packets at `address` into the plain
// buffer `out`, each vector as poll_vector returns it: one look at the whole row (the common
// case: it has all arrived), then poll_vector on each vector that held a sentinel word (a wait
// that reads the sender's header, NaN for a rejected or disagreeing sender, the deadline).
inline void poll_packets(const char* address, size_t bytes, CpuCall& call, int sender, void* out) {
  auto* copy = static_cast<char*>(out);
  if ((call.rejected | call.disagreeing) & (1u << sender)) {
    const Vec16 nan = nan_vector();
    for (size_t offset = 0; offset < bytes; offset += 16) std::memcpy(copy + offset, &nan, 16);
    return;
  }
  const auto* units = reinterpret_cast<const PacketUnit*>(address);
  for (size_t i = 0; i < bytes / sizeof(PacketUnit); ++i) {
    const PacketUnit unit = __atomic_load_n(units + i, __ATOMIC_ACQUIRE);
    std::memcpy(copy + i * sizeof(PacketUnit), &unit, sizeof(unit));
  }
  if (!holds_sentinel(out, bytes)) return;
  for (size_t offset = 0; offset < bytes; offset += 16) {
    Vec16 v;
    std::memcpy(&v, copy + offset, 16);
    if (has_arrived(v)) continue;
    v = poll_vector(address + offset, call, sender);
    std::memcpy(copy + offset, &v, 16);
  }
}

// The end of a CPU call, after it has arrived: every peer's header is checked; a disagreement
// throws (the team is failed), then a rejection (the team goes on).
inline void finish_call(CpuCall& call) {
  for (int r = 0; r < call.x.world_size; ++r) {
    if (r == call.x.rank || ((call.rejected | call.disagreeing) & (1u << r))) continue;
    call.header_stops(r, wait_vector(call.header_of(r), call.x, call.mine, r));
  }
  if (call.disagreeing != 0) throw_failure(call.x);
  for (int r = 0; r < call.x.world_size; ++r) {
    if (call.rejected & (1u << r)) {
      TPF_FAIL("rank " << call.x.rank << ": rank " << r
                       << " rejected its part of this call (its own error says why); this "
                          "rank's outputs are NaN, and the team goes on");
    }
  }
}

// The session's Coop on the CPU: the rank's one thread is the only participant. The control
// block is only ever touched by its own rank's thread; the atomics keep it well-defined anyway.
struct ThreadCoop {
  static uint32_t load(const uint32_t* word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }
  static uint64_t load(const uint64_t* word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }
  static void store(uint32_t* word, uint32_t value) {
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
  }
  static void store(uint64_t* word, uint64_t value) {
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
  }
  static uint32_t add_arrival(uint32_t* count) {
    return __atomic_fetch_add(count, 1u, __ATOMIC_ACQ_REL);
  }
  static uint32_t participants() { return 1; }
  static int64_t thread_index() { return 0; }
  static int64_t thread_count() { return 1; }
  static void store_sentinel(Vec16* address) {
    store_vector(reinterpret_cast<char*>(address), sentinel_vector());
  }
  static Vec16 load_mark(const Vec16* address) {
    return load_vector(reinterpret_cast<const char*>(address));
  }
  static void record_mark(const Exchange& x, const Vec16& mark) { impl::record_mark(x, mark); }
};

using CpuSession = LamportSession<ThreadCoop>;

// The session of this rank's next call. A team that failed earlier, here or on a peer (its
// mark), refuses the call before anything is written: RefusedCall.
inline CpuSession begin_session(const Exchange& exchange) {
  const CpuSession session(read_call_state<ThreadCoop>(exchange));
  if (session.failed()) {
    throw RefusedCall(describe_failure(*exchange.errors, exchange.rank, -1) +
                      "; this call was refused and wrote nothing");
  }
  return session;
}

// Stores this rank's call header into every peer.
inline void send_header(const Exchange& x, const CpuSession& session, const CallSignature& mine) {
  for (int r = 0; r < x.world_size; ++r) {
    if (r != x.rank) store_vector(x.workspace[r] + session.header_send_offset(x), mine.header);
  }
}

// The start of a CPU call: its signature as this call's number sends it (sequenced_signature),
// stored into every peer as the call's header.
inline CpuCall start_call(const Exchange& x, const CpuSession& session,
                          const CallSignature& signature) {
  CpuCall call{x, session.slot(), sequenced_signature(signature, session.sequence())};
  send_header(x, session, call.mine);
  return call;
}

}  // namespace tpfuse::impl
