// The local fused epilogue kernel (no collective): add + RMSNorm, or RMSNorm, of one rank's rows.
// add_rmsnorm runs it, and the NCCL path runs it on the all-reduced sum.
#include <cuda_runtime.h>

#include <algorithm>

#include "core/calls.h"
#include "core/error.h"
#include "cuda/device_ops.cuh"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"
#include "cuda/row_launch.cuh"
#include "cuda/rows.cuh"
#include "tpfuse/impl/epilogue.h"

namespace tpfuse::impl {
namespace {

// Rows resident at once decide its speed past a few hundred tokens (one block a row, each a
// chain of load, block reduction, store): gamma is read after the row's sum is stored, where
// its latency overlaps the reduction and no register holds it while the row loads (hidden 3072
// in bf16: four blocks of 384 threads fit a multiprocessor instead of three; a tighter register
// cap spills).
template <typename T, typename Epilogue, int kVecsPerThread>
__device__ __forceinline__ void local_epilogue_rows(const RowCall& p) {
  constexpr int kElements = Packed<T>::kElements;
  const int64_t vectors = p.hidden / kElements;
  __shared__ float shared_sums[33];
  grid_dependency_wait();
  launch_dependents();
  for (int64_t token = blockIdx.x; token < p.tokens; token += gridDim.x) {
    Vec16 input[kVecsPerThread], residual[kVecsPerThread];
    load_contribution<T, Epilogue, kVecsPerThread>(p, token, vectors, input);
    if constexpr (Epilogue::kHasResidual) {
      load_row<kVecsPerThread>(p.residual, token * vectors, vectors, residual);
    }
    float acc[kVecsPerThread][kElements];
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      if (owns<kVecsPerThread>(i, vectors)) accumulate_first<T>(acc[i], input[i]);
    }
    finish_row<T, kVecsPerThread, Epilogue>(acc, residual, GammaInMemory{p.gamma}, p, token,
                                            vectors, shared_sums, NoSend{});
  }
}

template <typename T, typename Epilogue, int kVecsPerThread>
__global__ void __launch_bounds__(kMaxThreads) local_epilogue_kernel(const RowCall p) {
  local_epilogue_rows<T, Epilogue, kVecsPerThread>(p);
}

// The FP8 forms with one vector a thread (MoE aside) held to 56 registers, which they fit without
// spilling: three blocks of 384 threads resident instead of two. (A cap on every kernel would
// change the others' allocation too.)
template <typename T, typename Epilogue, int kVecsPerThread>
__global__ void __maxnreg__(56) local_epilogue_kernel_56(const RowCall p) {
  local_epilogue_rows<T, Epilogue, kVecsPerThread>(p);
}

// The FP8 forms with two vectors a thread (MoE aside; hidden 4104-8192 in bf16) take 101
// registers at hidden 7168: one block of 448 threads a multiprocessor. Held to 72 (with spills),
// two fit. Measured on one H200 at hidden 7168 (the ab/ of
// bench/results/h200-20261202-eee69af-qk-many-tokens/): faster for the dynamic scales from 512
// tokens on (0.93x at 1024, 0.91x at 4096), slower for the static scale at every count and for
// every mode below 512 tokens (1.2x at 1-64): the launch picks it for the dynamic modes from
// kCappedFrom tokens.
template <typename T, typename Epilogue, int kVecsPerThread>
__global__ void __maxnreg__(72) local_epilogue_kernel_72(const RowCall p) {
  local_epilogue_rows<T, Epilogue, kVecsPerThread>(p);
}

constexpr int64_t kCappedFrom = 512;

template <typename T, typename Epilogue, int kVecsPerThread>
constexpr auto local_kernel() {
  if constexpr (Epilogue::kHasQuant && !Epilogue::kHasMoe && kVecsPerThread == 1) {
    return local_epilogue_kernel_56<T, Epilogue, kVecsPerThread>;
  } else {
    return local_epilogue_kernel<T, Epilogue, kVecsPerThread>;
  }
}

// Whether a call takes the 72-register form (above).
template <typename Epilogue, int kVecsPerThread>
constexpr bool has_capped_form() {
  return Epilogue::kHasQuant && !Epilogue::kHasMoe && kVecsPerThread == 2;
}

bool takes_capped_form(const RowCall& call) {
  return call.tokens >= kCappedFrom &&
         (call.quant == QuantMode::kPerToken || call.quant == QuantMode::kPerTokenGroup128);
}

// The MoE combine alone, rounded, into `out` [tokens, hidden]: what the NCCL path all-reduces.
template <typename T, typename Epilogue, int kVecsPerThread>
__global__ void __launch_bounds__(kMaxThreads) moe_combine_kernel(const RowCall p, void* out) {
  const int64_t vectors = p.hidden / Packed<T>::kElements;
  grid_dependency_wait();
  launch_dependents();
  for (int64_t token = blockIdx.x; token < p.tokens; token += gridDim.x) {
    Vec16 row[kVecsPerThread];
    load_contribution<T, Epilogue, kVecsPerThread>(p, token, vectors, row);
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      if (owns<kVecsPerThread>(i, vectors)) store_vector(out, token * vectors + owned(i), row[i]);
    }
  }
}

// The world size does not matter to a local kernel: row tags of world 1 (the runtime path) name
// each instantiation once.
constexpr int kLocalWorld = 1;

// A local kernel's launch: one block a token (at most 65535), the row's launch shape;
// launch_with(kernel_tag, blocks, threads) launches the instantiation bound to the call.
template <typename LaunchWith>
void launch_local(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue,
                  LaunchWith&& launch_with) {
  const LaunchShape shape = launch_shape(call.hidden, dtype_size(dtype));
  const int blocks = int(std::min<int64_t>(call.tokens, 65535));
  dispatch_row_kernel(dtype, kLocalWorld, epilogue, shape,
                      [&](auto kernel_tag) { launch_with(kernel_tag, blocks, shape.threads); });
}

}  // namespace

void cuda_local_epilogue(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue,
                         cudaStream_t stream) {
  TPF_CHECK_ARG(epilogue.norm, "local epilogue", "a plain sum has no local epilogue");
  launch_local(call, dtype, epilogue, [&](auto kernel_tag, int blocks, int threads) {
    using Tag = decltype(kernel_tag);
    if constexpr (has_capped_form<typename Tag::Epilogue, Tag::kVecs>()) {
      if (takes_capped_form(call)) {
        return launch(local_epilogue_kernel_72<typename Tag::T, typename Tag::Epilogue, Tag::kVecs>,
                      blocks, threads, 0, stream, call);
      }
    }
    if constexpr (Tag::Epilogue::kHasNorm) {
      launch(local_kernel<typename Tag::T, typename Tag::Epilogue, Tag::kVecs>(), blocks, threads,
             0, stream, call);
    }
  });
}

void cuda_moe_combine(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue, void* out,
                      cudaStream_t stream) {
  TPF_CHECK_ARG(epilogue.moe, "moe combine", "the call has no MoE finalize");
  launch_local(call, dtype, epilogue, [&](auto kernel_tag, int blocks, int threads) {
    using Tag = decltype(kernel_tag);
    if constexpr (Tag::Epilogue::kHasMoe) {
      launch(moe_combine_kernel<typename Tag::T, typename Tag::Epilogue, Tag::kVecs>, blocks,
             threads, 0, stream, call, out);
    }
  });
}

void cuda_preload_local_kernels() {
  for_each_row_kernel(kLocalWorld, [](auto kernel_tag) {
    using Tag = decltype(kernel_tag);
    if constexpr (Tag::Epilogue::kHasNorm) {
      preload(local_kernel<typename Tag::T, typename Tag::Epilogue, Tag::kVecs>());
    }
    if constexpr (has_capped_form<typename Tag::Epilogue, Tag::kVecs>()) {
      preload(local_epilogue_kernel_72<typename Tag::T, typename Tag::Epilogue, Tag::kVecs>);
    }
    if constexpr (Tag::Epilogue::kHasMoe) {
      preload(moe_combine_kernel<typename Tag::T, typename Tag::Epilogue, Tag::kVecs>);
    }
  });
}

}  // namespace tpfuse::impl
