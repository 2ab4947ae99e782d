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

// A SYCL rank's own in-order queue: the team's context and the rank's device, where its calls go
// when they pass no queue. Make more queues of the same context and device from it (in order).
sycl::queue& sycl_queue(const Team& team);

}  // namespace tpfuse
