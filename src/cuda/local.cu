// The local fused epilogue kernel (no collective): add + RMSNorm, or RMSNorm, of one rank's rows.
// add_rmsnorm runs it, and the NCCL path runs it on the all-reduced sum.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#include "core/calls.h"
#include "cuda/check.h"
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
//
// kStage, for a two-vector kernel of which one block fits a multiprocessor (the FP8 forms at
// hidden 7168 in bf16): nothing else there overlaps a row's reduction and stores with loads, so
// past one wave the grid is what fits at once, a block takes rows token, token + gridDim.x, ...,
// and once a thread has its vectors of a row it copies the same vectors of the block's next row
// into shared memory (cp.async), in flight while this row finishes. Two buffers alternate, so a
// copy never lands where the thread is still reading; a thread reads back only what it copied, so
// no barrier is needed. Not where two or more blocks fit (the other blocks' loads overlap the
// reduction) nor for four-vector rows (twice the loads in flight already): staging slows those
// (cdd3d3d:bench/studies/h200-20261202-local-staging/). Not for the MoE combine.
// Up to this many elements a call lets the next kernel launch as its blocks finish, above as they
// start: the next grid's early blocks take residency from a small call's rows, while a large
// call's drain overlaps the next launch (cdd3d3d:bench/studies/h200-20261202-local-trigger/).
constexpr int64_t kLateTriggerElements = int64_t{1} << 21;

template <typename T, typename Epilogue, int kVecsPerThread, bool kStage>
__device__ __forceinline__ void local_epilogue_rows(const RowCall& p) {
  static_assert(!(kStage && Epilogue::kHasMoe), "the MoE combine loads its rows itself");
  constexpr int kElements = Packed<T>::kElements;
  constexpr int kTensors = Epilogue::kHasResidual ? 2 : 1;
  const int64_t vectors = p.hidden / kElements;
  __shared__ float shared_sums[33];
  // [buffer][input, residual][kVecsPerThread][blockDim.x]: vector i of this thread of each.
  extern __shared__ __align__(16) Vec16 staged[];
  const auto staged_at = [&](int buffer, int tensor, int i) {
    return staged + ((buffer * kTensors + tensor) * kVecsPerThread + i) * int(blockDim.x) +
           int(threadIdx.x);
  };
  grid_dependency_wait();
  const bool trigger_late = p.tokens * p.hidden <= kLateTriggerElements;
  if (!trigger_late) launch_dependents();
  int buffer = 0;
  for (int64_t token = blockIdx.x; token < p.tokens; token += gridDim.x, buffer ^= 1) {
    Vec16 input[kVecsPerThread], residual[kVecsPerThread];
    if (kStage && token != blockIdx.x) {
      wait_async_copies();
#pragma unroll
      for (int i = 0; i < kVecsPerThread; ++i) {
        if (!owns<kVecsPerThread>(i, vectors)) continue;
        input[i] = *staged_at(buffer, 0, i);
        if constexpr (Epilogue::kHasResidual) residual[i] = *staged_at(buffer, 1, i);
      }
    } else {
      load_contribution<T, Epilogue, kVecsPerThread>(p, token, vectors, input);
      if constexpr (Epilogue::kHasResidual) {
        load_row<kVecsPerThread>(p.residual, token * vectors, vectors, residual);
      }
    }
    const int64_t next = token + gridDim.x;
    if (kStage && next < p.tokens) {
#pragma unroll
      for (int i = 0; i < kVecsPerThread; ++i) {
        if (!owns<kVecsPerThread>(i, vectors)) continue;
        const int64_t vector = next * vectors + owned(i);
        copy_async(staged_at(buffer ^ 1, 0, i), static_cast<const Vec16*>(p.input) + vector);
        if constexpr (Epilogue::kHasResidual) {
          copy_async(staged_at(buffer ^ 1, 1, i), static_cast<const Vec16*>(p.residual) + vector);
        }
      }
      commit_async_copies();
    }
    float acc[kVecsPerThread][kElements];
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      if (owns<kVecsPerThread>(i, vectors)) accumulate_first<T>(acc[i], input[i]);
    }
    finish_row<T, kVecsPerThread, Epilogue>(acc, residual, GammaInMemory{p.gamma}, p, token,
                                            vectors, shared_sums, NoSend{});
  }
  if (trigger_late) launch_dependents();
}

template <typename T, typename Epilogue, int kVecsPerThread, bool kStage>
__global__ void __launch_bounds__(kMaxThreads) local_epilogue_kernel(const RowCall p) {
  local_epilogue_rows<T, Epilogue, kVecsPerThread, kStage>(p);
}

// The FP8 forms with one vector a thread (MoE aside) held to 56 registers, which they fit without
// spilling: three blocks of 384 threads resident instead of two. (A cap on every kernel would
// change the others' allocation too.)
template <typename T, typename Epilogue, int kVecsPerThread, bool kStage>
__global__ void __maxnreg__(56) local_epilogue_kernel_56(const RowCall p) {
  local_epilogue_rows<T, Epilogue, kVecsPerThread, kStage>(p);
}

template <typename T, typename Epilogue, int kVecsPerThread, bool kStage>
constexpr auto local_kernel() {
  if constexpr (Epilogue::kHasQuant && !Epilogue::kHasMoe && kVecsPerThread == 1) {
    return local_epilogue_kernel_56<T, Epilogue, kVecsPerThread, kStage>;
  } else {
    return local_epilogue_kernel<T, Epilogue, kVecsPerThread, kStage>;
  }
}

using LocalKernel = void (*)(RowCall);

// The vectors a thread of a staging form holds (above).
constexpr int kStagedVecs = 2;

// The staging form of a local kernel, or nullptr where it has none.
template <typename T, typename Epilogue, int kVecsPerThread>
LocalKernel staging_kernel() {
  if constexpr (Epilogue::kHasMoe || kVecsPerThread != kStagedVecs) {
    return nullptr;
  } else {
    return local_kernel<T, Epilogue, kVecsPerThread, true>();
  }
}

// The MoE combine alone, rounded, into `out` [tokens, hidden]: what the NCCL path all-reduces,
// through the MoeContribution policy's per-vector step, as the CPU backend materializes it.
template <typename T, typename Epilogue, int kVecsPerThread>
__global__ void __launch_bounds__(kMaxThreads) moe_combine_kernel(const RowCall p, void* out) {
  const int64_t vectors = p.hidden / Packed<T>::kElements;
  grid_dependency_wait();
  launch_dependents();
  const MoeRows moe = moe_rows_of(p);
  const auto load = [](const void* base, int64_t index) { return load_vector(base, index); };
  for (int64_t token = blockIdx.x; token < p.tokens; token += gridDim.x) {
#pragma unroll
    for (int i = 0; i < kVecsPerThread; ++i) {
      if (owns<kVecsPerThread>(i, vectors)) {
        store_vector(out, token * vectors + owned(i),
                     Epilogue::Contribution::template combine_vector<T>(moe, token, vectors,
                                                                        owned(i), load));
      }
    }
  }
}

// The world size does not matter to a local kernel: row tags of world 1 (the runtime path) name
// each instantiation once.
constexpr int kLocalWorld = 1;
constexpr int64_t kMaxLocalBlocks = 65535;

// Whether the local kernel stages the next row past one wave (local_epilogue_rows);
// TPFUSE_LOCAL_STAGE=0 turns it off (read once), for A/B runs.
bool local_staging_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("TPFUSE_LOCAL_STAGE");
    return value == nullptr || value[0] != '0';
  }();
  return enabled;
}

// The dynamic shared memory a staging block of `threads` threads takes: two buffers of a row's
// input and residual vectors.
template <typename Epilogue, int kVecsPerThread>
constexpr size_t staged_bytes(int threads) {
  return 2 * size_t(Epilogue::kHasResidual ? 2 : 1) * kVecsPerThread * threads * sizeof(Vec16);
}

// A local epilogue kernel's launch: one block a token, or the staging form (local_epilogue_rows)
// on the blocks that fit with its shared memory; at most kMaxLocalBlocks blocks.
struct LocalLaunch {
  LocalKernel kernel;
  int blocks;
  int threads;
  size_t shared_bytes;  // > 0: the staging form
};

// Whether `kernel` may take `bytes` of dynamic shared memory on the current device; above the
// default 48 KiB it is allowed what the device offers (once per kernel and device).
bool allow_shared_bytes(LocalKernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return true;
  static std::mutex mutex;
  static std::map<std::pair<LocalKernel, int>, size_t> allowed;
  int device = 0;
  TPF_CHECK_CUDA(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  auto found = allowed.find({kernel, device});
  if (found == allowed.end()) {
    int offered = 0;
    TPF_CHECK_CUDA(
        cudaDeviceGetAttribute(&offered, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    cudaFuncAttributes attributes{};
    TPF_CHECK_CUDA(cudaFuncGetAttributes(&attributes, kernel));
    const size_t most = size_t(offered) - attributes.sharedSizeBytes;
    TPF_CHECK_CUDA(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(most)));
    found = allowed.emplace(std::make_pair(kernel, device), most).first;
  }
  return bytes <= found->second;
}

template <typename Epilogue, int kVecsPerThread>
LocalLaunch local_launch(LocalKernel plain, LocalKernel staging, const RowCall& call, int threads) {
  const int blocks = int(std::min(call.tokens, kMaxLocalBlocks));
  // Most calls have no staging form: they ask the device nothing.
  if (staging == nullptr || !local_staging_enabled()) return {plain, blocks, threads, 0};
  const int64_t multiprocessors = current_device_multiprocessors();
  const size_t shared_bytes = staged_bytes<Epilogue, kVecsPerThread>(threads);
  if (call.tokens > multiprocessors && blocks_that_fit(plain, threads, 0) == 1 &&
      allow_shared_bytes(staging, shared_bytes)) {
    const int64_t staged_blocks = multiprocessors * blocks_that_fit(staging, threads, shared_bytes);
    if (staged_blocks > 0) {
      return {staging, int(std::min<int64_t>(blocks, staged_blocks)), threads, shared_bytes};
    }
  }
  return {plain, blocks, threads, 0};
}

// The launch of a call of the local epilogue (not a plain sum).
LocalLaunch local_launch_of(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue) {
  TPF_CHECK_ARG(epilogue.norm, "local epilogue", "a plain sum has no local epilogue");
  LocalLaunch chosen{};
  const LaunchShape shape = launch_shape(call.hidden, dtype_size(dtype));
  dispatch_row_kernel(dtype, kLocalWorld, epilogue, shape, [&](auto kernel_tag) {
    using Tag = decltype(kernel_tag);
    using T = typename Tag::T;
    using Epilogue = typename Tag::Epilogue;
    constexpr int kVecs = Tag::kVecs;
    if constexpr (Epilogue::kHasMoe) {
      chosen = local_launch<Epilogue, kVecs>(local_kernel<T, Epilogue, kVecs, false>(), nullptr,
                                             call, shape.threads);
    } else if constexpr (Epilogue::kHasNorm) {
      chosen =
          local_launch<Epilogue, kVecs>(local_kernel<T, Epilogue, kVecs, false>(),
                                        staging_kernel<T, Epilogue, kVecs>(), call, shape.threads);
    }
  });
  return chosen;
}

// Binds the instantiation of the call's dtype, epilogue and launch shape:
// launch_with(kernel_tag, blocks, threads) launches it.
template <typename LaunchWith>
void launch_local(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue,
                  LaunchWith&& launch_with) {
  const LaunchShape shape = launch_shape(call.hidden, dtype_size(dtype));
  const int blocks = int(std::min(call.tokens, kMaxLocalBlocks));
  dispatch_row_kernel(dtype, kLocalWorld, epilogue, shape,
                      [&](auto kernel_tag) { launch_with(kernel_tag, blocks, shape.threads); });
}

}  // namespace

void cuda_local_epilogue(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue,
                         cudaStream_t stream) {
  const LocalLaunch chosen = local_launch_of(call, dtype, epilogue);
  launch(chosen.kernel, chosen.blocks, chosen.threads, chosen.shared_bytes, stream, call);
}

bool cuda_local_epilogue_stages(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue) {
  return local_launch_of(call, dtype, epilogue).shared_bytes > 0;
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
    using T = typename Tag::T;
    using Epilogue = typename Tag::Epilogue;
    constexpr int kVecs = Tag::kVecs;
    if constexpr (Epilogue::kHasNorm) {
      preload(local_kernel<T, Epilogue, kVecs, false>());
      if (const LocalKernel staging = staging_kernel<T, Epilogue, kVecs>()) {
        // The shared memory the widest shape stages, allowed now rather than at a first call
        // that may be under graph capture.
        preload(staging);
        allow_shared_bytes(staging, staged_bytes<Epilogue, kVecs>(kMaxThreads));
      }
    }
    if constexpr (Epilogue::kHasMoe) {
      preload(moe_combine_kernel<T, Epilogue, kVecs>);
    }
  });
}

}  // namespace tpfuse::impl
