// device_math.cuh: device-side building blocks shared by the kernels: 16-byte vectors, bf16
// unpacking, the hardware e4m3 conversion and division by a shared divisor. Internal.
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

#include "qkvfuse/numeric.hpp"

namespace qkvfuse::cuda {

/// 16 bytes: the widest load/store a thread issues (LDG.128 / STG.128).
struct alignas(16) Vec16 {
  uint32_t w[4];
};

/// 8 bf16 values of a Vec16 to fp32 (a bf16 is the high half of an fp32: a shift, no rounding).
__device__ __forceinline__ void bf16x8_to_float(const Vec16& v, float (&out)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(v.w[i] << 16);
    out[2 * i + 1] = __uint_as_float(v.w[i] & 0xffff0000u);
  }
}

/// Two fp32 to packed bf16x2 (round to nearest even, NaN kept), low element first.
__device__ __forceinline__ uint32_t float2_to_bf16x2(float lo, float hi) {
  const __nv_bfloat162 packed = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&packed);
}

/// 8 fp32 to 8 bf16 in a Vec16.
__device__ __forceinline__ Vec16 float_to_bf16x8(const float (&in)[8]) {
  Vec16 v;
#pragma unroll
  for (int i = 0; i < 4; ++i) v.w[i] = float2_to_bf16x2(in[2 * i], in[2 * i + 1]);
  return v;
}

/// Two fp32 to two e4m3 with round-to-nearest-even and saturation (SPEC.md section 4), one
/// instruction on sm_89+. Low byte = lo. NaN -> 0x7f, +-inf and |x| > 448 -> +-448.
__device__ __forceinline__ uint16_t float2_to_e4m3x2(float lo, float hi) {
  uint16_t packed;
  // cvt packs its first source operand into the upper byte.
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  return packed;
}

/// Four fp32 to four e4m3 packed in a uint32, element 0 in the low byte.
__device__ __forceinline__ uint32_t float4_to_e4m3x4(float a, float b, float c, float d) {
  return uint32_t(float2_to_e4m3x2(a, b)) | (uint32_t(float2_to_e4m3x2(c, d)) << 16);
}

// ------------------------------------------------------------------------------------------------
// Division by a value shared by many divisions (the grad scale, a quantize scale, the row width)
// ------------------------------------------------------------------------------------------------

/// a / b correctly rounded (IEEE division, bit-identical to __fdiv_rn), for one b and many a.
///
/// __fdiv_rn(a, b) compiles to MUFU.RCP r0 = ~1/b; r1 = fma(r0, fma(-b, r0, 1), r0);
/// q0 = a * r1; q1 = fma(r1, fma(-b, q0, a), q0), plus an FCHK test that sends operands of
/// extreme exponents (denormals, zero, inf/NaN, quotients near over/underflow) to a slow exact
/// path. Here r1 is computed once per b (the same instructions, so the same bits) and each
/// division costs three FMAs; operands outside [2^-40, 2^40] (zeros included, whose sign the
/// fast path could lose), far inside every FCHK limit, take __fdiv_rn itself. The results are
/// therefore those of __fdiv_rn for every input: 3 instead of ~10 instructions per element.
struct UniformDivisor {
  float divisor;
  float reciprocal;  ///< r1 above
  bool fast;         ///< divisor inside [2^-40, 2^40]

  __device__ __forceinline__ explicit UniformDivisor(float b) : divisor(b) {
    float r0;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(b));
    reciprocal = __fmaf_rn(r0, __fmaf_rn(-b, r0, 1.0f), r0);
    const float magnitude = fabsf(b);
    fast = magnitude >= 0x1p-40f && magnitude <= 0x1p40f;
  }

  __device__ __forceinline__ float operator()(float a) const {
    const float magnitude = fabsf(a);
    if (fast && magnitude >= 0x1p-40f && magnitude <= 0x1p40f) {
      const float q0 = __fmul_rn(a, reciprocal);
      return __fmaf_rn(reciprocal, __fmaf_rn(-divisor, q0, a), q0);
    }
    return __fdiv_rn(a, divisor);
  }
};

/// a / W for a row width W that is a power of two known at compile time (the model's 32, 64, 128
/// and 256): one multiplication by 1/W, which gives the bits of __fdiv_rn(a, W) for every a. The
/// exact quotient is a scaled by a power of two, and a product rounds that exact value as the
/// division does: subnormal results, zeros (with their sign), inf and NaN included. UniformDivisor
/// and divide_by_width spend 5-12 instructions per division for a width known only at run time.
template <int kWidth>
struct PowerOfTwoWidth {
  static_assert(kWidth > 0 && (kWidth & (kWidth - 1)) == 0 && kWidth <= (1 << 20),
                "a power of two whose reciprocal is a normal fp32");
  __device__ __forceinline__ float operator()(float a) const {
    return __fmul_rn(a, 1.0f / float(kWidth));
  }
};

/// |magnitude| with the sign bit of `sign`, as one LOP3 (select by the constant mask; ptxas emits
/// two for the equivalent (m & 0x7fffffff) | (s & 0x80000000)).
__device__ __forceinline__ float magnitude_with_sign_of(float magnitude, float sign) {
  uint32_t bits;
  asm("lop3.b32 %0, %1, 0x80000000, %2, 0xb8;"
      : "=r"(bits)
      : "r"(__float_as_uint(magnitude)), "r"(__float_as_uint(sign)));
  return __uint_as_float(bits);
}

/// a / D as UniformDivisor(D) computes it, for the rope kernels' row widths D in [2, 256], with
/// no branch: the per-row scalars of the row kernels then form one basic block, which ptxas can
/// interleave with the next row's (a branch per division kept the Q and K rows of the FP8
/// backward in sequence). Same bits as __fdiv_rn(a, D) for every a whose quotient is not
/// subnormal:
///   - |a| < 2^-40 (zeros included) is scaled by 2^64 into UniformDivisor's proven range and the
///     quotient back by 2^-64: both power-of-two products are exact unless the quotient is below
///     2^-126;
///   - 2^-40 <= |a| < inf: the three FMAs of UniformDivisor (no intermediate overflows: D >= 2);
///   - +-inf gives +-inf and NaN NaN (a * r), where the residual would make inf - inf;
///   - the sign comes from a (the FMAs can turn -0 into +0).
__device__ __forceinline__ float divide_by_width(float a, const UniformDivisor& width) {
  const bool tiny = fabsf(a) < 0x1p-40f;
  const float scaled = tiny ? __fmul_rn(a, 0x1p64f) : a;
  const float r = width.reciprocal;
  const float q0 = __fmul_rn(scaled, r);
  const float q1 = __fmaf_rn(r, __fmaf_rn(-width.divisor, q0, scaled), q0);
  const float q = isinf(a) ? __fmul_rn(a, r) : (tiny ? __fmul_rn(q1, 0x1p-64f) : q1);
  return magnitude_with_sign_of(q, a);
}

/// divide_by_width for a power-of-two width known at compile time: the same bits, one FMUL.
template <int kWidth>
__device__ __forceinline__ float divide_by_width(float a, const PowerOfTwoWidth<kWidth>& width) {
  return width(a);
}

/// __fdiv_rn(1, __fsqrt_rn(v)) with no branch, for v >= 2^-100, +inf or NaN (the rope kernels'
/// mean + eps, eps = kRmsNormEps). ptxas compiles __fsqrt_rn to MUFU.RSQ y, s = v*y corrected
/// by one FMA step, and __fdiv_rn(1, s) to MUFU.RCP and four FMAs, each behind a check that sends
/// operands of extreme exponents to a slow subroutine; for v in [2^-100, FLT_MAX] neither check
/// fires, so the same instructions written out here give the same bits. +inf gives +0 and NaN
/// NaN, as the slow paths do.
__device__ __forceinline__ float reciprocal_sqrt_rn(float v) {
  float y, r0;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(v));
  const float s0 = __fmul_rn(v, y);
  const float s = __fmaf_rn(__fmaf_rn(-s0, s0, v), __fmul_rn(y, 0.5f), s0);  // sqrt(v)
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(s));
  const float r1 = __fmaf_rn(r0, __fmaf_rn(-s, r0, 1.0f), r0);
  const float q = __fmaf_rn(r1, __fmaf_rn(-s, r1, 1.0f), r1);
  return isinf(v) ? 0.0f : q;
}

/// a clamped to [-limit, limit] (limit > 0), NaN kept: min(|a|, limit) with the sign of a, one
/// FMNMX (min.NaN.xorsign.abs: the sign of the result is sign(a) ^ sign(limit)).
__device__ __forceinline__ float clamp_magnitude(float a, float limit) {
  float r;
  asm("min.NaN.xorsign.abs.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(limit));
  return r;
}

/// e4m3(a / s) for one scale s and many a: the code of every element is float_to_e4m3 of
/// __fdiv_rn(a, s), as the CPU backend computes it, without a branch per element.
///
/// Only the e4m3 code is the contract, not the fp32 quotient, and that allows a branch-free form
/// of UniformDivisor's three FMAs for any a, where UniformDivisor sends zeros, tiny and huge
/// values to __fdiv_rn one element at a time (a branch and a convergence barrier per element;
/// removing them made the FP8 backward 3.4 % faster on the H200):
///   - a is first clamped to [-512 s, 512 s] (NaN kept): beyond that the quotient saturates to
///     448 either way, and an infinite a can no longer make inf - inf in the residual;
///   - 2^-40 <= |a| <= 512 s is inside UniformDivisor's proven range: the quotient has the bits
///     of __fdiv_rn;
///   - |a| < 2^-40 (zeros and denormals included) has |a / s| < 2^-40 / 2^-29 = 2^-11, and every
///     quotient below 2^-10 is +-0 in e4m3 whatever its low bits: only its sign matters. The
///     exact value q0 + r * (a - s * q0) is a * r up to relative terms below 2^-22, so a nonzero
///     a gives a quotient of its sign (or a zero of its sign, on underflow), and a zero a keeps
///     its sign through the negated-residual form of quotient().
/// Hence the fast path's range, s in [2^-29, 2^31] (512 s <= 2^40). Other scales (zero, negative,
/// NaN, inf, extreme) take __fdiv_rn for all 8 elements of a call: a branch that is uniform over
/// the launch, so it never diverges.
struct E4m3Scaler {
  UniformDivisor divisor;
  bool fast;

  __device__ __forceinline__ explicit E4m3Scaler(float s)
      : divisor(s), fast(s >= 0x1p-29f && s <= 0x1p31f) {}

  /// `limit` = 512 s (exact), clamping to it changes no code. Passed in rather than kept as a
  /// member: one multiply per 8 elements, and one register fewer across the kernels' loops.
  __device__ __forceinline__ float quotient(float a, float limit) const {
    const float clamped = clamp_magnitude(a, limit);
    const float r = divisor.reciprocal;
    const float q0 = __fmul_rn(clamped, r);
    // UniformDivisor's q0 + r * (c - s * q0), with the residual negated: fma(s, q0, -c) is
    // exactly -fma(-s, q0, c) (round-to-nearest is sign-symmetric), so q has the same bits,
    // except that a zero quotient keeps the sign of c, where the other form turns -0 into +0.
    // No sign fix-up is needed after it: 4 instructions per element.
    return __fmaf_rn(-r, __fmaf_rn(divisor.divisor, q0, -clamped), q0);
  }

  /// One value's quotient, for callers that convert elements one or two at a time.
  __device__ __forceinline__ float operator()(float a) const {
    return fast ? quotient(a, divisor.divisor * 512.0f) : __fdiv_rn(a, divisor.divisor);
  }

  /// codes() with the fast / general choice made by the caller (kFast must equal `fast`): a
  /// kernel that branches once on `fast` outside its loop keeps the loop free of the per-call
  /// branch, so ptxas can schedule across consecutive rows.
  template <bool kFast>
  __device__ __forceinline__ void codes(const float (&v)[8], uint32_t& lo, uint32_t& hi) const {
    float q[8];
    if constexpr (kFast) {
      const float limit = divisor.divisor * 512.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) q[i] = quotient(v[i], limit);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) q[i] = __fdiv_rn(v[i], divisor.divisor);
    }
    lo = float4_to_e4m3x4(q[0], q[1], q[2], q[3]);
    hi = float4_to_e4m3x4(q[4], q[5], q[6], q[7]);
  }

  /// 8 values -> 8 e4m3 codes in two words, element 0 in the low byte of lo: codes<kFast> with
  /// the test of `fast` made here. Written out rather than calling codes<>: that form compiled
  /// the D = 64 FP8 backward's loop 8-16 instructions longer, which was never timed on the GPU,
  /// so the measured SASS is kept.
  __device__ __forceinline__ void operator()(const float (&v)[8], uint32_t& lo,
                                             uint32_t& hi) const {
    float q[8];
    if (fast) {
      const float limit = divisor.divisor * 512.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) q[i] = quotient(v[i], limit);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) q[i] = __fdiv_rn(v[i], divisor.divisor);
    }
    lo = float4_to_e4m3x4(q[0], q[1], q[2], q[3]);
    hi = float4_to_e4m3x4(q[4], q[5], q[6], q[7]);
  }
};

}  // namespace qkvfuse::cuda
