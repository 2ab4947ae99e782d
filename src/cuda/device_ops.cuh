// Device primitives of the Lamport protocol: packet stores and polls, PDL, block reduction, and
// the GPU's Coop for the call session (tpfuse/impl/session.h). Each memory-ordering choice says
// why it is enough.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/calls.h"
#include "tpfuse/impl/lamport.h"
#include "tpfuse/impl/session.h"

namespace tpfuse::impl {

// Packet store into a peer's (or this rank's) slot. Volatile: the store goes out to L2 / over
// NVLink now rather than sitting in L1, and is not merged or reordered away by the compiler. No
// release is needed: the packet is its own flag (a receiver consumes exactly the words it saw
// change from the sentinel) and nothing else is published with it. (Plain weak stores time the
// same: cdd3d3d:bench/studies/h200x2-20261130-57e6130.md.)
__device__ __forceinline__ void store_packet(Vec16* address, const Vec16& v) {
  asm volatile("st.volatile.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(address), "r"(v.word[0]),
               "r"(v.word[1]), "r"(v.word[2]), "r"(v.word[3])
               : "memory");
}

// Poll of this rank's own slot. Volatile: every iteration reads L2 (where peers' NVLink stores
// land) instead of a stale L1 line, and the loop is not hoisted.
__device__ __forceinline__ Vec16 load_packet(const Vec16* address) {
  Vec16 v;
  asm volatile("ld.volatile.global.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.word[0]), "=r"(v.word[1]), "=r"(v.word[2]), "=r"(v.word[3])
               : "l"(address)
               : "memory");
  return v;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The GPU's clock for bounded_wait (session.h): the global timer, read every 256 polls (a read
// of it and the slow path's checks cost a poll little that often); a poll spins between reads.
struct GridClock {
  static constexpr uint32_t kCheckEvery = 256;
  __device__ __forceinline__ static uint64_t now_ns() { return global_timer_ns(); }
  __device__ __forceinline__ static void pause(uint32_t) {}
};

// Programmatic dependent launch. wait: blocks until every prerequisite grid has completed and
// its memory is visible (PTX griddepcontrol.wait). launch_dependents: lets the next kernel in
// the stream be scheduled (it still waits for our completion before touching memory).
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

__device__ __forceinline__ Vec16 load_vector(const void* base, int64_t index) {
  return reinterpret_cast<const Vec16*>(base)[index];
}

__device__ __forceinline__ void store_vector(void* base, int64_t index, const Vec16& v) {
  reinterpret_cast<Vec16*>(base)[index] = v;
}

// A reduction over the block in a fixed order (butterfly within warps, then warp 0 over the warp
// results; warps past the block's count give `identity`): the same launch shape gives the same
// bits on every rank and every call. The next reduction on the same shared values needs no
// barrier after this one: its writes of the warp values come after this one's second barrier,
// which follows every read of them, and its write of the total after its own first barrier, which
// follows every thread's read of this total.
template <typename Combine>
__device__ __forceinline__ float block_reduce(float value, float* shared_warp_values,
                                              float identity, Combine combine) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = (blockDim.x + 31) / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    value = combine(value, __shfl_xor_sync(0xffffffffu, value, offset));
  if (lane == 0) shared_warp_values[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < warps ? shared_warp_values[lane] : identity;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      value = combine(value, __shfl_xor_sync(0xffffffffu, value, offset));
    }
    if (lane == 0) shared_warp_values[32] = value;
  }
  __syncthreads();
  return shared_warp_values[32];
}

__device__ __forceinline__ float block_sum(float value, float* shared_warp_sums) {
  return block_reduce(value, shared_warp_sums, 0.0f, [](float a, float b) { return a + b; });
}

// Largest value over the block of values >= 0 (the FP8 output's per-token amax): fmaxf is exact
// in any order.
__device__ __forceinline__ float block_max(float value, float* shared_warp_values) {
  return block_reduce(value, shared_warp_values, 0.0f,
                      [](float a, float b) { return fmaxf(a, b); });
}

// The warp sums of kValues values a lane (a power of two, at most 32), each with exactly the
// additions of its own xor butterfly (block_reduce's first stage), so the same bits: but the first
// log2(kValues) steps trade half the values, not all of them (31 shuffles for 32 values instead of
// 160). Afterwards lane l holds the sum of value l >> (5 - log2(kValues)), which is returned; the
// values are overwritten.
template <int kValues>
__device__ __forceinline__ float warp_sum_spread(float (&values)[kValues]) {
  static_assert(kValues >= 1 && kValues <= 32 && (kValues & (kValues - 1)) == 0,
                "a power of two, at most a value a lane");
  const int lane = threadIdx.x % 32;
  int offset = 16;
#pragma unroll
  for (int live = kValues; live > 1; live /= 2, offset /= 2) {
    // The lower lane of each pair keeps the lower half: its partner sends it the same indices.
    const bool upper = (lane & offset) != 0;
#pragma unroll
    for (int j = 0; j < live / 2; ++j) {
      const float kept = upper ? values[j + live / 2] : values[j];
      const float sent = upper ? values[j] : values[j + live / 2];
      values[j] = kept + __shfl_xor_sync(0xffffffffu, sent, offset);
    }
  }
  float sum = values[0];
#pragma unroll
  for (; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  return sum;
}

// block_sum of two values at once (one pass, one set of barriers): each component gets exactly
// the additions, in the same order, that block_sum would give it alone (warp_sum_spread: lanes
// 0-15 hold the first, 16-31 the second).
__device__ __forceinline__ float2 block_sum2(float2 value, float2* shared_warp_sums) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = (blockDim.x + 31) / 32;
  float pair[2] = {value.x, value.y};
  float sum = warp_sum_spread(pair);
  if (lane % 16 == 0) reinterpret_cast<float*>(&shared_warp_sums[warp])[lane / 16] = sum;
  __syncthreads();
  if (warp == 0) {
    const float2 warp_sums = lane < warps ? shared_warp_sums[lane] : make_float2(0.0f, 0.0f);
    float warp_pair[2] = {warp_sums.x, warp_sums.y};
    sum = warp_sum_spread(warp_pair);
    if (lane % 16 == 0) reinterpret_cast<float*>(&shared_warp_sums[32])[lane / 16] = sum;
  }
  __syncthreads();
  // No barrier after: as for block_reduce, the next call's writes come after this one's barriers.
  return shared_warp_sums[32];
}

// Error records (session.h). The first writer is decided in device memory: the control block's
// error (which later calls read cheaply) for a failure of the team, its call_claims for a
// per-call error; the winner alone writes the host-mapped record, details first, then a fence,
// then the kind the host polls. No system-scope atomic touches host memory.
__device__ __forceinline__ void write_host_word(uint32_t* word, uint32_t value) {
  __threadfence_system();  // the details before the kind
  *reinterpret_cast<volatile uint32_t*>(word) = value;
  __threadfence_system();
}

// True for the one thread that records this failure of the team (the first).
__device__ __forceinline__ bool claim_failure(const Exchange& x, int peer) {
  return atomicCAS(&x.control->error, 0u, uint32_t(1 + peer)) == 0u;
}

// Announces a failure of this rank's own (a timeout, a disagreement) to every rank: its mark
// (session.h's FailureMark) into each workspace, this rank's too. Volatile stores, as packets: a
// peer's next call, wait or check reads the mark and fails at once. The GPU does not know which
// call it was (the slot index has moved on by the time a wait gives up).
__device__ __forceinline__ void publish_failure(const Exchange& x, CallError kind, int peer,
                                                uint32_t sequence) {
  const Vec16 mark = failure_mark(kind, x.rank, peer, sequence);
  for (int r = 0; r < x.world_size; ++r) store_packet(x.mark_of(r), mark);
}

// `sequence`: the failing call's number where the caller knows it (the NCCL path's check).
__device__ __forceinline__ void record_failure(const Exchange& x, CallError kind, int peer,
                                               const Vec16& mine, const Vec16& theirs,
                                               uint32_t sequence = kUnknownSequence) {
  if (!claim_failure(x, peer)) return;
  // A team without peer stores (every call on the NCCL path) has no workspace to mark: its
  // peers learn of the failure from this rank's next header (failed_signature).
  if ((kind == CallError::kTimeout || kind == CallError::kMismatch) &&
      x.workspace[x.rank] != nullptr) {
    publish_failure(x, kind, peer, sequence);
  }
  x.errors->failure_peer = uint32_t(peer);
  x.errors->sequence = sequence;
  x.errors->mine = mine;
  x.errors->theirs = theirs;
  write_host_word(&x.errors->failure, uint32_t(kind));
}

// A peer's failure mark (session.h), recorded as this rank's failure (kPeerFailed).
__device__ __forceinline__ void record_mark(const Exchange& x, const Vec16& mark) {
  record_failure(x, CallError::kPeerFailed, FailureMark{mark}.marking_rank(), Vec16{}, mark);
}

// Whether a peer has marked the team failed (one word of the mark: the slow paths' check costs
// one register); the mark is then recorded.
__device__ __forceinline__ bool mark_seen(const Exchange& x) {
  if (reinterpret_cast<const volatile uint32_t*>(x.mark())[0] == kSentinel) return false;
  record_mark(x, load_packet(x.mark()));
  return true;
}

// True for the one thread that records a per-call error since Team::check last cleared one:
// call_claims moves from the record's call_generation to one past it, once.
__device__ __forceinline__ bool claim_call_error(const Exchange& x) {
  const uint32_t generation =
      *reinterpret_cast<const volatile uint32_t*>(&x.errors->call_generation);
  return atomicCAS(&x.control->call_claims, generation, generation + 1) == generation;
}

// A timeout waiting for `sender`, recorded without record_failure's two vectors: live in a hot
// kernel's poll they cost it registers (scripts/kernel-registers.sh shows it), and a timeout's
// record needs neither.
__device__ __forceinline__ void record_timeout(const Exchange& x, int sender) {
  if (claim_failure(x, sender)) {
    publish_failure(x, CallError::kTimeout, sender, kUnknownSequence);
    x.errors->failure_peer = uint32_t(sender);
    write_host_word(&x.errors->failure, uint32_t(CallError::kTimeout));
  }
}

// record_header's Recorder on the GPU (session.h): the rank's error record, its first writer
// decided in device memory (claim_call_error, record_failure).
struct DeviceRecorder {
  __device__ __forceinline__ void on_rejection(const Exchange& x, int sender) const {
    if (claim_call_error(x)) {
      x.errors->call_peer = uint32_t(sender);
      write_host_word(&x.errors->call_error, uint32_t(CallError::kPeerRejected));
    }
  }
  __device__ __forceinline__ void on_failure(const Exchange& x, CallError kind, int sender,
                                             const Vec16& mine, const Vec16& theirs,
                                             uint32_t sequence) const {
    record_failure(x, kind, sender, mine, theirs, sequence);
  }
};

// What a sender's header on a fused path, once in, says of this rank's call (session.h's
// header_verdict: nothing, or why the call cannot have its data, recorded). Returns true when it
// differs. No header on a fused path says its sender's team failed (a rank whose team failed
// refuses its calls before it stores anything), so the fused kernels record the two verdicts they
// can meet here rather than through record_header: its third branch, even folded away, cost a
// one-shot kernel spills (ptxas -v, sm_90a; a kFailed header would count as a disagreement).
__device__ __forceinline__ bool header_differs(const Exchange& x, const CallSignature& mine,
                                               const Vec16& header, int sender) {
  const CallError verdict = header_verdict(mine.header, header);
  if (verdict == CallError::kNone) return false;
  if (verdict == CallError::kPeerRejected) {
    DeviceRecorder{}.on_rejection(x, sender);
  } else {
    record_failure(x, CallError::kMismatch, sender, mine.header, header);
  }
  return true;
}

// Whether this rank's team has failed (a thread of this rank recorded it): one word, volatile.
__device__ __forceinline__ bool failure_recorded(const Exchange& x) {
  return *reinterpret_cast<volatile uint32_t*>(&x.control->error) != 0;
}

// Whether a wait of this block ended without data, or a peer's header differed from this call's:
// the block then ends the call with end_call's NaN fill. One shared word at a fixed address
// (setting it costs the polls no register), cleared by thread 0 where it reads the call state.
__device__ __forceinline__ uint32_t& block_lost_data() {
  __shared__ uint32_t lost;
  return lost;
}

// The wait for a packet vector in the fused kernels' receive loops: spins until every word holds
// data. In its slow path (every GridClock::kCheckEvery polls) it reads the hash word of the
// sender's call header: one that is in and differs from this call's (a sender that rejected its
// call, or whose call disagrees) ends the wait; so do a failure another thread of this rank
// recorded, and a timeout (record_timeout). What differed is recorded by the header check at the
// end of the call (check_header), where it costs the fast path no registers. A wait that ends
// without data returns NaN: the call's outputs are then NaN, and Team::check says why. Inlined:
// a call would make the caller save its live registers (spills) around it.
//
// WARNING: the one wait not written through bounded_wait (session.h), on purpose. It is the same
// loop, but here in the hot kernels ptxas allocates registers differently as soon as a part of
// it is a function, even an inlined one: with the give-up test as a predicate (a lambda, or a
// struct with an inlined operator()), or only the deadline as a helper, some one-shot kernels
// took up to 10 more registers and others spilled (ptxas -v, sm_90a, oneshot_shard0 against the
// loop as written here). Keep it written out; change it only with scripts/kernel-registers.sh.
template <typename Session>
__device__ __forceinline__ Vec16 wait_for_packet(const Vec16* address, const Session& session,
                                                 const Exchange& x, const CallSignature& mine,
                                                 int sender) {
  uint64_t deadline = 0;
  for (uint32_t spins = 1;; ++spins) {
    const Vec16 v = load_packet(address);
    if (has_arrived(v)) return v;
    if (spins % GridClock::kCheckEvery == 0) {
      const uint32_t hash =
          reinterpret_cast<const volatile uint32_t*>(session.received_header(x, sender))[3];
      if ((hash != kSentinel && hash != mine.hash()) ||
          *reinterpret_cast<volatile uint32_t*>(&x.control->error) != 0) {
        block_lost_data() = 1;
        return nan_vector();
      }
      if (x.timeout_ns != 0) {
        const uint64_t now = global_timer_ns();
        if (deadline == 0) {
          deadline = now + x.timeout_ns;
        } else if (now > deadline) {
          record_timeout(x, sender);
          block_lost_data() = 1;
          return nan_vector();
        }
      }
    }
  }
}

// The cheap header check (session.h): thread r of block 0 (r a peer) copies sender r's header
// into shared memory right after its sends, asynchronously (cp.async, through L2 where the peers'
// stores land): no register holds it while the call waits for its data. Once the data is in,
// check_header compares it; a header not in yet is waited for there, a differing one recorded.
struct EarlyHeaders {
  Vec16 header[kMaxWorldSize];
};

// 16 bytes from global to shared memory, asynchronously (cp.async, through L2);
// commit_async_copies() closes the thread's batch, wait_async_copies() waits for all of them.
__device__ __forceinline__ void copy_async(void* shared, const void* global) {
  const uint32_t destination = uint32_t(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(destination), "l"(global)
               : "memory");
}

// 4 bytes, where a source may not be 16-byte aligned (through L1: cp.async.cg takes 16 only).
__device__ __forceinline__ void copy_async_4(void* shared, const void* global) {
  const uint32_t destination = uint32_t(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(destination), "l"(global)
               : "memory");
}

__device__ __forceinline__ void commit_async_copies() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}

__device__ __forceinline__ void wait_async_copies() {
  asm volatile("cp.async.wait_all;" ::: "memory");
}

// Waits for every batch of the thread's copies but the kPending last committed.
template <int kPending>
__device__ __forceinline__ void wait_async_copies_but() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

template <typename Session>
__device__ __forceinline__ void fetch_headers(const Session& session, const Exchange& x,
                                              EarlyHeaders& early) {
  const int sender = int(threadIdx.x);
  if (blockIdx.x != 0 || sender >= session.world(x) || sender == x.rank) return;
  copy_async(&early.header[sender], session.received_header(x, sender));
  commit_async_copies();
}

// No function calls here or in the polls: any call in a kernel makes ptxas reserve the calling
// convention's registers in the whole kernel
// (cdd3d3d:bench/studies/h200-20261201-8d6265e-nothing-silent.md).
template <typename Session>
__device__ __forceinline__ void check_header(const Session& session, const Exchange& x,
                                             const CallSignature& mine, EarlyHeaders& early) {
  const int sender = int(threadIdx.x);
  if (blockIdx.x != 0 || sender >= session.world(x) || sender == x.rank) return;
  wait_async_copies();
  if (early.header[sender].word[3] == mine.hash()) return;
  const Vec16* address = session.received_header(x, sender);
  Vec16 header;
  const bool arrived = bounded_wait<GridClock>(
      x.timeout_ns, [&] { return load_packet(address); }, [&] { return failure_recorded(x); },
      [&](const Vec16& last) { record_failure(x, CallError::kTimeout, sender, mine.header, last); },
      header);
  if (!arrived || header_differs(x, mine, header, sender)) block_lost_data() = 1;
}

// A gpu-scope release add (no value back: the thread does not wait for it) and acquire load.
__device__ __forceinline__ void add_release(uint32_t* word, uint32_t value) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(word), "r"(value) : "memory");
}
__device__ __forceinline__ uint32_t load_acquire(const uint32_t* word) {
  uint32_t value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(word) : "memory");
  return value;
}

// NaN into every output of `outputs` (core/calls.h), spread over `threads` threads of which this
// is `thread`: each row's words one thread a word, the bytes past a row's last word one by one.
// No division: a 64-bit one is a called routine (see LamportSession::clear_previous).
__device__ __forceinline__ void fill_with_nan(const CallOutputs& outputs, uint32_t thread,
                                              uint32_t threads) {
#pragma unroll
  for (int i = 0; i < CallOutputs::kMost; ++i) {
    if (i >= outputs.count) break;
    const OutputRows& o = outputs.rows[i];
    if (o.base == nullptr) continue;
    const uint64_t words = o.row_bytes / 4;
    const uint64_t tail = o.row_bytes % 4;
    for (int64_t row = 0; row < o.rows; ++row) {
      char* const base = static_cast<char*>(o.base) + uint64_t(row) * o.stride_bytes;
      for (uint64_t w = thread; w < words; w += threads) {
        reinterpret_cast<uint32_t*>(base)[w] = o.word;
      }
      if (thread < tail) base[words * 4 + thread] = char(o.word >> (8 * thread));
    }
  }
}

// The fused kernels' last step: every output of a call that failed once begun is NaN, on every
// rank, as on the CPU backend. Without it a peer's data could remain in some blocks' outputs: a
// disagreement that keeps the packets' layout (found only by block 0's header check at the end),
// or a timeout in one block while the others had their data. Each block counts itself out of the
// call once its outputs are written (ControlBlock::finished of the call's slot: one release
// reduction by thread 0, which does not wait for it); a block that lost data (block_lost_data)
// then waits until every block of the grid has counted out (all are resident, and every wait of
// theirs ends: on its data, the team's failure or a peer's header, or the timeout), and fills
// every output (`outputs()`, a CallOutputs) with NaN. Its wait is bounded by the team's timeout;
// past it, it fills anyway.
template <typename Session, typename Outputs>
__device__ __forceinline__ void end_call(const Session& session, const Exchange& x,
                                         Outputs&& outputs) {
  if (Session::world(x) == 1) return;  // a team of one has no peer to lose data to
  __syncthreads();                     // the block's outputs written, and block_lost_data final
  uint32_t* const finished = &x.control->finished[session.slot()];
  if (threadIdx.x == 0) add_release(finished, 1u);
  if (block_lost_data() == 0) return;
  if (threadIdx.x == 0) {
    Vec16 ignored;
    bounded_wait<GridClock>(
        x.timeout_ns,
        [&] {
          Vec16 v{};
          if (load_acquire(finished) < gridDim.x) v.word[0] = kSentinel;
          return v;
        },
        [] { return false; }, [](const Vec16&) {}, ignored);
  }
  __syncthreads();
  fill_with_nan(outputs(), threadIdx.x, blockDim.x);
}

// Stores this rank's call header into every peer (threads 0..W-1 of block 0).
template <typename Session>
__device__ __forceinline__ void send_header(const Session& session, const Exchange& x,
                                            const CallSignature& mine) {
  const int receiver = int(threadIdx.x);
  if (blockIdx.x != 0 || receiver >= session.world(x) || receiver == x.rank) return;
  store_packet(reinterpret_cast<Vec16*>(x.workspace[receiver] + session.header_send_offset(x)),
               mine.header);
}

// The session's Coop on the GPU: a participant is a block (one of its threads arrives), the
// clear is spread over the whole grid.
struct GridCoop {
  // Volatile: the writer was a previous grid, complete and flushed (griddepcontrol.wait), and L1
  // must not serve an older copy.
  __device__ __forceinline__ static uint32_t load(const uint32_t* word) {
    return *reinterpret_cast<const volatile uint32_t*>(word);
  }
  __device__ __forceinline__ static uint64_t load(const uint64_t* word) {
    return *reinterpret_cast<const volatile uint64_t*>(word);
  }
  // Plain: the next call reads the control block after its own griddepcontrol.wait, when this
  // grid has completed and its memory is visible.
  __device__ __forceinline__ static void store(uint32_t* word, uint32_t value) { *word = value; }
  __device__ __forceinline__ static void store(uint64_t* word, uint64_t value) { *word = value; }
  __device__ __forceinline__ static uint32_t add_arrival(uint32_t* count) {
    return atomicAdd(count, 1u);
  }
  __device__ __forceinline__ static uint32_t participants() { return gridDim.x; }
  __device__ __forceinline__ static int64_t thread_index() {
    return int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  }
  __device__ __forceinline__ static int64_t thread_count() {
    return int64_t(gridDim.x) * blockDim.x;
  }
  // Plain: the slot is next polled two calls (two kernel boundaries) later, and a peer stores
  // into it only after it has seen a packet this rank sends later.
  __device__ __forceinline__ static void store_sentinel(Vec16* address) {
    *address = sentinel_vector();
  }
  // Volatile, as a poll: a peer stores the mark at any time.
  __device__ __forceinline__ static Vec16 load_mark(const Vec16* address) {
    return load_packet(address);
  }
  __device__ __forceinline__ static void record_mark(const Exchange& x, const Vec16& mark) {
    impl::record_mark(x, mark);
  }
};

template <int kWorldSize>
using GpuSession = LamportSession<GridCoop, kWorldSize>;

}  // namespace tpfuse::impl
