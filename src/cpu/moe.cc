// The CPU backend's MoE finalize: each call's combine (epilogue.h's moe_* steps) is computed into
// a buffer first, which the row calls then read as their input, with the epilogue's non-MoE twin.
// The GPU kernels combine where they load input; both give the same contribution bits.
#include <cstring>
#include <vector>

#include "cpu/kernels.h"
#include "tpfuse/impl/dispatch.h"
#include "tpfuse/impl/epilogue.h"

namespace tpfuse::impl {
namespace {

template <typename T>
void combine(const RowCall& p, Vec16* out) {
  constexpr int64_t kElements = Packed<T>::kElements;
  const int64_t vectors = p.hidden / kElements;
  const auto vector_at = [](const void* base, int64_t index) {
    Vec16 v;
    std::memcpy(&v, static_cast<const char*>(base) + index * 16, 16);
    return v;
  };
  for (int64_t token = 0; token < p.tokens; ++token) {
    for (int64_t v = 0; v < vectors; ++v) {
      float acc[kElements] = {};
      for (int j = 0; j < p.moe_topk; ++j) {
        const int64_t row = token * p.moe_topk + j;
        const float w = moe_weight<T>(p.moe_weights, p.moe_weights_in_dtype, row);
        moe_accumulate<T>(acc, vector_at(p.moe_rows, row * vectors + v), w, j == 0);
      }
      if (p.moe_shared != nullptr) {
        moe_add_shared<T>(acc, vector_at(p.moe_shared, token * vectors + v));
      }
      out[token * vectors + v] = pack<T>(acc);
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
