// The CPU backend's calls (cpu/rows.cc, cpu/qknorm.cc); cpu/backend.cc binds them to BackendOps.
#pragma once

#include <cstdint>

#include "core/calls.h"
#include "tpfuse/impl/epilogue.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse::impl {

class BackendOps;
// The CPU backend (cpu/backend.cc): what the CPU teams (cpu/team.cc, cpu/process_team.cc) run on.
const BackendOps& cpu_backend();

void cpu_oneshot(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue);
void cpu_twoshot(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue);
void cpu_local_epilogue(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue);
// The NCCL path's stand-in, with its rounding: a rank-ordered all-reduce rounded to dtype
// (one-shot exchanges of at most the workspace's capacity), then the local epilogue.
void cpu_nccl_path(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue);
// Rank-ordered all-reduce of rows x row_elements (row bytes a multiple of 16), rounded to dtype,
// in one-shot exchanges of at most a packet each (rows wider than a packet cut into pieces),
// whose headers carry `user`, the signature of the call the all-reduce serves.
void cpu_allreduce_rows(const Exchange& exchange, const CallSignature& user, const void* input,
                        void* out, int64_t rows, int64_t row_elements, DType dtype);

// A row call as the CPU row code runs it: with the MoE finalize (epilogue.moe), its combine
// computed into the rank thread's buffer (cpu/moe.cc; valid until the thread's next MoE call)
// that call().input points to, and epilogue() the same epilogue reading input; otherwise the call
// as given.
class CpuMoeInput {
 public:
  CpuMoeInput(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue);
  const RowCall& call() const { return call_; }
  const RowEpilogueKind& epilogue() const { return epilogue_; }

 private:
  RowCall call_;
  RowEpilogueKind epilogue_;
};

void cpu_qk_rmsnorm(const QkCall& call, DType dtype, QkPass pass);
// A call this rank makes without data (a rejection, or no tokens): src/cpu/absent.cc.
void cpu_absent_call(const Exchange& exchange, const CallSignature& signature);
void cpu_qk_nccl_path(const QkCall& call, DType dtype);

}  // namespace tpfuse::impl
