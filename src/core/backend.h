// The backend seam: what a team's calls run on. A backend is one folder (src/cpu/, src/cuda/)
// holding its BackendOps, its team creation and what a build without it says, and one line in
// src/core/registry.cc. A team holds the BackendOps it was made for, and the entry points
// (core/api.cc) call through it. Nothing here names a backend's types: the backend's stream or
// queue travels as the public Stream handle, which each backend reads as its own (the CPU
// backend: empty), and what a backend keeps per rank is its own TeamState (team_state.h).
#pragma once

#include <cstddef>
#include <initializer_list>

#include "core/calls.h"
#include "core/team_state.h"
#include "tpfuse/impl/epilogue.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse::impl {

struct NamedPointer {
  const char* name;
  const void* pointer;
};

class BackendOps {
 public:
  virtual ~BackendOps() = default;
  virtual Backend kind() const = 0;

  // Per-call checks of where the memory and the stream are, before any work (`team` null: a
  // local call). Throws naming the argument.
  virtual void validate_call(const TeamState* team, std::initializer_list<NamedPointer> pointers,
                             Stream stream, const char* op) const = 0;
  // The QK norm's checks only the backend can make, before any work (`team` null: the local
  // norm from sums): its positions where it can read them (the CPU's are host memory; the GPU's
  // and the SYCL backend's kernels bound them instead: that token NaN, the call reported), and
  // what its path for `algorithm` can carry (CUDA's NCCL path: its sums scratch).
  virtual void validate_qk(const TeamState*, const QkNormArgs&, Algorithm, const char*) const {}

  // Row calls: the two fused algorithms, the NCCL path (the all-reduce engine, then the local
  // epilogue; on the CPU a stand-in with the same rounding), and the local epilogue alone.
  virtual void oneshot(const TeamState& team, const RowCall& call, DType dtype,
                       const RowEpilogueKind& epilogue, Stream stream) const = 0;
  virtual void twoshot(const TeamState& team, const RowCall& call, DType dtype,
                       const RowEpilogueKind& epilogue, Stream stream) const = 0;
  virtual void nccl_path(const TeamState& team, const RowCall& call, DType dtype,
                         const RowEpilogueKind& epilogue, Stream stream) const = 0;
  virtual void local_epilogue(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue,
                              Stream stream) const = 0;
  // The stream a call of rank `team` that runs the local epilogue (a team of one) goes to:
  // `stream`, or where it is empty and the backend keeps a stream of the rank's own, that one
  // (the SYCL backend's in-order queue of the rank: sycl_queue(team)).
  virtual Stream rank_stream(const TeamState&, Stream stream) const { return stream; }

  // The QK norm: fused, through the NCCL path, and its local halves.
  virtual void qk_oneshot(const TeamState& team, const QkCall& call, DType dtype,
                          Stream stream) const = 0;
  virtual void qk_nccl_path(const TeamState& team, const QkCall& call, DType dtype,
                            Stream stream) const = 0;
  virtual void qk_local(const QkCall& call, DType dtype, QkPass pass, Stream stream) const = 0;

  // This rank's turn in a fused call it makes without data: a rejection (rejected_signature) or
  // a call of zero tokens (its own signature). session.h says why every rank must take it.
  virtual void absent_call(const TeamState& team, const CallSignature& signature,
                           Stream stream) const = 0;

  // This rank's turn on the NCCL path in a call it makes without data (a rejection, or a call
  // refused because the team failed): its header (`signature`; kFailed where the team failed)
  // and an all-reduce of `count` elements of `dtype` from scratch, so that the peers' call
  // completes and they are told (src/cuda/nccl_headers.cu). The CPU's stand-in takes the same
  // turn as an absent call.
  virtual void nccl_turn(const TeamState& team, const CallSignature& signature, size_t count,
                         DType dtype, Stream stream) const = 0;
  // Whether the team can run the NCCL path (the CPU's stand-in always can).
  virtual bool has_nccl_path(const TeamState& team) const = 0;
  // Whether the NCCL path's calls carry headers and take turns like the fused calls' (the CPU's
  // stand-in: a rejected call's absent turn reaches peers on it, and disagreeing calls on it are
  // told). NCCL's own all-reduce does not: a rank there must make the same call as its peers.
  virtual bool nccl_path_takes_turns() const = 0;
  // Team::check: synchronizes with the rank's work, then report_call_errors.
  virtual void check(const TeamState& team) const = 0;
};

// The backends (src/core/registry.cc, one line each): the backend of `kind` where this build has
// it, else null; require_backend and missing_backend throw naming `op` and what the build lacks.
const BackendOps* find_backend(Backend kind);
const BackendOps& require_backend(Backend kind, const char* op);
[[noreturn]] void missing_backend(Backend kind, const char* op);

}  // namespace tpfuse::impl
