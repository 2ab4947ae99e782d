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

// Fills `rows` rows of `row_bytes` bytes, `stride_bytes` apart, with `byte_pattern`'s word.
void fill_rows(void* base, int64_t rows, size_t row_bytes, size_t stride_bytes, uint32_t word) {
  if (base == nullptr) return;
  for (int64_t r = 0; r < rows; ++r) {
    char* row = static_cast<char*>(base) + size_t(r) * stride_bytes;
    for (size_t offset = 0; offset + 4 <= row_bytes; offset += 4)
      std::memcpy(row + offset, &word, 4);
    for (size_t offset = row_bytes / 4 * 4; offset < row_bytes; ++offset) row[offset] = char(word);
  }
}

// NaN in every element of any dtype (session.h's nan_vector word), and E4M3's NaN byte 0x7f.
constexpr uint32_t kNanWord = 0x7fc07fc0u;
constexpr uint32_t kFp8NanWord = 0x7f7f7f7fu;

// A fused call that failed once it had begun (a peer timed out, disagreed or rejected its part):
// every element of every output this rank's call writes becomes NaN, so that nothing of a failed
// call reads as numbers.
void poison_outputs(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue) {
  const size_t row_bytes = size_t(call.hidden) * dtype_size(dtype);
  fill_rows(call.residual_out, call.tokens, row_bytes, row_bytes, kNanWord);
  fill_rows(call.norm_out, call.tokens, row_bytes, row_bytes, kNanWord);
  if (!epilogue.quant) return;
  fill_rows(call.quant_out, call.tokens, size_t(call.hidden), size_t(call.hidden), kFp8NanWord);
  const int64_t scales = call.quant == QuantMode::kPerToken ? call.tokens
                         : call.quant == QuantMode::kPerTokenGroup128
                             ? call.tokens * (call.hidden / 128)
                             : 0;
  fill_rows(call.scales_out, 1, size_t(scales) * 4, 0, 0x7fc00000u);
}

void poison_outputs(const QkCall& call, DType dtype) {
  const size_t element = dtype_size(dtype);
  fill_rows(call.q_out, call.tokens, size_t(call.q_size) * element,
            size_t(call.q_out_stride) * element, kNanWord);
  fill_rows(call.k_out, call.tokens, size_t(call.kv_size) * element,
            size_t(call.k_out_stride) * element, kNanWord);
}

// Runs a fused call (noting_peer); an error it throws after it began makes its outputs NaN
// (poison), one that refused the call before it began leaves them as they were.
template <typename Call, typename Poison>
void poisoning(const TeamState& team, Call&& call, Poison&& poison) {
  try {
    noting_peer(team, call);
  } catch (const RefusedCall&) {
    throw;
  } catch (const Error&) {
    poison();
    throw;
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
    poisoning(
        team, [&] { cpu_oneshot(run.call(), dtype, run.epilogue()); },
        [&] { poison_outputs(call, dtype, epilogue); });
  }
  void twoshot(const TeamState& team, const RowCall& call, DType dtype,
               const RowEpilogueKind& epilogue, cudaStream_t) const override {
    const CpuMoeInput run(call, dtype, epilogue);
    poisoning(
        team, [&] { cpu_twoshot(run.call(), dtype, run.epilogue()); },
        [&] { poison_outputs(call, dtype, epilogue); });
  }
  void nccl_path(const TeamState& team, const RowCall& call, DType dtype,
                 const RowEpilogueKind& epilogue, cudaStream_t) const override {
    const CpuMoeInput run(call, dtype, epilogue);
    poisoning(
        team, [&] { cpu_nccl_path(run.call(), dtype, run.epilogue()); },
        [&] { poison_outputs(call, dtype, epilogue); });
  }
  void local_epilogue(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue,
                      cudaStream_t) const override {
    const CpuMoeInput run(call, dtype, epilogue);
    cpu_local_epilogue(run.call(), dtype, run.epilogue());
  }

  void qk_oneshot(const TeamState& team, const QkCall& call, DType dtype,
                  cudaStream_t) const override {
    poisoning(
        team, [&] { cpu_qk_rmsnorm(call, dtype, QkPass::kFused); },
        [&] { poison_outputs(call, dtype); });
  }
  void qk_nccl_path(const TeamState& team, const QkCall& call, DType dtype,
                    cudaStream_t) const override {
    poisoning(
        team, [&] { cpu_qk_nccl_path(call, dtype); }, [&] { poison_outputs(call, dtype); });
  }
  void qk_local(const QkCall& call, DType dtype, QkPass pass, cudaStream_t) const override {
    cpu_qk_rmsnorm(call, dtype, pass);
  }

  bool has_nccl_path(const TeamState&) const override { return true; }
  bool nccl_path_takes_turns() const override { return true; }

  void absent_call(const TeamState& team, const CallSignature& signature,
                   cudaStream_t) const override {
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

}  // namespace tpfuse::impl
