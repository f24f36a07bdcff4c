// test_cpu_special_values.cpp: what the CPU backend does with NaN, infinities, values beyond
// e4m3's range, zero rows and special scales (docs/special_values.md states each rule; every rule
// there has a test here).
//
// Where the float64 model of tests/reference.hpp follows the same IEEE rules as the fp32
// computation (NaN and infinity propagation), outputs are compared against it with the CPU tests'
// tolerance; where fp32 and float64 part ways (a row whose fp32 sum of squares overflows) or where
// the rule is about exact codes (saturation, division by a zero scale), the expectation is
// written out exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "qkvfuse/qkvfuse.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace qkvfuse::test {
namespace {

constexpr double kFp32Noise = 1.0 / (1 << 18);
const double kNaN = std::numeric_limits<double>::quiet_NaN();

// ---- rope helpers --------------------------------------------------------------------------------

/// The tests below write ref::Rope{T, H, D, r, paired, key_offset} with r read only under the
/// key offset (SPEC.md section 1's rotary_dim); without it every lane rotates (r = D).
ref::Rope resolved(ref::Rope rope) {
  if (!rope.key_offset) rope.rotary_dim = rope.head_dim;
  return rope;
}

RopeLayout layout_of(const ref::Rope& rope, const TensorView& factor1,
                     const TensorView& factor2) {
  return tables_layout(rope.heads, rope.rotary(), rope.paired, rope.key_offset, factor1, factor2);
}

/// relative * the largest finite |value| of each row (an infinity must match, not widen a row).
std::vector<double> finite_row_noise(const std::vector<double>& values, int64_t row) {
  std::vector<double> noise(values.size());
  for (size_t start = 0; start < values.size(); start += size_t(row)) {
    double largest = 0;
    for (size_t i = start; i < start + size_t(row); ++i) {
      if (std::isfinite(values[i])) largest = std::max(largest, std::fabs(values[i]));
    }
    for (size_t i = start; i < start + size_t(row); ++i) noise[i] = kFp32Noise * largest;
  }
  return noise;
}

struct RopeInputs {
  ref::Rope rope;
  std::vector<double> qk, factor1, factor2;
};

RopeInputs rope_inputs(std::mt19937_64& rng, ref::Rope rope) {
  rope = resolved(rope);
  RopeInputs in{rope, {}, {}, {}};
  in.qk = random_values(rng, size_t(rope.tokens * 2 * rope.heads * rope.head_dim), DType::kBFloat16);
  rotary_factor_values(rng, rope.tokens, rope.head_dim, rope.paired ? 2 : 1, rope.rotary(), false,
                       in.factor1, in.factor2);
  return in;
}

/// The CPU forward's q and k as bf16 bits.
std::pair<std::vector<uint16_t>, std::vector<uint16_t>> run_forward(const RopeInputs& in) {
  const ref::Rope& r = in.rope;
  HostTensor qk(DType::kBFloat16, {r.tokens, 2 * r.heads, r.head_dim});
  HostTensor f1(DType::kBFloat16, {r.tokens, r.factor_width()});
  HostTensor f2(DType::kBFloat16, {r.tokens, r.factor_width()});
  qk.set(in.qk);
  f1.set(in.factor1);
  f2.set(in.factor2);
  HostTensor q(DType::kBFloat16, {r.out_tokens(), r.out_heads(), r.head_dim});
  HostTensor k(DType::kBFloat16, {r.out_tokens(), r.out_heads(), r.head_dim});
  qk_norm_rope({qk.view(), q.view(), k.view(), layout_of(r, f1.view(), f2.view())});
  return {q.get_bf16_bits(), k.get_bf16_bits()};
}

/// The CPU backward's dx as bf16 bits.
std::vector<uint16_t> run_backward(const RopeInputs& in, const std::vector<double>& grad_q,
                                   const std::vector<double>& grad_k) {
  const ref::Rope& r = in.rope;
  HostTensor qk(DType::kBFloat16, {r.tokens, 2 * r.heads, r.head_dim});
  HostTensor f1(DType::kBFloat16, {r.tokens, r.factor_width()});
  HostTensor f2(DType::kBFloat16, {r.tokens, r.factor_width()});
  HostTensor gq(DType::kBFloat16, {r.out_tokens(), r.out_heads(), r.head_dim});
  HostTensor gk(DType::kBFloat16, {r.out_tokens(), r.out_heads(), r.head_dim});
  qk.set(in.qk);
  f1.set(in.factor1);
  f2.set(in.factor2);
  gq.set(grad_q);
  gk.set(grad_k);
  HostTensor dx(DType::kBFloat16, {r.tokens, 2 * r.heads, r.head_dim});
  qk_norm_rope_backward({.grad_q = gq.view(),
                         .grad_k = gk.view(),
                         .qk = qk.view(),
                         .grad_qk = dx.view(),
                         .layout = layout_of(r, f1.view(), f2.view())});
  return dx.get_bf16_bits();
}

double value_of(uint16_t bits) { return ref::bf16_value(bits); }

/// Forward against the float64 model (NaN exactly where the model has NaN).
void expect_forward_matches_model(const RopeInputs& in) {
  const auto [q, k] = run_forward(in);
  const ref::QkPair want = ref::rope_forward(in.rope, in.qk, in.factor1, in.factor2);
  EXPECT_TRUE(passes(compare_bf16("q", q, want.q, finite_row_noise(want.q, in.rope.head_dim))));
  EXPECT_TRUE(passes(compare_bf16("k", k, want.k, finite_row_noise(want.k, in.rope.head_dim))));
}

/// Index of element (t, h2, d) of a dense [T, 2H, D] tensor.
size_t qk_index(const ref::Rope& r, int64_t t, int64_t h2, int64_t d) {
  return size_t((t * 2 * r.heads + h2) * r.head_dim + d);
}

// ---- forward: zero rows, NaN, infinity, overflow -----------------------------------------------

TEST(CpuSpecialValues, ZeroRowStaysZero) {
  // sum(x^2) = 0: rstd = 1/sqrt(eps) (finite), n = 0, so every output of the row is +-0 in every
  // mode, and the key offset copies those zeros into the next token's shifted dims.
  auto rng = rng_for_test();
  for (int mode = 0; mode < 3; ++mode) {
    const ref::Rope rope = resolved({4, 2, 16, 8, mode == 1, mode == 2});
    RopeInputs in = rope_inputs(rng, rope);
    for (int64_t d = 0; d < rope.head_dim; ++d) {
      in.qk[qk_index(rope, 1, 0, d)] = 0.0;   // a query row
      in.qk[qk_index(rope, 2, 3, d)] = -0.0;  // a key row, negative zeros
    }
    SCOPED_TRACE(::testing::Message() << "mode " << mode);
    expect_forward_matches_model(in);
    const auto [q, k] = run_forward(in);
    // Plain and key offset: row (t, h) goes to q/k[t, h]; paired: to [2t + h / (H/2), h % (H/2)].
    const size_t q_row = mode == 1 ? size_t(2 * 1 + 0) * 1 : 1 * 2 + 0;
    const size_t k_row = mode == 1 ? size_t(2 * 2 + 1) * 1 : 2 * 2 + 1;
    for (int64_t d = 0; d < rope.head_dim; ++d) {
      EXPECT_EQ(value_of(q[q_row * 16 + size_t(d)]), 0.0) << "q dim " << d;
      // (With the key offset, the key row's own shifted dims come from token 1 instead.)
      if (mode != 2 || d < rope.rotary_dim) {
        EXPECT_EQ(value_of(k[k_row * 16 + size_t(d)]), 0.0) << "k dim " << d;
      }
      if (mode == 2 && d >= rope.rotary_dim) {
        EXPECT_EQ(value_of(k[(3 * 2 + 1) * 16 + size_t(d)]), 0.0) << "next token's shifted dim " << d;
      }
    }
  }
}

TEST(CpuSpecialValues, NaNInQkMakesItsOutputRowNaN) {
  auto rng = rng_for_test();
  for (bool key_offset : {false, true}) {
    const ref::Rope rope = resolved({4, 2, 16, 8, false, key_offset});
    RopeInputs in = rope_inputs(rng, rope);
    in.qk[qk_index(rope, 1, 3, 5)] = kNaN;  // key head 1 of token 1, one element
    SCOPED_TRACE(::testing::Message() << "key offset " << key_offset);
    expect_forward_matches_model(in);
    const auto [q, k] = run_forward(in);
    int64_t nan_count = 0;
    for (uint16_t bits : q) nan_count += std::isnan(value_of(bits));
    EXPECT_EQ(nan_count, 0) << "queries do not read key rows";
    for (size_t i = 0; i < k.size(); ++i) {
      const int64_t row = int64_t(i) / 16, d = int64_t(i) % 16;
      // The row itself. With the key offset, its shifted dims (d >= rotary_dim = 8) come from
      // token 0 instead, and the NaN row feeds the shifted dims of token 2's row.
      const bool own = row == 1 * 2 + 1 && (!key_offset || d < 8);
      const bool next = key_offset && row == 2 * 2 + 1 && d >= 8;
      const bool expect_nan = own || next;
      EXPECT_EQ(std::isnan(value_of(k[i])), expect_nan) << "k row " << row << " dim " << d;
    }
  }
}

TEST(CpuSpecialValues, InfinityInQkZeroesItsRowButTwoLanes) {
  // sum(x^2) = inf, rstd = 1/sqrt(inf) = 0: finite elements normalize to +-0, the infinite one
  // to inf * 0 = NaN, and the rotary mixes it into its lane pair: NaN at d and d ^ 1, 0 elsewhere.
  auto rng = rng_for_test();
  const ref::Rope rope = resolved({3, 2, 16, 0, false, false});
  RopeInputs in = rope_inputs(rng, rope);
  in.qk[qk_index(rope, 1, 0, 6)] = INFINITY;
  in.qk[qk_index(rope, 2, 2, 11)] = -INFINITY;
  expect_forward_matches_model(in);
  const auto [q, k] = run_forward(in);
  for (int64_t d = 0; d < 16; ++d) {
    const double qv = value_of(q[size_t(1 * 2 + 0) * 16 + size_t(d)]);
    const double kv = value_of(k[size_t(2 * 2 + 0) * 16 + size_t(d)]);
    if (d == 6 || d == 7) {
      EXPECT_TRUE(std::isnan(qv)) << d;
    } else {
      EXPECT_EQ(qv, 0.0) << d;
    }
    if (d == 10 || d == 11) {
      EXPECT_TRUE(std::isnan(kv)) << d;
    } else {
      EXPECT_EQ(kv, 0.0) << d;
    }
  }
}

TEST(CpuSpecialValues, RowWhoseSumOfSquaresOverflowsNormalizesToZero) {
  // fp32 sum(x^2) overflows to inf once |x| reaches about 2^64 (1.8e19): rstd = 0 and the whole
  // row, finite as it is, comes out as zeros (as F.rms_norm does in fp32). The float64 model
  // would normalize it; this is the fp32 behaviour, written out exactly.
  auto rng = rng_for_test();
  const ref::Rope rope = resolved({2, 1, 8, 0, false, false});
  RopeInputs in = rope_inputs(rng, rope);
  in.qk[qk_index(rope, 0, 0, 3)] = std::ldexp(1.0, 70);
  for (int64_t d = 0; d < 8; ++d) in.qk[qk_index(rope, 1, 1, d)] = -std::ldexp(1.0, 65);
  const auto [q, k] = run_forward(in);
  for (int64_t d = 0; d < 8; ++d) {
    EXPECT_EQ(value_of(q[size_t(d)]), 0.0) << "q row 0 dim " << d;
    EXPECT_EQ(value_of(k[size_t(8 + d)]), 0.0) << "k row 1 dim " << d;
    EXPECT_FALSE(std::isnan(value_of(q[size_t(8 + d)])));  // the other rows are untouched
  }
  // The backward of such a row is zero as well: dx = rstd * (...) with rstd = 0.
  const size_t out = size_t(rope.out_tokens() * rope.out_heads() * rope.head_dim);
  const std::vector<double> grad_q = random_values(rng, out, DType::kBFloat16);
  const std::vector<double> grad_k = random_values(rng, out, DType::kBFloat16);
  const std::vector<uint16_t> dx = run_backward(in, grad_q, grad_k);
  for (int64_t d = 0; d < 8; ++d) {
    EXPECT_EQ(value_of(dx[qk_index(rope, 0, 0, d)]), 0.0) << d;
    EXPECT_EQ(value_of(dx[qk_index(rope, 1, 1, d)]), 0.0) << d;
  }
}

TEST(CpuSpecialValues, HugeButSafeRowsNormalizeNormally) {
  // Values far beyond e4m3's 448 (up to 2^40 here) are nothing special for the norm as long as
  // the fp32 sum of squares stays finite: the outputs match the model.
  auto rng = rng_for_test();
  for (int mode = 0; mode < 3; ++mode) {
    RopeInputs in = rope_inputs(rng, {5, 2, 32, 16, mode == 1, mode == 2});
    for (size_t i = 0; i < in.qk.size(); i += 7) in.qk[i] = std::ldexp(in.qk[i] < 0 ? -1.0 : 1.0, 20 + int(i % 21));
    expect_forward_matches_model(in);
  }
}

TEST(CpuSpecialValues, NaNAndInfinityInFactorsStayInTheirColumn) {
  // y[d] = f1[d] * n[d] + f2[d] * n[d ^ 1]: factor column d feeds only output element d of every
  // row that reads that factor row; an infinite factor gives +-inf (or NaN where n[d] is 0).
  auto rng = rng_for_test();
  const ref::Rope rope = resolved({3, 2, 16, 0, false, false});
  RopeInputs in = rope_inputs(rng, rope);
  in.factor1[size_t(1 * 16 + 4)] = kNaN;
  in.factor2[size_t(2 * 16 + 9)] = INFINITY;
  expect_forward_matches_model(in);
  const auto [q, k] = run_forward(in);
  for (const std::vector<uint16_t>* out : {&q, &k}) {
    for (size_t i = 0; i < out->size(); ++i) {
      const int64_t t = int64_t(i) / 32, d = int64_t(i) % 16;
      const double v = value_of((*out)[i]);
      EXPECT_EQ(std::isnan(v), t == 1 && d == 4) << "element " << i;
      EXPECT_EQ(std::isinf(v), t == 2 && d == 9) << "element " << i;
    }
  }
}

// ---- backward ----------------------------------------------------------------------------------

TEST(CpuSpecialValues, BackwardZeroRowIsScaledByOneOverSqrtEps) {
  // A zero row: n = 0, so dx = rstd * dn with rstd = 1/sqrt(2^-23) ~ 2896: finite, large.
  auto rng = rng_for_test();
  const ref::Rope rope = resolved({3, 2, 16, 0, false, false});
  RopeInputs in = rope_inputs(rng, rope);
  for (int64_t d = 0; d < 16; ++d) in.qk[qk_index(rope, 1, 2, d)] = 0.0;
  const size_t out = size_t(rope.tokens * rope.heads * rope.head_dim);
  const std::vector<double> grad_q = random_values(rng, out, DType::kBFloat16);
  const std::vector<double> grad_k = random_values(rng, out, DType::kBFloat16);
  const std::vector<uint16_t> dx = run_backward(in, grad_q, grad_k);
  const std::vector<double> want =
      ref::rope_backward(rope, grad_q, grad_k, in.qk, in.factor1, in.factor2);
  EXPECT_TRUE(passes(compare_bf16("dx", dx, want, finite_row_noise(want, 16))));
  // Row (1, key head 0): dn = f1 * g + f2[d ^ 1] * g[d ^ 1] from k[1, 0].
  const double rstd = 1.0 / std::sqrt(1.0 / 8388608.0);
  for (int64_t d = 0; d < 16; ++d) {
    const size_t f = size_t(16 + d), f_pair = size_t(16 + (d ^ 1));
    const double dn = in.factor1[f] * grad_k[size_t(2 * 16 + d)] +
                      in.factor2[f_pair] * grad_k[size_t(2 * 16 + (d ^ 1))];
    EXPECT_NEAR(value_of(dx[qk_index(rope, 1, 2, d)]), rstd * dn, std::fabs(rstd * dn) / 64 + 1e-3) << d;
  }
}

TEST(CpuSpecialValues, BackwardNaNOrInfinityMakesTheWholeRowNaN) {
  // A NaN or infinite qk element (n has a NaN), or a NaN gradient element, reaches every element
  // of its row's dx through the row sum sum(dn * n).
  auto rng = rng_for_test();
  const ref::Rope rope = resolved({3, 2, 16, 0, false, false});
  RopeInputs in = rope_inputs(rng, rope);
  in.qk[qk_index(rope, 0, 1, 3)] = kNaN;
  in.qk[qk_index(rope, 2, 3, 12)] = INFINITY;
  const size_t out = size_t(rope.tokens * rope.heads * rope.head_dim);
  std::vector<double> grad_q = random_values(rng, out, DType::kBFloat16);
  const std::vector<double> grad_k = random_values(rng, out, DType::kBFloat16);
  grad_q[size_t((1 * 2 + 0) * 16 + 7)] = kNaN;  // q[1, 0] -> row (1, 0)
  const std::vector<uint16_t> dx = run_backward(in, grad_q, grad_k);
  const std::vector<double> want =
      ref::rope_backward(rope, grad_q, grad_k, in.qk, in.factor1, in.factor2);
  EXPECT_TRUE(passes(compare_bf16("dx", dx, want, finite_row_noise(want, 16))));
  for (size_t i = 0; i < dx.size(); ++i) {
    const int64_t row = int64_t(i) / 16;
    const bool nan_row = row == 0 * 4 + 1 || row == 2 * 4 + 3 || row == 1 * 4 + 0;
    EXPECT_EQ(std::isnan(value_of(dx[i])), nan_row) << "row " << row;
  }
}

TEST(CpuSpecialValues, BackwardInfiniteGradientsFollowTheModel) {
  // +-inf in a gradient: dn is infinite, the correction n * sum(dn * n) / D infinite or NaN, so
  // the row's dx is non-finite (mostly NaN); the model, with the same IEEE rules, agrees.
  auto rng = rng_for_test();
  for (int mode = 0; mode < 2; ++mode) {
    const ref::Rope rope = resolved({3, 2, 16, 0, mode == 1, false});
    RopeInputs in = rope_inputs(rng, rope);
    const size_t out = size_t(rope.out_tokens() * rope.out_heads() * rope.head_dim);
    std::vector<double> grad_q = random_values(rng, out, DType::kBFloat16);
    std::vector<double> grad_k = random_values(rng, out, DType::kBFloat16);
    grad_q[5] = INFINITY;
    grad_k[40] = -INFINITY;
    const std::vector<uint16_t> dx = run_backward(in, grad_q, grad_k);
    const std::vector<double> want =
        ref::rope_backward(rope, grad_q, grad_k, in.qk, in.factor1, in.factor2);
    EXPECT_TRUE(passes(compare_bf16("dx", dx, want, finite_row_noise(want, 16))));
  }
}

// ---- norm weights' gradients -----------------------------------------------------------------------

/// grad_w[d] is the fp32 sum over that weight's rows of gw[d] * n[d] (SPEC.md section 8), each
/// term under IEEE rules. The pattern of fuzz seed 20261203, cases 2363, 4705 and 8618: Hq = 2,
/// Hkv = 1 (an odd number of rows a token), D = 16, factor tables, both weights; token 2 reads an
/// infinite f1 at lane kInfLane, token 4 one at lane kZeroLane, and token 4's key row is all
/// zeros. Every row has qk = +1 and gradient +1 at both lanes, so gw = +inf there and n > 0:
/// every term at those lanes is +inf, but the zero row's is inf * 0 = NaN.
constexpr int64_t kInfLane = 5, kZeroLane = 10;

RopeData infinite_angle_data(int64_t tokens) {
  ref::Rope rope;
  rope.tokens = tokens;
  rope.heads = 2;
  rope.kv_heads = 1;
  rope.head_dim = 16;
  RopeSpec spec;
  spec.q_weight = spec.k_weight = true;
  spec.weight_dtype = DType::kFloat32;
  std::mt19937_64 rng(20261203);
  RopeData data(rope, spec, rng);
  const int64_t D = rope.head_dim, rows = rope.input_heads();
  data.tensors.factor1[size_t(2 * D + kInfLane)] = INFINITY;
  data.tensors.factor1[size_t(4 * D + kZeroLane)] = INFINITY;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h2 = 0; h2 < rows; ++h2) {
      for (int64_t d : {kInfLane, kZeroLane}) data.qk[size_t((t * rows + h2) * D + d)] = 1.0;
    }
  }
  for (int64_t d = 0; d < D; ++d) data.qk[size_t((4 * rows + rope.heads) * D + d)] = 0.0;
  data.refresh();
  return data;
}

/// grad_q or grad_k of `data` (dense), random but +1 at kInfLane and kZeroLane.
std::vector<double> plus_one_grads(std::mt19937_64& rng, const RopeData& data, bool keys) {
  const ref::Rope& r = data.rope;
  std::vector<double> g = random_values(rng, keys ? r.k_count() : r.q_count(), DType::kBFloat16);
  for (size_t row = 0; row < g.size() / size_t(r.head_dim); ++row) {
    for (int64_t d : {kInfLane, kZeroLane}) g[row * size_t(r.head_dim) + size_t(d)] = 1.0;
  }
  return g;
}

/// The expected classes at the two lanes, and the other lanes against the float64 model.
void expect_infinite_angle_weight_grads(const RopeData& data, const HostTensor& got_q,
                                        const HostTensor& got_k, const ref::RopeGradients& want) {
  const std::vector<double> q = got_q.get(), k = got_k.get();
  // The model, with the same IEEE rules, says the same.
  EXPECT_EQ(want.grad_q_weight[kInfLane], INFINITY);
  EXPECT_EQ(want.grad_k_weight[kInfLane], INFINITY);
  EXPECT_EQ(want.grad_q_weight[kZeroLane], INFINITY);
  EXPECT_TRUE(std::isnan(want.grad_k_weight[kZeroLane]));
  EXPECT_EQ(q[kInfLane], INFINITY) << "sum of +inf terms and finite ones";
  EXPECT_EQ(k[kInfLane], INFINITY) << "the one key row of token 2 gives +inf: not NaN";
  EXPECT_EQ(q[kZeroLane], INFINITY);
  EXPECT_TRUE(std::isnan(k[kZeroLane])) << "the zero key row's term is inf * 0 = NaN, got "
                                        << k[kZeroLane];
  const std::vector<double> tol_q = fp32_sum_tolerance(want.q_weight_magnitude, want.q_weight_terms);
  const std::vector<double> tol_k = fp32_sum_tolerance(want.k_weight_magnitude, want.k_weight_terms);
  for (int64_t d = 0; d < data.rope.head_dim; ++d) {
    if (d == kInfLane || d == kZeroLane) continue;
    EXPECT_NEAR(q[size_t(d)], want.grad_q_weight[size_t(d)], tol_q[size_t(d)]) << "lane " << d;
    EXPECT_NEAR(k[size_t(d)], want.grad_k_weight[size_t(d)], tol_k[size_t(d)]) << "lane " << d;
  }
}

TEST(CpuSpecialValues, WeightGradientsOfAnInfiniteAngle) {
  // Each weight-gradient lane is the plain IEEE sum of its rows' terms: +inf where every
  // non-finite term is +inf, NaN only where a term is (here the zero row's inf * 0). The CUDA
  // kernels must agree (test_cuda_rope_layouts.cpp, CudaRopeLayouts.InfiniteAngleWeightGradients).
  std::mt19937_64 rng(4705);
  for (int64_t tokens : {5, 70}) {  // 70: more than one of the CPU's 64-token blocks
    SCOPED_TRACE(::testing::Message() << "T=" << tokens);
    RopeData data = infinite_angle_data(tokens);
    const ref::Rope& r = data.rope;
    const std::vector<double> grad_q = plus_one_grads(rng, data, false);
    const std::vector<double> grad_k = plus_one_grads(rng, data, true);
    HostTensor gq(DType::kBFloat16, {r.tokens, r.heads, r.head_dim});
    HostTensor gk(DType::kBFloat16, {r.tokens, r.k_heads(), r.head_dim});
    gq.set(grad_q);
    gk.set(grad_k);
    const ref::RopeGradients want = ref::rope_gradients(r, grad_q, grad_k, data.qk, data.tensors);
    {
      SCOPED_TRACE("qk_norm_rope_backward");
      HostTensor dx(DType::kBFloat16, {r.tokens, r.input_heads(), r.head_dim});
      HostTensor wq(DType::kFloat32, {r.head_dim}), wk(DType::kFloat32, {r.head_dim});
      qk_norm_rope_backward({.grad_q = gq.view(),
                             .grad_k = gk.view(),
                             .qk = data.qk_tensor->view(),
                             .grad_qk = dx.view(),
                             .grad_q_weight = wq.view(),
                             .grad_k_weight = wk.view(),
                             .layout = data.layout()});
      expect_infinite_angle_weight_grads(data, wq, wk, want);
    }
    {
      SCOPED_TRACE("qkv_backward_fp8");
      const int64_t v_dim = 8, features = ref::qkv_dim(r, v_dim);
      HostTensor gv(DType::kBFloat16, {r.tokens, r.k_heads(), v_dim});
      gv.set(random_values(rng, size_t(r.tokens * r.k_heads() * v_dim), DType::kBFloat16));
      HostTensor scale(DType::kFloat32, {});
      scale.set({1.0f / 64});
      HostTensor row(DType::kFloat8E4M3, {r.tokens, features});
      HostTensor t(DType::kFloat8E4M3, {features, r.tokens});
      HostTensor wq(DType::kFloat32, {r.head_dim}), wk(DType::kFloat32, {r.head_dim});
      qkv_backward_fp8({.grad_q = gq.view(),
                        .grad_k = gk.view(),
                        .grad_v = gv.view(),
                        .qk = data.qk_tensor->view(),
                        .grad_scale = scale.view(),
                        .grad_row = row.view(),
                        .grad_t = t.view(),
                        .grad_q_weight = wq.view(),
                        .grad_k_weight = wk.view(),
                        .layout = data.layout()});
      expect_infinite_angle_weight_grads(data, wq, wk, want);
    }
  }
}

// ---- fused FP8 backward --------------------------------------------------------------------------

/// qkv_backward_fp8 with H = 1, D = 8, Dv = 8, T tokens; returns grad_row codes [T, 24].
std::vector<uint8_t> run_fp8(const std::vector<double>& qk, const std::vector<double>& grad_q,
                             const std::vector<double>& grad_k, const std::vector<double>& grad_v,
                             int64_t tokens, float grad_scale) {
  HostTensor qk_t(DType::kBFloat16, {tokens, 2, 8});
  HostTensor gq(DType::kBFloat16, {tokens, 1, 8}), gk(DType::kBFloat16, {tokens, 1, 8});
  HostTensor gv(DType::kBFloat16, {tokens, 1, 8});
  HostTensor f1(DType::kBFloat16, {tokens, 8}), f2(DType::kBFloat16, {tokens, 8});
  HostTensor scale(DType::kFloat32, {1});
  qk_t.set(qk);
  gq.set(grad_q);
  gk.set(grad_k);
  gv.set(grad_v);
  f1.set(std::vector<double>(size_t(tokens * 8), 1.0));  // stationary: dn = g
  f2.set(std::vector<double>(size_t(tokens * 8), 0.0));
  scale.set({grad_scale});
  HostTensor row(DType::kFloat8E4M3, {tokens, 24}), t(DType::kFloat8E4M3, {24, tokens});
  qkv_backward_fp8({.grad_q = gq.view(),
                    .grad_k = gk.view(),
                    .grad_v = gv.view(),
                    .qk = qk_t.view(),
                    .grad_scale = scale.view(),
                    .grad_row = row.view(),
                    .grad_t = t.view(),
                    .layout = tables_layout(1, 8, false, false, f1.view(), f2.view())});
  const std::vector<uint8_t> codes = row.get_codes();
  EXPECT_EQ(t.get_codes(), transpose(codes, tokens, 24));
  return codes;
}

TEST(CpuSpecialValues, Fp8BackwardSaturatesAndKeepsNaN) {
  // V features are e4m3(grad_v / grad_scale) exactly: beyond 448 (infinity included) saturates
  // to +-448 (0x7e / 0xfe), NaN of either sign is 0x7f, quotients below 2^-10 round to +-0.
  const float s = 1.0f / 448.0f;
  const std::vector<double> v = {kNaN, INFINITY, -INFINITY, 1e30, -448.0 * s, 500.0 * s,
                                 -0.0, ref::round_bf16(std::ldexp(1.0, -11) * s)};
  const std::vector<uint8_t> want = {0x7f, 0x7e, 0xfe, 0x7e, 0xfe, 0x7e, 0x80, 0x00};
  std::vector<double> grad_v(v.size());
  for (size_t i = 0; i < v.size(); ++i) grad_v[i] = ref::round_bf16(v[i]);
  std::vector<double> qk(16, 1.0), zeros(8, 0.0);
  const std::vector<uint8_t> codes = run_fp8(qk, zeros, zeros, grad_v, 1, s);
  for (size_t d = 0; d < 8; ++d) EXPECT_EQ(codes[16 + d], want[d]) << "V feature " << d;
}

TEST(CpuSpecialValues, Fp8BackwardSpecialGradScales) {
  auto rng = rng_for_test();
  const int64_t tokens = 3;
  const std::vector<double> qk = random_values(rng, size_t(tokens * 16), DType::kBFloat16);
  std::vector<double> grad_q = random_values(rng, size_t(tokens * 8), DType::kBFloat16);
  const std::vector<double> grad_k = random_values(rng, size_t(tokens * 8), DType::kBFloat16);
  std::vector<double> grad_v = random_values(rng, size_t(tokens * 8), DType::kBFloat16);
  for (int64_t d = 0; d < 8; ++d) grad_q[size_t(8 + d)] = 0.0;  // token 1: dx of Q row is 0
  grad_v[3] = 0.0;
  grad_v[4] = -0.0;
  grad_v[5] = INFINITY;

  // grad_scale = 0: x / 0 is +-inf -> +-448; 0 / 0 is NaN -> 0x7f (zero gradients become NaN).
  const std::vector<uint8_t> zero = run_fp8(qk, grad_q, grad_k, grad_v, tokens, 0.0f);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t f = 0; f < 24; ++f) {
      const uint8_t code = zero[size_t(t * 24 + f)];
      EXPECT_TRUE(code == 0x7e || code == 0xfe || code == 0x7f) << t << " " << f;
      if (t == 1 && f < 8) {
        EXPECT_EQ(code, 0x7f) << "zero dx / 0";
      }
    }
  }
  EXPECT_EQ(zero[16 + 3], 0x7f);
  EXPECT_EQ(zero[16 + 4], 0x7f);
  EXPECT_EQ(zero[16 + 5], 0x7e);
  EXPECT_EQ(zero[16 + 0], grad_v[0] > 0 ? 0x7e : 0xfe);

  // grad_scale = NaN: every code is NaN.
  for (uint8_t code : run_fp8(qk, grad_q, grad_k, grad_v, tokens, NAN)) EXPECT_EQ(code, 0x7f);

  // grad_scale = inf: finite / inf = +-0, inf / inf = NaN.
  const std::vector<uint8_t> inf = run_fp8(qk, grad_q, grad_k, grad_v, tokens, INFINITY);
  for (size_t i = 0; i < inf.size(); ++i) {
    if (i == 16 + 5) {
      EXPECT_EQ(inf[i], 0x7f);
    } else {
      EXPECT_TRUE(inf[i] == 0x00 || inf[i] == 0x80) << i;
    }
  }

  // A negative grad_scale flips every sign (NaN stays 0x7f).
  const float s = 1.0f / 64.0f;
  const std::vector<uint8_t> positive = run_fp8(qk, grad_q, grad_k, grad_v, tokens, s);
  const std::vector<uint8_t> negative = run_fp8(qk, grad_q, grad_k, grad_v, tokens, -s);
  for (size_t i = 0; i < positive.size(); ++i) {
    EXPECT_EQ(negative[i], positive[i] == 0x7f ? 0x7f : uint8_t(positive[i] ^ 0x80)) << i;
  }
}

// ---- quantize ------------------------------------------------------------------------------------

/// quantize_dual_layout of one [1, n] row of raw bf16 bits; returns the codes and amax.
std::pair<std::vector<uint8_t>, float> quantize_bits(std::vector<uint16_t> bits, float scale) {
  const int64_t n = int64_t(bits.size());
  std::vector<uint8_t> row(size_t(n), 0xaa), t(size_t(n), 0xaa);
  float amax = -1.0f;
  QuantizeDualParams p;
  p.src = make_view(bits.data(), DType::kBFloat16, kCPU, {1, n});
  p.scale = make_view(&scale, DType::kFloat32, kCPU, {});
  p.row = make_view(row.data(), DType::kFloat8E4M3, kCPU, {1, n});
  p.t = make_view(t.data(), DType::kFloat8E4M3, kCPU, {n, 1});
  p.amax = make_view(&amax, DType::kFloat32, kCPU, {});
  quantize_dual_layout(p);
  EXPECT_EQ(row, t);
  return {row, amax};
}

TEST(CpuSpecialValues, QuantizeSpecialInputs) {
  const float s = 0.5f;
  const std::vector<uint16_t> bits = {
      0x7fc0,                      // NaN
      0xffc0,                      // -NaN
      0x7f80,                      // inf
      0xff80,                      // -inf
      float_to_bf16(1e38f),        // far beyond 448 * s
      float_to_bf16(-224.0f),      // -448 * s exactly
      float_to_bf16(240.0f),       // 480 * s: past 448, saturates
      0x0000,                      // +0
      0x8000,                      // -0
      0x0001,                      // the smallest bf16 subnormal: rounds to +0
      float_to_bf16(0.0009765625f) // 2^-10 / s = 2^-9: the smallest e4m3 subnormal
  };
  const std::vector<uint8_t> want = {0x7f, 0x7f, 0x7e, 0xfe, 0x7e, 0xfe, 0x7e, 0x00, 0x80, 0x00, 0x01};
  const auto [codes, amax] = quantize_bits(bits, s);
  EXPECT_EQ(codes, want);
  EXPECT_TRUE(std::isnan(amax)) << "NaN anywhere makes amax NaN";
  // Without the NaNs, amax is the largest magnitude, infinity included.
  const auto [codes2, amax2] = quantize_bits({bits.begin() + 2, bits.end()}, s);
  EXPECT_EQ(amax2, INFINITY);
  // All zeros: amax is +0.
  const auto [codes3, amax3] = quantize_bits({0x8000, 0x0000, 0x8000}, s);
  EXPECT_EQ(float_bits(amax3), 0u);
}

TEST(CpuSpecialValues, QuantizeSpecialScales) {
  const std::vector<uint16_t> bits = {float_to_bf16(3.0f), float_to_bf16(-0.25f), 0x0000, 0x8000,
                                      0x7f80, 0x7fc0};
  // scale 0: +-x / 0 = +-inf -> +-448; +-0 / 0 = NaN; inf / 0 = inf -> 448.
  EXPECT_EQ(quantize_bits(bits, 0.0f).first,
            (std::vector<uint8_t>{0x7e, 0xfe, 0x7f, 0x7f, 0x7e, 0x7f}));
  // scale inf: finite / inf = +-0; inf / inf = NaN.
  EXPECT_EQ(quantize_bits(bits, INFINITY).first,
            (std::vector<uint8_t>{0x00, 0x80, 0x00, 0x80, 0x7f, 0x7f}));
  // scale NaN: every code NaN.
  EXPECT_EQ(quantize_bits(bits, NAN).first, std::vector<uint8_t>(6, 0x7f));
  // A negative scale flips signs: 3 / -1 = -3 (0xc4 is -3.0), -0.25 / -1 = 0.25 (0x28).
  EXPECT_EQ(quantize_bits(bits, -1.0f).first,
            (std::vector<uint8_t>{0xc4, 0x28, 0x80, 0x00, 0xfe, 0x7f}));
}

/// t holds row transposed entry by entry: row [batch, m, n], t [batch, n, m], e4m3 codes.
void expect_transposed(const std::vector<uint8_t>& row, const std::vector<uint8_t>& t,
                       int64_t batch, int64_t m, int64_t n) {
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        EXPECT_EQ(t[size_t((b * n + j) * m + i)], row[size_t((b * m + i) * n + j)])
            << "entry " << b << " row " << i << " column " << j;
      }
    }
  }
}

TEST(CpuSpecialValues, BatchedAmaxIsPerEntry) {
  std::vector<uint16_t> src(3 * 2 * 4, float_to_bf16(1.5f));
  src[8 + 3] = 0x7fc0;          // entry 1: NaN
  src[16 + 5] = 0xff80;         // entry 2: -inf
  std::vector<float> scale = {1.0f, 1.0f, 1.0f}, amax(3, -1.0f);
  std::vector<uint8_t> row(src.size(), 0x55), t(src.size(), 0x55);  // 0x55: no code expected
  QuantizeDualParams p;
  p.src = make_view(src.data(), DType::kBFloat16, kCPU, {3, 2, 4});
  p.scale = make_view(scale.data(), DType::kFloat32, kCPU, {3});
  p.row = make_view(row.data(), DType::kFloat8E4M3, kCPU, {3, 2, 4});
  p.t = make_view(t.data(), DType::kFloat8E4M3, kCPU, {3, 4, 2});
  p.amax = make_view(amax.data(), DType::kFloat32, kCPU, {3});
  quantize_dual_layout(p);
  EXPECT_EQ(amax[0], 1.5f);
  EXPECT_TRUE(std::isnan(amax[1]));
  EXPECT_EQ(amax[2], INFINITY);
  for (size_t i = 0; i < row.size(); ++i) {
    // 1.5 is 0x3c; NaN stays NaN (0x7f); -inf saturates to -448 (0xfe).
    EXPECT_EQ(row[i], i == 8 + 3 ? 0x7f : i == 16 + 5 ? 0xfe : 0x3c) << i;
  }
  expect_transposed(row, t, 3, 2, 4);
}

TEST(CpuSpecialValues, EmptySourceWritesNothing) {
  // M = 0: a no-op; amax keeps whatever it held (the max of no elements is not invented).
  uint16_t src[1] = {0};
  float scale = 1.0f, amax = -7.0f;
  uint8_t row[1] = {0xaa}, t[1] = {0xaa};
  QuantizeDualParams p;
  p.src = make_view(src, DType::kBFloat16, kCPU, {0, 4});
  p.scale = make_view(&scale, DType::kFloat32, kCPU, {});
  p.row = make_view(row, DType::kFloat8E4M3, kCPU, {0, 4});
  p.t = make_view(t, DType::kFloat8E4M3, kCPU, {4, 0});
  p.amax = make_view(&amax, DType::kFloat32, kCPU, {});
  quantize_dual_layout(p);
  EXPECT_EQ(amax, -7.0f);
}

TEST(CpuSpecialValues, WeightBankSpecialEntries) {
  // Entry 0 all zeros: scale 1, codes 0. Entry 1 holds an inf: scale inf, finite values -> +-0,
  // the inf -> inf / inf = NaN. Entry 2 holds a NaN: scale NaN, every code NaN. Entry 3 normal.
  std::vector<uint16_t> src(4 * 2 * 4, float_to_bf16(-2.0f));
  for (int i = 0; i < 8; ++i) src[size_t(i)] = 0;
  src[8 + 2] = 0x7f80;
  src[16 + 6] = 0x7fc0;
  std::vector<float> scale(4, -1.0f);
  std::vector<uint8_t> row(src.size(), 0x55), t(src.size(), 0x55);  // 0x55: no code expected
  QuantizeWeightBankParams p;
  p.src = make_view(src.data(), DType::kBFloat16, kCPU, {4, 2, 4});
  p.scale = make_view(scale.data(), DType::kFloat32, kCPU, {4});
  p.row = make_view(row.data(), DType::kFloat8E4M3, kCPU, {4, 2, 4});
  p.t = make_view(t.data(), DType::kFloat8E4M3, kCPU, {4, 4, 2});
  quantize_weight_bank(p);
  EXPECT_EQ(scale[0], 1.0f);
  EXPECT_EQ(scale[1], INFINITY);
  EXPECT_TRUE(std::isnan(scale[2]));
  EXPECT_EQ(scale[3], 2.0f / 448.0f);
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(row[size_t(i)], 0x00) << i;
    EXPECT_EQ(row[size_t(8 + i)], i == 2 ? 0x7f : 0x80) << i;
    EXPECT_EQ(row[size_t(16 + i)], 0x7f) << i;
    EXPECT_EQ(row[size_t(24 + i)], 0xfe) << i;  // -2 / (2 / 448) = -448
  }
  expect_transposed(row, t, 4, 2, 4);
}

// ---- GEMM ----------------------------------------------------------------------------------------

TEST(CpuSpecialValues, GemmNaNOperandPoisonsItsRowAndColumn) {
  // e4m3 has no infinity; its NaN (0x7f / 0xff) in a[m, k] makes row m of d NaN, in b[n, k]
  // column n. Everything else stays exact.
  const int64_t m = 4, n = 3, k = 8;
  std::vector<uint8_t> a(size_t(m * k), float_to_e4m3(1.0f)), b(size_t(n * k), float_to_e4m3(2.0f));
  a[size_t(1 * k + 5)] = 0x7f;
  b[size_t(2 * k + 0)] = 0xff;
  float one = 1.0f;
  std::vector<uint16_t> d(size_t(m * n), 0);
  Fp8GemmParams p;
  p.a = make_view(a.data(), DType::kFloat8E4M3, kCPU, {m, k});
  p.b = make_view(b.data(), DType::kFloat8E4M3, kCPU, {n, k});
  p.scale_a = make_view(&one, DType::kFloat32, kCPU, {});
  p.scale_b = make_view(&one, DType::kFloat32, kCPU, {});
  p.d = make_view(d.data(), DType::kBFloat16, kCPU, {m, n});
  fp8_gemm(p);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const float v = bf16_to_float(d[size_t(i * n + j)]);
      if (i == 1 || j == 2) {
        EXPECT_TRUE(std::isnan(v)) << i << " " << j;
      } else {
        EXPECT_EQ(v, 16.0f) << i << " " << j;
      }
    }
  }
}

}  // namespace
}  // namespace qkvfuse::test
