// What Team::check (and the CPU backend, at once) says of a rank's error record (session.h): the
// peer, and for ranks that disagree the first field that differs with both values.
#include <sstream>
#include <string>

#include "core/error.h"
#include "core/signature_fields.h"
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

// The first field of word[0] that differs (signature_fields.h), written as
// "<field>: <here> here, <there> on rank P".
void describe_word0(std::ostream& out, uint32_t mine, uint32_t theirs, int peer) {
  const auto stand_in = [](uint32_t word) {
    return (word & kStandInQkBit) != 0 ? "the NCCL path of the QK norm"
                                       : "the NCCL path of a row call";
  };
  const uint32_t op = kOpField.decode(mine);
  if (op == uint32_t(CallOp::kNccl) && kOpField.decode(theirs) == op &&
      (mine & kStandInQkBit) != (theirs & kStandInQkBit)) {
    out << "the op: " << stand_in(mine) << " here, " << stand_in(theirs) << " on rank " << peer;
    return;
  }
  if (op != kOpField.decode(theirs)) {
    out << kOpField.name << ": " << op_name(op) << " here, " << op_name(kOpField.decode(theirs))
        << " on rank " << peer;
    return;
  }
  const SignatureOf kind =
      op == uint32_t(CallOp::kQkOneShot) ? SignatureOf::kQk : SignatureOf::kRows;
  for (const SignatureField& field : kSignatureFields) {
    if (field.of != SignatureOf::kAll && field.of != kind) continue;
    if (field.decode(mine) == field.decode(theirs)) continue;
    out << field.name << ": " << field.describe(field.decode(mine)) << " here, "
        << field.describe(field.decode(theirs)) << " on rank " << peer;
    return;
  }
  // Bits no field holds (none are set today).
  out << "the call header: 0x" << std::hex << mine << " here, 0x" << theirs << std::dec
      << " on rank " << peer;
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
