// The CPU backend's row calls: one-shot, two-shot, the local epilogue and the NCCL path's
// stand-in. Ranks are threads of one process over host memory; each call is a Lamport session
// (tpfuse/impl/session.h) with the epilogues of tpfuse/impl/epilogue.h, the same steps and math
// the CUDA kernels run, with one thread in place of a grid.
#include <algorithm>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "cpu/exchange.h"
#include "cpu/kernels.h"
#include "tpfuse/impl/dispatch.h"
#include "tpfuse/impl/epilogue.h"
#include "tpfuse/impl/lamport.h"

namespace tpfuse::impl {
namespace {

Vec16 load_plain(const void* base, int64_t vector_index) {
  Vec16 v;
  std::memcpy(&v, static_cast<const char*>(base) + vector_index * 16, 16);
  return v;
}

void store_plain(void* base, int64_t vector_index, const Vec16& v) {
  std::memcpy(static_cast<char*>(base) + vector_index * 16, &v, 16);
}

template <typename T>
using Lanes = float[Packed<T>::kElements];

template <typename T>
Lanes<T>& lanes_at(std::vector<float>& acc, int64_t vector) {
  return *reinterpret_cast<Lanes<T>*>(&acc[vector * Packed<T>::kElements]);
}

// The FP8 output of one row from its normalized vectors (as stored in norm_out): the scale of
// the call, of the token or of each group of kQuantGroupSize elements (epilogue.h's steps, the
// same as the GPU's).
template <typename T>
void quantize_row(const std::vector<Vec16>& normalized, const RowCall& p, int64_t token) {
  constexpr int64_t kElements = Packed<T>::kElements;
  const int64_t vectors = int64_t(normalized.size());
  uint8_t* const out = static_cast<uint8_t*>(p.quant_out) + token * p.hidden;
  const auto store = [&](int64_t v, float scale) {
    const QuantBytes<T> bytes = quantize_vector<T>(normalized[size_t(v)], scale);
    std::memcpy(out + v * kElements, bytes.bytes, kElements);
  };
  switch (p.quant) {
    case QuantMode::kStatic: {
      const float scale = *p.quant_scale;
      for (int64_t v = 0; v < vectors; ++v) store(v, scale);
      break;
    }
    case QuantMode::kPerToken: {
      float amax = 0.0f;
      for (int64_t v = 0; v < vectors; ++v)
        amax = fmaxf(amax, vector_amax<T>(normalized[size_t(v)]));
      const float scale = dynamic_scale(amax);
      p.scales_out[token] = scale;
      for (int64_t v = 0; v < vectors; ++v) store(v, scale);
      break;
    }
    case QuantMode::kPerTokenGroup128: {
      const int64_t per_group = kQuantGroupSize / kElements;
      const int64_t groups = p.hidden / kQuantGroupSize;
      for (int64_t g = 0; g < groups; ++g) {
        float amax = 0.0f;
        for (int64_t v = g * per_group; v < (g + 1) * per_group; ++v) {
          amax = fmaxf(amax, vector_amax<T>(normalized[size_t(v)]));
        }
        const float scale = dynamic_scale(amax);
        p.scales_out[p.scales_column_major ? g * p.tokens + token : token * groups + g] = scale;
        for (int64_t v = g * per_group; v < (g + 1) * per_group; ++v) store(v, scale);
      }
      break;
    }
    case QuantMode::kNone:
      break;
  }
}

// The epilogue over one row whose rank sum (fp32) is in `acc`, vector by vector. on_rounded(v,
// vector) sees each rounded vector (residual_out's, or out's for a plain sum) as it is stored:
// the two-shot owner sends it to its peers.
template <typename T, typename Epilogue, typename OnRounded>
void finish_row(std::vector<float>& acc, const RowCall& p, int64_t token, OnRounded&& on_rounded) {
  const int64_t vectors = p.hidden / Packed<T>::kElements;
  const int64_t row = token * vectors;
  float sum_squares = 0.0f;
  for (int64_t v = 0; v < vectors; ++v) {
    const Vec16 residual = Epilogue::kHasResidual ? load_plain(p.residual, row + v) : Vec16{};
    const Vec16 rounded =
        Epilogue::template round_sum<T>(lanes_at<T>(acc, v), residual, sum_squares);
    void* destination = Epilogue::kHasNorm ? p.residual_out : p.norm_out;
    if (destination != nullptr) store_plain(destination, row + v, rounded);
    on_rounded(v, rounded);
  }
  if constexpr (Epilogue::kHasNorm) {
    const float scale = rms_scale(sum_squares, p.hidden, p.eps);
    std::vector<Vec16> normalized(Epilogue::kHasQuant ? size_t(vectors) : 0);
    for (int64_t v = 0; v < vectors; ++v) {
      const Vec16 out =
          Epilogue::template normalize<T>(lanes_at<T>(acc, v), load_plain(p.gamma, v), scale);
      store_plain(p.norm_out, row + v, out);
      if constexpr (Epilogue::kHasQuant) normalized[size_t(v)] = out;
    }
    if constexpr (Epilogue::kHasQuant) quantize_row<T>(normalized, p, token);
  }
}

template <typename T, typename Epilogue>
void finish_row(std::vector<float>& acc, const RowCall& p, int64_t token) {
  finish_row<T, Epilogue>(acc, p, token, [](int64_t, const Vec16&) {});
}

// Sums, in rank order into acc, `vectors` packet vectors at `offset` of every other sender's
// region of this rank's slot (polling each until it has arrived) and this rank's own row, read
// from its input at vector `own_vector` with sentinel words rewritten as a peer receives them.
template <typename T>
void receive_row(const CpuSession& session, CpuCall& call, const RowCall& p, size_t offset,
                 int64_t own_vector, int64_t vectors, std::vector<float>& acc) {
  const Exchange& x = p.exchange;
  for (int64_t v = 0; v < vectors; ++v) {
    Lanes<T>& lanes = lanes_at<T>(acc, v);
    for (int r = 0; r < x.world_size; ++r) {
      const Vec16 packet =
          r == x.rank
              ? rewrite_sentinel(load_plain(p.input, own_vector + v))
              : poll_vector(session.receive_region(p.exchange, r) + offset + v * 16, call, r);
      if (r == 0) {
        accumulate_first<T>(lanes, packet);
      } else {
        accumulate<T>(lanes, packet);
      }
    }
  }
}

// Stores `vectors` vectors of `source` (sentinel words rewritten) at `offset` of this rank's
// sender region of the call's slot in rank `receiver`'s workspace.
void send_row(const Exchange& x, const CpuSession& session, int receiver, size_t offset,
              const void* source, int64_t first_vector, int64_t vectors) {
  char* base = x.workspace[receiver] + session.send_offset(x) + offset;
  for (int64_t v = 0; v < vectors; ++v) {
    store_vector(base + v * 16, rewrite_sentinel(load_plain(source, first_vector + v)));
  }
}

template <typename T, typename Epilogue>
void oneshot(const RowCall& p) {
  const CpuSession session = begin_session(p.exchange);
  CpuCall call{p.exchange, session.slot(), p.signature};
  const int64_t vectors = p.hidden / Packed<T>::kElements;
  const size_t row_bytes = size_t(p.hidden) * sizeof(T);

  // Send: the call header, then this rank's packet, sentinel words rewritten, into every other
  // rank's slot.
  send_header(p.exchange, session, p.signature);
  for (int r = 0; r < session.world(p.exchange); ++r) {
    if (r != p.exchange.rank) send_row(p.exchange, session, r, 0, p.input, 0, p.tokens * vectors);
  }
  session.clear_previous(p.exchange);

  // Receive: sum every rank's packet in rank order, then the epilogue, row by row.
  std::vector<float> acc(size_t(p.hidden));
  for (int64_t token = 0; token < p.tokens; ++token) {
    receive_row<T>(session, call, p, size_t(token) * row_bytes, token * vectors, vectors, acc);
    finish_row<T, Epilogue>(acc, p, token);
  }
  session.arrive(p.exchange.control, uint64_t(p.tokens) * row_bytes);
  finish_call(call);
}

// Two-shot (tpfuse/impl/lamport.h): reduce-scatter the input rows to their owners, finish the
// owned rows and all-gather them rounded, finish the rows received rounded.
template <typename T, typename Epilogue>
void twoshot(const RowCall& p) {
  const CpuSession session = begin_session(p.exchange);
  CpuCall call{p.exchange, session.slot(), p.signature};
  send_header(p.exchange, session, p.signature);
  const int rank = p.exchange.rank;
  const int64_t vectors = p.hidden / Packed<T>::kElements;
  const size_t row_bytes = size_t(p.hidden) * sizeof(T);
  const TwoShotLayout layout(p.tokens, session.world(p.exchange));

  // Reduce-scatter: each input row to the rank that owns its token (its own rows stay in its
  // input).
  for (int owner = 0; owner < session.world(p.exchange); ++owner) {
    if (owner == rank) continue;
    for (int64_t local = 0; local < layout.count(owner); ++local) {
      send_row(p.exchange, session, owner, layout.scatter_row(local, row_bytes), p.input,
               (layout.begin(owner) + local) * vectors, vectors);
    }
  }
  session.clear_previous(p.exchange);

  // Owned rows: rank-ordered sum, epilogue, and the rounded row to every other rank.
  std::vector<float> acc(size_t(p.hidden));
  for (int64_t local = 0; local < layout.count(rank); ++local) {
    receive_row<T>(session, call, p, layout.scatter_row(local, row_bytes),
                   (layout.begin(rank) + local) * vectors, vectors, acc);
    finish_row<T, Epilogue>(
        acc, p, layout.begin(rank) + local, [&](int64_t v, const Vec16& rounded) {
          for (int r = 0; r < session.world(p.exchange); ++r) {
            if (r == rank) continue;
            store_vector(p.exchange.workspace[r] + session.send_offset(p.exchange) +
                             layout.gather_row(local, row_bytes) + v * 16,
                         rounded);
          }
        });
  }

  // Rows other ranks own arrive rounded: finish them exactly as their owner did.
  for (int owner = 0; owner < session.world(p.exchange); ++owner) {
    if (owner == rank) continue;
    const char* base = session.receive_region(p.exchange, owner);
    for (int64_t local = 0; local < layout.count(owner); ++local) {
      for (int64_t v = 0; v < vectors; ++v) {
        const Vec16 packet =
            poll_vector(base + layout.gather_row(local, row_bytes) + v * 16, call, owner);
        accumulate_first<T>(lanes_at<T>(acc, v), packet);
      }
      finish_row<T, typename Epilogue::Gathered>(acc, p, layout.begin(owner) + local);
    }
  }
  session.arrive(p.exchange.control, layout.sender_bytes(row_bytes));
  finish_call(call);
}

template <typename T, typename Epilogue>
void local_epilogue(const RowCall& p) {
  const int64_t vectors = p.hidden / Packed<T>::kElements;
  std::vector<float> acc(size_t(p.hidden));
  for (int64_t token = 0; token < p.tokens; ++token) {
    for (int64_t v = 0; v < vectors; ++v) {
      accumulate_first<T>(lanes_at<T>(acc, v), load_plain(p.input, token * vectors + v));
    }
    finish_row<T, Epilogue>(acc, p, token);
  }
}

// Binds dtype and epilogue and calls fn(T, Epilogue).
template <typename Fn>
void dispatch_row(DType dtype, const RowEpilogueKind& kind, Fn&& fn) {
  dispatch_dtype(dtype, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    const bool found = dispatch_epilogue_in(RowEpilogues{}, kind,
                                            [&](auto epilogue) { fn(TypeTag<T>{}, epilogue); });
    if (!found) TPF_FAIL("no row epilogue for this combination");  // validate_* rule it out
  });
}

}  // namespace

void cpu_oneshot(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue) {
  dispatch_row(dtype, epilogue, [&](auto type_tag, auto epilogue_tag) {
    oneshot<typename decltype(type_tag)::type, decltype(epilogue_tag)>(call);
  });
}

void cpu_twoshot(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue) {
  dispatch_row(dtype, epilogue, [&](auto type_tag, auto epilogue_tag) {
    twoshot<typename decltype(type_tag)::type, decltype(epilogue_tag)>(call);
  });
}

void cpu_local_epilogue(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue) {
  dispatch_row(dtype, epilogue, [&](auto type_tag, auto epilogue_tag) {
    local_epilogue<typename decltype(type_tag)::type, decltype(epilogue_tag)>(call);
  });
}

void cpu_allreduce_rows(const Exchange& exchange, const void* input, void* out, int64_t rows,
                        int64_t row_elements, DType dtype) {
  const size_t row_bytes = size_t(row_elements) * dtype_size(dtype);
  const int64_t chunk = std::max<int64_t>(1, int64_t(exchange.packet_bytes / row_bytes));
  for (int64_t first = 0; first < rows; first += chunk) {
    RowCall sum{};
    sum.exchange = exchange;
    sum.signature = row_signature(CallOp::kRowsOneShot, dtype, SumEpilogue::kKind,
                                  std::min(chunk, rows - first), row_elements, 0.0f);
    sum.input = static_cast<const char*>(input) + size_t(first) * row_bytes;
    sum.norm_out = static_cast<char*>(out) + size_t(first) * row_bytes;
    sum.tokens = std::min(chunk, rows - first);
    sum.hidden = row_elements;
    cpu_oneshot(sum, dtype, SumEpilogue::kKind);
  }
}

void cpu_nccl_path(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue) {
  if (!epilogue.norm) {
    cpu_allreduce_rows(call.exchange, call.input, call.norm_out, call.tokens, call.hidden, dtype);
    return;
  }
  // The sum, rounded to dtype as NCCL delivers it, then the local epilogue on it.
  std::vector<Vec16> sum(size_t(call.tokens * call.hidden) * dtype_size(dtype) / 16);
  cpu_allreduce_rows(call.exchange, call.input, sum.data(), call.tokens, call.hidden, dtype);
  RowCall local = call;
  local.input = sum.data();
  cpu_local_epilogue(local, dtype, epilogue);
}

}  // namespace tpfuse::impl
