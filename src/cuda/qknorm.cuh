// The distributed QK norm fused with its all-reduce (MiniMax-M2's QK-norm site), with optional
// rotary embedding. One kernel per call and rank; the exchange is the Lamport one-shot protocol
// of tpfuse/impl/lamport.h with one 16-byte packet per token, {sum q^2, sum k^2, 0, 0} in fp32.
//
//   [before griddepcontrol.wait]  nothing that reads or writes memory.
//   1. thread 0 reads the slot index, the bytes to clear and the error flag, while every
//      thread loads its q / k vectors of its block's first token and, for RoPE in registers,
//      that token's position, then its cos / sin values (the latencies overlap).
//   2. thread 0 of block 0 stores the call's header into every other rank (session.h); per
//      token of the block: sums of squares of q and k, one fixed-order block sum of the
//      pair (its barrier publishes what thread 0 read); thread 0 stores the packet into every
//      rank's slot. kLoadAhead: a block with several tokens loads the next token's vectors
//      first.
//   3. the gamma vectors are loaded (their latency overlaps the packets' flight); arrival by a
//      thread of the second warp, so that thread 0 polls without waiting for the atomic's round
//      trip (the last block advances the slot index), launch_dependents, clear the previous
//      call's slot but this rank's own region: as the add + RMSNorm one-shot kernel (oneshot.cuh
//      says why it is safe).
//   4. per token: thread 0 polls the W packets of this token and sums them in rank order (the
//      same bits on every rank; its own packet is one this thread stored in step 2; a long wait
//      reads the sender's header, and block 0 checks every peer's at the end), computes
//      both scales and shares them; each thread normalizes its vectors (still in registers
//      when the block has one token; else reloaded, with kLoadAhead the next token's while
//      this one is finished); RoPE (RopePath below) rotates them, in registers with the
//      neox partner from another lane of the warp, or through shared memory for layouts where
//      the partner may be in another warp; one rounding to the output type.
//
// With many tokens (takes_many_token_kernel), one or two vectors a thread and no RoPE or RoPE in
// registers, the fused op runs qk_rmsnorm_group_kernel instead (below): a block holds a group of
// tokens in registers across the exchange.
//
// QkKernels<T> (kernels.h) launches and preloads the instantiations of one dtype: each dtype's
// are compiled in a translation unit of their own (CMakeLists.txt), and qknorm.cu binds a call
// to its dtype's.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>

#include "core/calls.h"
#include "cuda/check.h"
#include "cuda/device_ops.cuh"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"
#include "tpfuse/impl/dispatch.h"
#include "tpfuse/impl/epilogue.h"
#include "tpfuse/impl/qknorm.h"

namespace tpfuse::impl {
namespace {

// How a launch applies RoPE. kRegisters: each thread rotates its own vectors, the neox partner
// vector comes from a lane of the same warp (a shuffle), the cos/sin values from the cache
// straight into registers, loaded while the packets are in flight; kShared: the general form, for
// layouts where a partner may sit in another warp or a vector straddles a rotary half (qknorm.h's
// rope_in_registers decides): the normalized row and the cos/sin row go through shared memory.
// Both rotate each element through `rotate` (qknorm.h).
enum class RopePath : int { kNone = 0, kShared = 1, kRegisters = 2 };

RopePath rope_path(const QkCall& p, int elements, int vecs_per_thread) {
  if (p.rope == RopeStyle::kNone) return RopePath::kNone;
  return rope_in_registers(p.rope, p.head_dim, p.rotary_dim, elements, vecs_per_thread)
             ? RopePath::kRegisters
             : RopePath::kShared;
}

// The many-token kernel's cos/sin row buffers (it writes the next group's before barrier A).
constexpr int kRopeBuffers = 3;

// Pieces both fused kernels share. The call's header, by thread 0 of block 0 from the slot it
// read itself (the other threads have not seen the call state yet; session.h).
template <int kWorldSize>
__device__ __forceinline__ void send_qk_header(const CallState& state, const QkCall& p) {
  const GpuSession<kWorldSize> sender(state);
#pragma unroll
  for (int r = 0; r < (kWorldSize > 0 ? kWorldSize : kMaxWorldSize); ++r) {
    if (kWorldSize == 0 && r >= sender.world(p.exchange)) break;
    if (r == p.exchange.rank) continue;
    store_packet(
        reinterpret_cast<Vec16*>(p.exchange.workspace[r] + sender.header_send_offset(p.exchange)),
        p.signature.header);
  }
}

// A token's packet of its two sums, into every rank's slot (this rank's own too: the QK norm
// reads its own packet back, lamport.h).
template <int kWorldSize>
__device__ __forceinline__ void send_qk_packet(const GpuSession<kWorldSize>& sender,
                                               const QkCall& p, int64_t token, float2 sums) {
  const size_t send_offset = sender.send_offset(p.exchange);
  const Vec16 packet = rewrite_sentinel(qk_packet(sums.x, p.counts_k ? sums.y : 0.0f));
#pragma unroll
  for (int r = 0; r < (kWorldSize > 0 ? kWorldSize : kMaxWorldSize); ++r) {
    if (kWorldSize == 0 && r >= sender.world(p.exchange)) break;
    store_packet(reinterpret_cast<Vec16*>(p.exchange.workspace[r] + send_offset) + token, packet);
  }
}

// A token whose position is outside the cache, for Team::check (the first since the last check).
__device__ __forceinline__ void record_bad_position(const QkCall& p, int64_t token) {
  if (p.exchange.errors == nullptr) return;
  if (claim_call_error(p.exchange)) {
    p.exchange.errors->position_token = token;
    p.exchange.errors->position = p.positions[token];
    p.exchange.errors->max_position = p.max_position;
    write_host_word(&p.exchange.errors->call_error, uint32_t(CallError::kBadPosition));
  }
}

// kPass: kFused runs the whole protocol; kSums stops after step 2, writing this rank's sums to
// p.sums instead of sending them; kNormFromSums skips steps 2-3 and takes the global sums from
// p.sums. The three share every arithmetic step, so the halves give the fused op's bits.
// kLoadAhead (launches with several tokens a block, one or two vectors a thread, RoPE through
// shared memory: the layouts the many-token kernel does not take; the host picks it): a block
// loads its next token's vectors while it works on the current one. A separate
// instantiation, because its second set of registers measured slower in the one-token kernel.
template <typename T, int kWorldSize, int kVecsPerThread, RopePath kRope, QkPass kPass,
          bool kLoadAhead = false>
__global__ void __launch_bounds__(kMaxThreads) qk_rmsnorm_kernel(const QkCall p) {
  constexpr bool kFused = kPass == QkPass::kFused;
  constexpr bool kRopeShared = kRope == RopePath::kShared;
  constexpr bool kRopeRegisters = kRope == RopePath::kRegisters;
  constexpr int kElements = Packed<T>::kElements;
  static_assert(!kLoadAhead || kVecsPerThread <= 2, "wider rows would spill the second set");
  ControlBlock* const control = p.exchange.control;
  // A thread's indices are 32-bit (a row has at most kVecsPerThread * kMaxThreads vectors of q
  // and k); a token's offsets 64-bit. Every width is a multiple of kElements (validate.cc).
  const int q_vectors = int(p.q_size / kElements);
  const int vectors = int((p.q_size + p.kv_size) / kElements);
  const int64_t row_vectors = (p.q_size + 2 * p.kv_size) / kElements;
  // kShared only: the normalized row (q_size + kv_size floats), then the position's cos/sin row.
  extern __shared__ float rope_shared[];
  float* const normalized = rope_shared;
  float* const cos_sin = rope_shared + (p.q_size + p.kv_size);
  __shared__ float2 shared_sums[33];
  __shared__ float shared_scale[2];
  __shared__ CallState shared_state;
  __shared__ EarlyHeaders early_headers;

  // Vector c of a row: q vector c for c < q_vectors, else k vector c - q_vectors. Its offset in
  // the qkv row and in the normalized row (q then k) is the same: c * kElements.
  const auto vector_of = [&](int i) { return int(threadIdx.x) + i * int(blockDim.x); };
  const auto load_values = [&](int64_t token, Vec16(&values)[kVecsPerThread]) {
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int c = vector_of(i);
      if (c < vectors) values[i] = load_vector(p.qkv, token * row_vectors + c);
    }
  };
  const auto copy_vectors = [](const Vec16* from, Vec16(&to)[kVecsPerThread]) {
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) to[i] = from[i];
  };
  // kRegisters: where each of this thread's vectors starts in its head (token-independent), and
  // the run of cos and sin values its elements use for a token's position: element e's are run
  // entry e (neox) or e / 2 (interleaved). Nothing reads the loaded values before the rotation,
  // so the loads do not hold up the sums and the send: mapped to elements right after the
  // loads, by a select on the style, they made every thread wait for them (and for the
  // position load before them) ahead of the block sum.
  const int half = int(p.rotary_dim / 2);
  int head_offset[kVecsPerThread];
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    head_offset[i] = kRopeRegisters ? int((vector_of(i) * kElements) % p.head_dim) : 0;
  }
  float cos_run[kRopeRegisters ? kVecsPerThread : 1][kElements];
  float sin_run[kRopeRegisters ? kVecsPerThread : 1][kElements];
  const auto load_rope_registers = [&](int64_t position) {
    if constexpr (kRopeRegisters) {
      const float* row_cos_sin = p.cos_sin_cache + position * p.rotary_dim;
      const bool neox = p.rope == RopeStyle::kNeox;
      // 16-byte loads where the rows, the sin half and the runs all start on 16 bytes: fewer
      // instructions, and no per-element style branch.
      const bool vector_loads =
          reinterpret_cast<uintptr_t>(p.cos_sin_cache) % 16 == 0 && p.rotary_dim % 8 == 0;
#pragma unroll
      for (int i = 0; i < kVecsPerThread; ++i) {
        const int j0 = head_offset[i];
        if (vector_of(i) >= vectors || j0 >= p.rotary_dim) continue;
        // neox: element j pairs with j +- half and uses index j mod half; interleaved: the pair
        // (2m, 2m + 1) uses index m. Either way this vector's indices are one run from `start`:
        // kElements of them (neox) or kElements / 2 (interleaved), never past `half`
        // (rope_in_registers admits no vector that straddles a rotary half).
        // The interleaved style fills the first half of the run only, and reads no more.
        const int start = neox ? (j0 < half ? j0 : j0 - half) : j0 / 2;
        const int run = neox ? kElements : kElements / 2;
        float(&run_cos)[kElements] = cos_run[i];
        float(&run_sin)[kElements] = sin_run[i];
        if (kElements % 4 == 0 && vector_loads && start % 4 == 0) {
#pragma unroll
          for (int k = 0; k < kElements; k += 4) {
            if (k >= run) break;
            const float4 c = *reinterpret_cast<const float4*>(row_cos_sin + start + k);
            const float4 s = *reinterpret_cast<const float4*>(row_cos_sin + half + start + k);
            run_cos[k] = c.x, run_cos[k + 1] = c.y, run_cos[k + 2] = c.z, run_cos[k + 3] = c.w;
            run_sin[k] = s.x, run_sin[k + 1] = s.y, run_sin[k + 2] = s.z, run_sin[k + 3] = s.w;
          }
        } else {
#pragma unroll
          for (int k = 0; k < kElements; ++k) {
            if (k >= run) break;
            run_cos[k] = row_cos_sin[start + k];
            run_sin[k] = row_cos_sin[half + start + k];
          }
        }
      }
    }
  };

  grid_dependency_wait();
  if constexpr (!kFused) launch_dependents();  // a local pass has no slot to protect

  // 1. Thread 0 reads the control block while every thread loads its vectors of the block's
  // first token (every block has at least one: the grid is at most `tokens` blocks) and, for
  // RoPE in registers, that token's position: the latencies overlap, and the first block sum's
  // barrier publishes what thread 0 read. The gamma vectors, which only the epilogue needs, are
  // loaded after the send, while the packets are in flight: issued here, a load the sums do not
  // need could still hold them up (the compiler may wait for a group of loads at once). The
  // cos/sin values are the exception: they wait for the position, a second load latency, which
  // the packets' flight after the send does not hide.
  CallState state{0, 0, 0};
  if (kFused && threadIdx.x == 0) {
    state = read_call_state<GridCoop>(p.exchange);
    shared_state = state;
    block_lost_data() = 0;
  }
  Vec16 values[kVecsPerThread], gammas[kVecsPerThread];
  load_values(blockIdx.x, values);
  // A position outside [0, max_position) reads the cache's row 0 instead (-1 below marks it) and
  // the token's outputs are NaN, recorded for Team::check: the host cannot see positions inside
  // a CUDA graph, and nothing outside the cache is ever read.
  const auto bounded_position = [&](int64_t position) {
    return position >= 0 && position < p.max_position ? position : int64_t(-1);
  };
  int64_t first_position = 0;
  if constexpr (kRopeRegisters) first_position = bounded_position(p.positions[blockIdx.x]);
  // The first token's cos/sin as soon as its position is in: their latency then overlaps the
  // block sum, the send and the packets' flight.
  load_rope_registers(first_position < 0 ? 0 : first_position);

  // 2. Send. Thread 0 sends, from the slot it read itself; a failed team sends nothing, so its
  // peers time out too. kLoadAhead: the next token's vectors are loaded before this one's are
  // reduced, a load in flight during every block sum instead of one latency per token.
  Vec16 next[kLoadAhead ? kVecsPerThread : 1];
  // `values` for the block's token `token` (the first is loaded before the loop).
  const auto take_token = [&](int64_t token) {
    if constexpr (kLoadAhead) {
      if (token != blockIdx.x) copy_vectors(next, values);
      if (token + gridDim.x < p.tokens) load_values(token + gridDim.x, next);
    } else if (token != blockIdx.x) {
      load_values(token, values);
    }
  };
  if (kFused && threadIdx.x == 0 && blockIdx.x == 0 && state.failed == 0) {
    send_qk_header<kWorldSize>(state, p);  // the call header first
  }
  for (int64_t token = blockIdx.x; kPass != QkPass::kNormFromSums && token < p.tokens;
       token += gridDim.x) {
    take_token(token);
    float2 sums = make_float2(0.0f, 0.0f);
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int c = vector_of(i);
      if (c >= vectors) continue;
      const float squares = vector_sum_squares<T>(values[i]);
      if (c < q_vectors) {
        sums.x += squares;
      } else {
        sums.y += squares;
      }
    }
    sums = block_sum2(sums, shared_sums);
    if (kPass == QkPass::kSums && threadIdx.x == 0) {
      p.sums[2 * token] = sums.x;
      p.sums[2 * token + 1] = p.counts_k ? sums.y : 0.0f;
    }
    if (kFused && threadIdx.x == 0 && state.failed == 0) {
      send_qk_packet(GpuSession<kWorldSize>(state), p, token, sums);  // thread 0's own read
    }
  }

  if constexpr (kPass == QkPass::kSums) return;
  if (kFused && shared_state.failed != 0) return;
  const GpuSession<kWorldSize> session(kFused ? shared_state : CallState{0, 0, 0});
  const int world = session.world(p.exchange);
  if constexpr (kFused) fetch_headers(session, p.exchange, early_headers);
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    const int c = vector_of(i);
    if (c >= vectors) continue;
    gammas[i] = c < q_vectors ? load_vector(p.q_gamma, c) : load_vector(p.k_gamma, c - q_vectors);
  }

  // 3. Arrival (by a thread of the second warp where there is one: thread 0, which polls, then
  // need not wait for the atomic's round trip), trigger, clear.
  const unsigned arriver = blockDim.x > 32 ? 32u : 0u;
  if (kFused && threadIdx.x == arriver) session.arrive(control, uint64_t(p.tokens) * sizeof(Vec16));
  if constexpr (kFused) {
    launch_dependents();
    session.clear_previous(p.exchange);
  }

  // 4. Receive, normalize, rotate, store. `values` still hold the block's first token unless
  // step 2 went on to others.
  const bool first_token_held = kPass == QkPass::kNormFromSums || gridDim.x >= p.tokens;
  const char* slot_base = session.receive_region(p.exchange, 0);
  if (!first_token_held) load_values(blockIdx.x, values);
  for (int64_t token = blockIdx.x; token < p.tokens; token += gridDim.x) {
    take_token(token);  // with kLoadAhead, the next one's load while this one is finished
    int64_t position = 0;
    if constexpr (kRopeRegisters) {
      position = token == blockIdx.x ? first_position : bounded_position(p.positions[token]);
      if (token != blockIdx.x) load_rope_registers(position < 0 ? 0 : position);
    }
    if constexpr (kRopeShared) {
      // The position's cos/sin row, loaded while the packets are in flight; the barrier after
      // the poll publishes it.
      position = bounded_position(p.positions[token]);
      const float* row_cos_sin = p.cos_sin_cache + (position < 0 ? 0 : position) * p.rotary_dim;
      for (int64_t e = threadIdx.x; e < p.rotary_dim; e += blockDim.x) cos_sin[e] = row_cos_sin[e];
    }
    if (kPass == QkPass::kNormFromSums && threadIdx.x == 0) {
      shared_scale[0] = rms_scale(p.sums[2 * token], p.q_global_size, p.eps);
      shared_scale[1] = rms_scale(p.sums[2 * token + 1], p.k_global_size, p.eps);
    }
    if (kFused && threadIdx.x == 0) {
      // Every sender's packet is loaded before the first is waited on: W polls in flight.
      constexpr int kPolls = kWorldSize > 0 ? kWorldSize : kMaxWorldSize;
      const auto address = [&](int r) {
        return reinterpret_cast<const Vec16*>(slot_base + r * p.exchange.packet_bytes) + token;
      };
      Vec16 packets[kPolls];
#pragma unroll
      for (int r = 0; r < kPolls; ++r) {
        if (r < world) packets[r] = load_packet(address(r));
      }
      float sums[4];
#pragma unroll
      for (int r = 0; r < kPolls; ++r) {
        if (r >= world) break;
        if (!has_arrived(packets[r])) {
          packets[r] = wait_for_packet(address(r), session, p.exchange, p.signature, r);
        }
        if (r == 0) {
          accumulate_first<float>(sums, packets[r]);
        } else {
          accumulate<float>(sums, packets[r]);
        }
      }
      shared_scale[0] = rms_scale(sums[0], p.q_global_size, p.eps);
      shared_scale[1] = rms_scale(sums[1], p.k_global_size, p.eps);
    }
    __syncthreads();
    float lanes[kVecsPerThread][kElements];
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int c = vector_of(i);
      if (c >= vectors) {
#pragma unroll
        for (int e = 0; e < kElements; ++e) lanes[i][e] = 0.0f;  // shuffled, never stored
        continue;
      }
      scale_lanes<T>(values[i], gammas[i], shared_scale[c < q_vectors ? 0 : 1], lanes[i]);
      if constexpr (kRopeShared) {
#pragma unroll
        for (int e = 0; e < kElements; ++e) normalized[c * kElements + e] = lanes[i][e];
      }
    }
    if constexpr (kRopeShared) {
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kVecsPerThread; ++i) {
        const int c = vector_of(i);
        if (c >= vectors) continue;
        // 32-bit offsets: a RoPE row is at most kMaxQkRopeWidth elements.
        rope_lanes<kElements>(lanes[i], normalized, c * kElements, int(p.head_dim),
                              int(p.rotary_dim), p.rope, cos_sin);
      }
    }
    if constexpr (kRopeRegisters) {
      const int lane = int(threadIdx.x % 32);
#pragma unroll
      for (int i = 0; i < kVecsPerThread; ++i) {
        const int j0 = head_offset[i];
        const bool rotary = vector_of(i) < vectors && j0 < p.rotary_dim;
        if (p.rope == RopeStyle::kNeox) {
          // neox: the partner vector is half / kElements vectors away, on that lane; every lane
          // of the warp takes part in the shuffle.
          const bool first = j0 < half;
          const int away = half / kElements;
          const int source = rotary ? (first ? lane + away : lane - away) : lane;
#pragma unroll
          for (int e = 0; e < kElements; ++e) {
            const float partner = __shfl_sync(0xffffffffu, lanes[i][e], source);
            if (rotary)
              lanes[i][e] = rotate(lanes[i][e], partner, cos_run[i][e], sin_run[i][e], first);
          }
        } else if (rotary) {
#pragma unroll
          for (int e = 0; e < kElements; e += 2) {
            const float x0 = lanes[i][e], x1 = lanes[i][e + 1];
            lanes[i][e] = rotate(x0, x1, cos_run[i][e / 2], sin_run[i][e / 2], true);
            lanes[i][e + 1] = rotate(x1, x0, cos_run[i][e / 2], sin_run[i][e / 2], false);
          }
        }
      }
    }
    if (position < 0 && threadIdx.x == 0) record_bad_position(p, token);
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int c = vector_of(i);
      if (c >= vectors) continue;
      const Vec16 out = position < 0 ? nan_vector() : pack<T>(lanes[i]);
      if (c < q_vectors) {
        store_vector(p.q_out, token * (p.q_out_stride / kElements) + c, out);
      } else {
        store_vector(p.k_out, token * (p.k_out_stride / kElements) + (c - q_vectors), out);
      }
    }
    __syncthreads();  // shared_scale and the normalized row are reused by the next token
  }
  if constexpr (kFused) {
    check_header(session, p.exchange, p.signature, early_headers);
    end_call(session, p.exchange, [&] { return qk_outputs(p, sizeof(T)); });
  }
}

// The many-token form of the fused kernel (launches with more tokens than resident blocks, one
// or two vectors a thread, no RoPE or RoPE in registers): a block takes kGroup consecutive tokens
// at a time and holds all of them in registers across the exchange, so each token is read once
// and a group costs two barriers instead of four a token. Per group:
//   1. every thread loads its vectors of the group's tokens (kGroup loads in flight) and, with
//      RoPE, the threads of the warps that send nothing copy the tokens' cos/sin rows into
//      shared memory asynchronously (cp.async: a copier waits for the position only, and no
//      sender waits for the copies before its send and poll);
//   2. per token, each thread's sums of squares and their warp sums (block_sum2's first stage);
//      barrier A; warp g finishes token g's block sum (block_sum2's second stage: the same
//      additions in the same order, so the bits of the one-token kernel and of the halves) and
//      its lane 0 sends the packet; in the first group, step 3 of the one-token kernel (arrival,
//      trigger, clear, the early headers);
//   3. lane 0 of warp g polls token g's packets (the thread that stored this rank's own packet
//      reads it back, as lamport.h requires) and writes the two scales; barrier B;
//   4. every thread normalizes, rotates and stores the group's tokens from its registers.
// kPrefetch: once step 2 has used a group's values, each thread copies its vectors of the block's
// next group into shared memory asynchronously (cp.async), and the copiers that group's cos/sin
// rows, so that they load while this group waits on its peers and stores; the next group takes
// them from there. A thread copies exactly the vectors it later reads, so no barrier guards that
// buffer.
// The sums and scales alternate between two buffers by group, the cos/sin rows between three
// (the next group's are written before barrier A), so no barrier is needed after step 4: a buffer
// is written again only after a barrier every thread passes once it has finished with it. Blocks
// wait on peers group by group; tokens go to blocks in increasing order, so the lowest token any
// block waits for has always been sent (no deadlock whatever the peers' grids). The grid is at most
// what is resident at once, as for the one-token kernel. Blocks a multiprocessor the many-token
// kernel is compiled for (0: ptxas's choice). With one vector a thread and RoPE in registers, the
// prefetch unbounded takes enough registers to leave one block of 448 threads resident; held to
// two it spills a little.
template <int kVecsPerThread, bool kPrefetch>
constexpr int kGroupKernelMinBlocks = kPrefetch&& kVecsPerThread == 1 ? 2 : 0;

template <typename T, int kWorldSize, int kVecsPerThread, RopePath kRope, int kGroup,
          bool kPrefetch>
__global__ void __launch_bounds__(kMaxThreads, kGroupKernelMinBlocks<kVecsPerThread, kPrefetch>)
    qk_rmsnorm_group_kernel(const QkCall p) {
  static_assert(kRope != RopePath::kShared, "the shared-memory RoPE takes a token at a time");
  constexpr bool kRopeRegisters = kRope == RopePath::kRegisters;
  constexpr int kElements = Packed<T>::kElements;
  ControlBlock* const control = p.exchange.control;
  // A thread's indices are 32-bit (a row has at most kVecsPerThread * kMaxThreads vectors of q
  // and k); a token's offsets 64-bit. Every width is a multiple of kElements (validate.cc).
  const int q_vectors = int(p.q_size / kElements);
  const int vectors = int((p.q_size + p.kv_size) / kElements);
  const int64_t row_vectors = (p.q_size + 2 * p.kv_size) / kElements;
  const int64_t q_out_vectors = p.q_out_stride / kElements;
  const int64_t k_out_vectors = p.k_out_stride / kElements;
  const int64_t groups = (p.tokens + kGroup - 1) / kGroup;
  const int lane = int(threadIdx.x % 32);
  const int warp = int(threadIdx.x / 32);
  const int warps = int((blockDim.x + 31) / 32);
  // kRegisters: kRopeBuffers buffers of kGroup cos/sin rows; then, kPrefetch, the next group's
  // vectors.
  extern __shared__ __align__(16) float rope_shared[];
  __shared__ float2 warp_sums[2][kGroup][32];
  __shared__ float shared_scale[2][kGroup][2];
  __shared__ bool bad_position[kRopeBuffers][kGroup];
  __shared__ CallState shared_state;
  __shared__ EarlyHeaders early_headers;

  const auto vector_of = [&](int i) { return int(threadIdx.x) + i * int(blockDim.x); };
  // The tokens of the group from token `first`: kGroup, but in the last group.
  const auto tokens_from = [&](int64_t first) {
    return int(p.tokens - first < kGroup ? p.tokens - first : kGroup);
  };
  Vec16 values[kGroup][kVecsPerThread];
  // fn(g, i, c, source) for each of this thread's vectors of the group from token `first`:
  // token first + g, vector i, row vector c, at `source` in qkv.
  const auto for_each_vector = [&](int64_t first, auto&& fn) {
    const int count = tokens_from(first);
    const Vec16* const rows = static_cast<const Vec16*>(p.qkv) + first * row_vectors;
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
#pragma unroll
      for (int i = 0; i < kVecsPerThread; ++i) {
        const int c = vector_of(i);
        if (g < count && c < vectors) fn(g, i, c, rows + g * row_vectors + c);
      }
    }
  };
  const auto load_group = [&](int64_t first) {
    for_each_vector(first, [&](int g, int i, int, const Vec16* source) { values[g][i] = *source; });
  };
  Vec16* const prefetched = reinterpret_cast<Vec16*>(
      rope_shared + (kRopeRegisters ? kRopeBuffers * kGroup * p.rotary_dim : 0));
  const auto prefetch_group = [&](int64_t first) {
    for_each_vector(first, [&](int g, int, int c, const Vec16* source) {
      copy_async(prefetched + g * vectors + c, source);
    });
  };
  const auto take_prefetched = [&](int64_t first) {
    wait_async_copies();  // with RoPE, the group's cos/sin rows too
    for_each_vector(first, [&](int g, int i, int c, const Vec16*) {
      values[g][i] = prefetched[g * vectors + c];
    });
  };
  const auto bounded_position = [&](int64_t position) {
    return position >= 0 && position < p.max_position ? position : int64_t(-1);
  };
  // A position outside [0, max_position) reads row 0 of the cache; its token's outputs are NaN
  // and the error is recorded in step 3, as in the one-token kernel.
  // The copiers: the warps after the kGroup senders (every thread where there are no more warps).
  // Chunks of 4 floats (rotary_dim is a multiple of kElements here), a copy of 16 bytes where the
  // cache is 16-byte aligned; the copier of a row's first chunk marks a position outside the
  // cache. 32-bit: rotary_dim is at most head_dim. The caller commits the copies.
  const int copier = warps > kGroup ? int(threadIdx.x) - 32 * kGroup : int(threadIdx.x);
  const int copiers = warps > kGroup ? int(blockDim.x) - 32 * kGroup : int(blockDim.x);
  const auto copy_rope_rows = [&](int64_t first, int rope_buffer) {
    if constexpr (kRopeRegisters) {
      const int rotary = int(p.rotary_dim);
      const int chunks = rotary / 4;
      const int count = tokens_from(first);
      const bool aligned = reinterpret_cast<uintptr_t>(p.cos_sin_cache) % 16 == 0;
      float* const rows = rope_shared + rope_buffer * kGroup * rotary;
      for (int t = copier; t >= 0 && t < count * chunks; t += copiers) {
        const int g = t / chunks;
        const int offset = (t - g * chunks) * 4;
        const int64_t position = bounded_position(p.positions[first + g]);
        if (offset == 0) bad_position[rope_buffer][g] = position < 0;
        const float* const source =
            p.cos_sin_cache + (position < 0 ? 0 : position) * rotary + offset;
        float* const destination = rows + g * rotary + offset;
        if (aligned) {
          copy_async(destination, source);
        } else {
#pragma unroll
          for (int k = 0; k < 4; ++k) copy_async_4(destination + k, source + k);
        }
      }
    }
  };

  grid_dependency_wait();
  CallState state{0, 0, 0};
  if (threadIdx.x == 0) {
    state = read_call_state<GridCoop>(p.exchange);
    shared_state = state;
    block_lost_data() = 0;
  }
  load_group(int64_t(blockIdx.x) * kGroup);
  if constexpr (kRopeRegisters) {
    copy_rope_rows(int64_t(blockIdx.x) * kGroup, 0);
    commit_async_copies();
  }
  if (threadIdx.x == 0 && blockIdx.x == 0 && state.failed == 0)
    send_qk_header<kWorldSize>(state, p);
  Vec16 gammas[kVecsPerThread];
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    const int c = vector_of(i);
    if (c < vectors) {
      gammas[i] = c < q_vectors ? load_vector(p.q_gamma, c) : load_vector(p.k_gamma, c - q_vectors);
    }
  }
  const int half = int(p.rotary_dim / 2);
  int head_offset[kVecsPerThread];
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    head_offset[i] = kRopeRegisters ? int((vector_of(i) * kElements) % p.head_dim) : 0;
  }
  // A thread of a warp that sends nothing counts the block in (else lane 1 of warp 0).
  const unsigned arriver = warps > kGroup ? unsigned(kGroup) * 32u : 1u;

  int buffer = 0, rope_buffer = 0;
  for (int64_t group = blockIdx.x; group < groups; group += gridDim.x, buffer ^= 1) {
    const int64_t first = group * kGroup;
    const int next_rope_buffer = rope_buffer == kRopeBuffers - 1 ? 0 : rope_buffer + 1;
    if (group != blockIdx.x) {
      if constexpr (kPrefetch) {
        take_prefetched(first);
      } else {
        load_group(first);
        if constexpr (kRopeRegisters) {
          copy_rope_rows(first, rope_buffer);
          commit_async_copies();
        }
      }
    }
    const int count = tokens_from(first);
    // 2. Sums of squares per token, {q, k} at 2 g and 2 g + 1: this thread's, then its warp's
    // (spread: each group of 32 / (2 kGroup) lanes holds one of them).
    float sums[2 * kGroup];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      sums[2 * g] = sums[2 * g + 1] = 0.0f;
#pragma unroll
      for (int i = 0; i < kVecsPerThread; ++i) {
        const int c = vector_of(i);
        if (c >= vectors || g >= count) continue;
        const float squares = vector_sum_squares<T>(values[g][i]);
        if (c < q_vectors) {
          sums[2 * g] += squares;
        } else {
          sums[2 * g + 1] += squares;
        }
      }
    }
    {
      constexpr int kLanesAValue = 32 / (2 * kGroup);
      const float sum = warp_sum_spread(sums);
      const int index = lane / kLanesAValue;
      if (lane % kLanesAValue == 0)
        reinterpret_cast<float*>(&warp_sums[buffer][index / 2][warp])[index % 2] = sum;
    }
    if constexpr (kPrefetch) {
      // The values are used (their sums taken), so their shared copies may be overwritten; the
      // cos/sin buffer of the next group was last read two groups ago. A batch is committed
      // even when there is no next group, so that the first group's wait below counts right.
      if (group + gridDim.x < groups) {
        prefetch_group((group + gridDim.x) * kGroup);
        copy_rope_rows((group + gridDim.x) * kGroup, next_rope_buffer);
      }
      commit_async_copies();
    }
    __syncthreads();  // A: the warp sums, and (first group) what thread 0 read
    if (group == blockIdx.x && shared_state.failed != 0) {  // a failed team sends nothing
      wait_async_copies();  // none lands in shared memory after the block exits
      return;
    }
    const GpuSession<kWorldSize> session(shared_state);
    const int64_t token = first + warp;
    const bool sender = warp < count;
    if (sender) {
      const float2 partial = lane < warps ? warp_sums[buffer][warp][lane] : make_float2(0.0f, 0.0f);
      float pair[2] = {partial.x, partial.y};
      const float sum = warp_sum_spread(pair);  // q's in lanes 0-15, k's in 16-31
      const float k_sum = __shfl_sync(0xffffffffu, sum, 16);
      if (lane == 0) send_qk_packet(session, p, token, make_float2(sum, k_sum));
    }
    if (group == blockIdx.x) {
      // The one-token kernel's step 3, once a call.
      if (threadIdx.x == arriver) session.arrive(control, uint64_t(p.tokens) * sizeof(Vec16));
      launch_dependents();
      session.clear_previous(p.exchange);
      fetch_headers(session, p.exchange, early_headers);
    }
    // 3. Receive: W polls in flight, the sum in rank order, the scales.
    if (sender && lane == 0) {
      constexpr int kPolls = kWorldSize > 0 ? kWorldSize : kMaxWorldSize;
      const int world = session.world(p.exchange);
      const char* slot_base = session.receive_region(p.exchange, 0);
      const auto address = [&](int r) {
        return reinterpret_cast<const Vec16*>(slot_base + r * p.exchange.packet_bytes) + token;
      };
      // A world size known at compile time loads every packet before waiting for the first;
      // the runtime form polls one at a time (an array of kMaxWorldSize packets would spill).
      constexpr int kInFlight = kWorldSize > 0 ? kWorldSize : 1;
      Vec16 packets[kInFlight];
      if constexpr (kWorldSize > 0) {
#pragma unroll
        for (int r = 0; r < kPolls; ++r) packets[r] = load_packet(address(r));
      }
      float totals[4];
#pragma unroll
      for (int r = 0; r < kPolls; ++r) {
        if (r >= world) break;
        Vec16& packet = packets[kWorldSize > 0 ? r : 0];
        if constexpr (kWorldSize == 0) packet = load_packet(address(r));
        if (!has_arrived(packet)) {
          packet = wait_for_packet(address(r), session, p.exchange, p.signature, r);
        }
        if (r == 0) {
          accumulate_first<float>(totals, packet);
        } else {
          accumulate<float>(totals, packet);
        }
      }
      shared_scale[buffer][warp][0] = rms_scale(totals[0], p.q_global_size, p.eps);
      shared_scale[buffer][warp][1] = rms_scale(totals[1], p.k_global_size, p.eps);
      if (kRopeRegisters && bad_position[rope_buffer][warp]) record_bad_position(p, token);
    }
    if constexpr (kRopeRegisters) {
      // This group's cos/sin rows: copied in step 1 (the first group, or without kPrefetch; with
      // kPrefetch the next group's batch is the one after them), else taken with the values.
      if (!kPrefetch) {
        wait_async_copies();
      } else if (group == blockIdx.x) {
        wait_async_copies_but<1>();
      }
    }
    __syncthreads();  // B: the scales, and the cos/sin rows
                      // 4. Normalize, rotate, store.
    Vec16* const q_rows = static_cast<Vec16*>(p.q_out) + first * q_out_vectors;
    Vec16* const k_rows = static_cast<Vec16*>(p.k_out) + first * k_out_vectors;
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      if (g >= count) break;
      float lanes[kVecsPerThread][kElements];
#pragma unroll
      for (int i = 0; i < kVecsPerThread; ++i) {
        const int c = vector_of(i);
        if (c >= vectors) {
#pragma unroll
          for (int e = 0; e < kElements; ++e) lanes[i][e] = 0.0f;  // shuffled, never stored
          continue;
        }
        scale_lanes<T>(values[g][i], gammas[i], shared_scale[buffer][g][c < q_vectors ? 0 : 1],
                       lanes[i]);
      }
      if constexpr (kRopeRegisters) {
        const float* const row_cos_sin = rope_shared + (rope_buffer * kGroup + g) * p.rotary_dim;
        const bool neox = p.rope == RopeStyle::kNeox;
#pragma unroll
        for (int i = 0; i < kVecsPerThread; ++i) {
          const int j0 = head_offset[i];
          const bool rotary = vector_of(i) < vectors && j0 < p.rotary_dim;
          // The run of cos/sin indices of this vector, as in the one-token kernel.
          const int start = neox ? (j0 < half ? j0 : j0 - half) : j0 / 2;
          if (neox) {
            const bool first_half = j0 < half;
            const int away = half / kElements;
            const int source = rotary ? (first_half ? lane + away : lane - away) : lane;
#pragma unroll
            for (int e = 0; e < kElements; ++e) {
              const float partner = __shfl_sync(0xffffffffu, lanes[i][e], source);
              if (rotary) {
                lanes[i][e] = rotate(lanes[i][e], partner, row_cos_sin[start + e],
                                     row_cos_sin[half + start + e], first_half);
              }
            }
          } else if (rotary) {
#pragma unroll
            for (int e = 0; e < kElements; e += 2) {
              const float c = row_cos_sin[start + e / 2], s = row_cos_sin[half + start + e / 2];
              const float x0 = lanes[i][e], x1 = lanes[i][e + 1];
              lanes[i][e] = rotate(x0, x1, c, s, true);
              lanes[i][e + 1] = rotate(x1, x0, c, s, false);
            }
          }
        }
      }
      const bool bad = kRopeRegisters && bad_position[rope_buffer][g];
#pragma unroll
      for (int i = 0; i < kVecsPerThread; ++i) {
        const int c = vector_of(i);
        if (c >= vectors) continue;
        const Vec16 out = bad ? nan_vector() : pack<T>(lanes[i]);
        if (c < q_vectors) {
          q_rows[g * q_out_vectors + c] = out;
        } else {
          k_rows[g * k_out_vectors + (c - q_vectors)] = out;
        }
      }
    }
    rope_buffer = next_rope_buffer;
  }
  const GpuSession<kWorldSize> session(shared_state);
  check_header(session, p.exchange, p.signature, early_headers);
  end_call(session, p.exchange, [&] { return qk_outputs(p, sizeof(T)); });
}

// Dynamic shared memory of a launch: with RoPE through shared memory, the normalized row and the
// cos/sin row.
size_t rope_shared_bytes(const QkCall& params, RopePath path) {
  return path == RopePath::kShared
             ? size_t(params.q_size + params.kv_size + params.rotary_dim) * sizeof(float)
             : 0;
}

template <typename Fn>
void dispatch_rope_path(RopePath path, Fn&& fn) {
  switch (path) {
    case RopePath::kNone:
      return fn(std::integral_constant<RopePath, RopePath::kNone>{});
    case RopePath::kShared:
      return fn(std::integral_constant<RopePath, RopePath::kShared>{});
    case RopePath::kRegisters:
      return fn(std::integral_constant<RopePath, RopePath::kRegisters>{});
  }
}

// Whether an instantiation exists (rope_path never picks kRegisters for more vectors).
template <RopePath kRope, int kVecs>
constexpr bool qk_kernel_exists() {
  return kRope != RopePath::kRegisters || kVecs <= kMaxRopeRegisterVecs;
}

}  // namespace

// Tokens a block of the many-token kernel holds at once: fewer share each exchange among fewer
// tokens, more spill registers with RoPE
// (cdd3d3d:bench/studies/h200-20261202-eee69af-qk-many-tokens/, docs/notebook.md).
constexpr int kQkTokenGroup = 4;

// Whether the fused QK norm takes the many-token kernel, whose grid (`group_grid`: its resident
// blocks) holds kQkTokenGroup tokens a block: from a quarter of that grid's tokens (more tokens
// than blocks). Below, the one-token kernel spreads the tokens over up to kQkTokenGroup times the
// blocks and is faster (same study). TPFUSE_QK_MANY_TOKENS_FROM overrides it (read once; 0 takes
// the many-token kernel at any count, as a test of it on few tokens does).
template <typename Grid>
bool takes_many_token_kernel(int64_t tokens, int multiprocessors, Grid&& group_grid) {
  static const int64_t configured = [] {
    const char* value = std::getenv("TPFUSE_QK_MANY_TOKENS_FROM");
    return value != nullptr && value[0] != '\0' ? std::max<long long>(0, std::atoll(value)) : -1LL;
  }();
  if (configured >= 0) return tokens > configured;
  // The grid is at least a block a multiprocessor: below that bound no occupancy lookup (the
  // calls of a decode step stay off it).
  if (tokens <= int64_t(kQkTokenGroup) * multiprocessors / 4) return false;
  return tokens > kQkTokenGroup * group_grid() / 4;
}

// Whether the many-token kernel prefetches the next group (its kPrefetch); TPFUSE_QK_PREFETCH=0
// turns it off (read once), for A/B runs.
inline bool qk_prefetch_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("TPFUSE_QK_PREFETCH");
    return value == nullptr || value[0] != '0';
  }();
  return enabled;
}

// The many-token kernel's dynamic shared memory: with RoPE in registers two buffers of kGroup
// cos/sin rows, and with kPrefetch a group's q and k vectors.
inline size_t group_kernel_shared_bytes(const QkCall& params, RopePath path, bool prefetch,
                                        size_t element_size) {
  const size_t rope = path == RopePath::kRegisters
                          ? size_t(kRopeBuffers * kQkTokenGroup * params.rotary_dim) * sizeof(float)
                          : 0;
  return rope + (prefetch
                     ? size_t(kQkTokenGroup) * size_t(params.q_size + params.kv_size) * element_size
                     : 0);
}

// The most dynamic shared memory the prefetching kernel is allowed (set once per device when the
// team preloads its kernels): four tokens of the widest row one block takes (512 threads of two
// vectors: 16 KiB a token) and their cos/sin rows.
constexpr int kGroupKernelMaxSharedBytes = 96 * 1024;

// The fused QK kernel's world sizes: dispatch_world_size's, and one rank (a one-rank team runs
// the fused kernel, its exchange with itself only).
template <typename Fn>
void dispatch_qk_world_size(int world_size, Fn&& fn) {
  if (world_size == 1) return fn(IntTag<1>{});
  dispatch_world_size(world_size, std::forward<Fn>(fn));
}

template <typename T>
void QkKernels<T>::launch_fused(const TeamState& team, const QkCall& params, cudaStream_t stream) {
  // The widest block that fits (one vector a thread): more vectors a thread measured slower.
  const LaunchShape shape = launch_shape(params.q_size + params.kv_size, sizeof(T));
  const RopePath path = rope_path(params, int(16 / sizeof(T)), shape.vecs_per_thread);
  const size_t shared_bytes = rope_shared_bytes(params, path);
  dispatch_qk_world_size(params.exchange.world_size, [&](auto world_tag) {
    constexpr int kWorld = decltype(world_tag)::value;
    dispatch_vecs(shape.vecs_per_thread, [&](auto vecs_tag) {
      constexpr int kVecs = decltype(vecs_tag)::value;
      dispatch_rope_path(path, [&](auto rope_tag) {
        constexpr RopePath kRope = decltype(rope_tag)::value;
        if constexpr (!qk_kernel_exists<kRope, kVecs>()) {
          TPF_FAIL("no QK-norm kernel with RoPE in registers for " << kVecs << " vectors");
        } else {
          // The grid is at most what is resident at once (blocks wait on peers). Many tokens
          // take the many-token kernel where it exists; else, with more than twice as many
          // tokens as resident blocks, the kernel that loads a token ahead (with fewer tokens a
          // block its larger register set, which fits fewer blocks, measured slower).
          const auto resident = [&](auto kernel) {
            return cuda_state(team).multiprocessors *
                   resident_blocks_per_multiprocessor(kernel, shape.threads, shared_bytes);
          };
          const auto run = [&](auto kernel) {
            const int blocks = int(std::min<int64_t>(params.tokens, resident(kernel)));
            launch(kernel, blocks, shape.threads, shared_bytes, stream, params);
          };
          const auto one_by_one = qk_rmsnorm_kernel<T, kWorld, kVecs, kRope, QkPass::kFused>;
          if constexpr (kVecs <= 2 && kRope != RopePath::kShared) {
            // A warp per token of a group finishes its sums: at least kQkTokenGroup warps.
            constexpr int kGroup = kQkTokenGroup;
            const bool prefetch = qk_prefetch_enabled() &&
                                  group_kernel_shared_bytes(params, kRope, true, sizeof(T)) <=
                                      size_t(kGroupKernelMaxSharedBytes);
            const auto kernel =
                prefetch ? qk_rmsnorm_group_kernel<T, kWorld, kVecs, kRope, kGroup, true>
                         : qk_rmsnorm_group_kernel<T, kWorld, kVecs, kRope, kGroup, false>;
            const size_t bytes = group_kernel_shared_bytes(params, kRope, prefetch, sizeof(T));
            const auto grid = [&] {
              return int64_t(cuda_state(team).multiprocessors) *
                     resident_blocks_per_multiprocessor(kernel, shape.threads, bytes);
            };
            if (shape.threads >= 32 * kGroup &&
                takes_many_token_kernel(params.tokens, cuda_state(team).multiprocessors, grid)) {
              const int64_t groups = (params.tokens + kGroup - 1) / kGroup;
              return launch(kernel, int(std::min(groups, grid())), shape.threads, bytes, stream,
                            params);
            }
          }
          if constexpr (kVecs <= 2) {
            if (params.tokens > 2 * int64_t(resident(one_by_one))) {
              return run(qk_rmsnorm_kernel<T, kWorld, kVecs, kRope, QkPass::kFused, true>);
            }
          }
          run(one_by_one);
        }
      });
    });
  });
}

template <typename T>
void QkKernels<T>::preload_kernels(int world_size) {
  dispatch_qk_world_size(world_size, [&](auto world_tag) {
    constexpr int kWorld = decltype(world_tag)::value;
    for (int vecs : {1, 2, 4, 8}) {
      dispatch_vecs(vecs, [&](auto vecs_tag) {
        constexpr int kVecs = decltype(vecs_tag)::value;
        preload(qk_rmsnorm_kernel<T, 1, kVecs, RopePath::kNone, QkPass::kSums>);
        for (RopePath path : {RopePath::kNone, RopePath::kShared, RopePath::kRegisters}) {
          dispatch_rope_path(path, [&](auto rope_tag) {
            constexpr RopePath kRope = decltype(rope_tag)::value;
            if constexpr (qk_kernel_exists<kRope, kVecs>()) {
              preload(qk_rmsnorm_kernel<T, kWorld, kVecs, kRope, QkPass::kFused>);
              if constexpr (kVecs <= 2) {
                preload(qk_rmsnorm_kernel<T, kWorld, kVecs, kRope, QkPass::kFused, true>);
              }
              if constexpr (kVecs <= 2 && kRope != RopePath::kShared) {
                preload(qk_rmsnorm_group_kernel<T, kWorld, kVecs, kRope, kQkTokenGroup, false>);
                const auto prefetching =
                    qk_rmsnorm_group_kernel<T, kWorld, kVecs, kRope, kQkTokenGroup, true>;
                preload(prefetching);
                TPF_CHECK_CUDA(cudaFuncSetAttribute(prefetching,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                    kGroupKernelMaxSharedBytes));
              }
              preload(qk_rmsnorm_kernel<T, 1, kVecs, kRope, QkPass::kNormFromSums>);
            }
          });
        }
      });
    }
  });
}

template <typename T>
void QkKernels<T>::launch_local(const QkCall& params, QkPass pass, cudaStream_t stream) {
  const LaunchShape shape = launch_shape(params.q_size + params.kv_size, sizeof(T));
  const RopePath path = pass == QkPass::kNormFromSums
                            ? rope_path(params, int(16 / sizeof(T)), shape.vecs_per_thread)
                            : RopePath::kNone;
  const size_t shared_bytes = rope_shared_bytes(params, path);
  const int blocks = int(std::min<int64_t>(params.tokens, 65535));
  dispatch_vecs(shape.vecs_per_thread, [&](auto vecs_tag) {
    constexpr int kVecs = decltype(vecs_tag)::value;
    if (pass == QkPass::kSums) {
      launch(qk_rmsnorm_kernel<T, 1, kVecs, RopePath::kNone, QkPass::kSums>, blocks, shape.threads,
             0, stream, params);
      return;
    }
    dispatch_rope_path(path, [&](auto rope_tag) {
      constexpr RopePath kRope = decltype(rope_tag)::value;
      if constexpr (!qk_kernel_exists<kRope, kVecs>()) {
        TPF_FAIL("no QK-norm kernel with RoPE in registers for " << kVecs << " vectors");
      } else {
        launch(qk_rmsnorm_kernel<T, 1, kVecs, kRope, QkPass::kNormFromSums>, blocks, shape.threads,
               shared_bytes, stream, params);
      }
    });
  });
}

}  // namespace tpfuse::impl
