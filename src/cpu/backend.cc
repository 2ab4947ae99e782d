// The CPU backend's BackendOps: ranks are threads of one process or processes of one host,
// calls block the calling rank thread, and there is no stream.
#include <cstring>
#include <string>

#include "core/backend.h"
#include "core/error.h"
#include "core/validate.h"
#include "cpu/exchange.h"
#include "cpu/kernels.h"

namespace tpfuse::impl {
namespace {

// Runs a call; a timeout it throws also says what the team knows of the missing peer's process.
template <typename Call>
void noting_peer(const TeamState& team, Call&& call) {
  try {
    call();
  } catch (const RefusedCall&) {
    throw;
  } catch (const Error& error) {
    const std::string note = peer_note(team);
    if (note.empty()) throw;
    throw Error(std::string(error.what()) + note);
  }
}

// Fills every output of a call with its NaN word (outputs_of, core/calls.h).
void poison(const CallOutputs& outputs) {
  for (int i = 0; i < outputs.count; ++i) {
    const OutputRows& o = outputs.rows[i];
    if (o.base == nullptr) continue;
    for (int64_t r = 0; r < o.rows; ++r) {
      char* row = static_cast<char*>(o.base) + uint64_t(r) * o.stride_bytes;
      for (uint64_t offset = 0; offset + 4 <= o.row_bytes; offset += 4)
        std::memcpy(row + offset, &o.word, 4);
      for (uint64_t offset = o.row_bytes / 4 * 4; offset < o.row_bytes; ++offset)
        row[offset] = char(o.word);
    }
  }
}

// Runs a fused call (noting_peer); an error it throws after it began makes its outputs NaN
// (poison), one that refused the call before it began leaves them as they were.
template <typename Call, typename Poison>
void poisoning(const TeamState& team, Call&& call, Poison&& poison_outputs) {
  try {
    noting_peer(team, call);
  } catch (const RefusedCall&) {
    throw;
  } catch (const Error&) {
    poison_outputs();
    throw;
  }
}

class CpuBackend final : public BackendOps {
 public:
  Backend kind() const override { return Backend::kCpu; }

  // The CPU backend has no stream: a call runs on its rank's thread.
  void validate_call(const TeamState* team, std::initializer_list<NamedPointer>, Stream stream,
                     const char* op) const override {
    TPF_CHECK_ARG(
        stream.handle == nullptr, op,
        "stream must be null for " << (team != nullptr ? "a CPU-backend team" : "the CPU backend"));
  }
  void validate_qk(const TeamState*, const QkNormArgs& args, Algorithm,
                   const char* op) const override {
    validate_positions_on_host(args, op);
  }

  void oneshot(const TeamState& team, const RowCall& call, DType dtype,
               const RowEpilogueKind& epilogue, Stream) const override {
    const CpuMoeInput run(call, dtype, epilogue);
    poisoning(
        team, [&] { cpu_oneshot(run.call(), dtype, run.epilogue()); },
        [&] { poison(outputs_of(call, dtype, epilogue)); });
  }
  void twoshot(const TeamState& team, const RowCall& call, DType dtype,
               const RowEpilogueKind& epilogue, Stream) const override {
    const CpuMoeInput run(call, dtype, epilogue);
    poisoning(
        team, [&] { cpu_twoshot(run.call(), dtype, run.epilogue()); },
        [&] { poison(outputs_of(call, dtype, epilogue)); });
  }
  void nccl_path(const TeamState& team, const RowCall& call, DType dtype,
                 const RowEpilogueKind& epilogue, Stream) const override {
    const CpuMoeInput run(call, dtype, epilogue);
    poisoning(
        team, [&] { cpu_nccl_path(run.call(), dtype, run.epilogue()); },
        [&] { poison(outputs_of(call, dtype, epilogue)); });
  }
  void local_epilogue(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue,
                      Stream) const override {
    const CpuMoeInput run(call, dtype, epilogue);
    cpu_local_epilogue(run.call(), dtype, run.epilogue());
  }

  void qk_oneshot(const TeamState& team, const QkCall& call, DType dtype, Stream) const override {
    poisoning(
        team, [&] { cpu_qk_rmsnorm(call, dtype, QkPass::kFused); },
        [&] { poison(outputs_of(call, dtype)); });
  }
  void qk_nccl_path(const TeamState& team, const QkCall& call, DType dtype, Stream) const override {
    poisoning(
        team, [&] { cpu_qk_nccl_path(call, dtype); }, [&] { poison(outputs_of(call, dtype)); });
  }
  void qk_local(const QkCall& call, DType dtype, QkPass pass, Stream) const override {
    cpu_qk_rmsnorm(call, dtype, pass);
  }

  void nccl_turn(const TeamState& team, const CallSignature& signature, size_t, DType,
                 Stream stream) const override {
    absent_call(team, signature, stream);
  }

  bool has_nccl_path(const TeamState&) const override { return true; }
  bool nccl_path_takes_turns() const override { return true; }

  void absent_call(const TeamState& team, const CallSignature& signature, Stream) const override {
    noting_peer(team, [&] { cpu_absent_call(team.exchange, signature); });
  }

  // A peer's failure mark counts as this rank's failure even before a call of this rank saw it.
  void check(const TeamState& team) const override {
    if (!team_failed(team) && team.world_size() > 1 && mark_arrived(team.exchange)) {
      record_mark(team.exchange, load_vector(reinterpret_cast<const char*>(team.exchange.mark())));
    }
    report_call_errors(team);
  }
};

}  // namespace

const BackendOps& cpu_backend() {
  static const CpuBackend backend;
  return backend;
}

const BackendOps* cpu_backend_ops() {
  return &cpu_backend();
}

}  // namespace tpfuse::impl
