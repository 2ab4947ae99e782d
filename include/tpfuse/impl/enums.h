// The public enums' enumerators: whether a value is one (is_known: the one source of each enum's
// range, for the library's argument checks), and each one's name (Enumerators: for messages, the
// torch ops' argument checks and the Python package's enums, which are made from it). A new
// enumerator goes into both; a static_assert below says when the two disagree.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "tpfuse/impl/epilogue/outputs.h"
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

// The listed outputs' modes (epilogue/outputs.h).
constexpr bool is_known(QuantMode mode) {
  return lists_output(mode);
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

// An enumerator and its name: the Python package's (tpfuse.Algorithm.AUTO, accepted as "auto"),
// algorithm_name's and norm_weight_name's.
template <typename Enum>
struct Enumerator {
  Enum value;
  const char* name;
};

// Enumerators<Enum>::kName (the C++ type's name) and kList, every enumerator of Enum.
template <typename Enum>
struct Enumerators;

template <>
struct Enumerators<Algorithm> {
  static constexpr const char* kName = "Algorithm";
  static constexpr Enumerator<Algorithm> kList[] = {{Algorithm::kAuto, "auto"},
                                                    {Algorithm::kOneShot, "oneshot"},
                                                    {Algorithm::kTwoShot, "twoshot"},
                                                    {Algorithm::kNccl, "nccl"}};
};

template <>
struct Enumerators<NormWeight> {
  static constexpr const char* kName = "NormWeight";
  static constexpr Enumerator<NormWeight> kList[] = {{NormWeight::kGamma, "gamma"},
                                                     {NormWeight::kOnePlusGamma, "one_plus_gamma"}};
};

// Made from the list of outputs (epilogue/outputs.h): a new output is named there.
template <typename... Outputs>
constexpr std::array<Enumerator<QuantMode>, sizeof...(Outputs)> output_enumerators(
    OutputList<Outputs...>) {
  return {Enumerator<QuantMode>{Outputs::kMode, Outputs::kName}...};
}

template <>
struct Enumerators<QuantMode> {
  static constexpr const char* kName = "QuantMode";
  static constexpr auto kList = output_enumerators(RowOutputs{});
};

template <>
struct Enumerators<RopeStyle> {
  static constexpr const char* kName = "RopeStyle";
  static constexpr Enumerator<RopeStyle> kList[] = {{RopeStyle::kNone, "none"},
                                                    {RopeStyle::kNeox, "neox"},
                                                    {RopeStyle::kInterleaved, "interleaved"}};
};

// The enumerator's name, or "unknown".
template <typename Enum>
constexpr const char* enumerator_name(Enum value) {
  for (const Enumerator<Enum>& enumerator : Enumerators<Enum>::kList) {
    if (enumerator.value == value) return enumerator.name;
  }
  return "unknown";
}

// Whether Enumerators<Enum>::kList holds exactly the values is_known accepts, each once (checked
// over a range wider than any enum here).
template <typename Enum>
constexpr bool lists_every_enumerator() {
  size_t known = 0;
  for (int value = -16; value < 256; ++value) known += is_known(Enum(value)) ? 1 : 0;
  size_t listed = 0;
  for (const Enumerator<Enum>& enumerator : Enumerators<Enum>::kList) {
    if (!is_known(enumerator.value)) return false;
    for (const Enumerator<Enum>& other : Enumerators<Enum>::kList) {
      if (&other != &enumerator && other.value == enumerator.value) return false;
    }
    ++listed;
  }
  return listed == known;
}

static_assert(lists_every_enumerator<Algorithm>(), "Enumerators<Algorithm> and is_known disagree");
static_assert(lists_every_enumerator<NormWeight>(),
              "Enumerators<NormWeight> and is_known disagree");
static_assert(lists_every_enumerator<QuantMode>(), "Enumerators<QuantMode> and is_known disagree");
static_assert(lists_every_enumerator<RopeStyle>(), "Enumerators<RopeStyle> and is_known disagree");

}  // namespace tpfuse::impl
