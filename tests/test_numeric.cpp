// test_numeric.cpp: the bf16 and e4m3 conversions of numeric.hpp (SPEC.md section 4).
//
// Checked three ways: against the format definitions written out here and in the reference
// (every e4m3 code, every rounding boundary), against the independent rounding of
// tests/reference.cpp on random floats, and, in CUDA builds, against the CUDA toolkit's own host
// conversions (__nv_cvt_float_to_fp8 with __NV_SATFINITE, __float2bfloat16_rn), which need no
// GPU. The GPU's cvt instructions are compared with these in test_cuda_numeric.cu.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "qkvfuse/numeric.hpp"
#include "reference.hpp"
#include "test_util.hpp"

#if defined(QKVFUSE_WITH_CUDA)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

namespace qkvfuse::test {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

float up(float x) { return std::nextafter(x, kInf); }
float down(float x) { return std::nextafter(x, -kInf); }
float away_from_zero(float x) { return std::nextafter(x, std::copysign(kInf, x)); }
float toward_zero(float x) { return std::nextafter(x, 0.0f); }

/// The 127 non-negative finite e4m3 values in increasing order (codes 0x00..0x7e).
std::vector<float> e4m3_ladder() {
  std::vector<float> values;
  for (int code = 0; code <= 0x7e; ++code) values.push_back(e4m3_to_float(uint8_t(code)));
  return values;
}

bool is_e4m3_nan(uint8_t code) { return (code & 0x7f) == 0x7f; }

/// Floats at and around every rounding boundary of e4m3 (midpoints of consecutive values, the
/// values themselves, their neighbours), both signs, plus the saturation edge and specials.
std::vector<float> e4m3_boundary_floats() {
  std::vector<float> out;
  const std::vector<float> ladder = e4m3_ladder();
  for (size_t i = 0; i < ladder.size(); ++i) {
    for (float x : {ladder[i], up(ladder[i]), down(ladder[i])}) out.push_back(x);
    if (i + 1 < ladder.size()) {
      const float mid = (ladder[i] + ladder[i + 1]) / 2;
      for (float x : {mid, up(mid), down(mid)}) out.push_back(x);
    }
  }
  for (float x :
       {448.0f, 449.0f, 464.0f, up(464.0f), 480.0f, 1e30f, std::numeric_limits<float>::max(), kInf,
        std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min(), 0.0f}) {
    out.push_back(x);
  }
  const size_t positive = out.size();
  for (size_t i = 0; i < positive; ++i) out.push_back(-out[i]);
  out.push_back(kNaN);
  out.push_back(-kNaN);
  return out;
}

/// Every bf16 value, the midpoint to its successor and both neighbours of that midpoint.
std::vector<float> bf16_boundary_floats() {
  std::vector<float> out;
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float value = bf16_to_float(uint16_t(bits));
    out.push_back(value);
    if (std::isnan(value) || std::isinf(value) || (bits & 0x7fff) == 0x7f7f) continue;
    const float next = bf16_to_float(uint16_t(bits + 1));
    if (std::isnan(next)) continue;
    const float mid = float((double(value) + double(next)) / 2);  // exact: one more bit
    for (float x : {mid, up(mid), down(mid)}) out.push_back(x);
  }
  return out;
}

/// Random floats: uniform bit patterns (every binade, NaN and inf included) and values spread
/// over the e4m3 range with a few extra bits beyond any format's grid.
std::vector<float> random_floats(std::mt19937_64& rng, size_t count) {
  std::vector<float> out;
  out.reserve(count);
  std::uniform_int_distribution<uint32_t> bits;
  std::uniform_real_distribution<float> unit(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-14, 10);
  for (size_t i = 0; i < count / 2; ++i) out.push_back(bits_float(bits(rng)));
  for (size_t i = count / 2; i < count; ++i) {
    const float magnitude = std::ldexp(unit(rng), exponent(rng));
    out.push_back((i & 1) ? -magnitude : magnitude);
  }
  return out;
}

// ---- e4m3 decode -------------------------------------------------------------------------------

TEST(NumericE4m3, EveryCodeDecodesToItsDefinedValue) {
  for (int code = 0; code < 256; ++code) {
    SCOPED_TRACE(code);
    const float got = e4m3_to_float(uint8_t(code));
    const double expected = ref::e4m3_value(uint8_t(code));
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(got));
      continue;
    }
    EXPECT_EQ(double(got), expected);
    EXPECT_EQ(std::signbit(got), (code & 0x80) != 0);  // -0 included
  }
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xff)));
}

TEST(NumericE4m3, TraitsMatchTheFormat) {
  EXPECT_EQ(E4M3::kMax, e4m3_to_float(E4M3::kMaxBits));
  EXPECT_EQ(E4M3::kMinSubnormal, e4m3_to_float(0x01));
  EXPECT_TRUE(std::isnan(e4m3_to_float(E4M3::kNaN)));
  EXPECT_EQ(kRmsNormEps, std::ldexp(1.0f, -23));
  EXPECT_EQ(kRmsNormEps, std::numeric_limits<float>::epsilon());
}

TEST(NumericE4m3, EveryCodeRoundTrips) {
  for (int code = 0; code < 256; ++code) {
    SCOPED_TRACE(code);
    const uint8_t back = float_to_e4m3(e4m3_to_float(uint8_t(code)));
    EXPECT_EQ(int(back), is_e4m3_nan(uint8_t(code)) ? 0x7f : code);
  }
}

// ---- fp32 -> e4m3 ------------------------------------------------------------------------------

TEST(NumericE4m3, MidpointsRoundToEvenAndNeighboursRoundAway) {
  const std::vector<float> ladder = e4m3_ladder();
  for (size_t i = 0; i + 1 < ladder.size(); ++i) {
    const float mid = (ladder[i] + ladder[i + 1]) / 2;
    const int lower = int(i);
    const int upper = int(i + 1);
    const int even = (lower % 2 == 0) ? lower : upper;  // the code with a 0 lsb
    SCOPED_TRACE(mid);
    EXPECT_EQ(int(float_to_e4m3(mid)), even);
    EXPECT_EQ(int(float_to_e4m3(up(mid))), upper);
    EXPECT_EQ(int(float_to_e4m3(down(mid))), lower);
    EXPECT_EQ(int(float_to_e4m3(-mid)), 0x80 | even);
    EXPECT_EQ(int(float_to_e4m3(-up(mid))), 0x80 | upper);
    EXPECT_EQ(int(float_to_e4m3(-down(mid))), 0x80 | lower);
  }
}

TEST(NumericE4m3, SaturatesFiniteOverflowAndInfinity) {
  for (float x : {448.0f, up(448.0f), 449.0f, 464.0f, up(464.0f), 480.0f, 1e30f,
                  std::numeric_limits<float>::max(), kInf}) {
    SCOPED_TRACE(x);
    EXPECT_EQ(int(float_to_e4m3(x)), 0x7e);
    EXPECT_EQ(int(float_to_e4m3(-x)), 0xfe);
  }
  // Below 448 the normal rounding applies: 432 is halfway between 416 (0x7d) and 448 (0x7e),
  // and the tie goes to the even code.
  EXPECT_EQ(int(float_to_e4m3(432.0f)), 0x7e);
  EXPECT_EQ(int(float_to_e4m3(down(432.0f))), 0x7d);
}

TEST(NumericE4m3, NaNBecomesCanonicalNaN) {
  for (float x : {kNaN, -kNaN, bits_float(0x7f800001u), bits_float(0xffc12345u)}) {
    EXPECT_EQ(int(float_to_e4m3(x)), 0x7f);
  }
}

TEST(NumericE4m3, SubnormalsAndZero) {
  const float unit = std::ldexp(1.0f, -9);  // the smallest subnormal
  EXPECT_EQ(int(float_to_e4m3(unit)), 0x01);
  EXPECT_EQ(int(float_to_e4m3(unit / 2)), 0x00);  // tie between 0 and 1: even
  EXPECT_EQ(int(float_to_e4m3(up(unit / 2))), 0x01);
  EXPECT_EQ(int(float_to_e4m3(1.5f * unit)), 0x02);  // tie between 1 and 2: even
  EXPECT_EQ(int(float_to_e4m3(2.5f * unit)), 0x02);  // tie between 2 and 3: even
  EXPECT_EQ(int(float_to_e4m3(3.5f * unit)), 0x04);  // tie between 3 and 4: even
  EXPECT_EQ(int(float_to_e4m3(7.0f * unit)), 0x07);
  EXPECT_EQ(int(float_to_e4m3(7.5f * unit)), 0x08);  // rounds up into the first normal
  EXPECT_EQ(int(float_to_e4m3(std::ldexp(1.0f, -6))), 0x08);
  EXPECT_EQ(int(float_to_e4m3(-1.5f * unit)), 0x82);
  EXPECT_EQ(int(float_to_e4m3(1e-30f)), 0x00);
  EXPECT_EQ(int(float_to_e4m3(-1e-30f)), 0x80);  // the sign of a vanished value stays
  EXPECT_EQ(int(float_to_e4m3(std::numeric_limits<float>::denorm_min())), 0x00);
  EXPECT_EQ(int(float_to_e4m3(0.0f)), 0x00);
  EXPECT_EQ(int(float_to_e4m3(-0.0f)), 0x80);
  EXPECT_TRUE(std::signbit(e4m3_to_float(0x80)));
  EXPECT_EQ(e4m3_to_float(0x80), 0.0f);
}

TEST(NumericE4m3, AgreesWithTheReferenceRounding) {
  auto rng = rng_for_test();
  std::vector<float> inputs = random_floats(rng, 1 << 18);
  const std::vector<float> boundaries = e4m3_boundary_floats();
  inputs.insert(inputs.end(), boundaries.begin(), boundaries.end());
  int64_t mismatches = 0;
  for (float x : inputs) {
    const uint8_t expected = ref::e4m3_code(ref::round_e4m3(x));
    const uint8_t got = float_to_e4m3(x);
    if (got != expected && mismatches++ < 5) {
      ADD_FAILURE() << "x = " << x << " (0x" << std::hex << float_bits(x) << "): got 0x" << int(got)
                    << ", reference 0x" << int(expected);
    }
  }
  EXPECT_EQ(mismatches, 0);
}

// ---- fp32 -> bf16 ------------------------------------------------------------------------------

TEST(NumericBf16, RoundsToNearestEvenAtEveryBoundary) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float value = bf16_to_float(uint16_t(bits));
    if (std::isnan(value) || std::isinf(value) || (bits & 0x7fff) == 0x7f7f) continue;
    const float next = bf16_to_float(uint16_t(bits + 1));
    if (std::isnan(next)) continue;
    const float mid = float((double(value) + double(next)) / 2);
    const uint16_t even = (bits % 2 == 0) ? uint16_t(bits) : uint16_t(bits + 1);
    ASSERT_EQ(float_to_bf16(value), bits);
    ASSERT_EQ(float_to_bf16(mid), even) << "midpoint after 0x" << std::hex << bits;
    // bits + 1 is the next value away from zero, for either sign.
    ASSERT_EQ(float_to_bf16(away_from_zero(mid)), uint16_t(bits + 1)) << std::hex << bits;
    ASSERT_EQ(float_to_bf16(toward_zero(mid)), bits) << std::hex << bits;
  }
}

TEST(NumericBf16, SpecialValues) {
  EXPECT_EQ(float_to_bf16(kInf), 0x7f80);
  EXPECT_EQ(float_to_bf16(-kInf), 0xff80);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds past the max
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
  for (float x : {kNaN, -kNaN, bits_float(0x7f800001u), bits_float(0xff800001u)}) {
    const uint16_t bits = float_to_bf16(x);
    EXPECT_TRUE(std::isnan(bf16_to_float(bits))) << std::hex << bits;  // a payload never turns inf
    EXPECT_EQ(bits & 0x8000, (float_bits(x) >> 16) & 0x8000);          // sign kept
  }
  EXPECT_EQ(round_to_bf16(1.0f + std::ldexp(1.0f, -8)), 1.0f);  // tie to even
}

TEST(NumericBf16, AgreesWithTheReferenceRounding) {
  auto rng = rng_for_test();
  int64_t mismatches = 0;
  for (float x : random_floats(rng, 1 << 18)) {
    if (std::isnan(x)) continue;
    const uint16_t expected = ref::bf16_bits(ref::round_bf16(x));
    if (float_to_bf16(x) != expected && mismatches++ < 5) {
      ADD_FAILURE() << "x = " << x << ": got 0x" << std::hex << float_to_bf16(x) << ", reference 0x"
                    << expected;
    }
  }
  EXPECT_EQ(mismatches, 0);
}

// ---- agreement with the CUDA toolkit's host conversions ----------------------------------------

#if defined(QKVFUSE_WITH_CUDA)

TEST(NumericCudaToolkit, EveryE4m3CodeDecodesLikeCuda) {
  for (int code = 0; code < 256; ++code) {
    SCOPED_TRACE(code);
    const float ours = e4m3_to_float(uint8_t(code));
    const float via_half =
        __half2float(__half(__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(code), __NV_E4M3)));
    __nv_fp8_e4m3 wrapped;
    wrapped.__x = __nv_fp8_storage_t(code);
    const float via_class = float(wrapped);
    for (float theirs : {via_half, via_class}) {
      if (std::isnan(ours) || std::isnan(theirs)) {
        EXPECT_EQ(std::isnan(ours), std::isnan(theirs));
      } else {
        EXPECT_EQ(float_bits(ours), float_bits(theirs));  // -0 included
      }
    }
  }
}

TEST(NumericCudaToolkit, FloatToE4m3MatchesSatfinite) {
  auto rng = rng_for_test();
  std::vector<float> inputs = random_floats(rng, 1 << 21);
  const std::vector<float> boundaries = e4m3_boundary_floats();
  inputs.insert(inputs.end(), boundaries.begin(), boundaries.end());
  int64_t mismatches = 0;
  for (float x : inputs) {
    const uint8_t ours = float_to_e4m3(x);
    const uint8_t theirs = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
    const bool same = (is_e4m3_nan(ours) || is_e4m3_nan(theirs))
                          ? is_e4m3_nan(ours) == is_e4m3_nan(theirs)
                          : ours == theirs;
    if (!same && mismatches++ < 5) {
      ADD_FAILURE() << "x = " << x << " (0x" << std::hex << float_bits(x) << "): ours 0x"
                    << int(ours) << ", CUDA 0x" << int(theirs);
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << inputs.size();
}

TEST(NumericCudaToolkit, FloatToBf16MatchesRn) {
  auto rng = rng_for_test();
  std::vector<float> inputs = random_floats(rng, 1 << 21);
  const std::vector<float> boundaries = bf16_boundary_floats();
  inputs.insert(inputs.end(), boundaries.begin(), boundaries.end());
  int64_t mismatches = 0;
  for (float x : inputs) {
    const uint16_t ours = float_to_bf16(x);
    const __nv_bfloat16_raw raw = __float2bfloat16_rn(x);
    const uint16_t theirs = raw.x;
    const bool ours_nan = std::isnan(bf16_to_float(ours));
    const bool theirs_nan = std::isnan(bf16_to_float(theirs));
    const bool same = (ours_nan || theirs_nan) ? ours_nan == theirs_nan : ours == theirs;
    if (!same && mismatches++ < 5) {
      ADD_FAILURE() << "x = " << x << " (0x" << std::hex << float_bits(x) << "): ours 0x" << ours
                    << ", CUDA 0x" << theirs;
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << inputs.size();
}

#else

constexpr const char* kNoToolkit =
    "built without CUDA (QKVFUSE_WITH_CUDA undefined): the toolkit's host conversions "
    "(cuda_fp8.h, cuda_bf16.h) are not available to compare against";

TEST(NumericCudaToolkit, EveryE4m3CodeDecodesLikeCuda) { GTEST_SKIP() << kNoToolkit; }
TEST(NumericCudaToolkit, FloatToE4m3MatchesSatfinite) { GTEST_SKIP() << kNoToolkit; }
TEST(NumericCudaToolkit, FloatToBf16MatchesRn) { GTEST_SKIP() << kNoToolkit; }

#endif

}  // namespace
}  // namespace qkvfuse::test
