// test_tensor.cpp: the TensorView helpers of tensor.hpp.
#include <gtest/gtest.h>

#include <cstdint>

#include "qkvfuse/error.hpp"
#include "qkvfuse/tensor.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace qkvfuse::test {
namespace {

TEST(Tensor, DtypeNamesAndSizes) {
  EXPECT_STREQ(dtype_name(DType::kBFloat16), "bfloat16");
  EXPECT_STREQ(dtype_name(DType::kFloat32), "float32");
  EXPECT_STREQ(dtype_name(DType::kFloat64), "float64");
  EXPECT_STREQ(dtype_name(DType::kFloat8E4M3), "float8_e4m3fn");
  EXPECT_STREQ(dtype_name(DType::kInt32), "int32");
  EXPECT_STREQ(dtype_name(DType::kInt64), "int64");
  EXPECT_EQ(dtype_size(DType::kBFloat16), 2u);
  EXPECT_EQ(dtype_size(DType::kFloat32), 4u);
  EXPECT_EQ(dtype_size(DType::kFloat64), 8u);
  EXPECT_EQ(dtype_size(DType::kFloat8E4M3), 1u);
  EXPECT_EQ(dtype_size(DType::kInt32), 4u);
  EXPECT_EQ(dtype_size(DType::kInt64), 8u);
  EXPECT_THROW(dtype_size(static_cast<DType>(42)), Error);
}

TEST(Tensor, DeviceNamesAndEquality) {
  EXPECT_EQ(device_name(kCPU), "cpu");
  EXPECT_EQ(device_name(Device{DeviceType::kCUDA, 3}), "cuda:3");
  EXPECT_TRUE((Device{DeviceType::kCUDA, 1} == Device{DeviceType::kCUDA, 1}));
  EXPECT_TRUE((Device{DeviceType::kCUDA, 0} != Device{DeviceType::kCUDA, 1}));
  EXPECT_TRUE((kCPU != Device{DeviceType::kCUDA, 0}));
}

TEST(Tensor, MakeViewDefaultsToRowMajorStrides) {
  float data[24];
  const TensorView view = make_view(data, DType::kFloat32, kCPU, {2, 3, 4});
  EXPECT_EQ(view.data, data);
  EXPECT_EQ(view.ndim, 3);
  EXPECT_EQ(view.size(0), 2);
  EXPECT_EQ(view.size(2), 4);
  EXPECT_EQ(view.stride(0), 12);
  EXPECT_EQ(view.stride(1), 4);
  EXPECT_EQ(view.stride(2), 1);
  EXPECT_EQ(view.numel(), 24);
  EXPECT_TRUE(view.is_contiguous());
  EXPECT_FALSE(is_absent(view));
}

TEST(Tensor, ExplicitStridesAndContiguity) {
  uint16_t data[64];
  // A column slice of a [4, 16] buffer: rows padded, so not contiguous.
  const TensorView slice = make_view(data, DType::kBFloat16, kCPU, {4, 2, 3}, {16, 3, 1});
  EXPECT_EQ(slice.numel(), 24);
  EXPECT_FALSE(slice.is_contiguous());
  // A size-1 dimension's stride does not matter for contiguity.
  EXPECT_TRUE(make_view(data, DType::kBFloat16, kCPU, {1, 5}, {999, 1}).is_contiguous());
  EXPECT_FALSE(make_view(data, DType::kBFloat16, kCPU, {5, 2}, {1, 5}).is_contiguous());
  // A scalar and an empty tensor.
  const TensorView scalar = make_view(data, DType::kFloat32, kCPU, {});
  EXPECT_EQ(scalar.ndim, 0);
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_TRUE(scalar.is_contiguous());
  EXPECT_EQ(make_view(nullptr, DType::kFloat32, kCPU, {0, 7}).numel(), 0);
}

TEST(Tensor, DescribeNamesDtypeShapeStridesDevice) {
  uint16_t data[8];
  const TensorView view =
      make_view(data, DType::kBFloat16, Device{DeviceType::kCUDA, 0}, {2, 4}, {8, 1});
  EXPECT_EQ(view.describe(), "bfloat16[2, 4] strides [8, 1] on cuda:0");
  EXPECT_EQ(make_view(data, DType::kFloat32, kCPU, {}).describe(), "float32[] strides [] on cpu");
}

TEST(Tensor, MakeViewRejectsBadArguments) {
  float data[4];
  EXPECT_TRUE(throws_error(
      [&] {
        make_view(data, DType::kFloat32, kCPU, {1, 1, 1, 1, 1});
      },
      {"make_view", "at most 4 dims"}));
  EXPECT_TRUE(throws_error(
      [&] {
        make_view(data, DType::kFloat32, kCPU, {2, 2}, {2});
      },
      {"make_view", "strides"}));
  EXPECT_TRUE(throws_error(
      [&] {
        make_view(data, DType::kFloat32, kCPU, {2, -1});
      },
      {"make_view", ">= 0"}));
}

TEST(Tensor, AbsentMeansNoDataAndNoDims) {
  EXPECT_TRUE(is_absent(TensorView{}));
  float value = 0;
  EXPECT_FALSE(is_absent(make_view(&value, DType::kFloat32, kCPU, {})));
  EXPECT_FALSE(is_absent(make_view(nullptr, DType::kFloat32, kCPU, {0})));
}

TEST(Tensor, ErrorsCarryTheSourceLocation) {
  EXPECT_TRUE(throws_error([] { QKVF_CHECK(1 + 1 == 3, "arithmetic: expected ", 3, ", got ", 2); },
                           {"arithmetic: expected 3, got 2 [", "test_tensor.cpp:"}));
}

}  // namespace
}  // namespace qkvfuse::test
