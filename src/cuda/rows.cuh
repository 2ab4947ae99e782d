// Row-level device helpers of the add-RMSNorm kernels (one-shot, two-shot, local): a block holds
// one token row, each thread kVecsPerThread 16-byte vectors of it in registers (vector i of
// thread t is element vector t + i * blockDim.x of the row).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/calls.h"
#include "cuda/device_ops.cuh"
#include "tpfuse/impl/epilogue.h"

namespace tpfuse::impl {

template <int kVecsPerThread>
__device__ __forceinline__ bool owns(int i, int64_t vectors) {
  return threadIdx.x + int64_t(i) * blockDim.x < vectors;
}
__device__ __forceinline__ int64_t owned(int i) {
  return threadIdx.x + int64_t(i) * blockDim.x;
}

// Loads this thread's vectors of row `row` of `base` (nothing where the thread owns none).
template <int kVecsPerThread>
__device__ __forceinline__ void load_row(const void* base, int64_t row, int64_t vectors,
                                         Vec16 (&out)[kVecsPerThread]) {
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    if (owns<kVecsPerThread>(i, vectors)) out[i] = load_vector(base, row + owned(i));
  }
}

// This thread's vectors of token `token`'s contribution to the sum: its input row, or (kHasMoe)
// the MoE combine of its expert rows (the MoeContribution policy's steps,
// epilogue/contribution_moe.h, a row's vectors at a time), rounded once to T. The expert rows are
// loaded kChunk at a time, all in flight before the first is added, and added in order.
template <typename T, typename Epilogue, int kVecsPerThread>
__device__ __forceinline__ void load_contribution(const RowCall& p, int64_t token, int64_t vectors,
                                                  Vec16 (&out)[kVecsPerThread]) {
  if constexpr (Epilogue::kHasMoe) {
    constexpr int kChunk = kVecsPerThread <= 2 ? 4 : 1;
    float acc[kVecsPerThread][Packed<T>::kElements] = {};
    for (int first = 0; first < p.moe_topk; first += kChunk) {
      Vec16 rows[kChunk][kVecsPerThread];
      float weights[kChunk];
#pragma unroll
      for (int c = 0; c < kChunk; ++c) {
        if (first + c >= p.moe_topk) break;
        const int64_t row = token * p.moe_topk + first + c;
        weights[c] = moe_weight<T>(p.moe_weights, p.moe_weights_in_dtype, row);
        load_row<kVecsPerThread>(p.moe_rows, row * vectors, vectors, rows[c]);
      }
#pragma unroll
      for (int c = 0; c < kChunk; ++c) {
        if (first + c >= p.moe_topk) break;
#pragma unroll
        for (int i = 0; i < kVecsPerThread; ++i) {
          if (owns<kVecsPerThread>(i, vectors)) {
            moe_accumulate<T>(acc[i], rows[c][i], weights[c], first + c == 0);
          }
        }
      }
    }
    if (p.moe_shared != nullptr) {
      Vec16 shared[kVecsPerThread];
      load_row<kVecsPerThread>(p.moe_shared, token * vectors, vectors, shared);
#pragma unroll
      for (int i = 0; i < kVecsPerThread; ++i) {
        if (owns<kVecsPerThread>(i, vectors)) moe_add_shared<T>(acc[i], shared[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      if (owns<kVecsPerThread>(i, vectors)) out[i] = pack<T>(acc[i]);
    }
  } else {
    load_row<kVecsPerThread>(p.input, token * vectors, vectors, out);
  }
}

// The start of a one-shot or two-shot call, after griddepcontrol.wait: thread 0 reads the control
// block while every thread loads its block's first contribution row (the two latencies overlap);
// the barrier gives every thread what thread 0 read.
template <typename T, typename Epilogue, int kVecsPerThread>
__device__ __forceinline__ CallState begin_call(const RowCall& p, int64_t vectors,
                                                Vec16 (&row)[kVecsPerThread]) {
  __shared__ CallState shared_state;
  if (threadIdx.x == 0) {
    shared_state = read_call_state<GridCoop>(p.exchange);
    block_lost_data() = 0;
  }
  load_contribution<T, Epilogue, kVecsPerThread>(p, blockIdx.x, vectors, row);
  __syncthreads();
  return shared_state;
}

// Sums this thread's vectors of a row over the `world` ranks in rank order in fp32: the peers'
// packets polled at `address` (vector index 0 of the row) in sender regions `sender_stride`
// bytes apart, this rank's own contribution (sentinel words rewritten as a peer receives them)
// from `own_row` (registers) when `own_in_registers`, else from `own` (its input row in memory):
// a rank's own rows never go through its slot.
template <typename T, int kWorldSize, int kVecsPerThread, typename Session>
__device__ __forceinline__ void receive_row(float (&acc)[kVecsPerThread][Packed<T>::kElements],
                                            const Vec16* address, size_t sender_stride,
                                            const Vec16* own,
                                            const Vec16 (&own_row)[kVecsPerThread],
                                            bool own_in_registers, int world, int64_t vectors,
                                            const Session& session, const RowCall& p) {
  const Exchange& x = p.exchange;
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    if (!owns<kVecsPerThread>(i, vectors)) continue;
    const auto own_vector = [&] {
      return rewrite_sentinel(own_in_registers ? own_row[i] : load_vector(own, owned(i)));
    };
    const Vec16* vector = address + owned(i);
    const auto sender_address = [&](int r) {
      return reinterpret_cast<const Vec16*>(reinterpret_cast<const char*>(vector) +
                                            r * sender_stride);
    };
    if constexpr (kWorldSize > 0) {
      // All W loads in flight before the first use.
      Vec16 packets[kWorldSize];
#pragma unroll
      for (int r = 0; r < kWorldSize; ++r) {
        packets[r] = r == x.rank ? own_vector() : load_packet(sender_address(r));
      }
#pragma unroll
      for (int r = 0; r < kWorldSize; ++r) {
        if (!has_arrived(packets[r])) {
          packets[r] = wait_for_packet(sender_address(r), session, x, p.signature, r);
        }
      }
      accumulate_first<T>(acc[i], packets[0]);
#pragma unroll
      for (int r = 1; r < kWorldSize; ++r) accumulate<T>(acc[i], packets[r]);
    } else {
      for (int r = 0; r < world; ++r) {
        Vec16 packet = r == x.rank ? own_vector() : load_packet(sender_address(r));
        if (!has_arrived(packet)) {
          packet = wait_for_packet(sender_address(r), session, x, p.signature, r);
        }
        if (r == 0) {
          accumulate_first<T>(acc[i], packet);
        } else {
          accumulate<T>(acc[i], packet);
        }
      }
    }
  }
}

// Where finish_row takes gamma from: vectors in registers (loaded earlier, while packets were in
// flight), or, for a kernel with nothing in flight to hide it behind, memory: loaded after the
// rounded outputs are stored, so that its latency overlaps the block reduction and no register
// holds it while the row is loaded (the local kernel: fewer registers, more rows resident).
struct GammaInMemory {
  const void* gamma;
};

template <int kVecsPerThread>
__device__ __forceinline__ void gamma_vectors(const Vec16 (&in)[kVecsPerThread], int64_t,
                                              Vec16 (&out)[kVecsPerThread]) {
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) out[i] = in[i];
}

template <int kVecsPerThread>
__device__ __forceinline__ void gamma_vectors(const GammaInMemory& in, int64_t vectors,
                                              Vec16 (&out)[kVecsPerThread]) {
  load_row<kVecsPerThread>(in.gamma, 0, vectors, out);
}

// The FP8 output of a token row from this thread's normalized vectors: the Output policy of the
// call's mode (tpfuse/impl/epilogue/outputs.h, picked at run time: no kernel per policy), one
// code path a scope (output_scale picks the policy's scale step): the call's static scale
// (kCall), the token's (a block max) or each group's (kGroup). A group's
// kQuantGroupSize elements are consecutive vectors held by consecutive lanes of one warp
// (blockDim is a multiple of 32 and hidden of the group size), so its max is a shuffle over 16
// (or, for fp32, 32) lanes; every lane takes part in the shuffles, those without a vector with 0.
template <typename T, int kVecsPerThread>
__device__ __forceinline__ void quantize_row(const Vec16 (&normalized)[kVecsPerThread],
                                             const RowCall& p, int64_t token, int64_t vectors,
                                             float* shared_values, float static_scale) {
  constexpr int kElements = Packed<T>::kElements;
  uint8_t* const out = static_cast<uint8_t*>(p.quant_out) + token * p.hidden;
  const auto store = [&](int i, const Fp8Divisor& divisor) {
    const QuantBytes<T> q = quantize_vector<T>(normalized[i], divisor);
    uint8_t* const at = out + owned(i) * kElements;
    if constexpr (kElements == 8) {
      uint2 word;
      memcpy(&word, q.bytes, 8);
      *reinterpret_cast<uint2*>(at) = word;
    } else {
      uint32_t word;
      memcpy(&word, q.bytes, 4);
      *reinterpret_cast<uint32_t*>(at) = word;
    }
  };
  const OutputScope scope = output_scope_of(p.quant);
  if (scope == OutputScope::kGroup) {
    constexpr int kGroupLanes = int(kQuantGroupSize) / kElements;  // 16, or 32 for fp32
    const int64_t groups = p.hidden / kQuantGroupSize;
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      // The same for every thread of the block, so the shuffles below see whole warps.
      if (int64_t(i) * blockDim.x >= vectors) break;
      const bool mine = owns<kVecsPerThread>(i, vectors);
      float amax = mine ? vector_amax<T>(normalized[i]) : 0.0f;
#pragma unroll
      for (int offset = kGroupLanes / 2; offset > 0; offset /= 2) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
      }
      const float scale = output_scale<OutputScope::kGroup>(p.quant, dynamic_scale(amax));
      if (mine) {
        store(i, fp8_divisor(scale));
        if (owned(i) % kGroupLanes == 0) {
          p.scales_out[group_scale_index(token, owned(i) / kGroupLanes, p.tokens, groups,
                                         p.scales_column_major)] = scale;
        }
      }
    }
    return;
  }
  float scale = static_scale;  // kCall
  if (scope == OutputScope::kToken) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      if (owns<kVecsPerThread>(i, vectors)) amax = fmaxf(amax, vector_amax<T>(normalized[i]));
    }
    scale =
        output_scale<OutputScope::kToken>(p.quant, dynamic_scale(block_max(amax, shared_values)));
    if (threadIdx.x == 0) p.scales_out[token] = scale;
  }
  const Fp8Divisor divisor = fp8_divisor(scale);
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    if (owns<kVecsPerThread>(i, vectors)) store(i, divisor);
  }
}

// The epilogue for one token row whose fp32 rank sum each thread holds in `acc`; the residual
// vectors were loaded earlier, while the packets were in flight, and gamma as `Gamma` says.
// on_rounded(i, vector) sees each rounded output vector (residual_out's, or out's for a plain
// sum): the two-shot owner sends it to its peers there.
template <typename T, int kVecsPerThread, typename Epilogue, typename Gamma, typename OnRounded>
__device__ __forceinline__ void finish_row(float (&acc)[kVecsPerThread][Packed<T>::kElements],
                                           const Vec16 (&residual)[kVecsPerThread],
                                           const Gamma& gamma_source, const RowCall& p,
                                           int64_t token, int64_t vectors, float* shared_sums,
                                           OnRounded&& on_rounded) {
  const int64_t row = token * vectors;
  void* const rounded_out = Epilogue::kHasNorm ? p.residual_out : p.norm_out;
  float sum_squares = 0.0f;
#pragma unroll
  for (int i = 0; i < kVecsPerThread; ++i) {
    if (owns<kVecsPerThread>(i, vectors)) {
      const Vec16 rounded = Epilogue::template round_sum<T>(acc[i], residual[i], sum_squares);
      if (!Epilogue::kHasNorm || rounded_out != nullptr) {
        store_vector(rounded_out, row + owned(i), rounded);
      }
      on_rounded(i, rounded);
    }
  }
  if constexpr (Epilogue::kHasNorm) {
    Vec16 gamma[kVecsPerThread];
    gamma_vectors<kVecsPerThread>(gamma_source, vectors, gamma);
    // The static FP8 scale, loaded while the reduction runs.
    float static_scale = 1.0f;
    if constexpr (Epilogue::kHasQuant) {
      // Given for a kCall output alone (validate_quant).
      if (p.quant_scale != nullptr) static_scale = *p.quant_scale;
    }
    const float scale = rms_scale(block_sum(sum_squares, shared_sums), p.hidden, p.eps);
    Vec16 normalized[kVecsPerThread];
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      if (owns<kVecsPerThread>(i, vectors)) {
        normalized[i] = Epilogue::template normalize<T>(acc[i], gamma[i], scale);
        // Only an FP8 call may leave the bf16 norm out (validate_add_rmsnorm).
        if (!Epilogue::kHasQuant || p.norm_out != nullptr) {
          store_vector(p.norm_out, row + owned(i), normalized[i]);
        }
      }
    }
    if constexpr (Epilogue::kHasQuant) {
      quantize_row<T, kVecsPerThread>(normalized, p, token, vectors, shared_sums, static_scale);
    }
  }
}

struct NoSend {
  __device__ __forceinline__ void operator()(int, const Vec16&) const {}
};

}  // namespace tpfuse::impl
