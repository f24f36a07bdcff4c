// qkvfuse/numeric.hpp: bf16 and e4m3 (float8_e4m3fn) conversions and the FP8 constants.
//
// These are the bit-exact definitions SPEC.md section 4 fixes, usable on host and device. The CPU
// backend computes with them; the CUDA kernels use the hardware `cvt` instructions, which the
// GPU tests check agree with these bit for bit.
//   fp32 -> bf16: round to nearest even; NaN stays NaN (quiet, sign kept).
//   fp32 -> e4m3: round to nearest even with saturation (`satfinite`): finite values beyond 448
//                 and +-inf become +-448; NaN becomes 0x7f (what `cvt.rn.satfinite.e4m3x2.f32`
//                 gives). Subnormals are kept: the smallest magnitude is 2^-9.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define QKVF_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define QKVF_HOST_DEVICE inline
#endif

namespace qkvfuse {

/// float8_e4m3fn traits, in one place.
struct E4M3 {
  static constexpr float kMax = 448.0f;           ///< largest finite value (0x7e)
  static constexpr float kMinSubnormal = 0.001953125f;  ///< 2^-9 (0x01)
  static constexpr uint8_t kNaN = 0x7f;
  static constexpr uint8_t kMaxBits = 0x7e;
  static constexpr int kExponentBias = 7;
  static constexpr int kMantissaBits = 3;
};

/// RMS-norm epsilon: F.rms_norm's fp32 default, torch.finfo(float32).eps = 2^-23.
inline constexpr float kRmsNormEps = 1.1920928955078125e-7f;

QKVF_HOST_DEVICE uint32_t float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

QKVF_HOST_DEVICE float bits_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

QKVF_HOST_DEVICE float bf16_to_float(uint16_t bits) { return bits_float(uint32_t(bits) << 16); }

QKVF_HOST_DEVICE uint16_t float_to_bf16(float value) {
  const uint32_t bits = float_bits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x0040u);  // quiet NaN
  // Round to nearest even: add half an ulp of the bf16 result, plus one when the kept lsb is odd.
  const uint32_t rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(rounded >> 16);
}

/// Rounds an fp32 value to the nearest bf16 and returns it as fp32.
QKVF_HOST_DEVICE float round_to_bf16(float value) { return bf16_to_float(float_to_bf16(value)); }

QKVF_HOST_DEVICE float e4m3_to_float(uint8_t bits) {
  const uint32_t sign = uint32_t(bits & 0x80u) << 24;
  const uint32_t exponent = (bits >> 3) & 0xfu;
  const uint32_t mantissa = bits & 0x7u;
  if (exponent == 0xfu && mantissa == 0x7u) return bits_float(sign | 0x7fc00000u);  // NaN
  if (exponent == 0) {
    // Subnormal: mantissa * 2^-9, exact in fp32.
    const float magnitude = float(mantissa) * E4M3::kMinSubnormal;
    return sign ? -magnitude : magnitude;
  }
  // Normal: rebias the exponent from 7 to 127 and widen the mantissa from 3 to 23 bits.
  return bits_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

QKVF_HOST_DEVICE uint8_t float_to_e4m3(float value) {
  const uint32_t bits = float_bits(value);
  const uint8_t sign = uint8_t((bits >> 24) & 0x80u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return E4M3::kNaN;
  // 0x43e00000 is 448.0f: everything at or beyond it, infinity included, saturates.
  if (magnitude >= 0x43e00000u) return uint8_t(sign | E4M3::kMaxBits);
  if (magnitude < 0x3c800000u) {
    // Below 2^-6, the smallest normal: count in units of 2^-9 (exact scaling by a power of two)
    // and round to nearest even. A result of 8 is 2^-6, whose encoding 0x08 is also correct.
    const float units = bits_float(magnitude) * 512.0f;
    uint32_t whole = uint32_t(units);
    const float rest = units - float(whole);
    if (rest > 0.5f || (rest == 0.5f && (whole & 1u))) ++whole;
    return uint8_t(sign | whole);
  }
  // Normal: keep 3 of 23 mantissa bits, rounding to nearest even, then rebias 127 -> 7. A carry
  // out of the mantissa correctly bumps the exponent; 448 <= |x| was handled above, and values in
  // [448 - half ulp, 448) round to at most 0x7e.
  const uint32_t rounded = magnitude + 0x7ffffu + ((magnitude >> 20) & 1u);
  return uint8_t(sign | ((rounded >> 20) - (120u << 3)));
}

}  // namespace qkvfuse
