// The SYCL backend's QK norm (allreduce_qk_rmsnorm, with optional RoPE, and its local passes
// qk_sum_squares and qk_rmsnorm_from_sums), compiled at run time by the kernel compiler
// (src/sycl/compiler.h) from this file and the headers it includes, all embedded in the library
// (this one as "tpfuse/sycl/qknorm.h"). One kernel per dtype: the pass is a parameter.
//
// The arithmetic is the CPU backend's (src/cpu/qknorm.cc), through the same functions
// (tpfuse/impl/qknorm.h, epilogue.h), in the same order, so the bits are the CPU backend's:
// a token's sums of squares by one work-item, q's vectors then k's, each vector's squares summed
// by vector_sum_squares; the packets {sum q^2, sum k^2, 0, 0} summed in rank order in fp32; each
// element scaled as scale_lanes does; RoPE by rope_lanes from the normalized, unrotated row.
//
// A call is one work-group, the rank's one participant of the Lamport session (session.h with
// tpfuse/sycl/exchange.h's WorkGroupCoop), as the row kernels (rows.h says why one). The fused
// call's steps:
//   1. work-item 0 reads the call state (waits.h's group_call_state); a failed team sends nothing
//      and returns (its peers time out or see its mark: every rank reports it);
//   2. send: work-item r stores the call's header (sequenced_signature) into rank r; work-item i
//      sums tokens i, i + group size, ... and stores each token's packet into every rank's slot,
//      its own too (the packets are in no input; lamport.h: a rank's own region is read only
//      where the same call stored it);
//   3. after a group barrier (every send before any wait: rows.h's Pitfall), arrive (work-item
//      0) and clear the previous call's slot;
//   4. the headers, before any packet is used: work-item r waits for rank r's header and checks
//      it (record_header: a rejection, a disagreement, a failed peer). If any differs (or its wait
//      ended without it), every output of the call is NaN and nothing else is read: a rejected
//      or disagreeing call gives no number on any rank;
//   5. per token: work-item 0 waits for the W packets and sums them in rank order; the group
//      takes the two sums by broadcast, and every work-item normalizes its vectors of the row
//      (with RoPE: into the stage, a row of fp32 in work-group local memory, then after a barrier
//      rotates its vectors from it); one rounding to the output type;
//   6. a wait that ended without its packet (a timeout, a failure of the team) makes every output
//      of the call NaN at the end, as on the CPU and the GPU.
// A position outside [0, max_position) is checked on the device (the host cannot read device
// memory without waiting): that token's outputs are NaN, nothing of the cache is read for it,
// and the first such token since the last Team::check is recorded (CallError::kBadPosition),
// which Team::check reports naming it. The local passes record nothing (no team): the NaN says it.
// Memory ordering: every protocol word through exchange.h's release stores and acquire loads; the
// stage is read across work-items only after a group barrier.
#pragma once

#include <sycl/sycl.hpp>

#include <cstdint>

#include "tpfuse/impl/epilogue.h"
#include "tpfuse/impl/lamport.h"
#include "tpfuse/impl/numeric.h"
#include "tpfuse/impl/qknorm.h"
#include "tpfuse/impl/session.h"
#include "tpfuse/limits.h"
#include "tpfuse/sycl/calls.h"
#include "tpfuse/sycl/exchange.h"
#include "tpfuse/sycl/waits.h"

namespace tpfuse::impl::sycl_device {

// This rank's {sum q^2, sum k^2} of one token (k as 0 where this rank does not count it), in the
// CPU backend's order.
template <typename T>
void qk_token_sums(const SyclQkCall& p, int64_t token, float& sum_q, float& sum_k) {
  constexpr int kElements = Packed<T>::kElements;
  const int64_t q_vectors = p.q_size / kElements;
  const int64_t kv_vectors = p.kv_size / kElements;
  const Vec16* row = static_cast<const Vec16*>(p.qkv) + token * (q_vectors + 2 * kv_vectors);
  sum_q = 0.0f;
  sum_k = 0.0f;
  for (int64_t v = 0; v < q_vectors; ++v) sum_q += vector_sum_squares<T>(row[v]);
  if (!p.counts_k) return;
  for (int64_t v = 0; v < kv_vectors; ++v) sum_k += vector_sum_squares<T>(row[q_vectors + v]);
}

// Output vector c of a token's row: q's vectors, then k's.
template <typename T>
Vec16* qk_output(const SyclQkCall& p, int64_t token, int64_t c) {
  constexpr int kElements = Packed<T>::kElements;
  const int64_t q_vectors = p.q_size / kElements;
  return c < q_vectors ? static_cast<Vec16*>(p.q_out) + token * (p.q_out_stride / kElements) + c
                       : static_cast<Vec16*>(p.k_out) + token * (p.k_out_stride / kElements) +
                             (c - q_vectors);
}

// Every output of the call NaN (a call that failed once begun), spread over the group.
template <typename T>
void qk_outputs_nan(const SyclQkCall& p, int64_t first, int64_t stride) {
  constexpr int kElements = Packed<T>::kElements;
  const int64_t vectors = (p.q_size + p.kv_size) / kElements;
  for (int64_t i = first; i < p.tokens * vectors; i += stride) {
    *qk_output<T>(p, i / vectors, i % vectors) = nan_vector();
  }
}

// A token whose position is outside the cache, for Team::check (the first since the last check).
inline void record_bad_position(const SyclQkCall& p, int64_t token, int64_t position) {
  const Exchange& x = p.exchange;
  if (x.errors == nullptr) return;  // a local pass: no team to tell
  if (claim_call_error(x)) {
    x.errors->position_token = token;
    x.errors->position = position;
    x.errors->max_position = p.max_position;
    store_release(&x.errors->call_error, uint32_t(CallError::kBadPosition));
  }
}

// Normalizes (and rotates) one token's q and k with its global sums, each work-item its vectors
// c = first, first + stride, ...; `stage`: work-group local memory for a row of fp32 (RoPE).
// Every work-item of the group calls it (its barriers; `position` is read by each alike).
template <typename T>
void finish_qk_token(const SyclQkCall& p, const sycl::group<1>& group, int64_t first,
                     int64_t stride, int64_t token, float sum_q, float sum_k, float* stage) {
  constexpr int kElements = Packed<T>::kElements;
  const int64_t q_vectors = p.q_size / kElements;
  const int64_t kv_vectors = p.kv_size / kElements;
  const int64_t vectors = q_vectors + kv_vectors;
  const RopeStyle rope = RopeStyle(p.rope);
  const int64_t position = rope != RopeStyle::kNone ? p.positions[token] : 0;
  if (rope != RopeStyle::kNone && (position < 0 || position >= p.max_position)) {
    if (first == 0) record_bad_position(p, token, position);
    for (int64_t c = first; c < vectors; c += stride) *qk_output<T>(p, token, c) = nan_vector();
    return;
  }
  const float scale_q = rms_scale(sum_q, p.q_global_size, p.eps);
  const float scale_k = rms_scale(sum_k, p.k_global_size, p.eps);
  const Vec16* row = static_cast<const Vec16*>(p.qkv) + token * (q_vectors + 2 * kv_vectors);
  const auto* q_gamma = static_cast<const Vec16*>(p.q_gamma);
  const auto* k_gamma = static_cast<const Vec16*>(p.k_gamma);
  for (int64_t c = first; c < vectors; c += stride) {
    float lanes[kElements];
    if (c < q_vectors) {
      scale_lanes<T>(row[c], q_gamma[c], scale_q, lanes);
    } else {
      scale_lanes<T>(row[c], k_gamma[c - q_vectors], scale_k, lanes);
    }
    if (rope == RopeStyle::kNone) {
      *qk_output<T>(p, token, c) = pack<T>(lanes);
    } else {
      for (int e = 0; e < kElements; ++e) stage[c * kElements + e] = lanes[e];
    }
  }
  if (rope == RopeStyle::kNone) return;
  // Every normalized element staged before any is read as a partner (and, in place, every input
  // vector read before any output is written).
  sycl::group_barrier(group);
  const float* cos_sin = p.cos_sin_cache + position * p.rotary_dim;
  for (int64_t c = first; c < vectors; c += stride) {
    float lanes[kElements];
    rope_lanes<kElements>(lanes, stage, int(c * kElements), int(p.head_dim), int(p.rotary_dim),
                          rope, cos_sin);
    *qk_output<T>(p, token, c) = pack<T>(lanes);
  }
  sycl::group_barrier(group);  // the stage is the next token's
}

template <typename T>
void qk_call(const SyclQkCall& p, float* stage) {
  using Session = LamportSession<WorkGroupCoop>;
  const sycl::nd_item<1> item = this_item();
  const sycl::group<1> group = item.get_group();
  const int64_t first = int64_t(item.get_local_linear_id());
  const int64_t stride = int64_t(item.get_local_range(0));

  if (p.pass == kSyclQkSums) {
    for (int64_t token = first; token < p.tokens; token += stride) {
      qk_token_sums<T>(p, token, p.sums[2 * token], p.sums[2 * token + 1]);
    }
    return;
  }
  if (p.pass == kSyclQkNormFromSums) {
    for (int64_t token = 0; token < p.tokens; ++token) {
      finish_qk_token<T>(p, group, first, stride, token, p.sums[2 * token], p.sums[2 * token + 1],
                         stage);
    }
    return;
  }

  // 1. The call state.
  const Exchange& x = p.exchange;
  const int world = x.world_size;
  const CallState state = group_call_state(group, x, first == 0);
  const Session session(state);
  if (session.failed()) return;
  const CallSignature mine = sequenced_signature(p.signature, state.sequence);
  const size_t send_offset = session.send_offset(x);

  // 2. Send: the header, then each token's packet to every rank (this one too).
  if (first < world && first != x.rank) {
    store_vector(reinterpret_cast<Vec16*>(x.workspace[first] + session.header_send_offset(x)),
                 mine.header);
  }
  for (int64_t token = first; token < p.tokens; token += stride) {
    float sum_q, sum_k;
    qk_token_sums<T>(p, token, sum_q, sum_k);
    const Vec16 packet = rewrite_sentinel(qk_packet(sum_q, sum_k));
    for (int r = 0; r < world; ++r) {
      store_vector(reinterpret_cast<Vec16*>(x.workspace[r] + send_offset) + token, packet);
    }
  }

  // 3. Every send before any wait; arrive (work-item 0 alone read the state it moves), clear.
  sycl::group_barrier(group);
  if (first == 0) session.arrive(x.control, uint64_t(p.tokens) * 16);
  session.clear_previous(x);

  // 4. The headers before the data.
  const bool differs =
      peer_header_differs(session, x, mine, state.sequence, p.bound, size_t(first));
  if (sycl::any_of_group(group, differs)) {
    qk_outputs_nan<T>(p, first, stride);
    return;
  }

  // 5. Per token: the rank-ordered sum of the packets (work-item 0), then the norm.
  bool lost = false;
  for (int64_t token = 0; token < p.tokens; ++token) {
    float sums[4] = {};
    if (first == 0) {
      for (int sender = 0; sender < world; ++sender) {
        const auto* address =
            reinterpret_cast<const Vec16*>(session.receive_region(x, sender)) + token;
        Vec16 packet;
        if (sender == x.rank) {
          packet = load_vector(address);  // stored by this group before its barrier
        } else if (!wait_vector(address, x, mine, sender, state.sequence, p.bound, packet)) {
          packet = nan_vector();
          lost = true;
        }
        if (sender == 0) {
          accumulate_first<float>(sums, packet);
        } else {
          accumulate<float>(sums, packet);
        }
      }
    }
    const float sum_q = sycl::group_broadcast(group, sums[0], 0);
    const float sum_k = sycl::group_broadcast(group, sums[1], 0);
    finish_qk_token<T>(p, group, first, stride, token, sum_q, sum_k, stage);
  }

  // 6. A wait that ended without its packet: every output NaN.
  if (sycl::any_of_group(group, lost)) {
    sycl::group_barrier(group);  // after every work-item's last output of the loop
    qk_outputs_nan<T>(p, first, stride);
  }
}

}  // namespace tpfuse::impl::sycl_device

// The kernels, by name (src/sycl/backend.cc looks them up): tpf_sycl_qk_<dtype>. The stage is
// a row of fp32 in work-group local memory, as wide as a RoPE row may be (kMaxQkRopeWidth), a
// work_group_static: group_local_memory_for_overwrite crashed the 2026.2 runtime when it loaded
// the compiled bundle (DeviceKernelInfo::setImplicitLocalArgPos; docs/sycl.md, Pitfalls).
#define TPF_SYCL_QK_KERNEL(dtype_name, T)                                                     \
  extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY(                                               \
      (sycl::ext::oneapi::experimental::nd_range_kernel<1>)) void                             \
      tpf_sycl_qk_##dtype_name(tpfuse::impl::SyclQkCall p) {                                  \
    static sycl::ext::oneapi::experimental::work_group_static<float[tpfuse::kMaxQkRopeWidth]> \
        stage;                                                                                \
    tpfuse::impl::sycl_device::qk_call<T>(p, &stage[0]);                                      \
  }

TPF_SYCL_QK_KERNEL(f32, float)
TPF_SYCL_QK_KERNEL(f16, tpfuse::impl::Float16)
TPF_SYCL_QK_KERNEL(bf16, tpfuse::impl::BFloat16)
