// Internal: what a Team handle points to, and the parameters every one-shot launch takes.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tpfuse/impl/epilogue.h"
#include "tpfuse/impl/lamport.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse::impl {

// Owner of all ranks' memory in an in-process team (CPU or CUDA); frees it when the last handle
// goes away.
struct TeamMemory {
  virtual ~TeamMemory() = default;
};

// One row of the selection table as it applies to a team: messages of at most max_bytes run
// `algorithm`.
struct SelectionStep {
  uint64_t max_bytes;
  Algorithm algorithm;
};

struct TeamState {
  Backend backend = Backend::kCpu;
  int rank = 0;
  int world_size = 0;
  int device = -1;
  size_t packet_bytes = 0;
  uint64_t timeout_ns = 0;  // 0: wait forever
  // Base of every rank's workspace as this rank addresses it (peer pointers over NVLink for CUDA).
  std::array<char*, kMaxWorld> workspace{};
  ControlBlock* control = nullptr;  // this rank's control block (device memory for CUDA)
  // Nonzero after a call of this rank timed out: 1 + the rank that did not arrive. Host memory
  // (mapped into the device for CUDA), so the host reads it without synchronizing.
  uint32_t* error_flag = nullptr;
  int multiprocessors = 0;  // CUDA: SM count of this rank's device
  std::string device_name;  // CUDA: e.g. "NVIDIA H200" (the selection table's key)
  // The table's rows for this device and world size, in order (matched once, at creation).
  std::vector<SelectionStep> selection;
  // false when the fused kernels may not run (no proven peer stores): every op takes the NCCL
  // path, and fallback_reason says why. The same on every rank.
  bool fused = true;
  std::string fallback_reason;
  std::string peer_memory;
  // CUDA teams built with NCCL: this rank's communicator (ncclComm_t), and a [packet_bytes / 8,
  // 2] fp32 device buffer for the QK norm's NCCL path.
  void* nccl_comm = nullptr;
  float* qk_sums = nullptr;
  std::shared_ptr<TeamMemory> memory;
};

// Everything one call of the one-shot kernel (or its CPU twin) needs; passed by value.
struct OneShotParams {
  char* workspace[kMaxWorld];
  ControlBlock* control;
  uint32_t* error_flag;
  int rank;
  int world_size;
  size_t packet_bytes;
  const void* input;
  const void* residual;
  const void* gamma;
  void* residual_out;
  void* norm_out;
  int64_t tokens;
  int64_t hidden;
  float eps;
  uint64_t timeout_ns;
};

// The team side of a Lamport exchange (what the QK-norm launch needs beside its tensors).
struct ExchangeParams {
  char* workspace[kMaxWorld];
  ControlBlock* control;
  uint32_t* error_flag;
  int rank;
  int world_size;
  size_t packet_bytes;
  uint64_t timeout_ns;
};

// One call of the QK-norm kernel (or its CPU twin); passed by value.
struct QkNormParams {
  ExchangeParams exchange;
  const void* qkv;
  void* q_out;  // row stride q_out_stride elements
  void* k_out;  // row stride k_out_stride elements
  int64_t q_out_stride;
  int64_t k_out_stride;
  const void* q_gamma;
  const void* k_gamma;
  int64_t tokens;
  int64_t q_size;
  int64_t kv_size;
  int64_t q_global_size;
  int64_t k_global_size;
  int counts_k;  // 0 on ranks whose KV heads another rank already counts
  float eps;
  int rope;  // RopeStyle
  int64_t head_dim;
  int64_t rotary_dim;
  const int64_t* positions;
  const float* cos_sin_cache;
  float* sums;  // local halves only: [tokens, 2] written (sum pass) or read (norm pass)
};

enum class QkPass : int { kFused = 0, kSums = 1, kNormFromSums = 2 };

// The algorithm a call runs (Team::choose): throws naming `op` if a forced one cannot run.
Algorithm choose_algorithm(const TeamState& team, int64_t tokens, int64_t hidden, DType dtype,
                           Algorithm requested, const char* op);
// The rows of the selection table (data/algorithms.csv, or the file named by
// TPFUSE_ALGORITHM_TABLE) for a device and world size; a team keeps them.
std::vector<SelectionStep> selection_for(const std::string& device_name, int world_size);
// The table's choice for a message: the first row whose device, world size and byte bound match.
Algorithm table_algorithm(const std::string& device_name, int world_size, uint64_t bytes);
// Parses a selection table (CSV text); throws naming the line of a malformed row.
struct SelectionRule {
  std::string device;  // "*" or a device name
  int world_size;      // 0: any
  uint64_t max_bytes;  // messages of at most this many bytes
  Algorithm algorithm;
};
std::vector<SelectionRule> parse_selection_table(const std::string& text,
                                                 const std::string& origin);

ExchangeParams make_exchange_params(const TeamState& team);
QkNormParams make_qk_params(const TeamState& team, const QkNormArgs& args);
// The tensor fields alone (counts_k = 1): what the local passes need.
QkNormParams make_qk_local_params(const QkNormArgs& args);
void validate_qk_args(const QkNormArgs& args, const char* op);
Algorithm choose_qk_algorithm(const TeamState& team, const QkNormArgs& args, const char* op);
void validate_qk_rmsnorm(const TeamState& team, const QkNormArgs& args, Algorithm algorithm,
                         const char* op);
void cpu_qk_rmsnorm(const QkNormParams& params, DType dtype, QkPass pass);
void cuda_qk_rmsnorm(const TeamState& team, const QkNormParams& params, DType dtype,
                     cudaStream_t stream);
void cuda_qk_local(const QkNormParams& params, DType dtype, QkPass pass, cudaStream_t stream);
void cuda_validate_pointers(const TeamState& team,
                            std::initializer_list<std::pair<const char*, const void*>> pointers,
                            cudaStream_t stream, const char* op);

OneShotParams make_oneshot_params(const TeamState& team, const AddRmsNormArgs& args);
// The tensor and shape fields alone: what the local (no collective) kernels need.
OneShotParams make_local_params(const AddRmsNormArgs& args);
void validate_team_options(const TeamOptions& options, const char* op);

// Argument checks shared by every backend; each throws tpfuse::Error naming the argument.
// validate_qk_rmsnorm expects validate_qk_args to have passed.
void validate_team(const Team& team, const char* op);
void validate_add_rmsnorm(const AddRmsNormArgs& args, Epilogue epilogue, const char* op);

// Backends. The local epilogue runs kAddRmsNorm or kRmsNorm on one rank (no collective).
void cpu_oneshot(const TeamState& team, const OneShotParams& params, DType dtype,
                 Epilogue epilogue);
void cpu_twoshot(const TeamState& team, const OneShotParams& params, DType dtype,
                 Epilogue epilogue);
// The CPU backend's stand-in for the NCCL path, with its rounding: a rank-ordered all-reduce
// rounded to dtype (one-shot exchanges of at most the workspace's capacity), then the local
// epilogue.
void cpu_nccl_path(const TeamState& team, const OneShotParams& params, DType dtype,
                   Epilogue epilogue);
// Rank-ordered all-reduce of rows x row_elements (row bytes a multiple of 16), rounded to dtype,
// in one-shot exchanges of at most the workspace's capacity.
void cpu_allreduce_rows(const TeamState& team, const void* input, void* out, int64_t rows,
                        int64_t row_elements, DType dtype);
void cpu_qk_nccl_path(const TeamState& team, const QkNormParams& params, DType dtype);
void cpu_local_epilogue(const OneShotParams& params, DType dtype, Epilogue epilogue);
void cpu_check(const TeamState& team);

void cuda_oneshot(const TeamState& team, const OneShotParams& params, DType dtype,
                  Epilogue epilogue, cudaStream_t stream);
void cuda_twoshot(const TeamState& team, const OneShotParams& params, DType dtype,
                  Epilogue epilogue, cudaStream_t stream);
void cuda_nccl_path(const TeamState& team, const OneShotParams& params, DType dtype,
                    Epilogue epilogue, cudaStream_t stream);
void cuda_qk_nccl_path(const TeamState& team, const QkNormParams& params, DType dtype,
                       cudaStream_t stream);
void cuda_local_epilogue(const OneShotParams& params, DType dtype, Epilogue epilogue,
                         cudaStream_t stream);
// Loads every kernel a team of this world size may launch, on the current device (see
// preload in cuda/launch.cuh: lazy loading can deadlock spinning kernels).
void cuda_preload_kernels(int world_size);
void cuda_preload_twoshot_kernels(int world_size);
void cuda_preload_qk_kernels(int world_size);
void cuda_check(const TeamState& team);
void cuda_validate_call(const TeamState& team, const AddRmsNormArgs& args, cudaStream_t stream,
                        const char* op);

}  // namespace tpfuse::impl
