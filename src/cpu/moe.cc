// The CPU backend's MoE finalize: each call's combine (the MoeContribution policy's per-vector
// step, tpfuse/impl/epilogue/contribution_moe.h) is computed into a buffer first, which the row
// calls then read as their input, with the epilogue's non-MoE twin. The CUDA NCCL path
// materializes it through the same step; the fused GPU kernels combine where they load input,
// with the same steps: the same contribution bits.
#include <cstring>
#include <vector>

#include "core/calls.h"
#include "cpu/kernels.h"
#include "tpfuse/impl/dispatch.h"
#include "tpfuse/impl/epilogue.h"

namespace tpfuse::impl {
namespace {

template <typename T>
void combine(const RowCall& p, Vec16* out) {
  const int64_t vectors = p.hidden / Packed<T>::kElements;
  const MoeRows moe = moe_rows_of(p);
  const auto load = [](const void* base, int64_t index) {
    Vec16 v;
    std::memcpy(&v, static_cast<const char*>(base) + index * 16, 16);
    return v;
  };
  for (int64_t token = 0; token < p.tokens; ++token) {
    for (int64_t v = 0; v < vectors; ++v) {
      out[token * vectors + v] = MoeContribution::combine_vector<T>(moe, token, vectors, v, load);
    }
  }
}

// Each rank thread's combined rows: grown to the largest call and kept, so that a call allocates
// nothing once its size has been seen (a failed growth throws and leaves the buffer as it was).
Vec16* contribution_buffer(size_t vectors) {
  thread_local std::vector<Vec16> buffer;
  if (buffer.size() < vectors) buffer.resize(vectors);
  return buffer.data();
}

}  // namespace

CpuMoeInput::CpuMoeInput(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue)
    : call_(call), epilogue_(epilogue) {
  if (!epilogue.moe) return;
  Vec16* const contribution =
      contribution_buffer(size_t(call.tokens * call.hidden) * dtype_size(dtype) / 16);
  dispatch_dtype(dtype, [&](auto type_tag) {
    combine<typename decltype(type_tag)::type>(call, contribution);
  });
  call_.input = contribution;
  epilogue_.moe = false;
}

}  // namespace tpfuse::impl
