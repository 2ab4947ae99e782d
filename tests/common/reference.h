// Host data for the tests: values in any dtype, a float64 reference of the fused op, and
// comparisons that report the first few mismatches.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tpfuse/impl/numeric.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse::testing {

// A tensor as raw bytes of its dtype.
struct HostTensor {
  DType dtype = DType::kBFloat16;
  std::vector<uint8_t> bytes;

  HostTensor() = default;
  HostTensor(DType type, size_t count) : dtype(type), bytes(count * dtype_size(type)) {}
  size_t count() const { return bytes.size() / dtype_size(dtype); }
  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }

  double get(size_t i) const {
    switch (dtype) {
      case DType::kFloat32: {
        float x;
        std::memcpy(&x, &bytes[i * 4], 4);
        return x;
      }
      case DType::kFloat16: {
        impl::Float16 x;
        std::memcpy(&x, &bytes[i * 2], 2);
        return impl::to_float(x);
      }
      case DType::kBFloat16: {
        impl::BFloat16 x;
        std::memcpy(&x, &bytes[i * 2], 2);
        return impl::to_float(x);
      }
    }
    return 0;
  }
  // Stores x rounded to the dtype (round to nearest even).
  void set(size_t i, double x) {
    const float value = float(x);
    switch (dtype) {
      case DType::kFloat32:
        std::memcpy(&bytes[i * 4], &value, 4);
        break;
      case DType::kFloat16: {
        const impl::Float16 h = impl::from_float<impl::Float16>(value);
        std::memcpy(&bytes[i * 2], &h, 2);
        break;
      }
      case DType::kBFloat16: {
        const impl::BFloat16 h = impl::from_float<impl::BFloat16>(value);
        std::memcpy(&bytes[i * 2], &h, 2);
        break;
      }
    }
  }
  void set_bits16(size_t i, uint16_t bits) { std::memcpy(&bytes[i * 2], &bits, 2); }
  void set_bits32(size_t i, uint32_t bits) { std::memcpy(&bytes[i * 4], &bits, 4); }
};

// A bell-shaped value of mean 0 and standard deviation `scale` from one 64-bit draw: the sum of
// its four 16-bit uniforms (Irwin-Hall), standardized; bounded at +-2*sqrt(3)*scale. The random
// tensors take it instead of std::normal_distribution, whose logarithm and two draws a pair
// were half of the soak tests' time.
inline double bell_value(uint64_t bits, double scale) {
  constexpr double kMean = 4 * 32767.5;
  static const double kDeviation = std::sqrt(4 * (65536.0 * 65536.0 - 1) / 12);
  const double sum = double(bits & 0xffff) + double((bits >> 16) & 0xffff) +
                     double((bits >> 32) & 0xffff) + double(bits >> 48);
  return (sum - kMean) / kDeviation * scale;
}

inline HostTensor random_tensor(std::mt19937_64& rng, DType dtype, size_t count,
                                double scale = 1.0) {
  HostTensor t(dtype, count);
  for (size_t i = 0; i < count; ++i) t.set(i, bell_value(rng(), scale));
  return t;
}

// Poison: a finite value no correct output holds by chance (0x5a5a... is about 1.5e16 in bf16
// and fp32, 203.25 in fp16), so an unwritten output element fails the comparison.
// An E4M3 reference independent of tpfuse's conversion: the nearest of the 127 non-negative
// finite codes by value in double (they increase with the code), ties to the even code,
// saturating at 448, NaN to 0x7f, the sign copied.
inline uint8_t reference_e4m3(float x) {
  static const std::vector<double> values = [] {
    std::vector<double> v;
    for (int code = 0; code <= 0x7e; ++code) {
      const int exponent = code >> 3, mantissa = code & 7;
      v.push_back(exponent == 0 ? std::ldexp(double(mantissa), -9)
                                : std::ldexp(1.0 + mantissa / 8.0, exponent - 7));
    }
    return v;
  }();
  if (std::isnan(x)) return 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double magnitude = std::fabs(double(x));
  if (magnitude >= 464.0) return uint8_t(sign | 0x7e);
  // The first code not below the magnitude, and the one before it: the nearest is one of them.
  const int above = int(std::lower_bound(values.begin(), values.end(), magnitude) - values.begin());
  if (above == 0) return sign;
  if (above > 0x7e) return uint8_t(sign | 0x7e);
  const int below = above - 1;
  const double up = values[size_t(above)] - magnitude, down = magnitude - values[size_t(below)];
  const int code = up < down ? above : down < up ? below : (above % 2 == 0 ? above : below);
  return uint8_t(sign | code);
}

inline HostTensor poisoned(DType dtype, size_t count) {
  HostTensor t(dtype, count);
  std::memset(t.data(), 0x5a, t.bytes.size());
  return t;
}

// Unit roundoff of the dtype: half an ulp relative.
inline double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return std::ldexp(1.0, -24);
    case DType::kFloat16:
      return std::ldexp(1.0, -11);
    case DType::kBFloat16:
      return std::ldexp(1.0, -8);
  }
  return 1;
}

struct Reference {
  std::vector<double> residual_out;  // sum + residual, unrounded
  std::vector<double> norm_out;
  std::vector<double> magnitude;   // sum of |terms| per element: the scale of rounding errors
  std::vector<double> norm_scale;  // per element: |gamma| * rstd * magnitude
};

// float64 reference: residual_out = sum_r input_r + residual; norm_out = rmsnorm(residual_out) * g.
// weight: the norm multiplies by gamma, or by 1 + gamma (NormWeight::kOnePlusGamma).
inline Reference reference_add_rmsnorm(const std::vector<HostTensor>& inputs,
                                       const HostTensor* residual, const HostTensor& gamma,
                                       int64_t tokens, int64_t hidden, double eps,
                                       NormWeight weight = NormWeight::kGamma) {
  Reference ref;
  const size_t count = size_t(tokens * hidden);
  ref.residual_out.assign(count, 0.0);
  ref.norm_out.assign(count, 0.0);
  ref.magnitude.assign(count, 0.0);
  ref.norm_scale.assign(count, 0.0);
  for (size_t i = 0; i < count; ++i) {
    double sum = inputs[0].get(i);
    double magnitude = std::fabs(sum);
    for (size_t r = 1; r < inputs.size(); ++r) {
      sum += inputs[r].get(i);
      magnitude += std::fabs(inputs[r].get(i));
    }
    if (residual != nullptr) {
      sum += residual->get(i);
      magnitude += std::fabs(residual->get(i));
    }
    ref.residual_out[i] = sum;
    ref.magnitude[i] = magnitude;
  }
  for (int64_t t = 0; t < tokens; ++t) {
    double sum_squares = 0;
    for (int64_t h = 0; h < hidden; ++h) {
      const double x = ref.residual_out[t * hidden + h];
      sum_squares += x * x;
    }
    const double rstd = 1.0 / std::sqrt(sum_squares / double(hidden) + eps);
    for (int64_t h = 0; h < hidden; ++h) {
      const size_t i = size_t(t * hidden + h);
      const double w =
          weight == NormWeight::kOnePlusGamma ? 1.0 + gamma.get(size_t(h)) : gamma.get(size_t(h));
      ref.norm_out[i] = ref.residual_out[i] * rstd * w;
      ref.norm_scale[i] = std::fabs(w) * rstd * ref.magnitude[i];
    }
  }
  return ref;
}

// Compares `actual` with `expected` elementwise: non-finite expected values must match in kind
// (NaN, or Inf of the same sign); finite ones within `tolerance[i]`. Returns "" or a report.
inline std::string compare(const HostTensor& actual, const std::vector<double>& expected,
                           const std::vector<double>& tolerance, const std::string& what) {
  std::ostringstream report;
  size_t failures = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double a = actual.get(i);
    const double e = expected[i];
    bool ok;
    if (std::isnan(e)) {
      ok = std::isnan(a);
    } else if (std::isinf(e)) {
      ok = a == e;
    } else {
      ok = std::isfinite(a) && std::fabs(a - e) <= tolerance[i];
    }
    if (!ok && failures++ < 5) {
      report << "  " << what << "[" << i << "] = " << a << ", expected " << e << " (tolerance "
             << tolerance[i] << ")\n";
    }
  }
  if (failures == 0) return "";
  std::ostringstream head;
  head << failures << " of " << expected.size() << " elements of " << what << " wrong:\n";
  return head.str() + report.str();
}

}  // namespace tpfuse::testing
