// CPU-backend teams of one rank per process on this host: every rank's workspace in one block of
// shared memory that each process maps at an address of its own. The calls are the in-process
// CPU team's (src/cpu/): senders store into the peer's workspace through this process's mapping,
// with the same release/acquire word stores, which order across processes as across threads (one
// physical page, lock-free 32-bit atomics). Each rank's control block and error record are
// touched by that rank only, so they stay in its process's private memory.
//
// The memory has no name anywhere: rank 0 makes it with memfd_create, and it lives exactly as
// long as some process holds its descriptor or a mapping of it. So a team leaves nothing behind
// however its processes end, even when every rank dies while the team is being made.
//
// Creation (create_cpu_team(id, ...)): the id holds a random name. Rank 0 listens on the Linux
// abstract unix socket of that name (the name lives while the socket is open and in no
// filesystem; a second listener of one id fails: an id makes one team), creates the memory,
// reserves its pages (so that running out of memory is an error here, not a SIGBUS later) and
// writes the header. Every other rank connects to the socket (retrying until its deadline: rank 0
// may start late) and receives the memory's descriptor from rank 0 (SCM_RIGHTS; rank 0 serves
// only processes of its own user or root, as a 0600 file would). Every rank maps the memory,
// checks that its world size and options are rank 0's, claims its rank, fills its own workspace
// with the sentinel and counts itself in; the team exists once all have (the count's
// release/acquire orders every fill before any rank's first packet). Rank 0 hands out the
// descriptor while it waits for the count and closes the socket and its descriptor once every
// rank has joined: the mappings keep the memory until the last process unmaps it. A rank that
// waits past the deadline marks the memory abandoned and throws naming the ranks that did not
// join; ranks still waiting see the mark and throw too (rank 0 still serves those that have
// connected, so that they see it, then closes the socket).
//
// The abstract namespace belongs to the network namespace: every rank must share rank 0's (as
// processes of one host do unless a container gives them network namespaces of their own).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <iomanip>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>

#include "core/backend.h"
#include "core/error.h"
#include "core/team_state.h"
#include "cpu/kernels.h"
#include "tpfuse/impl/lamport.h"

namespace tpfuse {
namespace impl {
namespace {

constexpr char kIdMagic[16] = "tpfuse-cpu-id:2";
constexpr const char* kNamePrefix = "tpfuse-";
constexpr size_t kPage = 4096;

// What an id holds: the magic (an id made by create_cpu_team_id) and the team's name,
// "tpfuse-<128 random bits in hex>": the abstract socket rank 0 listens on, and the memory's
// memfd name (seen in /proc/<pid>/fd and maps).
struct IdFields {
  char magic[16];
  char name[48];
};
static_assert(sizeof(IdFields) == sizeof(CpuTeamId));

// The memory's first page; the workspaces follow, one every `workspace_stride` bytes. Fields other
// than the words below are written by rank 0 before it hands out the descriptor.
struct SegmentHeader {
  uint32_t abandoned;  // 1: a rank gave up waiting; no team comes of this memory
  uint32_t joined;     // ranks that have filled their workspace
  uint32_t world_size;
  uint32_t peer_stores;
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

// One message of the descriptor hand-over: a byte (a stream message carries at least one) and
// room for one descriptor (SCM_RIGHTS). Built in place: the header points into the object.
struct DescriptorMessage {
  char byte = 'T';
  iovec data{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr header{};
  DescriptorMessage() {
    header.msg_iov = &data;
    header.msg_iovlen = 1;
    header.msg_control = control;
    header.msg_controllen = sizeof(control);
  }
  DescriptorMessage(const DescriptorMessage&) = delete;
  DescriptorMessage& operator=(const DescriptorMessage&) = delete;
};

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

// This process's mapping of the memory, and the rank's private control block and error record.
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

void* map_memory(int fd, size_t bytes) {
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    TPF_FAIL("create_cpu_team: mapping "
             << bytes << " bytes of the team's shared memory failed: " << errno_text());
  }
  return base;
}

// Closes the descriptor on every way out.
struct Descriptor {
  int fd = -1;
  Descriptor() = default;
  explicit Descriptor(int fd) : fd(fd) {}
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
  ~Descriptor() { reset(); }
  void reset() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

// The abstract socket address of a team's name: a leading NUL, then the name (no terminator).
struct SocketAddress {
  sockaddr_un address{};
  socklen_t length = 0;
  explicit SocketAddress(const std::string& name) {
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path + 1, name.data(), name.size());
    length = socklen_t(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  }
  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&address); }
};
static_assert(sizeof(IdFields::name) < sizeof(sockaddr_un::sun_path));

// Rank 0's side of creation: the team's memory and the socket that hands its descriptor out.
// Both close when it goes; the mappings keep the memory.
class MemoryServer {
 public:
  // Listens on the name's socket first: a second team of one id fails before reserving memory.
  MemoryServer(const std::string& name, int world_size) {
    listener_.fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (listener_.fd < 0) {
      TPF_FAIL("create_cpu_team: rank 0 cannot make a unix socket: " << errno_text());
    }
    const SocketAddress address(name);
    if (::bind(listener_.fd, address.get(), address.length) != 0 ||
        ::listen(listener_.fd, SOMAXCONN) != 0) {
      TPF_FAIL("create_cpu_team: rank 0 cannot listen on the abstract socket @"
               << name << ": " << errno_text()
               << (errno == EADDRINUSE
                       ? " (an id makes one team: make a new id with create_cpu_team_id)"
                       : ""));
    }
    memory_.fd = ::memfd_create(name.c_str(), MFD_CLOEXEC);
    if (memory_.fd < 0) {
      TPF_FAIL("create_cpu_team: rank 0 cannot create shared memory for a team of "
               << world_size << " (memfd_create): " << errno_text());
    }
  }

  // Sizes the memory and reserves its pages. posix_fallocate: memory that cannot be had fails
  // here (ENOSPC, ENOMEM) instead of raising SIGBUS at the first store into a page that cannot be
  // backed.
  void reserve(size_t total, int world_size, const TeamOptions& options) {
    const int failure = ::ftruncate(memory_.fd, off_t(total)) != 0
                            ? errno
                            : ::posix_fallocate(memory_.fd, 0, off_t(total));
    if (failure != 0) {
      TPF_FAIL("create_cpu_team: cannot reserve "
               << total << " bytes of shared memory for a team of " << world_size << " ("
               << std::strerror(failure) << "); lower TeamOptions::packet_bytes (now "
               << options.packet_bytes << ") or free memory");
    }
  }
  int memory() const { return memory_.fd; }

  // Hands the descriptor to every rank that has connected, and returns when none waits. A rank
  // whose handover fails sees its connection end and connects again.
  void serve() const {
    for (;;) {
      const Descriptor connection(::accept4(listener_.fd, nullptr, nullptr, SOCK_CLOEXEC));
      if (connection.fd < 0) return;  // EAGAIN: none waits
      ucred peer{};
      socklen_t length = sizeof(peer);
      if (::getsockopt(connection.fd, SOL_SOCKET, SO_PEERCRED, &peer, &length) != 0 ||
          (peer.uid != ::geteuid() && peer.uid != 0)) {
        continue;  // another user's process: the memory is not theirs
      }
      DescriptorMessage message;
      cmsghdr* rights = CMSG_FIRSTHDR(&message.header);
      rights->cmsg_level = SOL_SOCKET;
      rights->cmsg_type = SCM_RIGHTS;
      rights->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(rights), &memory_.fd, sizeof(int));
      ::sendmsg(connection.fd, &message.header, MSG_NOSIGNAL);
    }
  }

  // Serves those still connected, then closes the socket (its name goes) and the descriptor.
  void close() {
    serve();
    listener_.reset();
    memory_.reset();
  }

 private:
  Descriptor listener_;
  Descriptor memory_;
};

// Rank 0: creates the memory, reserves its pages and writes the header.
void create_memory(MemoryServer& server, ProcessTeamMemory& memory, int world_size,
                   const TeamOptions& options, size_t stride, size_t total) {
  server.reserve(total, world_size, options);
  memory.base = map_memory(server.memory(), total);
  memory.bytes = total;
  SegmentHeader* header = memory.header();
  header->world_size = uint32_t(world_size);
  header->peer_stores = options.peer_stores ? 1 : 0;
  header->packet_bytes = options.packet_bytes;
  header->workspace_stride = stride;
  header->total_bytes = total;
}

// Ranks other than 0: the memory's descriptor, from rank 0's socket once it listens; -1 if the
// connection ended without one (rank 0 closed the socket or exited: the caller connects again).
int receive_memory(const std::string& name, int rank, const TeamOptions& options,
                   const Deadline& deadline) {
  const auto timed_out = [&](const char* what) {
    TPF_FAIL("create_cpu_team: rank " << rank << " waited " << options.peer_timeout_seconds
                                      << " s for rank 0 to " << what << " (socket @" << name
                                      << "): did rank 0 get the same id, and is it running?");
  };
  const SocketAddress address(name);
  Descriptor connection;
  for (;;) {
    connection.fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (connection.fd < 0) {
      TPF_FAIL("create_cpu_team: rank " << rank << " cannot make a unix socket: " << errno_text());
    }
    if (::connect(connection.fd, address.get(), address.length) == 0) break;
    // ECONNREFUSED: nothing listens yet; EAGAIN: the backlog is full.
    if (errno != ECONNREFUSED && errno != ENOENT && errno != EAGAIN) {
      TPF_FAIL("create_cpu_team: rank " << rank << " cannot connect to rank 0's socket @" << name
                                        << ": " << errno_text());
    }
    connection.reset();
    if (deadline.passed()) timed_out("create the team");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // Rank 0 serves connections between the steps of its own setup.
  for (pollfd ready{connection.fd, POLLIN, 0}; ::poll(&ready, 1, 10) <= 0;) {
    if (deadline.passed()) timed_out("set the team up");
  }
  DescriptorMessage message;
  if (::recvmsg(connection.fd, &message.header, MSG_CMSG_CLOEXEC) != 1) return -1;
  const cmsghdr* rights = CMSG_FIRSTHDR(&message.header);
  if (rights == nullptr || rights->cmsg_level != SOL_SOCKET || rights->cmsg_type != SCM_RIGHTS ||
      rights->cmsg_len != CMSG_LEN(sizeof(int))) {
    return -1;
  }
  int fd = -1;
  std::memcpy(&fd, CMSG_DATA(rights), sizeof(int));
  return fd;
}

// Ranks other than 0: maps rank 0's memory and checks that this rank was given what rank 0 was.
void open_memory(ProcessTeamMemory& memory, const std::string& name, int rank, int world_size,
                 const TeamOptions& options, size_t total, const Deadline& deadline) {
  Descriptor fd;
  while ((fd.fd = receive_memory(name, rank, options, deadline)) < 0) Deadline::pause();
  struct stat status {};
  if (::fstat(fd.fd, &status) != 0 || size_t(status.st_size) < kPage) {
    TPF_FAIL("create_cpu_team: rank " << rank << " was sent no team memory by rank 0 (socket @"
                                      << name << ")");
  }
  void* first_page = map_memory(fd.fd, kPage);
  const SegmentHeader seen = *static_cast<const SegmentHeader*>(first_page);
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
  if (seen.total_bytes != total || size_t(status.st_size) < total) {
    TPF_FAIL("create_cpu_team: the team's memory (socket @" << name << ") has another layout");
  }
  memory.base = map_memory(fd.fd, total);
  memory.bytes = total;
}  // the mapping keeps the memory; the descriptor is not needed

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
  std::random_device entropy;
  std::ostringstream name;
  name << impl::kNamePrefix << std::hex;
  for (int word = 0; word < 4; ++word) name << std::setw(8) << std::setfill('0') << entropy();
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
                    std::strncmp(fields.name, impl::kNamePrefix, 7) == 0,
                op, "id was not made by create_cpu_team_id");
  const std::string name = fields.name;

  const size_t workspace = impl::workspace_bytes(world_size, options.packet_bytes);
  const size_t stride = (workspace + impl::kPage - 1) / impl::kPage * impl::kPage;
  const size_t total = impl::kPage + size_t(world_size) * stride;
  const impl::Deadline deadline(options.peer_timeout_seconds);
  auto memory = std::make_shared<impl::ProcessTeamMemory>();
  std::unique_ptr<impl::MemoryServer> server;
  if (rank == 0) {
    server = std::make_unique<impl::MemoryServer>(name, world_size);
    impl::create_memory(*server, *memory, world_size, options, stride, total);
  } else {
    impl::open_memory(*memory, name, rank, world_size, options, total, deadline);
  }
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
    if (server) server->serve();
    const bool abandoned = impl::load_acquire(&header->abandoned) != 0;
    if (abandoned || join_deadline.passed()) {
      const std::string absent = impl::ranks_where(*header, world_size, false);
      const std::string filling = impl::ranks_where(*header, world_size, true);
      impl::store_release(&header->abandoned, 1);
      if (server) server->close();  // those connected by now see the mark
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
  if (server) server->close();  // every rank has it mapped: the socket's name goes

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
