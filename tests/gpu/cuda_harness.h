// The CUDA test harness: an in-process team over GPUs 0..W-1 (or a given team and its ranks'
// devices), a stream per rank, device buffers; every rank's work queued from its own host thread.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "harness.h"
#include "tpfuse/cuda.h"

namespace tpfuse::testing {

inline void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw Error(std::string(what) + ": " + cudaGetErrorString(status));
}

class CudaHarness : public Harness {
 public:
  explicit CudaHarness(int world_size, const TeamOptions& options = {})
      : CudaHarness(create_cuda_team(first_devices(world_size), options),
                    first_devices(world_size)) {}
  // A team made elsewhere; devices[r] is rank r's device.
  CudaHarness(std::vector<Team> team, std::vector<int> devices)
      : team_(std::move(team)), devices_(std::move(devices)) {
    for (int r = 0; r < world_size(); ++r) {
      check_cuda(cudaSetDevice(devices_[r]), "cudaSetDevice");
      cudaStream_t stream;
      check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
      streams_.push_back(stream);
    }
  }
  ~CudaHarness() override {
    for (size_t r = 0; r < streams_.size(); ++r) {
      cudaSetDevice(devices_[r]);
      cudaStreamSynchronize(streams_[r]);
      cudaStreamDestroy(streams_[r]);
    }
    for (auto& [device, pointer] : blocks_) {
      cudaSetDevice(device);
      cudaFree(pointer);
    }
  }
  std::vector<Team>& team() override { return team_; }
  cudaStream_t stream(int rank) { return streams_[rank]; }
  void* allocate(int rank, size_t bytes) override {
    check_cuda(cudaSetDevice(devices_[rank]), "cudaSetDevice");
    void* pointer = nullptr;
    check_cuda(cudaMalloc(&pointer, bytes), "cudaMalloc");
    blocks_.emplace_back(devices_[rank], pointer);
    return pointer;
  }
  void upload(int rank, void* destination, const void* source, size_t bytes) override {
    check_cuda(cudaSetDevice(devices_[rank]), "cudaSetDevice");
    check_cuda(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyHostToDevice, streams_[rank]),
               "upload");
    check_cuda(cudaStreamSynchronize(streams_[rank]), "upload sync");
  }
  void download(int rank, void* destination, const void* source, size_t bytes) override {
    check_cuda(cudaSetDevice(devices_[rank]), "cudaSetDevice");
    check_cuda(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDeviceToHost, streams_[rank]),
               "download");
    check_cuda(cudaStreamSynchronize(streams_[rank]), "download sync");
  }
  void run(const std::function<void(int, Stream)>& call) override {
    enqueue(call);
    synchronize();
  }
  // A host thread per rank queues that rank's work, as a thread or process per GPU does in
  // serving (the NCCL path needs it: NCCL calls of several ranks from one thread must be
  // grouped). Rethrows the first exception.
  void enqueue(const std::function<void(int, Stream)>& call) override {
    std::vector<std::thread> threads;
    std::exception_ptr first_error;
    std::mutex mutex;
    for (int r = 0; r < world_size(); ++r) {
      threads.emplace_back([&, r] {
        try {
          check_cuda(cudaSetDevice(devices_[r]), "cudaSetDevice");
          call(r, cuda_stream(streams_[r]));
        } catch (...) {
          std::lock_guard<std::mutex> lock(mutex);
          if (!first_error) first_error = std::current_exception();
        }
      });
    }
    for (auto& thread : threads) thread.join();
    if (first_error) std::rethrow_exception(first_error);
  }
  void synchronize() override {
    for (int r = 0; r < world_size(); ++r) {
      check_cuda(cudaSetDevice(devices_[r]), "cudaSetDevice");
      check_cuda(cudaStreamSynchronize(streams_[r]), "cudaStreamSynchronize");
      team_[r].check();
    }
  }
  // Each rank's thread captures its calls into a CUDA graph (as a serving engine captures its
  // decode step), then every replay launches the graphs of all ranks.
  void replay(const std::function<void(int, Stream)>& call, int replays,
              const std::function<void(int)>& before,
              const std::function<void(int)>& after) override {
    std::vector<cudaGraphExec_t> graphs(world_size(), nullptr);
    const auto destroy = [&] {
      for (int r = 0; r < world_size(); ++r) {
        if (graphs[r] != nullptr) cudaGraphExecDestroy(graphs[r]);
      }
    };
    try {
      enqueue([&](int rank, Stream queue) {
        const cudaStream_t stream = static_cast<cudaStream_t>(queue.handle);
        check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
        cudaGraph_t graph = nullptr;
        try {
          call(rank, queue);
        } catch (...) {
          cudaStreamEndCapture(stream, &graph);  // leaves the stream usable
          if (graph != nullptr) cudaGraphDestroy(graph);
          throw;
        }
        check_cuda(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
        const cudaError_t instantiated = cudaGraphInstantiate(&graphs[rank], graph, 0);
        cudaGraphDestroy(graph);
        check_cuda(instantiated, "cudaGraphInstantiate");
      });
      for (int i = 0; i < replays; ++i) {
        before(i);
        for (int r = 0; r < world_size(); ++r) {
          check_cuda(cudaSetDevice(devices_[r]), "cudaSetDevice");
          check_cuda(cudaGraphLaunch(graphs[r], streams_[r]), "cudaGraphLaunch");
        }
        synchronize();
        after(i);
      }
    } catch (...) {
      destroy();
      throw;
    }
    destroy();
  }

 private:
  static std::vector<int> first_devices(int world_size) {
    std::vector<int> devices(world_size);
    for (int r = 0; r < world_size; ++r) devices[r] = r;
    return devices;
  }

  std::vector<Team> team_;
  std::vector<int> devices_;
  std::vector<cudaStream_t> streams_;
  std::vector<std::pair<int, void*>> blocks_;
};

inline int gpus() {
  return std::min(cuda_device_count(), 8);
}

// How many GPUs there are, asked in a forked child so that this process never initializes CUDA
// (tests that fork ranks must not have: a process that has initialized CUDA cannot hand it to a
// forked child).
inline int gpus_seen_by_a_child() {
  static int count = -1;
  if (count >= 0) return count;
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t child = ::fork();
  if (child == 0) {
    ::alarm(60);
    ::_exit(std::min(cuda_device_count(), 100));
  }
  int status = 0;
  count = child > 0 && ::waitpid(child, &status, 0) == child && WIFEXITED(status)
              ? WEXITSTATUS(status)
              : 0;
  return count;
}

// Tests that need a team of at least two GPUs report themselves skipped with fewer.
class MultiGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (gpus() < 2) GTEST_SKIP() << "needs 2 GPUs, found " << gpus();
  }
};

}  // namespace tpfuse::testing
