// Deterministic random inputs, the same on the host (CPU mode) and the device (GPU mode).
#pragma once

#include <cstdint>

#include "tpfuse/impl/config.h"

namespace tpfuse::bench {

// splitmix64's finalizer: a good hash of (seed, index), so every element gets its own value with
// no generator state to carry between threads.
TPF_HOST_DEVICE uint64_t mix_bits(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A value in (low, high) for element `index`. The 24-bit fraction is (k + 1/2) / 2^24, never 0
// or 1/2, so for (low, high) = (-1, 1) the value is an odd multiple of 2^-24: exact in fp32 and
// never zero, not even after rounding to fp16 or bf16. Zeros would let the one-shot protocol's
// sentinel rewrite and the norm take paths that real activations rarely take.
TPF_HOST_DEVICE float random_value(uint64_t seed, uint64_t index, float low, float high) {
  const uint64_t bits = mix_bits(seed * 0x100000001b3ull + index);
  const float fraction = (float(bits >> 40) + 0.5f) * (1.0f / 16777216.0f);
  return low + (high - low) * fraction;
}

}  // namespace tpfuse::bench
