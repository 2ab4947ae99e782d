// A test harness over a team: allocates per-rank buffers, moves data, and runs one call on every
// rank at once. The CPU harness runs each rank on a thread; the CUDA harness launches each
// rank's work on its own stream. The property tests in oneshot_properties.h run on both.
#pragma once

#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "tpfuse/tpfuse.h"

namespace tpfuse::testing {

class Harness {
 public:
  virtual ~Harness() = default;
  virtual std::vector<Team>& team() = 0;
  int world_size() { return int(team().size()); }
  // Memory of `bytes` on rank's device (host memory for the CPU backend), 16-byte aligned, freed
  // with the harness.
  virtual void* allocate(int rank, size_t bytes) = 0;
  virtual void upload(int rank, void* destination, const void* source, size_t bytes) = 0;
  virtual void download(int rank, void* destination, const void* source, size_t bytes) = 0;
  // Runs call(rank, stream) for every rank concurrently and waits for all of them (device work
  // included). Rethrows the first exception.
  virtual void run(const std::function<void(int rank, Stream stream)>& call) = 0;
  // Queues call(rank, stream) on every rank without waiting for device work (CPU: same as run).
  virtual void enqueue(const std::function<void(int rank, Stream stream)>& call) = 0;
  virtual void synchronize() = 0;
  // Captures call(rank, stream) once on every rank, then replays it `replays` times: before(i)
  // runs on the host before replay i, after(i) once replay i has finished on every rank. The
  // CUDA harness captures a CUDA graph a rank and launches it; here the call runs each time.
  virtual void replay(const std::function<void(int rank, Stream stream)>& call, int replays,
                      const std::function<void(int replay)>& before,
                      const std::function<void(int replay)>& after) {
    for (int i = 0; i < replays; ++i) {
      before(i);
      run(call);
      after(i);
    }
  }

  // The algorithm the property suites force on every call (kAuto: the team chooses).
  Algorithm algorithm = Algorithm::kAuto;
};

// Every rank of a shared-memory CPU team (create_cpu_team(id, rank, world_size)), each joined
// from a thread of its own: every rank maps the segment at an address of its own, as the ranks
// of separate processes do.
inline std::vector<Team> create_shared_memory_team(int world_size,
                                                   const TeamOptions& options = {}) {
  const CpuTeamId id = create_cpu_team_id();
  std::vector<Team> team(static_cast<size_t>(world_size));
  std::vector<std::thread> threads;
  std::exception_ptr first_error;
  std::mutex mutex;
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        team[rank] = create_cpu_team(id, rank, world_size, options);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!first_error) first_error = std::current_exception();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  if (first_error) std::rethrow_exception(first_error);
  return team;
}

class CpuHarness : public Harness {
 public:
  explicit CpuHarness(int world_size, const TeamOptions& options = {})
      : team_(create_cpu_team(world_size, options)) {}
  // Over a team made elsewhere (a shared-memory team, for one).
  explicit CpuHarness(std::vector<Team> team) : team_(std::move(team)) {}
  ~CpuHarness() override {
    for (void* block : blocks_) std::free(block);
  }
  std::vector<Team>& team() override { return team_; }
  void* allocate(int, size_t bytes) override {
    void* block = std::aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
    blocks_.push_back(block);
    return block;
  }
  void upload(int, void* destination, const void* source, size_t bytes) override {
    std::memcpy(destination, source, bytes);
  }
  void download(int, void* destination, const void* source, size_t bytes) override {
    std::memcpy(destination, source, bytes);
  }
  void run(const std::function<void(int, Stream)>& call) override {
    std::vector<std::thread> threads;
    std::exception_ptr first_error;
    std::mutex mutex;
    for (int rank = 0; rank < world_size(); ++rank) {
      threads.emplace_back([&, rank] {
        try {
          call(rank, Stream{});
        } catch (...) {
          std::lock_guard<std::mutex> lock(mutex);
          if (!first_error) first_error = std::current_exception();
        }
      });
    }
    for (auto& thread : threads) thread.join();
    if (first_error) std::rethrow_exception(first_error);
  }
  void enqueue(const std::function<void(int, Stream)>& call) override { run(call); }
  void synchronize() override {}

 private:
  std::vector<Team> team_;
  std::vector<void*> blocks_;
};

}  // namespace tpfuse::testing
