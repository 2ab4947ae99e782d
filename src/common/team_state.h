// Internal: what a Team handle points to, and the parameters every one-shot launch takes.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <utility>

#include "tpfuse/impl/epilogue.h"
#include "tpfuse/impl/lamport.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse::impl {

// Owner of all ranks' memory in an in-process team (CPU or CUDA); frees it when the last handle
// goes away.
struct TeamMemory {
  virtual ~TeamMemory() = default;
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

ExchangeParams make_exchange_params(const TeamState& team);
QkNormParams make_qk_params(const TeamState& team, const QkNormArgs& args);
// The tensor fields alone (counts_k = 1): what the local passes need.
QkNormParams make_qk_local_params(const QkNormArgs& args);
void validate_qk_args(const QkNormArgs& args, const char* op);
void validate_qk_rmsnorm(const TeamState& team, const QkNormArgs& args, const char* op);
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
void validate_team(const Team& team, const char* op);
void validate_add_rmsnorm(const AddRmsNormArgs& args, Epilogue epilogue, const char* op);
void validate_capacity(const TeamState& team, const AddRmsNormArgs& args, const char* op);

// Backends.
void cpu_oneshot(const TeamState& team, const OneShotParams& params, DType dtype,
                 Epilogue epilogue);
void cpu_add_rmsnorm(const AddRmsNormArgs& args);
void cpu_check(const TeamState& team);

void cuda_oneshot(const TeamState& team, const OneShotParams& params, DType dtype,
                  Epilogue epilogue, cudaStream_t stream);
void cuda_add_rmsnorm(const AddRmsNormArgs& args, cudaStream_t stream);
void cuda_check(const TeamState& team);
void cuda_validate_call(const TeamState& team, const AddRmsNormArgs& args, cudaStream_t stream,
                        const char* op);

}  // namespace tpfuse::impl
