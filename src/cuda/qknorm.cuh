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
// QkKernels<T> (kernels.h) launches and preloads the instantiations of one dtype: each dtype's
// are compiled in a translation unit of their own (CMakeLists.txt), and qknorm.cu binds a call
// to its dtype's.
#pragma once

#include <cuda_runtime.h>

#include "core/calls.h"
#include "core/error.h"
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

// kPass: kFused runs the whole protocol; kSums stops after step 2, writing this rank's sums to
// p.sums instead of sending them; kNormFromSums skips steps 2-3 and takes the global sums from
// p.sums. The three share every arithmetic step, so the halves give the fused op's bits.
// kLoadAhead (launches with several tokens a block, one or two vectors a thread; the host
// picks it): a block loads its next token's vectors while it works on the current one. A separate
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
  const int64_t q_vectors = p.q_size / kElements;
  const int64_t vectors = (p.q_size + p.kv_size) / kElements;
  const int64_t row = p.q_size + 2 * p.kv_size;
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
  const auto vector_of = [&](int i) { return int64_t(threadIdx.x) + int64_t(i) * blockDim.x; };
  const auto load_values = [&](int64_t token, Vec16(&values)[kVecsPerThread]) {
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int64_t c = vector_of(i);
      if (c < vectors) values[i] = load_vector(p.qkv, (token * row) / kElements + c);
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
    state = read_call_state<GridCoop>(control);
    shared_state = state;
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
    // The call header first (session.h), from the slot thread 0 read.
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
  for (int64_t token = blockIdx.x; kPass != QkPass::kNormFromSums && token < p.tokens;
       token += gridDim.x) {
    take_token(token);
    float2 sums = make_float2(0.0f, 0.0f);
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int64_t c = vector_of(i);
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
      const GpuSession<kWorldSize> sender(state);  // thread 0's own read
      const size_t send_offset = sender.send_offset(p.exchange);
      const Vec16 packet = rewrite_sentinel(qk_packet(sums.x, p.counts_k ? sums.y : 0.0f));
#pragma unroll
      for (int r = 0; r < (kWorldSize > 0 ? kWorldSize : kMaxWorldSize); ++r) {
        if (kWorldSize == 0 && r >= sender.world(p.exchange)) break;
        store_packet(reinterpret_cast<Vec16*>(p.exchange.workspace[r] + send_offset) + token,
                     packet);
      }
    }
  }

  if constexpr (kPass == QkPass::kSums) return;
  if (kFused && shared_state.failed != 0) return;
  const GpuSession<kWorldSize> session(kFused ? shared_state : CallState{0, 0, 0});
  const int world = session.world(p.exchange);
  if constexpr (kFused) fetch_headers(session, p.exchange, early_headers);
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    const int64_t c = vector_of(i);
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
      const int64_t c = vector_of(i);
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
        const int64_t c = vector_of(i);
        if (c >= vectors) continue;
        // 32-bit offsets: a RoPE row is at most kMaxQkRopeWidth elements.
        rope_lanes<kElements>(lanes[i], normalized, int(c * kElements), int(p.head_dim),
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
    if (position < 0 && threadIdx.x == 0 && p.exchange.errors != nullptr) {
      if (atomicCAS_system(&p.exchange.errors->call_error, 0u, uint32_t(CallError::kBadPosition)) ==
          0u) {
        p.exchange.errors->position_token = token;
        p.exchange.errors->position = p.positions[token];
        p.exchange.errors->max_position = p.max_position;
        __threadfence_system();
      }
    }
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int64_t c = vector_of(i);
      if (c >= vectors) continue;
      const Vec16 out = position < 0 ? nan_vector() : pack<T>(lanes[i]);
      if (c < q_vectors) {
        store_vector(p.q_out, (token * p.q_out_stride) / kElements + c, out);
      } else {
        store_vector(p.k_out, (token * p.k_out_stride) / kElements + (c - q_vectors), out);
      }
    }
    __syncthreads();  // shared_scale and the normalized row are reused by the next token
  }
  if constexpr (kFused) check_header(session, p.exchange, p.signature, early_headers);
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

template <typename T>
void QkKernels<T>::launch_fused(const TeamState& team, const QkCall& params, cudaStream_t stream) {
  // The widest block that fits (one vector a thread): more vectors a thread measured slower.
  const LaunchShape shape = launch_shape(params.q_size + params.kv_size, sizeof(T));
  const RopePath path = rope_path(params, int(16 / sizeof(T)), shape.vecs_per_thread);
  const size_t shared_bytes = rope_shared_bytes(params, path);
  dispatch_world_size(params.exchange.world_size, [&](auto world_tag) {
    constexpr int kWorld = decltype(world_tag)::value;
    dispatch_vecs(shape.vecs_per_thread, [&](auto vecs_tag) {
      constexpr int kVecs = decltype(vecs_tag)::value;
      dispatch_rope_path(path, [&](auto rope_tag) {
        constexpr RopePath kRope = decltype(rope_tag)::value;
        if constexpr (!qk_kernel_exists<kRope, kVecs>()) {
          TPF_FAIL("no QK-norm kernel with RoPE in registers for " << kVecs << " vectors");
        } else {
          // The grid is at most what is resident at once (blocks wait on peers). Launches with
          // more than twice as many tokens as resident blocks take the kernel that loads a
          // token ahead, where it exists: with fewer tokens a block its larger register set,
          // which fits fewer blocks, measured slower.
          const auto resident = [&](auto kernel) {
            return team.multiprocessors *
                   resident_blocks_per_multiprocessor(kernel, shape.threads, shared_bytes);
          };
          const auto run = [&](auto kernel) {
            const int blocks = int(std::min<int64_t>(params.tokens, resident(kernel)));
            launch(kernel, blocks, shape.threads, shared_bytes, stream, params);
          };
          const auto one_by_one = qk_rmsnorm_kernel<T, kWorld, kVecs, kRope, QkPass::kFused>;
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
  dispatch_world_size(world_size, [&](auto world_tag) {
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
