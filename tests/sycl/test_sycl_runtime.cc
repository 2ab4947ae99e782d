// Intel's SYCL runtime as the SYCL backend will use it (docs/sycl.md):
//  * the run-time kernel compiler (src/sycl/compiler.h): compile errors as tpfuse errors with the
//    log, the in-memory and disk caches (a new process loads what an earlier one compiled);
//  * tpfuse's headers as SYCL device code: every embedded header compiles on its own, and the
//    numeric conversions, the Lamport rewrite and arrival check, packing, the epilogue's rank sum
//    and the call signatures give the host's bits (tests/sycl/smoke_kernels.sycl);
//  * a toy 2-rank exchange through the Lamport session (tpfuse/impl/session.h with
//    src/sycl/device/exchange.h): back-to-back calls whose sums match the host's bits on both
//    ranks, over two launches and from two queues; and a missing peer is a timeout, not a hang.
// The device tests need Intel's OpenCL CPU device: ctest sets its environment
// (tests/sycl/CMakeLists.txt); by hand, set what scripts/fetch-sycl.sh prints.
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <sycl/sycl.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "sycl/compiler.h"
#include "sycl/embedded.h"
#include "tpfuse/impl/epilogue.h"
#include "tpfuse/impl/lamport.h"
#include "tpfuse/impl/numeric.h"
#include "tpfuse/impl/session.h"
#include "tpfuse/tpfuse.h"

extern char** environ;

namespace tpfuse::sycl_backend {
EmbeddedTexts test_kernel_sources();  // generated: tests/sycl/smoke_kernels.sycl
}

namespace {

namespace sb = tpfuse::sycl_backend;
using namespace tpfuse::impl;

constexpr int kNumericResults = 9;  // as in smoke_kernels.sycl
constexpr int kVectorResults = 6;

sb::KernelSource smoke_source() {
  for (const sb::EmbeddedText& text : sb::test_kernel_sources()) {
    if (std::string(text.name) == "smoke_kernels.sycl") {
      return sb::KernelSource{"smoke kernels", std::string(text.text, text.size), {}, {}};
    }
  }
  ADD_FAILURE() << "smoke_kernels.sycl is not embedded";
  return {};
}

// A fresh directory under the system's temporary directory, removed at the end of the test.
struct TemporaryDirectory {
  std::filesystem::path path;
  TemporaryDirectory() {
    std::string pattern =
        (std::filesystem::temp_directory_path() / "tpfuse-sycl-test-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) ADD_FAILURE() << "mkdtemp failed";
    path = pattern;
  }
  ~TemporaryDirectory() {
    std::error_code error;
    std::filesystem::remove_all(path, error);
  }
};

// Intel's OpenCL CPU device, where one can compile SYCL source; the reason when there is none.
std::optional<sycl::queue>& cpu_queue(std::string& why) {
  static std::string reason;
  // Never destroyed, as the process's compiler (src/sycl/compiler.h says why).
  static auto* queue = new std::optional<sycl::queue>([] {
    std::optional<sycl::queue> found;
    try {
      for (const sycl::device& device : sycl::device::get_devices(sycl::info::device_type::cpu)) {
        if (sb::can_compile_sycl(device)) {
          found.emplace(device, sycl::property::queue::in_order());
          break;
        }
        reason = sb::describe_device(device) + " cannot compile SYCL source";
      }
    } catch (const sycl::exception& e) {
      reason = std::string("the SYCL runtime found no platform: ") + e.what();
    }
    if (!found && reason.empty()) reason = "no SYCL CPU device";
    return found;
  }());
  why = reason +
        " (Intel's OpenCL CPU device needs OCL_ICD_FILENAMES=<env>/lib/libintelocl.so "
        "and LD_LIBRARY_PATH=<env>/lib: scripts/fetch-sycl.sh prints them; ctest sets "
        "them)";
  return *queue;
}

bool device_required() {
  const char* value = std::getenv("TPFUSE_SYCL_REQUIRE_DEVICE");
  return value != nullptr && std::string(value) == "1";
}

#define TPF_REQUIRE_CPU_DEVICE(queue_variable) \
  std::string tpf_why_;                        \
  auto& tpf_queue_ = cpu_queue(tpf_why_);      \
  if (!tpf_queue_) {                           \
    if (device_required()) FAIL() << tpf_why_; \
    GTEST_SKIP() << tpf_why_;                  \
  }                                            \
  sycl::queue& queue_variable = *tpf_queue_

// USM shared memory of n T, freed at the end of the scope.
template <typename T>
struct Shared {
  sycl::queue queue;
  T* data;
  Shared(sycl::queue& q, size_t n) : queue(q), data(sycl::malloc_shared<T>(n, q)) {
    if (data == nullptr) ADD_FAILURE() << "malloc_shared of " << n << " elements failed";
  }
  ~Shared() { sycl::free(data, queue); }
  T& operator[](size_t i) { return data[i]; }
};

// ---------------------------------------------------------------------------------------------
// The compiler wrapper.

TEST(SyclCompiler, EmbedsTheLibraryHeaders) {
  std::vector<std::string> names;
  for (const sb::EmbeddedText& header : sb::library_headers()) names.push_back(header.name);
  for (const char* needed :
       {"tpfuse/limits.h", "tpfuse/tpfuse.h", "tpfuse/version.h", "tpfuse/impl/config.h",
        "tpfuse/impl/numeric.h", "tpfuse/impl/lamport.h", "tpfuse/impl/session.h",
        "tpfuse/impl/epilogue.h", "tpfuse/sycl/exchange.h"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), needed), names.end()) << needed;
  }
  // The text is the header's: its first line, as in the source tree.
  for (const sb::EmbeddedText& header : sb::library_headers()) {
    if (std::string(header.name) == "tpfuse/impl/lamport.h") {
      EXPECT_EQ(std::string(header.text, 40).rfind("// The Lamport one-shot protocol", 0), 0u);
    }
  }
}

TEST(SyclCompiler, SettingsFromTheEnvironment) {
  const char* saved = std::getenv("TPFUSE_SYCL_CACHE_DIR");
  const std::string saved_value = saved ? saved : "";
  ::setenv("TPFUSE_SYCL_CACHE_DIR", "/some/where", 1);
  EXPECT_EQ(sb::CompilerSettings::from_environment().cache_dir, "/some/where");
  ::setenv("TPFUSE_SYCL_CACHE_DIR", "off", 1);
  EXPECT_TRUE(sb::CompilerSettings::from_environment().cache_dir.empty());
  ::unsetenv("TPFUSE_SYCL_CACHE_DIR");
  EXPECT_FALSE(sb::CompilerSettings::from_environment().cache_dir.empty());
  if (saved) ::setenv("TPFUSE_SYCL_CACHE_DIR", saved_value.c_str(), 1);
}

TEST(SyclCompiler, CompileErrorIsATpfuseErrorWithTheLog) {
  TPF_REQUIRE_CPU_DEVICE(queue);
  TemporaryDirectory cache;
  sb::KernelCompiler compiler(sb::CompilerSettings{cache.path});
  const sb::KernelSource broken{
      "a broken kernel",
      "#include <sycl/sycl.hpp>\n"
      "#include <tpfuse/impl/numeric.h>\n"
      "extern \"C\" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY(("
      "sycl::ext::oneapi::experimental::nd_range_kernel<1>))\n"
      "void broken(float* p) { p[0] = tpfuse::impl::no_such_function(); }\n",
      {},
      {}};
  try {
    compiler.build(queue, broken);
    FAIL() << "a kernel that calls an undeclared function compiled";
  } catch (const tpfuse::Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("'a broken kernel' did not compile"), std::string::npos) << message;
    EXPECT_NE(message.find("no_such_function"), std::string::npos) << message;
    EXPECT_NE(message.find("src/sycl/compiler.cc"), std::string::npos) << message;
  }
  // A source's own header of a library header's name is the one it includes.
  const sb::KernelSource shadowing{"a shadowing header",
                                   "#include <tpfuse/impl/numeric.h>\n",
                                   {{"tpfuse/impl/numeric.h", "#error the source's own header\n"}},
                                   {}};
  try {
    compiler.build(queue, shadowing);
    FAIL() << "the library's numeric.h was included instead of the source's own";
  } catch (const tpfuse::Error& e) {
    EXPECT_NE(std::string(e.what()).find("the source's own header"), std::string::npos) << e.what();
  }
  EXPECT_EQ(compiler.stats().compiles, 0u);
}

TEST(SyclCompiler, MissingKernelIsATpfuseError) {
  TPF_REQUIRE_CPU_DEVICE(queue);
  const sb::Build build = sb::kernel_compiler().build(queue, smoke_source());
  EXPECT_NO_THROW(build.kernel("tpf_smoke_numeric"));
  EXPECT_THROW(build.kernel("tpf_no_such_kernel"), tpfuse::Error);
}

constexpr const char* kBackendKernels = "tpfuse/sycl/rows.h";

// Each embedded header compiles on its own as SYCL device code (as headers_compile_alone checks
// them on the host), and all of them together with <sycl/sycl.hpp>.
TEST(SyclCompiler, EveryEmbeddedHeaderCompilesAloneAsDeviceCode) {
  TPF_REQUIRE_CPU_DEVICE(queue);
  for (const sb::EmbeddedText& header : sb::library_headers()) {
    // The backend's kernels (35 of them: minutes of compiling) are its tests' to compile, with
    // the backend's options (tests/sycl/test_sycl_backend.cc).
    if (std::string(header.name) == kBackendKernels) continue;
    const sb::KernelSource alone{std::string("header ") + header.name,
                                 std::string("#include <") + header.name + ">\n",
                                 {},
                                 {}};
    const sb::Build build = sb::kernel_compiler().build(queue, alone);
    std::cout << "[ device pass ] " << header.name << ": " << sb::to_string(build.origin) << " in "
              << build.seconds << " s\n";
  }
  std::string all = "#include <sycl/sycl.hpp>\n";
  for (const sb::EmbeddedText& header : sb::library_headers()) {
    if (std::string(header.name) == kBackendKernels) continue;
    all += std::string("#include <") + header.name + ">\n";
  }
  EXPECT_NO_THROW(
      sb::kernel_compiler().build(queue, sb::KernelSource{"every header", all, {}, {}}));
}

TEST(SyclCompiler, MemoryCacheDiskCacheAndKeys) {
  TPF_REQUIRE_CPU_DEVICE(queue);
  TemporaryDirectory cache;
  const sb::KernelSource source{
      "a small kernel",
      "#include <sycl/sycl.hpp>\n#include <tpfuse/impl/numeric.h>\n"
      "extern \"C\" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY(("
      "sycl::ext::oneapi::experimental::nd_range_kernel<1>))\n"
      "void to_bf16(const float* in, uint16_t* out) {\n"
      "  const size_t i = sycl::ext::oneapi::this_work_item::get_nd_item<1>()"
      ".get_global_linear_id();\n"
      "  out[i] = tpfuse::impl::from_float<tpfuse::impl::BFloat16>(in[i] * SCALE).bits;\n"
      "}\n",
      {},
      {"-DSCALE=2.0f"}};
  {
    sb::KernelCompiler compiler(sb::CompilerSettings{cache.path});
    const sb::Build first = compiler.build(queue, source);
    EXPECT_EQ(first.origin, sb::BuildOrigin::kCompiled);
    EXPECT_TRUE(first.disk_note.empty()) << first.disk_note;
    EXPECT_TRUE(std::filesystem::exists(first.cache_file));
    EXPECT_EQ(compiler.build(queue, source).origin, sb::BuildOrigin::kMemory);

    // Another option is another key, and another file.
    sb::KernelSource other = source;
    other.options = {"-DSCALE=4.0f"};
    const sb::Build second = compiler.build(queue, other);
    EXPECT_EQ(second.origin, sb::BuildOrigin::kCompiled);
    EXPECT_NE(second.cache_file, first.cache_file);
    EXPECT_NE(sb::cache_key(queue.get_device(), source), sb::cache_key(queue.get_device(), other));

    // The build runs.
    Shared<float> in(queue, 16);
    Shared<uint16_t> out(queue, 16);
    for (int i = 0; i < 16; ++i) in[i] = 1.0f + float(i) / 7.0f;
    sycl::kernel kernel = second.kernel("to_bf16");
    queue
        .submit([&](sycl::handler& h) {
          h.set_args(in.data, out.data);
          h.parallel_for(sycl::nd_range<1>{16, 16}, kernel);
        })
        .wait();
    for (int i = 0; i < 16; ++i) EXPECT_EQ(out[i], from_float<BFloat16>(in[i] * 4.0f).bits) << i;
    EXPECT_EQ(compiler.stats().compiles, 2u);
    EXPECT_EQ(compiler.stats().memory_hits, 1u);
  }
  {
    // A new compiler (as a new process would) finds both on disk.
    sb::KernelCompiler compiler(sb::CompilerSettings{cache.path});
    const sb::Build loaded = compiler.build(queue, source);
    EXPECT_EQ(loaded.origin, sb::BuildOrigin::kDisk);
    EXPECT_EQ(compiler.stats().disk_hits, 1u);

    // A cache file that is not one (or a truncated one) is a miss, recompiled and rewritten.
    compiler.forget();
    std::ofstream(loaded.cache_file, std::ios::binary | std::ios::trunc) << "not a cache file";
    const sb::Build rebuilt = compiler.build(queue, source);
    EXPECT_EQ(rebuilt.origin, sb::BuildOrigin::kCompiled);
    EXPECT_NE(rebuilt.disk_note.find("is not a tpfuse SYCL cache file"), std::string::npos)
        << rebuilt.disk_note;
    compiler.forget();
    EXPECT_EQ(compiler.build(queue, source).origin, sb::BuildOrigin::kDisk);
  }
}

// What a child process (the test binary run again, see main) reports: where its build came from
// and how long it took, and how long the whole process ran.
struct ChildReport {
  std::string origin;
  double build_seconds = -1;      // wall time of the build
  double build_cpu_seconds = -1;  // CPU time of the process's threads during the build (the
                                  // figure that a machine shared with other work distorts less)
  double process_seconds = -1;
};

double process_cpu_seconds() {
  timespec t{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

ChildReport run_child(const std::vector<std::string>& extra_environment) {
  TemporaryDirectory scratch;
  const std::string report = (scratch.path / "report").string();
  // This process's environment, less the variables the child is given anew.
  std::vector<std::string> environment;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string variable(*e);
    bool overridden = variable.rfind("TPFUSE_SYCL_TEST_CHILD=", 0) == 0;
    for (const std::string& extra : extra_environment) {
      overridden = overridden || variable.rfind(extra.substr(0, extra.find('=') + 1), 0) == 0;
    }
    if (!overridden) environment.push_back(variable);
  }
  environment.push_back("TPFUSE_SYCL_TEST_CHILD=" + report);
  environment.insert(environment.end(), extra_environment.begin(), extra_environment.end());
  std::vector<char*> envp;
  for (std::string& e : environment) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  char* argv[] = {self.data(), nullptr};
  const auto start = std::chrono::steady_clock::now();
  pid_t pid = 0;
  ChildReport result;
  if (::posix_spawn(&pid, self.c_str(), nullptr, nullptr, argv, envp.data()) != 0) {
    ADD_FAILURE() << "posix_spawn failed";
    return result;
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  result.process_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  std::ifstream in(report);
  in >> result.origin >> result.build_seconds >> result.build_cpu_seconds;
  return result;
}

// The figures docs/sycl.md quotes: the first compile of the smoke kernels into an empty disk
// cache, then a new process that finds them there.
TEST(SyclCompiler, NewProcessLoadsFromTheDiskCache) {
  TPF_REQUIRE_CPU_DEVICE(queue);
  (void)queue;
  TemporaryDirectory cache;
  const std::string dir = "TPFUSE_SYCL_CACHE_DIR=" + cache.path.string();
  const ChildReport cold = run_child({dir});
  const ChildReport warm = run_child({dir});
  std::cout << "[ figures ] smoke kernels, first compile: " << cold.build_seconds << " s (CPU "
            << cold.build_cpu_seconds << " s; whole process " << cold.process_seconds
            << " s); a new process, disk cache warm: " << warm.build_seconds << " s (CPU "
            << warm.build_cpu_seconds << " s, from " << warm.origin << "; whole process "
            << warm.process_seconds << " s)\n";
  EXPECT_EQ(cold.origin, "compiled");
  EXPECT_EQ(warm.origin, "disk");
  EXPECT_LT(warm.build_seconds, cold.build_seconds);
  RecordProperty("first_compile_seconds", std::to_string(cold.build_seconds));
  RecordProperty("warm_process_load_seconds", std::to_string(warm.build_seconds));
}

// ---------------------------------------------------------------------------------------------
// tpfuse's headers as SYCL device code, against the host.

bool is_nan_bits(uint32_t bits) {
  return (bits & 0x7fffffffu) > 0x7f800000u;
}
bool is_nan16(uint32_t bits, bool bf16) {
  return bf16 ? (bits & 0x7fffu) > 0x7f80u : (bits & 0x7fffu) > 0x7c00u;
}

// Lanes of two vectors of `kind` (0: fp32, 1: bf16, 2: fp16) are the same bits, or both NaN
// (NaN payloads aside: numeric.h's promise; an add's operand order decides which NaN survives).
bool same_lanes(const Vec16& a, const Vec16& b, int kind) {
  for (int w = 0; w < 4; ++w) {
    if (kind == 0) {
      if (a.word[w] != b.word[w] && !(is_nan_bits(a.word[w]) && is_nan_bits(b.word[w])))
        return false;
      continue;
    }
    for (int half = 0; half < 2; ++half) {
      const uint32_t x = (a.word[w] >> (16 * half)) & 0xffffu;
      const uint32_t y = (b.word[w] >> (16 * half)) & 0xffffu;
      if (x != y && !(is_nan16(x, kind == 1) && is_nan16(y, kind == 1))) return false;
    }
  }
  return true;
}

std::string hex(const Vec16& v) {
  std::ostringstream out;
  out << std::hex;
  for (int w = 0; w < 4; ++w) out << (w ? " " : "") << v.word[w];
  return out.str();
}

// fp32 inputs for the conversions: the special values, a sweep of bit patterns over all of
// fp32 (every 4099th), and every bf16 value with the low halves that decide its rounding.
std::vector<float> conversion_inputs() {
  std::vector<uint32_t> bits = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u,
                                0xffc00000u, 0x7f800001u, 0x7fbfffffu, 0x00000001u, 0x807fffffu,
                                0x00800000u, 0x3f800000u, 0x477fefffu, 0x477ff000u, 0x43e00000u,
                                0x43e80000u, 0x3c800000u, 0x3a800000u, 0x33000000u, 0x38800000u};
  for (uint64_t u = 0; u <= 0xffffffffu; u += 4099) bits.push_back(uint32_t(u));
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    for (uint32_t low : {0x0000u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu})
      bits.push_back(b << 16 | low);
  }
  std::vector<float> values(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) values[i] = bits_float(bits[i]);
  return values;
}

TEST(SyclDeviceCode, NumericConversionsGiveTheHostsBits) {
  TPF_REQUIRE_CPU_DEVICE(queue);
  const sb::Build build = sb::kernel_compiler().build(queue, smoke_source());
  const std::vector<float> values = conversion_inputs();
  const int64_t count = int64_t(values.size());
  Shared<float> in(queue, values.size());
  Shared<uint32_t> out(queue, values.size() * kNumericResults);
  std::memcpy(in.data, values.data(), values.size() * sizeof(float));
  sycl::kernel kernel = build.kernel("tpf_smoke_numeric");
  queue
      .submit([&](sycl::handler& h) {
        h.set_args(static_cast<const float*>(in.data), out.data, count);
        h.parallel_for(sycl::nd_range<1>{4096, 64}, kernel);
      })
      .wait();
  const char* names[kNumericResults] = {
      "bf16",      "fp16",    "e4m3", "bf16->fp32", "fp16->fp32", "e4m3->fp32", "reciprocal_sqrt",
      "rms_scale", "division"};
  int64_t mismatches[kNumericResults] = {};
  for (int64_t i = 0; i < count; ++i) {
    const float x = values[size_t(i)];
    const BFloat16 bf16 = from_float<BFloat16>(x);
    const Float16 fp16 = from_float<Float16>(x);
    const Fp8E4M3 fp8 = fp8_e4m3_from_float(x);
    const uint32_t host[kNumericResults] = {bf16.bits,
                                            fp16.bits,
                                            fp8.bits,
                                            float_bits(to_float(bf16)),
                                            float_bits(to_float(fp16)),
                                            float_bits(to_float(fp8)),
                                            float_bits(reciprocal_sqrt(x)),
                                            float_bits(rms_scale(x, 3072, 1e-6f)),
                                            float_bits(x / values[size_t((i * 7 + 1) % count)])};
    for (int r = 0; r < kNumericResults; ++r) {
      const uint32_t device = out[size_t(i * kNumericResults + r)];
      // Conversions are integer code: every bit. Arithmetic: every bit but NaN payloads.
      const bool same =
          device == host[r] || (r >= 6 && is_nan_bits(device) && is_nan_bits(host[r]));
      if (!same && mismatches[r]++ < 3) {
        ADD_FAILURE() << names[r] << " of " << std::hex << float_bits(x) << ": device " << device
                      << ", host " << host[r];
      }
    }
  }
  for (int r = 0; r < kNumericResults; ++r) {
    EXPECT_EQ(mismatches[r], 0) << names[r] << " over " << count << " values";
  }
}

// 16-byte vectors: random words, with the words the protocol must handle in every lane position
// (the sentinel, a 16-bit -0 in either half, NaN, Inf, denormals), and whole vectors of them.
constexpr uint32_t kSpecialWords[] = {
    kSentinel, 0x00008000u, 0x80008000u, 0x00000000u, 0x7fc07fc0u, 0x7f807f80u, 0xff80ff80u,
    0x00010001u, 0x7f7f7f7fu, 0x7fc00000u, 0x00000001u, 0x3f803f80u, 0xbf80bf80u, 0x7c007c00u,
    // a 16-bit -0 beside a nonzero: where a rank sum of the sentinel
    // and its rewrite differ in a zero's sign and the output keeps it
    0x80003f80u, 0x3f808000u};
constexpr size_t kSpecialCount = std::size(kSpecialWords);

std::vector<Vec16> adversarial_vectors(size_t count, uint32_t seed) {
  std::mt19937 random(seed);
  const uint32_t* special = kSpecialWords;
  std::vector<Vec16> vectors(count);
  for (size_t i = 0; i < count; ++i) {
    for (int w = 0; w < 4; ++w) {
      const uint32_t pick = random();
      vectors[i].word[w] = pick % 4 == 0 ? special[(pick >> 8) % kSpecialCount] : random();
    }
  }
  for (size_t s = 0; s < kSpecialCount && s < count; ++s) {
    vectors[s] = Vec16{{special[s], special[s], special[s], special[s]}};
  }
  return vectors;
}

TEST(SyclDeviceCode, VectorsSessionAndEpilogueGiveTheHostsBits) {
  TPF_REQUIRE_CPU_DEVICE(queue);
  const sb::Build build = sb::kernel_compiler().build(queue, smoke_source());
  const std::vector<Vec16> vectors = adversarial_vectors(65536, 42);
  const int64_t count = int64_t(vectors.size());
  Shared<Vec16> in(queue, vectors.size());
  Shared<Vec16> out(queue, vectors.size() * kVectorResults);
  Shared<uint32_t> arrived(queue, vectors.size());
  std::memcpy(in.data, vectors.data(), vectors.size() * sizeof(Vec16));
  sycl::kernel kernel = build.kernel("tpf_smoke_vectors");
  queue
      .submit([&](sycl::handler& h) {
        h.set_args(static_cast<const Vec16*>(in.data), out.data, arrived.data, count);
        h.parallel_for(sycl::nd_range<1>{2048, 64}, kernel);
      })
      .wait();
  int64_t failures = 0;
  int64_t sentinel_vectors = 0;
  for (int64_t i = 0; i < count && failures < 10; ++i) {
    const Vec16& v = vectors[size_t(i)];
    const Vec16& next = vectors[size_t((i + 1) % count)];
    Vec16 host[kVectorResults];
    host[0] = rewrite_sentinel(v);
    float lanes[8];
    unpack<BFloat16>(v, lanes);
    for (float& lane : lanes) lane *= 0.5f;
    host[1] = pack<BFloat16>(lanes);
    float acc[8];
    accumulate_first<BFloat16>(acc, rewrite_sentinel(v));
    accumulate<BFloat16>(acc, rewrite_sentinel(next));
    host[2] = round_output<BFloat16>(acc);
    float acc16[8];
    accumulate_first<Float16>(acc16, rewrite_sentinel(v));
    accumulate<Float16>(acc16, rewrite_sentinel(next));
    host[3] = round_output<Float16>(acc16);
    const uint32_t extra[2] = {v.word[3], next.word[0]};
    host[4] =
        sequenced_signature(make_signature(v.word[0], v.word[1], v.word[2], extra, 2), next.word[1])
            .header;
    float acc32[4];
    accumulate_first<float>(acc32, rewrite_sentinel(v));
    accumulate<float>(acc32, rewrite_sentinel(next));
    host[5] = round_output<float>(acc32);

    const Vec16* device = out.data + i * kVectorResults;
    // The rewrite and the signature are integer code: every bit. Lanes of arithmetic: every bit
    // but NaN payloads.
    const int kinds[kVectorResults] = {-1, 1, 1, 2, -1, 0};
    for (int r = 0; r < kVectorResults; ++r) {
      const bool same = kinds[r] < 0 ? same_signature(device[r], host[r])
                                     : same_lanes(device[r], host[r], kinds[r]);
      if (!same) {
        ++failures;
        ADD_FAILURE() << "vector " << i << " (" << hex(v) << ", next " << hex(next) << ") result "
                      << r << ": device " << hex(device[r]) << ", host " << hex(host[r]);
      }
    }
    EXPECT_EQ(arrived[size_t(i)], has_arrived(v) ? 1u : 0u) << "vector " << i << " " << hex(v);
    sentinel_vectors += has_arrived(v) ? 0 : 1;
    EXPECT_TRUE(has_arrived(device[0])) << "a rewritten vector still holds the sentinel";
  }
  EXPECT_EQ(failures, 0);
  EXPECT_GT(sentinel_vectors, 1000);  // the inputs did exercise the rewrite
}

// ---------------------------------------------------------------------------------------------
// The toy 2-rank exchange.

// Two ranks' workspaces, control blocks and error records in USM shared memory, laid out as
// lamport.h says, and each rank's Exchange (session.h).
struct ToyTeam {
  static constexpr int kWorld = 2;
  sycl::queue queue;
  int64_t vectors;
  size_t packet_bytes;
  char* workspace[kWorld] = {};
  ControlBlock* control = nullptr;
  ErrorRecord* errors = nullptr;
  Exchange* exchanges = nullptr;
  uint32_t* status = nullptr;

  ToyTeam(sycl::queue& q, int64_t vector_count)
      : queue(q), vectors(vector_count), packet_bytes(size_t(vector_count) * 16) {
    for (int r = 0; r < kWorld; ++r) {
      workspace[r] = sycl::malloc_shared<char>(allocation_bytes(kWorld, packet_bytes), queue);
      auto* words = reinterpret_cast<uint32_t*>(workspace[r]);
      for (size_t w = 0; w < workspace_bytes(kWorld, packet_bytes) / 4; ++w) words[w] = kSentinel;
    }
    control = sycl::malloc_shared<ControlBlock>(kWorld, queue);
    errors = sycl::malloc_shared<ErrorRecord>(kWorld, queue);
    exchanges = sycl::malloc_shared<Exchange>(kWorld, queue);
    status = sycl::malloc_shared<uint32_t>(kWorld, queue);
    std::memset(control, 0, sizeof(ControlBlock) * kWorld);
    std::memset(errors, 0, sizeof(ErrorRecord) * kWorld);
    std::memset(status, 0, sizeof(uint32_t) * kWorld);
    for (int r = 0; r < kWorld; ++r) {
      Exchange x{};
      for (int p = 0; p < kWorld; ++p) x.workspace[p] = workspace[p];
      x.control = &control[r];
      x.errors = &errors[r];
      x.rank = r;
      x.world_size = kWorld;
      x.packet_bytes = packet_bytes;
      x.header_area = header_offset(0, 0, kWorld, packet_bytes);
      x.timeout_ns = 0;
      exchanges[r] = x;
    }
  }
  ~ToyTeam() {
    for (char* w : workspace) sycl::free(w, queue);
    sycl::free(control, queue);
    sycl::free(errors, queue);
    sycl::free(exchanges, queue);
    sycl::free(status, queue);
  }
};

// bf16 inputs [call][rank][vector] whose scale alternates from call to call (2^8, 2^-8: a slot
// read one call late would hold sums of the wrong size), with the adversarial words mixed in.
std::vector<Vec16> exchange_inputs(int calls, int64_t vectors, uint32_t seed) {
  std::vector<Vec16> inputs = adversarial_vectors(size_t(calls) * 2 * size_t(vectors), seed);
  std::mt19937 random(seed + 1);
  std::normal_distribution<float> normal;
  for (int c = 0; c < calls; ++c) {
    const float scale = c % 2 == 0 ? 256.0f : 1.0f / 256.0f;
    for (int64_t i = 0; i < 2 * vectors; ++i) {
      Vec16& packet = inputs[size_t(c * 2 * vectors + i)];
      const int64_t v = i % vectors;
      if (v < int64_t(kSpecialCount * kSpecialCount)) {
        // Every pair of special words meets in the two ranks' packets (rank 0's word a, rank
        // 1's word b, at every word position): where a sentinel's rewrite changes a zero's sign.
        const size_t a = size_t(v) / kSpecialCount;
        const size_t b = size_t(v) % kSpecialCount;
        for (int w = 0; w < 4; ++w) {
          packet.word[w] = kSpecialWords[((i < vectors ? a : b) + size_t(w)) % kSpecialCount];
        }
        continue;
      }
      if (i % 7 == 3) continue;  // keep some random adversarial vectors as they are
      float lanes[8];
      for (float& lane : lanes) lane = normal(random) * scale;
      packet = pack<BFloat16>(lanes);
    }
  }
  return inputs;
}

// Runs `calls` calls of both ranks: one launch of two work-groups, or one launch per rank from
// two queues. Returns the outputs [call][rank][vector].
std::vector<Vec16> run_exchange(ToyTeam& team, sycl::queue* rank_queues, bool two_queues,
                                const std::vector<Vec16>& inputs, int calls, uint64_t max_polls,
                                int ranks_launched = ToyTeam::kWorld) {
  const sb::Build build = sb::kernel_compiler().build(team.queue, smoke_source());
  sycl::kernel kernel = build.kernel("tpf_smoke_exchange");
  Shared<Vec16> in(team.queue, inputs.size());
  Shared<Vec16> out(team.queue, inputs.size());
  std::memcpy(in.data, inputs.data(), inputs.size() * sizeof(Vec16));
  for (size_t i = 0; i < inputs.size(); ++i) out[i] = Vec16{{1, 2, 3, 4}};
  constexpr size_t kLocal = 64;
  auto launch = [&](sycl::queue& q, int rank_base, size_t groups) {
    return q.submit([&](sycl::handler& h) {
      h.set_args(static_cast<const Exchange*>(team.exchanges), rank_base,
                 static_cast<const Vec16*>(in.data), out.data, team.status, calls, team.vectors,
                 max_polls);
      h.parallel_for(sycl::nd_range<1>{groups * kLocal, kLocal}, kernel);
    });
  };
  if (two_queues) {
    std::vector<sycl::event> events;
    for (int r = 0; r < ranks_launched; ++r) events.push_back(launch(rank_queues[r], r, 1));
    for (sycl::event& e : events) e.wait();
  } else {
    launch(team.queue, 0, size_t(ranks_launched)).wait();
  }
  return std::vector<Vec16>(out.data, out.data + inputs.size());
}

// The host's sum of one call: rank order, fp32, one rounding to bf16 (epilogue.h).
Vec16 host_sum(const std::vector<Vec16>& inputs, int call, int64_t vectors, int64_t v) {
  float acc[8];
  for (int sender = 0; sender < ToyTeam::kWorld; ++sender) {
    const Vec16 packet =
        rewrite_sentinel(inputs[size_t((int64_t(call) * ToyTeam::kWorld + sender) * vectors + v)]);
    if (sender == 0) {
      accumulate_first<BFloat16>(acc, packet);
    } else {
      accumulate<BFloat16>(acc, packet);
    }
  }
  return round_output<BFloat16>(acc);
}

// Checks that both ranks' outputs of every call are the host's sum, bit for bit (the same code
// in the same order: NaN payloads included), and so the same on both ranks.
void expect_host_sums(const std::vector<Vec16>& inputs, const std::vector<Vec16>& outputs,
                      int calls, int64_t vectors) {
  int failures = 0;
  for (int c = 0; c < calls; ++c) {
    for (int64_t v = 0; v < vectors; ++v) {
      const Vec16 expected = host_sum(inputs, c, vectors, v);
      for (int r = 0; r < ToyTeam::kWorld; ++r) {
        const Vec16& got = outputs[size_t((int64_t(c) * ToyTeam::kWorld + r) * vectors + v)];
        if (!same_signature(got, expected) && failures++ < 5) {
          ADD_FAILURE() << "call " << c << " rank " << r << " vector " << v << ": device "
                        << hex(got) << ", host " << hex(expected);
        }
      }
    }
  }
  EXPECT_EQ(failures, 0);
}

// About 10 s of polling on this machine's CPU device before a poll gives up (one look of a
// work-group's vectorized lanes took about 0.7 us: AMissingPeerIsATimeoutNotAHang gives up after
// 2^20 in about 0.75 s): far above a peer's delay on a loaded machine, far below ctest's timeout.
constexpr uint64_t kMaxPolls = uint64_t(1) << 24;

void check_two_rank_exchange(bool two_queues) {
  TPF_REQUIRE_CPU_DEVICE(queue);
  const auto units = queue.get_device().get_info<sycl::info::device::max_compute_units>();
  if (units < 2) {
    GTEST_SKIP() << "the device has " << units
                 << " compute unit(s): 2 spinning ranks need 2 (docs/sycl.md)";
  }
  const int64_t vectors = 1024;  // 16 KiB a packet
  ToyTeam team(queue, vectors);
  sycl::queue rank_queues[2] = {sycl::queue(queue.get_context(), queue.get_device()),
                                sycl::queue(queue.get_context(), queue.get_device())};
  // Two launches, 4 calls then 3: the second goes on from the slot and call number the first left
  // in device memory (no host state changes per call).
  int done = 0;
  for (int calls : {4, 3}) {
    const std::vector<Vec16> inputs = exchange_inputs(calls, vectors, 7 + uint32_t(done));
    const std::vector<Vec16> outputs =
        run_exchange(team, rank_queues, two_queues, inputs, calls, kMaxPolls);
    ASSERT_EQ(team.status[0], 0u) << "rank 0 timed out in call " << team.status[0] - 1;
    ASSERT_EQ(team.status[1], 0u) << "rank 1 timed out in call " << team.status[1] - 1;
    expect_host_sums(inputs, outputs, calls, vectors);
    done += calls;
    for (int r = 0; r < ToyTeam::kWorld; ++r) {
      EXPECT_EQ(team.control[r].sequence, uint32_t(done)) << "rank " << r;
      EXPECT_EQ(team.control[r].slot, uint32_t(done % kSlots)) << "rank " << r;
      EXPECT_EQ(team.control[r].arrivals, 0u) << "rank " << r;
      EXPECT_EQ(team.errors[r].failure, 0u) << "rank " << r;
    }
  }
  // Every slot but the last call's was re-filled with the sentinel in its peer's region.
  for (int r = 0; r < ToyTeam::kWorld; ++r) {
    const int peer = 1 - r;
    const uint32_t last = uint32_t((done - 1) % kSlots);
    const uint32_t cleared = slot_to_clear(last);
    const auto* region = reinterpret_cast<const Vec16*>(
        team.workspace[r] + packet_offset(cleared, peer, ToyTeam::kWorld, team.packet_bytes));
    for (int64_t v = 0; v < vectors; ++v) {
      ASSERT_FALSE(has_arrived(region[v]))
          << "rank " << r << " slot " << cleared << " vector " << v;
    }
  }
}

TEST(SyclExchange, TwoRanksOneLaunchGiveTheHostsSums) {
  check_two_rank_exchange(false);
}

TEST(SyclExchange, TwoRanksTwoQueuesGiveTheHostsSums) {
  check_two_rank_exchange(true);
}

// Rank 0 alone: its poll runs out of polls, it records a timeout naming rank 1 and marks the
// team failed in both workspaces, its outputs are NaN, and the kernel ends.
TEST(SyclExchange, AMissingPeerIsATimeoutNotAHang) {
  TPF_REQUIRE_CPU_DEVICE(queue);
  const int64_t vectors = 64;
  ToyTeam team(queue, vectors);
  const std::vector<Vec16> inputs = exchange_inputs(1, vectors, 99);
  const auto start = std::chrono::steady_clock::now();
  const std::vector<Vec16> outputs =
      run_exchange(team, nullptr, false, inputs, 1, uint64_t(1) << 20, /*ranks_launched=*/1);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(team.status[0], 1u);
  EXPECT_EQ(team.errors[0].failure, uint32_t(CallError::kTimeout));
  EXPECT_EQ(team.errors[0].failure_peer, 1u);
  EXPECT_EQ(team.control[0].error, 2u);  // 1 + the rank it names
  for (int r = 0; r < ToyTeam::kWorld; ++r) {
    const FailureMark mark{*reinterpret_cast<const Vec16*>(team.exchanges[0].mark_of(r))};
    EXPECT_TRUE(has_arrived(mark.word)) << "rank " << r << "'s mark";
    EXPECT_EQ(mark.kind(), CallError::kTimeout);
    EXPECT_EQ(mark.marking_rank(), 0);
    EXPECT_EQ(mark.named_rank(), 1);
  }
  for (int64_t v = 0; v < vectors; ++v) {
    float lanes[8];
    unpack<BFloat16>(outputs[size_t(v)], lanes);
    for (float lane : lanes) ASSERT_TRUE(std::isnan(lane)) << "vector " << v;
  }
  std::cout << "[ figures ] a missing peer: timed out after " << seconds << " s\n";
}

// The child mode of the binary (NewProcessLoadsFromTheDiskCache): build the smoke kernels through
// the process's compiler and report where they came from and how long that took.
int run_as_child(const char* report) {
  std::string why;
  auto& queue = cpu_queue(why);
  if (!queue) {
    std::cerr << why << "\n";
    return 2;
  }
  try {
    const double cpu_start = process_cpu_seconds();
    const sb::Build build = sb::kernel_compiler().build(*queue, smoke_source());
    std::ofstream(report) << sb::to_string(build.origin) << " " << build.seconds << " "
                          << process_cpu_seconds() - cpu_start << "\n";
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 3;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (const char* report = std::getenv("TPFUSE_SYCL_TEST_CHILD")) return run_as_child(report);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
