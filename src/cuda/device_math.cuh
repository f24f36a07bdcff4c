// device_math.cuh: device-side building blocks shared by the kernels: 16-byte vectors, bf16
// unpacking and the hardware e4m3 conversion. Internal.
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

}  // namespace qkvfuse::cuda
