// The distributed QK norm on the CPU backend: per token, this rank's sums of squares of q and k
// go to every rank as one fp32 packet (a Lamport session, tpfuse/impl/session.h), every rank sums
// the packets in rank order, and normalizes (and rotates) its own q and k slices. Same functions
// as the GPU kernel (tpfuse/impl/qknorm.h, tpfuse/impl/epilogue.h).
#include <cstring>
#include <vector>

#include "cpu/exchange.h"
#include "cpu/kernels.h"
#include "tpfuse/impl/dispatch.h"
#include "tpfuse/impl/epilogue.h"
#include "tpfuse/impl/qknorm.h"

namespace tpfuse::impl {
namespace {

Vec16 load_at(const void* base, int64_t element_offset, size_t element_size) {
  Vec16 v;
  std::memcpy(&v, static_cast<const char*>(base) + element_offset * int64_t(element_size), 16);
  return v;
}

// This rank's {sum q^2, sum k^2} of one token (k as 0 where this rank does not count it).
template <typename T>
void row_sums(const QkCall& p, int64_t token, float& sum_q, float& sum_k) {
  constexpr int kElements = Packed<T>::kElements;
  const int64_t row = p.q_size + 2 * p.kv_size;
  sum_q = 0.0f;
  sum_k = 0.0f;
  for (int64_t e = 0; e < p.q_size; e += kElements) {
    sum_q += vector_sum_squares<T>(load_at(p.qkv, token * row + e, sizeof(T)));
  }
  if (!p.counts_k) return;
  for (int64_t e = 0; e < p.kv_size; e += kElements) {
    sum_k += vector_sum_squares<T>(load_at(p.qkv, token * row + p.q_size + e, sizeof(T)));
  }
}

// Normalizes (and rotates) one token's q and k with the global sums; `normalized` and
// `rotated` are scratch rows.
template <typename T>
void normalize_row(const QkCall& p, int64_t token, float sum_q, float sum_k,
                   std::vector<float>& normalized, std::vector<float>& rotated) {
  constexpr int kElements = Packed<T>::kElements;
  const int64_t row = p.q_size + 2 * p.kv_size;
  const float scale_q = rms_scale(sum_q, p.q_global_size, p.eps);
  const float scale_k = rms_scale(sum_k, p.k_global_size, p.eps);
  for (int64_t e = 0; e < p.q_size; e += kElements) {
    float(&lanes)[kElements] = *reinterpret_cast<float(*)[kElements]>(&normalized[e]);
    scale_lanes<T>(load_at(p.qkv, token * row + e, sizeof(T)), load_at(p.q_gamma, e, sizeof(T)),
                   scale_q, lanes);
  }
  for (int64_t e = 0; e < p.kv_size; e += kElements) {
    float(&lanes)[kElements] = *reinterpret_cast<float(*)[kElements]>(&normalized[p.q_size + e]);
    scale_lanes<T>(load_at(p.qkv, token * row + p.q_size + e, sizeof(T)),
                   load_at(p.k_gamma, e, sizeof(T)), scale_k, lanes);
  }
  if (p.rope != RopeStyle::kNone) {
    // Vector by vector, as the GPU kernel: partners are read from the unrotated row.
    const float* cos_sin = p.cos_sin_cache + p.positions[token] * p.rotary_dim;
    for (int64_t e = 0; e < p.q_size + p.kv_size; e += kElements) {
      float(&lanes)[kElements] = *reinterpret_cast<float(*)[kElements]>(&rotated[e]);
      rope_lanes<kElements>(lanes, normalized.data(), int(e), int(p.head_dim), int(p.rotary_dim),
                            p.rope, cos_sin);
    }
    normalized.swap(rotated);
  }
  for (int64_t e = 0; e < p.q_size + p.kv_size; e += kElements) {
    const Vec16 out = pack<T>(*reinterpret_cast<const float(*)[kElements]>(&normalized[e]));
    char* destination =
        e < p.q_size
            ? static_cast<char*>(p.q_out) + (token * p.q_out_stride + e) * int64_t(sizeof(T))
            : static_cast<char*>(p.k_out) +
                  (token * p.k_out_stride + e - p.q_size) * int64_t(sizeof(T));
    std::memcpy(destination, &out, 16);
  }
}

template <typename T>
void qk_rmsnorm(const QkCall& p, QkPass pass) {
  std::vector<float> normalized(size_t(p.q_size + p.kv_size));
  std::vector<float> rotated(size_t(p.q_size + p.kv_size));
  if (pass == QkPass::kSums) {
    for (int64_t token = 0; token < p.tokens; ++token) {
      row_sums<T>(p, token, p.sums[2 * token], p.sums[2 * token + 1]);
    }
    return;
  }
  if (pass == QkPass::kNormFromSums) {
    for (int64_t token = 0; token < p.tokens; ++token) {
      normalize_row<T>(p, token, p.sums[2 * token], p.sums[2 * token + 1], normalized, rotated);
    }
    return;
  }
  const Exchange& x = p.exchange;
  const CpuSession session = begin_session(x);
  CpuCall call = start_call(x, session, p.signature);

  // Send: {sum q^2, sum k^2} per token to every rank (its own too: its packet is in no input).
  for (int64_t token = 0; token < p.tokens; ++token) {
    float sum_q, sum_k;
    row_sums<T>(p, token, sum_q, sum_k);
    const Vec16 packet = rewrite_sentinel(qk_packet(sum_q, sum_k));
    for (int r = 0; r < x.world_size; ++r) {
      store_vector(x.workspace[r] + session.send_offset(x) + token * 16, packet);
    }
  }
  session.clear_previous(x);

  // Receive: sum the packets in rank order, then normalize, rotate, store.
  for (int64_t token = 0; token < p.tokens; ++token) {
    float sums[4] = {};
    for (int r = 0; r < x.world_size; ++r) {
      const Vec16 packet = poll_vector(session.receive_region(x, r) + token * 16, call, r);
      if (r == 0) {
        accumulate_first<float>(sums, packet);
      } else {
        accumulate<float>(sums, packet);
      }
    }
    normalize_row<T>(p, token, sums[0], sums[1], normalized, rotated);
  }
  session.arrive(x.control, size_t(p.tokens) * 16);
  finish_call(call);
}

}  // namespace

void cpu_qk_rmsnorm(const QkCall& call, DType dtype, QkPass pass) {
  dispatch_dtype(dtype, [&](auto tag) { qk_rmsnorm<typename decltype(tag)::type>(call, pass); });
}

// The NCCL path's stand-in: this rank's sums, a rank-ordered fp32 all-reduce of them, the norm.
void cpu_qk_nccl_path(const QkCall& call, DType dtype) {
  const int64_t rows = (2 * call.tokens + 3) / 4;  // 16-byte rows of 4 floats
  std::vector<float> sums(size_t(rows) * 4, 0.0f);
  QkCall pass = call;
  pass.sums = sums.data();
  cpu_qk_rmsnorm(pass, dtype, QkPass::kSums);
  cpu_allreduce_rows(call.exchange, call.signature, sums.data(), sums.data(), rows, 4,
                     DType::kFloat32);
  cpu_qk_rmsnorm(pass, dtype, QkPass::kNormFromSums);
}

}  // namespace tpfuse::impl
