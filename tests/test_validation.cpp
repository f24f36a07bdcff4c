// test_validation.cpp: every public op refuses each class of bad argument with a qkvfuse::Error
// that names the op and the argument, treats empty work as a no-op that writes nothing, and
// never writes anything when it refuses.
//
// Each test starts from a valid call (checked to succeed) and breaks one thing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "qkvfuse/qkvfuse.hpp"
#include "reference.hpp"
#include "test_util.hpp"
#include "validate.hpp"

namespace qkvfuse::test {
namespace {

constexpr Device kCuda0{DeviceType::kCUDA, 0};

TensorView with_strides(TensorView view, std::initializer_list<int64_t> strides) {
  int d = 0;
  for (int64_t stride : strides) view.strides[d++] = stride;
  return view;
}

TensorView on_device(TensorView view, Device device) {
  view.device = device;
  return view;
}

/// A view of `sizes` (row-major) over another view's memory: aliasing on purpose.
TensorView alias(const TensorView& memory, DType dtype, std::initializer_list<int64_t> sizes) {
  return make_view(memory.data, dtype, memory.device, sizes);
}

/// True when every element of the tensor's buffer still holds the exact poison bytes (a NaN that
/// an op wrote would not do).
bool untouched(const HostTensor& tensor) { return tensor.elements_touched() == 0; }

// ---- the rope ops and the fused FP8 backward ---------------------------------------------------

/// Valid arguments for qk_norm_rope, its backward and qkv_backward_fp8 (T=4, H=2, D=32, Dv=16).
struct RopeArgs {
  static constexpr int64_t T = 4, H = 2, D = 32, Dv = 16, kQkvDim = 2 * H * D + H * Dv;
  HostTensor qk{DType::kBFloat16, {T, 2 * H, D}};
  HostTensor factor1{DType::kBFloat16, {T, D}};
  HostTensor factor2{DType::kBFloat16, {T, D}};
  HostTensor q{DType::kBFloat16, {T, H, D}};
  HostTensor k{DType::kBFloat16, {T, H, D}};
  HostTensor grad_q{DType::kBFloat16, {T, H, D}};
  HostTensor grad_k{DType::kBFloat16, {T, H, D}};
  HostTensor grad_qk{DType::kBFloat16, {T, 2 * H, D}};
  HostTensor grad_v{DType::kBFloat16, {T, H, Dv}};
  HostTensor grad_scale{DType::kFloat32, {}};
  HostTensor grad_row{DType::kFloat8E4M3, {T, kQkvDim}};
  HostTensor grad_t{DType::kFloat8E4M3, {kQkvDim, T}};

  RopeArgs() {
    for (HostTensor* input : {&qk, &factor1, &grad_q, &grad_k, &grad_v, &grad_scale}) {
      input->set(std::vector<double>(size_t(input->numel()), 1.0));
    }
    factor2.set(std::vector<double>(size_t(factor2.numel()), 0.0));
  }
  RopeLayout layout() { return tables_layout(H, D, false, false, factor1.view(), factor2.view()); }
  QkNormRopeParams forward() { return {qk.view(), q.view(), k.view(), layout()}; }
  QkNormRopeBackwardParams backward() {
    return {.grad_q = grad_q.view(),
            .grad_k = grad_k.view(),
            .qk = qk.view(),
            .grad_qk = grad_qk.view(),
            .layout = layout()};
  }
  QkvBackwardFp8Params fp8() {
    return {.grad_q = grad_q.view(),
            .grad_k = grad_k.view(),
            .grad_v = grad_v.view(),
            .qk = qk.view(),
            .grad_scale = grad_scale.view(),
            .grad_row = grad_row.view(),
            .grad_t = grad_t.view(),
            .layout = layout()};
  }
};

TEST(Validation, ValidRopeCallsSucceed) {
  RopeArgs args;
  EXPECT_NO_THROW(qk_norm_rope(args.forward()));
  EXPECT_NO_THROW(qk_norm_rope_backward(args.backward()));
  EXPECT_NO_THROW(qkv_backward_fp8(args.fp8()));
}

TEST(Validation, QkNormRopeWrongDtype) {
  RopeArgs args;
  auto p = args.forward();
  p.qk.dtype = DType::kFloat8E4M3;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); }, {"qk_norm_rope: qk: expected dtype"}));
  p = args.forward();
  p.q.dtype = DType::kFloat32;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); }, {"q: expected dtype bfloat16", "float32"}));
  p = args.forward();
  p.layout.factor1.dtype = DType::kFloat8E4M3;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); }, {"factor1: expected dtype"}));
  p = args.forward();
  p.layout.factor2.dtype = DType::kFloat32;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); }, {"factor2: expected dtype bfloat16"}));
}

// float16 and float8_e5m2 have DType tags (so that the PyTorch binding can hand them in) but no op
// takes them: each is refused by the argument's own check, listing what that argument takes.
TEST(Validation, DtypesNoOpTakesAreRefusedPerArgument) {
  RopeArgs args;
  auto p = args.forward();
  p.qk.dtype = DType::kFloat16;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); },
                           {"qk_norm_rope: qk: expected dtype bfloat16, float32 or float64, got "
                            "float16 ["}));
  p = args.forward();
  p.layout.factor1.dtype = DType::kFloat16;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); },
                           {"qk_norm_rope: layout.factor1: expected dtype bfloat16 or float32, "
                            "got float16 ["}));
  auto f = args.fp8();
  f.grad_row.dtype = DType::kFloat8E5M2;
  EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(f); },
                           {"qkv_backward_fp8: grad_row: expected dtype float8_e4m3fn, got "
                            "float8_e5m2 ["}));
}

// what() is the message and the location; the PyTorch binding reads the parts apart.
TEST(Validation, ErrorKeepsMessageAndLocationApart) {
  RopeArgs args;
  auto p = args.forward();
  p.layout.num_heads = 3;
  try {
    qk_norm_rope(p);
    FAIL() << "did not throw";
  } catch (const Error& error) {
    EXPECT_EQ(error.message().rfind("qk_norm_rope: qk: expected shape [T, 6, 32]", 0), 0u)
        << error.message();
    EXPECT_NE(std::string(error.file()).find("validate.cpp"), std::string::npos) << error.file();
    EXPECT_GT(error.line(), 0);
    EXPECT_EQ(std::string(error.what()), error.message() + " [" + error.file() + ":" +
                                             std::to_string(error.line()) + "]");
  }
  const Error bare("no location");
  EXPECT_STREQ(bare.what(), "no location");
  EXPECT_STREQ(bare.file(), "");
}

TEST(Validation, QkNormRopeWrongHeadCountAndShapes) {
  RopeArgs args;
  auto p = args.forward();
  p.layout.num_heads = 3;  // qk holds 4 heads, the layout says 6
  EXPECT_TRUE(
      throws_error([&] { qk_norm_rope(p); },
                   {"qk: expected shape [T, 6, 32] (num_heads + num_kv_heads = 6 heads), got [4, 4, 32]"}));
  p = args.forward();
  p.qk.ndim = 2;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); }, {"qk: expected 3 dims"}));
  p = args.forward();
  p.layout.factor1.sizes[0] = 3;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); }, {"factor1: expected shape [4, 32]"}));
  p = args.forward();
  p.layout.paired = true;  // paired factors are [T, 2D]
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); }, {"factor1: expected shape [4, 64]", "2*D"}));
  p = args.forward();
  p.k.sizes[1] = 1;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); }, {"k: expected shape [4, 2, 32]"}));
}

TEST(Validation, QkNormRopeHeadWidth) {
  // Every backend takes any even D in [2, 512] (CUDA so far [2, 256]: ValidationPending).
  RopeArgs args;
  for (int64_t bad : {0, 1, 33, 255, 511, 514}) {
    const std::string what = "qk: head width D = " + std::to_string(bad);
    auto p = args.forward();
    p.qk.sizes[2] = bad;
    EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); }, {"qk_norm_rope: " + what, "[2, 512]"}));
    auto b = args.backward();
    b.qk.sizes[2] = bad;
    EXPECT_TRUE(throws_error([&] { qk_norm_rope_backward(b); },
                             {"qk_norm_rope_backward: " + what, "[2, 512]"}));
    auto f = args.fp8();
    f.qk.sizes[2] = bad;
    EXPECT_TRUE(
        throws_error([&] { qkv_backward_fp8(f); }, {"qkv_backward_fp8: " + what, "[2, 512]"}));
  }
}

TEST(Validation, RopeOpsRefusePointersOffTheirElements) {
  // Pointers need their elements' alignment (on every device): a bf16 tensor at an odd byte
  // address, a float32 one at 2 bytes past a multiple of 4, is refused by name.
  RopeArgs args;
  const auto off = [](TensorView view, int64_t bytes) {
    view.data = static_cast<char*>(view.data) + bytes;
    return view;
  };
  const std::string not_aligned = "is not aligned to its ";
  auto p = args.forward();
  p.qk = off(p.qk, 1);
  EXPECT_TRUE(
      throws_error([&] { qk_norm_rope(p); }, {"qk_norm_rope: qk: ", not_aligned + "2-byte"}));
  p = args.forward();
  p.layout.factor2 = off(p.layout.factor2, 1);
  EXPECT_TRUE(
      throws_error([&] { qk_norm_rope(p); }, {"qk_norm_rope: layout.factor2: ", not_aligned + "2-byte"}));
  p = args.forward();
  p.q = off(p.q, 1);
  EXPECT_TRUE(
      throws_error([&] { qk_norm_rope(p); }, {"qk_norm_rope: q: ", not_aligned + "2-byte"}));
  HostTensor f32(DType::kFloat32, {RopeArgs::T * RopeArgs::D + 1});
  p = args.forward();
  p.layout.factor1 = p.layout.factor2 =
      make_view(static_cast<char*>(f32.view().data) + 2, DType::kFloat32, kCPU,
                {RopeArgs::T, RopeArgs::D});
  EXPECT_TRUE(
      throws_error([&] { qk_norm_rope(p); }, {"qk_norm_rope: layout.factor1: ", not_aligned + "4-byte"}));

  auto b = args.backward();
  b.grad_q = off(b.grad_q, 1);
  EXPECT_TRUE(throws_error([&] { qk_norm_rope_backward(b); },
                           {"qk_norm_rope_backward: grad_q: ", not_aligned + "2-byte"}));
  b = args.backward();
  b.grad_qk = off(b.grad_qk, 1);
  EXPECT_TRUE(throws_error([&] { qk_norm_rope_backward(b); },
                           {"qk_norm_rope_backward: grad_qk: ", not_aligned + "2-byte"}));

  auto f = args.fp8();
  f.grad_v = off(f.grad_v, 1);
  EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(f); },
                           {"qkv_backward_fp8: grad_v: ", not_aligned + "2-byte"}));
  f = args.fp8();
  f.grad_scale = off(f.grad_scale, 2);
  EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(f); },
                           {"qkv_backward_fp8: grad_scale: ", not_aligned + "4-byte"}));
  for (const HostTensor* out : {&args.q, &args.k, &args.grad_qk, &args.grad_row, &args.grad_t}) {
    EXPECT_TRUE(untouched(*out));
  }
}

TEST(Validation, RopeOpsTakeElementAlignedPointersAndAnyStrides) {
  // The same call with every tensor one element past an aligned address and odd strides gives
  // the same results: only element alignment is asked for.
  constexpr int64_t T = RopeArgs::T, H = RopeArgs::H, D = RopeArgs::D, Dv = 7;
  constexpr int64_t kQkvDim = 2 * H * D + H * Dv;
  auto rng = rng_for_test();
  const std::vector<double> qk_values =
      random_values(rng, size_t(T * 2 * H * D), DType::kBFloat16);
  const std::vector<double> grad_values = random_values(rng, size_t(T * H * D), DType::kBFloat16);
  const std::vector<double> v_values = random_values(rng, size_t(T * H * Dv), DType::kBFloat16);
  std::vector<double> f1, f2;
  rotary_factor_values(rng, T, D, 1, D, false, f1, f2);
  std::vector<uint16_t> q_bits[2], k_bits[2], grad_qk_bits[2];
  std::vector<uint8_t> row_codes[2], t_codes[2];
  for (int odd = 0; odd < 2; ++odd) {
    // odd: each stride `pad` more than packed (the last stays 1); offset 1 element.
    const auto strides = [odd](std::initializer_list<int64_t> sizes, int64_t pad) {
      if (!odd) return std::vector<int64_t>{};  // row-major
      std::vector<int64_t> out(sizes.size(), 1);
      int64_t stride = 1;
      for (size_t d = sizes.size(); d-- > 0;) {
        out[d] = stride;
        stride = stride * *(sizes.begin() + d) + pad;
      }
      return out;
    };
    const int64_t offset = odd;
    HostTensor qk(DType::kBFloat16, {T, 2 * H, D}, strides({T, 2 * H, D}, 3), offset);
    HostTensor factor1(DType::kFloat32, {T, D}, strides({T, D}, 1), offset);
    HostTensor factor2(DType::kFloat32, {T, D}, strides({T, D}, 1), offset);
    HostTensor grad(DType::kBFloat16, {T, H, D}, strides({T, H, D}, 1), offset);
    HostTensor grad_v(DType::kBFloat16, {T, H, Dv}, strides({T, H, Dv}, 1), offset);
    HostTensor scale(DType::kFloat32, {});
    HostTensor q(DType::kBFloat16, {T, H, D}, {}, offset);
    HostTensor k(DType::kBFloat16, {T, H, D}, {}, offset);
    HostTensor grad_qk(DType::kBFloat16, {T, 2 * H, D}, {}, offset);
    HostTensor grad_row(DType::kFloat8E4M3, {T, kQkvDim}, {}, offset);  // an odd byte address
    HostTensor grad_t(DType::kFloat8E4M3, {kQkvDim, T}, {}, offset);
    qk.set(qk_values);
    factor1.set(f1);
    factor2.set(f2);
    grad.set(grad_values);
    grad_v.set(v_values);
    scale.set({1.0 / 448});
    const RopeLayout layout = tables_layout(H, D, false, false, factor1.view(), factor2.view());
    EXPECT_NO_THROW(qk_norm_rope({qk.view(), q.view(), k.view(), layout}));
    EXPECT_NO_THROW(qk_norm_rope_backward({.grad_q = grad.view(),
                                           .grad_k = grad.view(),
                                           .qk = qk.view(),
                                           .grad_qk = grad_qk.view(),
                                           .layout = layout}));
    EXPECT_NO_THROW(qkv_backward_fp8({.grad_q = grad.view(),
                                      .grad_k = grad.view(),
                                      .grad_v = grad_v.view(),
                                      .qk = qk.view(),
                                      .grad_scale = scale.view(),
                                      .grad_row = grad_row.view(),
                                      .grad_t = grad_t.view(),
                                      .layout = layout}));
    q_bits[odd] = q.get_bf16_bits();
    k_bits[odd] = k.get_bf16_bits();
    grad_qk_bits[odd] = grad_qk.get_bf16_bits();
    row_codes[odd] = grad_row.get_codes();
    t_codes[odd] = grad_t.get_codes();
  }
  EXPECT_EQ(q_bits[0], q_bits[1]);
  EXPECT_EQ(k_bits[0], k_bits[1]);
  EXPECT_EQ(grad_qk_bits[0], grad_qk_bits[1]);
  EXPECT_EQ(row_codes[0], row_codes[1]);
  EXPECT_EQ(t_codes[0], t_codes[1]);
}

TEST(Validation, QkNormRopeStrides) {
  RopeArgs args;
  auto p = args.forward();
  p.qk.strides[2] = 2;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); }, {"qk: expected its last dim contiguous"}));
  p = args.forward();
  p.layout.factor2.strides[1] = 2;
  EXPECT_TRUE(
      throws_error([&] { qk_norm_rope(p); }, {"factor2: expected its last dim contiguous"}));
  p = args.forward();
  p.q = with_strides(p.q, {RopeArgs::H * RopeArgs::D + 8, RopeArgs::D, 1});
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); }, {"q: expected a row-major contiguous"}));
  // Token and head strides of qk are free: a column slice of a wider buffer is accepted.
  HostTensor wide(DType::kBFloat16, {RopeArgs::T, 2 * RopeArgs::H, RopeArgs::D},
                  {3 * 2 * RopeArgs::H * RopeArgs::D, RopeArgs::D, 1});
  wide.set(std::vector<double>(size_t(wide.numel()), 1.0));
  p = args.forward();
  p.qk = wide.view();
  EXPECT_NO_THROW(qk_norm_rope(p));
}

TEST(Validation, RopeLayoutFlags) {
  RopeArgs args;
  auto p = args.forward();
  p.layout.key_offset = true;
  for (int64_t bad : {3, 34, -2}) {
    p.layout.rotary_dim = bad;
    EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); },
                             {"layout.rotary_dim: expected ", "an even value in [0, D = 32]",
                              "got " + std::to_string(bad)}));
  }
  // rotary_dim applies to every row now (SPEC.md section 8), so an odd one is refused without
  // the key offset too; -1 (the whole head) and 0 (no rotation) are fine.
  p = args.forward();
  p.layout.rotary_dim = 3;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); },
                           {"qk_norm_rope: layout.rotary_dim: expected an even value", "got 3"}));
  for (int64_t fine : {-1, 0, 2, 32}) {
    p.layout.rotary_dim = fine;
    EXPECT_NO_THROW(qk_norm_rope(p)) << "rotary_dim " << fine;
  }

  p = args.forward();
  p.layout.paired = true;
  p.layout.key_offset = true;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); }, {"layout.paired, layout.key_offset: cannot both be set"}));

  p = args.forward();
  p.layout.num_heads = 0;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); }, {"layout.num_heads: expected >= 1"}));
}

TEST(Validation, PairedNeedsEvenHeads) {
  const int64_t T = 2, H = 3, D = 32;
  HostTensor qk(DType::kBFloat16, {T, 2 * H, D});
  HostTensor f(DType::kBFloat16, {T, 2 * D});
  HostTensor out(DType::kBFloat16, {2 * T, 1, D});
  HostTensor out2(DType::kBFloat16, {2 * T, 1, D});
  EXPECT_TRUE(throws_error(
      [&] {
        qk_norm_rope({qk.view(), out.view(), out2.view(),
                      tables_layout(H, D, true, false, f.view(), f.view())});
      },
      {"layout.paired: needs layout.num_kv_heads = layout.num_heads and an even layout.num_heads, "
       "got 3 and 3"}));
}

TEST(Validation, QkNormRopeOutputAliasing) {
  RopeArgs args;
  auto p = args.forward();
  p.q = alias(p.qk, DType::kBFloat16, {RopeArgs::T, RopeArgs::H, RopeArgs::D});
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); }, {"q: overlaps input qk"}));
  p = args.forward();
  p.k = p.q;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); }, {"q: overlaps output k"}));
  p = args.forward();
  p.k = alias(p.layout.factor2, DType::kBFloat16, {RopeArgs::T, RopeArgs::H, RopeArgs::D});
  p.k.data = static_cast<char*>(p.layout.factor2.data) - 2;  // a partial overlap, one element in
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); }, {"k: overlaps input layout.factor2"}));
}

TEST(Validation, QkNormRopeBackwardChecks) {
  RopeArgs args;
  auto p = args.backward();
  p.grad_q.dtype = DType::kFloat32;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope_backward(p); },
                           {"qk_norm_rope_backward: grad_q: expected dtype bfloat16"}));
  p = args.backward();
  p.grad_k.strides[2] = 3;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope_backward(p); },
                           {"grad_k: expected its last dim contiguous"}));
  p = args.backward();
  p.grad_qk.sizes[1] = 2;
  EXPECT_TRUE(
      throws_error([&] { qk_norm_rope_backward(p); }, {"grad_qk: expected shape [4, 4, 32]"}));
  p = args.backward();
  p.grad_qk = alias(p.grad_q, DType::kBFloat16, {RopeArgs::T, 2 * RopeArgs::H, RopeArgs::D});
  EXPECT_TRUE(throws_error([&] { qk_norm_rope_backward(p); }, {"grad_qk: overlaps input grad_q"}));
  p = args.backward();
  p.layout.num_heads = 1;
  EXPECT_TRUE(
      throws_error([&] { qk_norm_rope_backward(p); }, {"qk: expected shape", "num_heads + num_kv_heads = 2"}));
  p = args.backward();
  p.grad_qk.dtype = DType::kFloat32;  // qk is bf16: the gradient takes qk's dtype
  EXPECT_TRUE(throws_error([&] { qk_norm_rope_backward(p); },
                           {"qk_norm_rope_backward: grad_qk"}));
  p = args.backward();
  p.grad_qk = with_strides(p.grad_qk, {2 * RopeArgs::H * RopeArgs::D + 2, RopeArgs::D, 1});
  p.grad_qk.sizes[0] = RopeArgs::T - 1;  // stays inside the buffer: only the stride is wrong
  p.grad_q.sizes[0] = p.grad_k.sizes[0] = p.qk.sizes[0] = RopeArgs::T - 1;
  p.layout.factor1.sizes[0] = p.layout.factor2.sizes[0] = RopeArgs::T - 1;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope_backward(p); },
                           {"qk_norm_rope_backward: grad_qk: expected a row-major contiguous"}));
}

TEST(Validation, QkvBackwardFp8Checks) {
  RopeArgs args;
  auto p = args.fp8();
  p.grad_scale = alias(p.grad_scale, DType::kFloat32, {2});
  EXPECT_TRUE(
      throws_error([&] { qkv_backward_fp8(p); },
                   {"qkv_backward_fp8: grad_scale: expected a float32 scalar of shape [] or [1]"}));
  p = args.fp8();
  p.grad_scale.dtype = DType::kBFloat16;
  EXPECT_TRUE(
      throws_error([&] { qkv_backward_fp8(p); }, {"grad_scale: expected a float32 scalar"}));
  p = args.fp8();
  p.grad_v.sizes[1] = 3;
  EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(p); }, {"grad_v: expected shape [4, 2, Dv]"}));
  p = args.fp8();
  p.grad_row.sizes[1] = RopeArgs::kQkvDim - 1;
  EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(p); },
                           {"grad_row: expected shape [4, 160] (qkv_dim = (Hq + Hkv)*D + Hkv*Dv = 160)"}));
  p = args.fp8();
  p.grad_t = with_strides(p.grad_t, {RopeArgs::T + 1, 1});
  EXPECT_TRUE(
      throws_error([&] { qkv_backward_fp8(p); }, {"grad_t: expected a row-major contiguous"}));
  p = args.fp8();
  p.grad_t = p.grad_row;
  p.grad_t.sizes[0] = RopeArgs::kQkvDim;
  p.grad_t.sizes[1] = RopeArgs::T;
  p.grad_t.strides[0] = RopeArgs::T;
  EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(p); }, {"grad_row: overlaps output grad_t"}));
  p = args.fp8();
  p.qk.dtype = DType::kFloat32;  // the wide-qk CPU path is for qk_norm_rope only
  EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(p); }, {"qk: expected dtype bfloat16"}));
  p = args.fp8();
  p.layout.factor1.dtype = p.layout.factor2.dtype = DType::kFloat64;
  EXPECT_TRUE(
      throws_error([&] { qkv_backward_fp8(p); }, {"factor1: expected dtype bfloat16 or float32"}));
  p = args.fp8();
  p.grad_v.strides[2] = 2;
  EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(p); },
                           {"qkv_backward_fp8: grad_v: expected its last dim contiguous"}));
  p = args.fp8();
  p.grad_row.dtype = DType::kBFloat16;
  EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(p); },
                           {"qkv_backward_fp8: grad_row: expected dtype float8_e4m3fn"}));
  p = args.fp8();
  p.grad_t.dtype = DType::kFloat32;
  EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(p); },
                           {"qkv_backward_fp8: grad_t: expected dtype float8_e4m3fn"}));
  p = args.fp8();
  p.grad_t.sizes[1] = RopeArgs::T - 1;
  EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(p); },
                           {"qkv_backward_fp8: grad_t: expected shape"}));
  p = args.fp8();
  p.grad_row = with_strides(p.grad_row, {RopeArgs::kQkvDim + 1, 1});
  EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(p); },
                           {"qkv_backward_fp8: grad_row: expected a row-major contiguous"}));
}

TEST(Validation, QkvBackwardFp8VWidth) {
  // Any Dv >= 1 on the CPU (CUDA stops at 512: test_cuda_qkv_backward_fp8.cpp); Dv = 0 is
  // refused by name.
  constexpr int64_t T = RopeArgs::T, H = RopeArgs::H, D = RopeArgs::D;
  for (int64_t v_dim : {0, 1, 7, 513, 600}) {
    RopeArgs args;
    const int64_t qkv_dim = 2 * H * D + H * v_dim;
    HostTensor grad_v(DType::kBFloat16, {T, H, v_dim});
    HostTensor grad_row(DType::kFloat8E4M3, {T, qkv_dim});
    HostTensor grad_t(DType::kFloat8E4M3, {qkv_dim, T});
    grad_v.set(std::vector<double>(size_t(grad_v.numel()), 1.0));
    auto p = args.fp8();
    p.grad_v = grad_v.view();
    p.grad_row = grad_row.view();
    p.grad_t = grad_t.view();
    if (v_dim == 0) {
      EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(p); },
                               {"qkv_backward_fp8: grad_v: expected a V head width Dv"}));
      EXPECT_TRUE(untouched(grad_row));
    } else {
      EXPECT_NO_THROW(qkv_backward_fp8(p)) << "Dv = " << v_dim;
    }
  }
}

TEST(Validation, EmptyRopeWorkIsANoOpThatWritesNothing) {
  const int64_t H = 2, D = 32;
  HostTensor guard(DType::kBFloat16, {64});
  HostTensor guard_f8(DType::kFloat8E4M3, {64});
  const TensorView empty_qk = make_view(guard.view().data, DType::kBFloat16, kCPU, {0, 2 * H, D});
  const TensorView empty_f = make_view(guard.view().data, DType::kBFloat16, kCPU, {0, D});
  const TensorView empty_out = make_view(guard.view().data, DType::kBFloat16, kCPU, {0, H, D});
  const TensorView empty_v = make_view(guard.view().data, DType::kBFloat16, kCPU, {0, H, 16});
  HostTensor scale(DType::kFloat32, {});
  const TensorView empty_row = make_view(guard_f8.view().data, DType::kFloat8E4M3, kCPU, {0, 160});
  const TensorView empty_t = make_view(guard_f8.view().data, DType::kFloat8E4M3, kCPU, {160, 0});
  const RopeLayout layout = tables_layout(H, D, false, false, empty_f, empty_f);
  EXPECT_NO_THROW(qk_norm_rope({empty_qk, empty_out, empty_out, layout}));
  EXPECT_NO_THROW(qk_norm_rope_backward({.grad_q = empty_out,
                                         .grad_k = empty_out,
                                         .qk = empty_qk,
                                         .grad_qk = empty_qk,
                                         .layout = layout}));
  EXPECT_NO_THROW(qkv_backward_fp8({.grad_q = empty_out,
                                    .grad_k = empty_out,
                                    .grad_v = empty_v,
                                    .qk = empty_qk,
                                    .grad_scale = scale.view(),
                                    .grad_row = empty_row,
                                    .grad_t = empty_t,
                                    .layout = layout}));
  EXPECT_TRUE(untouched(guard));
  EXPECT_TRUE(untouched(guard_f8));
}

// ---- general layouts (SPEC.md section 8): every refusal of rope_options, rope_inputs and
// rope_weight_grads, on each rope op ----------------------------------------------------------------

/// Valid general-layout arguments: T=4, Hq=4 over Hkv=2, D=32, NeoX over r=16 from a cos/sin
/// cache [P=8, 16] at int32 positions, a bf16 q_weight and a float32 k_weight (so the two
/// gradients differ in dtype), Dv=16. `tables()` swaps the cache for factor tables.
struct LayoutArgs {
  static constexpr int64_t T = 4, Hq = 4, Hkv = 2, D = 32, R = 16, P = 8, Dv = 16;
  static constexpr int64_t kQkvDim = (Hq + Hkv) * D + Hkv * Dv;
  HostTensor qk{DType::kBFloat16, {T, Hq + Hkv, D}};
  HostTensor cos_sin{DType::kBFloat16, {P, R}};
  HostTensor positions{DType::kInt32, {T}};
  HostTensor factor1{DType::kBFloat16, {T, D}};
  HostTensor factor2{DType::kBFloat16, {T, D}};
  HostTensor q_weight{DType::kBFloat16, {D}};
  HostTensor k_weight{DType::kFloat32, {D}};
  HostTensor q{DType::kBFloat16, {T, Hq, D}};
  HostTensor k{DType::kBFloat16, {T, Hkv, D}};
  HostTensor grad_q{DType::kBFloat16, {T, Hq, D}};
  HostTensor grad_k{DType::kBFloat16, {T, Hkv, D}};
  HostTensor grad_qk{DType::kBFloat16, {T, Hq + Hkv, D}};
  HostTensor grad_v{DType::kBFloat16, {T, Hkv, Dv}};
  HostTensor grad_scale{DType::kFloat32, {}};
  HostTensor grad_row{DType::kFloat8E4M3, {T, kQkvDim}};
  HostTensor grad_t{DType::kFloat8E4M3, {kQkvDim, T}};
  HostTensor grad_q_weight{DType::kBFloat16, {D}};
  HostTensor grad_k_weight{DType::kFloat32, {D}};

  LayoutArgs() {
    for (HostTensor* input : {&qk, &cos_sin, &factor1, &factor2, &q_weight, &k_weight, &grad_q,
                              &grad_k, &grad_v, &grad_scale}) {
      input->set(std::vector<double>(size_t(input->numel()), 0.5));
    }
    positions.set_ints({0, 7, 3, 0});
  }
  RopeLayout layout() {
    RopeLayout layout;
    layout.num_heads = Hq;
    layout.num_kv_heads = Hkv;
    layout.rotary_dim = R;
    layout.rotary_style = RotaryStyle::kNeox;
    layout.eps = 1e-6f;
    layout.cos_sin = cos_sin.view();
    layout.positions = positions.view();
    layout.q_weight = q_weight.view();
    layout.k_weight = k_weight.view();
    return layout;
  }
  /// The same layout with factor tables [T, D] instead of the cache.
  RopeLayout tables() {
    RopeLayout layout = this->layout();
    layout.cos_sin = TensorView{};
    layout.positions = TensorView{};
    layout.factor1 = factor1.view();
    layout.factor2 = factor2.view();
    return layout;
  }
  QkNormRopeParams forward() { return {qk.view(), q.view(), k.view(), layout()}; }
  QkNormRopeBackwardParams backward() {
    return {.grad_q = grad_q.view(),
            .grad_k = grad_k.view(),
            .qk = qk.view(),
            .grad_qk = grad_qk.view(),
            .grad_q_weight = grad_q_weight.view(),
            .grad_k_weight = grad_k_weight.view(),
            .layout = layout()};
  }
  QkvBackwardFp8Params fp8() {
    return {.grad_q = grad_q.view(),
            .grad_k = grad_k.view(),
            .grad_v = grad_v.view(),
            .qk = qk.view(),
            .grad_scale = grad_scale.view(),
            .grad_row = grad_row.view(),
            .grad_t = grad_t.view(),
            .grad_q_weight = grad_q_weight.view(),
            .grad_k_weight = grad_k_weight.view(),
            .layout = layout()};
  }
  /// Every output still holds its poison.
  bool nothing_written() const {
    for (const HostTensor* out :
         {&q, &k, &grad_qk, &grad_row, &grad_t, &grad_q_weight, &grad_k_weight}) {
      if (!untouched(*out)) return false;
    }
    return true;
  }
};

/// The layout broken by `breaks` is refused by all three rope ops, each message naming the op and
/// containing `parts`, and nothing is written. `tables` starts from the factor-table layout.
void expect_layout_refused(const std::function<void(RopeLayout&)>& breaks,
                           const std::vector<std::string>& parts, bool tables = false) {
  LayoutArgs args;
  const RopeLayout base = tables ? args.tables() : args.layout();
  const auto with = [&](const std::string& op) {
    std::vector<std::string> all = {op + ": "};
    all.insert(all.end(), parts.begin(), parts.end());
    return all;
  };
  auto f = args.forward();
  f.layout = base;
  breaks(f.layout);
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(f); }, with("qk_norm_rope")));
  auto b = args.backward();
  b.layout = base;
  breaks(b.layout);
  EXPECT_TRUE(throws_error([&] { qk_norm_rope_backward(b); }, with("qk_norm_rope_backward")));
  auto p = args.fp8();
  p.layout = base;
  breaks(p.layout);
  EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(p); }, with("qkv_backward_fp8")));
  EXPECT_TRUE(args.nothing_written());
}

TEST(ValidationLayout, ValidGeneralCallsSucceed) {
  for (bool tables : {false, true}) {
    LayoutArgs args;
    auto f = args.forward();
    auto b = args.backward();
    auto p = args.fp8();
    if (tables) f.layout = b.layout = p.layout = args.tables();
    EXPECT_NO_THROW(qk_norm_rope(f));
    EXPECT_NO_THROW(qk_norm_rope_backward(b));
    EXPECT_NO_THROW(qkv_backward_fp8(p));
  }
  // Hkv = 0 means Hq; MQA; the layout's defaults (r = -1: the cache's width).
  LayoutArgs args;
  auto f = args.forward();
  f.layout.rotary_dim = -1;
  EXPECT_NO_THROW(qk_norm_rope(f));
  HostTensor k1(DType::kBFloat16, {LayoutArgs::T, 1, LayoutArgs::D});
  HostTensor qk5(DType::kBFloat16, {LayoutArgs::T, 5, LayoutArgs::D});
  qk5.set(std::vector<double>(size_t(qk5.numel()), 0.5));
  f = args.forward();
  f.qk = qk5.view();
  f.k = k1.view();
  f.layout.num_kv_heads = 1;
  EXPECT_NO_THROW(qk_norm_rope(f));
}

TEST(ValidationLayout, KvHeadsMustDivideQueryHeads) {
  for (int64_t bad : {3, -1, 5}) {
    SCOPED_TRACE(bad);
    expect_layout_refused([bad](RopeLayout& l) { l.num_kv_heads = bad; },
                          {"layout.num_kv_heads: expected a divisor of layout.num_heads = 4, "
                           "got " + std::to_string(bad)});
  }
}

TEST(ValidationLayout, UnknownRotaryStyle) {
  expect_layout_refused([](RopeLayout& l) { l.rotary_style = static_cast<RotaryStyle>(7); },
                        {"layout.rotary_style: expected RotaryStyle::kInterleaved or RotaryStyle::kNeox, got 7"});
}

TEST(ValidationLayout, AtMostOneAngleSource) {
  LayoutArgs tensors;  // views to add
  const TensorView f1 = tensors.factor1.view(), f2 = tensors.factor2.view();
  const TensorView cos_sin = tensors.cos_sin.view(), positions = tensors.positions.view();
  expect_layout_refused(
      [&](RopeLayout& l) {
        l.factor1 = f1;
        l.factor2 = f2;
      },
      {"layout.factor1, layout.cos_sin: expected at most one angle source, got both the factor "
       "tables (layout.factor1, layout.factor2) and a cos/sin cache (layout.cos_sin, "
       "layout.positions)"});
  expect_layout_refused([&](RopeLayout& l) { l.factor1 = f1; },
                        {"expected at most one angle source"});
  // No angle source is a call without rotary (SPEC.md section 9): a rotary width is then refused.
  expect_layout_refused(
      [](RopeLayout& l) {
        l.cos_sin = TensorView{};
        l.positions = TensorView{};
      },
      {"layout.rotary_dim: expected -1 (the default) or 0 without an angle source"});
  expect_layout_refused([](RopeLayout& l) { l.factor2 = TensorView{}; },
                        {"layout.factor2: missing: layout.factor1 and layout.factor2 go together, got "
                         "only layout.factor1"}, true);
  expect_layout_refused([](RopeLayout& l) { l.factor1 = TensorView{}; },
                        {"layout.factor1: missing: layout.factor1 and layout.factor2 go together, got "
                         "only layout.factor2"}, true);
  expect_layout_refused([](RopeLayout& l) { l.positions = TensorView{}; },
                        {"layout.positions: missing: layout.cos_sin and layout.positions go together, "
                         "got only layout.cos_sin"});
  expect_layout_refused([](RopeLayout& l) { l.cos_sin = TensorView{}; },
                        {"layout.cos_sin: missing: layout.cos_sin and layout.positions go together, "
                         "got only layout.positions"});
  (void)cos_sin;
  (void)positions;
}

TEST(ValidationLayout, CosSinMustBeTwoDimensional) {
  LayoutArgs memory;
  const TensorView flat = alias(memory.cos_sin.view(), DType::kBFloat16, {LayoutArgs::P * 16});
  const TensorView cube = alias(memory.cos_sin.view(), DType::kBFloat16, {2, 4, 16});
  expect_layout_refused([&](RopeLayout& l) { l.cos_sin = flat; },
                        {"layout.cos_sin: expected 2 dims [P, r]"});
  expect_layout_refused([&](RopeLayout& l) { l.cos_sin = cube; },
                        {"layout.cos_sin: expected 2 dims [P, r]"});
}

TEST(ValidationLayout, RotaryDim) {
  // Below -1; odd; past D (factor tables: r is the layout's).
  expect_layout_refused([](RopeLayout& l) { l.rotary_dim = -2; },
                        {"layout.rotary_dim: expected -1 (the default) or an even value in "
                         "[0, D = 32], got -2"},
                        true);
  for (int64_t bad : {15, 33, 34, 64}) {
    SCOPED_TRACE(bad);
    expect_layout_refused([bad](RopeLayout& l) { l.rotary_dim = bad; },
                          {"layout.rotary_dim: expected an even value in [0, D = 32], got " +
                           std::to_string(bad)},
                          true);
  }
  // With a cache, r must equal cos_sin's width.
  expect_layout_refused([](RopeLayout& l) { l.rotary_dim = 8; },
                        {"layout.cos_sin: expected width r = 8 (layout.rotary_dim), got",
                         "[8, 16]"});
  expect_layout_refused([](RopeLayout& l) { l.rotary_dim = 32; },
                        {"layout.cos_sin: expected width r = 32"});
  // r = -1 takes the cache's width, which must then be even and at most D.
  for (int64_t width : {15, 34}) {
    SCOPED_TRACE(width);
    HostTensor odd(DType::kBFloat16, {LayoutArgs::P, width});
    expect_layout_refused(
        [&](RopeLayout& l) {
          l.rotary_dim = -1;
          l.cos_sin = odd.view();
        },
        {"layout.cos_sin: expected an even width r in [0, D = 32], got " +
         std::to_string(width)});
  }
}

TEST(ValidationLayout, PairedAndKeyOffsetNeedEqualHeads) {
  LayoutArgs memory;
  HostTensor wide1(DType::kBFloat16, {LayoutArgs::T, 2 * LayoutArgs::D});
  HostTensor wide2(DType::kBFloat16, {LayoutArgs::T, 2 * LayoutArgs::D});
  expect_layout_refused([](RopeLayout& l) { l.paired = true; },
                        {"layout.paired: needs layout.num_kv_heads = layout.num_heads and an "
                         "even layout.num_heads, got 4 and 2"},
                        true);
  // Paired with a cache, even with equal heads: defined with factor tables only.
  expect_layout_refused(
      [](RopeLayout& l) {
        l.paired = true;
        l.num_kv_heads = 0;
      },
      {"layout.paired: defined with factor tables [T, 2D] only, got a cos/sin cache"});
  expect_layout_refused([](RopeLayout& l) { l.key_offset = true; },
                        {"layout.key_offset: needs layout.num_kv_heads = layout.num_heads, got 4 and 2"});
  expect_layout_refused([](RopeLayout& l) { l.key_offset = true; },
                        {"layout.key_offset: needs layout.num_kv_heads = layout.num_heads, got 4 and 2"}, true);
  // MQA and an odd head count for paired.
  expect_layout_refused(
      [](RopeLayout& l) {
        l.paired = true;
        l.num_kv_heads = 1;
      },
      {"layout.paired: needs layout.num_kv_heads = layout.num_heads", "got 4 and 1"}, true);
}

TEST(ValidationLayout, WeightsNeedTheNorm) {
  expect_layout_refused([](RopeLayout& l) { l.normalize = false; },
                        {"layout.q_weight: norm weights need layout.normalize = true, got false"});
  expect_layout_refused(
      [](RopeLayout& l) {
        l.normalize = false;
        l.q_weight = TensorView{};
      },
      {"layout.k_weight: norm weights need layout.normalize = true, got false"});
  // Without weights, no norm is fine (and eps is not read: 0 passes).
  LayoutArgs args;
  auto f = args.forward();
  f.layout.normalize = false;
  f.layout.q_weight = f.layout.k_weight = TensorView{};
  f.layout.eps = 0.0f;
  EXPECT_NO_THROW(qk_norm_rope(f));
}

TEST(ValidationLayout, EpsMustBePositiveAndFinite) {
  for (float bad : {0.0f, -0.0f, -1e-6f, INFINITY, -INFINITY, NAN}) {
    SCOPED_TRACE(bad);
    expect_layout_refused([bad](RopeLayout& l) { l.eps = bad; },
                          {"layout.eps: expected a positive finite value, got"});
  }
  LayoutArgs args;
  auto f = args.forward();
  for (float fine : {1e-38f, 1e-6f, 1.0f, 3e38f}) {
    f.layout.eps = fine;
    EXPECT_NO_THROW(qk_norm_rope(f)) << fine;
  }
}

TEST(ValidationLayout, WeightOffsetMustBeFinite) {
  for (float bad : {INFINITY, -INFINITY, NAN}) {
    SCOPED_TRACE(bad);
    expect_layout_refused([bad](RopeLayout& l) { l.weight_offset = bad; },
                          {"layout.weight_offset: expected a finite value, got"});
  }
  LayoutArgs args;
  auto f = args.forward();
  for (float fine : {1.0f, -3.5f, 0.0f}) {
    f.layout.weight_offset = fine;
    EXPECT_NO_THROW(qk_norm_rope(f)) << fine;
  }
}

TEST(ValidationLayout, WeightTensors) {
  LayoutArgs memory;
  HostTensor f64(DType::kFloat64, {LayoutArgs::D});
  HostTensor long_weight(DType::kBFloat16, {LayoutArgs::D + 2});
  HostTensor strided(DType::kBFloat16, {LayoutArgs::D}, {2});
  HostTensor row(DType::kBFloat16, {1, LayoutArgs::D});
  f64.set(std::vector<double>(LayoutArgs::D, 1.0));
  const auto retyped = [](TensorView view, DType dtype) {
    view.dtype = dtype;
    return view;
  };
  const TensorView fp8 = retyped(memory.q_weight.view(), DType::kFloat8E4M3);
  const TensorView ints = retyped(memory.k_weight.view(), DType::kInt32);
  expect_layout_refused([&](RopeLayout& l) { l.q_weight = fp8; },
                        {"layout.q_weight: expected dtype bfloat16 or float32, got float8_e4m3fn"});
  expect_layout_refused([&](RopeLayout& l) { l.k_weight = ints; },
                        {"layout.k_weight: expected dtype bfloat16 or float32, got int32"});
  // float64 weights only with float64 qk (the CPU's gradient checks).
  expect_layout_refused([&](RopeLayout& l) { l.q_weight = f64.view(); },
                        {"layout.q_weight: expected dtype bfloat16 or float32, got float64"});
  expect_layout_refused([&](RopeLayout& l) { l.k_weight = long_weight.view(); },
                        {"layout.k_weight: expected shape [32] ([D]), got [34]"});
  expect_layout_refused([&](RopeLayout& l) { l.q_weight = row.view(); },
                        {"layout.q_weight: expected shape [32] ([D]), got [1, 32]"});
  expect_layout_refused([&](RopeLayout& l) { l.q_weight = strided.view(); },
                        {"layout.q_weight: expected its last dim contiguous"});
  HostTensor roomy(DType::kFloat32, {LayoutArgs::D + 1});
  TensorView off = roomy.view();
  off.data = static_cast<char*>(off.data) + 2;
  off.sizes[0] = LayoutArgs::D;
  expect_layout_refused(
      [&](RopeLayout& l) { l.k_weight = off; },
      {"layout.k_weight: data pointer", "is not aligned to its 4-byte elements"});
  expect_layout_refused([&](RopeLayout& l) { l.q_weight = on_device(l.q_weight, kCuda0); },
                        {"layout.q_weight: is on cuda:0, but ", " is on cpu"});
}

TEST(ValidationLayout, CacheTensors) {
  LayoutArgs memory;
  const auto retyped = [](TensorView view, DType dtype) {
    view.dtype = dtype;
    return view;
  };
  HostTensor f64(DType::kFloat64, {LayoutArgs::P, LayoutArgs::R});
  expect_layout_refused([&](RopeLayout& l) { l.cos_sin = f64.view(); },
                        {"layout.cos_sin: expected dtype bfloat16 or float32, got float64"});
  expect_layout_refused(
      [&](RopeLayout& l) { l.cos_sin = retyped(l.cos_sin, DType::kFloat8E4M3); },
      {"layout.cos_sin: expected dtype bfloat16 or float32, got float8_e4m3fn"});
  expect_layout_refused([](RopeLayout& l) { l.cos_sin.sizes[0] = 0; },
                        {"layout.cos_sin: expected 1 <= P <= 2^31 - 1 positions"});
  expect_layout_refused([](RopeLayout& l) { l.cos_sin.sizes[0] = int64_t(1) << 31; },
                        {"layout.cos_sin: expected 1 <= P <= 2^31 - 1 positions"});
  expect_layout_refused(
      [](RopeLayout& l) {
        l.cos_sin.sizes[0] = 2;
        l.cos_sin.strides[1] = 2;
        l.cos_sin.strides[0] = 32;
      },
      {"layout.cos_sin: expected its last dim contiguous"});
  TensorView odd = memory.cos_sin.view();
  odd.data = static_cast<char*>(odd.data) + 1;
  odd.sizes[0] = LayoutArgs::P - 1;
  expect_layout_refused([&](RopeLayout& l) { l.cos_sin = odd; },
                        {"layout.cos_sin: data pointer", "is not aligned to its 2-byte elements"});
  // positions: int32 or int64 [T].
  expect_layout_refused(
      [&](RopeLayout& l) { l.positions = retyped(l.positions, DType::kFloat32); },
      {"layout.positions: expected dtype int32 or int64, got float32"});
  expect_layout_refused(
      [&](RopeLayout& l) { l.positions = retyped(l.positions, DType::kBFloat16); },
      {"layout.positions: expected dtype int32 or int64, got bfloat16"});
  HostTensor longer(DType::kInt64, {LayoutArgs::T + 1});
  expect_layout_refused([&](RopeLayout& l) { l.positions = longer.view(); },
                        {"layout.positions: expected shape [4] ([T], T from qk), got [5]"});
  HostTensor column(DType::kInt32, {LayoutArgs::T, 1});
  expect_layout_refused([&](RopeLayout& l) { l.positions = column.view(); },
                        {"layout.positions: expected shape [4]", "got [4, 1]"});
  HostTensor wide(DType::kInt64, {LayoutArgs::T + 1});
  TensorView off = wide.view();
  off.data = static_cast<char*>(off.data) + 4;
  off.sizes[0] = LayoutArgs::T;
  expect_layout_refused([&](RopeLayout& l) { l.positions = off; },
                        {"layout.positions: data pointer", "is not aligned to its 8-byte elements"});
  expect_layout_refused([](RopeLayout& l) { l.positions = on_device(l.positions, kCuda0); },
                        {"layout.positions: is on cuda:0, but ", " is on cpu"});
  // Strided positions (a column of a [T, 2] int64 batch) are fine.
  HostTensor pairs(DType::kInt64, {LayoutArgs::T, 2});
  pairs.set_ints({0, 9, 1, 9, 2, 9, 3, 9});
  LayoutArgs args;
  auto f = args.forward();
  f.layout.positions = make_view(pairs.view().data, DType::kInt64, kCPU, {LayoutArgs::T}, {2});
  EXPECT_NO_THROW(qk_norm_rope(f));
}

TEST(ValidationLayout, GqaShapes) {
  LayoutArgs args;
  auto f = args.forward();
  f.k = alias(f.k, DType::kBFloat16, {LayoutArgs::T, LayoutArgs::Hq, LayoutArgs::D});
  f.k.data = args.q.view().data;  // shape checked before overlap
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(f); },
                           {"qk_norm_rope: k: expected shape [4, 2, 32] ([T, num_kv_heads, D])"}));
  f = args.forward();
  f.layout.num_kv_heads = 4;  // qk holds 6 heads, the layout now says 8
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(f); },
                           {"qk: expected shape [T, 8, 32] (num_heads + num_kv_heads = 8 heads)"}));
  auto b = args.backward();
  b.grad_k.sizes[1] = LayoutArgs::Hq;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope_backward(b); },
                           {"qk_norm_rope_backward: grad_k: expected shape [4, 2, 32]"}));
  b = args.backward();
  b.grad_qk.sizes[1] = 2 * LayoutArgs::Hq;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope_backward(b); },
                           {"qk_norm_rope_backward: grad_qk: expected shape [4, 6, 32]"}));
  auto p = args.fp8();
  p.grad_v.sizes[1] = LayoutArgs::Hq;
  EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(p); },
                           {"qkv_backward_fp8: grad_v: expected shape [4, 2, Dv] (T from qk, "
                       "num_kv_heads)"}));
  p = args.fp8();
  p.grad_row.sizes[1] = 2 * LayoutArgs::Hq * LayoutArgs::D + LayoutArgs::Hq * LayoutArgs::Dv;
  EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(p); },
                           {"qkv_backward_fp8: grad_row: expected shape [4, 224] (qkv_dim = "
                       "(Hq + Hkv)*D + Hkv*Dv = 224)"}));
  EXPECT_TRUE(args.nothing_written());
}

/// The weight-gradient refusals of one backward op, given its valid params.
template <typename Params>
void check_weight_grad_refusals(LayoutArgs& args, Params valid, const std::string& op,
                                const std::function<void(const Params&)>& run) {
  HostTensor f32(DType::kFloat32, {LayoutArgs::D});
  HostTensor bf16(DType::kBFloat16, {LayoutArgs::D});
  HostTensor longer(DType::kFloat32, {LayoutArgs::D + 1});
  HostTensor strided(DType::kBFloat16, {LayoutArgs::D}, {2});
  Params p = valid;
  // A gradient given without its weight, and missing with it.
  p.layout.q_weight = TensorView{};
  EXPECT_TRUE(throws_error([&] { run(p); },
                           {op + ": grad_q_weight: given, but its weight is not (a gradient goes "
                            "with its weight)"}));
  p = valid;
  p.layout.k_weight = TensorView{};
  EXPECT_TRUE(throws_error([&] { run(p); },
                           {op + ": grad_k_weight: given, but its weight is not"}));
  p = valid;
  p.grad_q_weight = TensorView{};
  EXPECT_TRUE(throws_error([&] { run(p); },
                           {op + ": grad_q_weight: missing (the layout has its weight, whose "
                            "gradient it receives)"}));
  p = valid;
  p.grad_k_weight = TensorView{};
  EXPECT_TRUE(throws_error([&] { run(p); }, {op + ": grad_k_weight: missing"}));
  // The weight's dtype ([D] bf16 for q, float32 for k here), shape, contiguity.
  p = valid;
  p.grad_q_weight = f32.view();
  EXPECT_TRUE(throws_error([&] { run(p); },
                           {op + ": grad_q_weight: expected dtype bfloat16, got float32"}));
  p = valid;
  p.grad_k_weight = bf16.view();
  EXPECT_TRUE(throws_error([&] { run(p); },
                           {op + ": grad_k_weight: expected dtype float32, got bfloat16"}));
  p = valid;
  p.grad_k_weight = longer.view();
  EXPECT_TRUE(throws_error([&] { run(p); },
                           {op + ": grad_k_weight: expected shape [32] ([D], as its weight), "
                            "got [33]"}));
  p = valid;
  p.grad_q_weight = strided.view();
  EXPECT_TRUE(throws_error([&] { run(p); },
                           {op + ": grad_q_weight: expected a row-major contiguous tensor"}));
  // Outputs overlap nothing: the weight itself, the other gradient.
  p = valid;
  p.grad_q_weight = p.layout.q_weight;
  EXPECT_TRUE(throws_error([&] { run(p); },
                           {op + ": grad_q_weight: overlaps input layout.q_weight"}));
  p = valid;
  p.grad_k_weight = alias(p.layout.k_weight, DType::kFloat32, {LayoutArgs::D});
  EXPECT_TRUE(throws_error([&] { run(p); },
                           {op + ": grad_k_weight: overlaps input layout.k_weight"}));
  // The workspace: none is needed on the CPU (size 0); one given must still be float32 [n].
  p = valid;
  EXPECT_EQ(backward_workspace_size(p), 0);
  HostTensor workspace(DType::kFloat32, {16});
  p.workspace = workspace.view();
  EXPECT_NO_THROW(run(p));
  HostTensor f64(DType::kFloat64, {16});
  p.workspace = f64.view();
  EXPECT_TRUE(throws_error([&] { run(p); },
                           {op + ": workspace: expected dtype float32, got float64"}));
  HostTensor matrix(DType::kFloat32, {4, 4});
  p.workspace = matrix.view();
  EXPECT_TRUE(throws_error([&] { run(p); }, {op + ": workspace: expected 1 dims"}));
  HostTensor gapped(DType::kFloat32, {8}, {2});
  p.workspace = gapped.view();
  EXPECT_TRUE(throws_error([&] { run(p); },
                           {op + ": workspace: expected a row-major contiguous"}));
  p = valid;
  p.workspace = alias(p.grad_q_weight, DType::kFloat32, {4});
  EXPECT_TRUE(throws_error([&] { run(p); }, {op + ": grad_q_weight: overlaps output workspace"}));
  (void)args;
}

TEST(ValidationLayout, WeightGradientsOfTheBf16Backward) {
  LayoutArgs args;
  check_weight_grad_refusals<QkNormRopeBackwardParams>(
      args, args.backward(), "qk_norm_rope_backward",
      [](const QkNormRopeBackwardParams& p) { qk_norm_rope_backward(p); });
}

TEST(ValidationLayout, WeightGradientsOfTheFp8Backward) {
  LayoutArgs args;
  check_weight_grad_refusals<QkvBackwardFp8Params>(
      args, args.fp8(), "qkv_backward_fp8",
      [](const QkvBackwardFp8Params& p) { qkv_backward_fp8(p); });
}

// The packed op takes the layout whole (its tensors too), with the norm weights' gradients and
// their workspace among its own arguments.
struct PackedLayoutArgs {
  static constexpr int64_t T = 4, C = 16, Hq = 4, Hkv = 2, D = 32, Dv = 16;
  static constexpr int64_t kQk = (Hq + Hkv) * D, kV = Hkv * Dv, kQkv = kQk + kV;
  LayoutArgs rope;  // cos_sin, positions, weights (T = 4, D = 32)
  HostTensor x_f8{DType::kFloat8E4M3, {T, C}};
  HostTensor x_f8_t{DType::kFloat8E4M3, {C, T}};
  HostTensor weight_f8{DType::kFloat8E4M3, {kQkv, C}};
  HostTensor weight_f8_t{DType::kFloat8E4M3, {C, kQkv}};
  HostTensor scale{DType::kFloat32, {}};
  HostTensor qkv{DType::kBFloat16, {T, kQkv}};
  HostTensor qk_weight{DType::kBFloat16, {kQk, C}};
  HostTensor v_weight{DType::kBFloat16, {kV, C}};
  HostTensor partials{DType::kFloat32, {kGradScalePartials}};
  HostTensor grad_x{DType::kBFloat16, {T, C}};
  HostTensor grad_weight{DType::kBFloat16, {kQkv, C}};
  HostTensor grad_qkv_scale{DType::kFloat32, {}};

  PackedLayoutArgs() {
    for (HostTensor* input : {&x_f8, &x_f8_t, &weight_f8, &weight_f8_t, &scale, &qk_weight,
                              &v_weight}) {
      input->set(std::vector<double>(size_t(input->numel()), 1.0));
    }
  }
  PackedQkvForwardParams forward() {
    return {.x_f8 = x_f8.view(),
            .weight_f8 = weight_f8.view(),
            .x_scale = scale.view(),
            .weight_scale = scale.view(),
            .qkv_scale = scale.view(),
            .qk = make_view(qkv.view().data, DType::kBFloat16, kCPU, {T, Hq + Hkv, D},
                            {kQkv, D, 1}),
            .v = make_view(static_cast<uint16_t*>(qkv.view().data) + kQk, DType::kBFloat16, kCPU,
                           {T, Hkv, Dv}, {kQkv, Dv, 1}),
            .q = rope.q.view(),
            .k = rope.k.view(),
            .layout = rope.layout()};
  }
  PackedQkvBackwardParams backward() {
    return {.grad_q = rope.grad_q.view(),
            .grad_k = rope.grad_k.view(),
            .grad_v = rope.grad_v.view(),
            .qk = rope.qk.view(),
            .x_f8_t = x_f8_t.view(),
            .weight_f8_t = weight_f8_t.view(),
            .qk_weight = qk_weight.view(),
            .v_weight = v_weight.view(),
            .x_scale = scale.view(),
            .weight_scale = scale.view(),
            .qkv_scale = scale.view(),
            .grad_scale = scale.view(),
            .grad_row = rope.grad_row.view(),
            .grad_t = rope.grad_t.view(),
            .partials = partials.view(),
            .grad_q_weight = rope.grad_q_weight.view(),
            .grad_k_weight = rope.grad_k_weight.view(),
            .grad_x = grad_x.view(),
            .grad_qk_weight = make_view(grad_weight.view().data, DType::kBFloat16, kCPU, {kQk, C}),
            .grad_v_weight = make_view(static_cast<uint16_t*>(grad_weight.view().data) + kQk * C,
                                       DType::kBFloat16, kCPU, {kV, C}),
            .grad_qkv_scale = grad_qkv_scale.view(),
            .layout = rope.layout()};
  }
  bool nothing_written() const {
    return untouched(qkv) && untouched(grad_x) && untouched(grad_weight) &&
           untouched(grad_qkv_scale) && rope.nothing_written();
  }
};

TEST(ValidationLayout, PackedOpWithAGeneralLayout) {
  {
    PackedLayoutArgs args;
    EXPECT_NO_THROW(packed_qkv_forward(args.forward()));
    EXPECT_NO_THROW(packed_qkv_backward(args.backward()));
    EXPECT_EQ(backward_workspace_size(args.backward()), 0);
  }
  PackedLayoutArgs args;
  auto f = args.forward();
  f.v.sizes[1] = PackedLayoutArgs::Hq;
  EXPECT_TRUE(throws_error([&] { packed_qkv_forward(f); },
                           {"packed_qkv_forward: v: expected shape [4, 2, Dv] (T from x_f8, "
                       "num_kv_heads)"}));
  f = args.forward();
  f.weight_f8.sizes[0] = 2 * PackedLayoutArgs::Hq * PackedLayoutArgs::D;
  EXPECT_TRUE(throws_error([&] { packed_qkv_forward(f); },
                           {"packed_qkv_forward: weight_f8: expected shape [224, 16] (qkv_dim = "
                       "(Hq + Hkv)*D + Hkv*Dv = 224)"}));
  f = args.forward();
  f.layout.key_offset = true;
  EXPECT_TRUE(throws_error([&] { packed_qkv_forward(f); },
                           {"packed_qkv_forward",
                            "layout.key_offset: needs layout.num_kv_heads = layout.num_heads"}));
  f = args.forward();
  f.layout.positions.sizes[0] = PackedLayoutArgs::T - 1;
  EXPECT_TRUE(throws_error([&] { packed_qkv_forward(f); },
                           {"packed_qkv_forward", "layout.positions: expected shape [4]"}));
  f = args.forward();
  f.layout.q_weight.dtype = DType::kFloat8E4M3;
  EXPECT_TRUE(throws_error([&] { packed_qkv_forward(f); },
                           {"packed_qkv_forward", "layout.q_weight"}));

  auto b = args.backward();
  b.qk_weight.sizes[0] = 2 * PackedLayoutArgs::Hq * PackedLayoutArgs::D;
  EXPECT_TRUE(throws_error([&] { packed_qkv_backward(b); },
                           {"packed_qkv_backward: qk_weight: expected shape [192, 16] "
                       "([(Hq+Hkv)*D, C])"}));
  b = args.backward();
  b.v_weight.sizes[0] = PackedLayoutArgs::Hq * PackedLayoutArgs::Dv;
  EXPECT_TRUE(throws_error([&] { packed_qkv_backward(b); },
                           {"packed_qkv_backward: v_weight: expected shape [32, 16] "
                            "([Hkv*Dv, C])"}));
  b = args.backward();
  b.grad_q_weight = TensorView{};
  EXPECT_TRUE(throws_error([&] { packed_qkv_backward(b); },
                           {"packed_qkv_backward", "grad_q_weight: missing"}));
  b = args.backward();
  b.layout.k_weight = TensorView{};
  EXPECT_TRUE(throws_error([&] { packed_qkv_backward(b); },
                           {"packed_qkv_backward", "grad_k_weight: given, but its weight is not"}));
  b = args.backward();
  b.grad_k_weight = alias(b.grad_x, DType::kFloat32, {PackedLayoutArgs::D});
  EXPECT_TRUE(throws_error([&] { packed_qkv_backward(b); },
                           {"packed_qkv_backward", "grad_k_weight: overlaps output grad_x"}));
  EXPECT_TRUE(args.nothing_written());
}

TEST(ValidationLayout, PackedRopeWorkspaceIsNamedAsThePackedArgument) {
  // packed_qkv_backward's norm-weight workspace is the argument `rope_workspace`; its refusals
  // come from the qkv_backward_fp8 step, whose argument is `workspace`, and must still name the
  // one the caller passed (found by this test, fixed in 160d250).
  PackedLayoutArgs args;
  HostTensor f64(DType::kFloat64, {16});
  auto b = args.backward();
  b.rope_workspace = f64.view();
  EXPECT_TRUE(throws_error([&] { packed_qkv_backward(b); },
                           {"packed_qkv_backward", "rope_workspace", "expected dtype float32"}));
  EXPECT_TRUE(args.nothing_written());
}

// ---- devices -----------------------------------------------------------------------------------

TEST(Validation, TensorsOnDifferentDevicesAreRefused) {
  RopeArgs args;
  auto p = args.forward();
  p.layout.factor1 = on_device(p.layout.factor1, kCuda0);
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); },
                           {"qk_norm_rope: layout.factor1: is on cuda:0, but qk is on cpu"}));
}

TEST(Validation, ScalesOnAnotherDeviceAreRefused) {
  // A scale is a tensor like any other: on another device than the data it is refused by name
  // (a device scale read by a host loop, or a host scale read by a kernel, would crash or lie).
  RopeArgs rope;
  auto fp8 = rope.fp8();
  fp8.grad_scale = on_device(fp8.grad_scale, kCuda0);
  EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(fp8); },
                           {"qkv_backward_fp8: grad_scale: is on cuda:0, but grad_q is on cpu"}));
  EXPECT_TRUE(untouched(rope.grad_row));
}

TEST(Validation, CudaViewsOfHostMemoryGiveAClearError) {
  // Host pointers labelled cuda:0: a CPU-only build says it was built without CUDA; a CUDA build
  // says there is no device, or that the pointer is not memory of that GPU. Never a crash.
  RopeArgs args;
  auto p = args.forward();
  for (TensorView* view : {&p.qk, &p.layout.factor1, &p.layout.factor2, &p.q, &p.k})
    *view = on_device(*view, kCuda0);
  try {
    qk_norm_rope(p);
    FAIL() << "a CUDA view of host memory was accepted";
  } catch (const Error& error) {
    std::string message = error.what();
    EXPECT_NE(message.find("qk_norm_rope: qk"), std::string::npos) << message;
    std::transform(message.begin(), message.end(), message.begin(),
                   [](unsigned char ch) { return char(std::tolower(ch)); });
    EXPECT_NE(message.find("cuda"), std::string::npos) << message;
  }
  EXPECT_TRUE(untouched(args.q));
}

// ---- quantize ----------------------------------------------------------------------------------

struct QuantizeArgs {
  static constexpr int64_t B = 2, M = 5, N = 7;
  HostTensor src{DType::kBFloat16, {M, N}};
  HostTensor scale{DType::kFloat32, {1}};
  HostTensor row{DType::kFloat8E4M3, {M, N}};
  HostTensor t{DType::kFloat8E4M3, {N, M}};
  HostTensor amax{DType::kFloat32, {}};
  HostTensor bank_src{DType::kBFloat16, {B, M, N}};
  HostTensor bank_scale{DType::kFloat32, {B}};
  HostTensor bank_row{DType::kFloat8E4M3, {B, M, N}};
  HostTensor bank_t{DType::kFloat8E4M3, {B, N, M}};

  QuantizeArgs() {
    src.set(std::vector<double>(M * N, 1.0));
    scale.set({1.0});
    bank_src.set(std::vector<double>(B * M * N, 1.0));
  }
  QuantizeDualParams dual() {
    return {src.view(), scale.view(), row.view(), t.view(), amax.view()};
  }
  QuantizeWeightBankParams bank() {
    return {bank_src.view(), bank_scale.view(), bank_row.view(), bank_t.view()};
  }
};

TEST(Validation, ValidQuantizeCallsSucceed) {
  QuantizeArgs args;
  EXPECT_NO_THROW(quantize_dual_layout(args.dual()));
  EXPECT_NO_THROW(quantize_weight_bank(args.bank()));
}

TEST(Validation, QuantizeDualChecks) {
  QuantizeArgs args;
  auto p = args.dual();
  p.src.dtype = DType::kFloat32;
  EXPECT_TRUE(throws_error([&] { quantize_dual_layout(p); },
                           {"quantize_dual_layout: src: expected dtype bfloat16, got float32"}));
  p = args.dual();
  p.src.ndim = 1;
  EXPECT_TRUE(throws_error([&] { quantize_dual_layout(p); },
                           {"src: expected shape [M, N] or, batched, [B, M, N]"}));
  p = args.dual();
  p.src.strides[1] = 2;
  EXPECT_TRUE(
      throws_error([&] { quantize_dual_layout(p); }, {"src: expected its last dim contiguous"}));
  p = args.dual();
  p.scale.sizes[0] = 2;
  EXPECT_TRUE(throws_error([&] { quantize_dual_layout(p); },
                           {"scale: expected a float32 scalar of shape [] or [1]"}));
  p = args.dual();
  p.scale.dtype = DType::kFloat64;
  EXPECT_TRUE(throws_error([&] { quantize_dual_layout(p); }, {"scale: expected a float32 scalar"}));
  p = args.dual();
  p.t = alias(p.t, DType::kFloat8E4M3, {QuantizeArgs::M, QuantizeArgs::N});
  EXPECT_TRUE(throws_error([&] { quantize_dual_layout(p); },
                           {"t: expected shape [7, 5] (src transposed)"}));
  p = args.dual();
  p.row.dtype = DType::kBFloat16;
  EXPECT_TRUE(
      throws_error([&] { quantize_dual_layout(p); }, {"row: expected dtype float8_e4m3fn"}));
  p = args.dual();
  p.amax = alias(p.amax, DType::kFloat32, {2});
  EXPECT_TRUE(throws_error([&] { quantize_dual_layout(p); }, {"amax: expected a float32 scalar"}));
  p = args.dual();
  p.row = alias(p.src, DType::kFloat8E4M3, {QuantizeArgs::M, QuantizeArgs::N});
  EXPECT_TRUE(throws_error([&] { quantize_dual_layout(p); }, {"row: overlaps input src"}));
  p = args.dual();
  p.t = alias(p.row, DType::kFloat8E4M3, {QuantizeArgs::N, QuantizeArgs::M});
  EXPECT_TRUE(throws_error([&] { quantize_dual_layout(p); }, {"row: overlaps output t"}));
  // Batched: one scale per entry.
  p = args.dual();
  p.src = args.bank_src.view();
  p.row = args.bank_row.view();
  p.t = args.bank_t.view();
  p.amax = TensorView{};
  EXPECT_TRUE(throws_error([&] { quantize_dual_layout(p); },
                           {"scale: expected shape [2] (one per batch entry of src), got [1]"}));
  p.scale = args.bank_scale.view();
  args.bank_scale.set({1.0, 2.0});
  EXPECT_NO_THROW(quantize_dual_layout(p));
  HostTensor one_amax{DType::kFloat32, {1}};
  p.amax = one_amax.view();  // batched: one amax per entry
  EXPECT_TRUE(throws_error([&] { quantize_dual_layout(p); },
                           {"quantize_dual_layout: amax: expected shape [2]"}));
  p.amax = TensorView{};
  p.scale.dtype = DType::kFloat64;
  EXPECT_TRUE(throws_error([&] { quantize_dual_layout(p); },
                           {"quantize_dual_layout: scale: expected dtype float32"}));
  p = args.dual();
  p.t.dtype = DType::kBFloat16;
  EXPECT_TRUE(throws_error([&] { quantize_dual_layout(p); },
                           {"quantize_dual_layout: t: expected dtype float8_e4m3fn"}));
  p = args.dual();
  p.row = alias(p.row, DType::kFloat8E4M3, {QuantizeArgs::N, QuantizeArgs::M});
  EXPECT_TRUE(throws_error([&] { quantize_dual_layout(p); },
                           {"quantize_dual_layout: row: expected shape [5, 7] (src's shape)"}));
  p = args.dual();
  p.row = with_strides(p.row, {QuantizeArgs::N - 1, 1});  // rows overlapping: inside the buffer
  EXPECT_TRUE(throws_error([&] { quantize_dual_layout(p); },
                           {"quantize_dual_layout: row: expected a row-major contiguous"}));
}

TEST(Validation, QuantizeWeightBankChecks) {
  QuantizeArgs args;
  auto p = args.bank();
  p.src = args.src.view();
  EXPECT_TRUE(throws_error([&] { quantize_weight_bank(p); },
                           {"quantize_weight_bank: src: expected 3 dims"}));
  p = args.bank();
  p.scale = alias(p.scale, DType::kFloat32, {3});
  EXPECT_TRUE(throws_error([&] { quantize_weight_bank(p); }, {"scale: expected shape [2]"}));
  p = args.bank();
  p.scale = alias(p.row, DType::kFloat32, {QuantizeArgs::B});
  EXPECT_TRUE(throws_error([&] { quantize_weight_bank(p); }, {"scale: overlaps output row"}));
  p = args.bank();
  p.t.sizes[1] = QuantizeArgs::M;
  EXPECT_TRUE(throws_error([&] { quantize_weight_bank(p); }, {"t: expected shape [2, 7, 5]"}));
}

TEST(Validation, EmptyQuantizeIsANoOpThatWritesNothing) {
  QuantizeArgs args;
  auto p = args.dual();
  p.src.sizes[0] = 0;
  p.row.sizes[0] = 0;
  p.t.sizes[1] = 0;
  EXPECT_NO_THROW(quantize_dual_layout(p));
  auto b = args.bank();
  b.src.sizes[1] = 0;
  b.row.sizes[1] = 0;
  b.t.sizes[2] = 0;
  EXPECT_NO_THROW(quantize_weight_bank(b));
  for (const HostTensor* out :
       {&args.row, &args.t, &args.amax, &args.bank_scale, &args.bank_row, &args.bank_t}) {
    EXPECT_TRUE(untouched(*out));
  }
}

// ---- fp8_gemm ----------------------------------------------------------------------------------

struct GemmArgs {
  static constexpr int64_t M = 4, N = 6, K = 8;
  HostTensor a{DType::kFloat8E4M3, {M, K}};
  HostTensor b{DType::kFloat8E4M3, {N, K}};
  HostTensor scale_a{DType::kFloat32, {}};
  HostTensor scale_b{DType::kFloat32, {1}};
  HostTensor alpha{DType::kFloat32, {}};
  HostTensor d{DType::kBFloat16, {M, N}};

  GemmArgs() {
    a.set(std::vector<double>(M * K, 1.0));
    b.set(std::vector<double>(N * K, 1.0));
    scale_a.set({1.0});
    scale_b.set({1.0});
    alpha.set({1.0});
  }
  Fp8GemmParams params() {
    return {a.view(), b.view(), scale_a.view(), scale_b.view(), alpha.view(), d.view()};
  }
};

TEST(Validation, Fp8GemmChecks) {
  GemmArgs args;
  EXPECT_NO_THROW(fp8_gemm(args.params()));
  auto p = args.params();
  p.a.dtype = DType::kBFloat16;
  EXPECT_TRUE(throws_error([&] { fp8_gemm(p); },
                           {"fp8_gemm: a: expected dtype float8_e4m3fn, got bfloat16"}));
  p = args.params();
  p.b.sizes[1] = GemmArgs::K - 1;
  EXPECT_TRUE(throws_error([&] { fp8_gemm(p); }, {"b: expected shape [N, 8] (K from a"}));
  p = args.params();
  p.d.sizes[1] = GemmArgs::N + 1;
  EXPECT_TRUE(throws_error([&] { fp8_gemm(p); }, {"d: expected shape [4, 6]"}));
  p = args.params();
  p.d.dtype = DType::kFloat32;
  EXPECT_TRUE(throws_error([&] { fp8_gemm(p); }, {"d: expected dtype bfloat16"}));
  p = args.params();
  p.scale_a = alias(p.scale_a, DType::kFloat32, {2});
  EXPECT_TRUE(throws_error([&] { fp8_gemm(p); },
                           {"scale_a: expected a float32 scalar of shape [] or [1]"}));
  p = args.params();
  p.alpha.dtype = DType::kBFloat16;
  EXPECT_TRUE(throws_error([&] { fp8_gemm(p); }, {"alpha: expected a float32 scalar"}));
  p = args.params();
  p.a.strides[0] = GemmArgs::K - 2;
  EXPECT_TRUE(throws_error([&] { fp8_gemm(p); }, {"a: expected a row stride >= its 8 columns"}));
  p = args.params();
  p.b.strides[1] = 2;
  EXPECT_TRUE(throws_error([&] { fp8_gemm(p); }, {"b: expected its last dim contiguous"}));
  p = args.params();
  p.d = alias(p.a, DType::kBFloat16, {GemmArgs::M, GemmArgs::N});
  EXPECT_TRUE(throws_error([&] { fp8_gemm(p); }, {"d: overlaps input a"}));
  p = args.params();
  p.d = alias(p.alpha, DType::kBFloat16, {1, GemmArgs::N});
  p.a.sizes[0] = 1;
  EXPECT_TRUE(throws_error([&] { fp8_gemm(p); }, {"d: overlaps input alpha"}));
  p = args.params();
  p.alpha = TensorView{};  // optional
  EXPECT_NO_THROW(fp8_gemm(p));
  p = args.params();
  p.a = alias(p.a, DType::kFloat8E4M3, {1, GemmArgs::M, GemmArgs::K});
  EXPECT_TRUE(throws_error([&] { fp8_gemm(p); }, {"fp8_gemm: a: expected"}));
  p = args.params();
  p.b.dtype = DType::kBFloat16;
  EXPECT_TRUE(throws_error([&] { fp8_gemm(p); }, {"fp8_gemm: b: expected dtype float8_e4m3fn"}));
  p = args.params();
  p.d.strides[0] = GemmArgs::N - 2;
  EXPECT_TRUE(throws_error([&] { fp8_gemm(p); }, {"fp8_gemm: d: expected a row stride >= its 6"}));
  p = args.params();
  p.d.strides[1] = 2;
  EXPECT_TRUE(throws_error([&] { fp8_gemm(p); }, {"fp8_gemm: d: expected its last dim contiguous"}));
}

TEST(Validation, EmptyGemmIsANoOpThatWritesNothing) {
  GemmArgs args;
  auto p = args.params();
  p.a.sizes[0] = 0;
  p.d.sizes[0] = 0;
  EXPECT_NO_THROW(fp8_gemm(p));
  p = args.params();
  p.b.sizes[0] = 0;
  p.d.sizes[1] = 0;
  EXPECT_NO_THROW(fp8_gemm(p));
  EXPECT_TRUE(untouched(args.d));
}

// ---- packed projection -------------------------------------------------------------------------

/// Valid packed forward/backward arguments: T=4, C=16, H=2, D=32, Dv=16 (qkv_dim 160).
struct PackedArgs {
  static constexpr int64_t T = 4, C = 16, H = 2, D = 32, Dv = 16;
  static constexpr int64_t kQk = 2 * H * D, kV = H * Dv, kQkv = kQk + kV;
  HostTensor x_f8{DType::kFloat8E4M3, {T, C}};
  HostTensor x_f8_t{DType::kFloat8E4M3, {C, T}};
  HostTensor weight_f8{DType::kFloat8E4M3, {kQkv, C}};
  HostTensor weight_f8_t{DType::kFloat8E4M3, {C, kQkv}};
  HostTensor scale{DType::kFloat32, {}};  // every scale
  HostTensor factor1{DType::kBFloat16, {T, D}};
  HostTensor factor2{DType::kBFloat16, {T, D}};
  HostTensor qkv{DType::kBFloat16, {T, kQkv}};
  HostTensor q{DType::kBFloat16, {T, H, D}};
  HostTensor k{DType::kBFloat16, {T, H, D}};
  HostTensor grad_q{DType::kBFloat16, {T, H, D}};
  HostTensor grad_k{DType::kBFloat16, {T, H, D}};
  HostTensor grad_v{DType::kBFloat16, {T, H, Dv}};
  HostTensor qk_saved{DType::kBFloat16, {T, 2 * H, D}};
  HostTensor qk_weight{DType::kBFloat16, {kQk, C}};
  HostTensor v_weight{DType::kBFloat16, {kV, C}};
  HostTensor grad_row{DType::kFloat8E4M3, {T, kQkv}};
  HostTensor grad_t{DType::kFloat8E4M3, {kQkv, T}};
  HostTensor partials{DType::kFloat32, {kGradScalePartials}};
  HostTensor grad_x{DType::kBFloat16, {T, C}};
  HostTensor grad_weight{DType::kBFloat16, {kQkv, C}};
  HostTensor grad_qkv_scale{DType::kFloat32, {1}};

  PackedArgs() {
    for (HostTensor* input : {&x_f8, &x_f8_t, &weight_f8, &weight_f8_t, &scale, &factor1, &grad_q,
                              &grad_k, &grad_v, &qk_saved, &qk_weight, &v_weight}) {
      input->set(std::vector<double>(size_t(input->numel()), 1.0));
    }
    factor2.set(std::vector<double>(size_t(factor2.numel()), 0.0));
  }
  RopeLayout layout() { return tables_layout(H, D, false, false, factor1.view(), factor2.view()); }
  TensorView qk_out() {
    return make_view(qkv.view().data, DType::kBFloat16, kCPU, {T, 2 * H, D}, {kQkv, D, 1});
  }
  TensorView v_out() {
    return make_view(static_cast<uint16_t*>(qkv.view().data) + kQk, DType::kBFloat16, kCPU,
                     {T, H, Dv}, {kQkv, Dv, 1});
  }
  PackedQkvForwardParams forward() {
    return {.x_f8 = x_f8.view(),
            .weight_f8 = weight_f8.view(),
            .x_scale = scale.view(),
            .weight_scale = scale.view(),
            .qkv_scale = scale.view(),
            .qk = qk_out(),
            .v = v_out(),
            .q = q.view(),
            .k = k.view(),
            .layout = layout()};
  }
  PackedQkvBackwardParams backward() {
    const TensorView grad_qk_weight =
        make_view(grad_weight.view().data, DType::kBFloat16, kCPU, {kQk, C});
    const TensorView grad_v_weight = make_view(
        static_cast<uint16_t*>(grad_weight.view().data) + kQk * C, DType::kBFloat16, kCPU, {kV, C});
    return {.grad_q = grad_q.view(),
            .grad_k = grad_k.view(),
            .grad_v = grad_v.view(),
            .qk = qk_saved.view(),
            .x_f8_t = x_f8_t.view(),
            .weight_f8_t = weight_f8_t.view(),
            .qk_weight = qk_weight.view(),
            .v_weight = v_weight.view(),
            .x_scale = scale.view(),
            .weight_scale = scale.view(),
            .qkv_scale = scale.view(),
            .grad_scale = scale.view(),
            .grad_row = grad_row.view(),
            .grad_t = grad_t.view(),
            .partials = partials.view(),
            .grad_x = grad_x.view(),
            .grad_qk_weight = grad_qk_weight,
            .grad_v_weight = grad_v_weight,
            .grad_qkv_scale = grad_qkv_scale.view(),
            .layout = layout()};
  }
};

TEST(Validation, ValidPackedCallsSucceed) {
  PackedArgs args;
  EXPECT_NO_THROW(packed_qkv_forward(args.forward()));
  EXPECT_NO_THROW(packed_qkv_backward(args.backward()));
}

TEST(Validation, PackedForwardChecks) {
  PackedArgs args;
  auto p = args.forward();
  p.x_f8.dtype = DType::kBFloat16;
  EXPECT_TRUE(throws_error([&] { packed_qkv_forward(p); },
                           {"packed_qkv_forward: x_f8: expected dtype float8_e4m3fn"}));
  p = args.forward();
  p.weight_f8.sizes[0] = PackedArgs::kQkv - 16;
  EXPECT_TRUE(throws_error([&] { packed_qkv_forward(p); },
                           {"weight_f8: expected shape [160, 16] (qkv_dim = (Hq + Hkv)*D + Hkv*Dv = 160"}));
  p = args.forward();
  p.qk.strides[1] = PackedArgs::D + 2;
  EXPECT_TRUE(
      throws_error([&] { packed_qkv_forward(p); }, {"qk: expected its heads packed in each row"}));
  p = args.forward();
  p.v.sizes[0] = PackedArgs::T - 1;
  EXPECT_TRUE(
      throws_error([&] { packed_qkv_forward(p); }, {"v: expected shape [4, 2, Dv] (T from x_f8"}));
  p = args.forward();
  p.layout.num_heads = 4;
  EXPECT_TRUE(
      throws_error([&] { packed_qkv_forward(p); }, {"qk: expected shape", "num_heads + num_kv_heads = 8"}));
  p = args.forward();
  p.qkv_scale = alias(p.qkv_scale, DType::kFloat32, {2});
  EXPECT_TRUE(
      throws_error([&] { packed_qkv_forward(p); }, {"qkv_scale: expected a float32 scalar"}));
  p = args.forward();
  p.q = alias(p.x_f8, DType::kBFloat16, {PackedArgs::T, PackedArgs::H, PackedArgs::D});
  EXPECT_TRUE(throws_error([&] { packed_qkv_forward(p); }, {"q: overlaps input x_f8"}));
  p = args.forward();
  p.v.strides[0] = PackedArgs::kQkv - 8;  // v's rows now run into the next row's qk
  EXPECT_TRUE(throws_error([&] { packed_qkv_forward(p); }, {"qk: overlaps output v"}));
  // Token strides below one token's row: the message names the argument, not the GEMM's d.
  p = args.forward();
  p.qk.strides[0] = PackedArgs::kQk - 2;
  EXPECT_TRUE(throws_error([&] { packed_qkv_forward(p); },
                           {"packed_qkv_forward: qk: expected a token stride >= its 128 elements"}));
  p = args.forward();
  p.v.strides[0] = PackedArgs::kV - 2;
  EXPECT_TRUE(throws_error([&] { packed_qkv_forward(p); },
                           {"packed_qkv_forward: v: expected a token stride >= its 32 elements"}));
  p = args.forward();
  p.x_f8.strides[1] = 2;
  EXPECT_TRUE(throws_error([&] { packed_qkv_forward(p); }, {"packed_qkv_forward: x_f8"}));
  p = args.forward();
  p.weight_f8.dtype = DType::kBFloat16;
  EXPECT_TRUE(throws_error([&] { packed_qkv_forward(p); },
                           {"packed_qkv_forward: weight_f8: expected dtype float8_e4m3fn"}));
  p = args.forward();
  p.qk.dtype = DType::kFloat32;
  EXPECT_TRUE(throws_error([&] { packed_qkv_forward(p); },
                           {"packed_qkv_forward: qk: expected dtype bfloat16"}));
}

TEST(Validation, PackedForwardRefusesBeforeWritingAnything) {
  // A bad factor table is only seen by the qk_norm_rope step; the GEMM before it must not run.
  PackedArgs args;
  auto p = args.forward();
  p.layout.factor1.sizes[1] = PackedArgs::D + 2;
  EXPECT_TRUE(throws_error([&] { packed_qkv_forward(p); },
                           {"packed_qkv_forward", "factor1: expected shape [4, 32]"}));
  EXPECT_TRUE(untouched(args.qkv));
  EXPECT_TRUE(untouched(args.q));
}

TEST(Validation, PackedBackwardChecks) {
  PackedArgs args;
  auto p = args.backward();
  p.x_f8_t.sizes[1] = PackedArgs::T + 1;
  EXPECT_TRUE(throws_error([&] { packed_qkv_backward(p); },
                           {"packed_qkv_backward: x_f8_t: expected shape [C, 4] (T from qk)"}));
  p = args.backward();
  p.weight_f8_t.sizes[1] = PackedArgs::kQkv + 16;
  EXPECT_TRUE(
      throws_error([&] { packed_qkv_backward(p); }, {"weight_f8_t: expected shape [16, 160]"}));
  p = args.backward();
  p.qk_weight.sizes[0] = PackedArgs::kQk + 1;
  EXPECT_TRUE(throws_error([&] { packed_qkv_backward(p); },
                           {"qk_weight: expected shape [128, 16] ([(Hq+Hkv)*D, C])"}));
  p = args.backward();
  p.grad_v_weight.strides[0] = PackedArgs::C + 1;
  EXPECT_TRUE(throws_error([&] { packed_qkv_backward(p); },
                           {"grad_v_weight: expected a row-major contiguous"}));
  p = args.backward();
  p.partials.sizes[0] = 8;
  EXPECT_TRUE(throws_error([&] { packed_qkv_backward(p); }, {"partials: expected shape [264]"}));
  p = args.backward();
  p.grad_qkv_scale.dtype = DType::kFloat64;
  EXPECT_TRUE(
      throws_error([&] { packed_qkv_backward(p); }, {"grad_qkv_scale: expected a float32 scalar"}));
  p = args.backward();
  p.grad_x = alias(p.grad_row, DType::kBFloat16, {PackedArgs::T, PackedArgs::C});
  EXPECT_TRUE(throws_error([&] { packed_qkv_backward(p); }, {"grad_row: overlaps output grad_x"}));
  p = args.backward();
  p.grad_qk_weight = alias(p.qk_weight, DType::kBFloat16, {PackedArgs::kQk, PackedArgs::C});
  EXPECT_TRUE(
      throws_error([&] { packed_qkv_backward(p); }, {"grad_qk_weight: overlaps input qk_weight"}));

  // One broken argument at a time, each refused with a message that names it.
  struct Case {
    const char* expected;
    void (*breaks)(PackedQkvBackwardParams&);
  };
  const Case cases[] = {
      {"packed_qkv_backward: qk: expected dtype", [](auto& q) { q.qk.dtype = DType::kFloat32; }},
      {"packed_qkv_backward: qk: expected shape", [](auto& q) { q.qk.sizes[1] = 3; }},
      {"packed_qkv_backward: grad_v: expected dtype",
       [](auto& q) { q.grad_v.dtype = DType::kFloat32; }},
      {"packed_qkv_backward: grad_v: expected shape [4, 2, Dv]",
       [](auto& q) { q.grad_v.sizes[1] = 3; }},
      {"packed_qkv_backward: x_f8_t: expected dtype",
       [](auto& q) { q.x_f8_t.dtype = DType::kBFloat16; }},
      {"packed_qkv_backward: x_f8_t", [](auto& q) { q.x_f8_t.strides[1] = 2; }},
      {"packed_qkv_backward: weight_f8_t: expected dtype",
       [](auto& q) { q.weight_f8_t.dtype = DType::kBFloat16; }},
      {"packed_qkv_backward: weight_f8_t", [](auto& q) { q.weight_f8_t.strides[1] = 2; }},
      {"packed_qkv_backward: qk_weight: expected dtype",
       [](auto& q) { q.qk_weight.dtype = DType::kFloat32; }},
      {"packed_qkv_backward: v_weight: expected shape",
       [](auto& q) { q.v_weight.sizes[0] = PackedArgs::kV + 2; }},
      {"packed_qkv_backward: partials: expected dtype",
       [](auto& q) { q.partials.dtype = DType::kFloat64; }},
      {"packed_qkv_backward: grad_x: expected dtype",
       [](auto& q) { q.grad_x.dtype = DType::kFloat32; }},
      {"packed_qkv_backward: grad_x: expected shape [4, 16]",
       [](auto& q) { q.grad_x.sizes[1] = PackedArgs::C - 2; }},
      {"packed_qkv_backward: grad_x", [](auto& q) { q.grad_x.strides[1] = 2; }},
      {"packed_qkv_backward: grad_scale: expected a float32 scalar",
       [](auto& q) { q.grad_scale.dtype = DType::kFloat64; }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.expected);
    p = args.backward();
    c.breaks(p);
    EXPECT_TRUE(throws_error([&] { packed_qkv_backward(p); }, {c.expected}));
  }
  for (const HostTensor* out :
       {&args.grad_row, &args.grad_t, &args.grad_x, &args.grad_weight, &args.grad_qkv_scale}) {
    EXPECT_TRUE(untouched(*out));
  }
}

TEST(Validation, PackedBackwardRefusesBeforeWritingAnything) {
  // A bad grad_q is only seen by the qkv_backward_fp8 step's own checks.
  PackedArgs args;
  auto p = args.backward();
  p.grad_q.sizes[0] = PackedArgs::T - 1;
  EXPECT_TRUE(throws_error([&] { packed_qkv_backward(p); },
                           {"packed_qkv_backward", "grad_q: expected shape [4, 2, 32]"}));
  for (const HostTensor* out :
       {&args.grad_row, &args.grad_t, &args.grad_x, &args.grad_weight, &args.grad_qkv_scale}) {
    EXPECT_TRUE(untouched(*out));
  }
}

TEST(Validation, EmptyPackedWorkIsANoOpThatWritesNothing) {
  PackedArgs args;
  auto f = args.forward();
  f.x_f8.sizes[0] = f.qk.sizes[0] = f.v.sizes[0] = f.q.sizes[0] = f.k.sizes[0] = 0;
  f.layout.factor1.sizes[0] = f.layout.factor2.sizes[0] = 0;
  EXPECT_NO_THROW(packed_qkv_forward(f));
  auto b = args.backward();
  for (TensorView* view :
       {&b.grad_q, &b.grad_k, &b.grad_v, &b.qk, &b.layout.factor1, &b.layout.factor2, &b.grad_row, &b.grad_x}) {
    view->sizes[0] = 0;
  }
  b.x_f8_t.sizes[1] = b.grad_t.sizes[1] = 0;
  EXPECT_NO_THROW(packed_qkv_backward(b));
  for (const HostTensor* out : {&args.qkv, &args.q, &args.k, &args.grad_row, &args.grad_t,
                                &args.grad_x, &args.grad_weight, &args.grad_qkv_scale}) {
    EXPECT_TRUE(untouched(*out));
  }
}

TEST(Validation, NullDataAndMissingArgumentsAreRefused) {
  RopeArgs args;
  auto p = args.forward();
  p.qk.data = nullptr;
  EXPECT_TRUE(
      throws_error([&] { qk_norm_rope(p); }, {"qk: has 512 elements but a null data pointer"}));
  p = args.forward();
  p.k = TensorView{};
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(p); }, {"qk_norm_rope: k: missing"}));
  GemmArgs gemm;
  auto g = gemm.params();
  g.scale_b = TensorView{};  // only alpha is optional
  EXPECT_TRUE(throws_error([&] { fp8_gemm(g); }, {"fp8_gemm: scale_b: missing"}));
}

TEST(Validation, QuantizeAndGemmScalesOnAnotherDeviceAreRefused) {
  QuantizeArgs quantize;
  auto dual = quantize.dual();
  dual.scale = on_device(dual.scale, kCuda0);
  EXPECT_TRUE(throws_error([&] { quantize_dual_layout(dual); },
                           {"quantize_dual_layout: scale: is on cuda:0, but src is on cpu"}));
  GemmArgs gemm;
  auto p = gemm.params();
  p.scale_b = on_device(p.scale_b, kCuda0);
  EXPECT_TRUE(throws_error([&] { fp8_gemm(p); },
                           {"fp8_gemm: scale_b: is on cuda:0, but a is on cpu"}));
}

// ---- SPEC.md section 9: the families' options ----------------------------------------------------

TEST(ValidationFamilies, QueryOnlyRefusals) {
  const auto query_only = [](RopeLayout& l) {
    l.query_only = true;
    l.num_kv_heads = 0;
    l.k_weight = TensorView{};
  };
  expect_layout_refused([](RopeLayout& l) { l.query_only = true; },
                        {"layout.num_kv_heads: expected 0 with layout.query_only (no key heads), got 2"});
  expect_layout_refused(
      [&](RopeLayout& l) {
        query_only(l);
        l.key_offset = true;
      },
      {"layout.query_only: has no key heads, so neither layout.paired nor layout.key_offset"});
  expect_layout_refused(
      [&](RopeLayout& l) {
        query_only(l);
        l.paired = true;
      },
      {"layout.query_only: has no key heads, so neither layout.paired nor layout.key_offset"}, true);
  LayoutArgs tensors;
  const TensorView k_weight = tensors.k_weight.view();
  expect_layout_refused(
      [&](RopeLayout& l) {
        query_only(l);
        l.k_weight = k_weight;
      },
      {"layout.k_weight: given, but layout.query_only has no key rows"});
  expect_layout_refused(
      [&](RopeLayout& l) {
        query_only(l);
        l.normalize_v = true;
      },
      {"layout.normalize_v: expected false with layout.query_only (no V heads to normalize), got "
       "true"});
  // A valid query-only layout on these [T, Hq + Hkv, D] arguments: qk's shape is then wrong.
  expect_layout_refused(query_only,
                        {"qk: expected shape [T, 4, 32] (layout.query_only: layout.num_heads = 4 heads)"});
}

TEST(ValidationFamilies, NormScopeAndVNormRefusals) {
  expect_layout_refused([](RopeLayout& l) { l.norm_scope = static_cast<NormScope>(5); },
                        {"layout.norm_scope: expected NormScope::kHead or NormScope::kToken, got 5"});
  expect_layout_refused(
      [](RopeLayout& l) {
        l.norm_scope = NormScope::kToken;
        l.normalize_v = true;
      },
      {"layout.normalize_v: defined with layout.norm_scope = NormScope::kHead only"});
  // Token scope: the weights are [Hq*D] and [Hkv*D], not [D].
  expect_layout_refused([](RopeLayout& l) { l.norm_scope = NormScope::kToken; },
                        {"layout.q_weight: expected shape [128] (layout.norm_scope = "
                         "NormScope::kToken: [layout.num_heads * D]), got [32]"});
  // The V norm reads v: the rope ops' V tensors go with it (named per op below).
  LayoutArgs args;
  auto f = args.forward();
  f.layout.normalize_v = true;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(f); },
                           {"qk_norm_rope: v: missing (layout.normalize_v reads the V heads)"}));
  auto p = args.fp8();
  p.layout.normalize_v = true;
  EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(p); },
                           {"qkv_backward_fp8: v: missing (layout.normalize_v reads the V heads)"}));
  f = args.forward();
  f.v = args.grad_v.view();
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(f); },
                           {"qk_norm_rope: v: given, but layout.normalize_v is false"}));
  f = args.forward();
  f.layout.normalize_v = true;
  f.v = args.grad_v.view();
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(f); }, {"qk_norm_rope: v_out: missing"}));
  HostTensor v_out(DType::kBFloat16, {LayoutArgs::T, LayoutArgs::Hkv, LayoutArgs::Dv + 1});
  f.v_out = v_out.view();
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(f); },
                           {"qk_norm_rope: v_out: expected shape [4, 2, 16] (v's shape)"}));
  auto b = args.backward();
  b.layout.normalize_v = true;
  b.v = args.grad_v.view();
  b.grad_v_out = args.grad_v.view();
  EXPECT_TRUE(throws_error([&] { qk_norm_rope_backward(b); },
                           {"qk_norm_rope_backward: grad_v: missing"}));
  EXPECT_TRUE(args.nothing_written());
}

TEST(ValidationFamilies, NoAngleSourceRefusals) {
  const auto no_angles = [](RopeLayout& l) {
    l.cos_sin = TensorView{};
    l.positions = TensorView{};
    l.rotary_dim = -1;
  };
  expect_layout_refused(
      [&](RopeLayout& l) {
        no_angles(l);
        l.rotary_dim = 2;
      },
      {"layout.rotary_dim: expected -1 (the default) or 0 without an angle source"});
  expect_layout_refused(
      [&](RopeLayout& l) {
        no_angles(l);
        l.num_kv_heads = 0;
        l.paired = true;
      },
      {"layout.paired: defined with factor tables [T, 2D] only, got no angle source"});
  // Valid without angles: nothing rotates.
  LayoutArgs args;
  auto f = args.forward();
  no_angles(f.layout);
  EXPECT_NO_THROW(qk_norm_rope(f));
}

TEST(ValidationFamilies, HeadWidthUpTo512) {
  // D = 512 is valid (the shapes of these arguments are not, past the head width).
  LayoutArgs args;
  auto f = args.forward();
  f.qk.sizes[2] = 512;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(f); },
                           {"qk_norm_rope: layout.q_weight: expected shape [512] ([D])"}));
  // Past 512 no backend takes it: refused as unsupported, and on CUDA not as a pending option.
  f.qk.sizes[2] = 514;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(f); },
                           {"qk_norm_rope: qk: head width D = 514 is not supported: expected an "
                            "even D in [2, 512]"}));
  EXPECT_EQ(validate::cuda_pending_option(args.layout(), 514), "");
  validate::set_cuda_section9_for_testing(false);  // the refusal: the switch's off state
  EXPECT_EQ(validate::cuda_pending_option(args.layout(), 512), "qk: head width D = 512 (above 256)");
}

/// `view` as if it lived on cuda:0 (the pointer is never read: the pending-option check reads
/// only the device and the shape, and runs first).
TensorView on_cuda(TensorView view) {
  view.device = Device{DeviceType::kCUDA, 0};
  return view;
}

TEST(ValidationFamilies, CudaRefusesEachPendingOptionByName) {
  // Checked on the host before any CUDA call, so a build without CUDA (CI) gives the message too.
  // The refusals are the switch's off state (whatever QKVFUSE_CUDA_SECTION9 says).
  validate::set_cuda_section9_for_testing(false);
  struct Pending {
    std::function<void(RopeLayout&, TensorView&)> set;
    std::string name;
  };
  const std::vector<Pending> pending = {
      {[](RopeLayout&, TensorView& qk) { qk.sizes[2] = 512; }, "qk: head width D = 512 (above 256)"},
      {[](RopeLayout& l, TensorView&) { l.normalize_v = true; }, "layout.normalize_v"},
      {[](RopeLayout& l, TensorView&) { l.norm_scope = NormScope::kToken; },
       "layout.norm_scope: NormScope::kToken (one RMS over the token)"},
      {[](RopeLayout& l, TensorView&) { l.query_only = true; }, "layout.query_only"},
      {[](RopeLayout& l, TensorView&) {
         l.cos_sin = TensorView{};
         l.positions = TensorView{};
       },
       "layout.factor1, layout.cos_sin: none (a call without rotary)"},
  };
  for (const Pending& option : pending) {
    SCOPED_TRACE(option.name);
    const std::string refused = ": " + option.name + ": not yet on the CUDA backend";
    LayoutArgs args;
    auto f = args.forward();
    f.qk = on_cuda(f.qk);
    option.set(f.layout, f.qk);
    EXPECT_TRUE(throws_error([&] { qk_norm_rope(f); }, {"qk_norm_rope" + refused}));
    auto b = args.backward();
    b.qk = on_cuda(b.qk);
    option.set(b.layout, b.qk);
    EXPECT_TRUE(throws_error([&] { qk_norm_rope_backward(b); }, {"qk_norm_rope_backward" + refused}));
    auto p = args.fp8();
    p.qk = on_cuda(p.qk);
    option.set(p.layout, p.qk);
    EXPECT_TRUE(throws_error([&] { qkv_backward_fp8(p); }, {"qkv_backward_fp8" + refused}));
    PackedQkvForwardParams forward;
    forward.qk = on_cuda(args.qk.view());
    option.set(forward.layout = args.layout(), forward.qk);
    EXPECT_TRUE(throws_error([&] { packed_qkv_forward(forward); }, {"packed_qkv_forward" + refused}));
    PackedQkvBackwardParams backward;
    backward.qk = on_cuda(args.qk.view());
    option.set(backward.layout = args.layout(), backward.qk);
    EXPECT_TRUE(
        throws_error([&] { packed_qkv_backward(backward); }, {"packed_qkv_backward" + refused}));
    EXPECT_TRUE(args.nothing_written());
  }
  // The section 8 layout itself is not refused by this check (it goes on to the device checks).
  RopeLayout plain;
  EXPECT_EQ(validate::cuda_pending_option(plain, 256),
            "layout.factor1, layout.cos_sin: none (a call without rotary)");
  LayoutArgs args;
  EXPECT_EQ(validate::cuda_pending_option(args.layout(), 256), "");
  // The refusal says how to opt in.
  auto f = args.forward();
  f.qk = on_cuda(f.qk);
  f.layout.query_only = true;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(f); },
                           {"set QKVFUSE_CUDA_SECTION9=1 to try the untested kernels"}));
}

TEST(ValidationFamilies, CudaSection9SwitchLetsEachOptionPass) {
  // QKVFUSE_CUDA_SECTION9=1 (here its test hook): none of section 9's options is pending on CUDA;
  // a head wider than 512 stays unsupported everywhere. Off again: each is refused as before.
  RopeLayout layout;
  layout.num_heads = 2;
  layout.normalize_v = true;
  layout.norm_scope = NormScope::kToken;
  layout.query_only = true;
  EXPECT_NE(validate::cuda_pending_option(layout, 512), "");
  validate::set_cuda_section9_for_testing(true);
  EXPECT_TRUE(validate::cuda_section9_enabled());
  EXPECT_EQ(validate::cuda_pending_option(layout, 512), "");
  EXPECT_EQ(validate::cuda_pending_option(layout, 384), "");
  EXPECT_EQ(validate::cuda_pending_option(RopeLayout{}, 256), "");  // no angle source
  LayoutArgs args;
  auto f = args.forward();
  f.qk.sizes[2] = 514;
  EXPECT_TRUE(throws_error([&] { qk_norm_rope(f); },
                           {"qk_norm_rope: qk: head width D = 514 is not supported"}));
  validate::set_cuda_section9_for_testing(false);
  EXPECT_FALSE(validate::cuda_section9_enabled());
  EXPECT_EQ(validate::cuda_pending_option(layout, 512), "qk: head width D = 512 (above 256)");
  EXPECT_EQ(validate::cuda_pending_option(RopeLayout{}, 256),
            "layout.factor1, layout.cos_sin: none (a call without rotary)");
}

}  // namespace
}  // namespace qkvfuse::test
