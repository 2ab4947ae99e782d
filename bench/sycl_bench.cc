// SYCL mode of tpfuse-bench (--backend sycl; auto where the build has the SYCL backend and a SYCL
// GPU is found and no CUDA GPU is): a SYCL team (create_sycl_team) of --world ranks on the first
// SYCL GPU, else on the CPU device (Intel's OpenCL CPU device: then these are CPU-device figures,
// never to be read as Intel GPU figures), and the CPU backend beside it in the same run.
//
// A SYCL call only queues one kernel, so one host thread submits every rank's calls, as a serving
// engine's rank does: each replay submits ops_per_graph calls a rank, interleaved (rank 0's i-th,
// rank 1's i-th, ...), then waits for every rank (Team::check). Two figures a shape, medians of
// the replays: the op's time (the replay's wall time over ops_per_graph: the calls run back to
// back on the device), and the host's cost of one call (the submissions' time over the calls
// made: validation, the call's record, the kernel submission; no compile and no wait).
#include <sycl/sycl.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench.h"
#include "tpfuse/sycl.h"

namespace tpfuse::bench {
namespace {

// Defaults of the SYCL mode. On the CPU device a call at 64 tokens of hidden 7168 takes a few
// ms; these keep the default run (SYCL and CPU backends) to a few minutes on 2 cores.
constexpr int kSyclOpsPerGraph = 10;
constexpr int kSyclReplays = 10;
constexpr int64_t kSyclMaxDefaultTokens = 64;
constexpr int kSyclDefaultWorld = 2;

// One rank's device buffers (USM device memory of its queue), freed with the object.
class RankBuffers {
 public:
  RankBuffers(sycl::queue& queue, const BenchPlan& plan, int rank) : queue_(queue) {
    const int64_t elements = int64_t(plan.buffer_bytes / dtype_size(plan.dtype));
    std::vector<char> host(plan.buffer_bytes);
    for (int s = 0; s < kBufferSets; ++s) {
      Set& set = sets_[size_t(s)];
      uint64_t seed = uint64_t(rank) * 1000 + uint64_t(s) * 10;
      for (void** buffer : {&set.input, &set.residual, &set.residual_out, &set.norm_out}) {
        *buffer = allocate(plan.buffer_bytes);
        fill_random_host(host.data(), elements, plan.dtype, seed++, -1.0f, 1.0f);
        queue_.memcpy(*buffer, host.data(), plan.buffer_bytes).wait();
      }
      set.quant_out = allocate(plan.buffer_bytes);
      set.scales = static_cast<float*>(allocate(fp8_scales_bytes(plan.buffer_bytes)));
    }
    // The static FP8 scale, device memory as every pointer of a SYCL call.
    static_scale_ = static_cast<float*>(allocate(sizeof(float)));
    queue_.memcpy(static_scale_, &kBenchStaticScale, sizeof(float)).wait();
    // The same gamma on every rank, as a replicated norm weight is.
    gamma_ = allocate(size_t(plan.max_hidden) * dtype_size(plan.dtype));
    fill_random_host(host.data(), plan.max_hidden, plan.dtype, 4, 0.5f, 1.5f);
    queue_.memcpy(gamma_, host.data(), size_t(plan.max_hidden) * dtype_size(plan.dtype)).wait();
  }
  ~RankBuffers() {
    for (void* block : blocks_) sycl::free(block, queue_);
  }
  RankBuffers(const RankBuffers&) = delete;
  RankBuffers& operator=(const RankBuffers&) = delete;

  struct Set {
    void *input, *residual, *residual_out, *norm_out, *quant_out;
    float* scales;
  };
  const Set& set(int index) const { return sets_[size_t(index % kBufferSets)]; }
  const void* gamma() const { return gamma_; }
  const float* static_scale() const { return static_scale_; }
  // Device memory of `bytes`, freed with the object (for the QK norm's buffers too).
  void* allocate(size_t bytes) {
    void* block = sycl::malloc_device(bytes, queue_);
    if (block == nullptr) {
      throw std::runtime_error("tpfuse-bench: sycl::malloc_device of " + std::to_string(bytes) +
                               " bytes failed");
    }
    blocks_.push_back(block);
    return block;
  }

 private:
  sycl::queue& queue_;
  std::array<Set, kBufferSets> sets_{};
  void* gamma_ = nullptr;
  float* static_scale_ = nullptr;
  std::vector<void*> blocks_;
};

struct Timing {
  double op_us;    // wall time of a replay over its ops_per_graph
  double host_us;  // submission time of a replay over the calls submitted
};

// Medians over the plan's replays (after one warm-up replay) of `call(rank, index)` made
// ops_per_graph times by each of the first `ranks` ranks, interleaved, then `wait(rank)` for each.
Timing measure(const BenchPlan& plan, int ranks, const std::function<void(int, int)>& call,
               const std::function<void(int)>& wait) {
  std::vector<double> op_us, host_us;
  for (int replay = -1; replay < plan.replays; ++replay) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < plan.ops_per_graph; ++i) {
      for (int r = 0; r < ranks; ++r) call(r, i);
    }
    const auto submitted = std::chrono::steady_clock::now();
    for (int r = 0; r < ranks; ++r) wait(r);
    const auto done = std::chrono::steady_clock::now();
    if (replay < 0) continue;
    op_us.push_back(std::chrono::duration<double, std::micro>(done - start).count() /
                    plan.ops_per_graph);
    host_us.push_back(std::chrono::duration<double, std::micro>(submitted - start).count() /
                      (plan.ops_per_graph * ranks));
  }
  return {median(op_us), median(host_us)};
}

AddRmsNormArgs fused_args(const RankBuffers::Set& set, const void* gamma, int64_t hidden,
                          int64_t tokens, DType dtype) {
  return row_args(set.input, set.residual, gamma, set.residual_out, set.norm_out, hidden, tokens,
                  dtype);
}

// The team's device: the first SYCL GPU, else the CPU device.
sycl::device bench_device() {
  const std::vector<sycl::device> gpus = sycl::device::get_devices(sycl::info::device_type::gpu);
  if (!gpus.empty()) return gpus.front();
  const std::vector<sycl::device> cpus = sycl::device::get_devices(sycl::info::device_type::cpu);
  if (!cpus.empty()) return cpus.front();
  throw std::runtime_error(
      "--backend sycl: no SYCL GPU or CPU device found (Intel's OpenCL CPU device needs "
      "OCL_ICD_FILENAMES=<runtime>/lib/libintelocl.so and <runtime>/lib on LD_LIBRARY_PATH: "
      "scripts/fetch-sycl.sh prints them)");
}

std::vector<Record> run_sycl_ranks(const std::vector<Team>& team, const BenchPlan& plan) {
  const int world = int(team.size());
  std::vector<Record> records;
  std::vector<std::unique_ptr<RankBuffers>> buffers;
  for (int r = 0; r < world; ++r) {
    buffers.push_back(std::make_unique<RankBuffers>(sycl_queue(team[size_t(r)]), plan, r));
  }
  const auto queue = [&](int r) -> sycl::queue& { return sycl_queue(team[size_t(r)]); };
  const auto check = [&](int r) { team[size_t(r)].check(); };
  const auto add = [&](const char* op, const std::string& impl, int64_t hidden, int64_t tokens,
                       int ranks, double us, const char* method) {
    Record record = measured(op, impl.c_str(), hidden, tokens, ranks, us);
    record.method = method;
    records.push_back(record);
  };
  constexpr const char* kHostMethod =
      "host time of one call (its validation, record and kernel submission), median of the "
      "replays";

  for (const auto& shape : plan.shapes) {
    const int64_t hidden = shape.first;
    for (const int64_t tokens : shape.second) {
      double oneshot_us = std::nan("");
      for (const Algorithm algorithm : {Algorithm::kOneShot, Algorithm::kTwoShot}) {
        if (tokens > team[0].max_tokens(hidden, plan.dtype, algorithm)) continue;
        const Timing t = measure(
            plan, world,
            [&](int r, int i) {
              AddRmsNormArgs args =
                  fused_args(buffers[size_t(r)]->set(i), buffers[size_t(r)]->gamma(), hidden,
                             tokens, plan.dtype);
              args.algorithm = algorithm;
              allreduce_add_rmsnorm(team[size_t(r)], args, queue(r));
            },
            check);
        const std::string impl =
            algorithm == Algorithm::kOneShot ? "tpfuse_oneshot_sycl" : "tpfuse_twoshot_sycl";
        add("allreduce_add_rmsnorm", impl, hidden, tokens, world, t.op_us, "");
        add("allreduce_add_rmsnorm", impl + "_host", hidden, tokens, world, t.host_us, kHostMethod);
        if (algorithm == Algorithm::kOneShot) oneshot_us = t.op_us;
      }
      // The FP8 outputs (the selector's algorithm), the bf16 norm kept.
      for (const QuantMode mode : kBenchQuantModes) {
        if (mode == QuantMode::kPerTokenGroup128 && hidden % kQuantGroupSize != 0) continue;
        const Timing t = measure(
            plan, world,
            [&](int r, int i) {
              const RankBuffers::Set& set = buffers[size_t(r)]->set(i);
              AddRmsNormArgs args =
                  fused_args(set, buffers[size_t(r)]->gamma(), hidden, tokens, plan.dtype);
              args.quant = mode;
              args.quant_out = set.quant_out;
              if (mode == QuantMode::kStatic) {
                args.quant_scale = buffers[size_t(r)]->static_scale();
              } else {
                args.scales_out = set.scales;
              }
              allreduce_add_rmsnorm(team[size_t(r)], args, queue(r));
            },
            check);
        add(fp8_op_name(mode), "tpfuse_auto_sycl", hidden, tokens, world, t.op_us, "");
      }
      // The local kernel on rank 0's queue: the norm without the exchange.
      const Timing local = measure(
          plan, 1,
          [&](int, int i) {
            add_rmsnorm(
                Backend::kSycl,
                fused_args(buffers[0]->set(i), buffers[0]->gamma(), hidden, tokens, plan.dtype),
                queue(0));
          },
          [&](int) { queue(0).wait_and_throw(); });
      add("add_rmsnorm", "sycl_local_add_rmsnorm", hidden, tokens, 1, local.op_us, "");
      std::fprintf(stderr,
                   "hidden %lld tokens %lld (us/op): tpfuse_oneshot_sycl %.2f  "
                   "sycl_local_add_rmsnorm %.2f\n",
                   static_cast<long long>(hidden), static_cast<long long>(tokens), oneshot_us,
                   local.op_us);
    }
  }

  // The QK norm at MiniMax-M2's shapes for this world (in place in the qkv rows), with and
  // without RoPE, where the backend has it.
  const QkShape shape = minimax_qk_shape(world);
  if (!shape.valid) return records;
  const int64_t row = shape.q_size + 2 * shape.kv_size;
  const std::vector<int64_t> positions = qk_positions(plan.max_tokens);
  const std::vector<float> cos_sin = qk_cos_sin_cache();
  const int64_t gamma_size = std::max(shape.q_size, shape.kv_size);
  std::vector<char> host_gamma(size_t(gamma_size) * dtype_size(plan.dtype));
  fill_random_host(host_gamma.data(), gamma_size, plan.dtype, 5, 0.5f, 1.5f);
  struct QkBuffers {
    void *gamma, *positions, *cos_sin;
  };
  std::vector<QkBuffers> qk(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    RankBuffers& b = *buffers[size_t(r)];
    qk[size_t(r)] = {b.allocate(host_gamma.size()), b.allocate(positions.size() * 8),
                     b.allocate(cos_sin.size() * 4)};
    queue(r).memcpy(qk[size_t(r)].gamma, host_gamma.data(), host_gamma.size());
    queue(r).memcpy(qk[size_t(r)].positions, positions.data(), positions.size() * 8);
    queue(r).memcpy(qk[size_t(r)].cos_sin, cos_sin.data(), cos_sin.size() * 4).wait();
  }
  for (int64_t tokens = 1; tokens <= plan.max_tokens; tokens *= 2) {
    if (size_t(tokens * row) * dtype_size(plan.dtype) > plan.buffer_bytes) break;
    for (const bool rope : {false, true}) {
      Timing t{};
      try {
        t = measure(
            plan, world,
            [&](int r, int i) {
              allreduce_qk_rmsnorm(
                  team[size_t(r)],
                  minimax_qk_args(
                      shape, buffers[size_t(r)]->set(i).input, qk[size_t(r)].gamma, tokens,
                      plan.dtype,
                      rope ? static_cast<const int64_t*>(qk[size_t(r)].positions) : nullptr,
                      static_cast<const float*>(qk[size_t(r)].cos_sin)),
                  sycl_stream(queue(r)));
            },
            check);
      } catch (const Error& error) {
        std::fprintf(stderr, "the QK norm is not measured on SYCL: %s\n", error.what());
        return records;
      }
      add("allreduce_qk_rmsnorm", rope ? "tpfuse_fused_rope_sycl" : "tpfuse_fused_sycl",
          shape.q_size + shape.kv_size, tokens, world, t.op_us, "");
    }
  }
  return records;
}

}  // namespace

bool sycl_gpu_found() {
  try {
    return !sycl::device::get_devices(sycl::info::device_type::gpu).empty();
  } catch (const sycl::exception&) {
    return false;
  }
}

std::vector<Record> run_sycl_bench(const Options& options, RunInfo& info) {
  const int world = options.world_size > 0 ? options.world_size : kSyclDefaultWorld;
  const sycl::device device = bench_device();
  const bool on_cpu = device.is_cpu();
  info.gpu = device.get_info<sycl::info::device::name>();
  info.driver = device.get_info<sycl::info::device::driver_version>();
  info.backend = on_cpu ? "sycl (CPU device)" : "sycl";
  info.ops_per_graph = options.ops_per_graph > 0 ? options.ops_per_graph : kSyclOpsPerGraph;
  info.replays = options.replays > 0 ? options.replays : kSyclReplays;
  info.method = std::to_string(info.ops_per_graph) +
                " calls a rank per replay, submitted by one host thread (ranks interleaved), "
                "then every rank's Team::check; the replay's wall time over the calls a rank, "
                "median of " +
                std::to_string(info.replays) + " replays after one warm-up";
  std::printf(
      "SYCL mode: %d ranks on '%s'%s\n", world, info.gpu.c_str(),
      on_cpu ? " (Intel's OpenCL CPU device: CPU-device figures, not Intel GPU figures)" : "");
  std::fflush(stdout);
  const auto created = std::chrono::steady_clock::now();
  const std::vector<Team> team =
      create_sycl_team(std::vector<sycl::device>(size_t(world), device), team_options_of(options));
  std::fprintf(stderr, "SYCL team of %d made in %.2f s (its kernels compiled or loaded then)\n",
               world,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - created).count());
  const BenchPlan plan =
      make_plan(options, team[0], kSyclMaxDefaultTokens, kSyclOpsPerGraph, kSyclReplays);
  std::vector<Record> records = run_sycl_ranks(team, plan);

  // The CPU backend beside it, on the same shapes (ranks as threads).
  Options cpu = options;
  cpu.world_size = world;
  cpu.processes = false;
  cpu.ops_per_graph = plan.ops_per_graph;
  cpu.replays = plan.replays;
  if (cpu.tokens.empty()) {
    for (int64_t tokens = 1; tokens <= kSyclMaxDefaultTokens; tokens *= 2) {
      cpu.tokens.push_back(tokens);
    }
  }
  RunInfo cpu_info;
  std::vector<Record> cpu_records = run_cpu_bench(cpu, cpu_info);
  for (Record& record : cpu_records) {
    if (record.method.empty()) record.method = "CPU backend: " + cpu_info.method;
    records.push_back(std::move(record));
  }
  info.host_cpu = cpu_info.host_cpu;
  return records;
}

}  // namespace tpfuse::bench
