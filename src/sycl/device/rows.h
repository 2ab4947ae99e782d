// The SYCL backend's kernels, compiled at run time by the kernel compiler (src/sycl/compiler.h)
// from this file and the headers it includes, all embedded in the library (this one as
// "tpfuse/sycl/rows.h"): the row collectives one-shot and two-shot (allreduce,
// allreduce_add_rmsnorm with every epilogue of epilogue.h's RowEpilogues: gamma or 1 + gamma,
// the FP8 outputs, the MoE finalize), their local form, the absent call, and the calibrations of
// the waits' bound.
//
// A call is one work-group: the rank's one participant of the Lamport session (session.h, with
// tpfuse/sycl/exchange.h's WorkGroupCoop), its work-items spreading the sends, the clear, the
// receives and the epilogue. One work-group, because a rank's work-groups poll their peers' and
// all of them must run at once: on Intel's OpenCL CPU device a work-group holds a core until it
// ends, and more spinning work-groups than compute units wait for a peer that never gets one
// (create_sycl_team refuses such teams). The steps, in order:
//   1. work-item 0 reads the call state (read_call_state); the group takes it by broadcast. A
//      failed team sends nothing and returns (its peers time out: every rank reports it);
//   2. send: work-item r stores the call's header (its signature with the call number folded in,
//      sequenced_signature) into rank r; then the packets of the rank's contribution (its input,
//      or its MoE combine), sentinel words rewritten: one-shot all of them to every peer,
//      two-shot each owner's tokens to it (lamport.h's TwoShotLayout);
//   3. after a group barrier (every send before any poll: see there), arrive (work-item 0: the
//      only participant) and clear the previous call's slot. A rank's next call starts only once
//      this one has ended (its queue is in order: validate_call). Then the headers, before any
//      packet is used: work-item r waits for rank r's and checks it (record_header: a rejection,
//      a disagreement, a failed peer); if any differs, every output of the call is NaN;
//   4. per token (finish_token): each work-item sums its vectors over the ranks in rank order in
//      fp32 (its own term from its contribution), polling its peers' packets (wait_vector: a
//      failure of the team or the bound end the wait with NaN, the call lost), and rounds
//      them once (+ residual) into the output; with a norm, the rounded row is staged, work-item
//      0 sums its squares in element order (the CPU backend's order: the same bits), and every
//      work-item normalizes (and quantizes). Two-shot finishes its owned tokens so, sends each
//      rounded vector to every peer, and after a second barrier finishes the peers' tokens from
//      their rounded rows (Epilogue::Gathered);
//   5. a wait that ended without its packet makes every output of the call NaN.
// Memory ordering: every protocol word goes through exchange.h's release stores and acquire
// loads. A staged row is read across work-items only after a group barrier (or the broadcast
// that follows it), whose fence orders the group's global memory.
//
// Waits (tpfuse/sycl/waits.h) are bounded by the device's clock where it has one, else by looks.
#pragma once

#include <sycl/sycl.hpp>

#include <cstdint>

#include "tpfuse/impl/epilogue.h"
#include "tpfuse/impl/lamport.h"
#include "tpfuse/impl/numeric.h"
#include "tpfuse/impl/session.h"
#include "tpfuse/sycl/calls.h"
#include "tpfuse/sycl/exchange.h"
#include "tpfuse/sycl/waits.h"

namespace tpfuse::impl::sycl_device {

// Vector v of token `token`'s contribution to the sum: its input, or (kHasMoe) the MoE combine of
// its expert rows, sum_j w_j * x_j in fp32 in j order plus the shared row, packed once
// (epilogue.h's steps, as the CPU's and the GPU's combine).
template <typename T, typename Epilogue>
Vec16 contribution(const SyclRowCall& p, int64_t token, int64_t v) {
  constexpr int kElements = Packed<T>::kElements;
  const int64_t vectors = p.hidden / kElements;
  if constexpr (Epilogue::kHasMoe) {
    const auto* rows = static_cast<const Vec16*>(p.moe_rows);
    float acc[kElements];
    for (int j = 0; j < p.moe_topk; ++j) {
      const int64_t row = token * p.moe_topk + j;
      const float w = moe_weight<T>(p.moe_weights, p.moe_weights_in_dtype != 0, row);
      moe_accumulate<T>(acc, rows[row * vectors + v], w, j == 0);
    }
    if (p.moe_shared != nullptr) {
      moe_add_shared<T>(acc, static_cast<const Vec16*>(p.moe_shared)[token * vectors + v]);
    }
    return pack<T>(acc);
  } else {
    return static_cast<const Vec16*>(p.input)[token * vectors + v];
  }
}

// Finishes token `token`: each work-item's vectors of its rank sum (sum(v, index, acc) gives one
// in fp32), + residual, rounded once into the output (on_rounded(v, rounded) sees each: the
// two-shot owner sends it). With a norm, the rounded row is staged (in norm_out, else
// residual_out, else `scratch`: one row), work-item 0 sums its squares in element order from 0
// (src/cpu/rows.cc's order: the same bits), and every work-item normalizes its vectors. With an
// FP8 output (kHasQuant), work-item 0 first takes the token's or each group's largest magnitude
// of the normalized row (recomputed from the stage: max is exact in any order) and writes the
// dynamic scales; after a barrier every work-item quantizes its normalized vectors
// (epilogue.h's quantize_vector). Every work-item of the group calls it (its barriers).
template <typename T, typename Epilogue, typename Sum, typename OnRounded>
void finish_token(const SyclRowCall& p, const sycl::group<1>& group, int64_t first, int64_t stride,
                  int64_t token, Vec16* scratch, Sum&& sum, OnRounded&& on_rounded) {
  constexpr int kElements = Packed<T>::kElements;
  const int64_t vectors = p.hidden / kElements;
  const auto* residual = static_cast<const Vec16*>(p.residual);
  const auto* gamma = static_cast<const Vec16*>(p.gamma);
  auto* residual_out = static_cast<Vec16*>(p.residual_out);
  auto* norm_out = static_cast<Vec16*>(p.norm_out);
  Vec16* const stage = norm_out != nullptr       ? norm_out + token * vectors
                       : residual_out != nullptr ? residual_out + token * vectors
                                                 : scratch;
  for (int64_t v = first; v < vectors; v += stride) {
    const int64_t index = token * vectors + v;
    float acc[kElements];
    sum(v, index, acc);
    float unused = 0.0f;
    Vec16 residual_vector{};
    if constexpr (Epilogue::kHasResidual) residual_vector = residual[index];
    const Vec16 rounded = Epilogue::template round_sum<T>(acc, residual_vector, unused);
    if constexpr (Epilogue::kHasNorm) {
      if (residual_out != nullptr) residual_out[index] = rounded;
    }
    stage[v] = rounded;
    on_rounded(v, rounded);
  }
  if constexpr (Epilogue::kHasNorm) {
    sycl::group_barrier(group);
    float sum_squares = 0.0f;
    if (first == 0) {
      for (int64_t v = 0; v < vectors; ++v) {
        float lanes[kElements];
        unpack<T>(stage[v], lanes);
        for (int l = 0; l < kElements; ++l) sum_squares += lanes[l] * lanes[l];
      }
    }
    const float scale = sycl::group_broadcast(group, rms_scale(sum_squares, p.hidden, p.eps), 0);
    const auto normalized = [&](int64_t v) {
      float lanes[kElements];
      unpack<T>(stage[v], lanes);
      return Epilogue::template normalize<T>(lanes, gamma[v], scale);
    };
    float quant_scale = 0.0f;
    const QuantMode mode = QuantMode(p.quant);
    // The Output policy's scope picks the path, and its scale step the scale (impl/epilogue/).
    const OutputScope scope = output_scope_of(mode);
    if constexpr (Epilogue::kHasQuant) {
      constexpr int64_t kGroupVectors = kQuantGroupSize / kElements;
      const int64_t groups = p.hidden / kQuantGroupSize;
      float token_scale = 0.0f;
      if (first == 0) {
        if (scope == OutputScope::kCall) {
          token_scale = *p.quant_scale;
        } else if (scope == OutputScope::kToken) {
          float amax = 0.0f;
          for (int64_t v = 0; v < vectors; ++v) amax = fmaxf(amax, vector_amax<T>(normalized(v)));
          token_scale = output_scale<OutputScope::kToken>(mode, dynamic_scale(amax));
          p.scales_out[token] = token_scale;
        } else {
          for (int64_t g = 0; g < groups; ++g) {
            float amax = 0.0f;
            for (int64_t v = g * kGroupVectors; v < (g + 1) * kGroupVectors; ++v) {
              amax = fmaxf(amax, vector_amax<T>(normalized(v)));
            }
            p.scales_out[p.scales_column_major ? g * p.tokens + token : token * groups + g] =
                output_scale<OutputScope::kGroup>(mode, dynamic_scale(amax));
          }
        }
      }
      quant_scale = sycl::group_broadcast(group, token_scale, 0);
      sycl::group_barrier(group);  // the group scales in scales_out, read below
    }
    // Every work-item's normalized vectors (norm_out may be the stage: each rewrites only its own
    // vectors, which work-item 0 has read by now).
    for (int64_t v = first; v < vectors; v += stride) {
      const int64_t index = token * vectors + v;
      const Vec16 out = normalized(v);
      if (norm_out != nullptr) norm_out[index] = out;
      if constexpr (Epilogue::kHasQuant) {
        const int64_t groups = p.hidden / kQuantGroupSize;
        const int64_t group_index = v * kElements / kQuantGroupSize;
        const float divisor_scale =
            scope != OutputScope::kGroup
                ? quant_scale
                : p.scales_out[p.scales_column_major ? group_index * p.tokens + token
                                                     : token * groups + group_index];
        const QuantBytes<T> bytes = quantize_vector<T>(out, fp8_divisor(divisor_scale));
        uint8_t* const to = static_cast<uint8_t*>(p.quant_out) + token * p.hidden + v * kElements;
        for (int i = 0; i < kElements; ++i) to[i] = bytes.bytes[i];
      }
    }
  }
}

// Every output of a row call NaN (a call that failed once begun; core/calls.h's row_outputs on
// the host): residual_out and norm_out, the FP8 bytes (E4M3's NaN) and the dynamic scales.
template <typename T, typename Epilogue>
void row_outputs_nan(const SyclRowCall& p, int64_t first, int64_t stride) {
  constexpr int kElements = Packed<T>::kElements;
  const int64_t vectors = p.tokens * (p.hidden / kElements);
  auto* residual_out = static_cast<Vec16*>(p.residual_out);
  auto* norm_out = static_cast<Vec16*>(p.norm_out);
  for (int64_t i = first; i < vectors; i += stride) {
    if (residual_out != nullptr) residual_out[i] = nan_vector();
    if (norm_out != nullptr) norm_out[i] = nan_vector();
  }
  if constexpr (Epilogue::kHasQuant) {
    auto* words = static_cast<uint32_t*>(p.quant_out);  // 16-byte aligned, rows of 8k bytes
    for (int64_t i = first; i < p.tokens * p.hidden / 4; i += stride) words[i] = 0x7f7f7f7fu;
    const int64_t scales = scale_count(output_scope_of(QuantMode(p.quant)), p.tokens, p.hidden);
    for (int64_t i = first; i < scales; i += stride) {
      p.scales_out[i] = sycl::bit_cast<float>(uint32_t(0x7fc00000u));
    }
  }
}

template <typename T, typename Epilogue>
void row_call(const SyclRowCall& p) {
  using Session = LamportSession<WorkGroupCoop>;
  constexpr int kElements = Packed<T>::kElements;
  const sycl::nd_item<1> item = this_item();
  const sycl::group<1> group = item.get_group();
  const int64_t first = int64_t(item.get_local_linear_id());
  const int64_t stride = int64_t(item.get_local_range(0));
  const Exchange& x = p.exchange;
  const bool local = p.local != 0;
  const bool twoshot = !local && p.twoshot != 0;
  const int world = local ? 1 : x.world_size;
  const int rank = local ? 0 : x.rank;
  const int64_t vectors = p.hidden / kElements;
  const uint64_t row_bytes = uint64_t(p.hidden) * sizeof(T);
  const TwoShotLayout layout(p.tokens, world);

  CallState state{};
  if (!local) state = group_call_state(group, x, first == 0);
  const Session session(state);
  if (!local && session.failed()) return;
  const CallSignature mine = sequenced_signature(p.signature, state.sequence);
  const size_t send_offset = local ? 0 : session.send_offset(x);
  // A peer's packet vector at `offset` bytes into its region of this rank's slot.
  // (The headers were checked before any is read: step 3.) A wait that ends without the packet
  // (a failure of the team, the bound) gives NaN and marks the call lost (step 5).
  bool lost = false;
  const auto packet_of = [&](int sender, uint64_t offset) {
    Vec16 v;
    if (!wait_vector(reinterpret_cast<const Vec16*>(session.receive_region(x, sender) + offset), x,
                     mine, sender, state.sequence, p.bound, v)) {
      lost = true;
      return nan_vector();
    }
    return v;
  };
  const auto nothing = [](int64_t, const Vec16&) {};
  // One row of scratch for an FP8 call that writes neither norm_out nor residual_out: this rank's
  // own sender region of the slot, which no rank stores into in a row call (lamport.h).
  Vec16* const scratch =
      local ? nullptr : reinterpret_cast<Vec16*>(x.workspace[rank] + send_offset);

  if (!local) {
    // 2. Send: the header, then one-shot's whole input to every peer, or two-shot's scatter
    //    (each owner's tokens of the input, to it).
    if (first < world && first != rank) {
      store_vector(reinterpret_cast<Vec16*>(x.workspace[first] + session.header_send_offset(x)),
                   mine.header);
    }
    if (twoshot) {
      for (int owner = 0; owner < world; ++owner) {
        if (owner == rank) continue;
        auto* region = reinterpret_cast<Vec16*>(x.workspace[owner] + send_offset);
        for (int64_t i = first; i < layout.count(owner) * vectors; i += stride) {
          const Vec16 packet =
              contribution<T, Epilogue>(p, layout.begin(owner) + i / vectors, i % vectors);
          store_vector(region + i, rewrite_sentinel(packet));  // scatter rows from 0
        }
      }
    } else {
      for (int64_t i = first; i < p.tokens * vectors; i += stride) {
        const Vec16 packet =
            rewrite_sentinel(contribution<T, Epilogue>(p, i / vectors, i % vectors));
        for (int r = 0; r < world; ++r) {
          if (r != rank)
            store_vector(reinterpret_cast<Vec16*>(x.workspace[r] + send_offset) + i, packet);
        }
      }
    }
    // Every work-item's sends before any work-item's polls. A work-item receives vectors that
    // other work-items of the peer's group sent, and a group's work-items have no forward
    // progress of their own: the CPU device runs them a few SIMD lanes at a time, each lane group
    // to the next barrier, so a lane group polling for a vector a later one sends would wait
    // forever (found with rows of 224 vectors: a timeout on every call).
    sycl::group_barrier(group);
    // 3. Arrive (work-item 0 alone read the state it moves), clear.
    if (first == 0) {
      session.arrive(x.control,
                     twoshot ? layout.sender_bytes(row_bytes) : uint64_t(p.tokens) * row_bytes);
    }
    session.clear_previous(x);
    // The headers before any packet is used (peer_header_differs). If any differs (or its wait
    // ended without it), every output of the call is NaN and no packet is read: a peer whose call
    // disagrees but keeps the packets' layout (another dtype, another eps) mixes nothing in.
    const bool differs =
        peer_header_differs(session, x, mine, state.sequence, p.bound, size_t(first));
    if (sycl::any_of_group(group, differs)) {
      // Every store the call's signature implies still goes out (session.h): two-shot's gather
      // rows too, which a rejecting peer's absent call drains. NaN: no number.
      if (twoshot) {
        for (int r = 0; r < world; ++r) {
          if (r == rank) continue;
          for (int64_t i = first; i < layout.count(rank) * vectors; i += stride) {
            auto* gather = reinterpret_cast<Vec16*>(x.workspace[r] + send_offset +
                                                    layout.gather_row(i / vectors, row_bytes));
            store_vector(gather + i % vectors, nan_vector());
          }
        }
      }
      row_outputs_nan<T, Epilogue>(p, first, stride);
      return;
    }
  }

  // 4. Receive and finish, a token at a time: one-shot every token from every rank's packets
  //    (its own from its input); two-shot the owned tokens from the scattered rows, each rounded
  //    row sent to every peer (all-gather), then, after a barrier (every gather sent before any
  //    is polled: as above), the peers' tokens from their rounded rows (Epilogue::Gathered).
  const auto rank_sum = [&](int64_t v, int64_t index, uint64_t offset, float(&acc)[kElements]) {
    for (int sender = 0; sender < world; ++sender) {
      const Vec16 packet = sender == rank
                               ? rewrite_sentinel(contribution<T, Epilogue>(p, index / vectors, v))
                               : packet_of(sender, offset + uint64_t(v) * 16);
      if (sender == 0) {
        accumulate_first<T>(acc, packet);
      } else {
        accumulate<T>(acc, packet);
      }
    }
  };
  if (!twoshot) {
    for (int64_t token = 0; token < p.tokens; ++token) {
      finish_token<T, Epilogue>(
          p, group, first, stride, token, scratch,
          [&](int64_t v, int64_t index, float(&acc)[kElements]) {
            rank_sum(v, index, uint64_t(token) * row_bytes, acc);
          },
          nothing);
    }
  } else {
    for (int64_t local_row = 0; local_row < layout.count(rank); ++local_row) {
      finish_token<T, Epilogue>(
          p, group, first, stride, layout.begin(rank) + local_row, scratch,
          [&](int64_t v, int64_t index, float(&acc)[kElements]) {
            rank_sum(v, index, layout.scatter_row(local_row, row_bytes), acc);
          },
          [&](int64_t v, const Vec16& rounded) {
            for (int r = 0; r < world; ++r) {
              if (r == rank) continue;
              auto* gather = reinterpret_cast<Vec16*>(x.workspace[r] + send_offset +
                                                      layout.gather_row(local_row, row_bytes));
              store_vector(gather + v, rounded);  // canonical: no word is the sentinel
            }
          });
    }
    sycl::group_barrier(group);
    for (int owner = 0; owner < world; ++owner) {
      if (owner == rank) continue;
      for (int64_t local_row = 0; local_row < layout.count(owner); ++local_row) {
        finish_token<T, typename Epilogue::Gathered>(
            p, group, first, stride, layout.begin(owner) + local_row, scratch,
            [&](int64_t v, int64_t, float(&acc)[kElements]) {
              accumulate_first<T>(acc, packet_of(owner, layout.gather_row(local_row, row_bytes) +
                                                            uint64_t(v) * 16));
            },
            nothing);
      }
    }
  }

  // 5. A wait that ended without its packet: every output of the call NaN, as on the CPU and
  //    the GPU (what was finished before it holds no number either).
  if (!local && sycl::any_of_group(group, lost)) {
    sycl::group_barrier(group);  // after every work-item's last output above
    row_outputs_nan<T, Epilogue>(p, first, stride);
  }
}

// An absent call (session.h; src/cuda/absent.cu is the GPU's): the header, the clear, every
// peer's header (an empty call must agree with it; a rejecting rank takes whatever comes), the
// drain of what their signatures say they sent, and the arrival with the largest region used.
inline void absent_call(const SyclAbsentCall& p) {
  using Session = LamportSession<WorkGroupCoop>;
  const sycl::nd_item<1> item = this_item();
  const sycl::group<1> group = item.get_group();
  const int64_t first = int64_t(item.get_local_linear_id());
  const int64_t stride = int64_t(item.get_local_range(0));
  const Exchange& x = p.exchange;
  const int world = x.world_size;
  const CallState state = group_call_state(group, x, first == 0);
  const Session session(state);
  if (session.failed()) return;
  const CallSignature mine = sequenced_signature(p.signature, state.sequence);
  if (first < world && first != x.rank) {
    store_vector(reinterpret_cast<Vec16*>(x.workspace[first] + session.header_send_offset(x)),
                 mine.header);
  }
  session.clear_previous(x);
  sycl::group_barrier(group);  // every header sent before any wait (row_call says why)
  if (first < world && first != x.rank) {
    Vec16 header;
    if (wait_vector(session.received_header(x, int(first)), x, mine, int(first), state.sequence,
                    p.bound, header) &&
        mine.op() != CallOp::kRejected) {
      record_header(Recorder{}, x, mine.header, header, int(first), state.sequence);
    }
  }
  sycl::group_barrier(group);
  const uint32_t failed =
      sycl::group_broadcast(group, first == 0 ? load_acquire(&x.control->error) : 0u, 0);
  if (failed != 0) return;
  uint64_t clear_bytes = 0;
  for (int sender = 0; sender < world; ++sender) {
    if (sender == x.rank) continue;
    const Vec16 header = load_vector(session.received_header(x, sender));
    const SenderExtents extents = sender_extents(CallSignature{header}, sender, x.rank, world);
    clear_bytes = extents.clear_bytes > clear_bytes ? extents.clear_bytes : clear_bytes;
    const char* region = session.receive_region(x, sender);
    for (int range = 0; range < 2; ++range) {
      for (uint64_t offset = extents.begin[range] + 16 * uint64_t(first);
           offset < extents.end[range]; offset += 16 * uint64_t(stride)) {
        Vec16 v;
        if (!wait_vector(reinterpret_cast<const Vec16*>(region + offset), x, mine, sender,
                         state.sequence, p.bound, v)) {
          break;
        }
      }
    }
  }
  sycl::group_barrier(group);
  if (first == 0) session.arrive(x.control, clear_bytes);
}

}  // namespace tpfuse::impl::sycl_device

namespace tpfuse::impl::sycl_kernels {
using Sum = SumEpilogue;
using Norm = RowEpilogue<false, true>;
using ResidualNorm = RowEpilogue<true, true>;
using NormOnePlusGamma = RowEpilogue<false, true, NormWeight::kOnePlusGamma>;
using ResidualNormOnePlusGamma = RowEpilogue<true, true, NormWeight::kOnePlusGamma>;
using NormQuant = RowEpilogue<false, true, NormWeight::kGamma, true>;
using ResidualNormQuant = RowEpilogue<true, true, NormWeight::kGamma, true>;
using NormOnePlusGammaQuant = RowEpilogue<false, true, NormWeight::kOnePlusGamma, true>;
using ResidualNormOnePlusGammaQuant = RowEpilogue<true, true, NormWeight::kOnePlusGamma, true>;
using ResidualNormMoe = RowEpilogue<true, true, NormWeight::kGamma, false, true>;
using ResidualNormQuantMoe = RowEpilogue<true, true, NormWeight::kGamma, true, true>;
}  // namespace tpfuse::impl::sycl_kernels

// The kernels, by name (src/sycl/backend.cc looks them up): tpf_sycl_rows_<dtype>_<epilogue>.
#define TPF_SYCL_ROW_KERNEL(dtype_name, T, epilogue_name, Epilogue)                  \
  extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY(                                      \
      (sycl::ext::oneapi::experimental::nd_range_kernel<1>)) void                    \
      tpf_sycl_rows_##dtype_name##_##epilogue_name(tpfuse::impl::SyclRowCall p) {    \
    tpfuse::impl::sycl_device::row_call<T, tpfuse::impl::sycl_kernels::Epilogue>(p); \
  }
#define TPF_SYCL_ROW_KERNELS(dtype_name, T)                                              \
  TPF_SYCL_ROW_KERNEL(dtype_name, T, sum, Sum)                                           \
  TPF_SYCL_ROW_KERNEL(dtype_name, T, norm, Norm)                                         \
  TPF_SYCL_ROW_KERNEL(dtype_name, T, residual_norm, ResidualNorm)                        \
  TPF_SYCL_ROW_KERNEL(dtype_name, T, norm_1pg, NormOnePlusGamma)                         \
  TPF_SYCL_ROW_KERNEL(dtype_name, T, residual_norm_1pg, ResidualNormOnePlusGamma)        \
  TPF_SYCL_ROW_KERNEL(dtype_name, T, norm_q, NormQuant)                                  \
  TPF_SYCL_ROW_KERNEL(dtype_name, T, residual_norm_q, ResidualNormQuant)                 \
  TPF_SYCL_ROW_KERNEL(dtype_name, T, norm_1pg_q, NormOnePlusGammaQuant)                  \
  TPF_SYCL_ROW_KERNEL(dtype_name, T, residual_norm_1pg_q, ResidualNormOnePlusGammaQuant) \
  TPF_SYCL_ROW_KERNEL(dtype_name, T, residual_norm_moe, ResidualNormMoe)                 \
  TPF_SYCL_ROW_KERNEL(dtype_name, T, residual_norm_q_moe, ResidualNormQuantMoe)

TPF_SYCL_ROW_KERNELS(f32, float)
TPF_SYCL_ROW_KERNELS(f16, tpfuse::impl::Float16)
TPF_SYCL_ROW_KERNELS(bf16, tpfuse::impl::BFloat16)

extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY(
    (sycl::ext::oneapi::experimental::nd_range_kernel<
        1>)) void tpf_sycl_absent(tpfuse::impl::SyclAbsentCall p) {
  tpfuse::impl::sycl_device::absent_call(p);
}

// The device clock's ticks at its start (ticks[0]) and once the host has set *flag (ticks[1]): the
// host times the same span (src/sycl/team.cc). Bounded: 2^32 looks at the flag at most.
extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY((sycl::ext::oneapi::experimental::nd_range_kernel<
                                              1>)) void tpf_sycl_clock_rate(const uint32_t* flag,
                                                                            uint64_t* ticks) {
  using namespace tpfuse::impl;
  sycl_device::store_release(&ticks[0], sycl_device::device_ticks() | 1u);
  for (uint64_t l = 0; l < (uint64_t(1) << 32) && sycl_device::load_acquire(flag) == 0; ++l) {
  }
  sycl_device::store_release(&ticks[1], sycl_device::device_ticks() | 1u);
}

// `looks` looks (the waits' loop, with their slow-path loads) at a vector that never arrives:
// how fast a wait looks, which a device without a clock turns into its bound.
extern "C" SYCL_EXT_ONEAPI_FUNCTION_PROPERTY(
    (sycl::ext::oneapi::experimental::nd_range_kernel<
        1>)) void tpf_sycl_calibrate(const tpfuse::impl::Vec16* never, const uint32_t* words,
                                     uint64_t looks, uint32_t* out) {
  using namespace tpfuse::impl;
  const int64_t first = int64_t(sycl_device::this_item().get_local_linear_id());
  const Vec16* address = never + first;
  Vec16 v = sycl_device::load_vector(address);
  uint32_t seen = 0;
  for (uint64_t l = 1; l < looks && !has_arrived(v); ++l) {
    if (l % sycl_device::kCheckEvery == 0) {
      seen ^= sycl_device::load_acquire(&words[0]) ^ sycl_device::load_acquire(&words[1]) ^
              sycl_device::load_acquire(&words[2]);
    }
    v = sycl_device::load_vector(address);
  }
  if (has_arrived(v) || seen == 1u) out[0] = 1u;
}
