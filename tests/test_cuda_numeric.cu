// test_cuda_numeric.cu: the device conversions the kernels use (src/cuda/device_math.cuh) against
// the host definitions of SPEC.md section 4 (qkvfuse/numeric.hpp), bit for bit.
//
//   fp32 -> e4m3: float2_to_e4m3x2 / float4_to_e4m3x4 (cvt.rn.satfinite.e4m3x2.f32) vs
//                 float_to_e4m3 (nearest even, saturating, NaN -> 0x7f)
//   fp32 -> bf16: float2_to_bf16x2 / float_to_bf16x8 (cvt.rn.bf16x2.f32) vs float_to_bf16
//   e4m3 -> fp32: all 256 codes through the hardware cvt.rn.f16x2.e4m3x2 vs e4m3_to_float
// Inputs: every rounding boundary of both formats (each e4m3 value, the midpoints between
// neighbours and the floats either side of them, the saturation edge, bf16 ties with odd and
// even kept bits, the bf16 overflow edge, subnormals of all three formats, +-0, +-inf, NaNs),
// then a few million random bit patterns and random normal values over many scales.
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "cuda/device_math.cuh"
#include "gpu_util.hpp"
#include "qkvfuse/numeric.hpp"
#include "test_util.hpp"

namespace qkvfuse::test {
namespace {

using cuda::Vec16;

/// Four conversions of 8 consecutive inputs per thread: pairs and quads to e4m3, pairs and
/// 8-vectors to bf16 (so that element order inside the packed results is checked too).
__global__ void convert_kernel(const float* in, int64_t groups, uint8_t* e4m3_pair,
                               uint8_t* e4m3_quad, uint16_t* bf16_pair, uint16_t* bf16_vec) {
  const int64_t g = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  const float* x = in + 8 * g;
  for (int i = 0; i < 8; i += 2) {
    const uint16_t e = cuda::float2_to_e4m3x2(x[i], x[i + 1]);
    e4m3_pair[8 * g + i] = uint8_t(e & 0xff);
    e4m3_pair[8 * g + i + 1] = uint8_t(e >> 8);
    const uint32_t b = cuda::float2_to_bf16x2(x[i], x[i + 1]);
    bf16_pair[8 * g + i] = uint16_t(b & 0xffff);
    bf16_pair[8 * g + i + 1] = uint16_t(b >> 16);
  }
  for (int i = 0; i < 8; i += 4) {
    const uint32_t e = cuda::float4_to_e4m3x4(x[i], x[i + 1], x[i + 2], x[i + 3]);
    for (int j = 0; j < 4; ++j) e4m3_quad[8 * g + i + j] = uint8_t(e >> (8 * j));
  }
  float v[8];
  for (int i = 0; i < 8; ++i) v[i] = x[i];
  const Vec16 packed = cuda::float_to_bf16x8(v);
  for (int i = 0; i < 8; ++i) bf16_vec[8 * g + i] = uint16_t(packed.w[i / 2] >> (16 * (i % 2)));
}

/// Every e4m3 code through the hardware decode (to f16, exact) and on to fp32.
__global__ void decode_kernel(float* out) {
  const int code = int(threadIdx.x);
  const uint16_t pair = uint16_t(code | (code << 8));
  uint32_t halves;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(halves) : "h"(pair));
  out[code] = __half2float(__ushort_as_half(uint16_t(halves & 0xffff)));
}

bool bf16_is_nan(uint16_t bits) { return (bits & 0x7f80) == 0x7f80 && (bits & 0x007f) != 0; }

/// The boundary inputs: see the file comment.
std::vector<float> boundary_values() {
  std::vector<float> v;
  auto both_signs = [&](float x) {
    v.push_back(x);
    v.push_back(-x);
  };
  auto with_neighbours = [&](float x) {
    both_signs(x);
    both_signs(std::nextafter(x, 0.0f));
    both_signs(std::nextafter(x, std::numeric_limits<float>::infinity()));
  };
  // e4m3: every value, every midpoint between neighbours (ties), and the floats either side.
  for (int code = 0; code < 0x7e; ++code) {
    const float here = e4m3_to_float(uint8_t(code));
    const float next = e4m3_to_float(uint8_t(code + 1));
    with_neighbours(here);
    with_neighbours(0.5f * (here + next));
  }
  // Saturation: 448 is the largest value; 464 is halfway to the next binade step (480).
  for (float x : {448.0f, 464.0f, 480.0f, 512.0f, 1e4f, 3.0e38f}) with_neighbours(x);
  // Subnormal edges: half the smallest e4m3 subnormal, the smallest normal, fp32 subnormals.
  for (float x : {0.0009765625f, 0.001953125f, 0.0029296875f, 0.015625f, 1e-40f, 1.4e-45f}) {
    with_neighbours(x);
  }
  // bf16: ties (low half exactly 0x8000) with even and odd kept bits, just below and above, the
  // overflow edge (0x7f7f8000 rounds to infinity), bf16 subnormals.
  for (uint32_t high : {0x3f80u, 0x3f81u, 0x4049u, 0x0001u, 0x0080u, 0x7f7eu, 0x7f7fu}) {
    for (uint32_t low : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      both_signs(bits_float((high << 16) | low));
    }
  }
  both_signs(0.0f);
  both_signs(std::numeric_limits<float>::infinity());
  both_signs(std::numeric_limits<float>::max());
  both_signs(std::numeric_limits<float>::denorm_min());
  return v;
}

std::vector<float> nan_values() {
  std::vector<float> v;
  for (uint32_t bits : {0x7fc00000u, 0x7f800001u, 0x7fbfffffu, 0x7fffffffu, 0x7fc12345u}) {
    v.push_back(bits_float(bits));
    v.push_back(bits_float(bits | 0x80000000u));
  }
  return v;
}

std::vector<float> random_inputs(std::mt19937_64& rng, size_t count) {
  std::vector<float> v;
  v.reserve(count);
  std::uniform_int_distribution<uint32_t> bits;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-24, 12);
  for (size_t i = 0; i < count / 2; ++i) {
    float x = bits_float(bits(rng));
    if (std::isnan(x)) x = 1.0f;  // NaNs are judged on their own (NaNInputs)
    v.push_back(x);
  }
  while (v.size() < count) v.push_back(std::ldexp(normal(rng), exponent(rng)));
  return v;
}

/// The row-scalar tests' inputs: boundary_values(), `random` random_inputs, then every power of
/// two from 2^-149 to 2^127.
std::vector<float> row_scalar_inputs(std::mt19937_64& rng, size_t random) {
  std::vector<float> in = boundary_values();
  const std::vector<float> drawn = random_inputs(rng, random);
  in.insert(in.end(), drawn.begin(), drawn.end());
  for (int e = -149; e <= 127; ++e) in.push_back(std::ldexp(1.0f, e));
  return in;
}

/// got has want's bits, or both are NaN (any payload).
bool same_bits_or_nan(float got, float want) {
  return std::isnan(want) ? std::isnan(got) : float_bits(got) == float_bits(want);
}

struct Converted {
  std::vector<uint8_t> e4m3_pair, e4m3_quad;
  std::vector<uint16_t> bf16_pair, bf16_vec;
};

Converted convert_on_device(std::vector<float> in) {
  while (in.size() % 8 != 0) in.push_back(0.0f);
  const int64_t groups = int64_t(in.size() / 8);
  DeviceBuffer src = DeviceBuffer::from(in);
  DeviceBuffer e4m3_pair(in.size()), e4m3_quad(in.size());
  DeviceBuffer bf16_pair(2 * in.size()), bf16_vec(2 * in.size());
  convert_kernel<<<unsigned((groups + 255) / 256), 256>>>(
      static_cast<const float*>(src.data()), groups, static_cast<uint8_t*>(e4m3_pair.data()),
      static_cast<uint8_t*>(e4m3_quad.data()), static_cast<uint16_t*>(bf16_pair.data()),
      static_cast<uint16_t*>(bf16_vec.data()));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  synchronize();
  return {e4m3_pair.to_host<uint8_t>(), e4m3_quad.to_host<uint8_t>(),
          bf16_pair.to_host<uint16_t>(), bf16_vec.to_host<uint16_t>()};
}

/// Non-NaN inputs: every device result equals the host definition bit for bit.
void expect_bit_exact(const std::vector<float>& in) {
  const Converted out = convert_on_device(in);
  int64_t e4m3_bad = 0, bf16_bad = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const uint8_t e = float_to_e4m3(in[i]);
    const uint16_t b = float_to_bf16(in[i]);
    const bool e_ok = out.e4m3_pair[i] == e && out.e4m3_quad[i] == e;
    const bool b_ok = out.bf16_pair[i] == b && out.bf16_vec[i] == b;
    if (!e_ok && e4m3_bad++ < 5) {
      ADD_FAILURE() << "e4m3 of " << in[i] << " (0x" << std::hex << float_bits(in[i])
                    << "): device pair 0x" << int(out.e4m3_pair[i]) << " quad 0x"
                    << int(out.e4m3_quad[i]) << ", host 0x" << int(e);
    }
    if (!b_ok && bf16_bad++ < 5) {
      ADD_FAILURE() << "bf16 of " << in[i] << " (0x" << std::hex << float_bits(in[i])
                    << "): device pair 0x" << out.bf16_pair[i] << " vec 0x" << out.bf16_vec[i]
                    << ", host 0x" << b;
    }
  }
  EXPECT_EQ(e4m3_bad, 0) << "of " << in.size() << " inputs";
  EXPECT_EQ(bf16_bad, 0) << "of " << in.size() << " inputs";
  std::printf("[numeric] %zu inputs: %lld e4m3 and %lld bf16 mismatches\n", in.size(),
              (long long)e4m3_bad, (long long)bf16_bad);
}

TEST(CudaNumeric, BoundaryValuesBitExact) {
  QKVF_REQUIRE_GPU();
  expect_bit_exact(boundary_values());
}

TEST(CudaNumeric, RandomValuesBitExact) {
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  expect_bit_exact(random_inputs(rng, size_t(1) << 22));
}

TEST(CudaNumeric, NaNInputs) {
  QKVF_REQUIRE_GPU();
  const std::vector<float> in = nan_values();
  const Converted out = convert_on_device(in);
  int64_t payload_differs = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    // e4m3 has one NaN code the spec fixes (0x7f, the sign dropped, as satfinite gives).
    EXPECT_EQ(out.e4m3_pair[i], E4M3::kNaN) << "input 0x" << std::hex << float_bits(in[i]);
    EXPECT_EQ(out.e4m3_quad[i], E4M3::kNaN) << "input 0x" << std::hex << float_bits(in[i]);
    // bf16: NaN must stay NaN; the payload the hardware keeps is reported, not required.
    EXPECT_TRUE(bf16_is_nan(out.bf16_pair[i]) && bf16_is_nan(out.bf16_vec[i]))
        << "input 0x" << std::hex << float_bits(in[i]) << " gave 0x" << out.bf16_pair[i];
    if (out.bf16_pair[i] != float_to_bf16(in[i])) ++payload_differs;
  }
  std::printf("[numeric] bf16 NaN payloads differing from float_to_bf16: %lld of %zu\n",
              (long long)payload_differs, in.size());
}

TEST(CudaNumeric, AllE4m3CodesDecode) {
  QKVF_REQUIRE_GPU();
  DeviceBuffer out(256 * sizeof(float));
  decode_kernel<<<1, 256>>>(static_cast<float*>(out.data()));
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  synchronize();
  const std::vector<float> device = out.to_host<float>();
  for (int code = 0; code < 256; ++code) {
    const float host = e4m3_to_float(uint8_t(code));
    if (std::isnan(host)) {
      EXPECT_TRUE(std::isnan(device[code])) << "code 0x" << std::hex << code;
    } else {
      EXPECT_EQ(float_bits(device[code]), float_bits(host))
          << "code 0x" << std::hex << code << ": device " << device[code] << " host " << host;
      // And the round trip: encoding the decoded value gives the code back.
      EXPECT_EQ(float_to_e4m3(host), uint8_t(code)) << "code 0x" << std::hex << code;
    }
  }
}

// ---- the branch-free row scalars of the rope kernels ------------------------------------------

/// out[i] = divide_by_width(in[i], D) for D = 2 + blockIdx.y (2..256), and inv_sqrt[i] =
/// reciprocal_sqrt_rn(in[i]) where in[i] is a valid argument (>= 2^-100, +inf, NaN).
__global__ void row_scalar_kernel(const float* in, int64_t count, float* quotient,
                                  float* inv_sqrt) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const int width = 2 + int(blockIdx.y);
  const cuda::UniformDivisor divisor{float(width)};
  quotient[int64_t(blockIdx.y) * count + i] = cuda::divide_by_width(in[i], divisor);
  if (blockIdx.y == 0) inv_sqrt[i] = cuda::reciprocal_sqrt_rn(in[i]);
}

TEST(CudaNumeric, BranchFreeRowScalarsMatchIeee) {
  // Host IEEE float arithmetic (x86 SSE: correctly rounded division and square root) is the
  // reference: divide_by_width(a, D) == a / D bit for bit for every D in [2, 256] and every a
  // whose quotient is not subnormal; reciprocal_sqrt_rn(v) == 1 / sqrt(v) for v >= 2^-100.
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  const std::vector<float> in = row_scalar_inputs(rng, size_t(1) << 16);
  const int64_t count = int64_t(in.size());
  constexpr int kWidths = 255;  // D = 2 .. 256
  DeviceBuffer src = DeviceBuffer::from(in);
  DeviceBuffer quotient(size_t(count) * kWidths * sizeof(float));
  DeviceBuffer inv_sqrt(size_t(count) * sizeof(float));
  row_scalar_kernel<<<dim3(unsigned((count + 255) / 256), kWidths), 256>>>(
      static_cast<const float*>(src.data()), count, static_cast<float*>(quotient.data()),
      static_cast<float*>(inv_sqrt.data()));
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  synchronize();
  const std::vector<float> q = quotient.to_host<float>();
  const std::vector<float> r = inv_sqrt.to_host<float>();
  int64_t q_bad = 0, q_checked = 0, r_bad = 0, r_checked = 0;
  for (int w = 0; w < kWidths; ++w) {
    const float width = float(2 + w);
    for (int64_t i = 0; i < count; ++i) {
      const volatile float a = in[size_t(i)];
      const float want = a / width;
      if (std::fpclassify(want) == FP_SUBNORMAL) continue;  // documented exception
      ++q_checked;
      const float got = q[size_t(w * count + i)];
      const bool ok = same_bits_or_nan(got, want);
      if (!ok && q_bad++ < 5) {
        ADD_FAILURE() << "divide_by_width(" << a << " (0x" << std::hex << float_bits(a)
                      << "), " << std::dec << width << ") = " << got << ", IEEE " << want;
      }
    }
  }
  for (int64_t i = 0; i < count; ++i) {
    const volatile float v = in[size_t(i)];
    if (!(v >= 0x1p-100f) && !std::isnan(v)) continue;  // outside the function's domain
    ++r_checked;
    const float want = 1.0f / std::sqrt(float(v));
    const float got = r[size_t(i)];
    const bool ok = same_bits_or_nan(got, want);
    if (!ok && r_bad++ < 5) {
      ADD_FAILURE() << "reciprocal_sqrt_rn(" << v << ") = " << got << ", IEEE " << want;
    }
  }
  EXPECT_EQ(q_bad, 0) << "of " << q_checked;
  EXPECT_EQ(r_bad, 0) << "of " << r_checked;
  std::printf("[numeric] divide_by_width: %lld of %lld mismatches; reciprocal_sqrt_rn: %lld of "
              "%lld\n", (long long)q_bad, (long long)q_checked, (long long)r_bad,
              (long long)r_checked);
}

/// quotient[j * count + i] = PowerOfTwoWidth<2^(j+1)>(in[i]), j = 0 .. 7 (widths 2 .. 256).
template <int kWidth>
__device__ float divide_by_power_of_two(float a) {
  return cuda::PowerOfTwoWidth<kWidth>{}(a);
}

__global__ void power_of_two_width_kernel(const float* in, int64_t count, float* quotient) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const float a = in[i];
  quotient[0 * count + i] = divide_by_power_of_two<2>(a);
  quotient[1 * count + i] = divide_by_power_of_two<4>(a);
  quotient[2 * count + i] = divide_by_power_of_two<8>(a);
  quotient[3 * count + i] = divide_by_power_of_two<16>(a);
  quotient[4 * count + i] = divide_by_power_of_two<32>(a);
  quotient[5 * count + i] = divide_by_power_of_two<64>(a);
  quotient[6 * count + i] = divide_by_power_of_two<128>(a);
  quotient[7 * count + i] = divide_by_power_of_two<256>(a);
}

TEST(CudaNumeric, PowerOfTwoWidthMatchesIeee) {
  // The full-width rope kernels divide their row sums by D = 2^k with one multiplication: the
  // same bits as IEEE a / D for every a, subnormal quotients, zeros, infinities and NaN included.
  QKVF_REQUIRE_GPU();
  auto rng = rng_for_test();
  std::vector<float> in = row_scalar_inputs(rng, size_t(1) << 18);
  for (uint32_t bits = 1; bits < (1u << 16); ++bits) in.push_back(bits_float(bits * 97u));  // subnormals
  for (const float nan : nan_values()) in.push_back(nan);
  const int64_t count = int64_t(in.size());
  DeviceBuffer src = DeviceBuffer::from(in);
  DeviceBuffer quotient(size_t(count) * 8 * sizeof(float));
  power_of_two_width_kernel<<<unsigned((count + 255) / 256), 256>>>(
      static_cast<const float*>(src.data()), count, static_cast<float*>(quotient.data()));
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  synchronize();
  const std::vector<float> q = quotient.to_host<float>();
  int64_t bad = 0, subnormal = 0;
  for (int j = 0; j < 8; ++j) {
    const float width = float(2 << j);
    for (int64_t i = 0; i < count; ++i) {
      const volatile float a = in[size_t(i)];
      const float want = a / width;
      subnormal += std::fpclassify(want) == FP_SUBNORMAL;
      const float got = q[size_t(j * count + i)];
      const bool ok = same_bits_or_nan(got, want);
      if (!ok && bad++ < 5) {
        ADD_FAILURE() << "PowerOfTwoWidth<" << width << ">(" << a << " (0x" << std::hex
                      << float_bits(a) << std::dec << ")) = " << got << ", IEEE " << want;
      }
    }
  }
  EXPECT_EQ(bad, 0) << "of " << 8 * count;
  EXPECT_GT(subnormal, 1000) << "the inputs must reach subnormal quotients";
  std::printf("[numeric] PowerOfTwoWidth: %lld of %lld mismatches (%lld subnormal quotients)\n",
              (long long)bad, (long long)(8 * count), (long long)subnormal);
}

}  // namespace
}  // namespace qkvfuse::test
