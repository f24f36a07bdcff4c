// test_cpu_rope_layouts.cpp: the general layouts of SPEC.md section 8 on the CPU backend, against
// the float64 model of tests/reference.hpp: GQA and MQA heads, NeoX and interleaved rotary, partial
// and zero rotary widths, no norm / RMS / RMS * w / RMS * (1 + w) with any eps, factor tables or a
// cos/sin cache at int32 or int64 positions (packed documents too), the norm weights' gradients,
// every option combined with the others (a parameterized sweep) and with the speedrun's paired
// heads and key offset, real model shapes, and finite differences of the float64 model.
//
// Tolerances (those of test_cpu_qk_norm_rope.cpp): bf16 outputs within one ulp of the rounded
// model, further only within 2^-18 of the row's largest value or of the backward's term scale
// (ref::RopeGradients::term_scale); float32 outputs within the same noise, float64 within 1e-12
// of it. Weight gradients: the model's exact sum within the bound of a float32 sum of the same
// terms (fp32_sum_tolerance), then one bf16 ulp for bf16 weights. FP8: every Q/K code within one
// e4m3 step of the model's (or its row noise), V codes exact, and exactly the e4m3 of the
// backend's own bf16 backward.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "qkvfuse/qk_norm_rope.hpp"
#include "qkvfuse/qkv_backward_fp8.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace qkvfuse::test {
namespace {

constexpr double kFp32Noise = 1.0 / (1 << 18);  // 64 fp32 ulps of the row's largest value
constexpr double kFp64Noise = 1e-12;
const double kNaN = std::numeric_limits<double>::quiet_NaN();

double noise_of(DType dtype) { return dtype == DType::kFloat64 ? kFp64Noise : kFp32Noise; }

/// A bf16 (or `dtype`) [a, b, w] tensor whose heads and rows are padded by `padding` elements.
HostTensor padded(DType dtype, int64_t a, int64_t b, int64_t w, int64_t padding) {
  return HostTensor(dtype, {a, b, w}, {b * (w + padding) + padding, w + padding, 1});
}

/// Compares by dtype: bf16 by ulps, float32 and float64 against the noise bound.
::testing::AssertionResult matches(const std::string& what, const HostTensor& got, DType dtype,
                                   const std::vector<double>& expected,
                                   const std::vector<double>& noise) {
  if (dtype == DType::kBFloat16) {
    return passes(compare_bf16(what, got.get_bf16_bits(), expected, noise));
  }
  return passes(compare_close(what, got.get(), expected, noise));
}

/// The weight gradients' tolerance: a float32 sum of the model's terms (float64 sums: 1e-12).
std::vector<double> weight_tolerance(const std::vector<double>& magnitude, int64_t terms,
                                     DType compute) {
  if (compute != DType::kFloat64) return fp32_sum_tolerance(magnitude, terms);
  std::vector<double> tolerance(magnitude.size());
  for (size_t i = 0; i < magnitude.size(); ++i) tolerance[i] = kFp64Noise * magnitude[i];
  return tolerance;
}

/// Whether two tensors hold the same bits (NaN payloads included), element by element.
bool same_bits(const HostTensor& a, const HostTensor& b) {
  const std::vector<double> x = a.get(), y = b.get();
  return x.size() == y.size() &&
         (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(double)) == 0);
}

// ---- running the ops ---------------------------------------------------------------------------

struct ForwardOut {
  HostTensor q, k;
};

ForwardOut run_forward(RopeData& data) {
  const ref::Rope& r = data.rope;
  ForwardOut out{HostTensor(data.spec.qk_dtype, {r.out_tokens(), r.q_out_heads(), r.head_dim}),
                 HostTensor(data.spec.qk_dtype, {r.out_tokens(), r.k_out_heads(), r.head_dim})};
  qk_norm_rope({data.qk_tensor->view(), out.q.view(), out.k.view(), data.layout()});
  return out;
}

/// Fresh random output gradients for `data`, in its qk dtype, padded by `padding`.
struct Grads {
  std::vector<double> q, k;
  HostTensor q_tensor, k_tensor;
  Grads(std::mt19937_64& rng, const RopeData& data, int64_t padding = 0)
      : q(random_values(rng, data.rope.q_count(), data.spec.qk_dtype)),
        k(random_values(rng, data.rope.k_count(), data.spec.qk_dtype)),
        q_tensor(padded(data.spec.qk_dtype, data.rope.out_tokens(), data.rope.q_out_heads(),
                        data.rope.head_dim, padding)),
        k_tensor(padded(data.spec.qk_dtype, data.rope.out_tokens(), data.rope.k_out_heads(),
                        data.rope.head_dim, padding)) {
    q_tensor.set(q);
    k_tensor.set(k);
  }
};

/// The weight gradient outputs of a call: present exactly when the weights are, poisoned.
struct WeightGradOut {
  std::optional<HostTensor> q, k;
  explicit WeightGradOut(const RopeData& data) {
    if (data.q_weight) q.emplace(data.spec.weight_dtype, std::vector<int64_t>{data.rope.head_dim});
    if (data.k_weight) k.emplace(data.spec.weight_dtype, std::vector<int64_t>{data.rope.head_dim});
  }
  TensorView q_view() { return q ? q->view() : TensorView{}; }
  TensorView k_view() { return k ? k->view() : TensorView{}; }
};

struct BackwardOut {
  HostTensor grad_qk;
  WeightGradOut weights;
};

BackwardOut run_backward(RopeData& data, Grads& grads) {
  const ref::Rope& r = data.rope;
  BackwardOut out{HostTensor(data.spec.qk_dtype, {r.tokens, r.input_heads(), r.head_dim}),
                  WeightGradOut(data)};
  QkNormRopeBackwardParams p;
  p.grad_q = grads.q_tensor.view();
  p.grad_k = grads.k_tensor.view();
  p.qk = data.qk_tensor->view();
  p.grad_qk = out.grad_qk.view();
  p.grad_q_weight = out.weights.q_view();
  p.grad_k_weight = out.weights.k_view();
  p.layout = data.layout();
  EXPECT_EQ(backward_workspace_size(p), 0) << "the CPU backend needs no workspace";
  qk_norm_rope_backward(p);
  return out;
}

/// The weight gradients against the model.
void expect_weight_grads(const RopeData& data, WeightGradOut& got,
                         const ref::RopeGradients& want) {
  const DType compute = data.spec.qk_dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  for (int kind = 0; kind < 2; ++kind) {
    std::optional<HostTensor>& out = kind == 0 ? got.q : got.k;
    if (!out) continue;
    const std::vector<double>& value = kind == 0 ? want.grad_q_weight : want.grad_k_weight;
    const std::vector<double> tolerance =
        weight_tolerance(kind == 0 ? want.q_weight_magnitude : want.k_weight_magnitude,
                         kind == 0 ? want.q_weight_terms : want.k_weight_terms, compute);
    EXPECT_TRUE(matches(kind == 0 ? "grad_q_weight" : "grad_k_weight", *out,
                        data.spec.weight_dtype, value, tolerance));
  }
}

// ---- the checks ----------------------------------------------------------------------------------

void check_forward(RopeData& data) {
  SCOPED_TRACE("forward");
  ForwardOut out = run_forward(data);
  const ref::QkPair want = ref::rope_forward(data.rope, data.qk, data.tensors);
  const double noise = noise_of(data.spec.qk_dtype);
  const int64_t D = data.rope.head_dim;
  EXPECT_TRUE(matches("q", out.q, data.spec.qk_dtype, want.q, row_noise(want.q, D, noise)));
  EXPECT_TRUE(matches("k", out.k, data.spec.qk_dtype, want.k, row_noise(want.k, D, noise)));
  EXPECT_EQ(data.qk_tensor->padding_touched(), 0) << "qk's padding was written";
}

void check_backward(RopeData& data, std::mt19937_64& rng, int64_t grad_padding = 0) {
  SCOPED_TRACE("backward");
  Grads grads(rng, data, grad_padding);
  BackwardOut out = run_backward(data, grads);
  const ref::RopeGradients want =
      ref::rope_gradients(data.rope, grads.q, grads.k, data.qk, data.tensors);
  const double noise = noise_of(data.spec.qk_dtype);
  const int64_t D = data.rope.head_dim;
  std::vector<double> dx_noise = row_noise(want.grad_qk, D, noise);
  widen_by_terms(dx_noise, want.term_scale, D, noise);
  EXPECT_TRUE(matches("grad_qk", out.grad_qk, data.spec.qk_dtype, want.grad_qk, dx_noise));
  expect_weight_grads(data, out.weights, want);

  // The same call again: the same bits (fixed summation order).
  BackwardOut again = run_backward(data, grads);
  EXPECT_TRUE(same_bits(again.grad_qk, out.grad_qk)) << "grad_qk differs between runs";
  if (out.weights.q) EXPECT_TRUE(same_bits(*out.weights.q, *again.weights.q));
  if (out.weights.k) EXPECT_TRUE(same_bits(*out.weights.k, *again.weights.k));
}

/// qkv_backward_fp8 of `data` (bf16 qk) against the model and against the backend's own bf16
/// backward.
void check_fp8(RopeData& data, std::mt19937_64& rng, int64_t v_dim, float grad_scale,
               int64_t padding = 0) {
  SCOPED_TRACE(::testing::Message() << "qkv_backward_fp8 Dv=" << v_dim << " grad_scale "
                                    << grad_scale);
  const ref::Rope& r = data.rope;
  const int64_t T = r.tokens, features = ref::qkv_dim(r, v_dim);
  const int64_t qk_features = r.input_heads() * r.head_dim;
  Grads grads(rng, data, padding);
  const std::vector<double> grad_v =
      random_values(rng, size_t(T * r.k_heads() * v_dim), DType::kBFloat16);
  HostTensor grad_v_tensor = padded(DType::kBFloat16, T, r.k_heads(), v_dim, padding);
  grad_v_tensor.set(grad_v);
  HostTensor scale(DType::kFloat32, {});
  scale.set({grad_scale});
  HostTensor grad_row(DType::kFloat8E4M3, {T, features});
  HostTensor grad_t(DType::kFloat8E4M3, {features, T});
  WeightGradOut weights(data);
  QkvBackwardFp8Params p;
  p.grad_q = grads.q_tensor.view();
  p.grad_k = grads.k_tensor.view();
  p.grad_v = grad_v_tensor.view();
  p.qk = data.qk_tensor->view();
  p.grad_scale = scale.view();
  p.grad_row = grad_row.view();
  p.grad_t = grad_t.view();
  p.grad_q_weight = weights.q_view();
  p.grad_k_weight = weights.k_view();
  p.layout = data.layout();
  EXPECT_EQ(backward_workspace_size(p), 0);
  qkv_backward_fp8(p);

  const ref::RopeGradients want =
      ref::rope_gradients(r, grads.q, grads.k, data.qk, data.tensors);
  const std::vector<double> values =
      ref::qkv_backward_values(r, v_dim, grads.q, grads.k, grad_v, data.qk, data.tensors);
  const std::vector<double> noise =
      qkv_feature_noise(r, v_dim, values, kFp32Noise, want.term_scale);
  const std::vector<uint8_t> row = grad_row.get_codes();
  EXPECT_TRUE(passes(compare_e4m3("grad_row", row, values, grad_scale, noise)));
  EXPECT_EQ(grad_t.get_codes(), transpose(row, T, features)) << "grad_t is not grad_row^T";
  int64_t v_bad = 0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t f = qk_features; f < features; ++f) {
      const size_t i = size_t(t * features + f);
      v_bad += row[i] != ref::quantize_code(values[i], grad_scale);
    }
  }
  EXPECT_EQ(v_bad, 0) << "V features differ from e4m3(grad_v / grad_scale)";
  expect_weight_grads(data, weights, want);

  // Q/K codes: exactly e4m3 of the backend's own bf16 backward; the weight gradients: its bits.
  BackwardOut bf16 = run_backward(data, grads);
  const std::vector<double> dx = bf16.grad_qk.get();
  int64_t qk_bad = 0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t f = 0; f < qk_features; ++f) {
      qk_bad += row[size_t(t * features + f)] !=
                ref::quantize_code(dx[size_t(t * qk_features + f)], grad_scale);
    }
  }
  EXPECT_EQ(qk_bad, 0) << "Q/K features differ from e4m3(bf16 backward / grad_scale)";
  if (weights.q) EXPECT_TRUE(same_bits(*weights.q, *bf16.weights.q));
  if (weights.k) EXPECT_TRUE(same_bits(*weights.k, *bf16.weights.k));
}

// ---- the sweep: every option with the others ------------------------------------------------------

enum class Norm { kNone, kRms, kWeights, kGemma, kQueryWeight, kKeyWeight };
enum class Angles { kTablesBf16, kTablesF32, kCacheBf16Int32Packed, kCacheF32Int64 };

const char* norm_name(Norm norm) {
  switch (norm) {
    case Norm::kNone: return "nonorm";
    case Norm::kRms: return "rms";
    case Norm::kWeights: return "rmsw";
    case Norm::kGemma: return "rms1pw";
    case Norm::kQueryWeight: return "rmswq";
    case Norm::kKeyWeight: return "rmswk";
  }
  return "?";
}

const char* angles_name(Angles angles) {
  switch (angles) {
    case Angles::kTablesBf16: return "tablesbf16";
    case Angles::kTablesF32: return "tablesf32";
    case Angles::kCacheBf16Int32Packed: return "cachebf16int32packed";
    case Angles::kCacheF32Int64: return "cachef32int64";
  }
  return "?";
}

struct LayoutParam {
  std::string name;
  ref::Rope rope;
  RopeSpec spec;
};

/// gtest prints a parameter with its test's name (instead of its bytes, which hold pointers).
void PrintTo(const LayoutParam& param, std::ostream* out) { *out << param.name; }

void apply_norm(Norm norm, int64_t index, ref::Rope& rope, RopeSpec& spec) {
  rope.normalize = norm != Norm::kNone;
  spec.q_weight = norm == Norm::kWeights || norm == Norm::kGemma || norm == Norm::kQueryWeight;
  spec.k_weight = norm == Norm::kWeights || norm == Norm::kGemma || norm == Norm::kKeyWeight;
  if (norm == Norm::kGemma) {
    rope.weight_offset = 1.0;
    spec.weight_mean = 0.0;  // Gemma's weights sit around 0: (1 + w) around 1
  }
  // eps: the default 2^-23, Qwen's and Gemma's 1e-6, and a large one that matters at any scale.
  const double eps[] = {1.0 / 8388608.0, double(1e-6f), 0.25};
  rope.eps = eps[index % 3];
  spec.weight_dtype = index % 4 == 1 ? DType::kFloat32 : DType::kBFloat16;
}

void apply_angles(Angles angles, RopeSpec& spec) {
  spec.cache = angles == Angles::kCacheBf16Int32Packed || angles == Angles::kCacheF32Int64;
  spec.angle_dtype = angles == Angles::kTablesF32 || angles == Angles::kCacheF32Int64
                         ? DType::kFloat32
                         : DType::kBFloat16;
  spec.position_dtype =
      angles == Angles::kCacheBf16Int32Packed ? DType::kInt32 : DType::kInt64;
  spec.packed = angles == Angles::kCacheBf16Int32Packed;
}

std::vector<LayoutParam> layout_params() {
  std::vector<LayoutParam> params;
  const int64_t token_counts[] = {1, 3, 7, 17};
  const int64_t widths[] = {64, 34, 128, 16, 96};
  struct Heads {
    int64_t q, kv;
    const char* name;
  };
  const Heads heads_list[] = {{2, 2, "mha2"}, {4, 2, "gqa4x2"}, {3, 1, "mqa3"}, {6, 3, "gqa6x3"}};
  int64_t index = 0;
  const auto add = [&](ref::Rope rope, RopeSpec spec, const std::string& tag) {
    std::ostringstream name;
    name << tag << "_T" << rope.tokens << "_D" << rope.head_dim;
    if (spec.qk_dtype != DType::kBFloat16) name << "_qk" << dtype_name(spec.qk_dtype);
    params.push_back({name.str(), rope, spec});
  };
  for (const Heads& heads : heads_list) {
    for (bool neox : {false, true}) {
      for (int rotary = 0; rotary < 3; ++rotary) {
        for (Norm norm : {Norm::kNone, Norm::kRms, Norm::kWeights, Norm::kGemma,
                          Norm::kQueryWeight, Norm::kKeyWeight}) {
          for (Angles angles : {Angles::kTablesBf16, Angles::kTablesF32,
                                Angles::kCacheBf16Int32Packed, Angles::kCacheF32Int64}) {
            ref::Rope rope;
            rope.tokens = token_counts[index % 4];
            rope.head_dim = widths[(index / 4) % 5];
            rope.heads = heads.q;
            rope.kv_heads = heads.kv == heads.q && index % 2 ? 0 : heads.kv;  // 0 means Hq
            rope.neox = neox;
            const int64_t D = rope.head_dim;
            // Full (-1 = D), partial (about D/2, even, and r % 16 != 0 at times), none.
            rope.rotary_dim = rotary == 0 ? -1 : rotary == 1 ? D / 4 * 2 : 0;
            RopeSpec spec;
            apply_norm(norm, index, rope, spec);
            apply_angles(angles, spec);
            if (index % 9 == 4) spec.qk_dtype = DType::kFloat32;
            if (spec.cache && rope.rotary_dim < 0 && index % 2) {
              rope.rotary_dim = D;  // explicit r = cos_sin's width (else -1 resolves to it)
            }
            spec.qk_row_pad = index % 3 == 2 ? 24 : 0;
            std::ostringstream tag;
            tag << heads.name << (neox ? "_neox" : "_inter")
                << (rotary == 0 ? "_rfull" : rotary == 1 ? "_rhalf" : "_rzero") << "_"
                << norm_name(norm) << "_" << angles_name(angles);
            add(rope, spec, tag.str());
            ++index;
          }
        }
      }
    }
  }
  // The speedrun's key offset (Hq = Hkv) with the new options: style, width, norm, angles.
  for (bool neox : {false, true}) {
    for (int64_t rotary : {0, 2, 16, 62, 64}) {
      for (Norm norm : {Norm::kRms, Norm::kWeights, Norm::kGemma, Norm::kNone}) {
        for (Angles angles : {Angles::kTablesBf16, Angles::kCacheF32Int64}) {
          ref::Rope rope;
          rope.tokens = token_counts[index % 4];
          rope.heads = 1 + index % 3;
          rope.head_dim = 64;
          rope.rotary_dim = rotary;
          rope.key_offset = true;
          rope.neox = neox;
          RopeSpec spec;
          apply_norm(norm, index, rope, spec);
          apply_angles(angles, spec);
          std::ostringstream tag;
          tag << "keyoffset_H" << rope.heads << (neox ? "_neox" : "_inter") << "_r" << rotary
              << "_" << norm_name(norm) << "_" << angles_name(angles);
          add(rope, spec, tag.str());
          ++index;
        }
      }
    }
  }
  // Paired heads (Hq = Hkv even, factor tables [T, 2D]) with the new options.
  for (bool neox : {false, true}) {
    for (int rotary = 0; rotary < 3; ++rotary) {
      for (Norm norm : {Norm::kRms, Norm::kWeights, Norm::kGemma, Norm::kNone, Norm::kKeyWeight}) {
        ref::Rope rope;
        rope.tokens = token_counts[index % 4];
        rope.heads = index % 2 ? 2 : 6;
        rope.head_dim = widths[index % 5];
        rope.rotary_dim = rotary == 0 ? -1 : rotary == 1 ? rope.head_dim / 4 * 2 : 0;
        rope.paired = true;
        rope.neox = neox;
        RopeSpec spec;
        apply_norm(norm, index, rope, spec);
        apply_angles(index % 2 ? Angles::kTablesF32 : Angles::kTablesBf16, spec);
        std::ostringstream tag;
        tag << "paired_H" << rope.heads << (neox ? "_neox" : "_inter")
            << (rotary == 0 ? "_rfull" : rotary == 1 ? "_rhalf" : "_rzero") << "_"
            << norm_name(norm);
        add(rope, spec, tag.str());
        ++index;
      }
    }
  }
  return params;
}

class CpuRopeLayouts : public ::testing::TestWithParam<LayoutParam> {};

TEST_P(CpuRopeLayouts, ForwardBackwardAndFp8MatchTheModel) {
  const LayoutParam& param = GetParam();
  SCOPED_TRACE(describe(param.rope) + "; " + param.spec.describe());
  auto rng = rng_for_test();
  RopeData data(param.rope, param.spec, rng);
  check_forward(data);
  check_backward(data, rng, param.rope.tokens % 2 ? 3 : 0);
  if (param.spec.qk_dtype == DType::kBFloat16) {
    const int64_t v_dim = param.rope.tokens % 2 ? param.rope.head_dim : 40;
    check_fp8(data, rng, v_dim, param.rope.tokens == 7 ? 0.37f / 64 : 1.0f / 64,
              param.rope.tokens == 3 ? 2 : 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Options, CpuRopeLayouts, ::testing::ValuesIn(layout_params()),
                         [](const ::testing::TestParamInfo<LayoutParam>& info) {
                           return info.param.name;
                         });

// ---- real model shapes ----------------------------------------------------------------------------

/// A model family's attention layout (Hugging Face configs), with a cos/sin cache at packed
/// positions: T tokens of documents restarting at 0.
struct Model {
  const char* name;
  int64_t q_heads, kv_heads, head_dim, rotary_dim;
  bool neox, normalize, weights;
  double weight_offset, eps;
};

const Model kModels[] = {
    // Qwen3-8B: 32 query / 8 KV heads of 128, q_norm and k_norm (RMS * w), eps 1e-6, NeoX.
    {"Qwen3-8B", 32, 8, 128, -1, true, true, true, 0.0, double(1e-6f)},
    // Qwen3-0.6B: 16 / 8 heads of 128.
    {"Qwen3-0.6B", 16, 8, 128, -1, true, true, true, 0.0, double(1e-6f)},
    // Gemma 3 (as the brief's 16 / 8 heads of 256): RMS * (1 + w), eps 1e-6.
    {"Gemma3", 16, 8, 256, -1, true, true, true, 1.0, double(1e-6f)},
    // GLM-4 style: partial rotary over half the head (r = D/2), NeoX, 32 / 2 heads.
    {"GLM-partial", 32, 2, 128, 64, true, true, true, 0.0, double(1e-5f)},
    // Llama style: no QK norm at all, 32 / 8 heads of 128.
    {"Llama-nonorm", 32, 8, 128, -1, true, false, false, 0.0, 1.0 / 8388608.0},
};

TEST(CpuRopeModels, RealShapesMatchTheModel) {
  auto rng = rng_for_test();
  for (const Model& model : kModels) {
    for (DType positions : {DType::kInt32, DType::kInt64}) {
      ref::Rope rope;
      rope.tokens = positions == DType::kInt32 ? 61 : 64;
      rope.heads = model.q_heads;
      rope.kv_heads = model.kv_heads;
      rope.head_dim = model.head_dim;
      rope.rotary_dim = model.rotary_dim;
      rope.neox = model.neox;
      rope.normalize = model.normalize;
      rope.weight_offset = model.weight_offset;
      rope.eps = model.eps;
      RopeSpec spec;
      spec.cache = true;
      spec.position_dtype = positions;
      spec.packed = true;
      spec.cache_rows = 40;  // documents of up to 40 tokens
      spec.q_weight = spec.k_weight = model.weights;
      spec.weight_mean = model.weight_offset != 0 ? 0.0 : 1.0;
      // The Q/K columns of the [T, qkv_dim] GEMM output: rows padded by the V heads.
      spec.qk_row_pad = model.kv_heads * model.head_dim;
      SCOPED_TRACE(std::string(model.name) + ": " + describe(rope) + "; " + spec.describe());
      RopeData data(rope, spec, rng);
      check_forward(data);
      check_backward(data, rng);
      check_fp8(data, rng, model.head_dim, 1.0f / 448);
    }
  }
}

// ---- positions ------------------------------------------------------------------------------------

TEST(CpuRopePositions, PackedDocumentsRestartAtZero) {
  auto rng = rng_for_test();
  for (DType dtype : {DType::kInt32, DType::kInt64}) {
    for (bool neox : {false, true}) {
      ref::Rope rope;
      rope.tokens = 37;
      rope.heads = 4;
      rope.kv_heads = 2;
      rope.head_dim = 64;
      rope.neox = neox;
      RopeSpec spec;
      spec.cache = true;
      spec.position_dtype = dtype;
      spec.packed = true;
      spec.cache_rows = 9;
      SCOPED_TRACE(describe(rope) + "; " + spec.describe());
      RopeData data(rope, spec, rng);
      const std::vector<int64_t>& positions = data.tensors.positions;
      EXPECT_GT(std::count(positions.begin(), positions.end(), 0), 3) << "documents restart";
      check_forward(data);
      check_backward(data, rng);

      // Two tokens at the same position rotate alike: equal inputs give equal outputs.
      const int64_t D = rope.head_dim, rows = rope.input_heads();
      for (int64_t t = 1; t < rope.tokens; ++t) {
        for (int64_t i = 0; i < rows * D; ++i) data.qk[size_t(t * rows * D + i)] = data.qk[size_t(i)];
      }
      data.tensors.positions.assign(size_t(rope.tokens), 0);
      for (int64_t t = 0; t < rope.tokens; ++t) data.tensors.positions[size_t(t)] = t % 3;
      data.refresh();
      ForwardOut out = run_forward(data);
      const std::vector<uint16_t> q = out.q.get_bf16_bits();
      const size_t token = size_t(rope.heads * D);
      for (int64_t t = 3; t < rope.tokens; ++t) {
        EXPECT_TRUE(std::equal(q.begin() + long(size_t(t) * token),
                               q.begin() + long(size_t(t + 1) * token),
                               q.begin() + long(size_t(t % 3) * token)))
            << "token " << t << " at position " << t % 3;
      }
    }
  }
}

/// Positions outside [0, P) at a few tokens: those tokens' rotary lanes are NaN, nothing else is,
/// and nothing is read out of bounds (values far past the cache, both signs, both dtypes).
TEST(CpuRopePositions, OutOfRangePositionsGiveNaNOnlyInThatTokensRotaryLanes) {
  auto rng = rng_for_test();
  for (DType dtype : {DType::kInt32, DType::kInt64}) {
    for (bool key_offset : {false, true}) {
      for (bool normalize : {true, false}) {
        ref::Rope rope;
        rope.tokens = 9;
        rope.heads = key_offset ? 2 : 4;
        rope.kv_heads = key_offset ? 0 : 2;
        rope.head_dim = 48;
        rope.rotary_dim = 32;
        rope.neox = !key_offset;
        rope.key_offset = key_offset;
        rope.normalize = normalize;
        RopeSpec spec;
        spec.cache = true;
        spec.position_dtype = dtype;
        spec.cache_rows = 12;
        spec.q_weight = spec.k_weight = normalize;
        SCOPED_TRACE(describe(rope) + "; " + spec.describe());
        RopeData data(rope, spec, rng);
        const int64_t huge = dtype == DType::kInt32 ? int64_t(std::numeric_limits<int32_t>::max())
                                                    : int64_t(1) << 40;
        const int64_t tiny = dtype == DType::kInt32 ? int64_t(std::numeric_limits<int32_t>::min())
                                                    : -(int64_t(1) << 40);
        const std::vector<std::pair<int64_t, int64_t>> bad = {{1, -1}, {4, 12}, {5, huge}, {8, tiny}};
        for (const auto& [t, position] : bad) data.tensors.positions[size_t(t)] = position;
        data.refresh();
        check_forward(data);  // against the model, which has NaN exactly there

        ForwardOut out = run_forward(data);
        const int64_t D = rope.head_dim, r = rope.rotary();
        for (int kind = 0; kind < 2; ++kind) {
          const std::vector<double> y = (kind ? out.k : out.q).get();
          const int64_t heads = kind ? rope.k_heads() : rope.heads;
          for (int64_t t = 0; t < rope.tokens; ++t) {
            const bool token_bad = std::any_of(bad.begin(), bad.end(),
                                               [t](const auto& b) { return b.first == t; });
            for (int64_t h = 0; h < heads; ++h) {
              for (int64_t d = 0; d < D; ++d) {
                const bool nan = std::isnan(y[size_t((t * heads + h) * D + d)]);
                EXPECT_EQ(nan, token_bad && d < r)
                    << (kind ? "k" : "q") << " token " << t << " head " << h << " lane " << d;
              }
            }
          }
        }
        // The backward follows the model: a NaN rotary gradient reaches the row's sum (with the
        // norm) and the weights' gradients at the rotary lanes (SPEC.md does not say more).
        check_backward(data, rng);
      }
    }
  }
}

TEST(CpuRopePositions, CheckPositionsNamesTheFirstBadToken) {
  for (DType dtype : {DType::kInt32, DType::kInt64}) {
    HostTensor positions(dtype, {6});
    positions.set_ints({0, 3, 4, 0, 2, 1});
    EXPECT_NO_THROW(check_positions(positions.view(), 5));
    positions.set_ints({0, 3, 5, -1, 7, 1});
    EXPECT_TRUE(throws_error([&] { check_positions(positions.view(), 5); },
                             {"check_positions: positions[2] = 5 lies outside [0, 5)"}));
    positions.set_ints({0, 3, 2, -1, 7, 1});
    EXPECT_TRUE(throws_error([&] { check_positions(positions.view(), 5); },
                             {"positions[3] = -1 lies outside [0, 5)"}));
    EXPECT_TRUE(throws_error([&] { check_positions(positions.view(), 0); },
                             {"positions[0] = 0 lies outside [0, 0)"}));
    // Strided positions (every other element of a buffer) are read as a view.
    HostTensor strided(dtype, {3}, {2});
    strided.set_ints({1, 2, 9});
    EXPECT_TRUE(throws_error([&] { check_positions(strided.view(), 5); }, {"positions[2] = 9"}));
    // An empty call has nothing to check.
    EXPECT_NO_THROW(check_positions(make_view(positions.view().data, dtype, kCPU, {0}), 0));
  }
  HostTensor floats(DType::kFloat32, {3});
  floats.set({0, 1, 2});
  EXPECT_TRUE(throws_error([&] { check_positions(floats.view(), 5); },
                           {"check_positions: positions: expected dtype int32 or int64"}));
  HostTensor matrix(DType::kInt64, {2, 2});
  matrix.set_ints({0, 1, 2, 3});
  EXPECT_TRUE(throws_error([&] { check_positions(matrix.view(), 5); },
                           {"check_positions: positions: expected 1 dims"}));
  HostTensor one(DType::kInt64, {1});
  one.set_ints({0});
  EXPECT_TRUE(throws_error([&] { check_positions(one.view(), -1); },
                           {"check_positions: num_positions: expected >= 0, got -1"}));
}

TEST(CpuRopePositions, EnvironmentVariableChecksPositionsFirst) {
  // QKVFUSE_CHECK_POSITIONS=1 makes every call with a cache run check_positions first (read once
  // per process: CMake runs this test again with the variable set, as check_positions_env).
  const char* value = std::getenv("QKVFUSE_CHECK_POSITIONS");
  if (value == nullptr || std::string(value) != "1") {
    GTEST_SKIP() << "runs under QKVFUSE_CHECK_POSITIONS=1 (the check_positions_env test)";
  }
  auto rng = rng_for_test();
  ref::Rope rope;
  rope.tokens = 5;
  rope.heads = 2;
  rope.kv_heads = 1;
  rope.head_dim = 16;
  RopeSpec spec;
  spec.cache = true;
  spec.cache_rows = 4;
  spec.q_weight = true;
  RopeData data(rope, spec, rng);
  data.tensors.positions = {0, 3, 4, 1, -2};
  data.refresh();
  ForwardOut out{HostTensor(DType::kBFloat16, {5, 2, 16}), HostTensor(DType::kBFloat16, {5, 1, 16})};
  EXPECT_TRUE(throws_error(
      [&] { qk_norm_rope({data.qk_tensor->view(), out.q.view(), out.k.view(), data.layout()}); },
      {"check_positions: positions[2] = 4 lies outside [0, 4)"}));
  EXPECT_EQ(out.q.elements_touched(), 0) << "the forward ran despite the bad position";
  Grads grads(rng, data);
  BackwardOut back{HostTensor(DType::kBFloat16, {5, 3, 16}), WeightGradOut(data)};
  EXPECT_TRUE(throws_error(
      [&] {
        qk_norm_rope_backward({.grad_q = grads.q_tensor.view(),
                               .grad_k = grads.k_tensor.view(),
                               .qk = data.qk_tensor->view(),
                               .grad_qk = back.grad_qk.view(),
                               .grad_q_weight = back.weights.q_view(),
                               .layout = data.layout()});
      },
      {"positions[2] = 4"}));
  EXPECT_EQ(back.grad_qk.elements_touched(), 0);
  // Valid positions run.
  data.tensors.positions = {0, 3, 2, 1, 0};
  data.refresh();
  EXPECT_NO_THROW(qk_norm_rope({data.qk_tensor->view(), out.q.view(), out.k.view(), data.layout()}));
}

// ---- rotary width -----------------------------------------------------------------------------------

TEST(CpuRopeRotary, TableLanesPastTheRotaryWidthAreNeverRead) {
  // NaN in every table entry at lanes >= r (each D chunk of paired tables): no output and no
  // gradient may see it.
  auto rng = rng_for_test();
  for (bool neox : {false, true}) {
    for (int mode = 0; mode < 3; ++mode) {
      ref::Rope rope;
      rope.tokens = 5;
      rope.heads = 2;
      rope.head_dim = 40;
      rope.rotary_dim = 24;
      rope.neox = neox;
      rope.paired = mode == 1;
      rope.key_offset = mode == 2;
      RopeSpec spec;
      spec.q_weight = spec.k_weight = true;
      SCOPED_TRACE(describe(rope));
      RopeData data(rope, spec, rng);
      for (size_t i = 0; i < data.tensors.factor1.size(); ++i) {
        if (int64_t(i) % rope.head_dim >= rope.rotary()) {
          data.tensors.factor1[i] = kNaN;
          data.tensors.factor2[i] = kNaN;
        }
      }
      data.refresh();
      check_forward(data);  // the model reads lanes < r only
      ForwardOut out = run_forward(data);
      for (const HostTensor* y : {&out.q, &out.k}) {
        for (double v : y->get()) ASSERT_FALSE(std::isnan(v)) << "a lane >= r read its table";
      }
      Grads grads(rng, data);
      BackwardOut back = run_backward(data, grads);
      for (double v : back.grad_qk.get()) ASSERT_FALSE(std::isnan(v));
      for (double v : back.weights.q->get()) ASSERT_FALSE(std::isnan(v));
      for (double v : back.weights.k->get()) ASSERT_FALSE(std::isnan(v));
    }
  }
}

TEST(CpuRopeRotary, DefaultRotaryDimWithACacheIsTheCacheWidth) {
  // rotary_dim = -1 with cos_sin [P, 32] and D = 64: r = 32, lanes 32..63 pass through.
  auto rng = rng_for_test();
  for (bool neox : {false, true}) {
    ref::Rope rope;
    rope.tokens = 7;
    rope.heads = 4;
    rope.kv_heads = 1;
    rope.head_dim = 64;
    rope.rotary_dim = 32;  // what the model (and the cache's width) says
    rope.neox = neox;
    RopeSpec spec;
    spec.cache = true;
    RopeData data(rope, spec, rng);
    ASSERT_EQ(data.cos_sin->view().sizes[1], 32);
    RopeLayout layout = data.layout();
    layout.rotary_dim = -1;
    HostTensor q(DType::kBFloat16, {7, 4, 64}), k(DType::kBFloat16, {7, 1, 64});
    qk_norm_rope({data.qk_tensor->view(), q.view(), k.view(), layout});
    const ref::QkPair want = ref::rope_forward(rope, data.qk, data.tensors);
    EXPECT_TRUE(passes(compare_bf16("q", q.get_bf16_bits(), want.q, row_noise(want.q, 64, kFp32Noise))));
    EXPECT_TRUE(passes(compare_bf16("k", k.get_bf16_bits(), want.k, row_noise(want.k, 64, kFp32Noise))));
  }
}

TEST(CpuRopeRotary, ZeroRotaryWidthIsTheNormAlone) {
  // r = 0: y = nw exactly as the model's norm (no angle is read; the tables may hold anything).
  auto rng = rng_for_test();
  for (bool cache : {false, true}) {
    ref::Rope rope;
    rope.tokens = 3;
    rope.heads = 3;
    rope.kv_heads = 1;
    rope.head_dim = 32;
    rope.rotary_dim = 0;
    RopeSpec spec;
    spec.cache = cache;
    spec.q_weight = true;
    RopeData data(rope, spec, rng);
    if (!cache) {
      data.tensors.factor1.assign(data.tensors.factor1.size(), kNaN);
      data.tensors.factor2.assign(data.tensors.factor2.size(), kNaN);
      data.refresh();
    }
    check_forward(data);
    check_backward(data, rng);
  }
}

// ---- weight gradients -------------------------------------------------------------------------------

TEST(CpuRopeWeights, GradientsDoNotDependOnStridesOrRuns) {
  // The fixed summation order does not depend on how the inputs are laid out: padded gradients
  // and a qk column slice give the same bits as dense ones, run after run.
  auto rng = rng_for_test();
  ref::Rope rope;
  rope.tokens = 150;  // three summation blocks of the CPU backend, the last one partial
  rope.heads = 8;
  rope.kv_heads = 2;
  rope.head_dim = 64;
  rope.neox = true;
  rope.weight_offset = 1.0;
  RopeSpec spec;
  spec.cache = true;
  spec.q_weight = spec.k_weight = true;
  spec.weight_dtype = DType::kFloat32;
  spec.weight_mean = 0.0;
  RopeData dense(rope, spec, rng);
  spec.qk_row_pad = 40;
  RopeData sliced = dense;
  sliced.spec = spec;
  sliced.qk_tensor.emplace(DType::kBFloat16, std::vector<int64_t>{rope.tokens, 10, 64},
                           std::vector<int64_t>{10 * 64 + 40, 64, 1});
  sliced.refresh();
  Grads grads(rng, dense);
  Grads padded_grads = grads;
  padded_grads.q_tensor = padded(DType::kBFloat16, rope.tokens, 8, 64, 5);
  padded_grads.k_tensor = padded(DType::kBFloat16, rope.tokens, 2, 64, 5);
  padded_grads.q_tensor.set(grads.q);
  padded_grads.k_tensor.set(grads.k);
  BackwardOut first = run_backward(dense, grads);
  BackwardOut second = run_backward(sliced, padded_grads);
  BackwardOut third = run_backward(dense, grads);
  for (const BackwardOut* other : {&second, &third}) {
    EXPECT_TRUE(same_bits(first.grad_qk, other->grad_qk));
    EXPECT_TRUE(same_bits(*first.weights.q, *other->weights.q));
    EXPECT_TRUE(same_bits(*first.weights.k, *other->weights.k));
  }
  const ref::RopeGradients want = ref::rope_gradients(rope, grads.q, grads.k, dense.qk,
                                                      dense.tensors);
  expect_weight_grads(dense, first.weights, want);
}

TEST(CpuRopeWeights, EmptyCallsWriteZeroWeightGradients) {
  // T = 0: the weight gradients are written as zeros (SPEC: "At T = 0 the weight gradients are
  // written as zeros"), by the bf16 backward and by the FP8 backward.
  for (DType weight_dtype : {DType::kBFloat16, DType::kFloat32}) {
    const int64_t D = 32;
    HostTensor guard(DType::kBFloat16, {64});
    HostTensor guard_f8(DType::kFloat8E4M3, {64});
    HostTensor q_weight(weight_dtype, {D}), k_weight(weight_dtype, {D});
    q_weight.set(std::vector<double>(D, 1.0));
    k_weight.set(std::vector<double>(D, 1.0));
    HostTensor cos_sin(DType::kBFloat16, {4, D});
    cos_sin.set(std::vector<double>(4 * D, 0.5));
    const TensorView empty_positions = make_view(guard.view().data, DType::kInt32, kCPU, {0});
    RopeLayout layout;
    layout.num_heads = 4;
    layout.num_kv_heads = 2;
    layout.rotary_style = RotaryStyle::kNeox;
    layout.cos_sin = cos_sin.view();
    layout.positions = empty_positions;
    layout.q_weight = q_weight.view();
    layout.k_weight = k_weight.view();
    const auto empty = [&](int64_t heads) {
      return make_view(guard.view().data, DType::kBFloat16, kCPU, {0, heads, D});
    };
    {
      HostTensor gq(weight_dtype, {D}), gk(weight_dtype, {D});
      qk_norm_rope_backward({.grad_q = empty(4),
                             .grad_k = empty(2),
                             .qk = empty(6),
                             .grad_qk = empty(6),
                             .grad_q_weight = gq.view(),
                             .grad_k_weight = gk.view(),
                             .layout = layout});
      EXPECT_EQ(gq.get(), std::vector<double>(D, 0.0));
      EXPECT_EQ(gk.get(), std::vector<double>(D, 0.0));
    }
    {
      HostTensor gq(weight_dtype, {D}), gk(weight_dtype, {D});
      HostTensor scale(DType::kFloat32, {});
      scale.set({1.0});
      const int64_t features = 6 * D + 2 * 16;
      qkv_backward_fp8(
          {.grad_q = empty(4),
           .grad_k = empty(2),
           .grad_v = make_view(guard.view().data, DType::kBFloat16, kCPU, {0, 2, 16}),
           .qk = empty(6),
           .grad_scale = scale.view(),
           .grad_row = make_view(guard_f8.view().data, DType::kFloat8E4M3, kCPU, {0, features}),
           .grad_t = make_view(guard_f8.view().data, DType::kFloat8E4M3, kCPU, {features, 0}),
           .grad_q_weight = gq.view(),
           .grad_k_weight = gk.view(),
           .layout = layout});
      EXPECT_EQ(gq.get(), std::vector<double>(D, 0.0));
      EXPECT_EQ(gk.get(), std::vector<double>(D, 0.0));
    }
    {
      // The forward at T = 0 writes nothing.
      qk_norm_rope({empty(6), empty(4), empty(2), layout});
    }
    EXPECT_EQ(guard.elements_touched(), 0);
    EXPECT_EQ(guard_f8.elements_touched(), 0);
  }
}

// ---- finite differences of the float64 model ----------------------------------------------------------

/// L = sum(grad_q * q) + sum(grad_k * k) under the model.
double loss(const ref::Rope& rope, const std::vector<double>& qk, const ref::RopeTensors& tensors,
            const std::vector<double>& grad_q, const std::vector<double>& grad_k) {
  const ref::QkPair out = ref::rope_forward(rope, qk, tensors);
  double sum = 0;
  for (size_t i = 0; i < out.q.size(); ++i) sum += grad_q[i] * out.q[i];
  for (size_t i = 0; i < out.k.size(); ++i) sum += grad_k[i] * out.k[i];
  return sum;
}

/// Central differences (step 1e-6) of `loss` with respect to each element of `values`.
std::vector<double> central_differences(std::vector<double>& values,
                                        const std::function<double()>& f) {
  const double step = 1e-6;
  std::vector<double> grad(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    const double saved = values[i];
    values[i] = saved + step;
    const double above = f();
    values[i] = saved - step;
    const double below = f();
    values[i] = saved;
    grad[i] = (above - below) / (2 * step);
  }
  return grad;
}

TEST(CpuRopeFiniteDifferences, BackwardAndWeightGradientsAgreeWithTheModel) {
  auto rng = rng_for_test();
  struct Variant {
    int64_t q_heads, kv_heads, rotary;
    bool neox, normalize, cache, key_offset, paired;
    double offset, eps;
  };
  const Variant variants[] = {
      {4, 2, 8, true, true, true, false, false, 0.0, 0.25},             // GQA NeoX partial cache
      {3, 1, -1, false, true, false, false, false, 1.0, double(1e-6f)},  // MQA Gemma-style
      {2, 2, 6, true, true, false, true, false, 0.0, 1.0 / 8388608.0},   // key offset NeoX
      {2, 2, -1, false, true, false, false, true, 1.0, 0.25},            // paired, 1 + w
      {4, 1, 16, true, false, true, false, false, 0.0, 1.0},             // no norm, cache
      {2, 1, 0, false, true, true, false, false, 0.0, double(1e-6f)},    // r = 0
  };
  for (const Variant& v : variants) {
    ref::Rope rope;
    rope.tokens = 3;
    rope.heads = v.q_heads;
    rope.kv_heads = v.kv_heads;
    rope.head_dim = 16;
    rope.rotary_dim = v.rotary;
    rope.neox = v.neox;
    rope.normalize = v.normalize;
    rope.key_offset = v.key_offset;
    rope.paired = v.paired;
    rope.weight_offset = v.offset;
    rope.eps = v.eps;
    RopeSpec spec;
    spec.cache = v.cache;
    spec.q_weight = spec.k_weight = v.normalize;
    spec.weight_mean = v.offset != 0 ? 0.0 : 1.0;
    SCOPED_TRACE(describe(rope) + "; " + spec.describe());
    RopeData data(rope, spec, rng);  // bf16 values throughout
    const std::vector<double> grad_q = random_values(rng, rope.q_count(), DType::kBFloat16);
    const std::vector<double> grad_k = random_values(rng, rope.k_count(), DType::kBFloat16);
    ref::RopeTensors tensors = data.tensors;
    std::vector<double> qk = data.qk;
    const auto f = [&] { return loss(rope, qk, tensors, grad_q, grad_k); };
    const std::vector<double> numeric_qk = central_differences(qk, f);
    const std::vector<double> numeric_wq =
        v.normalize ? central_differences(tensors.q_weight, f) : std::vector<double>{};
    const std::vector<double> numeric_wk =
        v.normalize ? central_differences(tensors.k_weight, f) : std::vector<double>{};

    // The model's own gradients (scattered chain rule) against the differences.
    const ref::RopeGradients model = ref::rope_gradients(rope, grad_q, grad_k, data.qk, data.tensors);
    EXPECT_TRUE(passes(compare_close("model grad_qk vs differences", model.grad_qk, numeric_qk,
                                     row_noise(numeric_qk, 16, 1e-7))));
    if (v.normalize) {
      EXPECT_TRUE(passes(compare_close("model grad_q_weight vs differences", model.grad_q_weight,
                                       numeric_wq, row_noise(numeric_wq, 16, 1e-7))));
      EXPECT_TRUE(passes(compare_close("model grad_k_weight vs differences", model.grad_k_weight,
                                       numeric_wk, row_noise(numeric_wk, 16, 1e-7))));
    }

    // The CPU backend in float64 (qk, angles and weights float64) and in bf16.
    for (DType dtype : {DType::kFloat64, DType::kBFloat16}) {
      SCOPED_TRACE(dtype_name(dtype));
      RopeSpec wide = spec;
      wide.qk_dtype = dtype;
      wide.angle_dtype = dtype;
      wide.weight_dtype = dtype;
      RopeData run = data;
      run.spec = wide;
      run.qk_tensor.emplace(dtype, std::vector<int64_t>{3, rope.input_heads(), 16});
      if (run.factor1) run.factor1.emplace(dtype, std::vector<int64_t>{3, rope.factor_width()});
      if (run.factor2) run.factor2.emplace(dtype, std::vector<int64_t>{3, rope.factor_width()});
      if (run.cos_sin) run.cos_sin.emplace(dtype, run.cos_sin->view().ndim == 2
                                                      ? std::vector<int64_t>{run.cos_sin->view().sizes[0], run.cos_sin->view().sizes[1]}
                                                      : std::vector<int64_t>{});
      if (run.q_weight) run.q_weight.emplace(dtype, std::vector<int64_t>{16});
      if (run.k_weight) run.k_weight.emplace(dtype, std::vector<int64_t>{16});
      run.refresh();
      Grads grads(rng, run);
      grads.q = grad_q;
      grads.k = grad_k;
      grads.q_tensor.set(grad_q);
      grads.k_tensor.set(grad_k);
      BackwardOut out = run_backward(run, grads);
      const double relative = dtype == DType::kFloat64 ? 1e-7 : kFp32Noise;
      std::vector<double> noise = row_noise(numeric_qk, 16, relative);
      if (dtype == DType::kBFloat16) widen_by_terms(noise, model.term_scale, 16, relative);
      EXPECT_TRUE(matches("grad_qk vs differences", out.grad_qk, dtype, numeric_qk, noise));
      if (v.normalize) {
        const auto tolerance = [&](const std::vector<double>& numeric,
                                   const std::vector<double>& magnitude, int64_t terms) {
          std::vector<double> t = row_noise(numeric, 16, 1e-7);
          if (dtype == DType::kBFloat16) {
            const std::vector<double> sum = fp32_sum_tolerance(magnitude, terms);
            for (size_t i = 0; i < t.size(); ++i) t[i] += sum[i];
          }
          return t;
        };
        EXPECT_TRUE(matches("grad_q_weight vs differences", *out.weights.q, dtype, numeric_wq,
                            tolerance(numeric_wq, model.q_weight_magnitude, model.q_weight_terms)));
        EXPECT_TRUE(matches("grad_k_weight vs differences", *out.weights.k, dtype, numeric_wk,
                            tolerance(numeric_wk, model.k_weight_magnitude, model.k_weight_terms)));
      }
    }
  }
}

// ---- one rounding: the contract against Hugging Face's steps ----------------------------------------

TEST(CpuRopeModels, OneRoundingIsCloserThanHuggingFacesSteps) {
  // SPEC.md section 8: Hugging Face's Qwen3 rounds the normalized row to bf16, then its product
  // with the weight, then each rotary product and their sum; this contract rounds once. The
  // backend must sit within one ulp of the exact value (the sweep checks that), and so closer to
  // it than the stepwise rounding on average.
  auto rng = rng_for_test();
  ref::Rope rope;
  rope.tokens = 32;
  rope.heads = 16;
  rope.kv_heads = 8;
  rope.head_dim = 128;
  rope.neox = true;
  rope.eps = double(1e-6f);
  RopeSpec spec;
  spec.cache = true;
  spec.q_weight = spec.k_weight = true;
  RopeData data(rope, spec, rng);
  ForwardOut out = run_forward(data);
  const ref::QkPair exact = ref::rope_forward(rope, data.qk, data.tensors);
  // Stepwise, as Hugging Face: bf16(bf16(n) * w), then bf16(bf16(y*cos) + bf16(rot(y)*sin)).
  ref::Rope norm_only = rope;
  norm_only.rotary_dim = 0;
  ref::RopeTensors no_weights = data.tensors;
  no_weights.q_weight.clear();
  no_weights.k_weight.clear();
  const ref::QkPair n = ref::rope_forward(norm_only, data.qk, no_weights);
  const int64_t D = 128, half = 64;
  double ours = 0, stepwise = 0;
  for (int kind = 0; kind < 2; ++kind) {
    const std::vector<double>& normalized = kind ? n.k : n.q;
    const std::vector<double>& w = kind ? data.tensors.k_weight : data.tensors.q_weight;
    const std::vector<double>& want = kind ? exact.k : exact.q;
    const std::vector<double> got = (kind ? out.k : out.q).get();
    const int64_t heads = kind ? rope.k_heads() : rope.heads;
    for (int64_t t = 0; t < rope.tokens; ++t) {
      const int64_t p = data.tensors.positions[size_t(t)];
      for (int64_t h = 0; h < heads; ++h) {
        const size_t base = size_t((t * heads + h) * D);
        std::vector<double> y(static_cast<size_t>(D));
        for (int64_t d = 0; d < D; ++d) {
          y[size_t(d)] = ref::round_bf16(ref::round_bf16(normalized[base + size_t(d)]) * w[size_t(d)]);
        }
        for (int64_t d = 0; d < D; ++d) {
          const int64_t i = d % half;
          const double c = data.tensors.cos_sin[size_t(p * D + i)];
          const double s = data.tensors.cos_sin[size_t(p * D + half + i)];
          const double rotated = d < half ? -y[size_t(d + half)] : y[size_t(d - half)];
          const double hf = ref::round_bf16(ref::round_bf16(y[size_t(d)] * c) +
                                            ref::round_bf16(rotated * s));
          ours += std::fabs(got[base + size_t(d)] - want[base + size_t(d)]);
          stepwise += std::fabs(hf - want[base + size_t(d)]);
        }
      }
    }
  }
  std::printf("[rounding] sum |ours - exact| = %g, sum |stepwise - exact| = %g\n", ours, stepwise);
  EXPECT_LT(ours, stepwise);
}

}  // namespace
}  // namespace qkvfuse::test
