// test_cpu_quantize.cpp: the CPU dual-layout quantize (SPEC.md section 5) against the float64
// reference: codes bit-exact in both layouts, amax exact.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "qkvfuse/quantize.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace qkvfuse::test {
namespace {

/// Random bf16 values spread so that src / scale covers the whole e4m3 range, subnormals and
/// saturation included, plus zeros of both signs and infinities at random places.
std::vector<double> spread_values(std::mt19937_64& rng, size_t count, bool with_infinities) {
  std::vector<double> values = random_values(rng, count, DType::kBFloat16);
  std::uniform_int_distribution<int> exponent(-16, 10);
  std::uniform_int_distribution<int> special(0, 63);
  for (double& v : values) {
    v = ref::round_bf16(v * std::ldexp(1.0, exponent(rng)));
    switch (special(rng)) {
      case 0: v = 0.0; break;
      case 1: v = -0.0; break;
      case 2:
        if (with_infinities) v = std::copysign(INFINITY, v);
        break;
      default: break;
    }
  }
  return values;
}

/// The reference codes of every entry of a [B, M, N] source with per-entry scales, in both
/// layouts, concatenated like the op's outputs.
ref::Quantized reference_codes(const std::vector<double>& src, int64_t batch, int64_t rows,
                               int64_t cols, const std::vector<float>& scales) {
  ref::Quantized all;
  const size_t entry = size_t(rows * cols);
  for (int64_t b = 0; b < batch; ++b) {
    const std::vector<double> part(src.begin() + b * entry, src.begin() + (b + 1) * entry);
    const ref::Quantized q = ref::quantize(part, rows, cols, scales[size_t(b)]);
    all.row.insert(all.row.end(), q.row.begin(), q.row.end());
    all.t.insert(all.t.end(), q.t.begin(), q.t.end());
  }
  return all;
}

/// Reference amax of every entry.
std::vector<double> reference_amax(const std::vector<double>& src, int64_t batch, size_t entry) {
  std::vector<double> out;
  for (int64_t b = 0; b < batch; ++b) {
    out.push_back(ref::amax({src.begin() + b * entry, src.begin() + (b + 1) * entry}));
  }
  return out;
}

/// NaN-aware exact equality of amax values.
void expect_same_amax(const std::vector<double>& got, const std::vector<double>& expected) {
  ASSERT_EQ(got.size(), expected.size());
  for (size_t b = 0; b < got.size(); ++b) {
    if (std::isnan(expected[b])) {
      EXPECT_TRUE(std::isnan(got[b])) << "entry " << b;
    } else {
      EXPECT_EQ(got[b], expected[b]) << "entry " << b;
    }
  }
}

TEST(CpuQuantize, PlainIsBitExactInBothLayouts) {
  auto rng = rng_for_test();
  const struct {
    int64_t rows, cols, row_padding;
  } shapes[] = {{1, 1, 0}, {3, 17, 0}, {17, 3, 5}, {64, 768, 0}, {33, 100, 28}, {768, 64, 16}};
  for (const auto& shape : shapes) {
    for (float scale : {8.0f / 448, 1.0f, 0.37f}) {
      SCOPED_TRACE(::testing::Message() << shape.rows << " x " << shape.cols << " padding "
                                        << shape.row_padding << " scale " << scale);
      const std::vector<double> src = spread_values(rng, size_t(shape.rows * shape.cols), true);
      HostTensor src_t(DType::kBFloat16, {shape.rows, shape.cols},
                       {shape.cols + shape.row_padding, 1});
      src_t.set(src);
      HostTensor scale_t(DType::kFloat32, {});
      scale_t.set({scale});
      HostTensor row(DType::kFloat8E4M3, {shape.rows, shape.cols});
      HostTensor t(DType::kFloat8E4M3, {shape.cols, shape.rows});
      HostTensor amax(DType::kFloat32, {1});
      quantize_dual_layout({src_t.view(), scale_t.view(), row.view(), t.view(), amax.view()});

      const ref::Quantized expected = ref::quantize(src, shape.rows, shape.cols, scale);
      EXPECT_EQ(row.get_codes(), expected.row);
      EXPECT_EQ(t.get_codes(), expected.t);
      expect_same_amax(amax.get(), {ref::amax(src)});
    }
  }
}

TEST(CpuQuantize, ScaleIsATrueFp32Division) {
  for (float scale : {7.0f, 1.75f}) {
    const std::vector<double> src = e4m3_tie_inputs(scale);
    ASSERT_GE(src.size(), 64u) << "too few tie inputs for scale " << scale;
    const int64_t cols = int64_t(src.size());
    HostTensor src_t(DType::kBFloat16, {1, cols});
    src_t.set(src);
    HostTensor scale_t(DType::kFloat32, {});
    scale_t.set({scale});
    HostTensor row(DType::kFloat8E4M3, {1, cols});
    HostTensor t(DType::kFloat8E4M3, {cols, 1});
    quantize_dual_layout({src_t.view(), scale_t.view(), row.view(), t.view(), TensorView{}});
    const ref::Quantized expected = ref::quantize(src, 1, cols, scale);
    EXPECT_EQ(row.get_codes(), expected.row) << "scale " << scale;
    EXPECT_EQ(t.get_codes(), expected.t) << "scale " << scale;
  }
}

TEST(CpuQuantize, AmaxIsOptionalAndScalarShapesAreAccepted) {
  auto rng = rng_for_test();
  const std::vector<double> src = spread_values(rng, 5 * 9, false);
  HostTensor src_t(DType::kBFloat16, {5, 9});
  src_t.set(src);
  HostTensor scale_t(DType::kFloat32, {1});
  scale_t.set({0.25});
  HostTensor row(DType::kFloat8E4M3, {5, 9});
  HostTensor t(DType::kFloat8E4M3, {9, 5});
  quantize_dual_layout({src_t.view(), scale_t.view(), row.view(), t.view(), TensorView{}});
  const ref::Quantized expected = ref::quantize(src, 5, 9, 0.25f);
  EXPECT_EQ(row.get_codes(), expected.row);
  EXPECT_EQ(t.get_codes(), expected.t);

  HostTensor amax(DType::kFloat32, {});
  quantize_dual_layout({src_t.view(), scale_t.view(), row.view(), t.view(), amax.view()});
  expect_same_amax(amax.get(), {ref::amax(src)});
}

TEST(CpuQuantize, AmaxPropagatesNaNAndCountsInfinity) {
  std::vector<double> src = {1.0, -3.0, 2.0, 0.5};
  HostTensor src_t(DType::kBFloat16, {2, 2});
  HostTensor scale_t(DType::kFloat32, {});
  scale_t.set({1.0});
  HostTensor row(DType::kFloat8E4M3, {2, 2});
  HostTensor t(DType::kFloat8E4M3, {2, 2});
  HostTensor amax(DType::kFloat32, {});
  const auto run = [&] {
    src_t.set(src);
    quantize_dual_layout({src_t.view(), scale_t.view(), row.view(), t.view(), amax.view()});
    return amax.get()[0];
  };
  EXPECT_EQ(run(), 3.0);
  src[3] = -INFINITY;
  EXPECT_EQ(run(), INFINITY);
  EXPECT_EQ(row.get_codes()[3], 0xfe) << "-inf saturates to -448";
  src[1] = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(std::isnan(run()));
  EXPECT_EQ(row.get_codes()[1], 0x7f) << "NaN quantizes to NaN";
}

TEST(CpuQuantize, BatchedUsesOneScalePerEntry) {
  auto rng = rng_for_test();
  const int64_t batch = 4, rows = 33, cols = 20;
  const size_t entry = size_t(rows * cols);
  std::vector<double> src = spread_values(rng, size_t(batch) * entry, true);
  src[2 * entry + 7] = std::numeric_limits<double>::quiet_NaN();  // entry 2's amax only
  const std::vector<float> scales = {8.0f / 448, 1.0f, 0.37f, 1e-3f};
  // src is a padded [B, M, N] view: batch and row strides larger than dense.
  HostTensor src_t(DType::kBFloat16, {batch, rows, cols}, {rows * (cols + 3) + 11, cols + 3, 1});
  src_t.set(src);
  HostTensor scale_t(DType::kFloat32, {batch});
  scale_t.set({scales.begin(), scales.end()});
  HostTensor row(DType::kFloat8E4M3, {batch, rows, cols});
  HostTensor t(DType::kFloat8E4M3, {batch, cols, rows});
  HostTensor amax(DType::kFloat32, {batch});
  quantize_dual_layout({src_t.view(), scale_t.view(), row.view(), t.view(), amax.view()});

  const ref::Quantized expected = reference_codes(src, batch, rows, cols, scales);
  EXPECT_EQ(row.get_codes(), expected.row);
  EXPECT_EQ(t.get_codes(), expected.t);
  expect_same_amax(amax.get(), reference_amax(src, batch, entry));
}

TEST(CpuQuantize, WeightBankDerivesScalesFromAmax) {
  auto rng = rng_for_test();
  // The model's packed [Wq; Wk; Wv] cache at C = 768 (H = 6, D = 128, Dv = 128), three layers,
  // plus an all-zero layer whose scale must be 1.
  const int64_t batch = 4, rows = 2304, cols = 768;
  const size_t entry = size_t(rows * cols);
  std::vector<double> src = random_values(rng, size_t(batch) * entry, DType::kBFloat16, 0.02);
  std::fill(src.begin() + 3 * entry, src.end(), 0.0);
  HostTensor src_t(DType::kBFloat16, {batch, rows, cols});
  src_t.set(src);
  HostTensor scale(DType::kFloat32, {batch});
  HostTensor row(DType::kFloat8E4M3, {batch, rows, cols});
  HostTensor t(DType::kFloat8E4M3, {batch, cols, rows});
  quantize_weight_bank({src_t.view(), scale.view(), row.view(), t.view()});

  std::vector<float> expected_scales;
  for (double amax : reference_amax(src, batch, entry)) {
    expected_scales.push_back(amax == 0 ? 1.0f : float(amax) / 448.0f);  // an fp32 division
  }
  const std::vector<double> got_scales = scale.get();
  for (int64_t b = 0; b < batch; ++b) EXPECT_EQ(got_scales[size_t(b)], expected_scales[size_t(b)]);
  EXPECT_EQ(got_scales[3], 1.0);
  const ref::Quantized expected = reference_codes(src, batch, rows, cols, expected_scales);
  EXPECT_EQ(row.get_codes(), expected.row);
  EXPECT_EQ(t.get_codes(), expected.t);
}

}  // namespace
}  // namespace qkvfuse::test
