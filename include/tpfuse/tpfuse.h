// tpfuse: fused all-reduce + epilogue kernels for tensor-parallel inference.
//
// The whole public contract is in this header. It has no dependency on torch, CUDA or NCCL:
// tensors are raw pointers with a dtype and sizes, and work goes on the backend's stream, passed
// as a Stream (tpfuse/cuda.h adds the forms that take CUDA's stream and NCCL's communicator;
// tpfuse/sycl.h those that take a sycl::queue, and the SYCL teams over given devices).
//
//   Team        the ranks that reduce together and their symmetric workspace (one handle per rank).
//   allreduce_add_rmsnorm   residual_out = sum_r(input_r) + residual;
//                           norm_out     = rmsnorm(residual_out) * gamma
//   allreduce               out = sum_r(input_r)
//   add_rmsnorm             the same epilogue on one rank, no collective (the local kernel).
//
// Promises (tested): every rank gets bitwise-identical outputs; the same inputs give the same
// bits on every call; sums are accumulated in fp32 in rank order 0..W-1 and rounded once.
// Correct or loud: call k of a rank is only ever combined with call k of each peer (every call
// carries its number and signature in a header). Bad arguments throw tpfuse::Error naming the
// argument before any write; the rank still takes its turn in the call (no data), so its peers'
// call ends at once with NaN in every output and an error naming it, and the team goes on.
// Ranks whose calls disagree (op, algorithm, dtype, epilogue, tokens, widths, eps) get an error
// naming the peer and the field, and a peer that does not arrive within the timeout an error
// naming it; either fails the team on every rank: the rank that saw it announces it (a mark in
// every peer's workspace), so every later call of every rank is refused before it writes
// anything (a late peer never meets a call its peers gave up on) and every Team::check throws.
// A failed team stays failed: create a new one. Every output of a call that failed once begun
// is NaN, every element (on the GPU, a call whose kernel meets a peer's failure mark at its
// start writes nothing; Team::check tells the failure).
//
// Threads: a call blocks its thread on the CPU backend until every rank has made it, so an
// in-process CPU team needs one thread per rank (CUDA calls only queue work).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "tpfuse/limits.h"

namespace tpfuse {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };
// What a team's calls run on. The values are fixed (the torch ops pass them as integers); a
// backend a build lacks is an error naming it (cuda_available()).
enum class Backend : int { kCpu = 0, kCuda = 1, kSycl = 2 };

// The backend's stream (or queue) a call's work goes on, as an untyped handle: the CUDA stream
// for the CUDA backend (null: the default stream; tpfuse/cuda.h has the entry points that take
// CUDA's stream type), a sycl::queue* for the SYCL backend (null: the rank's own in-order queue;
// tpfuse/sycl.h), and empty for the CPU backend, whose calls run on the calling thread.
struct Stream {
  void* handle = nullptr;
};

const char* dtype_name(DType dtype);
size_t dtype_size(DType dtype);

// The one error type of the library. what() names the argument or the failing call, and where.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// How a call moves data. Every algorithm sums each element over the ranks in fp32 in rank order
// 0..W-1 where it can; one-shot and two-shot round once and give the same bits for a token
// whatever the batch (batch invariance). The NCCL path rounds the all-reduced sum to the dtype
// before the residual add (two roundings) and sums in NCCL's order: its bits may differ.
enum class Algorithm : int {
  kAuto = 0,     // the team's selection table decides (Team::choose)
  kOneShot = 1,  // Lamport one-shot: every rank stores its whole input into every rank
  kTwoShot = 2,  // reduce-scatter by tokens, epilogue on the owned tokens, all-gather
  kNccl = 3,     // ncclAllReduce, then the local epilogue kernel
};
const char* algorithm_name(Algorithm algorithm);

// Where a multi-process team's symmetric workspace comes from.
enum class PeerMemory : int {
  kAuto = 0,        // NCCL symmetric windows where NCCL has them, else CUDA IPC
  kNcclWindow = 1,  // ncclMemAlloc + ncclCommWindowRegister; peer addresses from the device API
  kCudaIpc = 2,     // cudaMalloc + cudaIpcGetMemHandle, handles all-gathered over NCCL
};

struct TeamOptions {
  // Bytes of one rank's packet in one Lamport slot: the largest message (tokens * hidden *
  // element size) a one-shot call can carry. Each rank allocates 3 slots * world_size * this, so
  // the default (16 MiB) costs 96 MiB per GPU at world size 2 and 384 MiB at 8; it holds 2730
  // tokens of hidden 3072 in bf16. A multiple of 16 in [16, 2^40]; a message a fused path cannot
  // carry goes to the NCCL path (the CPU backend's carries it a packet at a time), or is refused
  // before any write where there is none.
  size_t packet_bytes = size_t{16} << 20;
  // How long a rank waits for a peer's packet before it gives up, marks the team failed on every
  // rank and reports the missing rank (Team::check). 0 waits forever. At most a year. Allow for
  // a peer's slowest first call (a compile, a warm-up): a call that is late by more than this is
  // a dead peer to the team.
  double peer_timeout_seconds = 10.0;
  // false: ranks never store into each other's memory; every op runs through NCCL (for hosts
  // where P2P is known to be unreliable). true: the team proves at creation, with a
  // store-then-poll handshake, that every rank's stores arrive in every peer, and falls back
  // to NCCL (saying why, Team::fallback_reason) if they do not.
  bool peer_stores = true;
  // How long the creation handshake waits for a peer's store.
  double handshake_timeout_seconds = 5.0;
  // Multi-process teams only (create_cuda_team(id, ...) has only kCudaIpc: kAuto means it).
  PeerMemory peer_memory = PeerMemory::kAuto;
};

namespace impl {
struct TeamState;
}

// One rank's handle on a team. Handles are cheap to copy and share their workspace.
class Team {
 public:
  Team() = default;
  explicit Team(std::shared_ptr<impl::TeamState> state) : state_(std::move(state)) {}

  int rank() const;
  int world_size() const;
  Backend backend() const;
  // The device ordinal of this rank (CUDA: its device; SYCL: its index in
  // sycl::device::get_devices(); -1 for the CPU backend).
  int device() const;
  size_t packet_bytes() const;
  // Most tokens a call of this width and dtype can carry with `algorithm` (one-shot:
  // packet_bytes / row bytes; two-shot: world_size times half that; NCCL: no limit).
  int64_t max_tokens(int64_t hidden, DType dtype, Algorithm algorithm = Algorithm::kOneShot) const;
  // The algorithm allreduce_add_rmsnorm (and allreduce, as tokens x hidden) runs for this shape:
  // `requested` unless it is kAuto, else the selection table's choice (tpfuse/algorithms.csv);
  // then the next one that can carry the message (one-shot, two-shot, NCCL), and NCCL on a team
  // without peer stores. Throws if the result cannot run (e.g. NCCL in a build without it).
  Algorithm choose(int64_t tokens, int64_t hidden, DType dtype,
                   Algorithm requested = Algorithm::kAuto) const;
  // Empty when the fused kernels can run; otherwise why every op of this team runs through NCCL
  // (decided at creation, the same on every rank).
  const std::string& fallback_reason() const;
  // How ranks reach each other's memory: "host memory" (CPU backend, in-process), "shared memory"
  // (CPU backend, a process a rank), "cuda peer access" (in-process), "nccl window" or "cuda
  // ipc" (multi-process: create_nccl_team, or create_cuda_team(id, ...) without NCCL), "sycl usm"
  // (SYCL ranks sharing one device) or "sycl peer access" (several SYCL devices), "sycl shared
  // memory" or "sycl ipc" (SYCL, a process a rank: a CPU device or a GPU), or "none" (NCCL
  // only).
  const std::string& peer_memory() const;
  // Synchronizes with the rank's device work, then throws tpfuse::Error if the team failed: a
  // peer did not arrive in time (naming it), a peer's call disagreed with this rank's (naming the
  // peer, the field and both values), or a peer announced such a failure of its own (naming it
  // and what it saw). A failed team stays failed: create a new one. Also throws, once, if a peer
  // rejected its part of a call since the last check: this rank's outputs of that call are NaN,
  // and the team goes on. (The CPU backend throws all of these from the call itself.)
  void check() const;

  impl::TeamState* state() const { return state_.get(); }

 private:
  std::shared_ptr<impl::TeamState> state_;
};

// A team whose ranks are threads of this process over host memory: the CPU backend. Each rank's
// calls must come from its own thread (they block until the peers' packets arrive).
std::vector<Team> create_cpu_team(int world_size, const TeamOptions& options = {});

// A CPU-backend team whose ranks are processes of this host (one rank each), every rank's
// workspace in one block of shared memory: the same protocol and bits as the in-process CPU
// team. Make the id in any process (create_cpu_team_id; it is plain bytes: a magic and a random
// name), pass it to the others through any channel (a torch process group, MPI, a file), then
// create_cpu_team(id, rank, world_size) on every rank with the same world_size and TeamOptions.
// Collective: each rank waits up to options.peer_timeout_seconds (0: forever) for the others to
// join (rank 0 may start last), then throws naming the ranks that did not. An id makes one team.
// The memory has no name in any filesystem (a memfd that rank 0 hands to the other ranks over a
// Linux abstract unix socket named by the id, closed once every rank has joined), so nothing
// outlives the processes, even when all of them die while the team is being made. The ranks
// must share a network namespace (the socket's). A peer that dies later is reported as missing
// (naming its process) by the call that waits for it.
struct CpuTeamId {
  char bytes[64];
};
CpuTeamId create_cpu_team_id();
Team create_cpu_team(const CpuTeamId& id, int rank, int world_size,
                     const TeamOptions& options = {});

// A team of the given CUDA devices driven by this one process (peer access required; its absence
// is an error naming the pair). Rank i is devices[i].
std::vector<Team> create_cuda_team(const std::vector<int>& devices,
                                   const TeamOptions& options = {});

// A CUDA team of one rank per process on this host, made without NCCL: rank `rank` of
// `world_size` on CUDA device `device` (this process's ordinal). Peer memory is CUDA IPC
// (cudaIpcGetMemHandle / cudaIpcOpenMemHandle); ranks may share a device (several processes on
// one GPU: their kernels then time-slice, so keep token counts small), and ranks on different
// devices need P2P between them (its absence is an error naming the pair). The id comes from
// create_cpu_team_id(), made on one rank and passed to the others through any channel; the
// creation is collective and bootstraps over a CPU team of the same id (shared memory). Each of
// its waits for the peers lasts up to options.peer_timeout_seconds + handshake_timeout_seconds
// (0 peer timeout: forever; processes sharing a GPU set up seconds apart): a rank that never
// joins is named by the others. Every rank must pass the same world_size and options
// (packet_bytes, peer_stores, peer_memory; a difference is an error on every rank naming the
// rank and field); calls time out after peer_timeout_seconds as on other teams. This team has no
// NCCL path: it never falls back (fallback_reason() is empty, peer_memory() is "cuda ipc"),
// options.peer_stores must be true, and a call the workspace cannot carry
// (TeamOptions::packet_bytes) is refused with an error before any work, as is Algorithm::kNccl. GPU
// memory per rank: 3 * world_size * packet_bytes.
Team create_cuda_team(const CpuTeamId& id, int rank, int world_size, int device,
                      const TeamOptions& options = {});

// A team of one rank per process over an NCCL communicator the caller already has: in
// tpfuse/cuda.h, with the other forms that take CUDA's and NCCL's types.

// NCCL's bootstrap id: made on one rank (create_unique_id), passed to the others through any
// channel (MPI, a torch process group, a file), then create_nccl_team on every rank.
struct UniqueId {
  char bytes[128];
};
UniqueId create_unique_id();
// The same over a communicator the team creates and owns: rank `rank` of `world_size` on CUDA
// device `device`.
Team create_nccl_team(const UniqueId& id, int rank, int world_size, int device,
                      const TeamOptions& options = {});

// Whether this build has the NCCL path (the fallback, multi-process teams).
bool nccl_available();

// Rotary embedding applied after the QK norm: neox (rotate-half, as MiniMax-M2 uses) pairs
// element i with i + rotary_dim/2 of each head; interleaved pairs 2i with 2i+1.
enum class RopeStyle : int { kNone = 0, kNeox = 1, kInterleaved = 2 };

struct QkNormArgs {
  // [tokens, q_size + 2 * kv_size]: this rank's q, k and v slices (v is not touched).
  const void* qkv = nullptr;
  void* q_out = nullptr;          // [tokens, q_size]; nullptr: written in place into qkv's q slice
  void* k_out = nullptr;          // [tokens, kv_size]; nullptr: written in place into qkv's k slice
  const void* q_gamma = nullptr;  // [q_size]: this rank's slice of the q norm weight
  const void* k_gamma = nullptr;  // [kv_size]: this rank's slice of the k norm weight
  int64_t tokens = 0;
  int64_t q_size = 0;         // this rank's q width (its query heads * head_dim)
  int64_t kv_size = 0;        // this rank's k (and v) width
  int64_t q_global_size = 0;  // width q is normalized over, all ranks (e.g. 48 * 128)
  int64_t k_global_size = 0;  // width k is normalized over, each KV head once (e.g. 8 * 128)
  // Ranks holding each KV head (1, or world_size / kv_heads when kv_heads < world_size). Ranks
  // r and r' hold the same heads when r / kv_replicas == r' / kv_replicas; only the first of
  // each group (r % kv_replicas == 0) counts its k sum, so each head counts once.
  int kv_replicas = 1;
  DType dtype = DType::kBFloat16;
  float eps = 1e-6f;
  // Optional rotary embedding on the normalized q and k.
  RopeStyle rope = RopeStyle::kNone;
  int64_t head_dim = 0;                // divides q_size and kv_size
  int64_t rotary_dim = 0;              // even, <= head_dim; elements past it pass through
  const int64_t* positions = nullptr;  // [tokens], each in [0, max_position)
  // [max_position, rotary_dim] fp32: cos of the rotary_dim / 2 frequencies, then their sin.
  const float* cos_sin_cache = nullptr;
  int64_t max_position = 0;
  // kAuto, kOneShot (the fused kernel) or kNccl (qk_sum_squares, ncclAllReduce of the [tokens, 2]
  // sums, qk_rmsnorm_from_sums); kAuto picks one-shot unless the team has no peer stores.
  Algorithm algorithm = Algorithm::kAuto;
};

// The distributed QK norm: per token, sum_q = sum over ranks of |q_r|^2 and sum_k likewise (in
// fp32, rank order, identical bits on every rank), then q = q * rsqrt(sum_q / q_global_size +
// eps) * q_gamma, k likewise, then the optional RoPE; rounded once to dtype. One kernel per call.
// Returns the algorithm that ran.
Algorithm allreduce_qk_rmsnorm(const Team& team, const QkNormArgs& args, Stream stream = {});

// The QK norm's two local halves, for a runtime that all-reduces the sums itself (and for the
// NCCL path): qk_sum_squares writes this rank's sums[token] = {sum q^2, sum k^2} (fp32, k as 0
// when count_k is false: a replica whose KV heads another rank counts); qk_rmsnorm_from_sums
// normalizes (and rotates) with the global sums. Given sums summed in rank order in fp32, the
// outputs have the same bits as allreduce_qk_rmsnorm's. sums: [tokens, 2] fp32, 8-byte aligned,
// on the same device as the tensors (host memory for kCpu). q_global_size and k_global_size are
// used; kv_replicas is not.
void qk_sum_squares(Backend backend, const QkNormArgs& args, bool count_k, float* sums,
                    Stream stream = {});
void qk_rmsnorm_from_sums(Backend backend, const QkNormArgs& args, const float* sums,
                          Stream stream = {});

// This rank will not make the fused call its peers are making (the caller's own checks failed,
// say): it takes its turn without data, where the call would have been, so that the peers' call
// ends at once (NaN outputs, Team::check reports this rank) and the team goes on. The tpfuse ops
// do this themselves when they reject their arguments. On the CPU it blocks until the peers'
// calls arrive (on any path: the CPU's NCCL stand-in takes turns too). Nothing happens on a CUDA
// team's NCCL path: a turn there is an all-reduce of the call's count, which this call does not
// know (the ops' own rejections of a well-formed call take it).
void reject_call(const Team& team, Stream stream = {});

// Whether this build has the CUDA backend, and how many devices the runtime sees (0 if none).
bool cuda_available();
int cuda_device_count();

// Whether this build has the SYCL backend (Intel's SYCL runtime found at build time; kernels are
// compiled when a team is made, from tpfuse's own headers: docs/sycl.md).
bool sycl_available();
// A SYCL team of world_size ranks of this process, every rank on the default SYCL device (ranks
// share it through USM; tpfuse/sycl.h makes teams over given devices, and says what a team
// needs). Refused, naming the ranks and the compute units, where the device cannot run that many
// spinning ranks at once.
std::vector<Team> create_sycl_team(int world_size, const TeamOptions& options = {});

// The weight an RMSNorm applies: gamma, or 1 + gamma in fp32 (Gemma's and Qwen3-Next's form, whose
// stored weight is centered on zero).
enum class NormWeight : int { kGamma = 0, kOnePlusGamma = 1 };
const char* norm_weight_name(NormWeight weight);

// FP8 E4M3 output of the norm, for the FP8 GEMM that follows (all scales fp32):
//   kStatic:           q = e4m3(n / scale), one scale given (as engines pass a calibrated one);
//   kPerToken:         scale[t] = max(amax(n[t, :]), 1e-10) / 448, written;
//   kPerTokenGroup128: scale[t, g] = max(amax(n[t, 128 g : 128 g + 128]), 1e-10) / 448, written
//                      [tokens, hidden / 128] (DeepSeek-V3 / MiniMax-M2's block format),
//                      row-major (index t * groups + g, as Triton block-FP8 GEMMs index a
//                      [tokens, groups] tensor) or, with scales_column_major, column-major
//                      (index g * tokens + t: token-major, as CUTLASS's and DeepGEMM's Hopper
//                      blockwise FP8 GEMMs read activation scales).
//   kPerTokenGroup128Ue8m0: kPerTokenGroup128 with each scale rounded up to a power of two,
//                      scale[t, g] = 2^ceil(log2(max(amax, 1e-10) / 448)) (DeepSeek-V3's UE8M0
//                      scales, as DeepGEMM's Blackwell FP8 GEMMs take them), stored as fp32 in the
//                      same layouts: its exponent byte is the UE8M0 byte.
// n is the norm output as stored (norm_out, rounded to dtype), so q is exactly what quantizing
// norm_out gives; e4m3 rounds to nearest even and saturates at ±448 (NaN stays NaN, 0x7f). The
// division is IEEE fp32 on every backend: the same bits from the CPU and the GPU for the same n.
enum class QuantMode : int {
  kNone = 0,
  kStatic = 1,
  kPerToken = 2,
  kPerTokenGroup128 = 3,
  kPerTokenGroup128Ue8m0 = 4
};
const char* quant_mode_name(QuantMode mode);

struct AddRmsNormArgs {
  const void* input = nullptr;     // [tokens, hidden] this rank's partial sum
  const void* residual = nullptr;  // [tokens, hidden] or nullptr: no residual
  const void* gamma = nullptr;     // [hidden]
  void* residual_out = nullptr;    // [tokens, hidden]; required with a residual, optional without
  // [tokens, hidden]; with an FP8 output it is optional: given, it also receives the norm (the
  // router's bf16 copy); null, quant_out is the norm's only output and no bf16 norm is written.
  void* norm_out = nullptr;
  // FP8 output (QuantMode above): quant_out [tokens, hidden] bytes, 16-byte aligned;
  // quant_scale: kStatic's scale (one fp32, this rank's device memory on CUDA); scales_out:
  // kPerToken's [tokens] or the group modes' [tokens, hidden / 128] fp32.
  QuantMode quant = QuantMode::kNone;
  void* quant_out = nullptr;
  const float* quant_scale = nullptr;
  float* scales_out = nullptr;
  bool scales_column_major = false;  // the group modes' layout (above)
  // MoE finalize, in place of input: this rank's top-k expert output rows
  // moe_expert_rows [tokens, moe_topk, hidden] (dtype), their routing weights moe_weights
  // [tokens, moe_topk] (fp32, or dtype with moe_weights_in_dtype) and, where the model has one, a
  // shared expert's rows moe_shared [tokens, hidden] (dtype). This rank's contribution is then
  // sum_j weights[t, j] * rows[t, j] in fp32 with j in order (each product rounded, then each
  // add), plus the shared row, rounded once to dtype; input must be null. With a residual and
  // NormWeight::kGamma; moe_topk at most kMaxMoeTopK.
  const void* moe_expert_rows = nullptr;
  const void* moe_weights = nullptr;
  const void* moe_shared = nullptr;
  int moe_topk = 0;
  bool moe_weights_in_dtype = false;
  int64_t tokens = 0;
  int64_t hidden = 0;
  DType dtype = DType::kBFloat16;
  float eps = 1e-6f;
  NormWeight norm_weight = NormWeight::kGamma;
  Algorithm algorithm = Algorithm::kAuto;  // forced algorithm, or kAuto (Team::choose)
};

// residual_out = allreduce(input) + residual (or just the sum without a residual);
// norm_out = residual_out * rsqrt(mean(residual_out^2) + eps) * gamma (or * (1 + gamma), see
// NormWeight), with the norm computed
// from residual_out as stored (rounded to dtype), so norm_out equals what an unfused RMSNorm of
// residual_out gives within its own rounding. Outputs may alias input or residual exactly (in
// place); partial overlaps are rejected, and so is any overlap with gamma. For the CUDA backend
// pointers are device pointers of this rank's device and the work is queued on `stream`; for the
// CPU backend they are host pointers, the call blocks, and `stream` must be empty. Returns the
// algorithm that ran.
//
// One-shot and two-shot store a residual_out (or all-reduce out) word whose bits are the
// protocol's sentinel 0x80000000 (-0.0f in fp32; +0 then -0 in a pair of 16-bit elements) as +0,
// and normalize from that: the two-shot all-gather carries these outputs as Lamport packets,
// and both algorithms give the same bits.
//
// On a one-rank team there is nothing to exchange: every algorithm runs the local epilogue kernel
// (add_rmsnorm's) and gives its bits.
Algorithm allreduce_add_rmsnorm(const Team& team, const AddRmsNormArgs& args, Stream stream = {});

// out = sum over ranks of input; count elements (a multiple of kHiddenMultiple). Returns the
// algorithm that ran.
Algorithm allreduce(const Team& team, const void* input, void* out, int64_t count, DType dtype,
                    Stream stream = {}, Algorithm algorithm = Algorithm::kAuto);

// The local fused epilogue on one device (no collective): residual_out = input + residual,
// norm_out = rmsnorm(residual_out) * gamma. Backend kCuda queues a kernel on `stream`; kCpu runs
// on the calling thread.
void add_rmsnorm(Backend backend, const AddRmsNormArgs& args, Stream stream = {});

}  // namespace tpfuse
