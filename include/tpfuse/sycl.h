// tpfuse with SYCL's types: the entry points of tpfuse.h with a sycl::queue in place of the
// Stream (each forwards, a pointer to the queue as the Stream's handle, for the call's duration),
// and the SYCL teams over given devices.
//
// Compiles without the SYCL headers: sycl::queue and sycl::device are declared here as Intel's
// SYCL runtime declares them (namespace sycl, inline namespace _V1), so either header may come
// first. A call's queue must be in order (sycl::property::queue::in_order) and belong to the
// team's context and the rank's device: a rank's calls run one after another, each one kernel
// submission, with no host wait. Team::check waits for the rank's last call and reports.
#pragma once

#include <vector>

#include "tpfuse/tpfuse.h"

namespace sycl {
inline namespace _V1 {
class queue;
class device;
}  // namespace _V1
}  // namespace sycl

namespace tpfuse {

// The Stream that carries a SYCL queue.
inline Stream sycl_stream(sycl::queue& queue) {
  return Stream{&queue};
}

inline Algorithm allreduce_add_rmsnorm(const Team& team, const AddRmsNormArgs& args,
                                       sycl::queue& queue) {
  return allreduce_add_rmsnorm(team, args, sycl_stream(queue));
}

inline Algorithm allreduce(const Team& team, const void* input, void* out, int64_t count,
                           DType dtype, sycl::queue& queue,
                           Algorithm algorithm = Algorithm::kAuto) {
  return allreduce(team, input, out, count, dtype, sycl_stream(queue), algorithm);
}

inline Algorithm allreduce_qk_rmsnorm(const Team& team, const QkNormArgs& args,
                                      sycl::queue& queue) {
  return allreduce_qk_rmsnorm(team, args, sycl_stream(queue));
}

inline void qk_sum_squares(Backend backend, const QkNormArgs& args, bool count_k, float* sums,
                           sycl::queue& queue) {
  qk_sum_squares(backend, args, count_k, sums, sycl_stream(queue));
}

inline void qk_rmsnorm_from_sums(Backend backend, const QkNormArgs& args, const float* sums,
                                 sycl::queue& queue) {
  qk_rmsnorm_from_sums(backend, args, sums, sycl_stream(queue));
}

inline void reject_call(const Team& team, sycl::queue& queue) {
  reject_call(team, sycl_stream(queue));
}

inline void add_rmsnorm(Backend backend, const AddRmsNormArgs& args, sycl::queue& queue) {
  add_rmsnorm(backend, args, sycl_stream(queue));
}

// A team of ranks of this process on SYCL devices: rank i on devices[i]. Devices may repeat
// (ranks sharing a device reach each other through its USM); distinct devices must be of one
// platform, whose default context the team uses (a queue made from a device has it: memory
// allocated with such a queue is the team's to use) and reach each other's device memory (peer
// access; its absence is an error naming the pair). Every rank polls its peers from a running
// kernel, so the ranks of a device must all run at once: a team with more ranks on a device than it
// has compute units is refused, naming the ranks and the compute units (never a hang). Each rank's
// workspace is device memory (3 * world_size * packet_bytes), its error record host memory the host
// reads without waiting. The kernels are compiled here (src/sycl/compiler.h: cached in memory and
// on disk), and the poll bound that makes peer_timeout_seconds is calibrated here (docs/sycl.md
// says how).
std::vector<Team> create_sycl_team(const std::vector<sycl::device>& devices,
                                   const TeamOptions& options = {});

// A SYCL team of one rank per process on this host, as serving engines run: rank `rank` of
// `world_size` on `device`. The id comes from create_cpu_team_id(), made on one rank and passed to
// the others through any channel; the creation is collective and bootstraps over a CPU team of
// the same id (shared memory), as create_cuda_team(id, ...) does. The calls, their errors and
// Team::check are the in-process team's. Each rank's workspace (3 * world_size * packet_bytes):
// - on a CPU device (Intel's OpenCL CPU device: USM system allocations, kernels run in the
//   process that queued them): host memory every rank's process maps (a memfd the rank makes,
//   its pages reserved; its peers open it through /proc/<pid>/fd, so the ranks' processes must
//   be of one user and one PID namespace); peer_memory() is "sycl shared memory";
// - on a GPU: device memory exported with sycl_ext_oneapi_ipc_memory and opened by every peer
//   (ranks on different devices need peer access; its absence is an error naming them);
//   peer_memory() is "sycl ipc". Written for Intel GPUs and not run on one yet (docs/sycl.md).
// Checked, with the same error on every rank (each naming the rank and what differs): every
// rank's setup (a failure names the rank, with its message); packet_bytes, peer_stores and
// peer_memory as rank 0's (peer_stores must be true: there is no NCCL path); the devices all CPU
// devices or all GPUs; and no more ranks on a device than it has compute units, counted over the
// team's processes (the error names the ranks and the units; on the CPU device the units are the
// CPUs the ranks' processes may run on together: ranks pinned to one CPU share it). A rank given
// another world_size is told by the bootstrap ("world_size: 2 on rank 0, 3 here"); the others
// name it as not joined. A rank's kernels are compiled (or loaded from the caches: minutes cold)
// before it joins, so peer_timeout_seconds must allow for a peer's cold compile; then each wait
// for the peers lasts up to peer_timeout_seconds + handshake_timeout_seconds (0 peer timeout:
// forever), after which the ranks that never joined are named, never waited for. Last, a
// handshake: the team's first call (an allreduce of each rank's number, its sum checked) proves
// that every rank's stores arrive in every peer; its failure is an error of the creation. A peer
// that dies later is reported by the call that waits for it, with its process ("has exited").
Team create_sycl_team(const CpuTeamId& id, int rank, int world_size, const sycl::device& device,
                      const TeamOptions& options = {});

// A SYCL rank's own in-order queue: the team's context and the rank's device, where its calls go
// when they pass no queue. Make more queues of the same context and device from it (in order).
sycl::queue& sycl_queue(const Team& team);

}  // namespace tpfuse
