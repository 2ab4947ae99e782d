// Whether a value of one of the public enums is one of its enumerators: the one source of each
// enum's range, for the library's argument checks and the torch ops' (a new enumerator goes here).
#pragma once

#include <cstdint>
#include <limits>

#include "tpfuse/tpfuse.h"

namespace tpfuse::impl {

constexpr bool is_known(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kFloat16:
    case DType::kBFloat16:
      return true;
  }
  return false;
}

constexpr bool is_known(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::kAuto:
    case Algorithm::kOneShot:
    case Algorithm::kTwoShot:
    case Algorithm::kNccl:
      return true;
  }
  return false;
}

constexpr bool is_known(NormWeight weight) {
  switch (weight) {
    case NormWeight::kGamma:
    case NormWeight::kOnePlusGamma:
      return true;
  }
  return false;
}

constexpr bool is_known(QuantMode mode) {
  switch (mode) {
    case QuantMode::kNone:
    case QuantMode::kStatic:
    case QuantMode::kPerToken:
    case QuantMode::kPerTokenGroup128:
      return true;
  }
  return false;
}

constexpr bool is_known(RopeStyle style) {
  switch (style) {
    case RopeStyle::kNone:
    case RopeStyle::kNeox:
    case RopeStyle::kInterleaved:
      return true;
  }
  return false;
}

// An integer (a torch op's argument) as Enum, if it is one of Enum's enumerators.
template <typename Enum>
constexpr bool is_known_value(int64_t value) {
  return value >= std::numeric_limits<int>::min() && value <= std::numeric_limits<int>::max() &&
         is_known(Enum(int(value)));
}

}  // namespace tpfuse::impl
