// test_cpu_fp8_gemm.cpp: the CPU FP8 GEMM against the float64 reference.
//
// Tolerance: each output within one bf16 ulp of the exact product rounded to bf16. The backend's
// sum is exact; its two fp32 steps (the sum narrowed to fp32, the scale multiply) may then push a
// value across a bf16 rounding boundary, which is the one-ulp allowance, and the 2^-22 relative
// slack covers a value that sits on a boundary within those fp32 roundings.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "qkvfuse/fp8_gemm.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace qkvfuse::test {
namespace {

struct GemmCase {
  int64_t m, n, k;
  int64_t row_padding = 0;  ///< extra elements per row of a, b and d
  float scale_a = 1.0f;
  float scale_b = 1.0f;
  float alpha = 1.0f;
  bool with_alpha = false;
};

std::vector<double> relative_slack(const std::vector<double>& ref) {
  std::vector<double> slack(ref.size());
  for (size_t i = 0; i < ref.size(); ++i) slack[i] = std::ldexp(std::fabs(ref[i]), -22);
  return slack;
}

/// Runs one GEMM on fresh random operands; returns d's bits after checking it.
std::vector<uint16_t> check_gemm(const GemmCase& c) {
  SCOPED_TRACE(::testing::Message() << "M=" << c.m << " N=" << c.n << " K=" << c.k << " padding "
                                    << c.row_padding << " alpha " << (c.with_alpha ? "yes" : "no"));
  auto rng = rng_for_test();
  const std::vector<uint8_t> a = random_e4m3(rng, size_t(c.m * c.k));
  const std::vector<uint8_t> b = random_e4m3(rng, size_t(c.n * c.k));
  HostTensor a_t(DType::kFloat8E4M3, {c.m, c.k}, {c.k + c.row_padding, 1});
  HostTensor b_t(DType::kFloat8E4M3, {c.n, c.k}, {c.k + c.row_padding, 1});
  HostTensor d_t(DType::kBFloat16, {c.m, c.n}, {c.n + c.row_padding, 1});
  HostTensor scale_a(DType::kFloat32, {}), scale_b(DType::kFloat32, {1}),
      alpha(DType::kFloat32, {});
  a_t.set_codes(a);
  b_t.set_codes(b);
  scale_a.set({c.scale_a});
  scale_b.set({c.scale_b});
  alpha.set({c.alpha});
  Fp8GemmParams params{a_t.view(),
                       b_t.view(),
                       scale_a.view(),
                       scale_b.view(),
                       c.with_alpha ? alpha.view() : TensorView{},
                       d_t.view()};
  fp8_gemm(params);

  const double scale = double(c.scale_a) * c.scale_b * (c.with_alpha ? c.alpha : 1.0f);
  const std::vector<double> expected = ref::gemm(a, b, c.m, c.n, c.k, scale);
  EXPECT_TRUE(passes(compare_bf16("d", d_t.get_bf16_bits(), expected, relative_slack(expected))));
  EXPECT_EQ(d_t.padding_touched(), 0) << "d's row padding was written";
  return d_t.get_bf16_bits();
}

TEST(CpuFp8Gemm, MatchesReferenceAcrossShapes) {
  const GemmCase cases[] = {
      {1, 1, 1},
      {3, 5, 7, 0, 0.5f, 2.0f},
      {17, 33, 64, 3, 8.0f / 448, 0.013f, 0.91f, true},
      {16, 16, 16, 16, 1.0f, 1.0f, 3.0f, true},
      {64, 48, 768, 0, 8.0f / 448, 0.02f / 448, 0.83f, true},  // the model's K = C
      {40, 24, 64, 8, 1.0f / 448, 8.0f / 448},                 // wgrad-like: K = T
  };
  for (const GemmCase& c : cases) check_gemm(c);
}

TEST(CpuFp8Gemm, AlphaIsAThirdScale) {
  GemmCase with{9, 11, 32, 0, 0.5f, 0.25f, 0.37f, true};
  GemmCase folded{9, 11, 32, 0, 0.5f * 0.37f, 0.25f};
  // Same operands (same test, same seed): alpha must act exactly like a folded scale_a when the
  // fold is exact in fp32 (0.5 is a power of two).
  const std::vector<uint16_t> a = check_gemm(with);
  const std::vector<uint16_t> b = check_gemm(folded);
  EXPECT_EQ(a, b);
}

TEST(CpuFp8Gemm, EmptyReductionWritesZeros) {
  HostTensor a(DType::kFloat8E4M3, {4, 0}), b(DType::kFloat8E4M3, {3, 0});
  HostTensor d(DType::kBFloat16, {4, 3});
  HostTensor scale(DType::kFloat32, {});
  scale.set({2.0});
  fp8_gemm({a.view(), b.view(), scale.view(), scale.view(), TensorView{}, d.view()});
  for (double v : d.get()) EXPECT_EQ(v, 0.0);
}

TEST(CpuFp8Gemm, IsBitwiseDeterministic) {
  const GemmCase c{33, 65, 96, 0, 8.0f / 448, 0.011f, 0.9f, true};
  EXPECT_EQ(check_gemm(c), check_gemm(c));
}

}  // namespace
}  // namespace qkvfuse::test
