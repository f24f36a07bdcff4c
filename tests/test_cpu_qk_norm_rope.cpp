// test_cpu_qk_norm_rope.cpp: the CPU QK-norm + rotary, forward and backward (SPEC.md sections 1
// and 2), against the float64 reference and against finite differences.
//
// Tolerances: bf16 outputs within one bf16 ulp of the reference rounded to bf16 (a correct fp32
// computation lands on either side of a rounding boundary); beyond that only where the row's
// values cancel, within kFp32Noise of the row's largest value (see reference.hpp row_noise).
// float32 outputs within kFp32Noise of the row, float64 outputs within 1e-12 of the row.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "qkvfuse/qk_norm_rope.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace qkvfuse::test {
namespace {

constexpr double kFp32Noise = 1.0 / (1 << 18);  // 64 fp32 ulps of the row's largest value
constexpr double kFp64Noise = 1e-12;

// ---- cases and inputs --------------------------------------------------------------------------

struct RopeCase {
  int64_t tokens = 1;
  int64_t heads = 1;
  int64_t head_dim = 64;
  bool paired = false;
  bool key_offset = false;
  int64_t rotary_dim = 0;  ///< with key offset (r = D otherwise: the tables rotate every lane)
  DType dtype = DType::kBFloat16;
  DType factor_dtype = DType::kBFloat16;
  int64_t qk_extra_columns = 0;  ///< qk is a column slice of a wider [T, 2HD + extra] buffer
  int64_t grad_padding = 0;      ///< backward: grad_q/grad_k rows and heads padded by this much

  std::string describe() const {
    std::ostringstream out;
    out << "T=" << tokens << " H=" << heads << " D=" << head_dim << (paired ? " paired" : "")
        << (key_offset ? " key_offset rotary_dim=" : "")
        << (key_offset ? std::to_string(rotary_dim) : "") << " qk " << dtype_name(dtype)
        << " factors " << dtype_name(factor_dtype) << " extra columns " << qk_extra_columns
        << " grad padding " << grad_padding;
    return out.str();
  }
  int64_t rotary() const { return key_offset ? rotary_dim : head_dim; }
  ref::Rope rope() const { return {tokens, heads, head_dim, rotary(), paired, key_offset}; }
  RopeLayout layout(const TensorView& factor1, const TensorView& factor2) const {
    return tables_layout(heads, rotary(), paired, key_offset, factor1, factor2);
  }
};

/// The inputs of one case: dense values for the reference and host tensors for the op.
struct RopeInputs {
  std::vector<double> qk, factor1, factor2;
  HostTensor qk_tensor, factor1_tensor, factor2_tensor;

  RopeInputs(const RopeCase& c, std::mt19937_64& rng)
      : qk_tensor(c.dtype, {c.tokens, 2 * c.heads, c.head_dim},
                  {2 * c.heads * c.head_dim + c.qk_extra_columns, c.head_dim, 1},
                  c.qk_extra_columns / 2),
        factor1_tensor(c.factor_dtype, {c.tokens, c.rope().factor_width()}),
        factor2_tensor(c.factor_dtype, {c.tokens, c.rope().factor_width()}) {
    qk = random_values(rng, size_t(c.tokens * 2 * c.heads * c.head_dim), c.dtype);
    const bool fine_factors = c.factor_dtype != DType::kBFloat16;
    rotary_factor_values(rng, c.tokens, c.head_dim, c.paired ? 2 : 1, c.rotary(), fine_factors,
                         factor1, factor2);
    qk_tensor.set(qk);
    factor1_tensor.set(factor1);
    factor2_tensor.set(factor2);
  }
  RopeLayout layout(const RopeCase& c) {
    return c.layout(factor1_tensor.view(), factor2_tensor.view());
  }
};

/// An output or gradient tensor in the forward's output layout, padded by `padding` elements
/// per head and per token row when asked.
HostTensor output_tensor(const RopeCase& c, int64_t padding) {
  const ref::Rope rope = c.rope();
  const int64_t head_stride = c.head_dim + padding;
  return HostTensor(c.dtype, {rope.out_tokens(), rope.out_heads(), c.head_dim},
                    {rope.out_heads() * head_stride + padding, head_stride, 1});
}

/// Compares by dtype: bf16 by ulps, float32 and float64 by the row-scaled tolerance.
::testing::AssertionResult matches(const std::string& what, DType dtype, const HostTensor& got,
                                   const std::vector<double>& expected, int64_t row_length) {
  if (dtype == DType::kBFloat16) {
    return passes(compare_bf16(what, got.get_bf16_bits(), expected,
                               row_noise(expected, row_length, kFp32Noise)));
  }
  const double noise = dtype == DType::kFloat32 ? kFp32Noise : kFp64Noise;
  return passes(compare_close(what, got.get(), expected, row_noise(expected, row_length, noise)));
}

// ---- forward -----------------------------------------------------------------------------------

void check_forward(const RopeCase& c) {
  SCOPED_TRACE(c.describe());
  auto rng = rng_for_test();
  RopeInputs in(c, rng);
  HostTensor q = output_tensor(c, 0);
  HostTensor k = output_tensor(c, 0);
  qk_norm_rope({in.qk_tensor.view(), q.view(), k.view(), in.layout(c)});
  const ref::QkPair expected = ref::rope_forward(c.rope(), in.qk, in.factor1, in.factor2);
  EXPECT_TRUE(matches("q", c.dtype, q, expected.q, c.head_dim));
  EXPECT_TRUE(matches("k", c.dtype, k, expected.k, c.head_dim));
  EXPECT_EQ(in.qk_tensor.padding_touched(), 0) << "qk's buffer outside the view was written";
}

/// The shapes every mode runs at: odd token counts, 1/2/6 heads, the model widths and widths
/// that are not multiples of 8.
std::vector<RopeCase> sweep_cases() {
  std::vector<RopeCase> cases;
  for (int64_t tokens : {1, 3, 17}) {
    for (int64_t heads : {1, 2, 6}) {
      for (int64_t head_dim : {32, 34, 50, 64, 96, 128, 256}) {
        RopeCase plain;
        plain.tokens = tokens;
        plain.heads = heads;
        plain.head_dim = head_dim;
        cases.push_back(plain);
        RopeCase shifted = plain;
        shifted.key_offset = true;
        shifted.rotary_dim = head_dim / 4 * 2;  // D/2 rounded down to even
        cases.push_back(shifted);
        if (heads % 2 == 0) {
          RopeCase paired = plain;
          paired.paired = true;
          cases.push_back(paired);
        }
      }
    }
  }
  return cases;
}

TEST(CpuQkNormRope, ForwardMatchesReferenceAcrossShapesAndModes) {
  for (const RopeCase& c : sweep_cases()) check_forward(c);
}

TEST(CpuQkNormRope, ForwardModelShapes) {
  for (int64_t head_dim : {64, 96, 128}) {
    RopeCase c;
    c.tokens = 64;
    c.heads = 6;
    c.head_dim = head_dim;
    c.qk_extra_columns = 6 * 128;  // qk is the Q/K column block of the [T, qkv_dim] GEMM output
    check_forward(c);
    c.paired = true;
    check_forward(c);
    c.paired = false;
    c.key_offset = true;
    c.rotary_dim = head_dim / 2;
    check_forward(c);
  }
}

TEST(CpuQkNormRope, ForwardFloat32FactorsAndFloatQk) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat32, DType::kFloat64}) {
    for (DType factor_dtype : {DType::kBFloat16, DType::kFloat32, dtype}) {
      for (int mode = 0; mode < 3; ++mode) {
        RopeCase c;
        c.tokens = 5;
        c.heads = 2;
        c.head_dim = 96;
        c.dtype = dtype;
        c.factor_dtype = factor_dtype;
        c.paired = mode == 1;
        c.key_offset = mode == 2;
        c.rotary_dim = 48;
        check_forward(c);
      }
    }
  }
}

TEST(CpuQkNormRope, ForwardNonContiguousQk) {
  for (int mode = 0; mode < 3; ++mode) {
    RopeCase c;
    c.tokens = 7;
    c.heads = 6;
    c.head_dim = 64;
    c.qk_extra_columns = 6 * 128 + 8;
    c.paired = mode == 1;
    c.key_offset = mode == 2;
    c.rotary_dim = 32;
    check_forward(c);
  }
}

TEST(CpuQkNormRope, ForwardSmallestHeadWidths) {
  // Any even D from 2 (on CUDA too: the generic path, test_cuda_qk_norm_rope.cpp).
  for (int64_t head_dim : {2, 4, 6}) {
    RopeCase c;
    c.tokens = 3;
    c.heads = 2;
    c.head_dim = head_dim;
    check_forward(c);
    c.paired = true;
    check_forward(c);
  }
}

TEST(CpuQkNormRope, TinyRowsWhereEpsilonMatters) {
  // Rows of magnitude ~2^-12: mean(x^2) ~ 2^-24 is comparable to eps = 2^-23, so a wrong or
  // missing eps changes every output.
  RopeCase c;
  c.tokens = 5;
  c.heads = 2;
  c.head_dim = 64;
  auto rng = rng_for_test();
  RopeInputs in(c, rng);
  for (double& x : in.qk) x = ref::round_bf16(x / 4096);
  in.qk_tensor.set(in.qk);
  HostTensor q = output_tensor(c, 0), k = output_tensor(c, 0);
  qk_norm_rope({in.qk_tensor.view(), q.view(), k.view(), in.layout(c)});
  const ref::QkPair expected = ref::rope_forward(c.rope(), in.qk, in.factor1, in.factor2);
  EXPECT_TRUE(matches("q", c.dtype, q, expected.q, c.head_dim));
  EXPECT_TRUE(matches("k", c.dtype, k, expected.k, c.head_dim));

  const size_t out_count = size_t(c.tokens * c.heads * c.head_dim);
  const std::vector<double> grad_q = random_values(rng, out_count, c.dtype);
  const std::vector<double> grad_k = random_values(rng, out_count, c.dtype);
  HostTensor grad_q_tensor = output_tensor(c, 0), grad_k_tensor = output_tensor(c, 0);
  grad_q_tensor.set(grad_q);
  grad_k_tensor.set(grad_k);
  HostTensor grad_qk(c.dtype, {c.tokens, 2 * c.heads, c.head_dim});
  qk_norm_rope_backward({.grad_q = grad_q_tensor.view(),
                         .grad_k = grad_k_tensor.view(),
                         .qk = in.qk_tensor.view(),
                         .grad_qk = grad_qk.view(),
                         .layout = in.layout(c)});
  EXPECT_TRUE(matches("grad_qk", c.dtype, grad_qk,
                      ref::rope_backward(c.rope(), grad_q, grad_k, in.qk, in.factor1, in.factor2),
                      c.head_dim));
}

TEST(CpuQkNormRope, ForwardIsBitwiseDeterministic) {
  RopeCase c;
  c.tokens = 33;
  c.heads = 6;
  c.head_dim = 128;
  c.key_offset = true;
  c.rotary_dim = 64;
  auto rng = rng_for_test();
  RopeInputs in(c, rng);
  std::vector<std::vector<uint16_t>> runs;
  for (int run = 0; run < 2; ++run) {
    HostTensor q = output_tensor(c, 0);
    HostTensor k = output_tensor(c, 0);
    qk_norm_rope({in.qk_tensor.view(), q.view(), k.view(), in.layout(c)});
    std::vector<uint16_t> bits = q.get_bf16_bits();
    const std::vector<uint16_t> k_bits = k.get_bf16_bits();
    bits.insert(bits.end(), k_bits.begin(), k_bits.end());
    runs.push_back(bits);
  }
  EXPECT_EQ(runs[0], runs[1]);
}

// ---- index mappings, element by element --------------------------------------------------------

/// A qk whose row (t, h2) is the pattern [1, id+1, 1, id+1, ...] with id = t*2H + h2: after the
/// norm, the ratio of each odd lane to its even neighbour still names the source row.
std::vector<double> labelled_qk(int64_t tokens, int64_t heads2, int64_t head_dim) {
  std::vector<double> qk(size_t(tokens * heads2 * head_dim));
  for (int64_t row = 0; row < tokens * heads2; ++row) {
    for (int64_t d = 0; d < head_dim; ++d) qk[size_t(row * head_dim + d)] = (d % 2) ? row + 1 : 1;
  }
  return qk;
}

/// The source row id read back from lanes (d, d+1) of an output row.
int64_t label_of(const std::vector<double>& out, size_t even_lane) {
  return std::llround(out[even_lane + 1] / out[even_lane]) - 1;
}

TEST(CpuQkNormRope, PairedPlacementElementByElement) {
  const int64_t tokens = 3, heads = 4, head_dim = 8, half = heads / 2;
  // Factors: f2 = 0, so y = f1 * n; f1 names the factor row and half: 1 + (second half) + 4t.
  std::vector<double> factor1(size_t(tokens * 2 * head_dim)), factor2(factor1.size(), 0.0);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t col = 0; col < 2 * head_dim; ++col) {
      factor1[size_t(t * 2 * head_dim + col)] = 1 + (col >= head_dim ? 1 : 0) + 4 * t;
    }
  }
  const std::vector<double> qk = labelled_qk(tokens, 2 * heads, head_dim);
  HostTensor qk_tensor(DType::kBFloat16, {tokens, 2 * heads, head_dim});
  HostTensor f1(DType::kBFloat16, {tokens, 2 * head_dim}),
      f2(DType::kBFloat16, {tokens, 2 * head_dim});
  qk_tensor.set(qk);
  f1.set(factor1);
  f2.set(factor2);
  HostTensor q(DType::kBFloat16, {2 * tokens, half, head_dim});
  HostTensor k(DType::kBFloat16, {2 * tokens, half, head_dim});
  qk_norm_rope({qk_tensor.view(), q.view(), k.view(),
                tables_layout(heads, head_dim, true, false, f1.view(), f2.view())});

  for (int key = 0; key < 2; ++key) {
    const std::vector<double> out = (key ? k : q).get();
    for (int64_t out_token = 0; out_token < 2 * tokens; ++out_token) {
      for (int64_t out_head = 0; out_head < half; ++out_head) {
        // Inverse of the placement: output token 2t + h / (H/2), head h mod (H/2).
        const int64_t t = out_token / 2;
        const int64_t h = (out_token % 2) * half + out_head;
        const int64_t source = t * 2 * heads + key * heads + h;
        const double rstd =
            1 / std::sqrt((1 + double(source + 1) * (source + 1)) / 2 + 1.0 / (1 << 23));
        const double factor = 1 + (h % 2) + 4 * t;  // odd logical heads read the second half
        const size_t base = size_t((out_token * half + out_head) * head_dim);
        SCOPED_TRACE(::testing::Message()
                     << (key ? "k" : "q") << " token " << out_token << " head " << out_head);
        for (int64_t d = 0; d < head_dim; d += 2) {
          EXPECT_EQ(label_of(out, base + size_t(d)), source);
          EXPECT_NEAR(out[base + size_t(d)] / rstd, factor, factor / 64);
        }
      }
    }
  }
}

TEST(CpuQkNormRope, KeyOffsetPlacementElementByElement) {
  const int64_t tokens = 4, heads = 2, head_dim = 8, rotary_dim = 4;
  std::vector<double> factor1(size_t(tokens * head_dim), 1.0), factor2(factor1.size(), 0.0);
  const std::vector<double> qk = labelled_qk(tokens, 2 * heads, head_dim);
  HostTensor qk_tensor(DType::kBFloat16, {tokens, 2 * heads, head_dim});
  HostTensor f1(DType::kBFloat16, {tokens, head_dim}), f2(DType::kBFloat16, {tokens, head_dim});
  qk_tensor.set(qk);
  f1.set(factor1);
  f2.set(factor2);
  HostTensor q(DType::kBFloat16, {tokens, heads, head_dim});
  HostTensor k(DType::kBFloat16, {tokens, heads, head_dim});
  qk_norm_rope({qk_tensor.view(), q.view(), k.view(),
                tables_layout(heads, rotary_dim, false, true, f1.view(), f2.view())});

  for (int key = 0; key < 2; ++key) {
    const std::vector<double> out = (key ? k : q).get();
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const size_t base = size_t((t * heads + h) * head_dim);
        for (int64_t d = 0; d < head_dim; d += 2) {
          // Keys' stationary dims come from token t-1; token 0 and queries keep their own.
          const bool from_previous = key && t > 0 && d >= rotary_dim;
          const int64_t source = (from_previous ? t - 1 : t) * 2 * heads + key * heads + h;
          EXPECT_EQ(label_of(out, base + size_t(d)), source)
              << (key ? "k" : "q") << " token " << t << " head " << h << " dim " << d;
        }
      }
    }
  }
}

// ---- backward ----------------------------------------------------------------------------------

/// Runs the backward of case c with fresh gradients; returns grad_qk and the reference's.
void check_backward(const RopeCase& c) {
  SCOPED_TRACE(c.describe());
  auto rng = rng_for_test();
  RopeInputs in(c, rng);
  const ref::Rope rope = c.rope();
  const size_t out_count = size_t(rope.out_tokens() * rope.out_heads() * c.head_dim);
  const std::vector<double> grad_q = random_values(rng, out_count, c.dtype);
  const std::vector<double> grad_k = random_values(rng, out_count, c.dtype);
  HostTensor grad_q_tensor = output_tensor(c, c.grad_padding);
  HostTensor grad_k_tensor = output_tensor(c, c.grad_padding);
  grad_q_tensor.set(grad_q);
  grad_k_tensor.set(grad_k);
  HostTensor grad_qk(c.dtype, {c.tokens, 2 * c.heads, c.head_dim});
  qk_norm_rope_backward({.grad_q = grad_q_tensor.view(),
                         .grad_k = grad_k_tensor.view(),
                         .qk = in.qk_tensor.view(),
                         .grad_qk = grad_qk.view(),
                         .layout = in.layout(c)});
  const std::vector<double> expected =
      ref::rope_backward(rope, grad_q, grad_k, in.qk, in.factor1, in.factor2);
  EXPECT_TRUE(matches("grad_qk", c.dtype, grad_qk, expected, c.head_dim));
}

TEST(CpuQkNormRope, BackwardMatchesReferenceAcrossShapesAndModes) {
  for (const RopeCase& c : sweep_cases()) check_backward(c);
}

TEST(CpuQkNormRope, BackwardModelShapesWithStridedInputs) {
  for (int64_t head_dim : {64, 96, 128}) {
    RopeCase c;
    c.tokens = 64;
    c.heads = 6;
    c.head_dim = head_dim;
    c.qk_extra_columns = 6 * 128;
    c.grad_padding = 8;
    check_backward(c);
    c.paired = true;
    check_backward(c);
    c.paired = false;
    c.key_offset = true;
    c.rotary_dim = head_dim / 2;
    check_backward(c);
  }
}

TEST(CpuQkNormRope, KeyOffsetRotaryEdges) {
  // rotary_dim 0 (every key dim from the previous token, the t = 0 term included) up to D (none),
  // forward and backward.
  for (int64_t rotary_dim : {0, 2, 62, 64}) {
    RopeCase c;
    c.tokens = 4;
    c.heads = 2;
    c.head_dim = 64;
    c.key_offset = true;
    c.rotary_dim = rotary_dim;
    check_forward(c);
    check_backward(c);
  }
}

TEST(CpuQkNormRope, BackwardFloat32FactorsAndFloatQk) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat32, DType::kFloat64}) {
    for (DType factor_dtype : {DType::kBFloat16, DType::kFloat32, dtype}) {
      for (int mode = 0; mode < 3; ++mode) {
        RopeCase c;
        c.tokens = 5;
        c.heads = 2;
        c.head_dim = 50;
        c.dtype = dtype;
        c.factor_dtype = factor_dtype;
        c.paired = mode == 1;
        c.key_offset = mode == 2;
        c.rotary_dim = 24;
        c.grad_padding = 2;
        check_backward(c);
      }
    }
  }
}

// ---- finite differences ------------------------------------------------------------------------

/// d/dqk of L = sum(grad_q * q) + sum(grad_k * k) under the float64 reference forward, by
/// central differences (step 1e-6: truncation ~1e-12, cancellation ~1e-10 at these sizes).
std::vector<double> finite_difference(const ref::Rope& rope, std::vector<double> qk,
                                      const std::vector<double>& factor1,
                                      const std::vector<double>& factor2,
                                      const std::vector<double>& grad_q,
                                      const std::vector<double>& grad_k) {
  const auto loss = [&](const std::vector<double>& x) {
    const ref::QkPair out = ref::rope_forward(rope, x, factor1, factor2);
    double sum = 0;
    for (size_t i = 0; i < out.q.size(); ++i) sum += grad_q[i] * out.q[i] + grad_k[i] * out.k[i];
    return sum;
  };
  const double step = 1e-6;
  std::vector<double> grad(qk.size());
  for (size_t i = 0; i < qk.size(); ++i) {
    const double saved = qk[i];
    qk[i] = saved + step;
    const double above = loss(qk);
    qk[i] = saved - step;
    const double below = loss(qk);
    qk[i] = saved;
    grad[i] = (above - below) / (2 * step);
  }
  return grad;
}

TEST(CpuQkNormRope, BackwardAgreesWithFiniteDifferences) {
  auto rng = rng_for_test();
  for (int mode = 0; mode < 3; ++mode) {
    RopeCase c;
    c.tokens = 4;
    c.heads = 2;
    c.head_dim = 16;
    c.paired = mode == 1;
    c.key_offset = mode == 2;
    c.rotary_dim = 8;
    SCOPED_TRACE(c.describe());
    const ref::Rope rope = c.rope();
    const size_t out_count = size_t(rope.out_tokens() * rope.out_heads() * c.head_dim);
    // bf16-representable inputs, so the float64 and bf16 runs see the same values.
    c.dtype = DType::kBFloat16;
    RopeInputs in(c, rng);
    const std::vector<double> grad_q = random_values(rng, out_count, DType::kBFloat16);
    const std::vector<double> grad_k = random_values(rng, out_count, DType::kBFloat16);
    const std::vector<double> numeric =
        finite_difference(rope, in.qk, in.factor1, in.factor2, grad_q, grad_k);

    // The reference's own backward (the chain rule, scattered) against the differences.
    const std::vector<double> reference =
        ref::rope_backward(rope, grad_q, grad_k, in.qk, in.factor1, in.factor2);
    EXPECT_TRUE(passes(compare_close("reference vs finite differences", reference, numeric,
                                     row_noise(numeric, c.head_dim, 1e-7))));

    // The CPU backend: float64 to 1e-7 of the row (the differences' own accuracy), bf16 to one
    // ulp plus the fp32 noise.
    for (DType dtype : {DType::kFloat64, DType::kBFloat16}) {
      HostTensor grad_q_tensor(dtype, {rope.out_tokens(), rope.out_heads(), c.head_dim});
      HostTensor grad_k_tensor(dtype, {rope.out_tokens(), rope.out_heads(), c.head_dim});
      HostTensor qk(dtype, {c.tokens, 2 * c.heads, c.head_dim});
      HostTensor f1(dtype, {c.tokens, rope.factor_width()}),
          f2(dtype, {c.tokens, rope.factor_width()});
      grad_q_tensor.set(grad_q);
      grad_k_tensor.set(grad_k);
      qk.set(in.qk);
      f1.set(in.factor1);
      f2.set(in.factor2);
      HostTensor grad_qk(dtype, {c.tokens, 2 * c.heads, c.head_dim});
      qk_norm_rope_backward({.grad_q = grad_q_tensor.view(),
                             .grad_k = grad_k_tensor.view(),
                             .qk = qk.view(),
                             .grad_qk = grad_qk.view(),
                             .layout = c.layout(f1.view(), f2.view())});
      if (dtype == DType::kFloat64) {
        EXPECT_TRUE(passes(compare_close("float64 backward vs finite differences", grad_qk.get(),
                                         numeric, row_noise(numeric, c.head_dim, 1e-7))));
      } else {
        EXPECT_TRUE(
            passes(compare_bf16("bf16 backward vs finite differences", grad_qk.get_bf16_bits(),
                                numeric, row_noise(numeric, c.head_dim, kFp32Noise))));
      }
    }
  }
}

}  // namespace
}  // namespace qkvfuse::test
