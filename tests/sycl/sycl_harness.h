// The SYCL test harness: a team made by create_sycl_team (ranks sharing Intel's OpenCL CPU
// device here), device memory a rank, each rank's calls on its own in-order queue. Calls only
// queue work, so one thread submits every rank's in turn; synchronize is Team::check (which
// waits for the rank's last call and reports its errors).
#pragma once

#include <sycl/sycl.hpp>

#include <exception>
#include <string>
#include <vector>

#include "harness.h"
#include "tpfuse/sycl.h"

namespace tpfuse::testing {

class SyclHarness : public Harness {
 public:
  explicit SyclHarness(std::vector<Team> team) : team_(std::move(team)) {}
  ~SyclHarness() override {
    // Every rank's last call has ended (Team::check waits for it) before its memory goes.
    for (Team& rank : team_) {
      try {
        rank.check();
      } catch (const Error&) {
      }
    }
    for (size_t r = 0; r < blocks_.size(); ++r) {
      for (void* block : blocks_[r]) sycl::free(block, queue(int(r)));
    }
  }
  std::vector<Team>& team() override { return team_; }
  sycl::queue& queue(int rank) { return sycl_queue(team_[size_t(rank)]); }
  void* allocate(int rank, size_t bytes) override {
    void* block = sycl::malloc_device(bytes + 64, queue(rank));
    if (block == nullptr) throw Error("sycl::malloc_device of " + std::to_string(bytes) + " bytes");
    if (blocks_.size() < team_.size()) blocks_.resize(team_.size());
    blocks_[size_t(rank)].push_back(block);
    return block;
  }
  void upload(int rank, void* destination, const void* source, size_t bytes) override {
    queue(rank).memcpy(destination, source, bytes).wait();
  }
  void download(int rank, void* destination, const void* source, size_t bytes) override {
    queue(rank).memcpy(destination, source, bytes).wait();
  }
  void run(const std::function<void(int, Stream)>& call) override {
    enqueue(call);
    synchronize();
  }
  // Every rank's call, rank by rank (a call returns once its kernel is queued); the first error
  // is rethrown after every rank has made its call.
  void enqueue(const std::function<void(int, Stream)>& call) override {
    std::exception_ptr first_error;
    for (int r = 0; r < world_size(); ++r) {
      try {
        call(r, sycl_stream(queue(r)));
      } catch (...) {
        if (!first_error) first_error = std::current_exception();
      }
    }
    if (first_error) std::rethrow_exception(first_error);
  }
  void synchronize() override {
    std::exception_ptr first_error;
    for (int r = 0; r < world_size(); ++r) {
      try {
        team_[size_t(r)].check();
      } catch (...) {
        if (!first_error) first_error = std::current_exception();
      }
    }
    if (first_error) std::rethrow_exception(first_error);
  }

 private:
  std::vector<Team> team_;
  std::vector<std::vector<void*>> blocks_;
};

}  // namespace tpfuse::testing
