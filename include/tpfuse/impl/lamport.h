// The Lamport one-shot protocol: workspace layout, sentinel, slot rotation. Host+device.
//
// The story (the GPU kernels in src/cuda/ and the CPU backend in src/cpu/ both follow it, through
// the functions below and the call session of tpfuse/impl/session.h):
//
//  * Each rank's workspace holds kSlots = 3 slots; a slot holds one packet per sender rank,
//    packet_bytes each. Call k of a rank uses slot k % 3 (the control block keeps k % 3 itself,
//    not k, so no counter ever wraps onto the wrong slot). Rank r stores its packet for call k
//    (its input, 16-byte vectors) into slot k % 3, sender index r, of every other rank's
//    workspace. Its own contribution it reads from its input. A rank's own sender region is read
//    only by the QK norm (whose per-token packet is not in any input), and only words the same
//    thread stored earlier in the same call: no clear needs to touch it.
//  * An empty word holds the sentinel, negative zero's bit pattern 0x80000000. A receiver polls
//    its own slot until no 32-bit word of the vectors it needs holds the sentinel. A sender
//    rewrites payload words equal to the sentinel to +0 (0x00000000) before storing, so the
//    sentinel never appears as data. For 16-bit types a word holds two elements: the word
//    0x80000000 is (low +0, high -0) and becomes (+0, +0). Only zeros change sign; the sum
//    differs from the unrewritten one at most in the sign of a zero.
//  * In call k each rank also re-fills slot (k + 2) % 3 of its own workspace (the other
//    senders' regions) with the sentinel:
//    that is the slot call k - 1 read, so its readers (this rank's call k - 1) are done. The bytes
//    to clear are those call k - 1 received, recorded in the control block.
//  * Ranks may drift one call apart with no barrier: a rank in call k + 1 stores into slot
//    (k + 1) % 3 of a peer still in call k, which that peer cleared in call k - 1 and will not
//    touch again before its call k + 1 reads it.
//  * The slot index lives in device memory and advances once per call, by the last block to
//    have read it (an arrival count), so no host state changes per call and the kernel can be
//    captured in a CUDA graph and replayed forever.
//
// Two-shot uses the same slots, sentinel, rotation and clearing. Rank o owns the contiguous tokens
// [o * per, (o + 1) * per) (per = ceil(tokens / W), the last ranks may own fewer or none). In a
// call, sender r's region of the slot in rank o's workspace holds rows [0, per): r's input rows
// of the tokens o owns (reduce-scatter); and rows [per, 2 per): r's finished, rounded rows of
// the tokens r owns (all-gather). Every word stored into a slot is polled by its receiver in the
// same call, so the argument above (clear what the previous call read, drift of at most one
// call) holds unchanged: a rank finishes call k only after every rank has sent its call-k rows.
//
// Call headers: after the slots, each workspace holds one 16-byte header per slot and sender. In
// every call a sender stores its call's signature (session.h: op, dtype, epilogue, tokens, width,
// and a hash of the rest) into its header of the call's slot in every other rank, and clears the
// previous call's headers with the slot. Receivers compare each sender's header with their own
// call's: ranks that disagree on a call, or a peer that rejected its call (its header says so and
// it sends no packets), are detected instead of read as data (session.h says how).
//
// Call sequence: the control block counts the calls a rank has made (ControlBlock::sequence), and
// a header carries the call's number folded into its hash (sequenced_signature, session.h), so a
// header or packet left from another call is never taken for this one's.
//
// After the headers, the failure mark: one 16-byte word a rank's peers store into when a call of
// theirs fails the team (a timeout, a disagreement): who failed it, why, and in which call. A
// rank reads its own mark at the start of every call, in the slow path of its polls and in
// Team::check, so a failure on one rank is an error on every rank at once: a late peer's call
// is refused instead of combined with a call its peers gave up on (FailureMark, session.h).
//
// After the mark each workspace holds a handshake area: one 16-byte word per sender, which the
// team's creation handshake stores into and polls (proof that peer stores arrive).
//
// WARNING: the sentinel is a bit pattern. Compare bits, never values: -0.0f == 0.0f is true and a
// value comparison would accept an empty word as data (or, written as "== 0 && signbit", get
// optimized into exactly that). Every comparison here is on uint32_t.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tpfuse/impl/config.h"
#include "tpfuse/impl/numeric.h"
#include "tpfuse/limits.h"

namespace tpfuse::impl {

constexpr uint32_t kSentinel = 0x80000000u;
constexpr int kSlots = 3;

// Per-rank control block, in the rank's own memory (never touched by peers).
struct alignas(16) ControlBlock {
  uint32_t slot;         // slot of the next call: calls completed modulo kSlots
  uint32_t arrivals;     // blocks of the current call that have read call_counter
  uint32_t error;        // nonzero once the team failed: 1 + the rank it names (the GPU's claim
                         // of ErrorRecord::failure)
  uint32_t call_claims;  // per-call errors claimed (the GPU's claim of ErrorRecord::call_error)
  uint64_t slot_bytes[kSlots];  // bytes per sender each slot received in its last call
  uint32_t sequence;            // calls this rank has made, modulo 2^31 (the next call's number)
  // Blocks of the call in each slot that have written their outputs (the GPU's fused kernels:
  // a call that failed once begun waits for them all before it fills its outputs with NaN).
  // Zeroed for the next call by the last block to arrive.
  uint32_t finished[kSlots];
};

TPF_HOST_DEVICE uint32_t next_sequence(uint32_t sequence) {
  return (sequence + 1) & 0x7fffffffu;
}

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

// Byte offset, inside any rank's workspace, of sender `sender`'s call header in `slot`.
TPF_HOST_DEVICE size_t header_offset(uint32_t slot, int sender, int world_size,
                                     size_t packet_bytes) {
  return size_t(kSlots) * size_t(world_size) * packet_bytes +
         (size_t(slot) * size_t(world_size) + size_t(sender)) * 16;
}

// Byte offset, inside any rank's workspace, of its failure mark (after the headers).
TPF_HOST_DEVICE size_t mark_offset(int world_size, size_t packet_bytes) {
  return size_t(kSlots) * size_t(world_size) * (packet_bytes + 16);
}

// Bytes of the slots, the call headers and the failure mark: what a team fills with the sentinel.
TPF_HOST_DEVICE size_t workspace_bytes(int world_size, size_t packet_bytes) {
  return mark_offset(world_size, packet_bytes) + 16;
}

// Bytes of the handshake area after the workspace.
constexpr size_t kHandshakeBytes = 16 * kMaxWorldSize;

// Bytes to allocate for one rank's workspace: the slots and the handshake area.
TPF_HOST_DEVICE size_t allocation_bytes(int world_size, size_t packet_bytes) {
  return workspace_bytes(world_size, packet_bytes) + kHandshakeBytes;
}

// The two-shot token split (see above).
struct TwoShotLayout {
  int64_t tokens;
  int64_t per_rank;
  TPF_HOST_DEVICE TwoShotLayout(int64_t token_count, int world_size)
      : tokens(token_count), per_rank((token_count + world_size - 1) / world_size) {}
  TPF_HOST_DEVICE int owner(int64_t token) const { return int(token / per_rank); }
  TPF_HOST_DEVICE int64_t begin(int rank) const {
    return int64_t(rank) * per_rank < tokens ? int64_t(rank) * per_rank : tokens;
  }
  TPF_HOST_DEVICE int64_t count(int rank) const {
    const int64_t end =
        (int64_t(rank) + 1) * per_rank < tokens ? (int64_t(rank) + 1) * per_rank : tokens;
    return end - begin(rank);
  }
  // Bytes of each sender region a call uses (what the next call but one clears).
  TPF_HOST_DEVICE uint64_t sender_bytes(size_t row_bytes) const {
    return uint64_t(2 * per_rank) * row_bytes;
  }
  // Byte offset, inside a sender region, of input row `local` (reduce-scatter) and of finished
  // row `local` (all-gather).
  TPF_HOST_DEVICE size_t scatter_row(int64_t local, size_t row_bytes) const {
    return size_t(local) * row_bytes;
  }
  TPF_HOST_DEVICE size_t gather_row(int64_t local, size_t row_bytes) const {
    return size_t(per_rank + local) * row_bytes;
  }
};

// Most tokens of `row_bytes` a two-shot call carries: 2 * ceil(T / W) rows per sender region.
TPF_HOST_DEVICE int64_t twoshot_max_tokens(int world_size, size_t packet_bytes, size_t row_bytes) {
  return int64_t(world_size) * int64_t(packet_bytes / (2 * row_bytes));
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
