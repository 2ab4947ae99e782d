// The run-time kernel compiler of the SYCL backend: device code compiled from source when a
// program runs, by the SYCL runtime's kernel compiler (sycl_ext_oneapi_kernel_compiler,
// source_language::sycl, in libsycl-jit), from tpfuse's own headers embedded in the library at
// build time (src/sycl/embedded.h). No SYCL compiler is needed to build tpfuse, and the kernels
// are the library's headers, not a copy of them.
//
// A build is cached twice:
//  * in memory, per context and device, for the life of the KernelCompiler;
//  * on disk (CompilerSettings::cache_dir): the executable bundle as the runtime serializes it
//    (SYCLBIN, kernel_bundle::ext_oneapi_get_content), in one file per key. A new process loads
//    it in about a millisecond, where compiling takes seconds (docs/sycl.md has the figures).
// The key is everything the result depends on: the source, every header's name and text, the
// build options, the device (name, vendor, backend, driver version, platform) and the runtime's
// version. A cache file holds its whole key and is used only if that matches exactly, so a hash
// collision is a miss, never a wrong kernel; a file that does not load is a miss too, rewritten.
// (The runtime has a persistent cache of its own, SYCL_CACHE_PERSISTENT=1: it keeps the
// compiler's front-end output, keyed by the preprocessed source, and still preprocesses, links
// and translates in every process: about 0.3 s where this cache takes 1 ms. It is independent of
// this one and may be on too.)
//
// Kernels are free functions declared extern "C" (SYCL_EXT_ONEAPI_FUNCTION_PROPERTY): a kernel
// is found by its name. A template is instantiated inside such a kernel, never through the
// extension's registered kernel names: the 2026.2 runtime refuses to serialize a bundle built
// with registered names ("ext_oneapi_get_content: free-function kernels are not yet supported"),
// which would leave it out of the disk cache.
//
// Compiling takes seconds: callers build when a team is made or a new combination is first
// asked for, never inside a timed call.
#pragma once

#include <sycl/sycl.hpp>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace tpfuse::sycl_backend {

// One translation unit of device code.
struct KernelSource {
  std::string label;  // what it is, for messages: "smoke kernels"
  std::string text;   // the source; it includes <sycl/sycl.hpp> and tpfuse's headers by name
  // Include files of its own, (include name, text), searched before the library's headers.
  std::vector<std::pair<std::string, std::string>> headers;
  // Build options after default_build_options(): -D..., -O..., any option of the compiler.
  std::vector<std::string> options;
};

enum class BuildOrigin { kMemory, kDisk, kCompiled };
const char* to_string(BuildOrigin origin);

// An executable bundle and where it came from.
struct Build {
  sycl::kernel_bundle<sycl::bundle_state::executable> bundle;
  BuildOrigin origin;
  double seconds;          // what getting it took: compiling, loading from disk, or a look-up
  std::string log;         // the compiler's log (its warnings), when compiled here
  std::string disk_note;   // why the disk cache was not read or written, where it was not
  std::string cache_file;  // the disk cache's file for this key, if there is a disk cache

  // The extern "C" kernel `name`; a tpfuse::Error naming the source if there is none.
  sycl::kernel kernel(const std::string& name) const;
};

struct CompilerSettings {
  // The disk cache's directory; empty: no disk cache. From the environment: TPFUSE_SYCL_CACHE_DIR
  // (empty or "off": none), else $XDG_CACHE_HOME/tpfuse/sycl, else $HOME/.cache/tpfuse/sycl.
  std::filesystem::path cache_dir;
  static CompilerSettings from_environment();
};

struct CompilerStats {
  uint64_t memory_hits = 0;
  uint64_t disk_hits = 0;
  uint64_t compiles = 0;
  uint64_t disk_errors = 0;  // cache files that could not be written, or read but not loaded
  double compile_seconds = 0;
  double disk_seconds = 0;
};

class KernelCompiler {
 public:
  explicit KernelCompiler(CompilerSettings settings = CompilerSettings::from_environment());
  ~KernelCompiler();
  KernelCompiler(const KernelCompiler&) = delete;
  KernelCompiler& operator=(const KernelCompiler&) = delete;

  // The executable bundle of `source` for `device` (of `context`): from memory, from the disk
  // cache, or compiled now and stored in both. A source that does not compile is a
  // tpfuse::Error with the compiler's log; so is a device that cannot compile SYCL source.
  Build build(const sycl::context& context, const sycl::device& device, const KernelSource& source);
  Build build(const sycl::queue& queue, const KernelSource& source) {
    return build(queue.get_context(), queue.get_device(), source);
  }

  CompilerStats stats() const;
  const CompilerSettings& settings() const { return settings_; }
  // Drops the in-memory cache (the disk cache stays).
  void forget();

 private:
  struct Entry;
  CompilerSettings settings_;
  mutable std::mutex mutex_;  // held for a whole build: compiles are serialized
  std::vector<std::unique_ptr<Entry>> entries_;
  CompilerStats stats_;
};

// The process's compiler, its settings from the environment when first used; never destroyed.
// WARNING: a KernelCompiler, or a handle to a bundle it built, in static storage must not be
// destroyed at exit: with the 2026.2 runtime, releasing a JIT-compiled bundle after main returns
// crashes in libsycl-jit (whose statics are destroyed first). Destroy them before main returns,
// or never (as this one).
KernelCompiler& kernel_compiler();

// What every source is compiled with before its own options. -ffp-contract=off: no a * b + c
// becomes a fused multiply-add (the kernel compiler's default is on), so device arithmetic is
// the arithmetic the headers spell, as on the host (CMakeLists.txt builds the host so).
std::vector<std::string> default_build_options();

// Whether `device` can compile SYCL source (ext_oneapi_can_compile).
bool can_compile_sycl(const sycl::device& device);

// The device as a message names it, and as the cache key holds it: name, vendor, backend,
// driver version, platform.
std::string describe_device(const sycl::device& device);

// The cache key of `source` for `device`: everything a build depends on, as one text (what a
// disk cache file holds and must match).
std::string cache_key(const sycl::device& device, const KernelSource& source);

}  // namespace tpfuse::sycl_backend
