// test_rope_paths.cpp: which CUDA kernels a rope call goes to (src/cuda/rope_paths.hpp). Host
// code only, so it runs everywhere: the views carry made-up device addresses and are never read.
// The GPU tests check both paths' results; this pins the choice between them.
#include <gtest/gtest.h>

#include <cstdint>

#include "cuda/rope_paths.hpp"
#include "qkvfuse/tensor.hpp"

namespace qkvfuse::test {
namespace {

const Device kGpu{DeviceType::kCUDA, 0};
constexpr uintptr_t kBase = uintptr_t(1) << 32;  // 256-byte aligned, like a fresh allocation

void* at(uintptr_t byte_offset) { return reinterpret_cast<void*>(kBase + byte_offset); }

/// The model's layer: qk the Q/K columns of the packed [T, qkv_dim] GEMM output, the tables
/// [T, D] bf16, the outputs and gradients contiguous, each at its own aligned address.
struct Call {
  int64_t tokens = 64, heads = 6, dim = 128, v_dim = 128;
  int64_t qk_offset = 0;       ///< bytes added to qk's pointer
  int64_t qk_row_pad = 0;      ///< elements added to qk's token stride
  int64_t grad_row_offset = 0;
  int64_t grad_t_offset = 0;
  DType factor_dtype = DType::kBFloat16;
  int64_t factor_row_pad = 0;

  int64_t qkv_dim() const { return 2 * heads * dim + heads * v_dim; }
  TensorView qk() const {
    return make_view(at(uintptr_t(qk_offset)), DType::kBFloat16, kGpu, {tokens, 2 * heads, dim},
                     {qkv_dim() + qk_row_pad, dim, 1});
  }
  TensorView factor(int which) const {
    return make_view(at(uintptr_t(1 + which) << 28), factor_dtype, kGpu, {tokens, dim},
                     {dim + factor_row_pad, 1});
  }
  TensorView rows(int which) const {  // q, k, grad_q, grad_k
    return make_view(at(uintptr_t(3 + which) << 28), DType::kBFloat16, kGpu, {tokens, heads, dim});
  }
  QkNormRopeParams forward() const {
    return {qk(), factor(0), factor(1), rows(0), rows(1), {heads, dim, false, false}};
  }
  QkNormRopeBackwardParams backward() const {
    QkNormRopeBackwardParams p;
    p.grad_q = rows(2);
    p.grad_k = rows(3);
    p.qk = qk();
    p.factor1 = factor(0);
    p.factor2 = factor(1);
    p.grad_qk = make_view(at(uintptr_t(7) << 28), DType::kBFloat16, kGpu, {tokens, 2 * heads, dim});
    p.layout = {heads, dim, false, false};
    return p;
  }
  QkvBackwardFp8Params fp8() const {
    QkvBackwardFp8Params p;
    p.grad_q = rows(2);
    p.grad_k = rows(3);
    p.grad_v = make_view(at(uintptr_t(8) << 28), DType::kBFloat16, kGpu, {tokens, heads, v_dim});
    p.qk = qk();
    p.factor1 = factor(0);
    p.factor2 = factor(1);
    p.grad_scale = make_view(at(uintptr_t(9) << 28), DType::kFloat32, kGpu, {});
    p.grad_row = make_view(at((uintptr_t(10) << 28) + uintptr_t(grad_row_offset)),
                           DType::kFloat8E4M3, kGpu, {tokens, qkv_dim()});
    p.grad_t = make_view(at((uintptr_t(11) << 28) + uintptr_t(grad_t_offset)), DType::kFloat8E4M3,
                         kGpu, {qkv_dim(), tokens});
    p.layout = {heads, dim, false, false};
    return p;
  }
};

bool all_vector(const Call& c) {
  return cuda::rope::vector_path(c.forward()) && cuda::rope::vector_path(c.backward()) &&
         cuda::rope::vector_path(c.fp8());
}
bool none_vector(const Call& c) {
  return !cuda::rope::vector_path(c.forward()) && !cuda::rope::vector_path(c.backward()) &&
         !cuda::rope::vector_path(c.fp8());
}

TEST(RopePaths, ModelShapesTakeTheVectorKernels) {
  for (const int64_t dim : {32, 64, 96, 128, 256}) {
    Call c;
    c.dim = dim;
    EXPECT_TRUE(all_vector(c)) << "D = " << dim;
  }
  Call fp32;
  fp32.factor_dtype = DType::kFloat32;
  EXPECT_TRUE(all_vector(fp32));
  Call odd_tokens;  // grad_t rows of 17 bytes: the vector kernel stores them byte by byte
  odd_tokens.tokens = 17;
  EXPECT_TRUE(all_vector(odd_tokens));
}

TEST(RopePaths, WidthsOffTheVectorGeometriesTakeTheElementPairKernels) {
  for (const int64_t dim : {2, 8, 24, 34, 100, 254}) {
    Call c;
    c.dim = dim;
    EXPECT_TRUE(none_vector(c)) << "D = " << dim;
  }
}

TEST(RopePaths, MisalignedRowsTakeTheElementPairKernels) {
  Call pointer;  // one bf16 element off a 16-byte boundary
  pointer.qk_offset = 2;
  EXPECT_TRUE(none_vector(pointer));
  Call stride;  // token stride 16-byte aligned no more
  stride.qk_row_pad = 3;
  EXPECT_TRUE(none_vector(stride));
  Call factors;  // fp32 table rows of 130 elements: 520 bytes
  factors.factor_dtype = DType::kFloat32;
  factors.factor_row_pad = 2;
  EXPECT_TRUE(none_vector(factors));
  Call one_token;  // a size-1 dim's stride is never used: it does not count
  one_token.tokens = 1;
  one_token.qk_row_pad = 3;
  EXPECT_TRUE(all_vector(one_token));
}

TEST(RopePaths, Fp8BackwardAlsoNeedsVectorVWidthAndAlignedOutputs) {
  for (const int64_t v_dim : {1, 7, 130, 264, 512}) {
    Call c;
    c.v_dim = v_dim;
    c.qk_row_pad = (8 - c.qkv_dim() % 8) % 8;  // keep qk's rows 16-byte aligned
    EXPECT_FALSE(cuda::rope::vector_path(c.fp8())) << "Dv = " << v_dim;
    EXPECT_TRUE(cuda::rope::vector_path(c.forward())) << "Dv = " << v_dim;
  }
  for (const int64_t v_dim : {8, 64, 256}) {
    Call c;
    c.v_dim = v_dim;
    EXPECT_TRUE(cuda::rope::vector_path(c.fp8())) << "Dv = " << v_dim;
  }
  Call row;
  row.grad_row_offset = 8;
  EXPECT_FALSE(cuda::rope::vector_path(row.fp8()));
  Call transposed;
  transposed.grad_t_offset = 1;
  EXPECT_FALSE(cuda::rope::vector_path(transposed.fp8()));
}

}  // namespace
}  // namespace qkvfuse::test
