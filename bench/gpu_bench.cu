// GPU mode of tpfuse-bench: one process drives W GPUs, one host thread per rank.
//
// Method, the same for every impl: after one eager call, each rank thread captures a CUDA graph of
// ops_per_graph back-to-back ops on its own stream, rotating among kBufferSets buffer sets; the
// graph is replayed kGpuWarmupReplays times, then `replays` times, every replay started by all rank
// threads together (a host barrier) and timed with events on the rank's stream. A figure is the
// median replay / ops_per_graph: rank 0's as `us`, the slowest rank's as `us_max_rank`.
//
// WARNING: tpfuse's one-shot ops are collectives over a Lamport protocol whose slot rotation is
// driven by per-rank call counters. Every rank must make the same calls in the same order, the
// same number of times: a rank that skips a replay (or a warm-up) leaves its peers polling for
// packets that never come, until the peer timeout fails the team. So every rank thread runs
// exactly the same sequence below; a rank that only measures something local (the tpfuse_local
// row) still takes part in every barrier.
#include <cuda_runtime.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#if TPFUSE_BENCH_NCCL
#include <nccl.h>
#endif

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "bench.h"
#include "cuda/check.h"
#if TPFUSE_BENCH_NCCL
#include "cuda/nccl_types.h"
#include "cuda/team/teams.h"
#endif
#include "gpu_kernels.h"
#include "tpfuse/cuda.h"

extern char** environ;

namespace tpfuse::bench {
namespace {

// "580.159.04" from /proc/driver/nvidia/version ("... Kernel Module  580.159.04  ..."), or "".
std::string kernel_driver_version() {
  std::FILE* file = std::fopen("/proc/driver/nvidia/version", "r");
  if (file == nullptr) return "";
  char line[512] = {};
  const bool read = std::fgets(line, sizeof(line), file) != nullptr;
  std::fclose(file);
  if (!read) return "";
  // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  ..." or "... Open Kernel Module
  // for x86_64  580.159.04  ...": the first word after "Kernel Module" that starts with a digit.
  std::istringstream words(std::string(line).substr(std::string(line).find("Kernel Module") + 1));
  std::string word;
  while (words >> word) {
    if (std::isdigit(static_cast<unsigned char>(word[0])) && word.find('.') != std::string::npos) {
      return word;
    }
  }
  return "";
}

// Floors: the iterations and repeats the shared probes used, so figures stay comparable.
constexpr int kPingPongIterations = 20000;
constexpr int kPingPongRepeats = 5;
constexpr size_t kPeerCopyBytes = size_t{256} << 20;
constexpr int kPeerCopyRepeats = 10;
// The peer-store bandwidth floor's sizes: tokens x hidden (the plan's first hidden, else this).
constexpr int64_t kStoreFloorTokens[] = {256, 1024, 2048, 4096, 16384};
constexpr int64_t kStoreFloorHidden = 3072;

// Seeds per buffer role; each rank and buffer set adds its own offset so no two buffers match.
constexpr uint64_t kSeedInput = 1;
constexpr uint64_t kSeedResidual = 2;
constexpr uint64_t kSeedOutputs = 3;
constexpr uint64_t kSeedGamma = 4;

struct DeviceBufferSet {
  void* input = nullptr;
  void* residual = nullptr;
  void* residual_out = nullptr;
  void* norm_out = nullptr;
  void* quant_out = nullptr;  // the FP8 output and its scales
  float* scales = nullptr;
  void* moe_rows = nullptr;      // the MoE finalize: [tokens, kBenchMoeTopK, hidden] rows,
  float* moe_weights = nullptr;  // [tokens, kBenchMoeTopK] fp32 routing weights,
  void* moe_combined = nullptr;  // and the baseline's combine output [tokens, hidden]
};

// The MoE finalize measured: MiniMax-M2's top-8 (no shared expert), fp32 routing weights, at most
// kBenchMoeMaxTokens tokens (the decode range; the rows take top-k times the activation).
constexpr int kBenchMoeTopK = 8;
constexpr int64_t kBenchMoeMaxTokens = 256;

// The GPU mode also records whether the library launches with PDL.
#if TPFUSE_BENCH_NCCL
constexpr bool kBenchNccl = true;
#else
constexpr bool kBenchNccl = false;
#endif

struct GpuPlan : BenchPlan {
  bool pdl = true;
  // The NCCL baselines (not with --shared-device: NCCL refuses two ranks on one GPU).
  bool nccl_baselines = kBenchNccl;
};

// The library reads TPFUSE_DISABLE_PDL once; the same rule here labels the records.
bool tpfuse_pdl_enabled() {
  const char* value = std::getenv("TPFUSE_DISABLE_PDL");
  return value == nullptr || value[0] == '\0' || value[0] == '0';
}

std::string version_string(int version, int major_divisor, int minor_divisor) {
  return std::to_string(version / major_divisor) + "." +
         std::to_string((version % major_divisor) / minor_divisor);
}

#if TPFUSE_BENCH_NCCL

std::string nccl_version_string() {
  int version = 0;
  TPF_CHECK_NCCL(ncclGetVersion(&version));
  // Codes are X*1000+Y*100+Z up to 2.8 and X*10000+Y*100+Z after.
  const bool old_scheme = version < 20900;
  const int major = old_scheme ? version / 1000 : version / 10000;
  const int minor = old_scheme ? (version % 1000) / 100 : (version % 10000) / 100;
  const int patch = version % 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}
#endif

// One rank's device resources, made on and owned by the rank's thread (its device current).
class GpuRank {
 public:
  GpuRank(const Team& team, const GpuPlan& plan, const void* nccl_id) : team_(team) {
    device_ = team.device();
    try {
      initialize(plan, nccl_id);
    } catch (...) {
      release(false);
      throw;
    }
  }

  ~GpuRank() { release(!failed_ && std::uncaught_exceptions() == 0); }

  GpuRank(const GpuRank&) = delete;
  GpuRank& operator=(const GpuRank&) = delete;

  void mark_failed() { failed_ = true; }

  const Team& team() const { return team_; }
  int rank() const { return team_.rank(); }
  cudaStream_t stream() const { return stream_; }
  const void* gamma() const { return gamma_; }
  const int64_t* positions() const { return positions_; }
  const float* cos_sin() const { return cos_sin_; }
  float* sums() const { return sums_; }
  const float* static_scale() const { return static_scale_; }
#if TPFUSE_BENCH_NCCL
  ncclComm_t comm() const {
    return comm_;
  }
#endif

  // Median replay of a graph of `ops` calls of `enqueue` (buffer sets rotating), in µs per op.
  // Inactive ranks return NaN but take part in every barrier.
  double measure(Barrier& barrier, const GpuPlan& plan, bool active,
                 const std::function<void(const DeviceBufferSet&)>& enqueue) {
    if (active) {
      // One eager call first, outside the capture: NCCL sets up connections lazily at a comm's
      // first use of an algorithm, and tpfuse's argument checks query the stream; a capturing
      // thread may do neither (seen on an H200 pair: ncclAllReduce failed with an internal
      // error, cudaStreamGetDevice with cudaErrorStreamCaptureUnsupported).
      enqueue(sets_[0]);
      TPF_CHECK_CUDA(cudaStreamSynchronize(stream_));
    }
    cudaGraphExec_t exec = active ? capture(plan.ops_per_graph, enqueue) : nullptr;
    struct ExecGuard {
      cudaGraphExec_t exec;
      ~ExecGuard() {
        if (exec != nullptr) cudaGraphExecDestroy(exec);
      }
    } guard{exec};

    barrier.arrive_and_wait();
    if (active) {
      for (int i = 0; i < kGpuWarmupReplays; ++i) TPF_CHECK_CUDA(cudaGraphLaunch(exec, stream_));
      TPF_CHECK_CUDA(cudaStreamSynchronize(stream_));
    }
    std::vector<double> per_op_us;
    per_op_us.reserve(size_t(plan.replays));
    for (int replay = 0; replay < plan.replays; ++replay) {
      barrier.arrive_and_wait();
      if (!active) continue;
      TPF_CHECK_CUDA(cudaEventRecord(start_, stream_));
      TPF_CHECK_CUDA(cudaGraphLaunch(exec, stream_));
      TPF_CHECK_CUDA(cudaEventRecord(stop_, stream_));
      TPF_CHECK_CUDA(cudaEventSynchronize(stop_));
      float ms = 0.0f;
      TPF_CHECK_CUDA(cudaEventElapsedTime(&ms, start_, stop_));
      per_op_us.push_back(double(ms) * 1000.0 / plan.ops_per_graph);
    }
    return active ? median(per_op_us) : std::numeric_limits<double>::quiet_NaN();
  }

 private:
  void initialize(const GpuPlan& plan, const void* nccl_id) {
    TPF_CHECK_CUDA(cudaSetDevice(device_));
#if TPFUSE_BENCH_NCCL
    // First, so that a rank failing below cannot leave its peers waiting in ncclCommInitRank.
    if (plan.nccl_baselines) {
      TPF_CHECK_NCCL(ncclCommInitRank(&comm_, team_.world_size(),
                                      *static_cast<const ncclUniqueId*>(nccl_id), team_.rank()));
    }
#else
    (void)nccl_id;
#endif
    TPF_CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    TPF_CHECK_CUDA(cudaEventCreate(&start_));
    TPF_CHECK_CUDA(cudaEventCreate(&stop_));
    const uint64_t rank_seed = uint64_t(team_.rank()) * 1000;
    const int64_t elements = int64_t(plan.buffer_bytes / dtype_size(plan.dtype));
    for (int s = 0; s < kBufferSets; ++s) {
      DeviceBufferSet& set = sets_[s];
      const uint64_t set_seed = rank_seed + uint64_t(s) * 10;
      set.input = allocate(plan.buffer_bytes);
      set.residual = allocate(plan.buffer_bytes);
      set.residual_out = allocate(plan.buffer_bytes);
      set.norm_out = allocate(plan.buffer_bytes);
      fill_random_device(set.input, elements, plan.dtype, set_seed + kSeedInput, -1.0f, 1.0f,
                         stream_);
      fill_random_device(set.residual, elements, plan.dtype, set_seed + kSeedResidual, -1.0f, 1.0f,
                         stream_);
      // Outputs too: every page is touched before timing, whatever the first op writes.
      fill_random_device(set.residual_out, elements, plan.dtype, set_seed + kSeedOutputs, -1.0f,
                         1.0f, stream_);
      fill_random_device(set.norm_out, elements, plan.dtype, set_seed + kSeedOutputs + 1, -1.0f,
                         1.0f, stream_);
      set.quant_out = allocate(plan.buffer_bytes);
      set.scales = static_cast<float*>(allocate(fp8_scales_bytes(plan.buffer_bytes)));
      TPF_CHECK_CUDA(cudaMemsetAsync(set.quant_out, 0, plan.buffer_bytes, stream_));
      TPF_CHECK_CUDA(cudaMemsetAsync(set.scales, 0, fp8_scales_bytes(plan.buffer_bytes), stream_));
      const int64_t moe_tokens = std::min(plan.max_tokens, kBenchMoeMaxTokens);
      const int64_t moe_elements = moe_tokens * plan.max_hidden;
      set.moe_rows = allocate(size_t(moe_elements * kBenchMoeTopK) * dtype_size(plan.dtype));
      set.moe_weights = static_cast<float*>(allocate(size_t(moe_tokens * kBenchMoeTopK) * 4));
      set.moe_combined = allocate(size_t(moe_elements) * dtype_size(plan.dtype));
      fill_random_device(set.moe_rows, moe_elements * kBenchMoeTopK, plan.dtype,
                         set_seed + kSeedInput + 5, -1.0f, 1.0f, stream_);
      fill_random_device(set.moe_weights, moe_tokens * kBenchMoeTopK, DType::kFloat32,
                         set_seed + kSeedInput + 6, 0.0f, 0.25f, stream_);
      fill_random_device(set.moe_combined, moe_elements, plan.dtype, set_seed + kSeedOutputs + 2,
                         -1.0f, 1.0f, stream_);
    }
    static_scale_ = static_cast<float*>(allocate(sizeof(float)));
    TPF_CHECK_CUDA(cudaMemcpyAsync(static_scale_, &kBenchStaticScale, sizeof(float),
                                   cudaMemcpyHostToDevice, stream_));
    gamma_ = allocate(size_t(plan.max_hidden) * dtype_size(plan.dtype));
    fill_random_device(gamma_, plan.max_hidden, plan.dtype, kSeedGamma, 0.5f, 1.5f, stream_);
    // The QK-norm rows: RoPE positions (spread over the cache), the cos|sin cache, [T,2] sums.
    const std::vector<int64_t> positions = qk_positions(plan.max_tokens);
    const std::vector<float> cos_sin = qk_cos_sin_cache();
    positions_ = static_cast<int64_t*>(allocate(positions.size() * sizeof(int64_t)));
    cos_sin_ = static_cast<float*>(allocate(cos_sin.size() * sizeof(float)));
    sums_ = static_cast<float*>(allocate(size_t(plan.max_tokens) * 2 * sizeof(float)));
    TPF_CHECK_CUDA(cudaMemcpyAsync(positions_, positions.data(), positions.size() * sizeof(int64_t),
                                   cudaMemcpyHostToDevice, stream_));
    TPF_CHECK_CUDA(cudaMemcpyAsync(cos_sin_, cos_sin.data(), cos_sin.size() * sizeof(float),
                                   cudaMemcpyHostToDevice, stream_));
    TPF_CHECK_CUDA(cudaStreamSynchronize(stream_));
  }

  // Frees what was made; `clean` is false after a failure, when waiting could hang.
  void release(bool clean) {
    cudaSetDevice(device_);
#if TPFUSE_BENCH_NCCL
    if (comm_ != nullptr) {
      // After a failure a peer may never join the comm's pending work: abort, do not wait.
      if (clean) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
      comm_ = nullptr;
    }
#endif
    if (clean && stream_ != nullptr) cudaStreamSynchronize(stream_);
    for (void* pointer : allocations_) cudaFree(pointer);
    allocations_.clear();
    if (start_ != nullptr) cudaEventDestroy(start_);
    if (stop_ != nullptr) cudaEventDestroy(stop_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    start_ = stop_ = nullptr;
    stream_ = nullptr;
  }

  void* allocate(size_t bytes) {
    void* pointer = nullptr;
    TPF_CHECK_CUDA(cudaMalloc(&pointer, std::max<size_t>(bytes, 16)));
    allocations_.push_back(pointer);
    return pointer;
  }

  cudaGraphExec_t capture(int ops, const std::function<void(const DeviceBufferSet&)>& enqueue) {
    // Thread-local capture: the other rank threads keep calling the runtime meanwhile.
    TPF_CHECK_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    try {
      for (int i = 0; i < ops; ++i) enqueue(sets_[i % kBufferSets]);
    } catch (...) {
      // End the capture so the stream is usable again; the error in flight is the one to report.
      cudaGraph_t partial = nullptr;
      cudaStreamEndCapture(stream_, &partial);
      if (partial != nullptr) cudaGraphDestroy(partial);
      cudaGetLastError();
      throw;
    }
    cudaGraph_t graph = nullptr;
    TPF_CHECK_CUDA(cudaStreamEndCapture(stream_, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    TPF_CHECK_CUDA(instantiated);
    return exec;
  }

  Team team_;
  int device_ = 0;
  bool failed_ = false;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_ = nullptr;
#if TPFUSE_BENCH_NCCL
  ncclComm_t comm_ = nullptr;
#endif
  std::array<DeviceBufferSet, kBufferSets> sets_{};
  void* gamma_ = nullptr;
  int64_t* positions_ = nullptr;
  float* cos_sin_ = nullptr;
  float* sums_ = nullptr;
  float* static_scale_ = nullptr;
  std::vector<void*> allocations_;
};

AddRmsNormArgs fused_args(const DeviceBufferSet& set, const void* gamma, int64_t hidden,
                          int64_t tokens, DType dtype) {
  return row_args(set.input, set.residual, gamma, set.residual_out, set.norm_out, hidden, tokens,
                  dtype);
}

// Everything one rank thread measures, in the one order every rank follows.
void run_rank(GpuRank& gpu, Barrier& barrier, const GpuPlan& plan, std::vector<Record>& records) {
  const Team& team = gpu.team();
  const int world_size = team.world_size();
  const bool is_rank0 = gpu.rank() == 0;
  const DType dtype = plan.dtype;
  cudaStream_t stream = gpu.stream();

  auto add = [&](const char* op, const char* impl, int64_t hidden, int64_t tokens, int world,
                 double us, bool tpfuse_kernel) {
    records.push_back(measured(op, impl, hidden, tokens, world, us));
    if (tpfuse_kernel) records.back().pdl = plan.pdl;
    return us;
  };

  for (const auto& shape : plan.shapes) {
    // Plain variables, not a structured binding: the measuring lambdas capture them (C++17).
    const int64_t hidden = shape.first;
    for (const int64_t tokens : shape.second) {
      const int64_t count = tokens * hidden;
#if TPFUSE_BENCH_NCCL
      // The unfused model's step: NCCL's all-reduce of `input` into norm_out (out of place, which
      // also keeps the inputs from growing replay after replay), then the local fused add +
      // RMSNorm kernel in place on it.
      auto nccl_then_local = [&](const DeviceBufferSet& set, const void* input) {
        TPF_CHECK_NCCL(ncclAllReduce(input, set.norm_out, size_t(count), impl::nccl_type(dtype),
                                     ncclSum, gpu.comm(), stream));
        AddRmsNormArgs args = fused_args(set, gpu.gamma(), hidden, tokens, dtype);
        args.input = set.norm_out;
        add_rmsnorm(Backend::kCuda, args, stream);
      };
#endif
      std::string progress;
      auto note = [&](const char* label, double us) {
        char text[64];
        std::snprintf(text, sizeof(text), "  %s %.2f", label, us);
        progress += text;
      };

      // The fused op, each algorithm forced where it carries the message, then the selector's
      // choice ("tpfuse_auto", with what it chose).
      double us = 0;
      for (const Algorithm algorithm :
           {Algorithm::kOneShot, Algorithm::kTwoShot, Algorithm::kNccl, Algorithm::kAuto}) {
        if (tokens > team.max_tokens(hidden, dtype, algorithm)) continue;
        us = gpu.measure(barrier, plan, true, [&](const DeviceBufferSet& set) {
          AddRmsNormArgs args = fused_args(set, gpu.gamma(), hidden, tokens, dtype);
          args.algorithm = algorithm;
          allreduce_add_rmsnorm(team, args, stream);
        });
        team.check();
        static const char* const kImpl[] = {"tpfuse_auto", "tpfuse_oneshot", "tpfuse_twoshot",
                                            "tpfuse_nccl"};
        const char* impl = kImpl[int(algorithm)];
        add("allreduce_add_rmsnorm", impl, hidden, tokens, world_size, us, true);
        if (algorithm == Algorithm::kAuto) {
          records.back().chosen = algorithm_name(team.choose(tokens, hidden, dtype));
        }
        note(impl + 7, us);
      }

      // The norm's FP8 output too, in each mode (the selector's algorithm): what it adds to the
      // bf16 fused op above.
      for (const QuantMode mode : kBenchQuantModes) {
        if (mode == QuantMode::kPerTokenGroup128 && hidden % kQuantGroupSize != 0) continue;
        // keep_norm false: the FP8 output alone (norm_out null, no bf16 norm written), as for a
        // norm only an FP8 GEMM reads.
        for (const bool keep_norm : {true, false}) {
          us = gpu.measure(barrier, plan, true, [&](const DeviceBufferSet& set) {
            AddRmsNormArgs args = fused_args(set, gpu.gamma(), hidden, tokens, dtype);
            if (!keep_norm) args.norm_out = nullptr;
            args.quant = mode;
            args.quant_out = set.quant_out;
            if (mode == QuantMode::kStatic) {
              args.quant_scale = gpu.static_scale();
            } else {
              args.scales_out = set.scales;
            }
            allreduce_add_rmsnorm(team, args, stream);
          });
          team.check();
          add(fp8_op_name(mode), keep_norm ? "tpfuse_auto" : "tpfuse_auto_no_norm", hidden, tokens,
              world_size, us, true);
          records.back().chosen = algorithm_name(team.choose(tokens, hidden, dtype));
        }

        // As an unfused model gets it: the bf16 fused op, then a quantization kernel of its own.
        us = gpu.measure(barrier, plan, true, [&](const DeviceBufferSet& set) {
          allreduce_add_rmsnorm(team, fused_args(set, gpu.gamma(), hidden, tokens, dtype), stream);
          quantize_fp8_device(set.norm_out, tokens, hidden, dtype, mode, gpu.static_scale(),
                              set.quant_out, set.scales, stream);
        });
        team.check();
        add(fp8_op_name(mode), "tpfuse_auto+quant", hidden, tokens, world_size, us, true);
#if TPFUSE_BENCH_NCCL
        if (plan.nccl_baselines) {
          us = gpu.measure(barrier, plan, true, [&](const DeviceBufferSet& set) {
            nccl_then_local(set, set.input);
            quantize_fp8_device(set.norm_out, tokens, hidden, dtype, mode, gpu.static_scale(),
                                set.quant_out, set.scales, stream);
          });
          add(fp8_op_name(mode), "nccl_ar+local_add_rmsnorm+quant", hidden, tokens, world_size, us,
              false);
        }
#endif
      }

      // The MoE finalize fused in (the selector's algorithm), against the combine as a kernel of
      // its own before the fused op, and before NCCL + the local kernel.
      if (tokens <= kBenchMoeMaxTokens) {
        const char* moe_op = "allreduce_moe_finalize_add_rmsnorm";
        us = gpu.measure(barrier, plan, true, [&](const DeviceBufferSet& set) {
          AddRmsNormArgs args = fused_args(set, gpu.gamma(), hidden, tokens, dtype);
          args.input = nullptr;
          args.moe_expert_rows = set.moe_rows;
          args.moe_weights = set.moe_weights;
          args.moe_topk = kBenchMoeTopK;
          allreduce_add_rmsnorm(team, args, stream);
        });
        team.check();
        note("moe", add(moe_op, "tpfuse_auto", hidden, tokens, world_size, us, true));
        records.back().chosen = algorithm_name(team.choose(tokens, hidden, dtype));
        us = gpu.measure(barrier, plan, true, [&](const DeviceBufferSet& set) {
          moe_combine_device(set.moe_rows, set.moe_weights, kBenchMoeTopK, tokens, hidden, dtype,
                             set.moe_combined, stream);
          AddRmsNormArgs args = fused_args(set, gpu.gamma(), hidden, tokens, dtype);
          args.input = set.moe_combined;
          allreduce_add_rmsnorm(team, args, stream);
        });
        team.check();
        note("combine+tpfuse",
             add(moe_op, "moe_combine+tpfuse_auto", hidden, tokens, world_size, us, true));
#if TPFUSE_BENCH_NCCL
        if (plan.nccl_baselines) {
          us = gpu.measure(barrier, plan, true, [&](const DeviceBufferSet& set) {
            moe_combine_device(set.moe_rows, set.moe_weights, kBenchMoeTopK, tokens, hidden, dtype,
                               set.moe_combined, stream);
            nccl_then_local(set, set.moe_combined);
          });
          add(moe_op, "moe_combine+nccl_ar+local_add_rmsnorm", hidden, tokens, world_size, us,
              false);
        }
#endif
      }

#if TPFUSE_BENCH_NCCL
      if (plan.nccl_baselines) {
        // The honest baseline: the unfused model's step (nccl_then_local).
        us = gpu.measure(barrier, plan, true,
                         [&](const DeviceBufferSet& set) { nccl_then_local(set, set.input); });
        note("nccl_ar+local", add("allreduce_add_rmsnorm", "nccl_ar+local_add_rmsnorm", hidden,
                                  tokens, world_size, us, false));
      }
#endif

      us = gpu.measure(barrier, plan, true, [&](const DeviceBufferSet& set) {
        allreduce(team, set.input, set.norm_out, count, dtype, stream);
      });
      team.check();
      note("tpfuse_ar", add("allreduce", "tpfuse_auto", hidden, tokens, world_size, us, true));

#if TPFUSE_BENCH_NCCL
      if (plan.nccl_baselines) {
        us = gpu.measure(barrier, plan, true, [&](const DeviceBufferSet& set) {
          TPF_CHECK_NCCL(ncclAllReduce(set.input, set.norm_out, size_t(count),
                                       impl::nccl_type(dtype), ncclSum, gpu.comm(), stream));
        });
        note("nccl_ar", add("allreduce", "nccl", hidden, tokens, world_size, us, false));
      }
#endif

      // The local epilogue alone, on rank 0's GPU: what the fused op adds to a bare all-reduce.
      us = gpu.measure(barrier, plan, is_rank0, [&](const DeviceBufferSet& set) {
        add_rmsnorm(Backend::kCuda, fused_args(set, gpu.gamma(), hidden, tokens, dtype), stream);
      });
      note("local", add("add_rmsnorm", "tpfuse_local", hidden, tokens, 1, us, true));

      if (is_rank0) {
        std::fprintf(stderr, "hidden %lld tokens %lld (us/op, rank 0):%s\n",
                     static_cast<long long>(hidden), static_cast<long long>(tokens),
                     progress.c_str());
      }
    }
  }

  // The QK norm at MiniMax-M2's shapes for this world size (KV heads replicated when the world
  // is larger than 8), in place in each buffer set's qkv rows, with and without RoPE: the fused
  // op against its unfused form (sum-of-squares kernel, NCCL all-reduce of the [T, 2] fp32 sums,
  // norm kernel), which computes the same bits.
  // On a one-rank team also the per-rank shape of world 2 (MiniMax-M2 TP-2's, its global sizes
  // kept): the fused kernel the pair runs, without the exchange.
  std::vector<int> shape_worlds{world_size};
  if (world_size == 1) shape_worlds.push_back(2);
  for (const int shape_world : shape_worlds) {
    const QkShape shape = minimax_qk_shape(shape_world);
    const int64_t q_size = shape.q_size, kv_size = shape.kv_size;
    const int64_t qk_row = q_size + 2 * kv_size;
    if (!shape.valid || q_size > plan.max_hidden) continue;
    const std::string label = shape_world == world_size
                                  ? std::string()
                                  : qk_shape_label(shape, shape_world) + ", on a one-rank team";
    for (int64_t tokens = 1; tokens <= plan.max_tokens; tokens *= 2) {
      if (size_t(tokens * qk_row) * dtype_size(dtype) > plan.buffer_bytes) break;
      for (const bool rope : {false, true}) {
        const auto qk_args = [&](const DeviceBufferSet& set) {
          return minimax_qk_args(shape, set.input, gpu.gamma(), tokens, dtype,
                                 rope ? gpu.positions() : nullptr, gpu.cos_sin());
        };
        double us = gpu.measure(barrier, plan, true, [&](const DeviceBufferSet& set) {
          allreduce_qk_rmsnorm(team, qk_args(set), stream);
        });
        team.check();
        add("allreduce_qk_rmsnorm", rope ? "tpfuse_fused_rope" : "tpfuse_fused", q_size + kv_size,
            tokens, world_size, us, true);
        records.back().shape = label;
        double unfused = std::numeric_limits<double>::quiet_NaN();
#if TPFUSE_BENCH_NCCL
        if (plan.nccl_baselines) {
          const bool count_k = gpu.rank() % shape.kv_replicas == 0;
          unfused = gpu.measure(barrier, plan, true, [&](const DeviceBufferSet& set) {
            const QkNormArgs args = qk_args(set);
            qk_sum_squares(Backend::kCuda, args, count_k, gpu.sums(), stream);
            TPF_CHECK_NCCL(ncclAllReduce(gpu.sums(), gpu.sums(), size_t(2 * tokens), ncclFloat32,
                                         ncclSum, gpu.comm(), stream));
            qk_rmsnorm_from_sums(Backend::kCuda, args, gpu.sums(), stream);
          });
          add("allreduce_qk_rmsnorm", rope ? "nccl_ar_sums+local_rope" : "nccl_ar_sums+local",
              q_size + kv_size, tokens, world_size, unfused, false);
          records.back().shape = label;
        }
#endif
        double floor = std::numeric_limits<double>::quiet_NaN();
        if (!rope) {
          // The floor: q and k read and written back in place, nothing else (rank 0's GPU).
          floor = gpu.measure(barrier, plan, is_rank0, [&](const DeviceBufferSet& set) {
            rows_in_place_copy_device(set.input, tokens, qk_row, q_size + kv_size, dtype, stream);
          });
          add("allreduce_qk_rmsnorm", "hbm_in_place_copy", q_size + kv_size, tokens, 1, floor,
              false);
          records.back().shape = label;
        }
        if (is_rank0) {
          std::fprintf(stderr,
                       "qk norm%s q %lld + k %lld, tokens %lld (us/op, rank 0): tpfuse %.2f  "
                       "unfused %.2f  in-place copy %.2f\n",
                       rope ? "+rope" : "", static_cast<long long>(q_size),
                       static_cast<long long>(kv_size), static_cast<long long>(tokens), us, unfused,
                       floor);
        }
      }
    }
  }
}

void add_floors(const GpuPlan& plan, std::vector<Record>& records) {
  std::fprintf(stderr, "floors...\n");
  auto floor_record = [&](const char* impl, int world, double us, const std::string& method) {
    Record record;
    record.op = "floor";
    record.impl = impl;
    record.world_size = world;
    record.us = us;
    record.method = method;
    records.push_back(record);
    return &records.back();
  };
  const std::string graph_method = "cuda-graph of " + std::to_string(plan.ops_per_graph) +
                                   " empty kernels (1 block of 128 threads), median of " +
                                   std::to_string(plan.replays) + " replays";
  floor_record("empty_kernel_graph", 1,
               measure_empty_kernel_graph_us(0, true, plan.ops_per_graph, plan.replays),
               graph_method + ", programmatic dependent launch");
  floor_record("empty_kernel_graph_nopdl", 1,
               measure_empty_kernel_graph_us(0, false, plan.ops_per_graph, plan.replays),
               graph_method + ", no programmatic dependent launch");

  int can_access = 0;
  if (cuda_device_count() >= 2) {
    TPF_CHECK_CUDA(cudaDeviceCanAccessPeer(&can_access, 0, 1));
  }
  if (!can_access) {
    std::fprintf(stderr,
                 "tpfuse-bench: no peer access between GPU 0 and 1: NVLink floors skipped\n");
    return;
  }
  floor_record("nvlink_one_way", 2,
               measure_nvlink_one_way_us(0, 1, kPingPongIterations, kPingPongRepeats),
               "ping-pong GPU 0 <-> GPU 1, one thread each, volatile int stores into the peer, " +
                   std::to_string(kPingPongIterations) +
                   " round trips, one way = elapsed / iterations / 2, median of " +
                   std::to_string(kPingPongRepeats));
  const CopyFloor copy = measure_peer_copy(0, 1, kPeerCopyBytes, kPeerCopyRepeats);
  Record* record =
      floor_record("nvlink_copy_GBps", 2, copy.us,
                   "cudaMemcpyPeerAsync of " + std::to_string(kPeerCopyBytes >> 20) +
                       " MiB GPU 0 -> GPU 1, median of " + std::to_string(kPeerCopyRepeats));
  record->gbps = copy.gbps;
  record->bytes = int64_t(kPeerCopyBytes);

  // What NVLink carries each way while the other way is busy too: both GPUs sending a [tokens,
  // hidden] tensor into each other at once, the bytes each rank sends per call in one-shot and
  // in two-shot (half in the reduce-scatter, half in the all-gather); by SM stores, as a fused
  // kernel sends, and by the copy engines.
  const int64_t hidden = plan.shapes.empty() ? kStoreFloorHidden : plan.shapes.front().first;
  for (const int64_t tokens : kStoreFloorTokens) {
    const size_t bytes = size_t(tokens) * size_t(hidden) * dtype_size(plan.dtype);
    for (const PeerTransfer transfer : {PeerTransfer::kStores, PeerTransfer::kCopyEngine}) {
      const bool stores = transfer == PeerTransfer::kStores;
      const CopyFloor both =
          measure_peer_both_ways(0, 1, bytes, transfer, plan.ops_per_graph, plan.replays);
      Record* floor = floor_record(
          stores ? "nvlink_store_both_ways" : "nvlink_copy_both_ways", 2, both.us,
          "GPU 0 and GPU 1 each send " + std::to_string(tokens) + " x " + std::to_string(hidden) +
              " " + dtype_name(plan.dtype) + " into the other at once, " +
              (stores ? "SM stores (st.global.v4 of vectors read locally)"
                      : "copy engines (cudaMemcpyPeerAsync)") +
              "; " + std::to_string(plan.ops_per_graph) +
              (stores ? " kernels per GPU in a cuda-graph" : " copies per GPU enqueued directly") +
              ", median of " + std::to_string(plan.replays) + " replays on GPU 0");
      floor->tokens = tokens;
      floor->hidden = hidden;
      floor->gbps = both.gbps;
      floor->bytes = int64_t(bytes);
    }
  }
}

}  // namespace

namespace {

// The run's device fields and method, from GPU 0.
void fill_run_info(const GpuPlan& plan, bool processes, bool shared_device, RunInfo& info) {
  cudaDeviceProp properties{};
  TPF_CHECK_CUDA(cudaGetDeviceProperties(&properties, 0));
  int driver = 0;
  int runtime = 0;
  TPF_CHECK_CUDA(cudaDriverGetVersion(&driver));
  TPF_CHECK_CUDA(cudaRuntimeGetVersion(&runtime));
  info.gpu = properties.name;
  // The kernel module's version (e.g. 580.159.04) where the driver publishes it; else the CUDA
  // version the driver supports.
  info.driver = kernel_driver_version();
  if (info.driver.empty()) info.driver = "cuda " + version_string(driver, 1000, 10);
  info.cuda = version_string(runtime, 1000, 10);
  info.backend = "cuda";
  info.ops_per_graph = plan.ops_per_graph;
  info.replays = plan.replays;
  info.method = "cuda-graph of " + std::to_string(plan.ops_per_graph) + " ops, median of " +
                std::to_string(plan.replays) + " replays, " +
                (processes       ? "one process per GPU (create_nccl_team)"
                 : shared_device ? "every rank on GPU 0, one process (create_cuda_team), no NCCL"
                                 : "one process driving every GPU (create_cuda_team)");
#if TPFUSE_BENCH_NCCL
  info.nccl = nccl_version_string();
#endif
}

#if TPFUSE_BENCH_NCCL
// --processes: ranks meet through an all-reduce of one word on their own stream.
class NcclBarrier : public Barrier {
 public:
  explicit NcclBarrier(ncclComm_t comm) : comm_(comm) {
    TPF_CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    TPF_CHECK_CUDA(cudaMalloc(&word_, sizeof(int)));
    TPF_CHECK_CUDA(cudaMemset(word_, 0, sizeof(int)));
  }
  ~NcclBarrier() override {
    cudaStreamSynchronize(stream_);
    cudaFree(word_);
    cudaStreamDestroy(stream_);
  }
  void arrive_and_wait() override {
    TPF_CHECK_NCCL(ncclAllReduce(word_, word_, 1, ncclInt32, ncclSum, comm_, stream_));
    TPF_CHECK_CUDA(cudaStreamSynchronize(stream_));
  }

 private:
  ncclComm_t comm_;
  cudaStream_t stream_ = nullptr;
  int* word_ = nullptr;
};

std::string to_hex(const void* data, size_t bytes) {
  std::string hex;
  char byte[3];
  for (size_t i = 0; i < bytes; ++i) {
    std::snprintf(byte, sizeof(byte), "%02x", static_cast<const unsigned char*>(data)[i]);
    hex += byte;
  }
  return hex;
}

void from_hex(const char* hex, void* data, size_t bytes) {
  if (hex == nullptr || std::strlen(hex) != 2 * bytes) TPF_FAIL("bad id in the environment");
  for (size_t i = 0; i < bytes; ++i) {
    static_cast<unsigned char*>(data)[i] =
        static_cast<unsigned char>(std::stoi(std::string(hex + 2 * i, 2), nullptr, 16));
  }
}

// One rank of --processes: its own team over NCCL, the same measurements as a rank thread.
void run_rank_process(const Options& options) {
  const int rank = std::atoi(std::getenv("TPFUSE_BENCH_RANK"));
  const int world_size = std::atoi(std::getenv("TPFUSE_BENCH_WORLD"));
  TPF_CHECK_CUDA(cudaSetDevice(rank));
  UniqueId team_id;
  ncclUniqueId nccl_id;
  from_hex(std::getenv("TPFUSE_BENCH_TEAM_ID"), team_id.bytes, sizeof(team_id.bytes));
  from_hex(std::getenv("TPFUSE_BENCH_NCCL_ID"), &nccl_id, sizeof(nccl_id));
  const Team team = create_nccl_team(team_id, rank, world_size, rank, team_options_of(options));
  if (rank == 0) {
    std::fprintf(
        stderr, "rank processes: peer memory %s%s%s\n", team.peer_memory().c_str(),
        team.fallback_reason().empty() ? "" : "; fallback: ", team.fallback_reason().c_str());
  }
  GpuPlan plan;
  static_cast<BenchPlan&>(plan) =
      make_plan(options, team, kGpuMaxDefaultTokens, kGpuOpsPerGraph, kGpuReplays);
  plan.pdl = tpfuse_pdl_enabled();
  std::vector<Record> records;
  {
    GpuRank gpu(team, plan, &nccl_id);
    NcclBarrier barrier(gpu.comm());
    try {
      run_rank(gpu, barrier, plan, records);
    } catch (...) {
      gpu.mark_failed();
      throw;
    }
  }
  write_records(std::getenv("TPFUSE_BENCH_RECORDS"), records);
}

// --processes: starts one copy of this binary per GPU and merges what they measured.
std::vector<Record> launch_rank_processes(int world_size) {
  const std::string team_id = [] {
    const UniqueId id = create_unique_id();
    return to_hex(id.bytes, sizeof(id.bytes));
  }();
  ncclUniqueId nccl_id;
  TPF_CHECK_NCCL(ncclGetUniqueId(&nccl_id));
  const std::string bench_id = to_hex(&nccl_id, sizeof(nccl_id));
  const std::filesystem::path directory =
      std::filesystem::temp_directory_path() / ("tpfuse-bench-" + std::to_string(getpid()));
  std::filesystem::create_directories(directory);
  std::vector<std::string> argv_storage;
  {
    std::ifstream cmdline("/proc/self/cmdline");
    std::string argument;
    while (std::getline(cmdline, argument, '\0')) argv_storage.push_back(argument);
  }
  std::vector<char*> argv;
  for (std::string& argument : argv_storage) argv.push_back(argument.data());
  argv.push_back(nullptr);
  std::vector<pid_t> children;
  for (int rank = 0; rank < world_size; ++rank) {
    std::vector<std::string> variables = {
        "TPFUSE_BENCH_RANK=" + std::to_string(rank),
        "TPFUSE_BENCH_WORLD=" + std::to_string(world_size), "TPFUSE_BENCH_TEAM_ID=" + team_id,
        "TPFUSE_BENCH_NCCL_ID=" + bench_id,
        "TPFUSE_BENCH_RECORDS=" + (directory / ("rank" + std::to_string(rank) + ".tsv")).string()};
    std::vector<char*> env;
    for (char** e = environ; *e != nullptr; ++e) env.push_back(*e);
    for (std::string& v : variables) env.push_back(v.data());
    env.push_back(nullptr);
    pid_t pid = 0;
    if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(), env.data()) != 0) {
      for (pid_t child : children) kill(child, SIGKILL);
      TPF_FAIL("posix_spawn of rank " << rank << " failed");
    }
    children.push_back(pid);
  }
  // A rank that fails takes the others down: they would wait for it in NCCL forever.
  bool failed = false;
  for (size_t done = 0; done < children.size();) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, 0);
    if (pid < 0) break;
    ++done;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      failed = true;
      for (pid_t child : children) {
        if (child != pid) kill(child, SIGTERM);
      }
    }
  }
  if (failed) TPF_FAIL("a rank process failed (its error is above)");
  std::vector<std::vector<Record>> per_rank;
  for (int rank = 0; rank < world_size; ++rank) {
    per_rank.push_back(
        read_records((directory / ("rank" + std::to_string(rank) + ".tsv")).string()));
  }
  std::filesystem::remove_all(directory);
  return merge_ranks(per_rank);
}
#endif

}  // namespace

bool is_rank_process() {
  return std::getenv("TPFUSE_BENCH_RANK") != nullptr;
}

std::vector<Record> run_gpu_bench(const Options& options, RunInfo& info) {
  const int device_count = cuda_device_count();
  const int world_size =
      options.world_size > 0 ? options.world_size : std::min(device_count, kGpuMaxDefaultWorld);
  if (world_size < 1 || (world_size > device_count && !options.shared_device)) {
    TPF_FAIL("--world " << world_size << " but this process sees " << device_count
                        << " CUDA device(s)");
  }
  if (options.processes) {
#if TPFUSE_BENCH_NCCL
    if (is_rank_process()) {
      run_rank_process(options);
      return {};
    }
    GpuPlan plan;
    plan.ops_per_graph = options.ops_per_graph > 0 ? options.ops_per_graph : kGpuOpsPerGraph;
    plan.replays = options.replays > 0 ? options.replays : kGpuReplays;
    fill_run_info(plan, true, false, info);
    std::fprintf(stderr, "GPU mode: %d processes x %s, %s, %s\n", world_size, info.gpu.c_str(),
                 dtype_name(options.dtype), info.method.c_str());
    std::vector<Record> records = launch_rank_processes(world_size);
    add_floors(plan, records);
    return records;
#else
    TPF_FAIL("--processes needs NCCL, which this build of tpfuse-bench does not have");
#endif
  }
  // --shared-device: every rank on GPU 0 (the peers' stores are local ones), as on a machine
  // with one GPU.
  std::vector<int> devices(static_cast<size_t>(world_size));
  for (int rank = 0; rank < world_size; ++rank) {
    devices[size_t(rank)] = options.shared_device ? 0 : rank;
  }
  // Ranks sharing GPU 0 are a team the public create_cuda_team refuses (a device a rank): the
  // library's own form for them, as tests/gpu/test_shared_device_gpu.cc makes.
  const std::vector<Team> team =
      options.shared_device
          ? impl::create_in_process_cuda_team(devices, team_options_of(options), true)
          : create_cuda_team(devices, team_options_of(options));

  GpuPlan plan;
  static_cast<BenchPlan&>(plan) =
      make_plan(options, team[0], kGpuMaxDefaultTokens, kGpuOpsPerGraph, kGpuReplays);
  plan.pdl = tpfuse_pdl_enabled();
  plan.nccl_baselines = kBenchNccl && !options.shared_device;
  fill_run_info(plan, false, options.shared_device, info);

  const void* nccl_id_pointer = nullptr;
#if TPFUSE_BENCH_NCCL
  ncclUniqueId nccl_id;
  if (plan.nccl_baselines) {
    TPF_CHECK_NCCL(ncclGetUniqueId(&nccl_id));
    nccl_id_pointer = &nccl_id;
  }
#else
  std::fprintf(stderr, "tpfuse-bench: built without NCCL: the NCCL baselines are not measured\n");
#endif
  std::fprintf(stderr, "GPU mode: %d x %s, %s, %s\n", world_size, info.gpu.c_str(),
               dtype_name(options.dtype), info.method.c_str());

  RankBarrier barrier(world_size);
  std::vector<std::vector<Record>> per_rank(static_cast<size_t>(world_size));
  run_rank_threads(world_size, barrier, [&](int rank) {
    GpuRank gpu(team[size_t(rank)], plan, nccl_id_pointer);
    try {
      run_rank(gpu, barrier, plan, per_rank[size_t(rank)]);
    } catch (...) {
      gpu.mark_failed();
      throw;
    }
  });

  std::vector<Record> records = merge_ranks(per_rank);
  add_floors(plan, records);
  return records;
}

}  // namespace tpfuse::bench
