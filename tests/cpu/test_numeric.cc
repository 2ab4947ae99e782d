// The host conversions the CPU backend (and the tests) use: exact round trips and round to
// nearest even, checked against the neighbours of each result.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "reference.h"
#include "tpfuse/impl/lamport.h"
#include "tpfuse/impl/numeric.h"

namespace tpfuse::impl {
namespace {

using testing::reference_e4m3;

template <typename T>
void expect_round_trips() {
  for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const T value{uint16_t(bits)};
    const float x = to_float(value);
    if (std::isnan(x)) {
      EXPECT_TRUE(std::isnan(to_float(from_float<T>(x))));
      continue;
    }
    EXPECT_EQ(from_float<T>(x).bits, bits) << std::hex << bits;
  }
}

TEST(Numeric, SixteenBitValuesRoundTripExactly) {
  expect_round_trips<BFloat16>();
  expect_round_trips<Float16>();
}

template <typename T>
void expect_nearest_even(float x) {
  const T rounded = from_float<T>(x);
  const double result = to_float(rounded);
  if (std::isinf(result)) return;  // overflow: checked by the caller's bounds
  // The two neighbours of the result must be no closer to x (ties: the result is even).
  for (int step : {-1, 1}) {
    const uint16_t neighbour_bits = uint16_t(rounded.bits + step);
    const double neighbour = to_float(T{neighbour_bits});
    if (std::isnan(neighbour) || std::isinf(neighbour)) continue;
    if ((neighbour_bits & 0x7fff) == 0 && (rounded.bits & 0x7fff) == 0x7fff) continue;
    const double error = std::fabs(double(x) - result);
    const double other = std::fabs(double(x) - neighbour);
    if ((rounded.bits & 0x7fff) == 0 && step == -1) continue;  // crossing zero's sign
    EXPECT_TRUE(error < other || (error == other && (rounded.bits & 1) == 0))
        << x << " -> " << result << " but " << neighbour << " is nearer or an even tie";
  }
}

TEST(Numeric, RoundsToNearestEven) {
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t bits = rng();
    float x = bits_float(bits);
    if (std::isnan(x) || std::isinf(x)) continue;
    expect_nearest_even<BFloat16>(x);
    if (std::fabs(x) < 65000.0f) expect_nearest_even<Float16>(x);
    if (std::fabs(x) < 65000.0f) expect_nearest_even<Float16>(x * 1e-3f);
  }
  EXPECT_EQ(from_float<Float16>(65520.0f).bits, 0x7c00);  // rounds up to Inf
  EXPECT_EQ(from_float<Float16>(65519.0f).bits, 0x7bff);
  EXPECT_EQ(from_float<Float16>(std::ldexp(1.0f, -25)).bits, 0x0000);  // tie to even zero
  EXPECT_EQ(from_float<Float16>(std::ldexp(1.5f, -25)).bits, 0x0001);
  EXPECT_EQ(from_float<BFloat16>(1.0f + std::ldexp(1.0f, -8)).bits, 0x3f80);  // tie to even
  EXPECT_EQ(from_float<BFloat16>(1.0f + std::ldexp(3.0f, -8)).bits, 0x3f82);
}

TEST(Numeric, Fp8E4M3CodesRoundTrip) {
  for (int code = 0; code < 256; ++code) {
    const float x = to_float(Fp8E4M3{uint8_t(code)});
    if ((code & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(x)) << code;
      EXPECT_EQ(fp8_e4m3_from_float(x).bits, kFp8E4M3NaN);
      continue;
    }
    EXPECT_EQ(fp8_e4m3_from_float(x).bits, code) << std::hex << code;
  }
  EXPECT_EQ(to_float(Fp8E4M3{0x7e}), 448.0f);
  EXPECT_EQ(to_float(Fp8E4M3{0x01}), std::ldexp(1.0f, -9));
  EXPECT_EQ(to_float(Fp8E4M3{0x08}), std::ldexp(1.0f, -6));
}

TEST(Numeric, Fp8E4M3RoundsToNearestEvenAndSaturates) {
  // Every exponent, every kept mantissa and the dropped bits' telling patterns (zero, one, just
  // below, at and above half, all ones), both signs; then random bit patterns.
  const uint32_t dropped[] = {0, 1, 0x3ffff, 0x7fffe, 0x7ffff, 0x80000, 0x80001, 0xfffff};
  int checked = 0;
  for (uint32_t sign = 0; sign < 2; ++sign) {
    for (uint32_t exponent = 0; exponent < 256; ++exponent) {
      for (uint32_t kept = 0; kept < 8; ++kept) {
        for (const uint32_t low : dropped) {
          const float x = bits_float((sign << 31) | (exponent << 23) | (kept << 20) | low);
          ASSERT_EQ(fp8_e4m3_from_float(x).bits, reference_e4m3(x)) << std::hexfloat << x;
          ++checked;
        }
      }
    }
  }
  std::mt19937 rng(11);
  for (int i = 0; i < 400000; ++i) {
    // Half the draws within E4M3's range, where the rounding happens.
    uint32_t bits = rng();
    if (i % 2) bits = (bits & 0x800fffffu) | ((110u + rng() % 30u) << 23);
    const float x = bits_float(bits);
    ASSERT_EQ(fp8_e4m3_from_float(x).bits, reference_e4m3(x)) << std::hexfloat << x;
  }
  EXPECT_GT(checked, 30000);
  // The boundaries by name.
  EXPECT_EQ(fp8_e4m3_from_float(448.0f).bits, 0x7e);
  EXPECT_EQ(fp8_e4m3_from_float(463.99997f).bits, 0x7e);
  EXPECT_EQ(fp8_e4m3_from_float(464.0f).bits, 0x7e);  // the tie goes to 448's even mantissa
  EXPECT_EQ(fp8_e4m3_from_float(1e30f).bits, 0x7e);
  EXPECT_EQ(fp8_e4m3_from_float(-INFINITY).bits, 0xfe);
  EXPECT_EQ(fp8_e4m3_from_float(-NAN).bits, kFp8E4M3NaN);
  EXPECT_EQ(fp8_e4m3_from_float(-0.0f).bits, 0x80);
  EXPECT_EQ(fp8_e4m3_from_float(std::ldexp(1.0f, -10)).bits, 0x00);  // half the smallest: even
  EXPECT_EQ(fp8_e4m3_from_float(std::ldexp(1.5f, -10)).bits, 0x01);
  EXPECT_EQ(fp8_e4m3_from_float(std::ldexp(1.0f, -149)).bits, 0x00);  // an fp32 subnormal
  EXPECT_EQ(fp8_e4m3_from_float(std::ldexp(15.0f, -10)).bits, 0x08);  // up into the normals
}

TEST(Lamport, SentinelIsComparedAsBits) {
  // -0.0f equals 0.0f as a value; only the bits tell the sentinel from a payload zero.
  const Vec16 negative_zeros = sentinel_vector();
  EXPECT_FALSE(has_arrived(negative_zeros));
  Vec16 positive_zeros{{0, 0, 0, 0}};
  EXPECT_TRUE(has_arrived(positive_zeros));
  Vec16 one_missing{{0x3f800000u, 0, kSentinel, 0}};
  EXPECT_FALSE(has_arrived(one_missing));
  const Vec16 rewritten = rewrite_sentinel(Vec16{{kSentinel, 0x80000001u, 0x00008000u, kSentinel}});
  EXPECT_EQ(rewritten.word[0], 0u);
  EXPECT_EQ(rewritten.word[1], 0x80000001u);
  EXPECT_EQ(rewritten.word[2], 0x00008000u);
  EXPECT_EQ(rewritten.word[3], 0u);
  EXPECT_TRUE(has_arrived(rewritten));
}

TEST(Lamport, SlotRotation) {
  uint32_t slot = 0;
  for (int call = 0; call < 10; ++call) {
    EXPECT_EQ(slot, uint32_t(call % 3));
    const uint32_t next = next_slot(slot);
    // A call clears the slot the previous call used: never its own, never the next call's.
    EXPECT_EQ(slot_to_clear(next), slot);
    EXPECT_NE(slot_to_clear(slot), slot);
    EXPECT_NE(slot_to_clear(slot), next);
    slot = next;
  }
}

}  // namespace
}  // namespace tpfuse::impl
