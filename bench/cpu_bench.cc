// CPU mode of tpfuse-bench: the CPU backend, ranks as threads over host memory, or with
// --processes one process a rank over shared memory (create_cpu_team(id, ...)), as CPU
// tensor-parallel serving runs.
//
// These are figures of the CPU backend (the same protocol and epilogue code as the GPU kernels,
// run by threads): useful to see the driver work and to compare CPU-backend changes, never to be
// read as GPU figures. The method mirrors the GPU mode without graphs: ops_per_graph calls back
// to back, replays started by every rank together, std::chrono around each replay, the median
// replay / ops_per_graph.
//
// WARNING: the one-shot op is a collective: every rank thread makes the same calls in the same
// order (see gpu_bench.cu); the rank-0-only local measurement still takes every barrier.
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "bench.h"

namespace tpfuse::bench {
namespace {

struct HostBufferSet {
  AlignedBuffer input;
  AlignedBuffer residual;
  AlignedBuffer residual_out;
  AlignedBuffer norm_out;
  AlignedBuffer quant_out;  // the FP8 output and its scales
  AlignedBuffer scales;
};

// The warm-up is one batch: the CPU has no graph to instantiate, only caches and pages to touch.
constexpr int kWarmupBatches = 1;

std::string host_cpu_model() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos && colon + 2 <= line.size()) return line.substr(colon + 2);
    }
  }
  return "";
}

// Median batch of `ops` calls of `call` (buffer sets rotating), in µs per op. Inactive ranks
// return NaN but take part in every barrier.
double measure_batches(Barrier& barrier, const BenchPlan& plan, bool active,
                       const std::array<HostBufferSet, kBufferSets>& sets,
                       const std::function<void(const HostBufferSet&)>& call) {
  barrier.arrive_and_wait();
  if (active) {
    for (int batch = 0; batch < kWarmupBatches; ++batch) {
      for (int i = 0; i < plan.ops_per_graph; ++i) call(sets[size_t(i % kBufferSets)]);
    }
  }
  std::vector<double> per_op_us;
  for (int replay = 0; replay < plan.replays; ++replay) {
    barrier.arrive_and_wait();
    if (!active) continue;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < plan.ops_per_graph; ++i) call(sets[size_t(i % kBufferSets)]);
    const auto stop = std::chrono::steady_clock::now();
    per_op_us.push_back(std::chrono::duration<double, std::micro>(stop - start).count() /
                        plan.ops_per_graph);
  }
  return active ? median(per_op_us) : std::numeric_limits<double>::quiet_NaN();
}

AddRmsNormArgs fused_args(const HostBufferSet& set, const void* gamma, int64_t hidden,
                          int64_t tokens, DType dtype) {
  return row_args(set.input.data, set.residual.data, gamma, set.residual_out.data,
                  set.norm_out.data, hidden, tokens, dtype);
}

void run_rank(const Team& team, Barrier& barrier, const BenchPlan& plan,
              std::vector<Record>& records) {
  const int rank = team.rank();
  const bool is_rank0 = rank == 0;
  const int64_t elements = int64_t(plan.buffer_bytes / dtype_size(plan.dtype));
  std::array<HostBufferSet, kBufferSets> sets;
  for (int s = 0; s < kBufferSets; ++s) {
    HostBufferSet& set = sets[size_t(s)];
    const uint64_t seed = uint64_t(rank) * 1000 + uint64_t(s) * 10;
    set.input = AlignedBuffer(plan.buffer_bytes);
    set.residual = AlignedBuffer(plan.buffer_bytes);
    set.residual_out = AlignedBuffer(plan.buffer_bytes);
    set.norm_out = AlignedBuffer(plan.buffer_bytes);
    fill_random_host(set.input.data, elements, plan.dtype, seed + 1, -1.0f, 1.0f);
    fill_random_host(set.residual.data, elements, plan.dtype, seed + 2, -1.0f, 1.0f);
    fill_random_host(set.residual_out.data, elements, plan.dtype, seed + 3, -1.0f, 1.0f);
    fill_random_host(set.norm_out.data, elements, plan.dtype, seed + 4, -1.0f, 1.0f);
    set.quant_out = AlignedBuffer(plan.buffer_bytes);
    set.scales = AlignedBuffer(fp8_scales_bytes(plan.buffer_bytes));
    std::memset(set.quant_out.data, 0, plan.buffer_bytes);
    std::memset(set.scales.data, 0, fp8_scales_bytes(plan.buffer_bytes));
  }
  const float static_scale = kBenchStaticScale;
  // The same gamma on every rank, as a replicated norm weight is in tensor-parallel models.
  AlignedBuffer gamma(size_t(plan.max_hidden) * dtype_size(plan.dtype));
  fill_random_host(gamma.data, plan.max_hidden, plan.dtype, 4, 0.5f, 1.5f);

  auto add = [&](const char* op, const char* impl, int64_t hidden, int64_t tokens, int world,
                 double us) {
    records.push_back(measured(op, impl, hidden, tokens, world, us));
    return us;
  };

  for (const auto& shape : plan.shapes) {
    // Plain variables, not a structured binding: the measuring lambdas capture them (C++17).
    const int64_t hidden = shape.first;
    for (const int64_t tokens : shape.second) {
      // Each fused algorithm forced where it carries the message (the CPU backend's "nccl" is
      // its stand-in with NCCL's rounding).
      double fused_us = 0;
      for (const Algorithm algorithm : {Algorithm::kOneShot, Algorithm::kTwoShot}) {
        if (tokens > team.max_tokens(hidden, plan.dtype, algorithm)) continue;
        const double us = measure_batches(barrier, plan, true, sets, [&](const auto& set) {
          AddRmsNormArgs args = fused_args(set, gamma.data, hidden, tokens, plan.dtype);
          args.algorithm = algorithm;
          allreduce_add_rmsnorm(team, args);
        });
        team.check();
        add("allreduce_add_rmsnorm",
            algorithm == Algorithm::kOneShot ? "tpfuse_oneshot_cpu" : "tpfuse_twoshot_cpu", hidden,
            tokens, team.world_size(), us);
        if (algorithm == Algorithm::kOneShot) fused_us = us;
      }

      // The norm's FP8 output too, in each mode (the selector's algorithm), keeping the bf16 norm
      // and not (norm_out null: the FP8 output alone).
      for (const QuantMode mode : kBenchQuantModes) {
        if (mode == QuantMode::kPerTokenGroup128 && hidden % kQuantGroupSize != 0) continue;
        for (const bool keep_norm : {true, false}) {
          const double us = measure_batches(barrier, plan, true, sets, [&](const auto& set) {
            AddRmsNormArgs args = fused_args(set, gamma.data, hidden, tokens, plan.dtype);
            if (!keep_norm) args.norm_out = nullptr;
            args.quant = mode;
            args.quant_out = set.quant_out.data;
            if (mode == QuantMode::kStatic) {
              args.quant_scale = &static_scale;
            } else {
              args.scales_out = static_cast<float*>(set.scales.data);
            }
            allreduce_add_rmsnorm(team, args);
          });
          team.check();
          add(fp8_op_name(mode), keep_norm ? "tpfuse_auto_cpu" : "tpfuse_auto_no_norm_cpu", hidden,
              tokens, team.world_size(), us);
        }
      }

      const double local_us = measure_batches(barrier, plan, is_rank0, sets, [&](const auto& set) {
        add_rmsnorm(Backend::kCpu, fused_args(set, gamma.data, hidden, tokens, plan.dtype));
      });
      add("add_rmsnorm", "cpu_local_add_rmsnorm", hidden, tokens, 1, local_us);

      if (is_rank0) {
        std::fprintf(stderr,
                     "hidden %lld tokens %lld (us/op, rank 0):  tpfuse_oneshot_cpu %.2f  "
                     "cpu_local_add_rmsnorm %.2f\n",
                     static_cast<long long>(hidden), static_cast<long long>(tokens), fused_us,
                     local_us);
      }
    }
  }

  // The QK norm at MiniMax-M2's shapes for this world size (48 query heads, 8 KV heads of 128,
  // KV heads replicated beyond 8 ranks), in place in the input rows, with and without RoPE.
  const int world = team.world_size();
  const QkShape shape = minimax_qk_shape(world);
  if (!shape.valid) return;
  const int64_t row = shape.q_size + 2 * shape.kv_size;
  const std::vector<int64_t> positions = qk_positions(plan.max_tokens);
  const std::vector<float> cos_sin = qk_cos_sin_cache();
  const int64_t gamma_size = std::max(shape.q_size, shape.kv_size);
  AlignedBuffer qk_gamma(size_t(gamma_size) * dtype_size(plan.dtype));
  fill_random_host(qk_gamma.data, gamma_size, plan.dtype, 5, 0.5f, 1.5f);
  for (int64_t tokens = 1; tokens <= plan.max_tokens; tokens *= 2) {
    if (size_t(tokens * row) * dtype_size(plan.dtype) > plan.buffer_bytes) break;
    for (const bool rope : {false, true}) {
      const double us = measure_batches(barrier, plan, true, sets, [&](const auto& set) {
        allreduce_qk_rmsnorm(
            team, minimax_qk_args(shape, set.input.data, qk_gamma.data, tokens, plan.dtype,
                                  rope ? positions.data() : nullptr, cos_sin.data()));
      });
      team.check();
      add("allreduce_qk_rmsnorm", rope ? "tpfuse_fused_rope_cpu" : "tpfuse_fused_cpu",
          shape.q_size + shape.kv_size, tokens, world, us);
    }
  }
}

// Where the rank processes of --processes meet: a sense-reversing barrier in memory the launcher
// maps shared before it forks them. `aborted` is set by the launcher when a rank process fails,
// so that no rank waits for it forever.
class ProcessBarrier : public Barrier {
 public:
  struct Words {
    uint32_t arrived;
    uint32_t generation;
    uint32_t aborted;
  };
  ProcessBarrier(Words* words, int parties) : words_(words), parties_(uint32_t(parties)) {}
  void arrive_and_wait() override {
    const uint32_t generation = __atomic_load_n(&words_->generation, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&words_->arrived, 1u, __ATOMIC_ACQ_REL) == parties_) {
      __atomic_store_n(&words_->arrived, 0u, __ATOMIC_RELAXED);
      __atomic_store_n(&words_->generation, generation + 1, __ATOMIC_RELEASE);
      return;
    }
    while (__atomic_load_n(&words_->generation, __ATOMIC_ACQUIRE) == generation) {
      if (__atomic_load_n(&words_->aborted, __ATOMIC_ACQUIRE) != 0) throw BarrierAborted();
      sched_yield();  // ranks may outnumber cores
    }
  }

 private:
  Words* words_;
  uint32_t parties_;
};

// --processes: forks one process per rank; each joins the shared-memory team, measures as a rank
// thread does and leaves its records in a file; a rank that fails stops the others.
std::vector<Record> run_rank_processes(const Options& options, int world_size) {
  const CpuTeamId id = create_cpu_team_id();
  void* shared = mmap(nullptr, sizeof(ProcessBarrier::Words), PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shared == MAP_FAILED) throw std::runtime_error("tpfuse-bench: mmap of the barrier failed");
  auto* words = new (shared) ProcessBarrier::Words{};
  const std::filesystem::path directory =
      std::filesystem::temp_directory_path() / ("tpfuse-bench-cpu-" + std::to_string(getpid()));
  std::filesystem::create_directories(directory);
  const auto records_file = [&](int rank) {
    return (directory / ("rank" + std::to_string(rank) + ".tsv")).string();
  };
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> children;
  for (int rank = 0; rank < world_size; ++rank) {
    const pid_t pid = fork();
    if (pid < 0) {
      for (pid_t child : children) kill(child, SIGKILL);
      throw std::runtime_error("tpfuse-bench: fork failed");
    }
    if (pid == 0) {
      int status = 0;
      try {
        const Team team = create_cpu_team(id, rank, world_size, team_options_of(options));
        const BenchPlan plan =
            make_plan(options, team, kCpuMaxDefaultTokens, kCpuOpsPerGraph, kCpuReplays);
        ProcessBarrier barrier(words, world_size);
        std::vector<Record> records;
        run_rank(team, barrier, plan, records);
        write_records(records_file(rank), records);
      } catch (const BarrierAborted&) {
        status = 1;  // another rank failed first; its error is the one reported
      } catch (const std::exception& error) {
        std::fprintf(stderr, "tpfuse-bench: rank %d: %s\n", rank, error.what());
        status = 1;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      _exit(status);
    }
    children.push_back(pid);
  }
  bool failed = false;
  for (size_t done = 0; done < children.size(); ++done) {
    int status = 0;
    if (waitpid(-1, &status, 0) < 0) break;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      failed = true;
      __atomic_store_n(&words->aborted, 1u, __ATOMIC_RELEASE);
    }
  }
  munmap(shared, sizeof(ProcessBarrier::Words));
  if (failed) {
    std::filesystem::remove_all(directory);
    throw std::runtime_error("tpfuse-bench: a rank process failed (its error is above)");
  }
  std::vector<std::vector<Record>> per_rank;
  for (int rank = 0; rank < world_size; ++rank)
    per_rank.push_back(read_records(records_file(rank)));
  std::filesystem::remove_all(directory);
  return merge_ranks(per_rank);
}

}  // namespace

std::vector<Record> run_cpu_bench(const Options& options, RunInfo& info) {
  const int world_size = options.world_size > 0 ? options.world_size : kCpuDefaultWorld;
  info.gpu = "cpu";
  info.host_cpu = host_cpu_model();
  info.backend = "cpu";
  info.ops_per_graph = options.ops_per_graph > 0 ? options.ops_per_graph : kCpuOpsPerGraph;
  info.replays = options.replays > 0 ? options.replays : kCpuReplays;
  info.method = std::to_string(info.ops_per_graph) +
                " back-to-back calls per replay timed with std::chrono::steady_clock, median of " +
                std::to_string(info.replays) + " replays";
  if (options.processes) {
    info.method += "; one process a rank over shared memory";
    std::fprintf(stderr, "CPU mode: %d rank processes (shared memory), %s, %s\n", world_size,
                 dtype_name(options.dtype), info.method.c_str());
    return run_rank_processes(options, world_size);
  }
  const std::vector<Team> team = create_cpu_team(world_size, team_options_of(options));
  const BenchPlan plan =
      make_plan(options, team[0], kCpuMaxDefaultTokens, kCpuOpsPerGraph, kCpuReplays);
  std::fprintf(stderr, "CPU mode: %d rank threads, %s, %s\n", world_size, dtype_name(options.dtype),
               info.method.c_str());

  RankBarrier barrier(world_size);
  std::vector<std::vector<Record>> per_rank(static_cast<size_t>(world_size));
  run_rank_threads(world_size, barrier, [&](int rank) {
    run_rank(team[size_t(rank)], barrier, plan, per_rank[size_t(rank)]);
  });
  return merge_ranks(per_rank);
}

}  // namespace tpfuse::bench
