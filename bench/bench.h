// tpfuse-bench: what the modes (GPU, CPU) share: options, result records, the rank barrier.
//
// Every figure is microseconds per op: a batch of back-to-back ops (a CUDA graph on the GPU, a
// plain loop on the CPU) replayed many times, each replay started by every rank together, the
// median replay divided by the batch size. Baselines and floors are measured in the same run,
// the same way, so the table compares like with like.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "tpfuse/tpfuse.h"

namespace tpfuse::bench {

enum class BackendChoice { kAuto, kCuda, kCpu, kSycl };

struct Options {
  std::vector<int64_t> hiddens{3072, 4096, 7168};
  std::vector<int64_t> tokens;  // empty: powers of two up to the mode's default maximum
  DType dtype = DType::kBFloat16;
  int world_size = 0;  // 0: the mode's default
  // 0: the mode's default (the CPU mode takes fewer, so that its default run stays short).
  int ops_per_graph = 0;
  int replays = 0;
  std::string out_path;  // --out; empty: out_dir/<default name> (results_path.h)
  std::string out_dir;   // --out-dir; empty: ./tpfuse-results
  BackendChoice backend = BackendChoice::kAuto;
  size_t packet_bytes = size_t{16} << 20;
  double peer_timeout_seconds = 10.0;  // TeamOptions::peer_timeout_seconds (0: unchecked)
  bool processes = false;              // one process a rank (GPU: create_nccl_team; CPU: an id)
  bool shared_device = false;          // GPU: every rank on GPU 0, no NCCL baselines
};

// In --processes mode the launcher starts one copy of the binary per GPU with these set; such a
// copy measures and leaves its records in a file for the launcher, which writes the results.
bool is_rank_process();

// Defaults of the GPU mode.
constexpr int kGpuOpsPerGraph = 20;
constexpr int kGpuReplays = 50;
// Graph replays before timing: the first replay uploads the graph and faults in lazy state.
constexpr int kGpuWarmupReplays = 3;
constexpr int64_t kGpuMaxDefaultTokens = 4096;
constexpr int64_t kGpuMaxTokens = 32768;  // what --tokens may ask for
constexpr int kGpuMaxDefaultWorld = 8;
// Defaults of the CPU mode: ranks are threads over host memory, and one call at 256 tokens of
// hidden 7168 takes about 25 ms on 2 cores; these keep the default run, the FP8 outputs
// included, near a minute there.
constexpr int kCpuOpsPerGraph = 10;
constexpr int kCpuReplays = 20;
constexpr int64_t kCpuMaxDefaultTokens = 256;
constexpr int64_t kCpuMaxTokens = 4096;
constexpr int kCpuDefaultWorld = 2;

// Buffer sets each rank rotates through within a batch, so that consecutive ops never read the
// buffers the previous op just wrote (which caches would serve).
constexpr int kBufferSets = 4;
constexpr float kEps = 1e-6f;

// One measured figure. Fields shared by every record of a run are in RunInfo.
struct Record {
  std::string op;  // "allreduce_add_rmsnorm", "allreduce", "add_rmsnorm", "floor"
  std::string impl;
  int64_t hidden = 0;
  int64_t tokens = 0;
  int world_size = 1;
  double us = 0.0;                    // microseconds per op, rank 0's median replay
  std::optional<double> us_max_rank;  // the slowest rank's median replay
  std::optional<double> gbps;         // bandwidth floors only
  std::optional<int64_t> bytes;       // bandwidth floors only
  std::optional<bool> pdl;            // tpfuse kernels on the GPU: programmatic dependent launch on
  std::string method;                 // empty: the run's method (RunInfo::method)
  std::string chosen;                 // tpfuse_auto: the algorithm the selector chose
  std::string shape;                  // where `hidden` alone does not say it (the QK norm)
};

// A record of one measurement (the fields every mode sets).
inline Record measured(const char* op, const char* impl, int64_t hidden, int64_t tokens,
                       int world_size, double us) {
  Record record;
  record.op = op;
  record.impl = impl;
  record.hidden = hidden;
  record.tokens = tokens;
  record.world_size = world_size;
  record.us = us;
  return record;
}

// What is the same for every record of a run. Empty strings are left out of the JSON.
struct RunInfo {
  std::string dtype;
  std::string gpu;
  std::string driver;
  std::string cuda;
  std::string nccl;
  std::string host_cpu;
  std::string commit;
  std::string date;     // UTC, ISO 8601
  std::string backend;  // "cuda" or "cpu"
  std::string method;
  int ops_per_graph = 0;
  int replays = 0;
};

// Thrown in every waiting rank thread once another rank thread has failed and aborted the
// barrier, so that no thread waits forever for a rank that is gone.
class BarrierAborted : public std::runtime_error {
 public:
  BarrierAborted() : std::runtime_error("tpfuse-bench: another rank thread failed") {}
};

// A reusable barrier for the rank threads (std::barrier is C++20).
// Where every rank meets before each timed replay.
class Barrier {
 public:
  virtual ~Barrier() = default;
  virtual void arrive_and_wait() = 0;
};

// The rank threads of one process.
class RankBarrier : public Barrier {
 public:
  explicit RankBarrier(int parties) : parties_(parties) {}

  void arrive_and_wait() override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (aborted_) throw BarrierAborted();
    const uint64_t generation = generation_;
    if (++arrived_ == parties_) {
      arrived_ = 0;
      ++generation_;
      released_.notify_all();
      return;
    }
    released_.wait(lock, [&] { return generation_ != generation || aborted_; });
    if (generation_ == generation) throw BarrierAborted();
  }

  void abort() {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_ = true;
    released_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable released_;
  const int parties_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
};

// The token counts measured for one width: the requested (or default) counts that the one-shot
// workspace holds. Dropped counts are reported on stderr.
// What both modes measure: per width the token counts the workspace holds, and the buffer
// size that covers the largest shape.
struct BenchPlan {
  std::vector<std::pair<int64_t, std::vector<int64_t>>> shapes;
  size_t buffer_bytes = 0;
  int64_t max_hidden = 0;
  int64_t max_tokens = 1;
  int ops_per_graph = 0;
  int replays = 0;
  DType dtype = DType::kBFloat16;
};

// Fills a plan from the options; `team` sets what one-shot can carry, the defaults apply where
// the options leave a count at 0.
BenchPlan make_plan(const Options& options, const Team& team, int64_t default_max_tokens,
                    int default_ops_per_graph, int default_replays);

std::vector<int64_t> tokens_for_hidden(const Options& options, int64_t hidden, int64_t max_tokens,
                                       int64_t default_max_tokens);

double median(std::vector<double> values);

// Runs body(rank) on one thread per rank and joins them. A rank that fails aborts the barrier so
// that its peers stop waiting for it; its error is rethrown here once every thread has ended.
void run_rank_threads(int world_size, RankBarrier& barrier,
                      const std::function<void(int rank)>& body);

// One record per measurement from the rank threads' lists (the same measurements in the same
// order on every rank): rank 0's median as `us` and, where several ranks took part, the slowest
// rank's median as `us_max_rank`. Ranks that sat a measurement out hold NaN.
std::vector<Record> merge_ranks(const std::vector<std::vector<Record>>& per_rank);

// The team options the command line asks for.
TeamOptions team_options_of(const Options& options);

// A rank process's records as tab-separated lines, for the launcher that merges them
// (--processes).
void write_records(const std::string& path, const std::vector<Record>& records);
std::vector<Record> read_records(const std::string& path);

// The fused op's arguments on one buffer set of a mode (eps kEps, the rest the defaults).
AddRmsNormArgs row_args(const void* input, const void* residual, const void* gamma,
                        void* residual_out, void* norm_out, int64_t hidden, int64_t tokens,
                        DType dtype);

// Random values in [low, high), never zero, written as `dtype`: deterministic in `seed`.
void fill_random_host(void* data, int64_t count, DType dtype, uint64_t seed, float low, float high);

// Host memory aligned for the 16-byte vectors the kernels and the CPU backend use.
struct AlignedBuffer {
  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t bytes);
  AlignedBuffer(AlignedBuffer&& other) noexcept : data(other.data) { other.data = nullptr; }
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept {
    if (this != &other) {
      std::free(data);
      data = other.data;
      other.data = nullptr;
    }
    return *this;
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  ~AlignedBuffer();
  void* data = nullptr;
};

// The QK norm at MiniMax-M2's attention shapes, for both modes: 48 query heads and 8 KV heads of
// 128, partial RoPE (neox) over 64 dims, rope theta 5e6.
constexpr int64_t kQkHeads = 48;
constexpr int64_t kQkKvHeads = 8;
constexpr int64_t kQkHeadDim = 128;
constexpr int64_t kQkRotaryDim = 64;
constexpr int64_t kQkMaxPosition = 4096;

// One rank's slice at a world size (KV heads replicated when the world is larger than 8);
// `valid` is false when the query heads do not divide over the world.
struct QkShape {
  int64_t q_size = 0;
  int64_t kv_size = 0;
  int kv_replicas = 1;
  bool valid = false;
};
QkShape minimax_qk_shape(int world_size);
// "MiniMax-M2 q 3072 + k 512 per rank (48 / 8 heads of 128, world 2)": the records' `shape`.
std::string qk_shape_label(const QkShape& shape, int world_size);

// The call on a packed qkv of `tokens` rows (gamma serves q and k), with RoPE when positions and
// the cos|sin cache are given.
QkNormArgs minimax_qk_args(const QkShape& shape, void* qkv, const void* gamma, int64_t tokens,
                           DType dtype, const int64_t* positions, const float* cos_sin);

// Host copies of the RoPE inputs: positions spread over the cache, and the cache (cos of the
// rotary_dim / 2 frequencies, then their sin) for every position.
std::vector<int64_t> qk_positions(int64_t tokens);
std::vector<float> qk_cos_sin_cache();

// The FP8 outputs tpfuse-bench measures (the fused op with QuantMode), their op names, and the
// static scale it passes (small enough that some elements saturate, as they would in a model).
constexpr QuantMode kBenchQuantModes[] = {QuantMode::kStatic, QuantMode::kPerToken,
                                          QuantMode::kPerTokenGroup128};
constexpr float kBenchStaticScale = 0.01f;
inline const char* fp8_op_name(QuantMode mode) {
  switch (mode) {
    case QuantMode::kStatic:
      return "allreduce_add_rmsnorm_fp8";
    case QuantMode::kPerToken:
      return "allreduce_add_rmsnorm_fp8_token";
    default:
      return "allreduce_add_rmsnorm_fp8_group128";
  }
}
// Bytes of the scales buffer that covers every mode for a buffer of `buffer_bytes`.
inline size_t fp8_scales_bytes(size_t buffer_bytes) {
  return buffer_bytes / 4 + 64;
}

// Modes. Each fills `info` with the device fields and returns the records in measuring order.
std::vector<Record> run_cpu_bench(const Options& options, RunInfo& info);
std::vector<Record> run_gpu_bench(const Options& options, RunInfo& info);
// The SYCL mode (sycl_bench.cc, in builds with the SYCL backend): a SYCL team on the first SYCL
// GPU, else on the CPU device, and the CPU backend beside it.
std::vector<Record> run_sycl_bench(const Options& options, RunInfo& info);
bool sycl_gpu_found();

// Output.
void write_json(const std::string& path, const RunInfo& info, const std::vector<Record>& records);
void print_table(const RunInfo& info, const std::vector<Record>& records);

}  // namespace tpfuse::bench
