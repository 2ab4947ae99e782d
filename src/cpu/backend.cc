// The CPU backend's BackendOps: ranks are threads of one process or processes of one host,
// calls block the calling rank thread, and there is no stream.
#include <string>

#include "core/backend.h"
#include "core/error.h"
#include "core/validate.h"
#include "cpu/kernels.h"

namespace tpfuse::impl {
namespace {

// Runs a call; a timeout it throws also says what the team knows of the missing peer's process.
template <typename Call>
void noting_peer(const TeamState& team, Call&& call) {
  try {
    call();
  } catch (const Error& error) {
    const std::string note = peer_note(team);
    if (note.empty()) throw;
    throw Error(std::string(error.what()) + note);
  }
}

class CpuBackend final : public BackendOps {
 public:
  Backend kind() const override { return Backend::kCpu; }

  void validate_call(const TeamState* team, std::initializer_list<NamedPointer>,
                     cudaStream_t stream, const char* op) const override {
    TPF_CHECK_ARG(
        stream == nullptr, op,
        "stream must be null for " << (team != nullptr ? "a CPU-backend team" : "the CPU backend"));
  }
  void validate_positions(const QkNormArgs& args, const char* op) const override {
    validate_positions_on_host(args, op);
  }

  void oneshot(const TeamState& team, const RowCall& call, DType dtype,
               const RowEpilogueKind& epilogue, cudaStream_t) const override {
    const CpuMoeInput run(call, dtype, epilogue);
    noting_peer(team, [&] { cpu_oneshot(run.call(), dtype, run.epilogue()); });
  }
  void twoshot(const TeamState& team, const RowCall& call, DType dtype,
               const RowEpilogueKind& epilogue, cudaStream_t) const override {
    const CpuMoeInput run(call, dtype, epilogue);
    noting_peer(team, [&] { cpu_twoshot(run.call(), dtype, run.epilogue()); });
  }
  void nccl_path(const TeamState& team, const RowCall& call, DType dtype,
                 const RowEpilogueKind& epilogue, cudaStream_t) const override {
    const CpuMoeInput run(call, dtype, epilogue);
    noting_peer(team, [&] { cpu_nccl_path(run.call(), dtype, run.epilogue()); });
  }
  void local_epilogue(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue,
                      cudaStream_t) const override {
    const CpuMoeInput run(call, dtype, epilogue);
    cpu_local_epilogue(run.call(), dtype, run.epilogue());
  }

  void qk_oneshot(const TeamState& team, const QkCall& call, DType dtype,
                  cudaStream_t) const override {
    noting_peer(team, [&] { cpu_qk_rmsnorm(call, dtype, QkPass::kFused); });
  }
  void qk_nccl_path(const TeamState& team, const QkCall& call, DType dtype,
                    cudaStream_t) const override {
    noting_peer(team, [&] { cpu_qk_nccl_path(call, dtype); });
  }
  void qk_local(const QkCall& call, DType dtype, QkPass pass, cudaStream_t) const override {
    cpu_qk_rmsnorm(call, dtype, pass);
  }

  bool has_nccl_path(const TeamState&) const override { return true; }

  void absent_call(const TeamState& team, const CallSignature& signature,
                   cudaStream_t) const override {
    noting_peer(team, [&] { cpu_absent_call(team.exchange, signature); });
  }

  void check(const TeamState& team) const override { report_call_errors(team); }
};

}  // namespace

const BackendOps& cpu_backend() {
  static const CpuBackend backend;
  return backend;
}

}  // namespace tpfuse::impl
