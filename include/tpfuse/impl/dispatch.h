// One dispatch per axis: dtype and world size each bind a compile-time constant and call a
// lambda. World sizes 2, 4 and 8 are specialized; any other (up to kMaxWorldSize) runs with
// kWorldSize == 0, the runtime path. Adding a case is one line.
#pragma once

#include <string>

#include "tpfuse/impl/numeric.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse::impl {

template <typename T>
struct TypeTag {
  using type = T;
};

template <typename Fn>
decltype(auto) dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32:
      return fn(TypeTag<float>{});
    case DType::kFloat16:
      return fn(TypeTag<Float16>{});
    case DType::kBFloat16:
      return fn(TypeTag<BFloat16>{});
  }
  throw Error("tpfuse: unknown dtype " + std::to_string(int(dtype)));
}

template <int kValue>
struct IntTag {
  static constexpr int value = kValue;
};

template <typename Fn>
decltype(auto) dispatch_world_size(int world_size, Fn&& fn) {
  switch (world_size) {
    case 2:
      return fn(IntTag<2>{});
    case 4:
      return fn(IntTag<4>{});
    case 8:
      return fn(IntTag<8>{});
    default:
      return fn(IntTag<0>{});
  }
}

template <typename Fn>
decltype(auto) dispatch_bool(bool value, Fn&& fn) {
  return value ? fn(IntTag<1>{}) : fn(IntTag<0>{});
}

}  // namespace tpfuse::impl
