// SYCL teams of one process: ranks on SYCL devices (several may share one), every rank's
// workspace and control block in its device's memory, its error record in host memory. Made in
// this order: the refusal of ranks a device cannot run at once, the context and peer access, the
// kernels (compiled or from the caches: the warm-up), the memory, and the waits' bound.
#include <algorithm>
#include <array>
#include <chrono>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
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

struct SyclTeamMemory : TeamMemory {
  explicit SyclTeamMemory(const sycl::context& c) : context(c) {}
  ~SyclTeamMemory() override {
    for (void* block : blocks) sycl::free(block, context);
  }
  sycl::context context;
  std::vector<void*> blocks;
};

}  // namespace

std::string sycl_device_name(const sycl::device& device) {
  return device.get_info<sycl::info::device::name>();
}

void refuse_more_ranks_than_compute_units(const std::vector<RankOnDevice>& ranks, const char* op,
                                          const std::string& note) {
  if (ranks.size() < 2) return;
  std::vector<std::string> keys;
  for (const RankOnDevice& rank : ranks) {
    if (std::find(keys.begin(), keys.end(), rank.device_key) == keys.end()) {
      keys.push_back(rank.device_key);
    }
  }
  for (const std::string& key : keys) {
    std::vector<int> sharing;
    uint32_t units = ~0u;
    std::string name;
    for (const RankOnDevice& rank : ranks) {
      if (rank.device_key != key) continue;
      sharing.push_back(rank.rank);
      units = std::min(units, rank.compute_units);
      if (name.empty()) name = rank.device_name;
    }
    if (sharing.size() <= units) continue;
    std::ostringstream list;
    for (size_t i = 0; i < sharing.size(); ++i) list << (i > 0 ? ", " : "") << sharing[i];
    TPF_CHECK_ARG(false, op,
                  sharing.size() << " ranks (" << list.str() << ") on device '" << name
                                 << "', which has " << units << " compute units" << note
                                 << ": every rank polls its peers from a running "
                                    "kernel and needs a compute unit of its own at once, so at "
                                    "most "
                                 << units << " ranks may share this device");
  }
}

namespace {

// Looks per second of a wait (tpf_sycl_calibrate), by one work-item: what one wait costs, however
// a device runs a group's work-items (the CPU device runs them in SIMD lanes, a few lane groups
// one after another: measured over a whole group, a look seemed several times slower than a
// wait's, and waits ended 7 times too early). The fastest of three runs, so that a bound made
// from it lasts at least the timeout wherever a wait looks no faster than measured (a loaded
// device looks slower: its waits then last longer).
double looks_per_second(sycl::queue& queue, const SyclKernels& kernels) {
  const size_t group = kernels.group_size;
  auto* never = sycl::malloc_device<Vec16>(group, queue);
  auto* words = sycl::malloc_device<uint32_t>(4, queue);
  auto* out = sycl::malloc_device<uint32_t>(1, queue);
  if (never == nullptr || words == nullptr || out == nullptr) {
    TPF_FAIL("create_sycl_team: out of device memory for the calibration");
  }
  queue.fill(reinterpret_cast<uint32_t*>(never), kSentinel, group * 4);
  queue.fill(words, kSentinel, 4);
  queue.wait();
  constexpr uint64_t kLooks = uint64_t(1) << 16;
  double best = 0.0;
  for (int run = 0; run < 3; ++run) {
    const auto start = std::chrono::steady_clock::now();
    queue
        .submit([&](sycl::handler& handler) {
          handler.set_args(static_cast<const Vec16*>(never), static_cast<const uint32_t*>(words),
                           kLooks, out);
          handler.parallel_for(sycl::nd_range<1>{1, 1}, *kernels.calibrate);
        })
        .wait();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, double(kLooks) / std::max(seconds, 1e-9));
  }
  sycl::free(never, queue);
  sycl::free(words, queue);
  sycl::free(out, queue);
  return best;
}

// Ticks per second of the device's clock (tpf_sycl_clock_rate): the kernel reads it, the host
// times 50 ms, sets the flag, the kernel reads it again.
double clock_ticks_per_second(sycl::queue& queue, const SyclKernels& kernels) {
  auto* flag = sycl::malloc_host<uint32_t>(1, queue);
  auto* ticks = sycl::malloc_host<uint64_t>(2, queue);
  if (flag == nullptr || ticks == nullptr) {
    TPF_FAIL("create_sycl_team: out of host memory for the clock's calibration");
  }
  *flag = 0;
  ticks[0] = ticks[1] = 0;
  sycl::event run = queue.submit([&](sycl::handler& handler) {
    handler.set_args(static_cast<const uint32_t*>(flag), ticks);
    handler.parallel_for(sycl::nd_range<1>{1, 1}, *kernels.clock_rate);
  });
  using Clock = std::chrono::steady_clock;
  const auto give_up = Clock::now() + std::chrono::seconds(30);
  bool started = true;
  while (__atomic_load_n(&ticks[0], __ATOMIC_ACQUIRE) == 0) {
    if (Clock::now() > give_up) {
      started = false;
      break;
    }
    std::this_thread::yield();
  }
  const auto start = Clock::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto end = Clock::now();
  __atomic_store_n(flag, 1u, __ATOMIC_RELEASE);
  run.wait();
  const uint64_t elapsed = ticks[1] - ticks[0];
  sycl::free(flag, queue);
  sycl::free(ticks, queue);
  const double seconds = std::chrono::duration<double>(end - start).count();
  if (!started || elapsed == 0) {
    TPF_FAIL("create_sycl_team: the device's clock could not be timed (its kernel "
             << (started ? "read no ticks" : "did not start within 30 s") << ")");
  }
  return double(elapsed) / seconds;
}

}  // namespace

uint64_t sycl_wait_bound(sycl::queue& queue, const SyclKernels& kernels, double timeout_seconds) {
  if (timeout_seconds <= 0) return 0;
  const double rate =
      kernels.clock ? clock_ticks_per_second(queue, kernels) : looks_per_second(queue, kernels);
  return std::max<uint64_t>(1, uint64_t(timeout_seconds * rate));
}

}  // namespace impl

std::vector<Team> create_sycl_team(const std::vector<sycl::device>& devices,
                                   const TeamOptions& options) {
  const char* op = "create_sycl_team";
  const int world_size = int(devices.size());
  TPF_CHECK_ARG(world_size >= 1 && world_size <= kMaxWorldSize, op,
                "devices must name 1 to " << kMaxWorldSize << " ranks, got " << world_size);
  impl::validate_team_options(options, op);
  TPF_CHECK_ARG(options.peer_stores, op,
                "peer_stores must be true: the SYCL backend has no NCCL path to fall back on");
  std::vector<sycl::device> distinct;
  for (const sycl::device& device : devices) {
    if (std::find(distinct.begin(), distinct.end(), device) == distinct.end()) {
      distinct.push_back(device);
    }
  }
  std::vector<impl::RankOnDevice> on_devices;
  for (int r = 0; r < world_size; ++r) {
    const auto at = std::find(distinct.begin(), distinct.end(), devices[r]);
    on_devices.push_back({r, std::to_string(at - distinct.begin()),
                          impl::sycl_device_name(devices[r]),
                          devices[r].get_info<sycl::info::device::max_compute_units>()});
  }
  impl::refuse_more_ranks_than_compute_units(on_devices, op);
  for (const sycl::device& device : distinct) {
    TPF_CHECK_ARG(sycl_backend::can_compile_sycl(device), op,
                  "device '" << impl::sycl_device_name(device)
                             << "' cannot compile SYCL source at run time "
                                "(ext_oneapi_can_compile), which the SYCL backend's kernels need");
    TPF_CHECK_ARG(device.get_platform() == distinct.front().get_platform(), op,
                  "every device must be of one platform: '"
                      << impl::sycl_device_name(device) << "' is not of '"
                      << impl::sycl_device_name(distinct.front()) << "''s");
  }
  // Distinct devices store into each other's memory (GPU-only: not run here, docs/sycl.md).
  // (ext_oneapi_can_access_peer and enable_peer_access are not const: copies of the handles.)
  for (sycl::device from : distinct) {
    for (const sycl::device& to : distinct) {
      if (from == to) continue;
      TPF_CHECK_ARG(from.ext_oneapi_can_access_peer(to), op,
                    "device '" << impl::sycl_device_name(from) << "' cannot access the memory of '"
                               << impl::sycl_device_name(to) << "' (no peer access)");
      try {
        from.ext_oneapi_enable_peer_access(to);
      } catch (const sycl::exception&) {
        // Already enabled by an earlier team.
      }
    }
  }
  // The platform's default context: the one a queue made from a device has, so that memory the
  // caller allocates with such a queue (or for another team of the platform) is this team's too.
  const sycl::context context = distinct.front().get_platform().ext_oneapi_get_default_context();
  std::vector<const impl::SyclKernels*> kernels;
  for (const sycl::device& device : devices) {
    kernels.push_back(&impl::sycl_kernels(context, device));
  }

  auto memory = std::make_shared<impl::SyclTeamMemory>(context);
  const size_t bytes = impl::allocation_bytes(world_size, options.packet_bytes);
  std::vector<sycl::queue> queues;
  std::array<char*, kMaxWorldSize> workspace{};
  std::vector<impl::ControlBlock*> controls;
  std::vector<impl::ErrorRecord*> records;
  const auto allocated = [&](void* block, const char* what, int rank) {
    if (block == nullptr) {
      TPF_FAIL(op << ": out of memory allocating rank " << rank << "'s " << what << " on '"
                  << impl::sycl_device_name(devices[rank]) << "'");
    }
    memory->blocks.push_back(block);
    return block;
  };
  for (int r = 0; r < world_size; ++r) {
    queues.emplace_back(context, devices[r], sycl::property::queue::in_order{});
    sycl::queue& queue = queues.back();
    workspace[r] = static_cast<char*>(
        allocated(sycl::malloc_device(bytes, devices[r], context), "workspace", r));
    queue.fill(reinterpret_cast<uint32_t*>(workspace[r]), impl::kSentinel, bytes / 4);
    controls.push_back(static_cast<impl::ControlBlock*>(allocated(
        sycl::malloc_device(sizeof(impl::ControlBlock), devices[r], context), "control block", r)));
    queue.memset(controls.back(), 0, sizeof(impl::ControlBlock));
    records.push_back(static_cast<impl::ErrorRecord*>(
        allocated(sycl::malloc_host(sizeof(impl::ErrorRecord), context), "error record", r)));
    *records.back() = impl::ErrorRecord{};
  }
  for (sycl::queue& queue : queues) queue.wait();
  // The waits' bound: the timeout as clock ticks (or looks), at the rate measured on rank 0's
  // device.
  const uint64_t bound =
      impl::sycl_wait_bound(queues.front(), *kernels.front(), options.peer_timeout_seconds);
  const std::vector<sycl::device> all = sycl::device::get_devices();
  std::vector<Team> team;
  for (int r = 0; r < world_size; ++r) {
    const std::string peer_memory = distinct.size() == 1 ? "sycl usm" : "sycl peer access";
    auto state = impl::new_team_state<impl::SyclTeamState>(
        impl::sycl_backend(), r, world_size, options, "sycl:" + impl::sycl_device_name(devices[r]),
        "", peer_memory);
    for (int p = 0; p < world_size; ++p) state->exchange.workspace[p] = workspace[p];
    state->exchange.control = controls[r];
    state->exchange.errors = records[r];
    state->device = int(std::find(all.begin(), all.end(), devices[r]) - all.begin());
    state->context = context;
    state->sycl_device = devices[r];
    state->queue = queues[r];
    state->kernels = kernels[r];
    state->bound = bound;
    state->memory = memory;
    team.emplace_back(std::move(state));
  }
  return team;
}

sycl::queue& sycl_queue(const Team& team) {
  TPF_CHECK_ARG(team.state() != nullptr, "sycl_queue", "team is an empty handle");
  TPF_CHECK_ARG(team.backend() == Backend::kSycl, "sycl_queue",
                "team is not a SYCL team (backend " << int(team.backend()) << ")");
  return *impl::sycl_state(*team.state()).queue;
}

std::vector<Team> create_sycl_team(int world_size, const TeamOptions& options) {
  TPF_CHECK_ARG(world_size >= 1 && world_size <= kMaxWorldSize, "create_sycl_team",
                "world_size must be in [1, " << kMaxWorldSize << "], got " << world_size);
  const sycl::device device{sycl::default_selector_v};
  return create_sycl_team(std::vector<sycl::device>(size_t(world_size), device), options);
}

}  // namespace tpfuse
