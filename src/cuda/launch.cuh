// Host-side launch helpers shared by the CUDA kernels: launch shapes, occupancy-sized grids,
// programmatic dependent launch, and a device guard.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "cuda/check.h"
#include "tpfuse/impl/dispatch.h"

namespace tpfuse::impl {

// 512 threads at most: leaves 128 registers a thread for the packets and fp32 lanes in flight.
constexpr int kMaxThreads = 512;

struct LaunchShape {
  int vecs_per_thread;
  int threads;
};

inline LaunchShape launch_shape(int64_t hidden, size_t element_size) {
  const int64_t vectors = hidden * int64_t(element_size) / 16;
  for (int vecs : {1, 2, 4, 8}) {
    const int64_t threads = (vectors + vecs - 1) / vecs;
    if (threads <= kMaxThreads) return {vecs, int((threads + 31) / 32 * 32)};
  }
  TPF_FAIL("hidden " << hidden << " is too wide for one block");
}

template <typename Fn>
void dispatch_vecs(int vecs_per_thread, Fn&& fn) {
  switch (vecs_per_thread) {
    case 1:
      return fn(IntTag<1>{});
    case 2:
      return fn(IntTag<2>{});
    case 4:
      return fn(IntTag<4>{});
    default:
      return fn(IntTag<8>{});
  }
}

// How many blocks of `kernel` at `threads` threads and `shared_bytes` of dynamic shared memory
// fit on one multiprocessor at once (0: none). Cached per kernel and shape.
template <typename Kernel>
int blocks_that_fit(Kernel kernel, int threads, size_t shared_bytes) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, size_t>, int> cache;
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), threads, shared_bytes);
  std::lock_guard<std::mutex> lock(mutex);
  auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  int blocks = 0;
  TPF_CHECK_CUDA(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, shared_bytes));
  cache.emplace(key, blocks);
  return blocks;
}

// blocks_that_fit, at most kMaxBlocksPerMultiprocessor: the one-shot grid never exceeds what is
// resident together (its blocks wait on peers whose packets other blocks of the peer's grid
// send).
constexpr int kMaxBlocksPerMultiprocessor = 4;

template <typename Kernel>
int resident_blocks_per_multiprocessor(Kernel kernel, int threads, size_t shared_bytes) {
  const int blocks = blocks_that_fit(kernel, threads, shared_bytes);
  TPF_CHECK_ARG(blocks > 0, "launch",
                "the kernel cannot run " << threads << " threads per block on this device");
  return std::min(blocks, kMaxBlocksPerMultiprocessor);
}

// Multiprocessors of the current device (cached per device).
inline int current_device_multiprocessors() {
  static std::mutex mutex;
  static std::map<int, int> cache;
  int device = 0;
  TPF_CHECK_CUDA(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  auto found = cache.find(device);
  if (found != cache.end()) return found->second;
  int multiprocessors = 0;
  TPF_CHECK_CUDA(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device));
  cache.emplace(device, multiprocessors);
  return multiprocessors;
}

// Loads a kernel's code now. CUDA loads kernels lazily, at their first launch, and such a load
// can wait for the device to go idle: if a kernel of this rank is spinning on a peer whose host
// thread is in turn blocked loading a kernel, neither moves (seen on an H200 pair when one-shot
// and two-shot first met back to back). Teams preload every kernel they may launch at creation.
template <typename Kernel>
void preload(Kernel kernel) {
  cudaFuncAttributes attributes{};
  TPF_CHECK_CUDA(cudaFuncGetAttributes(&attributes, kernel));
}

inline bool pdl_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("TPFUSE_DISABLE_PDL");
    return value == nullptr || value[0] == '\0' || value[0] == '0';
  }();
  return enabled;
}

template <typename Kernel, typename... Args>
void launch(Kernel kernel, int blocks, int threads, size_t shared_bytes, cudaStream_t stream,
            Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attributes[1];
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attributes;
  config.numAttrs = pdl_enabled() ? 1 : 0;
  TPF_CHECK_CUDA(cudaLaunchKernelEx(&config, kernel, args...));
}

// Sets the current device for a scope, restoring the caller's afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    TPF_CHECK_CUDA(cudaGetDevice(&previous_));
    if (previous_ != device) TPF_CHECK_CUDA(cudaSetDevice(device));
    changed_ = previous_ != device;
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool changed_ = false;
};

}  // namespace tpfuse::impl
