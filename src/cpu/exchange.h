// How a CPU rank thread stores, polls and takes part in a call session (tpfuse/impl/session.h):
// the CPU backend's side of the protocol, shared by its row and QK-norm paths.
//
// Memory ordering: packet words are stored with release and polled with acquire (per 32-bit
// word, as on the GPU, where only word stores are single-copy atomic). The release on every
// store orders this rank's earlier clear of a slot before any peer's later store into it: a peer
// stores into that slot only after it has seen (acquired) a packet this rank sent after the
// clear.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>

#include "core/error.h"
#include "tpfuse/impl/lamport.h"
#include "tpfuse/impl/session.h"

namespace tpfuse::impl {

inline void store_word(uint32_t* word, uint32_t value) {
  __atomic_store_n(word, value, __ATOMIC_RELEASE);
}
inline uint32_t load_word(const uint32_t* word) {
  return __atomic_load_n(word, __ATOMIC_ACQUIRE);
}

inline void store_vector(char* address, const Vec16& v) {
  auto* words = reinterpret_cast<uint32_t*>(address);
  for (int i = 0; i < 4; ++i) store_word(words + i, v.word[i]);
}

inline Vec16 load_vector(const char* address) {
  const auto* words = reinterpret_cast<const uint32_t*>(address);
  Vec16 v;
  for (int i = 0; i < 4; ++i) v.word[i] = load_word(words + i);
  return v;
}

// Polls one packet vector until every word holds data, or the deadline passes: then marks the
// team failed (error_flag = 1 + sender) and throws naming the missing rank.
inline Vec16 poll_vector(const char* address, uint64_t timeout_ns, uint32_t* error_flag, int rank,
                         int sender) {
  Vec16 v = load_vector(address);
  if (has_arrived(v)) return v;
  const auto start = std::chrono::steady_clock::now();
  for (uint64_t spins = 0;; ++spins) {
    v = load_vector(address);
    if (has_arrived(v)) return v;
    // Ranks may outnumber cores: after a short spin, give the core to the peer being waited on.
    if (spins >= 16) std::this_thread::yield();
    if (spins % 64 == 63) {
      const auto waited = std::chrono::steady_clock::now() - start;
      const auto waited_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(waited).count();
      if (timeout_ns != 0 && uint64_t(waited_ns) > timeout_ns) {
        __atomic_store_n(error_flag, uint32_t(1 + sender), __ATOMIC_RELEASE);
        TPF_FAIL("rank " << rank << " waited " << double(waited_ns) * 1e-9 << " s for rank "
                         << sender << "'s packet: peer did not arrive; the team is now failed");
      }
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
};

using CpuSession = LamportSession<ThreadCoop>;

// The session of this rank's next call; throws if the team failed earlier (a failed rank sends
// nothing, so its peers time out too).
inline CpuSession begin_session(const Exchange& exchange) {
  const CpuSession session(read_call_state<ThreadCoop>(exchange.control));
  if (session.failed()) {
    TPF_FAIL("rank " << exchange.rank << ": the team failed earlier (rank "
                     << ThreadCoop::load(&exchange.control->error) - 1
                     << " did not arrive); create a new team");
  }
  return session;
}

}  // namespace tpfuse::impl
