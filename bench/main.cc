// tpfuse-bench: the project's benchmark driver. Measures the fused ops against NCCL + the local
// fused kernel and against the hardware floors in one run; prints a table and writes JSON
// (bench/plot_results.py draws it). Without two GPUs it runs the CPU backend and says so.
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "bench.h"
#include "results_path.h"

#ifndef TPFUSE_BENCH_SOURCE_DIR
#define TPFUSE_BENCH_SOURCE_DIR "."
#endif

namespace tpfuse::bench {
namespace {

constexpr const char* kUsage = R"(usage: tpfuse-bench [options]

  --hidden LIST        widths, comma-separated (default 3072,4096,7168)
  --tokens LIST        token counts, comma-separated (default powers of two 1..4096 on GPUs,
                       1..256 on the CPU); at most 32768 on GPUs and 4096 on the CPU (every
                       rank holds 16 buffers of tokens x hidden); counts the team's algorithms
                       cannot carry are skipped with a message
  --dtype D            bf16 | fp16 | fp32 (default bf16)
  --world N            ranks, 1..16 (default: every visible GPU, at most 8; CPU mode 2)
  --ops-per-graph N    back-to-back ops per timed replay (default 20; CPU mode 10)
  --replays N          timed replays; the median is reported (default 50; CPU mode 20)
  --packet-mib N       one-shot workspace packet size in MiB (TeamOptions::packet_bytes, default 16)
  --backend B          auto | cuda | cpu | sycl (default auto: cuda where a CUDA GPU is found;
                       one GPU measures the local kernels, a one-rank team and the floors; else
                       sycl where the build has the SYCL backend and a SYCL GPU is found; else
                       cpu). sycl: a SYCL team on the first SYCL GPU, else on Intel's OpenCL CPU
                       device (CPU-device figures), with the CPU backend beside it
  --processes          one process a rank, as serving runs: GPU mode one per GPU over NCCL
                       (create_nccl_team), CPU mode over shared memory (create_cpu_team with
                       an id); default: one process drives every GPU (create_cuda_team), or
                       the CPU ranks are threads
  --shared-device      GPU mode: every rank on GPU 0 (--world N of them), one process, no NCCL
                       baselines (NCCL refuses two ranks on one GPU)
  --peer-timeout S     TeamOptions::peer_timeout_seconds (default 10; 0: unchecked polling),
                       to measure what checked mode costs
  --out PATH           results JSON at PATH (taken: NAME-1.json, NAME-2.json, ... beside it)
  --out-dir DIR        results JSON in DIR under the default name (default DIR: ./tpfuse-results,
                       in the working directory): <device>-x<world>-<YYYYMMDD>-<HHMMSS>-<commit>.json
                       (UTC); a name already taken gets -1, -2, ...: no run overwrites another
  --help               this text

environment:
  TPFUSE_BENCH_COMMIT  commit recorded in the results (default: git rev-parse --short HEAD of the
                       source tree, "-dirty" appended if it has changes; "unknown" without git)
  TPFUSE_DISABLE_PDL   read by the library; recorded in each tpfuse record as "pdl"
  NCCL_NVLS_ENABLE     set to 0 unless already set: NVLink multicast stays off
)";

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "tpfuse-bench: %s\n\n%s", message.c_str(), kUsage);
  std::exit(2);
}

int64_t parse_integer(const std::string& flag, const std::string& text, int64_t minimum) {
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || errno != 0 || end == nullptr || *end != '\0' || value < minimum) {
    usage_error(flag + " expects an integer >= " + std::to_string(minimum) + ", got '" + text +
                "'");
  }
  return value;
}

std::vector<int64_t> parse_list(const std::string& flag, const std::string& text, int64_t minimum) {
  std::vector<int64_t> values;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    if (item.empty()) usage_error(flag + " has an empty item in '" + text + "'");
    values.push_back(parse_integer(flag, item, minimum));
  }
  if (values.empty() || text.back() == ',') {
    usage_error(flag + " expects a comma-separated list of integers, got '" + text + "'");
  }
  return values;
}

const char* short_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "fp32";
    case DType::kFloat16:
      return "fp16";
    case DType::kBFloat16:
      return "bf16";
  }
  return "unknown";
}

Options parse_options(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    std::string value;
    const size_t equals = flag.find('=');
    const bool inline_value = flag.rfind("--", 0) == 0 && equals != std::string::npos;
    if (inline_value) {
      value = flag.substr(equals + 1);
      flag = flag.substr(0, equals);
    }
    if (flag == "--help" || flag == "-h") {
      std::printf("%s", kUsage);
      std::exit(0);
    }
    static const char* const kFlags[] = {
        "--hidden",       "--tokens",     "--dtype",        "--world", "--ops-per-graph",
        "--replays",      "--packet-mib", "--backend",      "--out",   "--processes",
        "--peer-timeout", "--out-dir",    "--shared-device"};
    if (std::find(std::begin(kFlags), std::end(kFlags), flag) == std::end(kFlags)) {
      usage_error("unknown option '" + flag + "'");
    }
    if (flag == "--processes") {
      options.processes = true;
      continue;
    }
    if (flag == "--shared-device") {
      options.shared_device = true;
      continue;
    }
    if (!inline_value) {
      if (i + 1 >= argc) usage_error(flag + " needs a value");
      value = argv[++i];
    }
    if (flag == "--hidden") {
      options.hiddens = parse_list(flag, value, 1);
      for (const int64_t hidden : options.hiddens) {
        if (hidden % kHiddenMultiple != 0 || hidden > kMaxHidden) {
          usage_error("--hidden " + std::to_string(hidden) + ": widths must be multiples of " +
                      std::to_string(kHiddenMultiple) + " up to " + std::to_string(kMaxHidden));
        }
      }
    } else if (flag == "--tokens") {
      options.tokens = parse_list(flag, value, 1);
    } else if (flag == "--dtype") {
      if (value == "bf16") {
        options.dtype = DType::kBFloat16;
      } else if (value == "fp16") {
        options.dtype = DType::kFloat16;
      } else if (value == "fp32") {
        options.dtype = DType::kFloat32;
      } else {
        usage_error("--dtype expects bf16, fp16 or fp32, got '" + value + "'");
      }
    } else if (flag == "--world") {
      options.world_size = int(parse_integer(flag, value, 1));
      if (options.world_size > kMaxWorldSize) {
        usage_error("--world must be at most " + std::to_string(kMaxWorldSize));
      }
    } else if (flag == "--ops-per-graph") {
      options.ops_per_graph = int(parse_integer(flag, value, 1));
    } else if (flag == "--replays") {
      options.replays = int(parse_integer(flag, value, 1));
    } else if (flag == "--packet-mib") {
      options.packet_bytes = size_t(parse_integer(flag, value, 1)) << 20;
    } else if (flag == "--peer-timeout") {
      char* end = nullptr;
      options.peer_timeout_seconds = std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || options.peer_timeout_seconds < 0) {
        usage_error("--peer-timeout expects seconds >= 0, got '" + value + "'");
      }
    } else if (flag == "--backend") {
      if (value == "auto") {
        options.backend = BackendChoice::kAuto;
      } else if (value == "cuda") {
        options.backend = BackendChoice::kCuda;
      } else if (value == "cpu") {
        options.backend = BackendChoice::kCpu;
      } else if (value == "sycl") {
        options.backend = BackendChoice::kSycl;
      } else {
        usage_error("--backend expects auto, cuda, cpu or sycl, got '" + value + "'");
      }
    } else if (flag == "--out-dir") {
      options.out_dir = value;
    } else {  // --out
      options.out_path = value;
    }
  }
  if (!options.out_path.empty() && !options.out_dir.empty()) {
    usage_error("--out and --out-dir exclude each other");
  }
  if (options.shared_device && options.processes) {
    usage_error("--shared-device and --processes exclude each other");
  }
  return options;
}

// Output of a shell command, trailing newline removed; empty if it failed.
std::string command_output(const std::string& command) {
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return "";
  std::string output;
  char buffer[256];
  while (std::fgets(buffer, sizeof(buffer), pipe) != nullptr) output += buffer;
  const int status = pclose(pipe);
  if (status != 0) return "";
  while (!output.empty() && (output.back() == '\n' || output.back() == '\r')) output.pop_back();
  return output;
}

// The checkout the binary was built from, if it is still there (a binary carried to another
// machine falls back to the working directory).
std::string source_dir() {
  std::error_code error;
  if (std::filesystem::is_directory(TPFUSE_BENCH_SOURCE_DIR, error)) return TPFUSE_BENCH_SOURCE_DIR;
  return ".";
}

// Short commit, "-dirty" if the checkout has changes; "unknown" without git. Committed results are
// left out of the check (and ./tpfuse-results is ignored by git): otherwise the results of one run
// would mark every later run dirty.
std::string git_commit() {
  // A copy of the tree without .git (a machine the sources were shipped to) can be told.
  const char* given = std::getenv("TPFUSE_BENCH_COMMIT");
  if (given != nullptr && given[0] != '\0') return given;
  const std::string git = "git -C '" + source_dir() + "' ";
  const std::string commit = command_output(git + "rev-parse --short HEAD 2>/dev/null");
  if (commit.empty()) return "unknown";
  const std::string changes =
      command_output(git + "status --porcelain -- . ':(exclude)bench/results' 2>/dev/null");
  return changes.empty() ? commit : commit + "-dirty";
}

std::string utc_time(std::time_t when, const char* format) {
  std::tm utc{};
  gmtime_r(&when, &utc);
  char text[64];
  std::strftime(text, sizeof(text), format, &utc);
  return text;
}

// "NVIDIA H200" -> "nvidia-h200".
std::string slug(const std::string& name) {
  std::string out;
  for (const char c : name) {
    if (std::isalnum(static_cast<unsigned char>(c))) {
      out += char(std::tolower(static_cast<unsigned char>(c)));
    } else if (!out.empty() && out.back() != '-') {
      out += '-';
    }
  }
  while (!out.empty() && out.back() == '-') out.pop_back();
  return out.empty() ? "unknown" : out;
}

// The file this run writes: --out, or the default name in --out-dir (default ./tpfuse-results),
// created here with a numeric suffix if the name is taken (results_path.h).
std::string create_out_file(const Options& options, const RunInfo& info, int world_size,
                            std::time_t start) {
  std::filesystem::path wanted = options.out_path;
  if (wanted.empty()) {
    const std::string device = info.backend == "cpu" ? "cpu" : slug(info.gpu);
    const std::filesystem::path dir =
        options.out_dir.empty() ? kDefaultResultsDir : options.out_dir;
    wanted = dir / (results_stem(device, world_size, start, info.commit) + ".json");
  }
  return create_unique_file(wanted).string();
}

enum class Mode { kGpu, kCpu, kSycl };

// Whether this build has the SYCL mode and a SYCL GPU is there (asked only where no CUDA GPU is).
bool sycl_gpu_in_build() {
#if TPFUSE_BENCH_SYCL
  return sycl_gpu_found();
#else
  return false;
#endif
}

Mode choose_mode(const Options& options) {
  const char* kCpuNote = options.processes
                             ? ": running the CPU backend (one process a rank over shared memory; "
                               "these are CPU figures, not GPU figures)"
                             : ": running the CPU backend (ranks are threads; these are CPU "
                               "figures, not GPU figures)";
  const bool built_with_cuda = cuda_available();
  const int gpus = cuda_device_count();
  std::string reason;
  if (options.backend == BackendChoice::kSycl) {
    if (!sycl_available()) {
      usage_error(
          "--backend sycl, but this build has no SYCL backend (no SYCL runtime was found "
          "when it was configured: scripts/fetch-sycl.sh)");
    }
    return Mode::kSycl;
  }
  if (options.backend == BackendChoice::kCpu) {
    reason = "--backend cpu";
  } else if (!built_with_cuda) {
    if (options.backend == BackendChoice::kCuda) {
      usage_error("--backend cuda, but this build has no CUDA backend (configured without nvcc)");
    }
    reason = "This build has no CUDA backend";
  } else if (options.backend == BackendChoice::kCuda) {
    if (gpus == 0) usage_error("--backend cuda, but no CUDA GPUs were found");
    return Mode::kGpu;
  } else if (gpus == 0) {
    reason = "No CUDA GPUs found";
  } else {
    if (gpus == 1 && options.world_size <= 1) {
      std::printf(
          "One CUDA GPU found: measuring what one GPU shows (the local kernels, the fused ops "
          "on a one-rank team, the floors); the collectives need two or more\n");
    }
    return Mode::kGpu;
  }
  if (options.backend == BackendChoice::kAuto && sycl_gpu_in_build()) {
    std::printf("%s; a SYCL GPU found: running the SYCL backend\n", reason.c_str());
    return Mode::kSycl;
  }
  std::printf("%s%s\n", reason.c_str(), kCpuNote);
  std::fflush(stdout);
  return Mode::kCpu;
}

int run(int argc, char** argv) {
  // NVLink SHARP multicast stays off: NCCL must not create multicast objects on these machines,
  // and the baseline is then the same NCCL configuration as the committed baselines. An explicit
  // setting in the environment wins.
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  const Options options = parse_options(argc, argv);

  RunInfo info;
  info.dtype = short_dtype_name(options.dtype);
  info.commit = git_commit();
  const std::time_t start = std::time(nullptr);
  info.date = utc_time(start, "%Y-%m-%dT%H:%M:%SZ");

  const Mode mode = choose_mode(options);
  if (mode != Mode::kGpu && options.shared_device) {
    usage_error("--shared-device is an option of the GPU mode (this run is on the " +
                std::string(mode == Mode::kCpu ? "CPU" : "SYCL") + " backend)");
  }
  if (mode == Mode::kSycl && options.processes) {
    usage_error(
        "--processes: the SYCL mode's ranks are one process's (SYCL teams across "
        "processes are not built yet)");
  }
  // Every rank holds kBufferSets sets of four [tokens, hidden] buffers: past these counts a run
  // is a memory test, not a benchmark (100000 tokens of hidden 7168 would take 23 GB a rank).
  const int64_t most_tokens = mode == Mode::kGpu ? kGpuMaxTokens : kCpuMaxTokens;
  for (const int64_t tokens : options.tokens) {
    if (tokens > most_tokens) {
      usage_error("--tokens " + std::to_string(tokens) + ": the " +
                  (mode == Mode::kGpu ? "GPU" : "CPU") + " mode measures at most " +
                  std::to_string(most_tokens) + " tokens");
    }
  }
  std::vector<Record> records;
  int world_size = options.world_size;
  if (mode == Mode::kGpu) {
#if TPFUSE_BENCH_CUDA
    records = run_gpu_bench(options, info);
    if (is_rank_process()) return 0;  // the launcher writes the results
    if (world_size == 0) world_size = std::min(cuda_device_count(), kGpuMaxDefaultWorld);
#else
    usage_error("this build of tpfuse-bench has no GPU mode");
#endif
  } else if (mode == Mode::kSycl) {
#if TPFUSE_BENCH_SYCL
    records = run_sycl_bench(options, info);
    if (world_size == 0) world_size = kCpuDefaultWorld;
#else
    usage_error("this build of tpfuse-bench has no SYCL mode");
#endif
  } else {
    records = run_cpu_bench(options, info);
    if (world_size == 0) world_size = kCpuDefaultWorld;
  }

  // The QK norm's records say their shape (their `hidden` is the per-rank q + k width).
  for (Record& record : records) {
    if (record.op == "allreduce_qk_rmsnorm" && record.shape.empty()) {
      record.shape = qk_shape_label(minimax_qk_shape(record.world_size), record.world_size);
    }
  }
  print_table(info, records);
  const std::string out_path = create_out_file(options, info, world_size, start);
  write_json(out_path, info, records);
  std::printf("\nwrote %zu records to %s\n", records.size(), out_path.c_str());
  return 0;
}

}  // namespace
}  // namespace tpfuse::bench

int main(int argc, char** argv) {
  try {
    return tpfuse::bench::run(argc, argv);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "tpfuse-bench: error: %s\n", error.what());
    return 1;
  }
}
