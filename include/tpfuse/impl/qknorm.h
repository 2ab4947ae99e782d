// The QK-norm epilogue and rotary embedding, host+device: the GPU kernel and the CPU backend
// call these per 16-byte vector (norm) and per element (RoPE).
//
// Packet: one 16-byte vector per token, fp32 words {sum of q^2, sum of k^2, 0, 0}, exchanged
// with the Lamport protocol of lamport.h and summed in rank order like any fp32 packet.
#pragma once

#include <cstdint>

#include "tpfuse/impl/config.h"
#include "tpfuse/impl/numeric.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse::impl {

template <typename T>
TPF_HOST_DEVICE float vector_sum_squares(const Vec16& v) {
  float lanes[Packed<T>::kElements];
  unpack<T>(v, lanes);
  float sum = 0.0f;
  TPF_UNROLL
  for (int i = 0; i < Packed<T>::kElements; ++i) sum += lanes[i] * lanes[i];
  return sum;
}

TPF_HOST_DEVICE Vec16 qk_packet(float sum_q, float sum_k) {
  return Vec16{{float_bits(sum_q), float_bits(sum_k), 0u, 0u}};
}

// x * scale * gamma in fp32 lanes (not yet rounded: RoPE, if any, comes first).
template <typename T>
TPF_HOST_DEVICE void scale_lanes(const Vec16& x, const Vec16& gamma, float scale,
                                 float (&out)[Packed<T>::kElements]) {
  float g[Packed<T>::kElements];
  unpack<T>(x, out);
  unpack<T>(gamma, g);
  TPF_UNROLL
  for (int i = 0; i < Packed<T>::kElements; ++i) out[i] = (out[i] * scale) * g[i];
}

// The rotation of one element of a RoPE pair: x * cos - partner * sin for the pair's first
// element, x * cos + partner * sin for its second. Every RoPE path (the GPU kernel's two, the
// CPU backend) rotates through here. On the GPU the rounding is pinned (the product
// partner * sin rounded, then one fused multiply-add), so it does not depend on how the
// compiler contracts the expression where it is inlined.
TPF_HOST_DEVICE float rotate(float x, float partner, float c, float s, bool first) {
#if TPF_ON_DEVICE
  const float ps = __fmul_rn(partner, s);
  return __fmaf_rn(x, c, first ? -ps : ps);
#else
  return first ? x * c - partner * s : x * c + partner * s;
#endif
}

// Whether the GPU kernel can run RoPE in registers for a layout (else it goes through shared
// memory): vectors of `elements` never straddle a head or a rotary half (neox) or the rotary
// boundary (interleaved), and every neox partner vector is held by a lane of the same warp, at
// the same index of the thread's vectors. The kernel's block holds vector c of a row in thread
// c % threads (threads a multiple of 32), lane c % 32; heads start at multiples of the head's
// vector count, so a head lies in one warp when that count divides 32, and its rotary part does
// when a head starts a warp and the rotary part has at most 32 vectors. At most
// kMaxRopeRegisterVecs vectors a thread (the cos/sin registers). tests/cpu checks the claim on
// every layout it can make.
constexpr int kMaxRopeRegisterVecs = 2;

inline bool rope_in_registers(RopeStyle style, int64_t head_dim, int64_t rotary_dim, int elements,
                              int vecs_per_thread) {
  if (style == RopeStyle::kNone || vecs_per_thread > kMaxRopeRegisterVecs ||
      head_dim % elements != 0 || rotary_dim % elements != 0) {
    return false;
  }
  if (style == RopeStyle::kInterleaved) return true;  // interleaved pairs lie inside a vector
  const int64_t head_vectors = head_dim / elements;
  const bool half_whole = (rotary_dim / 2) % elements == 0;
  const bool one_warp =
      32 % head_vectors == 0 || (head_vectors % 32 == 0 && rotary_dim / elements <= 32);
  return half_whole && one_warp;
}

// Element j (0 <= j < head_dim) of one head after the rotary embedding; `head` holds the head's
// normalized fp32 values, `cos_sin` the position's cache row.
TPF_HOST_DEVICE float rope_element(const float* head, int64_t j, int64_t rotary_dim,
                                   RopeStyle style, const float* cos_sin) {
  if (j >= rotary_dim) return head[j];
  const int64_t half = rotary_dim / 2;
  if (style == RopeStyle::kNeox) {  // neox: (j, j + half)
    const int64_t i = j < half ? j : j - half;
    const float c = cos_sin[i];
    const float s = cos_sin[half + i];
    return j < half ? rotate(head[j], head[j + half], c, s, true)
                    : rotate(head[j], head[j - half], c, s, false);
  }
  // interleaved: (2i, 2i + 1)
  const int64_t i = j / 2;
  const float c = cos_sin[i];
  const float s = cos_sin[half + i];
  return j % 2 == 0 ? rotate(head[j], head[j + 1], c, s, true)
                    : rotate(head[j], head[j - 1], c, s, false);
}

// RoPE of one vector: `lanes` become elements [start, start + kN) of the normalized row `row`
// (which holds every head's normalized fp32 values, unrotated: the partners), rotated. The same
// arithmetic as rope_element for each element; when the kN elements lie in one head and one
// rotary half (neox) or pairs (interleaved), the head, the cos/sin index and the partner offset
// are worked out once for the vector instead of once per element.
template <int kN>
TPF_HOST_DEVICE void rope_lanes(float (&lanes)[kN], const float* row, int start, int head_dim,
                                int rotary_dim, RopeStyle style, const float* cos_sin) {
  const int j0 = start % head_dim;
  const int half = rotary_dim / 2;
  const float* head = row + (start - j0);
  const bool one_head = j0 + kN <= head_dim;
  if (one_head && j0 >= rotary_dim) {
    TPF_UNROLL
    for (int e = 0; e < kN; ++e) lanes[e] = head[j0 + e];
    return;
  }
  if (one_head && style == RopeStyle::kNeox &&
      (j0 + kN <= half || (j0 >= half && j0 + kN <= rotary_dim))) {
    if (j0 < half) {  // (j, j + half): x * cos - partner * sin
      TPF_UNROLL
      for (int e = 0; e < kN; ++e) {
        lanes[e] = rotate(head[j0 + e], head[j0 + e + half], cos_sin[j0 + e],
                          cos_sin[half + j0 + e], true);
      }
    } else {  // (j, j - half): x * cos + partner * sin
      const int i0 = j0 - half;
      TPF_UNROLL
      for (int e = 0; e < kN; ++e) {
        lanes[e] =
            rotate(head[j0 + e], head[i0 + e], cos_sin[i0 + e], cos_sin[half + i0 + e], false);
      }
    }
    return;
  }
  if (one_head && style == RopeStyle::kInterleaved && kN % 2 == 0 && j0 % 2 == 0 &&
      j0 + kN <= rotary_dim) {
    TPF_UNROLL
    for (int e = 0; e < kN; e += 2) {  // (2i, 2i + 1)
      const int i = (j0 + e) / 2;
      const float c = cos_sin[i];
      const float s = cos_sin[half + i];
      lanes[e] = rotate(head[j0 + e], head[j0 + e + 1], c, s, true);
      lanes[e + 1] = rotate(head[j0 + e + 1], head[j0 + e], c, s, false);
    }
    return;
  }
  TPF_UNROLL
  for (int e = 0; e < kN; ++e) {  // the vector spans heads or halves: element by element
    const int j = (start + e) % head_dim;
    lanes[e] = rope_element(row + (start + e - j), j, rotary_dim, style, cos_sin);
  }
}

}  // namespace tpfuse::impl
