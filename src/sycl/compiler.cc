#include "sycl/compiler.h"

#include <sycl/ext/oneapi/experimental/syclbin_kernel_bundle.hpp>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <system_error>

#include "core/error.h"
#include "sycl/embedded.h"

namespace tpfuse::sycl_backend {
namespace syclex = ::sycl::ext::oneapi::experimental;

namespace {

// The embedded headers live under this directory of the kernel compiler's in-memory file
// system, which is put on the include path: an absolute path, so that a tpfuse/ folder in the
// process's working directory cannot stand in for them.
constexpr const char* kHeaderRoot = "/tpfuse-embedded";

// A disk cache file: this line, the key's size and text, the bundle's size and bytes.
constexpr const char kFileMagic[] = "tpfuse SYCL kernel cache 1\n";

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// FNV-1a, 64 bits: the cache file's name. A collision only costs a recompile (the file holds its
// whole key).
uint64_t fnv1a(const std::string& text) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return h;
}

void append_field(std::string& key, const char* name, const std::string& value) {
  key += name;
  key += ' ';
  key += std::to_string(value.size());
  key += '\n';
  key += value;
  key += '\n';
}

const char* backend_name(::sycl::backend backend) {
  switch (backend) {
    case ::sycl::backend::opencl:
      return "opencl";
    case ::sycl::backend::ext_oneapi_level_zero:
      return "level_zero";
    case ::sycl::backend::ext_oneapi_cuda:
      return "cuda";
    case ::sycl::backend::ext_oneapi_hip:
      return "hip";
    default:
      return "other";
  }
}

std::string read_file(const std::filesystem::path& path, bool& ok) {
  std::ifstream in(path, std::ios::binary);
  ok = bool(in);
  if (!ok) return {};
  std::ostringstream out;
  out << in.rdbuf();
  ok = bool(in) || in.eof();
  return out.str();
}

bool read_u64(const std::string& data, size_t& at, uint64_t& value) {
  if (at > data.size() || data.size() - at < 8) return false;
  std::memcpy(&value, data.data() + at, 8);
  at += 8;
  return true;
}

void append_u64(std::string& data, uint64_t value) {
  char bytes[8];
  std::memcpy(bytes, &value, 8);
  data.append(bytes, 8);
}

// The bundle bytes of a cache file whose key is `key`; empty when the file is absent, is not a
// cache file, or holds another key (`note` says which, except for an absent file).
std::string read_cache_file(const std::filesystem::path& path, const std::string& key,
                            std::string& note) {
  std::error_code error;
  if (!std::filesystem::exists(path, error)) return {};
  bool ok = false;
  const std::string data = read_file(path, ok);
  if (!ok) {
    note = "could not read " + path.string();
    return {};
  }
  const size_t magic = sizeof(kFileMagic) - 1;
  size_t at = magic;
  uint64_t key_size = 0;
  uint64_t bundle_size = 0;
  if (data.compare(0, magic, kFileMagic) != 0 || !read_u64(data, at, key_size) ||
      data.size() - at < key_size) {
    note = path.string() + " is not a tpfuse SYCL cache file";
    return {};
  }
  if (data.compare(at, key_size, key) != 0) {
    note = path.string() + " holds another key (a name collision): recompiled";
    return {};
  }
  at += key_size;
  if (!read_u64(data, at, bundle_size) || data.size() - at != bundle_size) {
    note = path.string() + " is truncated";
    return {};
  }
  return data.substr(at);
}

// Writes the cache file through a temporary file in the same directory and a rename, so that a
// reader (another process) never sees half a file. Returns an empty string, or what went wrong.
std::string write_cache_file(const std::filesystem::path& path, const std::string& key,
                             const std::vector<char>& bundle) {
  std::error_code error;
  std::filesystem::create_directories(path.parent_path(), error);
  if (error) return "could not create " + path.parent_path().string() + ": " + error.message();
  static std::atomic<uint64_t> counter{0};
  const std::filesystem::path temporary =
      path.string() + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    if (!out) return "could not write " + temporary.string() + ": " + std::strerror(errno);
    std::string head(kFileMagic);
    append_u64(head, key.size());
    head += key;
    append_u64(head, bundle.size());
    out.write(head.data(), std::streamsize(head.size()));
    out.write(bundle.data(), std::streamsize(bundle.size()));
    out.close();
    if (!out) {
      std::filesystem::remove(temporary, error);
      return "could not write " + temporary.string();
    }
  }
  std::filesystem::rename(temporary, path, error);
  if (error) {
    std::filesystem::remove(temporary, error);
    return "could not rename into " + path.string() + ": " + error.message();
  }
  return {};
}

std::vector<std::string> all_options(const KernelSource& source) {
  std::vector<std::string> options = default_build_options();
  options.push_back(std::string("-I") + kHeaderRoot);
  options.insert(options.end(), source.options.begin(), source.options.end());
  return options;
}

}  // namespace

const char* to_string(BuildOrigin origin) {
  switch (origin) {
    case BuildOrigin::kMemory:
      return "memory";
    case BuildOrigin::kDisk:
      return "disk";
    case BuildOrigin::kCompiled:
      return "compiled";
  }
  return "?";
}

std::vector<std::string> default_build_options() {
  return {"-ffp-contract=off"};
}

bool can_compile_sycl(const ::sycl::device& device) {
  ::sycl::device handle = device;  // a handle: the query is not const
  return handle.ext_oneapi_can_compile(syclex::source_language::sycl);
}

std::string describe_device(const ::sycl::device& device) {
  const ::sycl::platform platform = device.get_platform();
  std::ostringstream out;
  out << device.get_info<::sycl::info::device::name>() << " ("
      << device.get_info<::sycl::info::device::vendor>() << ", "
      << backend_name(device.get_backend()) << ", driver "
      << device.get_info<::sycl::info::device::driver_version>() << ") on "
      << platform.get_info<::sycl::info::platform::name>() << " "
      << platform.get_info<::sycl::info::platform::version>();
  return out.str();
}

std::string cache_key(const ::sycl::device& device, const KernelSource& source) {
  std::string key;
  append_field(key, "device", describe_device(device));
  append_field(key, "runtime",
               std::to_string(__LIBSYCL_MAJOR_VERSION) + "." +
                   std::to_string(__LIBSYCL_MINOR_VERSION) + "." +
                   std::to_string(__LIBSYCL_PATCH_VERSION) + " " +
                   std::to_string(__SYCL_COMPILER_VERSION));
  for (const std::string& option : all_options(source)) append_field(key, "option", option);
  append_field(key, "source", source.text);
  for (const auto& [name, text] : source.headers) {
    append_field(key, "header", name);
    append_field(key, "text", text);
  }
  for (const EmbeddedText& header : library_headers()) {
    append_field(key, "library header", header.name);
    append_field(key, "text", std::string(header.text, header.size));
  }
  return key;
}

CompilerSettings CompilerSettings::from_environment() {
  CompilerSettings settings;
  if (const char* dir = std::getenv("TPFUSE_SYCL_CACHE_DIR")) {
    const std::string value(dir);
    if (!value.empty() && value != "off") settings.cache_dir = value;
    return settings;
  }
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0') {
    settings.cache_dir = std::filesystem::path(xdg) / "tpfuse" / "sycl";
  } else if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    settings.cache_dir = std::filesystem::path(home) / ".cache" / "tpfuse" / "sycl";
  }
  return settings;
}

sycl::kernel Build::kernel(const std::string& name) const {
  // A handle: the runtime's look-ups are not const.
  auto handle = bundle;
  if (!handle.ext_oneapi_has_kernel(name)) {
    TPF_FAIL("SYCL kernel compiler: no kernel '"
             << name << "' in this build (kernels are found by their extern \"C\" names)");
  }
  return handle.ext_oneapi_get_kernel(name);
}

struct KernelCompiler::Entry {
  std::string key;
  ::sycl::context context;
  ::sycl::device device;
  ::sycl::kernel_bundle<::sycl::bundle_state::executable> bundle;
};

KernelCompiler::KernelCompiler(CompilerSettings settings) : settings_(std::move(settings)) {}
KernelCompiler::~KernelCompiler() = default;

CompilerStats KernelCompiler::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void KernelCompiler::forget() {
  std::lock_guard<std::mutex> lock(mutex_);
  entries_.clear();
}

Build KernelCompiler::build(const ::sycl::context& context, const ::sycl::device& device,
                            const KernelSource& source) {
  const auto start = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mutex_);
  const std::string key = cache_key(device, source);
  for (const auto& entry : entries_) {
    if (entry->key == key && entry->context == context && entry->device == device) {
      ++stats_.memory_hits;
      return Build{entry->bundle, BuildOrigin::kMemory, seconds_since(start), {}, {}, {}};
    }
  }
  if (!can_compile_sycl(device)) {
    TPF_FAIL("SYCL kernel compiler: " << describe_device(device)
                                      << " cannot compile SYCL source (ext_oneapi_can_compile "
                                         "is false: no libsycl-jit, or a device it does not "
                                         "target), so '"
                                      << source.label << "' cannot be built for it");
  }

  std::string disk_note;
  std::filesystem::path file;
  if (!settings_.cache_dir.empty()) {
    char name[32];
    std::snprintf(name, sizeof(name), "%016llx.bin", static_cast<unsigned long long>(fnv1a(key)));
    file = settings_.cache_dir / name;
    std::string bytes = read_cache_file(file, key, disk_note);
    if (!bytes.empty()) {
      try {
        auto bundle = syclex::get_kernel_bundle<::sycl::bundle_state::executable>(
            context, {device}, ::sycl::span<char>(bytes.data(), bytes.size()));
        const double seconds = seconds_since(start);
        ++stats_.disk_hits;
        stats_.disk_seconds += seconds;
        entries_.push_back(std::make_unique<Entry>(Entry{key, context, device, bundle}));
        return Build{bundle, BuildOrigin::kDisk, seconds, {}, {}, file.string()};
      } catch (const ::sycl::exception& e) {
        ++stats_.disk_errors;
        disk_note = file.string() + " did not load (" + e.what() + "): recompiled";
      }
    }
  } else {
    disk_note = "no disk cache (TPFUSE_SYCL_CACHE_DIR is off, and no HOME)";
  }

  std::string log;
  std::optional<::sycl::kernel_bundle<::sycl::bundle_state::executable>> bundle;
  try {
    syclex::include_files includes;
    for (const auto& [name, text] : source.headers) {
      includes.add(std::string(kHeaderRoot) + "/" + name, text);
    }
    for (const EmbeddedText& header : library_headers()) {
      bool shadowed = false;
      for (const auto& own : source.headers) shadowed = shadowed || own.first == header.name;
      if (!shadowed) {
        includes.add(std::string(kHeaderRoot) + "/" + header.name,
                     std::string(header.text, header.size));
      }
    }
    auto source_bundle = syclex::create_kernel_bundle_from_source(
        context, syclex::source_language::sycl, source.text, syclex::properties{includes});
    bundle = syclex::build(
        source_bundle, {device},
        syclex::properties{syclex::build_options{all_options(source)}, syclex::save_log{&log}});
  } catch (const ::sycl::exception& e) {
    // errc::build: the what() string is the compiler's whole log. (errc::invalid: a header named
    // twice in the source's own headers.)
    TPF_FAIL("SYCL kernel compiler: '" << source.label << "' did not compile for "
                                       << describe_device(device) << " (" << e.code().message()
                                       << "):\n"
                                       << e.what());
  }
  const double seconds = seconds_since(start);
  ++stats_.compiles;
  stats_.compile_seconds += seconds;

  if (!file.empty()) {
    try {
      const std::vector<char> bytes = bundle->ext_oneapi_get_content();
      const std::string error = write_cache_file(file, key, bytes);
      if (!error.empty()) {
        ++stats_.disk_errors;
        disk_note = error;
      }
    } catch (const ::sycl::exception& e) {
      ++stats_.disk_errors;
      disk_note = std::string("the runtime could not serialize the bundle: ") + e.what();
    }
  }
  entries_.push_back(std::make_unique<Entry>(Entry{key, context, device, *bundle}));
  return Build{*bundle, BuildOrigin::kCompiled, seconds, log, disk_note, file.string()};
}

KernelCompiler& kernel_compiler() {
  // Never destroyed: a bundle the kernel compiler built, released by a static destructor, crashes
  // the process's exit (2026.2: libsycl-jit's own statics are gone by then; its destroyBinary
  // then reads a freed map). The runtime's shutdown releases what the compiler holds.
  static KernelCompiler* compiler = new KernelCompiler();
  return *compiler;
}

}  // namespace tpfuse::sycl_backend
