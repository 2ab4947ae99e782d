// CPU-backend teams of one rank per process on this host: every rank's workspace in one POSIX
// shared-memory segment that each process maps at an address of its own. The calls are the
// in-process CPU team's (src/cpu/): senders store into the peer's workspace through this
// process's mapping, with the same release/acquire word stores, which order across processes as
// across threads (one physical page, lock-free 32-bit atomics). Each rank's control block and
// error record are touched by that rank only, so they stay in its process's private memory.
//
// Creation (create_cpu_team(id, ...)): rank 0 creates the segment under the id's name, reserves
// its pages (so that a full /dev/shm is an error here, not a SIGBUS later), writes the header and
// sets `ready`. Every rank maps it, checks that its world size and options are rank 0's, claims
// its rank, fills its own workspace with the sentinel and counts itself in; the team exists once
// all have (the count's release/acquire orders every fill before any rank's first packet). Then
// each rank removes the name (the first removal wins): the pages live until the last process
// unmaps them, so a team whose processes die leaves nothing behind. A rank that waits past the
// deadline marks the segment abandoned, removes the name and throws naming the ranks that did
// not join; ranks still waiting see the mark and throw too.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>

#include "core/backend.h"
#include "core/error.h"
#include "core/team_state.h"
#include "tpfuse/impl/lamport.h"

namespace tpfuse {
namespace impl {
namespace {

constexpr char kIdMagic[16] = "tpfuse-cpu-id:1";
constexpr const char* kNamePrefix = "/tpfuse-";
constexpr size_t kPage = 4096;

// What an id holds: the magic (an id made by create_cpu_team_id) and the segment's name,
// "/tpfuse-<creator pid>-<random>".
struct IdFields {
  char magic[16];
  char name[48];
};
static_assert(sizeof(IdFields) == sizeof(CpuTeamId));

// The segment's first page; the workspaces follow, one every `workspace_stride` bytes. Fields
// other than the words below are written by rank 0 before it sets `ready` and read after it.
struct SegmentHeader {
  uint32_t ready;      // 1: rank 0 has sized the segment and written the fields
  uint32_t abandoned;  // 1: a rank gave up waiting; no team comes of this segment
  uint32_t joined;     // ranks that have filled their workspace
  uint32_t world_size;
  uint32_t peer_stores;
  uint32_t unused;
  uint64_t packet_bytes;
  uint64_t workspace_stride;
  uint64_t total_bytes;
  int32_t pid[kMaxWorldSize];      // each rank's process, 0 until it claims its rank
  uint32_t filled[kMaxWorldSize];  // 1 once the rank's workspace holds the sentinel
};
static_assert(sizeof(SegmentHeader) <= kPage);

uint32_t load_acquire(const uint32_t* word) {
  return __atomic_load_n(word, __ATOMIC_ACQUIRE);
}
void store_release(uint32_t* word, uint32_t value) {
  __atomic_store_n(word, value, __ATOMIC_RELEASE);
}

std::string errno_text() {
  return std::strerror(errno);
}

// A wait that ends `seconds` after it started (0: never).
class Deadline {
 public:
  explicit Deadline(double seconds) : seconds_(seconds) {}
  bool passed() const {
    if (seconds_ <= 0) return false;
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count() >
           seconds_;
  }
  static void pause() { std::this_thread::sleep_for(std::chrono::microseconds(200)); }

 private:
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  double seconds_;
};

// Whether a process runs: it exists (kill with no signal) and is not a zombie, an exited
// process its parent has not reaped yet (Linux: the state after the name in /proc/<pid>/stat).
bool process_alive(int32_t pid) {
  if (pid <= 0 || (::kill(pid, 0) != 0 && errno == ESRCH)) return false;
  std::FILE* stat = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (stat == nullptr) return true;
  char line[512] = {};
  const size_t read = std::fread(line, 1, sizeof(line) - 1, stat);
  std::fclose(stat);
  const char* name_end = std::strrchr(line, ')');
  return read == 0 || name_end == nullptr || name_end[1] != ' ' || name_end[2] != 'Z';
}

// Removes the names of segments whose creator has exited before the team was complete (a name
// lives only while its team is being made). Linux keeps shm_open names in /dev/shm.
void remove_stale_names() {
  DIR* directory = ::opendir("/dev/shm");
  if (directory == nullptr) return;
  const std::string prefix = std::string(kNamePrefix).substr(1);
  while (const dirent* entry = ::readdir(directory)) {
    const std::string name = entry->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const long pid = std::strtol(name.c_str() + prefix.size(), nullptr, 10);
    if (pid > 0 && !process_alive(int32_t(pid))) ::shm_unlink(("/" + name).c_str());
  }
  ::closedir(directory);
}

// This process's mapping of the segment, and the rank's private control block and error record.
struct ProcessTeamMemory : TeamMemory {
  void* base = nullptr;
  size_t bytes = 0;
  ControlBlock control{};
  ErrorRecord errors{};
  ~ProcessTeamMemory() override {
    if (base != nullptr) ::munmap(base, bytes);
  }
  SegmentHeader* header() const { return static_cast<SegmentHeader*>(base); }
};

void* map_segment(int fd, size_t bytes, const std::string& name) {
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    TPF_FAIL("create_cpu_team: mapping " << bytes << " bytes of shared memory " << name
                                         << " failed: " << errno_text());
  }
  return base;
}

// Closes the descriptor on every way out.
struct Descriptor {
  int fd = -1;
  ~Descriptor() {
    if (fd >= 0) ::close(fd);
  }
};

// Rank 0: creates the segment, reserves its pages and writes the header.
void create_segment(Descriptor& fd, ProcessTeamMemory& memory, const std::string& name,
                    int world_size, const TeamOptions& options, size_t stride, size_t total) {
  fd.fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd.fd < 0) {
    TPF_FAIL("create_cpu_team: rank 0 cannot create shared memory "
             << name << ": " << errno_text()
             << (errno == EEXIST ? " (an id makes one team: make a new id with create_cpu_team_id)"
                                 : ""));
  }
  // posix_fallocate reserves the pages: a full /dev/shm fails here with ENOSPC instead of
  // raising SIGBUS at the first store into a page it cannot back.
  const int reserve =
      ::ftruncate(fd.fd, off_t(total)) != 0 ? errno : ::posix_fallocate(fd.fd, 0, off_t(total));
  if (reserve != 0) {
    ::shm_unlink(name.c_str());
    TPF_FAIL("create_cpu_team: cannot reserve " << total << " bytes of shared memory for a team of "
                                                << world_size << " (" << std::strerror(reserve)
                                                << "); lower TeamOptions::packet_bytes (now "
                                                << options.packet_bytes << ") or free /dev/shm");
  }
  memory.base = map_segment(fd.fd, total, name);
  memory.bytes = total;
  SegmentHeader* header = memory.header();
  header->world_size = uint32_t(world_size);
  header->peer_stores = options.peer_stores ? 1 : 0;
  header->packet_bytes = options.packet_bytes;
  header->workspace_stride = stride;
  header->total_bytes = total;
  store_release(&header->ready, 1);
}

// Ranks other than 0: opens rank 0's segment once it exists and is ready, and checks that this
// rank was given what rank 0 was.
void open_segment(Descriptor& fd, ProcessTeamMemory& memory, const std::string& name, int rank,
                  int world_size, const TeamOptions& options, size_t total,
                  const Deadline& deadline) {
  const auto timed_out = [&](const char* what) {
    TPF_FAIL("create_cpu_team: rank " << rank << " waited " << options.peer_timeout_seconds
                                      << " s for rank 0 to " << what << " (shared memory " << name
                                      << "): did rank 0 get the same id, and is it running?");
  };
  while ((fd.fd = ::shm_open(name.c_str(), O_RDWR, 0)) < 0) {
    if (errno != ENOENT) {
      TPF_FAIL("create_cpu_team: rank " << rank << " cannot open shared memory " << name << ": "
                                        << errno_text());
    }
    if (deadline.passed()) timed_out("create the team");
    Deadline::pause();
  }
  // Rank 0 may not have sized it yet: reading a page past the end would raise SIGBUS.
  for (struct stat status{};; Deadline::pause()) {
    if (::fstat(fd.fd, &status) != 0) TPF_FAIL("create_cpu_team: fstat failed: " << errno_text());
    if (size_t(status.st_size) >= kPage) break;
    if (deadline.passed()) timed_out("size the team's memory");
  }
  void* first_page = map_segment(fd.fd, kPage, name);
  auto* header = static_cast<SegmentHeader*>(first_page);
  while (load_acquire(&header->ready) == 0 && load_acquire(&header->abandoned) == 0) {
    if (deadline.passed()) {
      ::munmap(first_page, kPage);
      timed_out("set the team up");
    }
    Deadline::pause();
  }
  const SegmentHeader seen = *header;
  ::munmap(first_page, kPage);
  std::ostringstream differs;
  if (seen.world_size != uint32_t(world_size)) {
    differs << "world_size: " << seen.world_size << " on rank 0, " << world_size << " here";
  } else if (seen.packet_bytes != options.packet_bytes) {
    differs << "options.packet_bytes: " << seen.packet_bytes << " on rank 0, "
            << options.packet_bytes << " here";
  } else if (seen.peer_stores != (options.peer_stores ? 1u : 0u)) {
    differs << "options.peer_stores: " << (seen.peer_stores ? "true" : "false") << " on rank 0, "
            << (options.peer_stores ? "true" : "false") << " here";
  }
  if (!differs.str().empty()) {
    TPF_FAIL("create_cpu_team: rank " << rank << " was not given what rank 0 was, in "
                                      << differs.str()
                                      << "; every rank must pass the same world_size and options");
  }
  if (seen.total_bytes != total)
    TPF_FAIL("create_cpu_team: segment " << name << " has another layout");
  memory.base = map_segment(fd.fd, total, name);
  memory.bytes = total;
}

// The ranks that have not claimed their rank, or (`claimed`) those that have but not yet filled
// their workspace: "2, 3".
std::string ranks_where(const SegmentHeader& header, int world_size, bool claimed) {
  std::ostringstream out;
  const char* separator = "";
  for (int r = 0; r < world_size; ++r) {
    const bool has_claimed = __atomic_load_n(&header.pid[r], __ATOMIC_ACQUIRE) != 0;
    const bool has_filled = __atomic_load_n(&header.filled[r], __ATOMIC_ACQUIRE) != 0;
    if (claimed ? (has_claimed && !has_filled) : !has_claimed) {
      out << separator << r;
      separator = ", ";
    }
  }
  return out.str();
}

}  // namespace
}  // namespace impl

CpuTeamId create_cpu_team_id() {
  impl::remove_stale_names();
  std::random_device entropy;
  std::ostringstream name;
  name << impl::kNamePrefix << ::getpid() << "-" << std::hex << entropy() << entropy();
  impl::IdFields fields{};
  std::memcpy(fields.magic, impl::kIdMagic, sizeof(fields.magic));
  std::snprintf(fields.name, sizeof(fields.name), "%s", name.str().c_str());
  CpuTeamId id{};
  std::memcpy(id.bytes, &fields, sizeof(id.bytes));
  return id;
}

Team create_cpu_team(const CpuTeamId& id, int rank, int world_size, const TeamOptions& options) {
  const char* op = "create_cpu_team";
  TPF_CHECK_ARG(world_size >= 1 && world_size <= kMaxWorldSize, op,
                "world_size must be in [1, " << kMaxWorldSize << "], got " << world_size);
  TPF_CHECK_ARG(rank >= 0 && rank < world_size, op,
                "rank must be in [0, world_size = " << world_size << "), got " << rank);
  impl::validate_team_options(options, op);
  impl::IdFields fields;
  std::memcpy(&fields, id.bytes, sizeof(fields));
  TPF_CHECK_ARG(std::memcmp(fields.magic, impl::kIdMagic, sizeof(fields.magic)) == 0 &&
                    std::memchr(fields.name, 0, sizeof(fields.name)) != nullptr &&
                    std::strncmp(fields.name, impl::kNamePrefix, 8) == 0,
                op, "id was not made by create_cpu_team_id");
  const std::string name = fields.name;

  const size_t workspace = impl::workspace_bytes(world_size, options.packet_bytes);
  const size_t stride = (workspace + impl::kPage - 1) / impl::kPage * impl::kPage;
  const size_t total = impl::kPage + size_t(world_size) * stride;
  const impl::Deadline deadline(options.peer_timeout_seconds);
  auto memory = std::make_shared<impl::ProcessTeamMemory>();
  {
    impl::Descriptor fd;
    if (rank == 0) {
      impl::create_segment(fd, *memory, name, world_size, options, stride, total);
    } else {
      impl::open_segment(fd, *memory, name, rank, world_size, options, total, deadline);
    }
  }  // the mapping keeps the segment; the descriptor is not needed
  impl::SegmentHeader* header = memory->header();
  if (impl::load_acquire(&header->abandoned) != 0) {
    TPF_FAIL("create_cpu_team: rank " << rank
                                      << ": another rank gave up waiting for this team's ranks "
                                         "to join; make a new id");
  }
  int32_t unclaimed = 0;
  const int32_t pid = int32_t(::getpid());
  if (!__atomic_compare_exchange_n(&header->pid[rank], &unclaimed, pid, false, __ATOMIC_ACQ_REL,
                                   __ATOMIC_ACQUIRE)) {
    TPF_FAIL("create_cpu_team: rank " << rank << " has already joined this team (process "
                                      << unclaimed << "); each rank joins once, with its own rank");
  }
  char* workspaces = static_cast<char*>(memory->base) + impl::kPage;
  auto* words = reinterpret_cast<uint32_t*>(workspaces + size_t(rank) * stride);
  for (size_t i = 0; i < workspace / 4; ++i) words[i] = impl::kSentinel;
  impl::store_release(&header->filled[rank], 1);
  __atomic_fetch_add(&header->joined, 1u, __ATOMIC_ACQ_REL);
  // The peers get the whole timeout from here: this rank's own setup does not count against them.
  const impl::Deadline join_deadline(options.peer_timeout_seconds);
  while (impl::load_acquire(&header->joined) < uint32_t(world_size)) {
    const bool abandoned = impl::load_acquire(&header->abandoned) != 0;
    if (abandoned || join_deadline.passed()) {
      const std::string absent = impl::ranks_where(*header, world_size, false);
      const std::string filling = impl::ranks_where(*header, world_size, true);
      impl::store_release(&header->abandoned, 1);
      ::shm_unlink(name.c_str());
      std::ostringstream why;
      if (abandoned) why << "another rank gave up waiting; ";
      if (!absent.empty()) why << "rank(s) " << absent << " did not join";
      if (!absent.empty() && !filling.empty()) why << ", and ";
      if (!filling.empty()) {
        why << "rank(s) " << filling << " had joined but not yet filled their workspace ("
            << workspace << " bytes each; a smaller options.packet_bytes is faster)";
      }
      TPF_FAIL("create_cpu_team: rank "
               << rank << ": " << why.str() << " within " << options.peer_timeout_seconds
               << " s (options.peer_timeout_seconds): each rank must call create_cpu_team with "
                  "this id, its own rank and world_size "
               << world_size);
    }
    impl::Deadline::pause();
  }
  ::shm_unlink(name.c_str());  // every rank has it mapped; the first removal wins

  const std::string fallback =
      options.peer_stores
          ? ""
          : "TeamOptions::peer_stores is false (CPU backend: ops run the NCCL path's stand-in)";
  auto state = impl::new_team_state(impl::cpu_backend(), rank, world_size, options, "cpu", fallback,
                                    "shared memory");
  for (int p = 0; p < world_size; ++p)
    state->exchange.workspace[p] = workspaces + size_t(p) * stride;
  state->exchange.control = &memory->control;
  state->exchange.errors = &memory->errors;
  state->peer_status = [header](int peer) -> std::string {
    const int32_t peer_pid = __atomic_load_n(&header->pid[peer], __ATOMIC_ACQUIRE);
    if (impl::process_alive(peer_pid)) return "";
    return " (its process, pid " + std::to_string(peer_pid) + ", has exited)";
  };
  state->memory = memory;
  return Team(std::move(state));
}

}  // namespace tpfuse
