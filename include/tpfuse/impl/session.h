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
//
// Call headers (lamport.h): before its packets a sender stores its call's signature into its
// header of the slot in every other rank. A receiver compares each sender's header with its own
// signature where that costs nothing on the path every good call takes: a poll that is still
// waiting after a while (the slow path) reads the sender's header, and one thread per sender
// checks the header once the call's data is in. What a mismatch means:
//   * the sender rejected its call (kRejected, and it sends no packets): every wait on it ends at
//     once with NaN, the call completes on every rank (every sender still makes every store its
//     signature implies), the rejecting rank drains what its peers sent it (absent calls below),
//     and the team goes on. The peers' outputs of that call are NaN; Team::check reports it.
//   * the ranks disagree (another op, algorithm, dtype, epilogue, token count, width or eps):
//     waits end with NaN, the team is failed (what each sender stored no longer matches what
//     each receiver will clear), and every rank's error names the peer and the field.
// A rank with nothing to send (a rejected call, or a call of zero tokens) still takes its turn
// as an absent call: its header, a drain of what its peers' signatures say they sent it, and the
// slot's clear and advance, so that its slot index stays in step with its peers'.
//
// Written once here too, at the end of this file: every wait of every backend is a bounded_wait
// (the backend gives its clock, its loads, when to give up, and what a timeout records; the GPU's
// packet poll in the hot kernels is the same loop written out, cuda/device_ops.cuh says why),
// and what a differing header means is header_verdict, recorded by record_header through the
// backend's Recorder (the GPU writes its error record; the CPU also keeps the call's own account).
#pragma once

#include <cstddef>
#include <cstdint>

#include "tpfuse/impl/config.h"
#include "tpfuse/impl/lamport.h"
#include "tpfuse/limits.h"

namespace tpfuse::impl {

// What a call's header says (CallSignature::word[0] bits 0-3).
enum class CallOp : uint32_t {
  kRowsOneShot = 1,  // allreduce_add_rmsnorm / allreduce, one-shot
  kRowsTwoShot = 2,  // the same, two-shot
  kQkOneShot = 3,    // allreduce_qk_rmsnorm, fused
  kRejected = 4,     // the sender rejected its call and sends no packets
  kNccl = 5,         // the NCCL path (CUDA: NCCL's all-reduce; the CPU: a stand-in whose sums go
                     // one-shot), labelled so that a fused peer is told the algorithm differs
  kFailed = 6,  // the sender's team has failed: word[1] the failure's kind, word[2] the rank it
                // names (a turn on the NCCL path of a call refused there: failed_signature)
};
// word[0] bit of a kNccl header whose all-reduce serves the QK norm (its sums), not a row call.
constexpr uint32_t kStandInQkBit = 1u << 21;

// A call's signature, as its header carries it. No word is ever the sentinel (each < 2^31):
//   word[0]: op | dtype << 4 | residual << 8 | norm << 9 | norm weight << 10 | rope << 12
//            (the QK norm) or the FP8 output's QuantMode << 12 | MoE finalize << 16 (rows)
//   word[1]: tokens
//   word[2]: width (hidden for rows, q_global_size for the QK norm)
//   word[3]: a 31-bit hash of the words above and of what else the ranks must agree on (eps;
//            for rows the MoE top-k; for the QK norm k_global_size, head_dim, rotary_dim,
//            kv_replicas)
// A receiver's cheap check compares word[3] alone; on a difference the whole header names the
// field.
struct CallSignature {
  Vec16 header;
  TPF_HOST_DEVICE CallOp op() const { return CallOp(header.word[0] & 0xfu); }
  TPF_HOST_DEVICE uint32_t dtype_code() const { return (header.word[0] >> 4) & 0xfu; }
  TPF_HOST_DEVICE int64_t tokens() const { return int64_t(header.word[1]); }
  TPF_HOST_DEVICE int64_t width() const { return int64_t(header.word[2]); }
  TPF_HOST_DEVICE uint32_t hash() const { return header.word[3]; }
};

TPF_HOST_DEVICE uint32_t signature_hash(uint32_t seed, uint32_t word) {
  // FNV-1a over the word's bytes.
  uint32_t h = seed;
  for (int i = 0; i < 4; ++i) h = (h ^ ((word >> (8 * i)) & 0xffu)) * 16777619u;
  return h;
}

// Builds a signature from its first three words and the extra words only the hash covers.
TPF_HOST_DEVICE CallSignature make_signature(uint32_t word0, uint32_t tokens, uint32_t width,
                                             const uint32_t* extra, int extra_count) {
  CallSignature s;
  s.header.word[0] = word0 & 0x7fffffffu;
  s.header.word[1] = tokens & 0x7fffffffu;
  s.header.word[2] = width & 0x7fffffffu;
  uint32_t h = 2166136261u;
  for (int i = 0; i < 3; ++i) h = signature_hash(h, s.header.word[i]);
  for (int i = 0; i < extra_count; ++i) h = signature_hash(h, extra[i]);
  s.header.word[3] = h & 0x7fffffffu;
  return s;
}

TPF_HOST_DEVICE CallSignature rejected_signature() {
  return make_signature(uint32_t(CallOp::kRejected), 0, 0, nullptr, 0);
}

// The signature as call number `sequence` of a rank sends it: the number folded into the hash
// word (an odd multiplier is a bijection on 31 bits, so two numbers never fold alike; the word
// stays below 2^31, never the sentinel). Headers of another call of the same shape then differ.
TPF_HOST_DEVICE uint32_t sequence_fold(uint32_t sequence) {
  return (sequence * 2654435761u) & 0x7fffffffu;
}
TPF_HOST_DEVICE CallSignature sequenced_signature(CallSignature s, uint32_t sequence) {
  s.header.word[3] ^= sequence_fold(sequence);
  return s;
}

TPF_HOST_DEVICE bool same_signature(const Vec16& a, const Vec16& b) {
  return a.word[0] == b.word[0] && a.word[1] == b.word[1] && a.word[2] == b.word[2] &&
         a.word[3] == b.word[3];
}

// A NaN in every element of any dtype (fp32 0x7fc07fc0; bf16 and fp16 0x7fc0): what a wait
// that ended without data (a timeout, a rejected or disagreeing peer) returns, so that the
// call's outputs are NaN rather than plausible numbers.
TPF_HOST_DEVICE Vec16 nan_vector() {
  return Vec16{{0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u}};
}

// How a call failed, as a rank's ErrorRecord keeps it.
enum class CallError : uint32_t {
  kNone = 0,
  kTimeout = 1,       // a peer's packet did not arrive in time (fails the team)
  kMismatch = 2,      // a peer's call disagrees with this rank's (fails the team)
  kPeerRejected = 3,  // a peer rejected its call; this call's outputs are NaN (the team goes on)
  kBadPosition = 4,   // a QK-norm position outside the cos/sin cache; that token's outputs are NaN
  kPeerFailed = 5,    // a peer failed the team (its failure mark, below; fails the team here too)
};

// What a rank stores into every rank's failure mark (lamport.h) when a call of its fails the
// team: the failure's kind (kTimeout or kMismatch), the rank that failed it, the rank that
// failure names, and the failing call's number. No word is the sentinel; a mark that has
// arrived (every word in) means the team is failed.
struct FailureMark {
  Vec16 word;
  TPF_HOST_DEVICE CallError kind() const { return CallError(word.word[0]); }
  TPF_HOST_DEVICE int marking_rank() const { return int(word.word[1]); }
  TPF_HOST_DEVICE int named_rank() const { return int(word.word[2]); }
  TPF_HOST_DEVICE uint32_t sequence() const { return word.word[3]; }
};
constexpr uint32_t kUnknownSequence = 0x7fffffffu;  // a mark whose call number is not known
TPF_HOST_DEVICE Vec16 failure_mark(CallError kind, int rank, int named, uint32_t sequence) {
  return Vec16{{uint32_t(kind), uint32_t(rank), uint32_t(named), sequence & 0x7fffffffu}};
}

// What a rank whose team has failed sends in its turn on the NCCL path (CallOp::kFailed): a peer
// records it as its own failure (kPeerFailed), as it would a failure mark.
TPF_HOST_DEVICE CallSignature failed_signature(CallError kind, int named) {
  return make_signature(uint32_t(CallOp::kFailed), uint32_t(kind), uint32_t(named), nullptr, 0);
}

// One rank's errors, in host memory (mapped into the device on CUDA) so the host reads them
// without synchronizing with a running kernel. The first failure wins and stays; the per-call
// error is the first since Team::check last reported one. A writer fills the details first and
// the kind (failure, call_error) last, so a reader that sees the kind sees its details. On the
// GPU the first writer is decided in device memory (the control block's error and call_claims),
// never by an atomic on this record: system-scope atomics on host memory are not supported over
// every host link (PCIe without host atomics).
struct alignas(16) ErrorRecord {
  uint32_t failure;       // CallError that failed the team, or kNone
  uint32_t failure_peer;  // the rank it names
  uint32_t call_error;    // kPeerRejected since the last check, or kNone
  uint32_t call_peer;
  Vec16 mine;              // kMismatch: this rank's signature
  Vec16 theirs;            // kMismatch: the peer's
  int64_t position_token;  // kBadPosition: the token, its position, and the cache's rows
  int64_t position;
  int64_t max_position;
  // Per-call errors Team::check has reported and cleared: the GPU claims call_error only while
  // its control block's call_claims equals this.
  uint32_t call_generation;
  uint32_t sequence;  // failures: the number of this rank's call that failed (CPU backend)
};

// The team side of every call: what a rank needs to exchange packets with its peers.
struct Exchange {
  // Base of every rank's workspace as this rank addresses it (peer pointers over NVLink on CUDA).
  char* workspace[kMaxWorldSize];
  ControlBlock* control;  // this rank's control block
  ErrorRecord* errors;    // this rank's error record (host memory; mapped on CUDA)
  int rank;
  int world_size;
  size_t packet_bytes;  // one sender region of one slot
  size_t header_area;   // header_offset(0, 0, world_size, packet_bytes): where the headers start
  uint64_t timeout_ns;  // 0: wait forever

  // This rank's failure mark (lamport.h), which its peers store into.
  TPF_HOST_DEVICE const Vec16* mark() const {
    return reinterpret_cast<const Vec16*>(workspace[rank] + header_area +
                                          size_t(kSlots) * size_t(world_size) * 16);
  }
  // Rank `receiver`'s failure mark as this rank addresses it.
  TPF_HOST_DEVICE Vec16* mark_of(int receiver) const {
    return reinterpret_cast<Vec16*>(workspace[receiver] + header_area +
                                    size_t(kSlots) * size_t(world_size) * 16);
  }
};

// What a call reads of its control block (and its failure mark) before it touches a slot.
struct CallState {
  uint32_t slot;
  uint32_t failed;       // nonzero: the team failed (here, or a peer's mark says so)
  uint32_t sequence;     // this call's number
  uint64_t clear_bytes;  // bytes per sender the previous call's slot received
};

// Reads the call state. Coop::load picks the loads: volatile on the GPU (a previous grid wrote
// the block), plain on the CPU (only this rank's thread touches it). A failure mark that has
// arrived fails the call: Coop::record_mark records it as this rank's failure (kPeerFailed) once.
template <typename Coop>
TPF_HOST_DEVICE CallState read_call_state(const Exchange& x) {
  const ControlBlock* control = x.control;
  CallState state;
  state.slot = Coop::load(&control->slot);
  state.failed = Coop::load(&control->error);
  state.sequence = Coop::load(&control->sequence);
  state.clear_bytes = Coop::load(&control->slot_bytes[slot_to_clear(state.slot)]);
  // A team of one has no peer to mark it. (A rank of one goes through the protocol for a plain
  // all-reduce and the QK norm: there the load cost a call 0.1-0.3 us on an H100,
  // bench/results/h100-20261205-969cf68-correct-or-loud.md.)
  if (x.world_size > 1) {
    const Vec16 mark = Coop::load_mark(x.mark());
    if (state.failed == 0 && has_arrived(mark)) {
      Coop::record_mark(x, mark);
      state.failed = 1;
    }
  }
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

  // Where this rank's header goes in any receiver's workspace, and where sender `sender`'s header
  // arrives in this rank's.
  TPF_HOST_DEVICE size_t header_send_offset(const Exchange& x) const {
    return header_of(x, state_.slot, x.rank);
  }
  TPF_HOST_DEVICE const Vec16* received_header(const Exchange& x, int sender) const {
    return reinterpret_cast<const Vec16*>(x.workspace[x.rank] + header_of(x, state_.slot, sender));
  }
  TPF_HOST_DEVICE uint32_t slot() const { return state_.slot; }
  TPF_HOST_DEVICE uint32_t sequence() const { return state_.sequence; }

  // Step 3, by one thread of each participant after it has read the call state (`control`:
  // this rank's control block, Exchange::control).
  TPF_HOST_DEVICE void arrive(ControlBlock* control, uint64_t bytes_per_sender) const {
    if (Coop::add_arrival(&control->arrivals) == Coop::participants() - 1) {
      Coop::store(&control->arrivals, 0u);
      Coop::store(&control->slot_bytes[state_.slot], bytes_per_sender);
      Coop::store(&control->slot, next_slot(state_.slot));
      Coop::store(&control->sequence, next_sequence(state_.sequence));
      Coop::store(&control->finished[next_slot(state_.slot)], 0u);
    }
  }

  // Step 4: re-fills the previous call's slot with the sentinel, region by region, each spread
  // over the Coop's threads (one thread: the regions' vectors in order). No division: on the GPU
  // a 64-bit one is a called routine, and a call makes the compiler keep registers in local
  // memory across the kernel. This rank's own region is left alone: nothing reads a word of it
  // that the same call did not store (lamport.h).
  TPF_HOST_DEVICE void clear_previous(const Exchange& x) const {
    const int64_t per_sender = int64_t(state_.clear_bytes / 16);
    char* base = x.workspace[x.rank] +
                 packet_offset(slot_to_clear(state_.slot), 0, world(x), x.packet_bytes);
    const int64_t stride = Coop::thread_count();
    for (int region = 0; region < world(x) - 1; ++region) {
      const int sender = region >= x.rank ? region + 1 : region;
      Vec16* const first = reinterpret_cast<Vec16*>(base + int64_t(sender) * x.packet_bytes);
      for (int64_t v = Coop::thread_index(); v < per_sender; v += stride) {
        Coop::store_sentinel(first + v);
      }
    }
    // The previous call's headers (every sender's but this rank's, which nobody sends it).
    for (int64_t sender = Coop::thread_index(); sender < world(x); sender += stride) {
      if (sender == x.rank) continue;
      Coop::store_sentinel(reinterpret_cast<Vec16*>(
          x.workspace[x.rank] + header_of(x, slot_to_clear(state_.slot), int(sender))));
    }
  }

 private:
  // header_offset (lamport.h) from the exchange's precomputed header area: fewer registers in
  // the polls' slow path, which reads headers.
  TPF_HOST_DEVICE static size_t header_of(const Exchange& x, uint32_t slot, int sender) {
    return x.header_area + (size_t(slot) * size_t(world(x)) + size_t(sender)) * 16;
  }
  // Byte offset, inside any rank's workspace, of sender `sender`'s region of this call's slot.
  TPF_HOST_DEVICE size_t region_offset(const Exchange& x, int sender) const {
    return packet_offset(state_.slot, sender, world(x), x.packet_bytes);
  }

  CallState state_;
};

// Where a sender's packets to `receiver` lie in the receiver's sender region of a slot, as its
// signature implies (every sender makes every store its signature implies, even when its waits
// ended without data): up to two byte ranges. What an absent call drains, and clears later.
struct SenderExtents {
  uint64_t begin[2];
  uint64_t end[2];
  uint64_t clear_bytes;  // what the receiver's next call but one clears of this region
};

TPF_HOST_DEVICE size_t signature_element_bytes(const CallSignature& s) {
  return s.dtype_code() == 0 ? 4 : 2;  // DType: float32 = 0, float16 = 1, bfloat16 = 2
}

TPF_HOST_DEVICE SenderExtents sender_extents(const CallSignature& s, int sender, int receiver,
                                             int world_size) {
  SenderExtents e{{0, 0}, {0, 0}, 0};
  const uint64_t row_bytes = uint64_t(s.width()) * signature_element_bytes(s);
  switch (s.op()) {
    case CallOp::kRowsOneShot:
    case CallOp::kNccl:
      e.end[0] = uint64_t(s.tokens()) * row_bytes;
      e.clear_bytes = e.end[0];
      break;
    case CallOp::kRowsTwoShot: {
      const TwoShotLayout layout(s.tokens(), world_size);
      e.end[0] = uint64_t(layout.count(receiver)) * row_bytes;  // scatter: the receiver's rows
      e.begin[1] = uint64_t(layout.per_rank) * row_bytes;       // gather: the sender's own rows
      e.end[1] = e.begin[1] + uint64_t(layout.count(sender)) * row_bytes;
      e.clear_bytes = layout.sender_bytes(row_bytes);
      break;
    }
    case CallOp::kQkOneShot:
      e.end[0] = uint64_t(s.tokens()) * 16;
      e.clear_bytes = e.end[0];
      break;
    default:  // kRejected: nothing
      break;
  }
  return e;
}

// What a sender's header, once in, says of this rank's call (`mine`: the header this rank sent
// for it):
//   kNone          the same call: the sender's packets are this call's;
//   kPeerRejected  the sender rejected its call and sends no packets: this call's waits on it end
//                  with NaN, a per-call error (the team goes on);
//   kPeerFailed    the sender's team had failed (CallOp::kFailed, the NCCL path's turn of a call
//                  refused there): this rank's team fails too;
//   kMismatch      anything else (another op, algorithm, dtype, shape, or call number): the
//                  team fails, naming the peer and both headers.
TPF_HOST_DEVICE CallError header_verdict(const Vec16& mine, const Vec16& theirs) {
  if (same_signature(theirs, mine)) return CallError::kNone;
  switch (CallSignature{theirs}.op()) {
    case CallOp::kRejected:
      return CallError::kPeerRejected;
    case CallOp::kFailed:
      return CallError::kPeerFailed;
    default:
      return CallError::kMismatch;
  }
}

// Records what a sender's header means (header_verdict), and returns it. The backend's Recorder
// writes it: recorder.on_rejection(x, sender) for a per-call rejection, and
// recorder.on_failure(x, kind, sender, mine, theirs, sequence) for a failure of the team (kMismatch
// with both headers; kPeerFailed with what the sender's header says as the failure mark it would
// have stored). `sequence`: this call's number where the caller knows it. (The GPU's fused
// kernels record header_verdict's two verdicts they can meet themselves: cuda/device_ops.cuh.)
template <typename Recorder>
TPF_HOST_DEVICE CallError record_header(Recorder&& recorder, const Exchange& x, const Vec16& mine,
                                        const Vec16& theirs, int sender,
                                        uint32_t sequence = kUnknownSequence) {
  const CallError verdict = header_verdict(mine, theirs);
  if (verdict == CallError::kPeerRejected) {
    recorder.on_rejection(x, sender);
  } else if (verdict == CallError::kPeerFailed) {
    const Vec16 mark =
        failure_mark(CallError(theirs.word[1]), sender, int(theirs.word[2]), kUnknownSequence);
    recorder.on_failure(x, CallError::kPeerFailed, sender, Vec16{}, mark, sequence);
  } else if (verdict == CallError::kMismatch) {
    recorder.on_failure(x, CallError::kMismatch, sender, mine, theirs, sequence);
  }
  return verdict;
}

// A bounded wait, the one every wait of the protocol takes: reads `load()` until every word of
// what it returns holds data (has_arrived), and every Clock::kCheckEvery reads (never on the path
// of a vector already in) asks `stop()` whether to give up (a differing header, a failure of the
// team: the caller's test) and then whether `timeout_ns` (0: never) has passed since the first of
// these checks (Clock::now_ns), where it calls `on_timeout(last vector read)` and gives up.
// Clock::pause(reads) comes between reads (the CPU yields its core after a while, the GPU spins).
// Returns whether the vector arrived, in `v`. The timeout is read by reference, where the check
// needs it (on the GPU a kernel parameter, which then holds no register across the wait). The
// GPU's packet poll in the fused kernels' receive loops is this loop written out: there even an
// inlined predicate cost registers (cuda/device_ops.cuh, wait_for_packet).
template <typename Clock, typename Load, typename Stop, typename OnTimeout>
TPF_HOST_DEVICE bool bounded_wait(const uint64_t& timeout_ns, Load&& load, Stop&& stop,
                                  OnTimeout&& on_timeout, Vec16& v) {
  uint64_t deadline = 0;
  for (uint32_t reads = 1;; ++reads) {
    v = load();
    if (has_arrived(v)) return true;
    Clock::pause(reads);
    if (reads % Clock::kCheckEvery != 0) continue;
    if (stop()) return false;
    if (timeout_ns == 0) continue;
    const uint64_t now = Clock::now_ns();
    if (deadline == 0) {
      deadline = now + timeout_ns;
    } else if (now > deadline) {
      on_timeout(v);
      return false;
    }
  }
}

}  // namespace tpfuse::impl
