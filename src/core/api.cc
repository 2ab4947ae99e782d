// The public entry points: validate, choose the algorithm, then hand the call to the team's
// backend (core/backend.h).
#include <algorithm>
#include <cstdint>
#include <limits>

#include "core/backend.h"
#include "core/calls.h"
#include "core/error.h"
#include "core/selection.h"
#include "core/signature_fields.h"
#include "core/team_state.h"
#include "core/validate.h"
#include "tpfuse/impl/enums.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
  }
  return "unknown";
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat16:
      return 2;
    case DType::kBFloat16:
      return 2;
  }
  return 0;
}

const char* norm_weight_name(NormWeight weight) {
  return impl::enumerator_name(weight);
}

const char* quant_mode_name(QuantMode mode) {
  const impl::OutputInfo* output = impl::find_output(mode);
  return output != nullptr ? output->description : "unknown";
}

namespace {
const impl::TeamState& state_of(const Team& team) {
  if (team.state() == nullptr)
    throw Error("tpfuse: the Team handle is empty (default-constructed)");
  return *team.state();
}
}  // namespace

int Team::rank() const {
  return state_of(*this).rank();
}
int Team::world_size() const {
  return state_of(*this).world_size();
}
Backend Team::backend() const {
  return state_of(*this).ops->kind();
}
int Team::device() const {
  return state_of(*this).device;
}
size_t Team::packet_bytes() const {
  return state_of(*this).packet_bytes();
}

int64_t Team::max_tokens(int64_t hidden, DType dtype, Algorithm algorithm) const {
  const impl::TeamState& state = state_of(*this);
  if (hidden <= 0) return 0;
  const size_t row_bytes = size_t(hidden) * dtype_size(dtype);
  const int64_t oneshot = int64_t(state.packet_bytes() / row_bytes);
  const int64_t twoshot =
      impl::twoshot_max_tokens(state.world_size(), state.packet_bytes(), row_bytes);
  switch (algorithm) {
    case Algorithm::kOneShot:
      return state.fused ? oneshot : 0;
    case Algorithm::kTwoShot:
      return state.fused ? twoshot : 0;
    case Algorithm::kNccl:
    case Algorithm::kAuto:
      if (state.ops->has_nccl_path(state)) {
        return std::numeric_limits<int64_t>::max();
      }
      return algorithm == Algorithm::kNccl || !state.fused ? 0 : std::max(oneshot, twoshot);
  }
  return 0;
}

Algorithm Team::choose(int64_t tokens, int64_t hidden, DType dtype, Algorithm requested) const {
  const char* op = "Team::choose";
  TPF_CHECK_ARG(tokens >= 0, op, "tokens must be >= 0, got " << tokens);
  TPF_CHECK_ARG(hidden > 0, op, "hidden must be > 0, got " << hidden);
  TPF_CHECK_ARG(impl::is_known(dtype), op, "dtype " << int(dtype) << " is unknown");
  return impl::choose_algorithm(state_of(*this), tokens, hidden, dtype, requested, op);
}

const std::string& Team::fallback_reason() const {
  return state_of(*this).fallback_reason;
}

const std::string& Team::peer_memory() const {
  return state_of(*this).peer_memory;
}

void Team::check() const {
  const impl::TeamState& state = state_of(*this);
  state.ops->check(state);
}

namespace impl {

void init_team_state(TeamState& state, const BackendOps& ops, int rank, int world_size,
                     const TeamOptions& options, const std::string& device_name,
                     const std::string& fallback_reason, const std::string& peer_memory) {
  state.ops = &ops;
  state.exchange.rank = rank;
  state.exchange.world_size = world_size;
  state.exchange.packet_bytes = options.packet_bytes;
  state.exchange.header_area = header_offset(0, 0, world_size, options.packet_bytes);
  state.exchange.timeout_ns = uint64_t(options.peer_timeout_seconds * 1e9);
  state.device_name = device_name;
  state.selection = selection_for(device_name, world_size);
  state.fused = fallback_reason.empty();
  state.fallback_reason = fallback_reason;
  state.peer_memory = peer_memory;
}

RowCall make_row_call(const TeamState* team, const AddRmsNormArgs& args) {
  RowCall call{};
  if (team != nullptr) call.exchange = team->exchange;
  call.input = args.input;
  call.residual = args.residual;
  call.gamma = args.gamma;
  call.residual_out = args.residual_out;
  call.norm_out = args.norm_out;
  call.tokens = args.tokens;
  call.hidden = args.hidden;
  call.eps = args.eps;
  call.quant = args.quant;
  call.quant_out = args.quant_out;
  call.quant_scale = args.quant_scale;
  call.scales_out = args.scales_out;
  call.scales_column_major = args.scales_column_major;
  call.moe_rows = args.moe_expert_rows;
  call.moe_weights = args.moe_weights;
  call.moe_shared = args.moe_shared;
  call.moe_topk = args.moe_topk;
  call.moe_weights_in_dtype = args.moe_weights_in_dtype;
  return call;
}

RowEpilogueKind row_epilogue_of(const AddRmsNormArgs& args) {
  return {args.residual != nullptr, true, args.norm_weight, args.quant != QuantMode::kNone,
          args.moe_expert_rows != nullptr};
}

QkCall make_qk_call(const TeamState* team, const QkNormArgs& args) {
  QkCall call{};
  if (team != nullptr) call.exchange = team->exchange;
  const int64_t row = args.q_size + 2 * args.kv_size;
  const size_t element = dtype_size(args.dtype);
  call.qkv = args.qkv;
  call.q_out = args.q_out != nullptr ? args.q_out : const_cast<void*>(args.qkv);
  call.q_out_stride = args.q_out != nullptr ? args.q_size : row;
  // In place, k is qkv's k slice; a null qkv (rejected later, by validation) stays null: no
  // pointer arithmetic on it (found by tests/fuzz/fuzz_arguments.cc under UBSan).
  call.k_out = args.k_out != nullptr ? args.k_out
               : args.qkv == nullptr
                   ? nullptr
                   : static_cast<char*>(const_cast<void*>(args.qkv)) + args.q_size * element;
  call.k_out_stride = args.k_out != nullptr ? args.kv_size : row;
  call.q_gamma = args.q_gamma;
  call.k_gamma = args.k_gamma;
  call.tokens = args.tokens;
  call.q_size = args.q_size;
  call.kv_size = args.kv_size;
  call.q_global_size = args.q_global_size;
  call.k_global_size = args.k_global_size;
  call.counts_k = team == nullptr || team->rank() % args.kv_replicas == 0;
  call.eps = args.eps;
  call.rope = args.rope;
  call.head_dim = args.head_dim;
  call.rotary_dim = args.rotary_dim;
  call.positions = args.positions;
  call.cos_sin_cache = args.cos_sin_cache;
  call.max_position = args.max_position;
  return call;
}

CallSignature row_signature(CallOp op, DType dtype, const RowEpilogueKind& epilogue, int64_t tokens,
                            int64_t hidden, float eps, QuantMode quant, int moe_topk) {
  const uint32_t word0 = kOpField.encode(uint32_t(op)) | kDTypeField.encode(uint32_t(dtype)) |
                         kResidualField.encode(epilogue.residual) |
                         kNormField.encode(epilogue.norm) |
                         kWeightField.encode(uint32_t(epilogue.weight)) |
                         kOutputField.encode(uint32_t(quant)) | kMoeField.encode(epilogue.moe);
  const uint32_t extra[] = {epilogue.norm ? float_bits(eps) : 0u,
                            epilogue.moe ? uint32_t(moe_topk) : 0u};
  return make_signature(word0, uint32_t(tokens), uint32_t(hidden), extra, 2);
}

CallSignature qk_signature(const QkNormArgs& a) {
  const uint32_t word0 = kOpField.encode(uint32_t(CallOp::kQkOneShot)) |
                         kDTypeField.encode(uint32_t(a.dtype)) |
                         kRopeField.encode(uint32_t(a.rope));
  const uint32_t extra[] = {uint32_t(a.k_global_size), uint32_t(a.head_dim),
                            uint32_t(a.rope != RopeStyle::kNone ? a.rotary_dim : 0),
                            uint32_t(a.kv_replicas), float_bits(a.eps)};
  return make_signature(word0, uint32_t(a.tokens), uint32_t(a.q_global_size), extra, 5);
}

namespace {

const TeamState& team_of(const Team& team, const char* op) {
  TPF_CHECK_ARG(team.state() != nullptr, op, "team is an empty handle");
  return *team.state();
}

// Whether this rank's turn in a call can be taken without data: the team has peers, has not
// failed, and exchanges through peer stores (or its NCCL path takes turns too, as the CPU's
// stand-in does).
bool takes_turns(const TeamState& state) {
  return state.world_size() > 1 && !team_failed(state) &&
         (state.fused || state.ops->nccl_path_takes_turns());
}

// Whether a rejected call's turn reaches its peers when their call goes to `algorithm`: the
// fused paths' absent turn does, and so does an NCCL path that takes turns. On a team without an
// NCCL path (CUDA IPC, SYCL) no peer's call goes there: a rejected call that asked for kNccl
// takes the absent turn that reaches a peer whose call runs fused.
bool turn_reaches(const TeamState& state, Algorithm algorithm) {
  return algorithm != Algorithm::kNccl || state.ops->nccl_path_takes_turns() ||
         !state.ops->has_nccl_path(state);
}

// This rank's turn, without data, in a call its peers make on the NCCL path of a backend whose
// NCCL path takes no absent turns (CUDA's NCCL): its header and the call's `count` from scratch
// (BackendOps::nccl_turn), so that the peers' NCCL call completes and tells them. `count` 0:
// not known (a malformed shape), no turn. A turn that cannot be queued is left out: the caller
// is already reporting its own error.
void take_nccl_turn(const TeamState& state, size_t count, DType dtype, Stream stream) {
  if (state.world_size() == 1 || count == 0 || state.ops->nccl_path_takes_turns() ||
      !state.ops->has_nccl_path(state)) {
    return;
  }
  try {
    state.ops->nccl_turn(state, rejected_signature(), count, dtype, stream);
  } catch (const Error&) {
  }
}

// A collective call on a team that has failed (here, or announced by a peer and seen by a call
// of this rank) is refused before anything is written. A call bound for CUDA's NCCL path still
// takes its turn there (`nccl_count` elements of `dtype`; its header says the team failed), as
// NCCL would otherwise leave the peers waiting.
void refuse_if_failed(const TeamState& state, bool nccl_path, size_t nccl_count, DType dtype,
                      Stream stream) {
  if (state.world_size() > 1 && team_failed(state)) {
    if (nccl_path) take_nccl_turn(state, nccl_count, dtype, stream);
    throw RefusedCall(
        describe_failure(*state.exchange.errors, state.rank(), state.device, peer_note(state)) +
        "; this call was refused and wrote nothing");
  }
}

// The absent call of a rejected call, where the team takes turns. A turn that cannot be queued
// (the stream was what was wrong) is left out: the caller is already reporting the rejection,
// and the peers then time out.
void queue_rejected_turn(const TeamState& state, Stream stream) {
  if (!takes_turns(state)) return;
  try {
    state.ops->absent_call(state, rejected_signature(), stream);
  } catch (const Error&) {
  }
}

// A call this rank rejected takes its turn, so that its peers get an error at once and the team
// goes on: as an absent call (session.h) on the fused paths, as an all-reduce of the call's count
// on CUDA's NCCL path (the call asked for it, or its own shape would go there).
void take_rejected_turn(const TeamState& state, Algorithm requested, int64_t tokens, int64_t hidden,
                        DType dtype, Stream stream, const char* op) {
  // Only a well-formed shape says where the peers' call goes; a malformed one is this rank's
  // alone, and the peers' well-formed calls run fused.
  const bool shape_valid = tokens >= 0 && hidden > 0 && hidden <= kMaxHidden &&
                           hidden % kHiddenMultiple == 0 && is_known(dtype);
  Algorithm algorithm = requested;
  if (requested == Algorithm::kAuto && shape_valid && state.world_size() > 1) {
    try {
      algorithm = choose_algorithm(state, tokens, hidden, dtype, requested, op);
    } catch (const Error&) {
      // This shape fits no path of the team (one without NCCL): a peer whose call does fit runs
      // it fused, where the absent turn below reaches it. Throwing here instead would leave the
      // turn untaken and that peer waiting out its timeout.
    }
  }
  if (!turn_reaches(state, algorithm)) {
    // CUDA's NCCL path: the turn needs the call's count, which only a well-formed shape gives.
    take_nccl_turn(state, shape_valid ? size_t(tokens) * size_t(hidden) : 0, dtype, stream);
    return;
  }
  if (takes_turns(state)) queue_rejected_turn(state, stream);
}

Algorithm run_rows(const Team& team, const AddRmsNormArgs& args, const RowEpilogueKind& epilogue,
                   Stream stream, const char* op) {
  const TeamState& state = team_of(team, op);
  Algorithm algorithm = Algorithm::kAuto;
  try {
    validate_add_rmsnorm(args, epilogue, op);
    algorithm = choose_algorithm(state, args.tokens, args.hidden, args.dtype, args.algorithm, op);
    state.ops->validate_call(&state,
                             {{"input", args.input},
                              {"residual", args.residual},
                              {"gamma", args.gamma},
                              {"residual_out", args.residual_out},
                              {"norm_out", args.norm_out},
                              {"quant_out", args.quant_out},
                              {"quant_scale", args.quant_scale},
                              {"scales_out", args.scales_out},
                              {"moe_expert_rows", args.moe_expert_rows},
                              {"moe_weights", args.moe_weights},
                              {"moe_shared", args.moe_shared}},
                             stream, op);
  } catch (const Error&) {
    take_rejected_turn(state, args.algorithm, args.tokens, args.hidden, args.dtype, stream, op);
    throw;
  }
  if (state.world_size() == 1 && epilogue.norm) {
    // One rank has nothing to exchange: every algorithm is the local epilogue, the same bits
    // without the protocol's work (control block, headers, slot) or an all-reduce that copies.
    if (args.tokens > 0) {
      state.ops->local_epilogue(make_row_call(nullptr, args), args.dtype, epilogue,
                                state.ops->rank_stream(state, stream));
    }
    return algorithm;
  }
  refuse_if_failed(state, algorithm == Algorithm::kNccl && args.tokens > 0,
                   size_t(args.tokens) * size_t(args.hidden), args.dtype, stream);
  const CallOp call_op = algorithm == Algorithm::kOneShot   ? CallOp::kRowsOneShot
                         : algorithm == Algorithm::kTwoShot ? CallOp::kRowsTwoShot
                                                            : CallOp::kNccl;
  RowCall call = make_row_call(&state, args);
  call.signature = row_signature(call_op, args.dtype, epilogue, args.tokens, args.hidden, args.eps,
                                 args.quant, args.moe_topk);
  if (call_op == CallOp::kNccl) {
    if (args.tokens > 0) state.ops->nccl_path(state, call, args.dtype, epilogue, stream);
    return algorithm;  // no tokens: every rank skips alike, NCCL is not called
  }
  if (args.tokens == 0) {
    // Still a turn: a peer whose call has tokens learns that this one had none.
    if (state.world_size() > 1) state.ops->absent_call(state, call.signature, stream);
  } else if (algorithm == Algorithm::kOneShot) {
    state.ops->oneshot(state, call, args.dtype, epilogue, stream);
  } else {
    state.ops->twoshot(state, call, args.dtype, epilogue, stream);
  }
  return algorithm;
}

void run_qk_local(Backend backend, const QkNormArgs& args, QkCall call, QkPass pass, Stream stream,
                  const char* op) {
  validate_qk_args(args, op);
  TPF_CHECK_ARG(call.sums != nullptr, op, "sums is null");
  TPF_CHECK_ARG(reinterpret_cast<uintptr_t>(call.sums) % 8 == 0, op, "sums must be 8-byte aligned");
  const BackendOps& ops = require_backend(backend, op);
  ops.validate_call(nullptr, {}, stream, op);
  if (pass == QkPass::kNormFromSums) ops.validate_qk(nullptr, args, Algorithm::kAuto, op);
  if (args.tokens == 0) return;
  ops.qk_local(call, args.dtype, pass, stream);
}

}  // namespace
}  // namespace impl

Algorithm allreduce_add_rmsnorm(const Team& team, const AddRmsNormArgs& args, Stream stream) {
  return impl::run_rows(team, args, impl::row_epilogue_of(args), stream, "allreduce_add_rmsnorm");
}

Algorithm allreduce(const Team& team, const void* input, void* out, int64_t count, DType dtype,
                    Stream stream, Algorithm algorithm) {
  // Any positive multiple of kHiddenMultiple is carried (as rows, below).
  if (!(count > 0 && count % kHiddenMultiple == 0)) {
    if (team.state() != nullptr) {
      // The count is malformed: a turn of the fused paths only (NCCL's needs the count).
      impl::take_rejected_turn(*team.state(), algorithm, -1, kHiddenMultiple, DType::kFloat32,
                               stream, "allreduce");
    }
    TPF_CHECK_ARG(false, "allreduce",
                  "count must be a positive multiple of " << kHiddenMultiple << ", got " << count);
  }
  AddRmsNormArgs args;
  args.input = input;
  args.norm_out = out;
  args.tokens = 1;
  args.hidden = count;
  args.dtype = dtype;
  args.algorithm = algorithm;
  // A flat message is carried as rows so that it spreads over many blocks: the widest row of
  // at most kFlatRow elements (a multiple of kHiddenMultiple) that divides count. The sum does
  // not depend on how rows are cut.
  constexpr int64_t kFlatRow = 2048;
  if (count > kFlatRow && count % kHiddenMultiple == 0) {
    int64_t row = kFlatRow;
    while (count % row != 0) row -= kHiddenMultiple;
    args.hidden = row;
    args.tokens = count / row;
  }
  return impl::run_rows(team, args, impl::SumEpilogue::kKind, stream, "allreduce");
}

Algorithm allreduce_qk_rmsnorm(const Team& team, const QkNormArgs& args, Stream stream) {
  const char* op = "allreduce_qk_rmsnorm";
  const impl::TeamState& state = impl::team_of(team, op);
  Algorithm algorithm = Algorithm::kAuto;
  try {
    impl::validate_qk_args(args, op);
    algorithm = impl::choose_qk_algorithm(state, args, op);
    impl::validate_qk_rmsnorm(state, args, op);
    state.ops->validate_qk(&state, args, algorithm, op);
    state.ops->validate_call(&state,
                             {{"qkv", args.qkv},
                              {"q_out", args.q_out},
                              {"k_out", args.k_out},
                              {"q_gamma", args.q_gamma},
                              {"k_gamma", args.k_gamma},
                              {"positions", args.positions},
                              {"cos_sin_cache", args.cos_sin_cache}},
                             stream, op);
  } catch (const Error&) {
    // The QK norm takes the NCCL path only when asked or without peer stores; there its turn is
    // the all-reduce of the sums, [tokens, 2] fp32.
    const Algorithm path = state.fused ? args.algorithm : Algorithm::kNccl;
    if (!impl::turn_reaches(state, path)) {
      impl::take_nccl_turn(state, args.tokens > 0 ? size_t(2 * args.tokens) : 0, DType::kFloat32,
                           stream);
    } else if (impl::takes_turns(state)) {
      impl::queue_rejected_turn(state, stream);
    }
    throw;
  }
  impl::refuse_if_failed(state, algorithm != Algorithm::kOneShot && args.tokens > 0,
                         size_t(2 * args.tokens), DType::kFloat32, stream);
  impl::QkCall call = impl::make_qk_call(&state, args);
  call.signature = impl::qk_signature(args);
  if (algorithm != Algorithm::kOneShot) {
    if (args.tokens > 0) state.ops->qk_nccl_path(state, call, args.dtype, stream);
    return algorithm;
  }
  if (args.tokens == 0) {
    if (state.world_size() > 1) state.ops->absent_call(state, call.signature, stream);
  } else {
    state.ops->qk_oneshot(state, call, args.dtype, stream);
  }
  return algorithm;
}

void reject_call(const Team& team, Stream stream) {
  const impl::TeamState& state = impl::team_of(team, "reject_call");
  if (impl::takes_turns(state)) state.ops->absent_call(state, impl::rejected_signature(), stream);
}

void qk_sum_squares(Backend backend, const QkNormArgs& args, bool count_k, float* sums,
                    Stream stream) {
  impl::QkCall call = impl::make_qk_call(nullptr, args);
  call.sums = sums;
  call.counts_k = count_k;
  impl::run_qk_local(backend, args, call, impl::QkPass::kSums, stream, "qk_sum_squares");
}

void qk_rmsnorm_from_sums(Backend backend, const QkNormArgs& args, const float* sums,
                          Stream stream) {
  impl::QkCall call = impl::make_qk_call(nullptr, args);
  call.sums = const_cast<float*>(sums);  // only read in this pass
  impl::run_qk_local(backend, args, call, impl::QkPass::kNormFromSums, stream,
                     "qk_rmsnorm_from_sums");
}

void add_rmsnorm(Backend backend, const AddRmsNormArgs& args, Stream stream) {
  const char* op = "add_rmsnorm";
  TPF_CHECK_ARG(args.residual != nullptr, op, "residual is null");
  const impl::RowEpilogueKind epilogue = impl::row_epilogue_of(args);
  impl::validate_add_rmsnorm(args, epilogue, op);
  const impl::BackendOps& ops = impl::require_backend(backend, op);
  ops.validate_call(nullptr, {}, stream, op);
  if (args.tokens == 0) return;
  ops.local_epilogue(impl::make_row_call(nullptr, args), args.dtype, epilogue, stream);
}

}  // namespace tpfuse
