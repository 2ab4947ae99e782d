// The CPU backend's packet stores and polls (shared by the add-RMSNorm and QK-norm paths).
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

#include "common/error.h"
#include "tpfuse/impl/lamport.h"

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

// Throws if this rank's team failed earlier.
inline void check_not_failed(const uint32_t* error_flag, int rank) {
  const uint32_t failed = __atomic_load_n(error_flag, __ATOMIC_ACQUIRE);
  if (failed != 0) {
    TPF_FAIL("rank " << rank << ": the team failed earlier (rank " << failed - 1
                     << " did not arrive); create a new team");
  }
}

// Re-fills the slot the previous call read (recorded in the control block) with the sentinel,
// but this rank's own sender region, which no call reads before storing (tpfuse/impl/lamport.h).
inline void clear_previous_slot(char* my_workspace, const ControlBlock& control, int world_size,
                                size_t packet_bytes, int rank) {
  const uint32_t clear_slot = slot_to_clear(control.slot);
  const size_t clear_bytes = control.slot_bytes[clear_slot];
  for (int r = 0; r < world_size; ++r) {
    if (r == rank) continue;
    char* base = my_workspace + packet_offset(clear_slot, r, world_size, packet_bytes);
    for (size_t offset = 0; offset < clear_bytes; offset += 16) {
      store_vector(base + offset, sentinel_vector());
    }
  }
}

}  // namespace tpfuse::impl
