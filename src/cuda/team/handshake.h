// The store-then-poll handshake every CUDA team runs at creation: each rank stores a word into
// every rank's handshake area (through the same peer pointers the kernels use) and polls its own
// area for every rank's word, with a timeout. A peer whose stores do not arrive (P2P off, broken,
// or another host) makes the team take the NCCL path instead of hanging in its first op.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <string>

#include "tpfuse/impl/lamport.h"

namespace tpfuse::impl {

// Queues a fill of `bytes` (a multiple of 4) at `words` with the sentinel on `stream`.
void fill_sentinel(void* words, size_t bytes, cudaStream_t stream);

// Queues the handshake of rank `rank` on `stream` (current device). arrived: host-mapped,
// [world] words; arrived[p] becomes 1 if p's word reached this rank, 0 if the timeout passed.
void launch_handshake(const std::array<char*, kMaxWorldSize>& workspace, int rank, int world,
                      size_t area_offset, uint64_t timeout_ns, uint32_t* arrived,
                      cudaStream_t stream);

// Bit p set: rank p's store reached the rank these flags belong to.
uint32_t arrived_mask(const uint32_t* arrived, int world);

// Empty if every rank saw every rank's store (masks[r] = what rank r saw), else a sentence
// naming the first pair that failed.
std::string handshake_verdict(const uint32_t* masks, int world, double timeout_seconds);

}  // namespace tpfuse::impl
