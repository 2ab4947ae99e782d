// Device code of tpfuse-bench: random input fills and the floors every tpfuse figure is read
// against. The floors follow the measuring method of the ops (graphs, events, medians), so a
// tpfuse op and the floor it approaches are comparable in one table.
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "bench.h"
#include "cuda/check.h"
#include "gpu_kernels.h"
#include "random_values.h"
#include "tpfuse/impl/dispatch.h"
#include "tpfuse/impl/epilogue.h"
#include "tpfuse/impl/numeric.h"

namespace tpfuse::bench {
namespace {

// A ping-pong whose peer never answers (no peer access after all, a dead link) gives up after
// this long instead of hanging the run; 20000 round trips take tens of milliseconds.
constexpr uint64_t kPingPongTimeoutNs = uint64_t{5} * 1000 * 1000 * 1000;
constexpr int kEmptyKernelThreads = 128;

template <typename T>
__global__ void fill_random_kernel(T* out, int64_t count, uint64_t seed, float low, float high) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    out[i] = impl::from_float<T>(random_value(seed, uint64_t(i), low, high));
  }
}

__global__ void empty_kernel() {}

// The PDL floor: what a tpfuse kernel pays at minimum for its grid-dependency wait and trigger.
__global__ void empty_pdl_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

// One thread per device. Round trip i: the starter stores i into the peer's flag; the responder
// sees it in its own flag and stores i back into the starter's. Volatile stores and polls: each
// store must leave the SM at once and each poll must read memory, not a register or L1; no
// fence is needed because each side only waits for the single word the other just wrote.
__global__ void ping_pong_kernel(volatile int* own_flag, volatile int* peer_flag, int iterations,
                                 bool starter, int* timed_out) {
  const uint64_t deadline = global_timer_ns() + kPingPongTimeoutNs;
  for (int i = 1; i <= iterations; ++i) {
    if (starter) *peer_flag = i;
    // The timer is read every 1024 polls only, so it does not lengthen the measured crossing.
    for (uint32_t polls = 1; *own_flag != i; ++polls) {
      if (polls % 1024 == 0 && global_timer_ns() > deadline) {
        *timed_out = 1;
        return;
      }
    }
    if (!starter) *peer_flag = i;
  }
}

// Stores `vectors` 16-byte vectors read from `source` into `destination` (a peer's memory), four
// in flight per thread. (st.volatile, as tpfuse stores its packets, measured the same.)
__global__ void peer_store_kernel(const int4* source, int4* destination, int64_t vectors) {
  constexpr int kUnroll = 4;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t base = first; base < vectors; base += stride * kUnroll) {
    int4 values[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * stride;
      if (i < vectors) values[u] = source[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * stride;
      if (i < vectors) destination[i] = values[u];
    }
  }
}

// Current device for a scope; the caller's device is restored afterwards.
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    TPF_CHECK_CUDA(cudaGetDevice(&previous_));
    TPF_CHECK_CUDA(cudaSetDevice(device));
  }
  ~ScopedDevice() { cudaSetDevice(previous_); }
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  int previous_ = 0;
};

// For destructors, which must not throw: frees run on the device that owns the resource.
class DeviceForCleanup {
 public:
  explicit DeviceForCleanup(int device) {
    cudaGetDevice(&previous_);
    cudaSetDevice(device);
  }
  ~DeviceForCleanup() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

int current_device() {
  int device = 0;
  TPF_CHECK_CUDA(cudaGetDevice(&device));
  return device;
}

// A stream and a pair of events on the current device, freed on scope exit.
struct TimedStream {
  TimedStream() : device(current_device()) {
    TPF_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    TPF_CHECK_CUDA(cudaEventCreate(&start));
    TPF_CHECK_CUDA(cudaEventCreate(&stop));
  }
  ~TimedStream() {
    DeviceForCleanup cleanup(device);
    cudaStreamSynchronize(stream);
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaStreamDestroy(stream);
  }
  TimedStream(const TimedStream&) = delete;
  TimedStream& operator=(const TimedStream&) = delete;

  float elapsed_ms() const {
    float ms = 0.0f;
    TPF_CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    return ms;
  }

  int device = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
};

// Device memory on the current device, freed on scope exit.
struct DeviceAllocation {
  explicit DeviceAllocation(size_t bytes) : device(current_device()) {
    TPF_CHECK_CUDA(cudaMalloc(&pointer, bytes));
  }
  ~DeviceAllocation() {
    DeviceForCleanup cleanup(device);
    cudaFree(pointer);
  }
  DeviceAllocation(const DeviceAllocation&) = delete;
  DeviceAllocation& operator=(const DeviceAllocation&) = delete;
  int device = 0;
  void* pointer = nullptr;
};

template <typename T>
__global__ void moe_combine_kernel(const impl::Vec16* rows, const float* weights, int topk,
                                   int64_t tokens, int64_t vectors, impl::Vec16* out) {
  constexpr int kElements = impl::Packed<T>::kElements;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < tokens * vectors;
       i += stride) {
    const int64_t token = i / vectors, v = i % vectors;
    float acc[kElements] = {};
    for (int j = 0; j < topk; ++j) {
      float lanes[kElements];
      impl::unpack<T>(rows[(token * topk + j) * vectors + v], lanes);
      const float w = weights[token * topk + j];
#pragma unroll
      for (int e = 0; e < kElements; ++e) acc[e] += w * lanes[e];
    }
    out[i] = impl::pack<T>(acc);
  }
}

// A block per token, a 16-byte vector a thread at a time; groups of 128 are 16 (or 32) lanes.
template <typename T>
__global__ void quantize_fp8_kernel(const impl::Vec16* norm, int64_t vectors, QuantMode mode,
                                    const float* static_scale, uint8_t* quant_out, float* scales,
                                    int64_t groups) {
  constexpr int kElements = impl::Packed<T>::kElements;
  constexpr int kGroupLanes = int(kQuantGroupSize) / kElements;
  const int64_t token = blockIdx.x;
  const impl::Vec16* row = norm + token * vectors;
  __shared__ float warp_max[32];
  float scale = mode == QuantMode::kStatic ? *static_scale : 0.0f;
  if (mode == QuantMode::kPerToken) {
    float amax = 0.0f;
    for (int64_t v = threadIdx.x; v < vectors; v += blockDim.x) {
      amax = fmaxf(amax, impl::vector_amax<T>(row[v]));
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    }
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < int(blockDim.x / 32); ++w) amax = fmaxf(amax, warp_max[w]);
      warp_max[0] = amax;
      scales[token] = impl::dynamic_scale(amax);
    }
    __syncthreads();
    scale = impl::dynamic_scale(warp_max[0]);
  }
  // Every thread runs the same number of iterations, so the group shuffles see whole warps.
  const impl::Fp8Divisor row_divisor = impl::fp8_divisor(scale);
  for (int64_t base = 0; base < vectors; base += blockDim.x) {
    const int64_t v = base + threadIdx.x;
    const bool mine = v < vectors;
    const impl::Vec16 x = mine ? row[v] : impl::Vec16{};
    impl::Fp8Divisor divisor = row_divisor;
    if (mode == QuantMode::kPerTokenGroup128) {
      float amax = mine ? impl::vector_amax<T>(x) : 0.0f;
      for (int offset = kGroupLanes / 2; offset > 0; offset /= 2) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
      }
      const float group_scale = impl::dynamic_scale(amax);
      if (mine && v % kGroupLanes == 0) scales[token * groups + v / kGroupLanes] = group_scale;
      divisor = impl::fp8_divisor(group_scale);
    }
    if (mine) {
      const impl::QuantBytes<T> q = impl::quantize_vector<T>(x, divisor);
      memcpy(quant_out + (token * vectors + v) * kElements, q.bytes, kElements);
    }
  }
}

// Four 16-byte vectors a thread, all loaded before any is stored; `flip` (0) keeps the stores.
__global__ void rows_in_place_copy_kernel(impl::Vec16* data, int64_t tokens, int64_t row_vectors,
                                          int64_t width_vectors, uint32_t flip) {
  constexpr int kUnroll = 4;
  const int64_t count = tokens * width_vectors;
  const int64_t base = (int64_t(blockIdx.x) * blockDim.x) * kUnroll + threadIdx.x;
  impl::Vec16 values[kUnroll];
  int64_t at[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t i = base + int64_t(u) * blockDim.x;
    at[u] = i < count ? (i / width_vectors) * row_vectors + i % width_vectors : -1;
    if (at[u] >= 0) values[u] = data[at[u]];
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (at[u] < 0) continue;
    values[u].word[0] ^= flip;
    data[at[u]] = values[u];
  }
}

}  // namespace

void moe_combine_device(const void* rows, const float* weights, int topk, int64_t tokens,
                        int64_t hidden, DType dtype, void* out, cudaStream_t stream) {
  impl::dispatch_dtype(dtype, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    const int64_t vectors = hidden / impl::Packed<T>::kElements;
    const int threads = 256;
    const int blocks = int(std::min<int64_t>((tokens * vectors + threads - 1) / threads, 4096));
    moe_combine_kernel<T><<<blocks, threads, 0, stream>>>(static_cast<const impl::Vec16*>(rows),
                                                          weights, topk, tokens, vectors,
                                                          static_cast<impl::Vec16*>(out));
  });
  TPF_CHECK_CUDA(cudaGetLastError());
}

void rows_in_place_copy_device(void* data, int64_t tokens, int64_t row, int64_t width, DType dtype,
                               cudaStream_t stream) {
  const int64_t elements = int64_t(16 / dtype_size(dtype));
  const int64_t count = tokens * (width / elements);
  if (count <= 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = (count + 4 * kThreads - 1) / (4 * kThreads);
  rows_in_place_copy_kernel<<<int(blocks), kThreads, 0, stream>>>(
      static_cast<impl::Vec16*>(data), tokens, row / elements, width / elements, 0u);
  TPF_CHECK_CUDA(cudaGetLastError());
}

void quantize_fp8_device(const void* norm, int64_t tokens, int64_t hidden, DType dtype,
                         QuantMode mode, const float* static_scale, void* quant_out, float* scales,
                         cudaStream_t stream) {
  impl::dispatch_dtype(dtype, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    const int64_t vectors = hidden / impl::Packed<T>::kElements;
    const int threads = int(std::min<int64_t>(512, (vectors + 31) / 32 * 32));
    quantize_fp8_kernel<T><<<int(tokens), threads, 0, stream>>>(
        static_cast<const impl::Vec16*>(norm), vectors, mode, static_scale,
        static_cast<uint8_t*>(quant_out), scales, hidden / kQuantGroupSize);
  });
  TPF_CHECK_CUDA(cudaGetLastError());
}

void fill_random_device(void* data, int64_t count, DType dtype, uint64_t seed, float low,
                        float high, cudaStream_t stream) {
  if (count <= 0) return;
  constexpr int kThreads = 256;
  const int blocks = int(std::min<int64_t>((count + kThreads - 1) / kThreads, 4096));
  impl::dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    fill_random_kernel<T>
        <<<blocks, kThreads, 0, stream>>>(static_cast<T*>(data), count, seed, low, high);
  });
  TPF_CHECK_CUDA(cudaGetLastError());
}

void enable_peer_access(int device, int peer) {
  ScopedDevice scoped(device);
  const cudaError_t status = cudaDeviceEnablePeerAccess(peer, 0);
  if (status == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();  // clears the sticky-looking status; nothing is wrong
    return;
  }
  TPF_CHECK_CUDA(status);
}

double measure_empty_kernel_graph_us(int device, bool pdl, int nodes, int replays) {
  ScopedDevice scoped(device);
  TimedStream timed;
  cudaGraph_t graph = nullptr;
  TPF_CHECK_CUDA(cudaStreamBeginCapture(timed.stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < nodes; ++i) {
    if (pdl) {
      cudaLaunchConfig_t config = {};
      config.gridDim = dim3(1);
      config.blockDim = dim3(kEmptyKernelThreads);
      config.stream = timed.stream;
      cudaLaunchAttribute attributes[1];
      attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attributes[0].val.programmaticStreamSerializationAllowed = 1;
      config.attrs = attributes;
      config.numAttrs = 1;
      TPF_CHECK_CUDA(cudaLaunchKernelEx(&config, empty_pdl_kernel));
    } else {
      empty_kernel<<<1, kEmptyKernelThreads, 0, timed.stream>>>();
      TPF_CHECK_CUDA(cudaGetLastError());
    }
  }
  TPF_CHECK_CUDA(cudaStreamEndCapture(timed.stream, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  TPF_CHECK_CUDA(instantiated);

  std::vector<double> per_kernel_us;
  try {
    for (int i = 0; i < kGpuWarmupReplays; ++i) TPF_CHECK_CUDA(cudaGraphLaunch(exec, timed.stream));
    TPF_CHECK_CUDA(cudaStreamSynchronize(timed.stream));
    for (int replay = 0; replay < replays; ++replay) {
      TPF_CHECK_CUDA(cudaEventRecord(timed.start, timed.stream));
      TPF_CHECK_CUDA(cudaGraphLaunch(exec, timed.stream));
      TPF_CHECK_CUDA(cudaEventRecord(timed.stop, timed.stream));
      TPF_CHECK_CUDA(cudaEventSynchronize(timed.stop));
      per_kernel_us.push_back(double(timed.elapsed_ms()) * 1000.0 / nodes);
    }
  } catch (...) {
    cudaGraphExecDestroy(exec);
    throw;
  }
  TPF_CHECK_CUDA(cudaGraphExecDestroy(exec));
  return median(per_kernel_us);
}

double measure_nvlink_one_way_us(int device_a, int device_b, int iterations, int repeats) {
  enable_peer_access(device_a, device_b);
  enable_peer_access(device_b, device_a);
  // Mapped pinned host memory: both devices can raise it, and the host reads it after syncing.
  int* timed_out = nullptr;
  TPF_CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&timed_out), sizeof(int),
                               cudaHostAllocMapped | cudaHostAllocPortable));
  struct HostFree {
    int* pointer;
    ~HostFree() { cudaFreeHost(pointer); }
  } free_timed_out{timed_out};
  *timed_out = 0;
  int* device_timed_out = nullptr;
  TPF_CHECK_CUDA(
      cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_timed_out), timed_out, 0));

  // Each flag gets its own 256 bytes so the two never share a cache line or a sector.
  constexpr size_t kFlagBytes = 256;
  ScopedDevice restore(device_a);
  TPF_CHECK_CUDA(cudaSetDevice(device_b));
  DeviceAllocation flag_b(kFlagBytes);
  TimedStream timed_b;  // only its stream is used: the starter side does the timing
  TPF_CHECK_CUDA(cudaSetDevice(device_a));
  DeviceAllocation flag_a(kFlagBytes);
  TimedStream timed_a;

  std::vector<double> one_way_us;
  for (int repeat = 0; repeat < repeats; ++repeat) {
    TPF_CHECK_CUDA(cudaSetDevice(device_b));
    TPF_CHECK_CUDA(cudaMemset(flag_b.pointer, 0, kFlagBytes));
    TPF_CHECK_CUDA(cudaDeviceSynchronize());
    TPF_CHECK_CUDA(cudaSetDevice(device_a));
    TPF_CHECK_CUDA(cudaMemset(flag_a.pointer, 0, kFlagBytes));
    TPF_CHECK_CUDA(cudaDeviceSynchronize());

    // The responder goes first so that it is polling before the first store can arrive.
    TPF_CHECK_CUDA(cudaSetDevice(device_b));
    ping_pong_kernel<<<1, 1, 0, timed_b.stream>>>(static_cast<int*>(flag_b.pointer),
                                                  static_cast<int*>(flag_a.pointer), iterations,
                                                  false, device_timed_out);
    TPF_CHECK_CUDA(cudaGetLastError());
    TPF_CHECK_CUDA(cudaSetDevice(device_a));
    TPF_CHECK_CUDA(cudaEventRecord(timed_a.start, timed_a.stream));
    ping_pong_kernel<<<1, 1, 0, timed_a.stream>>>(static_cast<int*>(flag_a.pointer),
                                                  static_cast<int*>(flag_b.pointer), iterations,
                                                  true, device_timed_out);
    TPF_CHECK_CUDA(cudaGetLastError());
    TPF_CHECK_CUDA(cudaEventRecord(timed_a.stop, timed_a.stream));
    TPF_CHECK_CUDA(cudaEventSynchronize(timed_a.stop));
    TPF_CHECK_CUDA(cudaStreamSynchronize(timed_b.stream));
    if (*reinterpret_cast<volatile int*>(timed_out) != 0) {
      TPF_FAIL("NVLink ping-pong between devices " << device_a << " and " << device_b
                                                   << " timed out: a store never arrived");
    }
    one_way_us.push_back(double(timed_a.elapsed_ms()) * 1000.0 / iterations / 2.0);
  }
  return median(one_way_us);
}

CopyFloor measure_peer_copy(int source_device, int destination_device, size_t bytes, int repeats) {
  enable_peer_access(source_device, destination_device);
  ScopedDevice restore(destination_device);
  DeviceAllocation destination(bytes);
  TPF_CHECK_CUDA(cudaMemset(destination.pointer, 0, bytes));
  TPF_CHECK_CUDA(cudaDeviceSynchronize());
  TPF_CHECK_CUDA(cudaSetDevice(source_device));
  DeviceAllocation source(bytes);
  TPF_CHECK_CUDA(cudaMemset(source.pointer, 1, bytes));
  TimedStream timed;
  auto copy = [&] {
    TPF_CHECK_CUDA(cudaMemcpyPeerAsync(destination.pointer, destination_device, source.pointer,
                                       source_device, bytes, timed.stream));
  };
  copy();  // warm-up: the first copy sets up the peer mapping
  TPF_CHECK_CUDA(cudaStreamSynchronize(timed.stream));
  std::vector<double> copy_us;
  for (int repeat = 0; repeat < repeats; ++repeat) {
    TPF_CHECK_CUDA(cudaEventRecord(timed.start, timed.stream));
    copy();
    TPF_CHECK_CUDA(cudaEventRecord(timed.stop, timed.stream));
    TPF_CHECK_CUDA(cudaEventSynchronize(timed.stop));
    copy_us.push_back(double(timed.elapsed_ms()) * 1000.0);
  }
  CopyFloor floor;
  floor.us = median(copy_us);
  floor.gbps = double(bytes) / (floor.us * 1e-6) / 1e9;
  return floor;
}

CopyFloor measure_peer_both_ways(int device_a, int device_b, size_t bytes, PeerTransfer transfer,
                                 int nodes, int replays) {
  enable_peer_access(device_a, device_b);
  enable_peer_access(device_b, device_a);
  const int64_t vectors = int64_t(bytes / sizeof(int4));
  ScopedDevice restore(device_a);
  // Per device: a source filled locally, a destination the other device sends into, a stream,
  // and (SM stores) a graph of `nodes` store kernels; peer copies cannot be captured, so the
  // copy engines get `nodes` copies enqueued per replay instead.
  struct Side {
    int device = 0;
    std::unique_ptr<DeviceAllocation> source, destination;
    std::unique_ptr<TimedStream> timed;
    cudaGraphExec_t exec = nullptr;
    ~Side() {
      DeviceForCleanup cleanup(device);
      if (exec != nullptr) cudaGraphExecDestroy(exec);
    }
  };
  Side sides[2];
  const int devices[2] = {device_a, device_b};
  for (int s = 0; s < 2; ++s) {
    TPF_CHECK_CUDA(cudaSetDevice(devices[s]));
    sides[s].device = devices[s];
    sides[s].source = std::make_unique<DeviceAllocation>(bytes);
    sides[s].destination = std::make_unique<DeviceAllocation>(bytes);
    sides[s].timed = std::make_unique<TimedStream>();
    TPF_CHECK_CUDA(cudaMemset(sides[s].source->pointer, s + 1, bytes));
    TPF_CHECK_CUDA(cudaDeviceSynchronize());
  }
  for (int s = 0; s < 2 && transfer == PeerTransfer::kStores; ++s) {
    TPF_CHECK_CUDA(cudaSetDevice(devices[s]));
    int multiprocessors = 0;
    TPF_CHECK_CUDA(
        cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, devices[s]));
    constexpr int kThreads = 512;
    const int blocks = int(std::max<int64_t>(
        1, std::min<int64_t>(int64_t(multiprocessors) * 4, (vectors + kThreads - 1) / kThreads)));
    const auto* source = static_cast<const int4*>(sides[s].source->pointer);
    auto* destination = static_cast<int4*>(sides[1 - s].destination->pointer);
    cudaStream_t stream = sides[s].timed->stream;
    cudaGraph_t graph = nullptr;
    TPF_CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < nodes; ++i) {
      peer_store_kernel<<<blocks, kThreads, 0, stream>>>(source, destination, vectors);
    }
    const cudaError_t launched = cudaGetLastError();
    const cudaError_t captured = cudaStreamEndCapture(stream, &graph);
    TPF_CHECK_CUDA(launched);
    TPF_CHECK_CUDA(captured);
    const cudaError_t instantiated = cudaGraphInstantiate(&sides[s].exec, graph, 0);
    cudaGraphDestroy(graph);
    TPF_CHECK_CUDA(instantiated);
  }
  const auto enqueue = [&](int s) {
    Side& side = sides[s];
    if (side.exec != nullptr) {
      TPF_CHECK_CUDA(cudaGraphLaunch(side.exec, side.timed->stream));
      return;
    }
    for (int i = 0; i < nodes; ++i) {
      TPF_CHECK_CUDA(cudaMemcpyPeerAsync(sides[1 - s].destination->pointer, devices[1 - s],
                                         side.source->pointer, devices[s], bytes,
                                         side.timed->stream));
    }
  };
  // Device b's transfers are enqueued first so that both send at once; device a's events time
  // its own (any start skew is spread over `nodes` transfers).
  std::vector<double> per_transfer_us;
  for (int replay = 0; replay < kGpuWarmupReplays + replays; ++replay) {
    TPF_CHECK_CUDA(cudaSetDevice(device_b));
    enqueue(1);
    TPF_CHECK_CUDA(cudaSetDevice(device_a));
    TimedStream& timed = *sides[0].timed;
    TPF_CHECK_CUDA(cudaEventRecord(timed.start, timed.stream));
    enqueue(0);
    TPF_CHECK_CUDA(cudaEventRecord(timed.stop, timed.stream));
    TPF_CHECK_CUDA(cudaEventSynchronize(timed.stop));
    TPF_CHECK_CUDA(cudaSetDevice(device_b));
    TPF_CHECK_CUDA(cudaStreamSynchronize(sides[1].timed->stream));
    if (replay >= kGpuWarmupReplays) {
      per_transfer_us.push_back(double(timed.elapsed_ms()) * 1000.0 / nodes);
    }
  }
  CopyFloor floor;
  floor.us = median(per_transfer_us);
  floor.gbps = double(bytes) / (floor.us * 1e-6) / 1e9;
  return floor;
}

}  // namespace tpfuse::bench
