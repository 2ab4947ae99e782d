// The bench's own device code: input fills and the floors (an empty kernel in a graph, an NVLink
// store-to-poll crossing, a peer copy). Host-callable; no CUDA headers needed to include this.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tpfuse/tpfuse.h"

namespace tpfuse::bench {

// Writes random_value(seed, i, low, high) as `dtype` into data[0, count) on the current device.
void fill_random_device(void* data, int64_t count, DType dtype, uint64_t seed, float low,
                        float high, cudaStream_t stream);

// Microseconds per kernel of a CUDA graph of `nodes` empty single-block kernels on `device`,
// median of `replays` replays. With `pdl`, each kernel is launched with programmatic stream
// serialization and waits on / releases its grid dependency as a tpfuse kernel does.
double measure_empty_kernel_graph_us(int device, bool pdl, int nodes, int replays);

// One-way NVLink latency between two devices with peer access: one thread on each stores a
// counter into the other's memory and polls its own; one way = elapsed / iterations / 2. Median
// of `repeats` runs.
double measure_nvlink_one_way_us(int device_a, int device_b, int iterations, int repeats);

struct CopyFloor {
  double us = 0.0;
  double gbps = 0.0;
};

// A cudaMemcpyPeerAsync of `bytes` from one device to another, median of `repeats` copies.
CopyFloor measure_peer_copy(int source_device, int destination_device, size_t bytes, int repeats);

// How the both-ways bandwidth floor moves its bytes: SM stores (16-byte vectors read locally and
// stored into the peer, as a fused kernel sends) or the copy engines (cudaMemcpyPeerAsync).
enum class PeerTransfer { kStores, kCopyEngine };

// Both devices send `bytes` into the other's memory at once: the NVLink bandwidth each direction
// reaches while the other direction is busy too (as in an all-reduce). `nodes` transfers on each
// device per replay (SM stores: a CUDA graph of them; peer copies cannot be captured, so they
// are enqueued directly), device a's replays timed; us per transfer, median of `replays`.
CopyFloor measure_peer_both_ways(int device_a, int device_b, size_t bytes, PeerTransfer transfer,
                                 int nodes, int replays);

// The baselines' separate kernels, the unfused form of what tpfuse fuses (each a 16-byte vector
// a thread, fp32 math, the library's conversions):
// out [tokens, hidden] = sum_j weights[t, j] (fp32) * rows[t, j] (dtype), rounded once: the MoE
// combine an engine runs before its all-reduce;
void moe_combine_device(const void* rows, const float* weights, int topk, int64_t tokens,
                        int64_t hidden, DType dtype, void* out, cudaStream_t stream);
// quant_out (E4M3) and scales of `norm` [tokens, hidden] in `mode` (tpfuse.h's QuantMode, the
// same definition), the quantization kernel that follows an unfused norm.
void quantize_fp8_device(const void* norm, int64_t tokens, int64_t hidden, DType dtype,
                         QuantMode mode, const float* static_scale, void* quant_out, float* scales,
                         cudaStream_t stream);

// Reads the first `width` elements of each of `tokens` rows of `row` elements and writes them
// back in place (16-byte vectors, several in flight a thread, no arithmetic): the memory traffic
// of an in-place QK norm of q and k, its floor. `width` and `row` are multiples of a vector.
void rows_in_place_copy_device(void* data, int64_t tokens, int64_t row, int64_t width, DType dtype,
                               cudaStream_t stream);

// Enables peer access from the current device to `peer`; already enabled is fine.
void enable_peer_access(int device, int peer);

}  // namespace tpfuse::bench
