// SYCL teams of one rank per process: create_sycl_team(id, rank, world_size, device). The calls
// are the in-process SYCL team's (src/sycl/backend.cc, the same kernels); only where a rank's
// workspace lives, and how its peers reach it, differ:
//
// - On a CPU device (Intel's OpenCL CPU device: its kernels run on threads of the process that
//   queued them, and it has USM system allocations, so a kernel dereferences any pointer of that
//   process's address space) each rank's workspace is a memfd the rank makes and maps. A peer
//   opens it through /proc/<pid>/fd/<fd> (the rank's process and descriptor, from its record)
//   and maps it at an address of its own; the kernels take those addresses in their parameters.
//   The protocol's words are 32-bit atomics on one physical page, which order across processes
//   as across threads. The memory has no name in any filesystem and goes with the last process
//   that maps it.
// - On a GPU (written for Intel GPUs and compiled; no Intel GPU has run it) each rank's workspace
//   is device memory exported with the runtime's inter-process memory extension
//   (sycl_ext_oneapi_ipc_memory: ipc::memory::get), whose handle's bytes travel in the rank's
//   record; each peer opens it (ipc::memory::open) on its own device.
//
// A rank's control block and error record are touched by its own kernels and host only (a
// peer's failure mark goes into the rank's workspace), so they are USM of the rank's own device
// and host, as in the in-process team.
//
// Creation. Each rank first does its own setup: the kernels (compiled, or from the caches), the
// queue, the control block and error record, the workspace (filled with the sentinel) and its
// export, the waits' bound. Then a CPU-backend team of the same id (create_cpu_team(id, ...): its
// join names a rank that never comes, and a rank given another world size) carries every exchange
// of creation, as in create_cuda_team(id, ...) (src/cuda/team/ipc_team.cu): an all-gather of each
// rank's Record, as an fp32 all-reduce of its bytes (one nonzero term a sum: exact).
//   1. the records: every rank's setup, options, device and workspace handle. Every rank checks
//      the same records alike, so every rank throws the same error: the first rank whose setup
//      failed, the first option that differs from rank 0's (naming it), devices of two kinds, or
//      more ranks on a device than it has compute units (the ranks of every process counted).
//      The round is also the barrier after which every workspace holds the sentinel.
//   2. each rank maps (or opens) its peers' workspaces; the round tells every rank that every
//      peer has, after which a rank closes its own descriptor (the mappings keep the memory).
//   3. the handshake: the team's first call (handshake below) proves that stores arrive.
// A rank's own failure in a step travels in its next record, so its peers throw naming it at
// once instead of timing out in the next exchange.
#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/error.h"
#include "core/team_state.h"
#include "sycl/compiler.h"
#include "sycl/state.h"
#include "sycl/team.h"
#include "tpfuse/impl/lamport.h"
#include "tpfuse/sycl.h"

namespace tpfuse {
namespace impl {
namespace {

namespace ipc = sycl::ext::oneapi::experimental::ipc;

constexpr const char* kOp = "create_sycl_team";

// How a rank's peers reach its workspace.
enum class MemoryKind : uint32_t {
  kSharedMemory = 1,  // a CPU device: a memfd, opened through /proc/<pid>/fd/<fd>
  kIpc = 2,           // a GPU: device memory and its IPC handle
};

const char* memory_kind_name(uint32_t kind) {
  return kind == uint32_t(MemoryKind::kSharedMemory) ? "a CPU device (shared memory)"
                                                     : "a GPU (IPC memory)";
}

// What a rank tells its peers in one exchange of creation (unused fields zero).
struct Record {
  uint32_t failed;  // 1: this rank's own step failed; `message` says why
  int32_t pid;
  uint64_t packet_bytes;
  uint32_t peer_stores;
  uint32_t peer_memory;
  uint32_t memory_kind;    // MemoryKind
  uint32_t compute_units;  // of the rank's device
  int32_t workspace_fd;    // kSharedMemory: the memfd, a descriptor of process `pid`
  uint32_t handle_bytes;   // kIpc: bytes of `handle`
  char device_key[48];     // ranks of one key share a device (device_key below)
  char device_name[64];
  unsigned char handle[128];  // kIpc: the workspace's IPC handle
  // A CPU device: the CPUs this rank's process may run on (sched_getaffinity), bit c % 64 of
  // word c / 64; all zero where it is not known.
  uint64_t cpus[16];
  char message[360];
};
static_assert(sizeof(Record) == 768, "Record is all-gathered as 768 floats");

// The bootstrap team's packet: one exchange of the largest team, as floats.
constexpr size_t kBootstrapPacketBytes = sizeof(Record) * 4 * kMaxWorldSize;

void set_text(char* field, size_t size, const std::string& text) {
  std::snprintf(field, size, "%s", text.c_str());
}

// Ranks of one key spin on one device's compute units. Every CPU device of a host runs its
// kernels on the host's cores, whichever process queued them: one key. A GPU is its UUID where
// the runtime tells it (else its PCI address, else its name).
std::string device_key(const sycl::device& device) {
  if (device.is_cpu()) return "cpu";
  if (device.has(sycl::aspect::ext_intel_device_info_uuid)) {
    const auto uuid = device.get_info<sycl::ext::intel::info::device::uuid>();
    std::string key = "uuid:";
    char hex[3];
    for (unsigned char byte : uuid) {
      std::snprintf(hex, sizeof(hex), "%02x", byte);
      key += hex;
    }
    return key;
  }
  if (device.has(sycl::aspect::ext_intel_pci_address)) {
    return "pci:" + device.get_info<sycl::ext::intel::info::device::pci_address>();
  }
  return "name:" + sycl_device_name(device);
}

// This rank's resources, and its mappings of the peers' workspaces. Its kernels have ended
// (~SyclTeamState waits for them) before this goes.
struct ProcessTeamMemory : TeamMemory {
  explicit ProcessTeamMemory(const sycl::context& c) : context(c) {}
  ~ProcessTeamMemory() override {
    for (void* mapping : peer_mappings) ::munmap(mapping, bytes);
    for (void* opened : peer_opened) {
      try {
        ipc::memory::close(opened, context);
      } catch (...) {
      }
    }
    try {
      if (exported) ipc::memory::put(*exported, context);
    } catch (...) {
    }
    if (device_workspace != nullptr) sycl::free(device_workspace, context);
    if (mapping != nullptr) ::munmap(mapping, bytes);
    if (fd >= 0) ::close(fd);
    if (control != nullptr) sycl::free(control, context);
    if (errors != nullptr) sycl::free(errors, context);
  }

  sycl::context context;
  size_t bytes = 0;  // of one rank's workspace (allocation_bytes)
  void* control = nullptr;
  void* errors = nullptr;
  // kSharedMemory: this rank's memfd (until every peer has mapped it) and mapping; the peers'.
  int fd = -1;
  void* mapping = nullptr;
  std::vector<void*> peer_mappings;
  // kIpc: this rank's device memory and its handle; the peers', opened.
  void* device_workspace = nullptr;
  std::optional<ipc::handle> exported;
  std::vector<void*> peer_opened;
  Team bootstrap;  // kept for peer_status: whether a missing peer's process has exited
};

std::string errno_text() {
  return std::strerror(errno);
}

// kSharedMemory: this rank's workspace, a memfd of `bytes`, its pages reserved (memory that
// cannot be had fails here, not as a SIGBUS at a later store), mapped and filled with the
// sentinel.
void create_shared_workspace(ProcessTeamMemory& memory, Record& record) {
  memory.fd = ::memfd_create("tpfuse-sycl-workspace", MFD_CLOEXEC);
  if (memory.fd < 0) TPF_FAIL("memfd_create of the workspace failed: " << errno_text());
  const int failure = ::ftruncate(memory.fd, off_t(memory.bytes)) != 0
                          ? errno
                          : ::posix_fallocate(memory.fd, 0, off_t(memory.bytes));
  if (failure != 0) {
    TPF_FAIL("cannot reserve " << memory.bytes << " bytes of shared memory for the workspace ("
                               << std::strerror(failure)
                               << "); lower TeamOptions::packet_bytes or free memory");
  }
  void* base = ::mmap(nullptr, memory.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, memory.fd, 0);
  if (base == MAP_FAILED) TPF_FAIL("mapping the workspace failed: " << errno_text());
  memory.mapping = base;
  auto* words = static_cast<uint32_t*>(base);
  for (size_t i = 0; i < memory.bytes / 4; ++i) words[i] = kSentinel;
  record.workspace_fd = memory.fd;
}

// kSharedMemory: peer `peer`'s workspace, mapped in this process.
void* map_peer_workspace(const ProcessTeamMemory& memory, const Record& peer_record, int peer,
                         const std::string& peer_note) {
  const std::string path = "/proc/" + std::to_string(peer_record.pid) + "/fd/" +
                           std::to_string(peer_record.workspace_fd);
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    TPF_FAIL("cannot open rank " << peer << "'s workspace through " << path << " (" << errno_text()
                                 << ")" << peer_note
                                 << ": the ranks' processes must be of one user (or may read "
                                    "each other's descriptors) and see each other's /proc (one "
                                    "PID namespace)");
  }
  struct stat status {};
  void* base = MAP_FAILED;
  if (::fstat(fd, &status) == 0 && size_t(status.st_size) == memory.bytes) {
    base = ::mmap(nullptr, memory.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  const int error = errno;
  ::close(fd);
  if (base == MAP_FAILED) {
    TPF_FAIL("cannot map rank " << peer << "'s workspace (" << path << ", "
                                << size_t(status.st_size) << " bytes where " << memory.bytes
                                << " were expected): " << std::strerror(error));
  }
  return base;
}

// kIpc: this rank's workspace, device memory filled with the sentinel, and its handle.
void create_ipc_workspace(ProcessTeamMemory& memory, sycl::queue& queue, Record& record) {
  memory.device_workspace = sycl::malloc_device(memory.bytes, queue);
  if (memory.device_workspace == nullptr) {
    TPF_FAIL("out of device memory for the workspace (" << memory.bytes << " bytes)");
  }
  queue.fill(static_cast<uint32_t*>(memory.device_workspace), kSentinel, memory.bytes / 4).wait();
  memory.exported = ipc::memory::get(memory.device_workspace, memory.context);
  const ipc::handle_data_t data = memory.exported->data();
  if (data.size() > sizeof(record.handle)) {
    TPF_FAIL("the runtime's IPC handle has " << data.size() << " bytes, more than the "
                                             << sizeof(record.handle) << " a record carries");
  }
  std::memcpy(record.handle, data.data(), data.size());
  record.handle_bytes = uint32_t(data.size());
}

// kIpc: this rank's device reaches peer `peer`'s (one device, or peer access between the two).
void check_peer_device(const sycl::device& device, const Record& peer_record, int peer) {
  const std::string key = device_key(device);
  if (key == peer_record.device_key) return;
  for (sycl::device other : device.get_platform().get_devices()) {
    if (device_key(other) != peer_record.device_key) continue;
    sycl::device from = device;
    TPF_CHECK_ARG(from.ext_oneapi_can_access_peer(other), kOp,
                  "device '" << sycl_device_name(device) << "' cannot access the memory of rank "
                             << peer << "'s device '" << peer_record.device_name
                             << "' (no peer access)");
    try {
      from.ext_oneapi_enable_peer_access(other);
    } catch (const sycl::exception&) {
      // Already enabled (by an earlier team).
    }
    return;
  }
  TPF_FAIL("rank " << peer << "'s device '" << peer_record.device_name << "' ("
                   << peer_record.device_key << ") is not one of this process's platform");
}

// Runs one step of this rank's own work; a failure goes into `record` (and `own`, in full).
template <typename Step>
void run_step(Record& record, std::string& own, Step&& step) {
  try {
    step();
  } catch (const sycl::exception& error) {
    own = std::string("the SYCL runtime: ") + error.what();
  } catch (const std::exception& error) {
    own = error.what();
  }
  if (!own.empty()) {
    record.failed = 1;
    set_text(record.message, sizeof(record.message), own);
  }
}

// Every rank's record of one exchange, through the bootstrap team (see the top of the file).
std::vector<Record> all_gather(const Team& bootstrap, const Record& mine, const char* what) {
  const int world = bootstrap.world_size(), rank = bootstrap.rank();
  constexpr size_t kBytes = sizeof(Record);
  std::vector<float> in(kBytes * size_t(world), 0.0f), out(in.size());
  const auto* bytes = reinterpret_cast<const unsigned char*>(&mine);
  for (size_t i = 0; i < kBytes; ++i) in[size_t(rank) * kBytes + i] = float(bytes[i]);
  try {
    allreduce(bootstrap, in.data(), out.data(), int64_t(in.size()), DType::kFloat32, Stream{},
              Algorithm::kOneShot);
  } catch (const Error& error) {
    TPF_FAIL(kOp << ": rank " << rank << ": the exchange of " << what
                 << " with the other ranks failed: " << error.what());
  }
  std::vector<Record> all(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    auto* record = reinterpret_cast<unsigned char*>(&all[size_t(r)]);
    for (size_t i = 0; i < kBytes; ++i) record[i] = (unsigned char)(out[size_t(r) * kBytes + i]);
  }
  return all;
}

// Throws on every rank alike if any rank's step failed: the first such rank, with its message
// (this rank's own in full).
void agree(const std::vector<Record>& records, int rank, const std::string& own, const char* step) {
  for (int r = 0; r < int(records.size()); ++r) {
    if (records[size_t(r)].failed == 0) continue;
    if (r == rank) TPF_FAIL(kOp << ": rank " << rank << ": " << step << " failed: " << own);
    TPF_FAIL(kOp << ": rank " << rank << ": rank " << r << "'s " << step
                 << " failed: " << records[size_t(r)].message);
  }
}

// Every rank checks the same records alike: the same error on every rank.
void check_records(const std::vector<Record>& records, int rank) {
  const Record& first = records[0];
  for (int r = 1; r < int(records.size()); ++r) {
    const Record& other = records[size_t(r)];
    std::ostringstream differs;
    if (other.packet_bytes != first.packet_bytes) {
      differs << "options.packet_bytes: " << first.packet_bytes << " on rank 0, "
              << other.packet_bytes << " on rank " << r;
    } else if (other.peer_stores != first.peer_stores) {
      differs << "options.peer_stores: " << (first.peer_stores ? "true" : "false") << " on rank 0, "
              << (other.peer_stores ? "true" : "false") << " on rank " << r;
    } else if (other.peer_memory != first.peer_memory) {
      differs << "options.peer_memory: " << first.peer_memory << " on rank 0, " << other.peer_memory
              << " on rank " << r;
    }
    if (!differs.str().empty()) {
      TPF_FAIL(kOp << ": rank " << rank << ": the ranks were not given the same options, in "
                   << differs.str() << "; every rank must pass the same world_size and options");
    }
  }
  TPF_CHECK_ARG(first.peer_stores != 0, kOp,
                "options.peer_stores must be true: the SYCL backend has no NCCL path to fall back "
                "on");
  for (int r = 1; r < int(records.size()); ++r) {
    const Record& other = records[size_t(r)];
    TPF_CHECK_ARG(other.memory_kind == first.memory_kind, kOp,
                  "rank 0's device '" << first.device_name << "' is "
                                      << memory_kind_name(first.memory_kind) << ", rank " << r
                                      << "'s '" << other.device_name << "' "
                                      << memory_kind_name(other.memory_kind)
                                      << ": every rank's device must be of one kind");
  }
  // The ranks on the host's CPU have as many compute units as the CPUs their processes may run
  // on together (the device's compute units are its process's CPUs): ranks pinned to one core
  // share it, ranks pinned to two cores each do not. (A count, not a matching of ranks to CPUs:
  // it never refuses a team whose ranks can each have a CPU, and may pass one whose masks
  // overlap unevenly.)
  uint64_t cpus[16] = {};
  for (const Record& record : records) {
    for (int w = 0; w < 16; ++w) cpus[w] |= record.cpus[w];
  }
  uint32_t cpu_count = 0;
  for (uint64_t word : cpus) cpu_count += uint32_t(__builtin_popcountll(word));
  std::vector<RankOnDevice> ranks;
  for (int r = 0; r < int(records.size()); ++r) {
    const Record& record = records[size_t(r)];
    const bool on_cpus = std::strcmp(record.device_key, "cpu") == 0 && cpu_count > 0;
    ranks.push_back(
        {r, record.device_key, record.device_name, on_cpus ? cpu_count : record.compute_units});
  }
  refuse_more_ranks_than_compute_units(ranks, kOp, ", counted over the team's processes");
}

// 3. The handshake: a first call of the team's own kernels, an allreduce of each rank's number
// (rank + 1), whose sum every rank checks. It proves that every rank's stores arrive in every
// peer, through the mappings the kernels use; a peer that died since the last exchange is named
// by its timeout. Every rank makes it, so the ranks' calls stay in step.
void handshake(const Team& team, sycl::queue& queue, const char* op) {
  constexpr int64_t kCount = 2 * kHiddenMultiple;
  float* values = sycl::malloc_shared<float>(2 * kCount, queue);
  if (values == nullptr) TPF_FAIL(op << ": out of memory for the handshake");
  std::fill(values, values + kCount, float(team.rank() + 1));
  std::fill(values + kCount, values + 2 * kCount, -1.0f);
  std::string error;
  try {
    allreduce(team, values, values + kCount, kCount, DType::kFloat32, Stream{&queue},
              Algorithm::kOneShot);
    team.check();
  } catch (const Error& e) {
    error = e.what();
  }
  const int world = team.world_size();
  const float expected = float(world * (world + 1) / 2);
  int64_t wrong = 0;
  for (int64_t i = 0; error.empty() && i < kCount; ++i) wrong += values[kCount + i] != expected;
  const float first = values[kCount];
  sycl::free(values, queue);
  if (!error.empty()) {
    TPF_FAIL(op << ": rank " << team.rank()
                << ": the handshake (a first call through the team's kernels) failed: " << error);
  }
  if (wrong != 0) {
    TPF_FAIL(op << ": rank " << team.rank() << ": the handshake's sum is wrong in " << wrong
                << " of " << kCount << " elements (" << first << " where " << expected
                << "): the ranks' stores do not arrive in their peers' workspaces");
  }
}

}  // namespace
}  // namespace impl

Team create_sycl_team(const CpuTeamId& id, int rank, int world_size, const sycl::device& device,
                      const TeamOptions& options) {
  using impl::kOp;
  TPF_CHECK_ARG(world_size >= 1 && world_size <= kMaxWorldSize, kOp,
                "world_size must be in [1, " << kMaxWorldSize << "], got " << world_size);
  TPF_CHECK_ARG(rank >= 0 && rank < world_size, kOp,
                "rank must be in [0, world_size = " << world_size << "), got " << rank);
  impl::validate_team_options(options, kOp);

  // This rank's own setup: its failure is told to the peers in the first exchange.
  const sycl::context context = device.get_platform().khr_get_default_context();
  auto memory = std::make_shared<impl::ProcessTeamMemory>(context);
  memory->bytes = impl::allocation_bytes(world_size, options.packet_bytes);
  impl::Record record{};
  std::string own;
  record.pid = int32_t(::getpid());
  record.packet_bytes = options.packet_bytes;
  record.peer_stores = options.peer_stores ? 1 : 0;
  record.peer_memory = uint32_t(options.peer_memory);
  record.workspace_fd = -1;
  std::optional<sycl::queue> queue;
  const impl::SyclKernels* kernels = nullptr;
  uint64_t bound = 0;
  impl::set_text(record.device_name, sizeof(record.device_name), impl::sycl_device_name(device));
  impl::set_text(record.device_key, sizeof(record.device_key), impl::device_key(device));
  record.compute_units = device.get_info<sycl::info::device::max_compute_units>();
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (device.is_cpu() && ::sched_getaffinity(0, sizeof(allowed), &allowed) == 0) {
    for (int c = 0; c < CPU_SETSIZE && c < 64 * 16; ++c) {
      if (CPU_ISSET(c, &allowed)) record.cpus[c / 64] |= uint64_t(1) << (c % 64);
    }
  }
  impl::run_step(record, own, [&] {
    TPF_CHECK_ARG(sycl_backend::can_compile_sycl(device), kOp,
                  "device '" << impl::sycl_device_name(device)
                             << "' cannot compile SYCL source at run time "
                                "(ext_oneapi_can_compile), which the SYCL backend's kernels need");
    if (device.is_cpu()) {
      TPF_CHECK_ARG(device.has(sycl::aspect::usm_system_allocations), kOp,
                    "CPU device '" << impl::sycl_device_name(device)
                                   << "' has no USM system allocations, which its kernels need to "
                                      "reach the peers' workspaces in shared memory");
      record.memory_kind = uint32_t(impl::MemoryKind::kSharedMemory);
    } else {
      TPF_CHECK_ARG(device.has(sycl::aspect::ext_oneapi_ipc_memory), kOp,
                    "device '" << impl::sycl_device_name(device)
                               << "' has no inter-process memory (sycl_ext_oneapi_ipc_memory), "
                                  "which the peers need to open its workspace");
      record.memory_kind = uint32_t(impl::MemoryKind::kIpc);
    }
    kernels = &impl::sycl_kernels(context, device);
    queue.emplace(context, device, sycl::property::queue::in_order{});
    memory->control = sycl::malloc_device(sizeof(impl::ControlBlock), *queue);
    memory->errors = sycl::malloc_host(sizeof(impl::ErrorRecord), *queue);
    if (memory->control == nullptr || memory->errors == nullptr) {
      TPF_FAIL("out of memory for the control block or the error record");
    }
    queue->memset(memory->control, 0, sizeof(impl::ControlBlock)).wait();
    *static_cast<impl::ErrorRecord*>(memory->errors) = impl::ErrorRecord{};
    if (record.memory_kind == uint32_t(impl::MemoryKind::kSharedMemory)) {
      impl::create_shared_workspace(*memory, record);
    } else {
      impl::create_ipc_workspace(*memory, *queue, record);
    }
    bound = impl::sycl_wait_bound(*queue, *kernels, options.peer_timeout_seconds);
  });

  // The bootstrap team. Ranks reach each wait of the creation after setup of their own (the
  // kernels may compile: minutes cold), so each wait lasts peer_timeout_seconds +
  // handshake_timeout_seconds, as create_cuda_team(id, ...)'s.
  TeamOptions bootstrap_options;
  bootstrap_options.packet_bytes = impl::kBootstrapPacketBytes;
  bootstrap_options.peer_timeout_seconds =
      options.peer_timeout_seconds > 0
          ? options.peer_timeout_seconds + options.handshake_timeout_seconds
          : 0.0;
  try {
    memory->bootstrap = create_cpu_team(id, rank, world_size, bootstrap_options);
  } catch (const Error& error) {
    TPF_FAIL(kOp << ": rank " << rank
                 << ": the bootstrap over a CPU team of this id failed: " << error.what());
  }
  const Team& bootstrap = memory->bootstrap;
  const auto peer_note = [&](int peer) {
    const impl::TeamState* state = bootstrap.state();
    return state->peer_status ? state->peer_status(peer) : std::string();
  };

  // 1. The records: every rank's setup, the same options everywhere, one kind of device, and
  // no more ranks on a device than it has compute units.
  const std::vector<impl::Record> records =
      impl::all_gather(bootstrap, record, "the setup records");
  impl::agree(records, rank, own, "setup");
  impl::check_records(records, rank);

  // 2. The peers' workspaces, mapped (or opened) in this process.
  std::array<char*, kMaxWorldSize> workspace{};
  const bool shared = records[0].memory_kind == uint32_t(impl::MemoryKind::kSharedMemory);
  workspace[size_t(rank)] = static_cast<char*>(shared ? memory->mapping : memory->device_workspace);
  record = impl::Record{};
  own.clear();
  impl::run_step(record, own, [&] {
    for (int r = 0; r < world_size; ++r) {
      if (r == rank) continue;
      const impl::Record& peer = records[size_t(r)];
      if (shared) {
        memory->peer_mappings.push_back(impl::map_peer_workspace(*memory, peer, r, peer_note(r)));
        workspace[size_t(r)] = static_cast<char*>(memory->peer_mappings.back());
      } else {
        impl::check_peer_device(device, peer, r);
        impl::ipc::handle_data_t data(peer.handle_bytes);
        std::memcpy(data.data(), peer.handle, peer.handle_bytes);
        memory->peer_opened.push_back(impl::ipc::memory::open(data, context, device));
        workspace[size_t(r)] = static_cast<char*>(memory->peer_opened.back());
      }
    }
  });
  impl::agree(impl::all_gather(bootstrap, record, "the peer mappings"), rank, own,
              "mapping of the peers");
  // Every peer has mapped this rank's workspace: the mappings keep the memory.
  if (memory->fd >= 0) {
    ::close(memory->fd);
    memory->fd = -1;
  }

  auto state = impl::new_team_state<impl::SyclTeamState>(
      impl::sycl_backend(), rank, world_size, options, "sycl:" + impl::sycl_device_name(device), "",
      shared ? "sycl shared memory" : "sycl ipc");
  for (int r = 0; r < world_size; ++r) state->exchange.workspace[r] = workspace[size_t(r)];
  state->exchange.control = static_cast<impl::ControlBlock*>(memory->control);
  state->exchange.errors = static_cast<impl::ErrorRecord*>(memory->errors);
  const std::vector<sycl::device> all = sycl::device::get_devices();
  state->device = int(std::find(all.begin(), all.end(), device) - all.begin());
  state->context = context;
  state->sycl_device = device;
  state->queue = *queue;
  state->kernels = kernels;
  state->bound = bound;
  const Team bootstrap_handle = bootstrap;
  state->peer_status = [bootstrap_handle](int peer) {
    const impl::TeamState* bootstrap_state = bootstrap_handle.state();
    return bootstrap_state->peer_status ? bootstrap_state->peer_status(peer) : std::string();
  };
  state->memory = memory;
  Team team(std::move(state));
  if (world_size > 1) impl::handshake(team, *queue, kOp);
  return team;
}

}  // namespace tpfuse
