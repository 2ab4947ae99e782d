// The Lamport one-shot protocol: workspace layout, sentinel, slot rotation. Host+device.
//
// The story (the GPU kernel in src/cuda/oneshot.cu and the CPU backend in src/cpu/cpu_team.cc
// both follow it, through the functions below):
//
//  * Each rank's workspace holds kSlots = 3 slots; a slot holds one packet per sender rank,
//    packet_bytes each. Call k of a rank uses slot k % 3 (the control block keeps k % 3 itself,
//    not k, so no counter ever wraps onto the wrong slot). Rank r stores its packet for call k
//    (its input, 16-byte vectors) into slot k % 3, sender index r, of every rank's workspace,
//    its own included.
//  * An empty word holds the sentinel, negative zero's bit pattern 0x80000000. A receiver polls
//    its own slot until no 32-bit word of the vectors it needs holds the sentinel. A sender
//    rewrites payload words equal to the sentinel to +0 (0x00000000) before storing, so the
//    sentinel never appears as data. For 16-bit types a word holds two elements: the word
//    0x80000000 is (low +0, high -0) and becomes (+0, +0). Only zeros change sign; the sum
//    differs from the unrewritten one at most in the sign of a zero.
//  * In call k each rank also re-fills slot (k + 2) % 3 of its own workspace with the sentinel:
//    that is the slot call k - 1 read, so its readers (this rank's call k - 1) are done. The bytes
//    to clear are those call k - 1 received, recorded in the control block.
//  * Ranks may drift one call apart with no barrier: a rank in call k + 1 stores into slot
//    (k + 1) % 3 of a peer still in call k, which that peer cleared in call k - 1 and will not
//    touch again before its call k + 1 reads it.
//  * The slot index lives in device memory and advances once per call, by the last block to
//    have read it (an arrival count), so no host state changes per call and the kernel can be
//    captured in a CUDA graph and replayed forever.
//
// WARNING: the sentinel is a bit pattern. Compare bits, never values: -0.0f == 0.0f is true and a
// value comparison would accept an empty word as data (or, written as "== 0 && signbit", get
// optimized into exactly that). Every comparison here is on uint32_t.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tpfuse/impl/config.h"
#include "tpfuse/impl/numeric.h"

namespace tpfuse::impl {

constexpr uint32_t kSentinel = 0x80000000u;
constexpr int kSlots = 3;
constexpr int kMaxWorld = 16;

// Per-rank control block, in the rank's own memory (never touched by peers).
struct alignas(16) ControlBlock {
  uint32_t slot;      // slot of the next call: calls completed modulo kSlots
  uint32_t arrivals;  // blocks of the current call that have read call_counter
  uint32_t error;     // nonzero once a call timed out: 1 + the rank that did not arrive
  uint32_t pad;
  uint64_t slot_bytes[kSlots];  // bytes per sender each slot received in its last call
};

TPF_HOST_DEVICE uint32_t next_slot(uint32_t slot) {
  return slot + 1 == kSlots ? 0 : slot + 1;
}
// The slot the previous call used: (slot + 2) % 3.
TPF_HOST_DEVICE uint32_t slot_to_clear(uint32_t slot) {
  return slot == 0 ? kSlots - 1 : slot - 1;
}

// Byte offset, inside any rank's workspace, of sender `sender`'s packet in `slot`.
TPF_HOST_DEVICE size_t packet_offset(uint32_t slot, int sender, int world_size,
                                     size_t packet_bytes) {
  return (size_t(slot) * size_t(world_size) + size_t(sender)) * packet_bytes;
}

TPF_HOST_DEVICE size_t workspace_bytes(int world_size, size_t packet_bytes) {
  return size_t(kSlots) * size_t(world_size) * packet_bytes;
}

TPF_HOST_DEVICE Vec16 sentinel_vector() {
  return Vec16{{kSentinel, kSentinel, kSentinel, kSentinel}};
}

// A payload vector as it may be sent: any word equal to the sentinel becomes +0.
TPF_HOST_DEVICE Vec16 rewrite_sentinel(Vec16 v) {
  TPF_UNROLL
  for (int i = 0; i < 4; ++i) v.word[i] = v.word[i] == kSentinel ? 0u : v.word[i];
  return v;
}

// True when every word of a polled vector holds data. Each 32-bit word is stored atomically,
// but a 16-byte store is not guaranteed to land as one, so every word is checked.
TPF_HOST_DEVICE bool has_arrived(const Vec16& v) {
  return v.word[0] != kSentinel && v.word[1] != kSentinel && v.word[2] != kSentinel &&
         v.word[3] != kSentinel;
}

}  // namespace tpfuse::impl
