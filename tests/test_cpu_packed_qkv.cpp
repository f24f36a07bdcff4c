// test_cpu_packed_qkv.cpp: the packed FP8 QKV projection on the CPU (SPEC.md section 6), forward
// and backward, against the float64 reference, stage by stage.
//
// Each stage is judged on the inputs it actually received: q and k against the reference rope of
// the op's own qk, the weight gradient against the reference GEMM of the op's own grad_t, and so
// on. A one-ulp difference upstream (allowed) then cannot masquerade as an error downstream.
// Tolerances per stage are those of the op tests, plus, for the scaled weight gradient, one ulp
// of the unobservable unscaled GEMM output carried through the qkv_scale multiply.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "backend.hpp"
#include "qkvfuse/packed_qkv.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace qkvfuse::test {
namespace {

constexpr double kFp32Noise = 1.0 / (1 << 18);

struct PackedCase {
  int64_t tokens = 3;
  int64_t channels = 40;
  int64_t heads = 2;     ///< Hq
  int64_t kv_heads = 0;  ///< Hkv; 0: Hq
  int64_t head_dim = 34;
  int64_t v_dim = 20;
  bool paired = false;
  bool key_offset = false;
  int64_t rotary_dim = 0;
  bool joined_qkv = true;           ///< qk and v column slices of one [T, qkv_dim] buffer
  bool joined_weight_grads = true;  ///< grad_qk_weight, grad_v_weight rows of one buffer
  float qkv_scale = 0.83f;
  /// The general layout's options (SPEC.md section 8): style, norm, eps, weight offset; `spec`
  /// picks the angle source and the weights (qk itself comes from the GEMM).
  bool neox = false;
  bool normalize = true;
  double eps = 1.0 / 8388608.0;
  double weight_offset = 0.0;
  // SPEC.md section 9
  bool token_norm = false;
  bool query_only = false;   ///< the weight's Q rows only: no K, no V
  bool normalize_v = false;  ///< the forward returns v_out; the backward reads the raw V
  bool angles = true;
  RopeSpec spec;

  int64_t k_heads() const { return query_only ? 0 : kv_heads ? kv_heads : heads; }
  int64_t qk_features() const { return (heads + k_heads()) * head_dim; }
  int64_t v_features() const { return k_heads() * v_dim; }
  int64_t qkv_dim() const { return qk_features() + v_features(); }
  int64_t rotary() const {
    if (!angles) return 0;
    return key_offset ? rotary_dim : rotary_dim > 0 ? rotary_dim : head_dim;
  }
  ref::Rope rope() const {
    ref::Rope rope{tokens, heads, head_dim, rotary(), paired, key_offset};
    rope.kv_heads = kv_heads;
    rope.neox = neox;
    rope.normalize = normalize;
    rope.eps = eps;
    rope.weight_offset = weight_offset;
    rope.token_norm = token_norm;
    rope.query_only = query_only;
    rope.normalize_v = normalize_v;
    rope.angles = angles;
    return rope;
  }
  std::string describe() const {
    std::ostringstream out;
    out << "T=" << tokens << " C=" << channels << " Hq=" << heads << " Hkv=" << k_heads()
        << " D=" << head_dim << " Dv=" << v_dim << " r=" << rotary() << (neox ? " neox" : "")
        << (normalize ? "" : " no-norm") << " eps=" << eps << " offset=" << weight_offset << " "
        << spec.describe() << (paired ? " paired" : "") << (key_offset ? " key_offset" : "")
        << (joined_qkv ? " one QKV GEMM" : " two QKV GEMMs")
        << (joined_weight_grads ? " one wgrad GEMM" : " two wgrad GEMMs")
        << (token_norm ? " token-norm" : "") << (query_only ? " query-only" : "")
        << (normalize_v ? " v-norm" : "") << (angles ? "" : " no-angles");
    return out.str();
  }
};

constexpr float kXScale = 8.0f / 448;
constexpr float kWeightScale = 0.05f / 448;
constexpr float kGradScale = 1.0f / 448;

/// The columns [first, first + count) of a dense [rows, cols] matrix.
std::vector<double> columns(const std::vector<double>& m, int64_t rows, int64_t cols, int64_t first,
                            int64_t count) {
  std::vector<double> out;
  for (int64_t r = 0; r < rows; ++r) {
    out.insert(out.end(), m.begin() + r * cols + first, m.begin() + r * cols + first + count);
  }
  return out;
}

/// Rows of a dense matrix [rows, cols] with `cols` columns, concatenated after `top`.
template <typename T>
std::vector<T> concat(std::vector<T> top, const std::vector<T>& bottom) {
  top.insert(top.end(), bottom.begin(), bottom.end());
  return top;
}

/// A view of `count` rows/columns inside an existing buffer.
TensorView sub_view(void* base, int64_t element_offset, DType dtype,
                    std::initializer_list<int64_t> sizes, std::initializer_list<int64_t> strides) {
  char* data = static_cast<char*>(base) + element_offset * int64_t(dtype_size(dtype));
  return make_view(data, dtype, kCPU, sizes, strides);
}

/// Everything one forward + backward produced, for the path-equivalence test.
struct PackedResult {
  std::vector<uint16_t> q, k, qkv, grad_x, grad_weight;
  std::vector<uint8_t> grad_row, grad_t;
  double grad_qkv_scale = 0;
};

PackedResult run_and_check(const PackedCase& c) {
  SCOPED_TRACE(c.describe());
  auto rng = rng_for_test();
  const ref::Rope rope = c.rope();
  const int64_t T = c.tokens, C = c.channels, qkv_dim = c.qkv_dim(), qk_features = c.qk_features();
  const int64_t v_features = c.v_features();
  const int64_t Hq = c.heads, Hkv = c.k_heads(), D = c.head_dim;
  PackedResult result;

  // ---- inputs
  const std::vector<uint8_t> x_f8 = random_e4m3(rng, size_t(T * C));
  const std::vector<uint8_t> weight_f8 = random_e4m3(rng, size_t(qkv_dim * C), 100.0f);
  // The layout's angles and weights (RopeData's own qk is not used: the GEMM makes qk).
  RopeData angles(rope, c.spec, rng);
  const RopeLayout layout = angles.layout();
  HostTensor x_t(DType::kFloat8E4M3, {T, C}), weight_t(DType::kFloat8E4M3, {qkv_dim, C});
  HostTensor x_scale(DType::kFloat32, {}), weight_scale(DType::kFloat32, {}),
      qkv_scale(DType::kFloat32, {});
  x_t.set_codes(x_f8);
  weight_t.set_codes(weight_f8);
  x_scale.set({kXScale});
  weight_scale.set({kWeightScale});
  qkv_scale.set({c.qkv_scale});

  // ---- forward
  HostTensor qkv(DType::kBFloat16, {T, qkv_dim});  // used when joined
  HostTensor qk_alone(DType::kBFloat16, {T, Hq + Hkv, D});
  HostTensor v_alone(DType::kBFloat16, {T, Hkv, c.v_dim});
  const TensorView qk_view = c.joined_qkv
                                 ? sub_view(qkv.view().data, 0, DType::kBFloat16, {T, Hq + Hkv, D},
                                            {qkv_dim, D, 1})
                                 : qk_alone.view();
  const TensorView v_view = c.joined_qkv ? sub_view(qkv.view().data, qk_features, DType::kBFloat16,
                                                    {T, Hkv, c.v_dim}, {qkv_dim, c.v_dim, 1})
                                         : v_alone.view();
  HostTensor q(DType::kBFloat16, {rope.out_tokens(), rope.q_out_heads(), D});
  HostTensor k(DType::kBFloat16, {rope.out_tokens(), rope.k_out_heads(), D});
  HostTensor v_out(DType::kBFloat16, {T, Hkv, c.v_dim});
  packed_qkv_forward({.x_f8 = x_t.view(),
                      .weight_f8 = weight_t.view(),
                      .x_scale = x_scale.view(),
                      .weight_scale = weight_scale.view(),
                      .qkv_scale = qkv_scale.view(),
                      .qk = qk_view,
                      .v = v_view,
                      .q = q.view(),
                      .k = k.view(),
                      .layout = layout,
                      .v_out = c.normalize_v ? v_out.view() : TensorView{}});

  std::vector<double> qkv_values;
  if (c.joined_qkv) {
    qkv_values = qkv.get();
    result.qkv = qkv.get_bf16_bits();
  } else {
    const std::vector<double> qk_part = qk_alone.get(), v_part = v_alone.get();
    for (int64_t t = 0; t < T; ++t) {
      qkv_values.insert(qkv_values.end(), qk_part.begin() + t * qk_features,
                        qk_part.begin() + (t + 1) * qk_features);
      qkv_values.insert(qkv_values.end(), v_part.begin() + t * v_features,
                        v_part.begin() + (t + 1) * v_features);
    }
    for (double v : qkv_values) result.qkv.push_back(ref::bf16_bits(v));
  }
  const std::vector<double> expected_qkv =
      ref::packed_projection(x_f8, weight_f8, T, qkv_dim, C, kXScale, kWeightScale, c.qkv_scale);
  std::vector<double> slack(expected_qkv.size());
  for (size_t i = 0; i < slack.size(); ++i) slack[i] = std::ldexp(std::fabs(expected_qkv[i]), -22);
  EXPECT_TRUE(passes(compare_bf16("qkv (qk and v)", result.qkv, expected_qkv, slack)));

  const std::vector<double> qk_values = columns(qkv_values, T, qkv_dim, 0, qk_features);
  const ref::QkPair expected_qk = ref::rope_forward(rope, qk_values, angles.tensors);
  result.q = q.get_bf16_bits();
  result.k = k.get_bf16_bits();
  EXPECT_TRUE(passes(compare_bf16("q", result.q, expected_qk.q,
                                  row_noise(expected_qk.q, c.head_dim, kFp32Noise))));
  EXPECT_TRUE(passes(compare_bf16("k", result.k, expected_qk.k,
                                  row_noise(expected_qk.k, c.head_dim, kFp32Noise))));
  // The V norm: v_out from the op's own raw V, which v keeps for the backward.
  const std::vector<double> v_values = columns(qkv_values, T, qkv_dim, qk_features, v_features);
  if (c.normalize_v) {
    const std::vector<double> expected_v =
        ref::v_norm_forward(T * Hkv, c.v_dim, c.eps, v_values);
    EXPECT_TRUE(passes(compare_bf16("v_out", v_out.get_bf16_bits(), expected_v,
                                    row_noise(expected_v, c.v_dim, kFp32Noise))));
  } else {
    EXPECT_EQ(v_out.elements_touched(), 0) << "v_out written without the V norm";
  }

  // ---- backward
  const std::vector<double> grad_q = random_values(rng, rope.q_count(), DType::kBFloat16, 0.02);
  const std::vector<double> grad_k = random_values(rng, rope.k_count(), DType::kBFloat16, 0.02);
  const std::vector<double> grad_v =
      random_values(rng, size_t(T * v_features), DType::kBFloat16, 0.02);
  const std::vector<double> qk_weight =
      random_values(rng, size_t(qk_features * C), DType::kBFloat16, 0.02);
  const std::vector<double> v_weight =
      random_values(rng, size_t(v_features * C), DType::kBFloat16, 0.02);
  HostTensor grad_q_t(DType::kBFloat16, {rope.out_tokens(), rope.q_out_heads(), D});
  HostTensor grad_k_t(DType::kBFloat16, {rope.out_tokens(), rope.k_out_heads(), D});
  HostTensor grad_v_t(DType::kBFloat16, {T, Hkv, c.v_dim});
  HostTensor qk_saved(DType::kBFloat16, {T, Hq + Hkv, D});
  HostTensor v_saved(DType::kBFloat16, {T, Hkv, c.v_dim});
  v_saved.set(v_values);
  HostTensor x_f8_t(DType::kFloat8E4M3, {C, T}), weight_f8_t(DType::kFloat8E4M3, {C, qkv_dim});
  HostTensor qk_weight_t(DType::kBFloat16, {qk_features, C}),
      v_weight_t(DType::kBFloat16, {v_features, C});
  HostTensor grad_scale(DType::kFloat32, {1});
  grad_q_t.set(grad_q);
  grad_k_t.set(grad_k);
  grad_v_t.set(grad_v);
  qk_saved.set(qk_values);
  x_f8_t.set_codes(transpose(x_f8, T, C));
  weight_f8_t.set_codes(transpose(weight_f8, qkv_dim, C));
  qk_weight_t.set(qk_weight);
  v_weight_t.set(v_weight);
  grad_scale.set({kGradScale});

  HostTensor grad_row(DType::kFloat8E4M3, {T, qkv_dim}), grad_t(DType::kFloat8E4M3, {qkv_dim, T});
  HostTensor partials(DType::kFloat32, {kGradScalePartials});
  HostTensor grad_x(DType::kBFloat16, {T, C}, {C + 8, 1});  // padded rows: a strided output
  HostTensor grad_weight(DType::kBFloat16, {qkv_dim, C});   // used when joined
  HostTensor grad_qk_alone(DType::kBFloat16, {qk_features, C}),
      grad_v_alone(DType::kBFloat16, {v_features, C});
  HostTensor grad_qkv_scale(DType::kFloat32, {});
  // The norm weights' gradients: present exactly when the weights are, poisoned.
  std::optional<HostTensor> grad_q_norm, grad_k_norm;
  if (angles.q_weight) {
    grad_q_norm.emplace(c.spec.weight_dtype, std::vector<int64_t>{rope.weight_width(false)});
  }
  if (angles.k_weight) {
    grad_k_norm.emplace(c.spec.weight_dtype, std::vector<int64_t>{rope.weight_width(true)});
  }
  const TensorView grad_qk_view =
      c.joined_weight_grads
          ? sub_view(grad_weight.view().data, 0, DType::kBFloat16, {qk_features, C}, {C, 1})
          : grad_qk_alone.view();
  const TensorView grad_v_view = c.joined_weight_grads
                                     ? sub_view(grad_weight.view().data, qk_features * C,
                                                DType::kBFloat16, {v_features, C}, {C, 1})
                                     : grad_v_alone.view();
  PackedQkvBackwardParams backward{.grad_q = grad_q_t.view(),
                       .grad_k = grad_k_t.view(),
                       .grad_v = grad_v_t.view(),
                       .qk = qk_saved.view(),
                       .x_f8_t = x_f8_t.view(),
                       .weight_f8_t = weight_f8_t.view(),
                       .qk_weight = qk_weight_t.view(),
                       .v_weight = v_weight_t.view(),
                       .x_scale = x_scale.view(),
                       .weight_scale = weight_scale.view(),
                       .qkv_scale = qkv_scale.view(),
                       .grad_scale = grad_scale.view(),
                       .grad_row = grad_row.view(),
                       .grad_t = grad_t.view(),
                       .partials = partials.view(),
                       .grad_x = grad_x.view(),
                       .grad_qk_weight = grad_qk_view,
                       .grad_v_weight = grad_v_view,
                       .grad_qkv_scale = grad_qkv_scale.view(),
                       .layout = layout,
                       .v = c.normalize_v ? v_saved.view() : TensorView{}};
  backward.grad_q_weight = grad_q_norm ? grad_q_norm->view() : TensorView{};
  backward.grad_k_weight = grad_k_norm ? grad_k_norm->view() : TensorView{};
  EXPECT_EQ(backward_workspace_size(backward), 0) << "the CPU backend needs no rope workspace";
  packed_qkv_backward(backward);

  // Fused FP8 gradient.
  const std::vector<double> values = ref::qkv_backward_values(
      rope, c.v_dim, grad_q, grad_k, grad_v, qk_values, angles.tensors, v_values);
  const ref::RopeGradients rope_grads =
      ref::rope_gradients(rope, grad_q, grad_k, qk_values, angles.tensors);
  const std::vector<double> v_terms =
      c.normalize_v ? ref::v_norm_gradients(T * Hkv, c.v_dim, c.eps, v_values, grad_v).term_scale
                    : std::vector<double>{};
  const std::vector<double> noise =
      qkv_feature_noise(rope, c.v_dim, values, kFp32Noise, rope_grads.term_scale, v_terms);
  result.grad_row = grad_row.get_codes();
  result.grad_t = grad_t.get_codes();
  EXPECT_TRUE(passes(compare_e4m3("grad_row", result.grad_row, values, kGradScale, noise)));
  EXPECT_EQ(result.grad_t, transpose(result.grad_row, T, qkv_dim));

  // The norm weights' gradients: the model's sums within a float32 sum's error.
  for (int kind = 0; kind < 2; ++kind) {
    std::optional<HostTensor>& got = kind == 0 ? grad_q_norm : grad_k_norm;
    if (!got) continue;
    const std::vector<double> tolerance =
        fp32_sum_tolerance(kind == 0 ? rope_grads.q_weight_magnitude : rope_grads.k_weight_magnitude,
                           kind == 0 ? rope_grads.q_weight_terms : rope_grads.k_weight_terms);
    const std::vector<double>& want = kind == 0 ? rope_grads.grad_q_weight : rope_grads.grad_k_weight;
    const std::string what = kind == 0 ? "grad_q_weight (norm)" : "grad_k_weight (norm)";
    if (c.spec.weight_dtype == DType::kBFloat16) {
      EXPECT_TRUE(passes(compare_bf16(what, got->get_bf16_bits(), want, tolerance)));
    } else {
      EXPECT_TRUE(passes(compare_close(what, got->get(), want, tolerance)));
    }
  }

  // Weight gradient: the reference GEMM of the op's own grad_t, scaled by qkv_scale.
  const std::vector<double> unscaled =
      ref::gemm(result.grad_t, transpose(x_f8, T, C), qkv_dim, C, T, double(kGradScale) * kXScale);
  std::vector<double> unscaled_bf16(unscaled.size());
  for (size_t i = 0; i < unscaled.size(); ++i) unscaled_bf16[i] = ref::round_bf16(unscaled[i]);
  const ref::WeightGrads expected_w =
      ref::packed_weight_grads(unscaled_bf16, concat(qk_weight, v_weight), c.qkv_scale);
  std::vector<double> carried(unscaled.size());  // one ulp (<= 2^-7 relative) of the GEMM output
  for (size_t i = 0; i < carried.size(); ++i)
    carried[i] = std::ldexp(std::fabs(expected_w.grad_weight[i]), -7);
  result.grad_weight = c.joined_weight_grads
                           ? grad_weight.get_bf16_bits()
                           : concat(grad_qk_alone.get_bf16_bits(), grad_v_alone.get_bf16_bits());
  EXPECT_TRUE(passes(compare_bf16("grad_qk_weight; grad_v_weight", result.grad_weight,
                                  expected_w.grad_weight, carried)));

  // grad_qkv_scale: products exact, fp32 sum (~1e-6 of the sum's scale sqrt(sum p^2)) plus the
  // same possible one-ulp differences of the unscaled gradient (<= 2^-7 of each product).
  double squares = 0;
  const std::vector<double> weights = concat(qk_weight, v_weight);
  for (size_t i = 0; i < weights.size(); ++i) squares += std::pow(unscaled_bf16[i] * weights[i], 2);
  result.grad_qkv_scale = grad_qkv_scale.get()[0];
  EXPECT_TRUE(
      passes(compare_close("grad_qkv_scale", {result.grad_qkv_scale}, {expected_w.grad_qkv_scale},
                           {(1e-4 + std::ldexp(1.0, -7)) * std::sqrt(squares)})));

  // Input gradient: the reference GEMM of the op's own grad_row.
  const std::vector<double> expected_x =
      ref::gemm(result.grad_row, transpose(weight_f8, qkv_dim, C), T, C, qkv_dim,
                double(kGradScale) * kWeightScale * c.qkv_scale);
  std::vector<double> x_slack(expected_x.size());
  for (size_t i = 0; i < x_slack.size(); ++i)
    x_slack[i] = std::ldexp(std::fabs(expected_x[i]), -22);
  result.grad_x = grad_x.get_bf16_bits();
  EXPECT_TRUE(passes(compare_bf16("grad_x", result.grad_x, expected_x, x_slack)));
  EXPECT_EQ(grad_x.padding_touched(), 0) << "grad_x's row padding was written";
  return result;
}

TEST(CpuPackedQkv, SmallOddShapes) {
  PackedCase c;  // T=3, C=40, H=2, D=34, Dv=20
  run_and_check(c);
  c.paired = true;
  run_and_check(c);
  c.paired = false;
  c.key_offset = true;
  c.rotary_dim = 16;
  run_and_check(c);

  PackedCase single;
  single.tokens = 17;
  single.channels = 24;
  single.heads = 1;
  single.head_dim = 32;
  single.v_dim = 48;
  run_and_check(single);
  single.tokens = 1;
  run_and_check(single);
}

TEST(CpuPackedQkv, OneAndTwoGemmPathsAgreeBitwise) {
  // Same test name, same seed: identical inputs for every run below.
  PackedCase c;
  c.paired = true;
  const PackedResult joined = run_and_check(c);
  c.joined_qkv = false;
  c.joined_weight_grads = false;
  const PackedResult split = run_and_check(c);
  EXPECT_EQ(joined.qkv, split.qkv);
  EXPECT_EQ(joined.q, split.q);
  EXPECT_EQ(joined.k, split.k);
  EXPECT_EQ(joined.grad_row, split.grad_row);
  EXPECT_EQ(joined.grad_weight, split.grad_weight);
  EXPECT_EQ(joined.grad_x, split.grad_x);
  EXPECT_EQ(joined.grad_qkv_scale, split.grad_qkv_scale);
}

/// SPEC.md section 7 at a reduced T: C = 768, H = 6, Dv = 128, bf16 factor tables.
PackedCase model_case(int64_t head_dim, int64_t heads = 6) {
  PackedCase c;
  c.tokens = 64;
  c.channels = 768;
  c.heads = heads;
  c.head_dim = head_dim;
  c.v_dim = 128;
  return c;
}

TEST(CpuPackedQkv, ModelD128AllModes) {
  PackedCase c = model_case(128);
  run_and_check(c);
  c.paired = true;
  c.joined_qkv = false;  // paired layers write v dense with a second GEMM
  c.qkv_scale = 0.5f;
  run_and_check(c);
  c = model_case(128);
  c.key_offset = true;
  c.rotary_dim = 64;
  c.joined_weight_grads = false;
  run_and_check(c);
}

TEST(CpuPackedQkv, ModelD96AndD64) {
  PackedCase c = model_case(96);
  c.key_offset = true;
  c.rotary_dim = 48;
  run_and_check(c);
  c = model_case(64);
  c.paired = true;
  c.joined_qkv = false;
  run_and_check(c);
  run_and_check(model_case(64, 12));
}

// ---- general layouts (SPEC.md section 8) -------------------------------------------------------

TEST(CpuPackedQkv, GqaWithNormWeightsAndACosSinCache) {
  // Qwen3-like: 4 query heads over 2 KV heads, NeoX from a cos/sin cache at packed positions,
  // q_norm and k_norm weights; one and two GEMMs for qkv and for the weight gradients.
  for (int variant = 0; variant < 4; ++variant) {
    PackedCase c;
    c.tokens = 7;
    c.channels = 48;
    c.heads = 4;
    c.kv_heads = 2;
    c.head_dim = 32;
    c.v_dim = 24;
    c.neox = true;
    c.eps = double(1e-6f);
    c.spec.cache = true;
    c.spec.packed = true;
    c.spec.position_dtype = variant % 2 ? DType::kInt32 : DType::kInt64;
    c.spec.q_weight = c.spec.k_weight = true;
    c.spec.weight_dtype = variant < 2 ? DType::kBFloat16 : DType::kFloat32;
    c.joined_qkv = variant != 1;
    c.joined_weight_grads = variant != 2;
    run_and_check(c);
  }
}

TEST(CpuPackedQkv, MqaGemmaAndPartialRotaryLayouts) {
  PackedCase mqa;  // MQA, Gemma's (1 + w) with weights around 0, interleaved tables
  mqa.tokens = 5;
  mqa.channels = 32;
  mqa.heads = 3;
  mqa.kv_heads = 1;
  mqa.head_dim = 64;
  mqa.v_dim = 64;
  mqa.weight_offset = 1.0;
  mqa.spec.q_weight = mqa.spec.k_weight = true;
  mqa.spec.weight_mean = 0.0;
  run_and_check(mqa);

  PackedCase glm;  // partial NeoX rotary (r = D/2) over a cache, key weight only
  glm.tokens = 9;
  glm.channels = 40;
  glm.heads = 4;
  glm.kv_heads = 1;
  glm.head_dim = 32;
  glm.rotary_dim = 16;
  glm.v_dim = 16;
  glm.neox = true;
  glm.spec.cache = true;
  glm.spec.k_weight = true;
  run_and_check(glm);

  PackedCase llama;  // no QK norm, GQA, cache
  llama.tokens = 3;
  llama.channels = 24;
  llama.heads = 6;
  llama.kv_heads = 2;
  llama.head_dim = 16;
  llama.v_dim = 8;
  llama.neox = true;
  llama.normalize = false;
  llama.spec.cache = true;
  run_and_check(llama);
}

// ---- the families' options (SPEC.md section 9) ------------------------------------------------

TEST(CpuPackedQkv, VNormTokenNormQueryOnlyAndNoAngles) {
  // Gemma 4: (q, k) norm weights and the V norm, D = 256 heads in small number; one and two
  // GEMMs for qkv and for the weight gradients.
  for (int variant = 0; variant < 3; ++variant) {
    PackedCase gemma;
    gemma.tokens = 5;
    gemma.channels = 32;
    gemma.heads = 2;
    gemma.kv_heads = 1;
    gemma.head_dim = 256;
    gemma.v_dim = 256;
    gemma.neox = true;
    gemma.eps = double(1e-6f);
    gemma.normalize_v = true;
    gemma.spec.cache = true;
    gemma.spec.packed = true;
    gemma.spec.q_weight = gemma.spec.k_weight = true;
    gemma.joined_qkv = variant != 1;
    gemma.joined_weight_grads = variant != 2;
    run_and_check(gemma);
  }
  // Gemma 4's KV-shared layers: the Q rows of the weight alone, D = 512.
  PackedCase shared;
  shared.tokens = 3;
  shared.channels = 24;
  shared.heads = 2;
  shared.head_dim = 512;
  shared.v_dim = 8;
  shared.query_only = true;
  shared.neox = true;
  shared.spec.cache = true;
  shared.spec.q_weight = true;
  run_and_check(shared);
  shared.joined_qkv = shared.joined_weight_grads = false;
  run_and_check(shared);
  // OLMo: the token-wide norm, weights [H*D].
  PackedCase olmo;
  olmo.tokens = 7;
  olmo.channels = 40;
  olmo.heads = 4;
  olmo.head_dim = 32;
  olmo.v_dim = 32;
  olmo.neox = true;
  olmo.token_norm = true;
  olmo.spec.cache = true;
  olmo.spec.q_weight = olmo.spec.k_weight = true;
  run_and_check(olmo);
  // SmolLM3's NoPE layers: no norm, no angles (q and k are the GEMM's rows, rounded once).
  PackedCase nope;
  nope.tokens = 4;
  nope.channels = 16;
  nope.heads = 4;
  nope.kv_heads = 2;
  nope.head_dim = 16;
  nope.v_dim = 16;
  nope.normalize = false;
  nope.angles = false;
  run_and_check(nope);
}

TEST(CpuPackedQkv, EmptyBackwardWritesZeroNormWeightGradients) {
  // T = 0: the projection writes nothing; the norm weights' gradients are zeros.
  const int64_t C = 16, Hq = 4, Hkv = 2, D = 32, Dv = 8;
  const int64_t qk_features = (Hq + Hkv) * D, v_features = Hkv * Dv;
  const int64_t qkv = qk_features + v_features;
  HostTensor guard(DType::kBFloat16, {64}), guard_f8(DType::kFloat8E4M3, {64});
  HostTensor weight_f8_t(DType::kFloat8E4M3, {C, qkv});
  HostTensor qk_weight(DType::kBFloat16, {qk_features, C}), v_weight(DType::kBFloat16, {v_features, C});
  HostTensor scale(DType::kFloat32, {}), partials(DType::kFloat32, {kGradScalePartials});
  HostTensor grad_weight(DType::kBFloat16, {qkv, C}), grad_qkv_scale(DType::kFloat32, {});
  HostTensor q_weight(DType::kFloat32, {D}), k_weight(DType::kBFloat16, {D});
  HostTensor grad_q_weight(DType::kFloat32, {D}), grad_k_weight(DType::kBFloat16, {D});
  HostTensor cos_sin(DType::kBFloat16, {4, D});
  for (HostTensor* t : {&weight_f8_t, &qk_weight, &v_weight, &scale, &q_weight, &k_weight, &cos_sin}) {
    t->set(std::vector<double>(size_t(t->numel()), 0.5));
  }
  RopeLayout layout;
  layout.num_heads = Hq;
  layout.num_kv_heads = Hkv;
  layout.rotary_style = RotaryStyle::kNeox;
  layout.cos_sin = cos_sin.view();
  layout.positions = make_view(guard.view().data, DType::kInt64, kCPU, {0});
  layout.q_weight = q_weight.view();
  layout.k_weight = k_weight.view();
  const auto bf16 = [&](std::initializer_list<int64_t> sizes) {
    return make_view(guard.view().data, DType::kBFloat16, kCPU, sizes);
  };
  const auto f8 = [&](std::initializer_list<int64_t> sizes) {
    return make_view(guard_f8.view().data, DType::kFloat8E4M3, kCPU, sizes);
  };
  packed_qkv_backward({.grad_q = bf16({0, Hq, D}),
                       .grad_k = bf16({0, Hkv, D}),
                       .grad_v = bf16({0, Hkv, Dv}),
                       .qk = bf16({0, Hq + Hkv, D}),
                       .x_f8_t = f8({C, 0}),
                       .weight_f8_t = weight_f8_t.view(),
                       .qk_weight = qk_weight.view(),
                       .v_weight = v_weight.view(),
                       .x_scale = scale.view(),
                       .weight_scale = scale.view(),
                       .qkv_scale = scale.view(),
                       .grad_scale = scale.view(),
                       .grad_row = f8({0, qkv}),
                       .grad_t = f8({qkv, 0}),
                       .partials = partials.view(),
                       .grad_q_weight = grad_q_weight.view(),
                       .grad_k_weight = grad_k_weight.view(),
                       .grad_x = bf16({0, C}),
                       .grad_qk_weight = make_view(grad_weight.view().data, DType::kBFloat16, kCPU,
                                                   {qk_features, C}),
                       .grad_v_weight = make_view(static_cast<uint16_t*>(grad_weight.view().data) +
                                                      qk_features * C,
                                                  DType::kBFloat16, kCPU, {v_features, C}),
                       .grad_qkv_scale = grad_qkv_scale.view(),
                       .layout = layout});
  EXPECT_EQ(grad_q_weight.get(), std::vector<double>(D, 0.0));
  EXPECT_EQ(grad_k_weight.get(), std::vector<double>(D, 0.0));
  EXPECT_EQ(grad_weight.elements_touched(), 0) << "the projection's gradient was written";
  EXPECT_EQ(grad_qkv_scale.elements_touched(), 0);
  EXPECT_EQ(guard.elements_touched(), 0);
  EXPECT_EQ(guard_f8.elements_touched(), 0);
}

// ---- the finalize step on its own (exact inputs, tight tolerance) ----------------------------

void check_finalize(int64_t qk_rows, int64_t v_rows, int64_t channels, bool positive) {
  SCOPED_TRACE(::testing::Message() << qk_rows << " + " << v_rows << " rows x " << channels
                                    << (positive ? " positive" : " random signs"));
  auto rng = rng_for_test();
  const size_t qk_count = size_t(qk_rows * channels), v_count = size_t(v_rows * channels);
  std::vector<double> grads = random_values(rng, qk_count + v_count, DType::kBFloat16);
  std::vector<double> weights = random_values(rng, qk_count + v_count, DType::kBFloat16);
  if (positive) {
    for (double& g : grads) g = std::fabs(g);
    for (double& w : weights) w = std::fabs(w);
  }
  const float qkv_scale = 0.83f;
  HostTensor grad_qk(DType::kBFloat16, {qk_rows, channels}),
      grad_v(DType::kBFloat16, {v_rows, channels});
  HostTensor qk_weight(DType::kBFloat16, {qk_rows, channels}),
      v_weight(DType::kBFloat16, {v_rows, channels});
  HostTensor scale(DType::kFloat32, {}), partials(DType::kFloat32, {kGradScalePartials});
  HostTensor out(DType::kFloat32, {});
  grad_qk.set({grads.begin(), grads.begin() + qk_count});
  grad_v.set({grads.begin() + qk_count, grads.end()});
  qk_weight.set({weights.begin(), weights.begin() + qk_count});
  v_weight.set({weights.begin() + qk_count, weights.end()});
  scale.set({qkv_scale});
  cpu::grad_weight_finalize({grad_qk.view(), grad_v.view(), qk_weight.view(), v_weight.view(),
                             scale.view(), partials.view(), out.view()});

  const ref::WeightGrads expected = ref::packed_weight_grads(grads, weights, qkv_scale);
  EXPECT_TRUE(passes(compare_bf16("scaled grad weights",
                                  concat(grad_qk.get_bf16_bits(), grad_v.get_bf16_bits()),
                                  expected.grad_weight)));
  double sum_abs = 0, squares = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    sum_abs += std::fabs(grads[i] * weights[i]);
    squares += std::pow(grads[i] * weights[i], 2);
  }
  // Positive terms: the deterministic bound of an fp32 sum whose chains are at most
  // ceil(n / partials) + partials long. Random signs: 1e-4 of the sum's natural scale.
  const double n = double(grads.size());
  const double tolerance =
      positive ? (std::ceil(n / kGradScalePartials) + kGradScalePartials) * std::ldexp(sum_abs, -24)
               : 1e-4 * std::sqrt(squares);
  EXPECT_TRUE(
      passes(compare_close("grad_qkv_scale", out.get(), {expected.grad_qkv_scale}, {tolerance})));
}

TEST(CpuPackedQkv, GradWeightFinalizeMatchesReference) {
  for (bool positive : {false, true}) {
    check_finalize(2, 1, 3, positive);     // fewer elements than partials
    check_finalize(12, 6, 100, positive);  // not a multiple of the partial count
    check_finalize(768, 768, 64, positive);
  }
}

}  // namespace
}  // namespace qkvfuse::test
