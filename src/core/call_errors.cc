// What Team::check (and the CPU backend, at once) says of a rank's error record (session.h): the
// peer, and for ranks that disagree the first field that differs with both values.
#include <sstream>
#include <string>

#include "core/error.h"
#include "core/team_state.h"
#include "tpfuse/impl/session.h"

namespace tpfuse::impl {
namespace {

const char* op_name(uint32_t op) {
  switch (CallOp(op)) {
    case CallOp::kRowsOneShot:
      return "one-shot all-reduce (+ add + RMSNorm)";
    case CallOp::kRowsTwoShot:
      return "two-shot all-reduce (+ add + RMSNorm)";
    case CallOp::kQkOneShot:
      return "fused QK norm";
    case CallOp::kRejected:
      return "a rejected call";
    case CallOp::kNccl:
      return "the NCCL path";
    case CallOp::kFailed:
      return "a call of a failed team";
  }
  return "an unknown op";
}

const char* dtype_code_name(uint32_t code) {
  return code <= 2 ? dtype_name(DType(int(code))) : "unknown";
}

// The first field of word[0] that differs, written as "<field>: <here> here, <there> on rank P".
void describe_word0(std::ostream& out, uint32_t mine, uint32_t theirs, int peer) {
  const auto field = [](uint32_t word, int shift, uint32_t mask) { return (word >> shift) & mask; };
  const auto stand_in = [](uint32_t word) {
    return (word & kStandInQkBit) != 0 ? "the NCCL path of the QK norm"
                                       : "the NCCL path of a row call";
  };
  if (field(mine, 0, 0xf) == uint32_t(CallOp::kNccl) &&
      field(theirs, 0, 0xf) == field(mine, 0, 0xf) &&
      (mine & kStandInQkBit) != (theirs & kStandInQkBit)) {
    out << "the op: " << stand_in(mine) << " here, " << stand_in(theirs) << " on rank " << peer;
  } else if (field(mine, 0, 0xf) != field(theirs, 0, 0xf)) {
    out << "the op / algorithm: " << op_name(field(mine, 0, 0xf)) << " here, "
        << op_name(field(theirs, 0, 0xf)) << " on rank " << peer;
  } else if (field(mine, 4, 0xf) != field(theirs, 4, 0xf)) {
    out << "dtype: " << dtype_code_name(field(mine, 4, 0xf)) << " here, "
        << dtype_code_name(field(theirs, 4, 0xf)) << " on rank " << peer;
  } else if (field(mine, 8, 1) != field(theirs, 8, 1)) {
    out << "residual: " << (field(mine, 8, 1) ? "given" : "none") << " here, "
        << (field(theirs, 8, 1) ? "given" : "none") << " on rank " << peer;
  } else if (field(mine, 9, 1) != field(theirs, 9, 1)) {
    out << "the epilogue: " << (field(mine, 9, 1) ? "add + RMSNorm" : "a plain sum") << " here, "
        << (field(theirs, 9, 1) ? "add + RMSNorm" : "a plain sum") << " on rank " << peer;
  } else if (field(mine, 10, 3) != field(theirs, 10, 3)) {
    out << "norm_weight: " << norm_weight_name(NormWeight(int(field(mine, 10, 3)))) << " here, "
        << norm_weight_name(NormWeight(int(field(theirs, 10, 3)))) << " on rank " << peer;
  } else if (field(mine, 0, 0xf) != uint32_t(CallOp::kQkOneShot) &&
             field(mine, 16, 1) != field(theirs, 16, 1)) {
    out << "the input: " << (field(mine, 16, 1) ? "a MoE combine" : "input") << " here, "
        << (field(theirs, 16, 1) ? "a MoE combine" : "input") << " on rank " << peer;
  } else if (field(mine, 0, 0xf) != uint32_t(CallOp::kQkOneShot)) {
    // Row calls keep their FP8 output's mode where the QK norm keeps its RoPE style.
    out << "quant: " << quant_mode_name(QuantMode(int(field(mine, 12, 3)))) << " here, "
        << quant_mode_name(QuantMode(int(field(theirs, 12, 3)))) << " on rank " << peer;
  } else {
    out << "rope: style " << field(mine, 12, 3) << " here, " << field(theirs, 12, 3) << " on rank "
        << peer;
  }
}

// Headers alike but for their hash: when the peer's is this rank's signature as a nearby call
// number folds it (sequenced_signature), how far that number is from this rank's; else 0.
int call_number_step(const ErrorRecord& e) {
  const uint32_t unsequenced = e.mine.word[3] ^ sequence_fold(e.sequence);
  for (int step = -8; step <= 8; ++step) {
    if (step != 0 &&
        (unsequenced ^ sequence_fold(e.sequence + uint32_t(step))) == e.theirs.word[3]) {
      return step;
    }
  }
  return 0;
}

std::string describe_mismatch(const ErrorRecord& e, int rank) {
  const int peer = int(e.failure_peer);
  std::ostringstream out;
  out << "rank " << rank << ": rank " << peer << "'s call disagrees with this rank's, in ";
  // Tokens first: the likeliest disagreement, and with no tokens an empty batch's null row
  // pointers also read as another epilogue.
  if (e.mine.word[1] != e.theirs.word[1]) {
    out << "tokens: " << e.mine.word[1] << " here, " << e.theirs.word[1] << " on rank " << peer;
  } else if (e.mine.word[0] != e.theirs.word[0]) {
    describe_word0(out, e.mine.word[0], e.theirs.word[0], peer);
  } else if (e.mine.word[2] != e.theirs.word[2]) {
    out << "the width (hidden, or q_global_size): " << e.mine.word[2] << " here, "
        << e.theirs.word[2] << " on rank " << peer;
  } else if (const int step = call_number_step(e)) {
    out << "the call: this rank's call " << e.sequence << " met rank " << peer << "'s call "
        << ((e.sequence + uint32_t(step)) & 0x7fffffffu)
        << " (a rank made a call its peers did not make, or skipped one)";
  } else {
    out << "eps or the MoE top-k (or, for the QK norm, k_global_size, head_dim, rotary_dim or "
           "kv_replicas)";
  }
  out << ". Every rank must make the same call (op, algorithm, dtype, epilogue, tokens, widths, "
         "eps); that call's outputs are NaN and the team is failed: create a new one";
  return out.str();
}

// Reported once: the record takes the next per-call error (session.h's call_generation lets the
// GPU claim it again).
void clear_call_error(ErrorRecord& e) {
  __atomic_store_n(&e.call_error, 0u, __ATOMIC_RELEASE);
  __atomic_fetch_add(&e.call_generation, 1u, __ATOMIC_RELEASE);
}

}  // namespace

std::string peer_note(const TeamState& team) {
  const ErrorRecord& e = *team.exchange.errors;
  if (!team.peer_status) return "";
  const CallError failure = CallError(__atomic_load_n(&e.failure, __ATOMIC_ACQUIRE));
  if (failure == CallError::kTimeout) return team.peer_status(int(e.failure_peer));
  // A peer's timeout, announced: what is known of the rank it waited for.
  const FailureMark mark{e.theirs};
  if (failure == CallError::kPeerFailed && mark.kind() == CallError::kTimeout) {
    const std::string status = team.peer_status(mark.named_rank());
    return status.empty() ? "" : " (rank " + std::to_string(mark.named_rank()) + status + ")";
  }
  return "";
}

std::string describe_failure(const ErrorRecord& e, int rank, int device,
                             const std::string& peer_note) {
  const uint32_t failure = __atomic_load_n(&e.failure, __ATOMIC_ACQUIRE);
  if (CallError(failure) == CallError::kMismatch) return describe_mismatch(e, rank);
  if (CallError(failure) == CallError::kPeerFailed) {
    const FailureMark mark{e.theirs};
    std::ostringstream out;
    out << "rank " << rank;
    if (device >= 0) out << " (device " << device << ")";
    out << ": rank " << mark.marking_rank() << " failed the team";
    if (mark.sequence() != kUnknownSequence) out << " in its call " << mark.sequence();
    out << " ("
        << (mark.kind() == CallError::kTimeout    ? "it timed out waiting for rank "
            : mark.kind() == CallError::kMismatch ? "its call disagreed with rank "
                                                  : "it was told of a failure by rank ")
        << mark.named_rank() << peer_note
        << "; its own error says more) and told every rank: a call it gave up on is never "
           "combined with a later one. Every call of every rank of this team now fails; create "
           "a new team";
    return out.str();
  }
  std::ostringstream out;
  out << "rank " << rank;
  if (device >= 0) out << " (device " << device << ")";
  out << ": a call timed out waiting for rank " << e.failure_peer << peer_note
      << " (it did not make the call: it may have died or hung, rejected its arguments where "
         "it could not take its turn (its own stream was bad, or its call went to NCCL), made "
         "a call that went to NCCL while this one was fused, or, with an in-process team, been "
         "driven from the thread that waited; each rank needs its own thread); the team is "
         "failed, create a new one";
  return out.str();
}

void report_call_errors(const TeamState& team) {
  ErrorRecord& e = *team.exchange.errors;
  if (__atomic_load_n(&e.failure, __ATOMIC_ACQUIRE) != 0) {
    TPF_FAIL(describe_failure(e, team.rank(), team.device, peer_note(team)));
  }
  const uint32_t call_error = __atomic_load_n(&e.call_error, __ATOMIC_ACQUIRE);
  if (CallError(call_error) == CallError::kBadPosition) {
    const int64_t token = e.position_token, position = e.position, rows = e.max_position;
    clear_call_error(e);
    TPF_FAIL("rank " << team.rank() << ": allreduce_qk_rmsnorm: positions[" << token
                     << "] = " << position << " is outside [0, max_position = " << rows
                     << "); that token's q and k outputs are NaN (the first such token of a call "
                        "since the last check)");
  }
  if (call_error != 0) {
    const uint32_t peer = e.call_peer;
    clear_call_error(e);  // the team goes on
    TPF_FAIL("rank " << team.rank() << ": rank " << peer
                     << " rejected its part of a call (its own error says why); this rank's "
                        "outputs of that call are NaN, and the team goes on");
  }
}

}  // namespace tpfuse::impl
