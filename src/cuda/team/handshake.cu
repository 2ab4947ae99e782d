// The creation handshake (cuda/team/handshake.h).
#include <cstdlib>
#include <sstream>

#include "cuda/check.h"
#include "cuda/device_ops.cuh"
#include "cuda/team/handshake.h"

namespace tpfuse::impl {
namespace {

// The word rank `sender` stores into rank `receiver`: never the sentinel the area starts with.
__host__ __device__ uint32_t handshake_word(int sender, int receiver) {
  return 0x7E5A0000u | (uint32_t(sender) << 8) | uint32_t(receiver);
}

struct HandshakeParams {
  char* workspace[kMaxWorldSize];
  int rank;
  int world;
  size_t area_offset;
  uint64_t timeout_ns;
  int drop_receiver;  // test hook: this rank does not store into that rank (-1: none)
  uint32_t* arrived;
};

// Thread p stores this rank's word into rank p's area, then polls this rank's area for p's word.
// Volatile stores and polls, as in the protocol (device_ops.cuh); the result goes to host-mapped
// memory with a system-scope fence so the host sees it once the stream is synchronized.
__global__ void handshake_kernel(const HandshakeParams p) {
  const int peer = threadIdx.x;
  if (peer >= p.world) return;
  if (peer != p.drop_receiver) {
    auto* slot = reinterpret_cast<volatile uint32_t*>(p.workspace[peer] + p.area_offset +
                                                      size_t(p.rank) * 16);
    *slot = handshake_word(p.rank, peer);
  }
  auto* mine =
      reinterpret_cast<volatile uint32_t*>(p.workspace[p.rank] + p.area_offset + size_t(peer) * 16);
  const uint32_t expected = handshake_word(peer, p.rank);
  const uint64_t deadline = global_timer_ns() + p.timeout_ns;
  uint32_t arrived = 0;
  for (uint32_t spins = 0;; ++spins) {
    if (*mine == expected) {
      arrived = 1;
      break;
    }
    if (spins % 64 == 0 && global_timer_ns() > deadline) break;
  }
  *reinterpret_cast<volatile uint32_t*>(&p.arrived[peer]) = arrived;
  __threadfence_system();
}

// TPFUSE_TEST_HANDSHAKE_DROP="s>r": rank s skips its handshake store into rank r, as if its P2P
// writes never arrived. For tests of the fallback; never set in production.
int drop_receiver_for(int rank) {
  const char* value = std::getenv("TPFUSE_TEST_HANDSHAKE_DROP");
  if (value == nullptr || value[0] == '\0') return -1;
  int sender = -1, receiver = -1;
  char separator = 0;
  std::istringstream in(value);
  in >> sender >> separator >> receiver;
  if (!in || separator != '>')
    TPF_FAIL("TPFUSE_TEST_HANDSHAKE_DROP must read 's>r', got " << value);
  return sender == rank ? receiver : -1;
}

__global__ void fill_sentinel_kernel(uint32_t* words, size_t count) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    words[i] = kSentinel;
  }
}

}  // namespace

void fill_sentinel(void* words, size_t bytes, cudaStream_t stream) {
  fill_sentinel_kernel<<<1024, 256, 0, stream>>>(static_cast<uint32_t*>(words), bytes / 4);
  TPF_CHECK_CUDA(cudaGetLastError());
}

void launch_handshake(const std::array<char*, kMaxWorldSize>& workspace, int rank, int world,
                      size_t area_offset, uint64_t timeout_ns, uint32_t* arrived,
                      cudaStream_t stream) {
  HandshakeParams params{};
  for (int r = 0; r < kMaxWorldSize; ++r) params.workspace[r] = workspace[r];
  params.rank = rank;
  params.world = world;
  params.area_offset = area_offset;
  params.timeout_ns = timeout_ns;
  params.drop_receiver = drop_receiver_for(rank);
  params.arrived = arrived;
  handshake_kernel<<<1, 32, 0, stream>>>(params);
  TPF_CHECK_CUDA(cudaGetLastError());
}

uint32_t arrived_mask(const uint32_t* arrived, int world) {
  uint32_t mask = 0;
  for (int p = 0; p < world; ++p) {
    if (reinterpret_cast<const volatile uint32_t*>(arrived)[p] != 0) mask |= 1u << p;
  }
  return mask;
}

std::string handshake_verdict(const uint32_t* masks, int world, double timeout_seconds) {
  for (int receiver = 0; receiver < world; ++receiver) {
    for (int sender = 0; sender < world; ++sender) {
      if ((masks[receiver] >> sender & 1u) == 0) {
        std::ostringstream out;
        out << "the creation handshake failed: rank " << receiver << " did not see rank " << sender
            << "'s store within " << timeout_seconds
            << " s (peer stores do not arrive; P2P off or broken?)";
        return out.str();
      }
    }
  }
  return "";
}

}  // namespace tpfuse::impl
