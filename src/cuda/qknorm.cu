// The distributed QK norm fused with its all-reduce (MiniMax-M2's QK-norm site), with optional
// rotary embedding. One kernel per call and rank; the exchange is the Lamport one-shot protocol
// of tpfuse/impl/lamport.h with one 16-byte packet per token, {sum q^2, sum k^2, 0, 0} in fp32.
//
//   [before griddepcontrol.wait]  nothing that reads or writes memory.
//   1. thread 0 reads the slot index, the bytes to clear and the error flag, while every
//      thread loads its q / k vectors of its block's first token (the latencies overlap).
//   2. per token of the block: sums of squares of q and k, one fixed-order block sum of the
//      pair (its barrier publishes what thread 0 read); thread 0 stores the packet into every
//      rank's slot.
//   3. arrival (the last block advances the slot index), launch_dependents, clear the previous
//      call's slot but this rank's own region: as the add + RMSNorm one-shot kernel (oneshot.cu
//      says why it is safe).
//   4. per token: with RoPE, the position's cos/sin row is loaded into shared memory while the
//      packets are in flight; thread 0 polls the W packets of this token and sums them in rank
//      order (the same bits on every rank; its own packet is one this thread stored in step 2),
//      computes both scales and shares them; each thread normalizes its vectors; with RoPE the
//      normalized row goes through shared memory so each element can read its rotation partner; one
//      rounding to the output type.
#include <cuda_runtime.h>

#include "common/error.h"
#include "common/team_state.h"
#include "cuda/device_ops.cuh"
#include "cuda/launch.cuh"
#include "tpfuse/impl/dispatch.h"
#include "tpfuse/impl/epilogue.h"
#include "tpfuse/impl/qknorm.h"

namespace tpfuse::impl {
namespace {

// kPass: kFused runs the whole protocol; kSums stops after step 2, writing this rank's sums to
// p.sums instead of sending them; kNormFromSums skips steps 1-3 and takes the global sums from
// p.sums. The three share every arithmetic step, so the halves give the fused op's bits.
template <typename T, int kWorldSize, int kVecsPerThread, bool kRope, QkPass kPass>
__global__ void __launch_bounds__(kMaxThreads) qk_rmsnorm_kernel(const QkNormParams p) {
  constexpr bool kFused = kPass == QkPass::kFused;
  constexpr int kElements = Packed<T>::kElements;
  ControlBlock* const control = p.exchange.control;
  const int world = kWorldSize > 0 ? kWorldSize : p.exchange.world_size;
  const int rank = p.exchange.rank;
  const int64_t q_vectors = p.q_size / kElements;
  const int64_t vectors = (p.q_size + p.kv_size) / kElements;
  const int64_t row = p.q_size + 2 * p.kv_size;
  // RoPE only: the normalized row (q_size + kv_size floats), then the position's cos/sin row.
  extern __shared__ float rope_shared[];
  float* const normalized = rope_shared;
  float* const cos_sin = rope_shared + (p.q_size + p.kv_size);
  __shared__ float2 shared_sums[33];
  __shared__ float shared_scale[2];
  __shared__ CallState shared_state;

  grid_dependency_wait();
  if constexpr (!kFused) launch_dependents();  // a local pass has no slot to protect

  // 1. Thread 0 reads the control block while every thread loads its vectors (step 2): the two
  // latencies overlap, and the first block sum's barrier publishes what thread 0 read.
  CallState state{0, 0, 0};
  if (kFused && threadIdx.x == 0) {
    state = read_call_state(control);
    shared_state = state;
  }

  // Vector c of a row: q vector c for c < q_vectors, else k vector c - q_vectors. Its offset in
  // the qkv row and in the normalized row (q then k) is the same: c * kElements.
  const auto vector_of = [&](int i) { return int64_t(threadIdx.x) + int64_t(i) * blockDim.x; };

  // 2. Send (every block has at least one token: the grid is at most `tokens` blocks). Thread 0
  // sends, from the slot it read itself; a failed team sends nothing, so its peers time out too.
  for (int64_t token = blockIdx.x; kPass != QkPass::kNormFromSums && token < p.tokens;
       token += gridDim.x) {
    float2 sums = make_float2(0.0f, 0.0f);
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int64_t c = vector_of(i);
      if (c >= vectors) continue;
      const Vec16 v = load_vector(p.qkv, (token * row) / kElements + c);
      const float squares = vector_sum_squares<T>(v);
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
      const size_t send_offset = packet_offset(state.slot, rank, world, p.exchange.packet_bytes);
      const Vec16 packet = rewrite_sentinel(qk_packet(sums.x, p.counts_k ? sums.y : 0.0f));
#pragma unroll
      for (int r = 0; r < (kWorldSize > 0 ? kWorldSize : kMaxWorld); ++r) {
        if (kWorldSize == 0 && r >= world) break;
        store_packet(reinterpret_cast<Vec16*>(p.exchange.workspace[r] + send_offset) + token,
                     packet);
      }
    }
  }

  if constexpr (kPass == QkPass::kSums) return;
  if (kFused && shared_state.failed != 0) return;
  const uint32_t slot = kFused ? shared_state.slot : 0;

  // 3. Arrival, trigger, clear.
  if (kFused && threadIdx.x == 0) arrive(control, slot, uint64_t(p.tokens) * sizeof(Vec16));
  if constexpr (kFused) {
    launch_dependents();
    clear_slot(p.exchange.workspace[rank], slot_to_clear(slot), shared_state.clear_bytes, world,
               p.exchange.packet_bytes, rank);
  }

  // 4. Receive, normalize, rotate, store.
  const char* slot_base =
      p.exchange.workspace[rank] + packet_offset(slot, 0, world, p.exchange.packet_bytes);
  for (int64_t token = blockIdx.x; token < p.tokens; token += gridDim.x) {
    Vec16 values[kVecsPerThread], gammas[kVecsPerThread];
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int64_t c = vector_of(i);
      if (c >= vectors) continue;
      values[i] = load_vector(p.qkv, (token * row) / kElements + c);
      gammas[i] = c < q_vectors ? load_vector(p.q_gamma, c) : load_vector(p.k_gamma, c - q_vectors);
    }
    if constexpr (kRope) {
      // The position's cos/sin row, loaded while the packets are in flight; the barrier after
      // the poll publishes it.
      const float* row_cos_sin = p.cos_sin_cache + p.positions[token] * p.rotary_dim;
      for (int64_t e = threadIdx.x; e < p.rotary_dim; e += blockDim.x) cos_sin[e] = row_cos_sin[e];
    }
    if (kPass == QkPass::kNormFromSums && threadIdx.x == 0) {
      shared_scale[0] = rms_scale(p.sums[2 * token], p.q_global_size, p.eps);
      shared_scale[1] = rms_scale(p.sums[2 * token + 1], p.k_global_size, p.eps);
    }
    if (kFused && threadIdx.x == 0) {
      // Every sender's packet is loaded before the first is waited on: W polls in flight.
      constexpr int kPolls = kWorldSize > 0 ? kWorldSize : kMaxWorld;
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
          packets[r] = wait_for_packet(address(r), p.exchange.timeout_ns, &control->error,
                                       p.exchange.error_flag, r);
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
      if (c >= vectors) continue;
      scale_lanes<T>(values[i], gammas[i], shared_scale[c < q_vectors ? 0 : 1], lanes[i]);
      if constexpr (kRope) {
#pragma unroll
        for (int e = 0; e < kElements; ++e) normalized[c * kElements + e] = lanes[i][e];
      }
    }
    if constexpr (kRope) {
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
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      const int64_t c = vector_of(i);
      if (c >= vectors) continue;
      const Vec16 out = pack<T>(lanes[i]);
      if (c < q_vectors) {
        store_vector(p.q_out, (token * p.q_out_stride) / kElements + c, out);
      } else {
        store_vector(p.k_out, (token * p.k_out_stride) / kElements + (c - q_vectors), out);
      }
    }
    __syncthreads();  // shared_scale and the normalized row are reused by the next token
  }
}

// Dynamic shared memory of a launch: with RoPE, the normalized row and the cos/sin row.
size_t rope_shared_bytes(const QkNormParams& params, bool rope) {
  return rope ? size_t(params.q_size + params.kv_size + params.rotary_dim) * sizeof(float) : 0;
}

}  // namespace

void cuda_qk_rmsnorm(const TeamState& team, const QkNormParams& params, DType dtype,
                     cudaStream_t stream) {
  if (*reinterpret_cast<volatile uint32_t*>(team.error_flag) != 0) cuda_check(team);
  DeviceGuard guard(team.device);
  const LaunchShape shape = launch_shape(params.q_size + params.kv_size, dtype_size(dtype));
  const bool rope = params.rope != 0;
  const size_t shared_bytes = rope_shared_bytes(params, rope);
  dispatch_dtype(dtype, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    dispatch_world_size(params.exchange.world_size, [&](auto world_tag) {
      constexpr int kWorld = decltype(world_tag)::value;
      dispatch_vecs(shape.vecs_per_thread, [&](auto vecs_tag) {
        constexpr int kVecs = decltype(vecs_tag)::value;
        dispatch_bool(rope, [&](auto rope_tag) {
          constexpr bool kRope = decltype(rope_tag)::value != 0;
          const auto kernel = qk_rmsnorm_kernel<T, kWorld, kVecs, kRope, QkPass::kFused>;
          const int resident = team.multiprocessors * resident_blocks_per_multiprocessor(
                                                          kernel, shape.threads, shared_bytes);
          const int blocks = int(std::min<int64_t>(params.tokens, resident));
          launch(kernel, blocks, shape.threads, shared_bytes, stream, params);
        });
      });
    });
  });
}

void cuda_preload_qk_kernels(int world_size) {
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    dispatch_dtype(dtype, [&](auto type_tag) {
      using T = typename decltype(type_tag)::type;
      dispatch_world_size(world_size, [&](auto world_tag) {
        constexpr int kWorld = decltype(world_tag)::value;
        for (int vecs : {1, 2, 4, 8}) {
          dispatch_vecs(vecs, [&](auto vecs_tag) {
            constexpr int kVecs = decltype(vecs_tag)::value;
            preload(qk_rmsnorm_kernel<T, kWorld, kVecs, false, QkPass::kFused>);
            preload(qk_rmsnorm_kernel<T, kWorld, kVecs, true, QkPass::kFused>);
            preload(qk_rmsnorm_kernel<T, 1, kVecs, false, QkPass::kSums>);
            preload(qk_rmsnorm_kernel<T, 1, kVecs, false, QkPass::kNormFromSums>);
            preload(qk_rmsnorm_kernel<T, 1, kVecs, true, QkPass::kNormFromSums>);
          });
        }
      });
    });
  }
}

void cuda_qk_local(const QkNormParams& params, DType dtype, QkPass pass, cudaStream_t stream) {
  const LaunchShape shape = launch_shape(params.q_size + params.kv_size, dtype_size(dtype));
  const bool rope = pass == QkPass::kNormFromSums && params.rope != 0;
  const size_t shared_bytes = rope_shared_bytes(params, rope);
  const int blocks = int(std::min<int64_t>(params.tokens, 65535));
  dispatch_dtype(dtype, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    dispatch_vecs(shape.vecs_per_thread, [&](auto vecs_tag) {
      constexpr int kVecs = decltype(vecs_tag)::value;
      if (pass == QkPass::kSums) {
        launch(qk_rmsnorm_kernel<T, 1, kVecs, false, QkPass::kSums>, blocks, shape.threads, 0,
               stream, params);
        return;
      }
      dispatch_bool(rope, [&](auto rope_tag) {
        constexpr bool kRope = decltype(rope_tag)::value != 0;
        launch(qk_rmsnorm_kernel<T, 1, kVecs, kRope, QkPass::kNormFromSums>, blocks, shape.threads,
               shared_bytes, stream, params);
      });
    });
  });
}

}  // namespace tpfuse::impl
