// family_checks.cpp: the checks of SPEC.md section 9's options against the float64 model (see
// family_checks.hpp).
#include "family_checks.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "qkvfuse/qk_norm_rope.hpp"
#include "qkvfuse/qkv_backward_fp8.hpp"
#include "reference.hpp"
#include "test_util.hpp"

namespace qkvfuse::test::families {

constexpr double kFp32Noise = 1.0 / (1 << 18);
constexpr double kFp64Noise = 1e-12;

/// The relative noise of a row's float32 (or float64) result: 2^-18 (1e-12) of the row's largest
/// value, grown with the square root of the values one RMS sums beyond 256 (a token-wide norm sums
/// thousands): the rounding of that sum moves every value of the token alike.
double noise_of(const RopeData& data) {
  const ref::Rope& r = data.rope;
  const int64_t values = r.token_norm ? std::max(r.heads, r.k_heads()) * r.head_dim : r.head_dim;
  const double growth = std::max(1.0, std::sqrt(double(values) / 256.0));
  return (data.spec.qk_dtype == DType::kFloat64 ? kFp64Noise : kFp32Noise) * growth;
}

/// The V norm's noise: as noise_of, over Dv values.
double v_noise_of(const RopeData& data) {
  const double growth = std::max(1.0, std::sqrt(double(data.spec.v_dim) / 256.0));
  return (data.spec.qk_dtype == DType::kFloat64 ? kFp64Noise : kFp32Noise) * growth;
}

::testing::AssertionResult matches(const std::string& what, const HostTensor& got, DType dtype,
                                   const std::vector<double>& expected,
                                   const std::vector<double>& noise) {
  if (dtype == DType::kBFloat16) {
    return passes(compare_bf16(what, got.get_bf16_bits(), expected, noise));
  }
  return passes(compare_close(what, got.get(), expected, noise));
}

bool same_bits(const HostTensor& a, const HostTensor& b) {
  const std::vector<double> x = a.get(), y = b.get();
  return x.size() == y.size() &&
         (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(double)) == 0);
}

/// A [a, b, w] tensor whose heads and rows are padded by `padding` elements.
HostTensor padded(DType dtype, int64_t a, int64_t b, int64_t w, int64_t padding) {
  return HostTensor(dtype, {a, b, w}, {b * (w + padding) + padding, w + padding, 1});
}

int64_t v_rows(const RopeData& data) { return data.rope.tokens * data.rope.k_heads(); }

// ---- running the ops ---------------------------------------------------------------------------

struct ForwardOut {
  HostTensor q, k;
  std::optional<HostTensor> v_out;
};

ForwardOut run_forward(RopeData& data, const FamilyRunner& runner) {
  const ref::Rope& r = data.rope;
  ForwardOut out{HostTensor(data.spec.qk_dtype, {r.out_tokens(), r.q_out_heads(), r.head_dim}),
                 HostTensor(data.spec.qk_dtype, {r.out_tokens(), r.k_out_heads(), r.head_dim}),
                 std::nullopt};
  QkNormRopeParams p{data.qk_tensor->view(), out.q.view(), out.k.view(), data.layout()};
  if (r.normalize_v) {
    out.v_out.emplace(data.spec.qk_dtype,
                      std::vector<int64_t>{r.tokens, r.k_heads(), data.spec.v_dim});
    p.v = data.v_tensor->view();
    p.v_out = out.v_out->view();
  }
  runner.forward(p);
  return out;
}

/// Fresh random output gradients (of q, k and, with the V norm, v_out), padded by `padding`.
struct Grads {
  std::vector<double> q, k, v;
  HostTensor q_tensor, k_tensor;
  std::optional<HostTensor> v_tensor;
  Grads(std::mt19937_64& rng, const RopeData& data, int64_t padding = 0)
      : q(random_values(rng, data.rope.q_count(), data.spec.qk_dtype)),
        k(random_values(rng, data.rope.k_count(), data.spec.qk_dtype)),
        q_tensor(padded(data.spec.qk_dtype, data.rope.out_tokens(), data.rope.q_out_heads(),
                        data.rope.head_dim, padding)),
        k_tensor(padded(data.spec.qk_dtype, data.rope.out_tokens(), data.rope.k_out_heads(),
                        data.rope.head_dim, padding)) {
    q_tensor.set(q);
    k_tensor.set(k);
    if (!data.rope.normalize_v) return;
    v = random_values(rng, size_t(v_rows(data) * data.spec.v_dim), data.spec.qk_dtype);
    v_tensor.emplace(padded(data.spec.qk_dtype, data.rope.tokens, data.rope.k_heads(),
                            data.spec.v_dim, padding));
    v_tensor->set(v);
  }
};

/// The weight gradient outputs: present exactly when the weights are ([D] or [H*D]), poisoned.
struct WeightGradOut {
  std::optional<HostTensor> q, k;
  explicit WeightGradOut(const RopeData& data) {
    if (data.q_weight) {
      q.emplace(data.spec.weight_dtype, std::vector<int64_t>{data.rope.weight_width(false)});
    }
    if (data.k_weight) {
      k.emplace(data.spec.weight_dtype, std::vector<int64_t>{data.rope.weight_width(true)});
    }
  }
  TensorView q_view() { return q ? q->view() : TensorView{}; }
  TensorView k_view() { return k ? k->view() : TensorView{}; }
};

struct BackwardOut {
  HostTensor grad_qk;
  WeightGradOut weights;
  std::optional<HostTensor> grad_v;
};

BackwardOut run_backward(RopeData& data, Grads& grads, const FamilyRunner& runner) {
  const ref::Rope& r = data.rope;
  BackwardOut out{HostTensor(data.spec.qk_dtype, {r.tokens, r.input_heads(), r.head_dim}),
                  WeightGradOut(data), std::nullopt};
  QkNormRopeBackwardParams p;
  p.grad_q = grads.q_tensor.view();
  p.grad_k = grads.k_tensor.view();
  p.qk = data.qk_tensor->view();
  p.grad_qk = out.grad_qk.view();
  p.grad_q_weight = out.weights.q_view();
  p.grad_k_weight = out.weights.k_view();
  p.layout = data.layout();
  if (r.normalize_v) {
    out.grad_v.emplace(data.spec.qk_dtype,
                       std::vector<int64_t>{r.tokens, r.k_heads(), data.spec.v_dim});
    p.grad_v_out = grads.v_tensor->view();
    p.v = data.v_tensor->view();
    p.grad_v = out.grad_v->view();
  }
  runner.backward(p);
  return out;
}

void expect_weight_grads(const RopeData& data, WeightGradOut& got,
                         const ref::RopeGradients& want) {
  const bool wide = data.spec.qk_dtype == DType::kFloat64;
  for (int kind = 0; kind < 2; ++kind) {
    std::optional<HostTensor>& out = kind == 0 ? got.q : got.k;
    if (!out) continue;
    const std::vector<double>& magnitude =
        kind == 0 ? want.q_weight_magnitude : want.k_weight_magnitude;
    std::vector<double> tolerance =
        fp32_sum_tolerance(magnitude, kind == 0 ? want.q_weight_terms : want.k_weight_terms);
    // Every term carries n, whose rstd sums the RMS's squares: noise_of's share of each term.
    const double norm_noise = noise_of(data) / (wide ? kFp64Noise : kFp32Noise) * 0x1p-20;
    const std::vector<double>& value = kind == 0 ? want.grad_q_weight : want.grad_k_weight;
    for (size_t i = 0; i < tolerance.size(); ++i) {
      tolerance[i] = wide ? kFp64Noise * magnitude[i] : tolerance[i] + norm_noise * magnitude[i];
      // A float32 weight's gradient is rounded to float32 once, from float64 sums too.
      if (data.spec.weight_dtype == DType::kFloat32) tolerance[i] += std::ldexp(std::fabs(value[i]), -24);
    }
    EXPECT_TRUE(matches(kind == 0 ? "grad_q_weight" : "grad_k_weight", *out,
                        data.spec.weight_dtype, value, tolerance));
  }
}

// ---- the checks ----------------------------------------------------------------------------------

void check_forward(RopeData& data, const FamilyRunner& runner) {
  SCOPED_TRACE("forward");
  ForwardOut out = run_forward(data, runner);
  const ref::QkPair want = ref::rope_forward(data.rope, data.qk, data.tensors);
  const double noise = noise_of(data);
  const int64_t D = data.rope.head_dim;
  EXPECT_TRUE(matches("q", out.q, data.spec.qk_dtype, want.q, row_noise(want.q, D, noise)));
  EXPECT_TRUE(matches("k", out.k, data.spec.qk_dtype, want.k, row_noise(want.k, D, noise)));
  EXPECT_EQ(data.qk_tensor->padding_touched(), 0) << "qk's padding was written";
  if (!data.rope.normalize_v) return;
  const int64_t Dv = data.spec.v_dim;
  const std::vector<double> v_want =
      ref::v_norm_forward(v_rows(data), Dv, data.rope.eps, data.v);
  EXPECT_TRUE(matches("v_out", *out.v_out, data.spec.qk_dtype, v_want,
                      row_noise(v_want, Dv, v_noise_of(data))));
  EXPECT_EQ(data.v_tensor->padding_touched(), 0) << "v's padding was written";
}

void check_backward(RopeData& data, std::mt19937_64& rng, const FamilyRunner& runner) {
  SCOPED_TRACE("backward");
  Grads grads(rng, data, 3);
  BackwardOut out = run_backward(data, grads, runner);
  const ref::RopeGradients want =
      ref::rope_gradients(data.rope, grads.q, grads.k, data.qk, data.tensors);
  const double noise = noise_of(data);
  const int64_t D = data.rope.head_dim;
  std::vector<double> dx_noise = row_noise(want.grad_qk, D, noise);
  widen_by_terms(dx_noise, want.term_scale, D, noise);
  EXPECT_TRUE(matches("grad_qk", out.grad_qk, data.spec.qk_dtype, want.grad_qk, dx_noise));
  expect_weight_grads(data, out.weights, want);
  if (data.rope.normalize_v) {
    const int64_t Dv = data.spec.v_dim;
    const ref::VNormGradients v_want =
        ref::v_norm_gradients(v_rows(data), Dv, data.rope.eps, data.v, grads.v);
    std::vector<double> v_noise = row_noise(v_want.grad_v, Dv, v_noise_of(data));
    widen_by_terms(v_noise, v_want.term_scale, Dv, v_noise_of(data));
    EXPECT_TRUE(matches("grad_v", *out.grad_v, data.spec.qk_dtype, v_want.grad_v, v_noise));
  }

  BackwardOut again = run_backward(data, grads, runner);
  EXPECT_TRUE(same_bits(again.grad_qk, out.grad_qk)) << "grad_qk differs between runs";
  if (out.weights.q) EXPECT_TRUE(same_bits(*out.weights.q, *again.weights.q));
  if (out.weights.k) EXPECT_TRUE(same_bits(*out.weights.k, *again.weights.k));
  if (out.grad_v) EXPECT_TRUE(same_bits(*out.grad_v, *again.grad_v));
}

/// qkv_backward_fp8 (bf16 qk) against the model and against the backend's own bf16 backward.
void check_fp8(RopeData& data, std::mt19937_64& rng, int64_t v_dim, float grad_scale,
               const FamilyRunner& runner) {
  SCOPED_TRACE(::testing::Message() << "qkv_backward_fp8 Dv=" << v_dim);
  const ref::Rope& r = data.rope;
  if (r.normalize_v) v_dim = data.spec.v_dim;
  const int64_t T = r.tokens, features = ref::qkv_dim(r, v_dim);
  const int64_t qk_features = r.input_heads() * r.head_dim;
  Grads grads(rng, data, 5);
  // The gradient of the V the forward returned (v_out under the V norm).
  const std::vector<double> grad_v =
      r.normalize_v ? grads.v : random_values(rng, size_t(T * r.k_heads() * v_dim), DType::kBFloat16);
  HostTensor grad_v_tensor = padded(DType::kBFloat16, T, r.k_heads(), v_dim, 5);
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
  if (r.normalize_v) p.v = data.v_tensor->view();
  runner.fp8(p);

  const ref::RopeGradients want = ref::rope_gradients(r, grads.q, grads.k, data.qk, data.tensors);
  const std::vector<double> values =
      ref::qkv_backward_values(r, v_dim, grads.q, grads.k, grad_v, data.qk, data.tensors, data.v);
  std::vector<double> v_terms;
  if (r.normalize_v) {
    v_terms = ref::v_norm_gradients(v_rows(data), v_dim, r.eps, data.v, grad_v).term_scale;
  }
  const std::vector<double> noise =
      qkv_feature_noise(r, v_dim, values, std::max(noise_of(data), v_noise_of(data)),
                        want.term_scale, v_terms);
  const std::vector<uint8_t> row = grad_row.get_codes();
  EXPECT_TRUE(passes(compare_e4m3("grad_row", row, values, grad_scale, noise)));
  EXPECT_EQ(grad_t.get_codes(), transpose(row, T, features)) << "grad_t is not grad_row^T";
  expect_weight_grads(data, weights, want);

  // Every code: exactly e4m3 of the backend's own bf16 backward (dx, and dv with the V norm).
  BackwardOut bf16 = run_backward(data, grads, runner);
  const std::vector<double> dx = bf16.grad_qk.get();
  const std::vector<double> dv = r.normalize_v ? bf16.grad_v->get() : grad_v;
  int64_t bad = 0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t f = 0; f < features; ++f) {
      const double value = f < qk_features ? dx[size_t(t * qk_features + f)]
                                           : dv[size_t(t * (features - qk_features) + f - qk_features)];
      bad += row[size_t(t * features + f)] != ref::quantize_code(value, grad_scale);
    }
  }
  EXPECT_EQ(bad, 0) << "codes differ from e4m3(bf16 backward / grad_scale)";
  if (weights.q) EXPECT_TRUE(same_bits(*weights.q, *bf16.weights.q));
  if (weights.k) EXPECT_TRUE(same_bits(*weights.k, *bf16.weights.k));
}

void check_all(RopeData& data, std::mt19937_64& rng, const FamilyRunner& runner) {
  check_forward(data, runner);
  check_backward(data, rng, runner);
  if (data.spec.qk_dtype == DType::kBFloat16) check_fp8(data, rng, 3, 1.0f / 64, runner);
}

// ---- the sweep -------------------------------------------------------------------------------------

void PrintTo(const FamilyParam& param, std::ostream* out) { *out << param.name; }

enum class Weights { kNone, kBoth, kOffset, kQueryOnly };

void apply_weights(Weights weights, ref::Rope& rope, RopeSpec& spec) {
  spec.q_weight = weights != Weights::kNone && rope.normalize;
  spec.k_weight = (weights == Weights::kBoth || weights == Weights::kOffset) && rope.normalize &&
                  !rope.query_only;
  if (weights == Weights::kOffset) {
    rope.weight_offset = 1.0;
    spec.weight_mean = 0.0;
  }
}

std::vector<FamilyParam> family_params() {
  std::vector<FamilyParam> params;
  const int64_t tokens[] = {1, 3, 17};
  const int64_t widths[] = {2, 6, 34, 130, 258, 512};
  struct Heads {
    int64_t q, kv;
  };
  const Heads heads_list[] = {{2, 2}, {4, 2}, {3, 1}};
  int64_t index = 0;
  const auto add = [&](ref::Rope rope, RopeSpec spec, const std::string& tag) {
    rope.tokens = tokens[index % 3];
    if (rope.head_dim == 0) rope.head_dim = widths[(index / 3) % 6];
    // Large heads at one token count only: the sweep stays quick.
    if (rope.head_dim >= 258) rope.tokens = std::min<int64_t>(rope.tokens, 3);
    if (!rope.angles) rope.rotary_dim = index % 2 ? -1 : 0;
    if (index % 7 == 3) spec.qk_dtype = DType::kFloat32;
    if (index % 11 == 5) spec.qk_dtype = DType::kFloat64;
    spec.qk_row_pad = index % 3 == 1 ? 10 : 0;
    spec.v_row_pad = index % 2 ? 6 : 0;
    spec.weight_dtype = index % 4 == 1 ? DType::kFloat32 : DType::kBFloat16;
    const double eps[] = {1.0 / 8388608.0, double(1e-6f), 0.25};
    rope.eps = eps[index % 3];
    std::ostringstream name;
    name << tag << "_T" << rope.tokens << "_D" << rope.head_dim;
    params.push_back({name.str(), rope, spec});
    ++index;
  };
  const auto set_angles = [](int angles, ref::Rope& rope, RopeSpec& spec) {
    rope.angles = angles != 2;
    spec.cache = angles == 1;
    spec.packed = true;
    spec.angle_dtype = angles == 1 ? DType::kFloat32 : DType::kBFloat16;
  };
  const char* angle_names[] = {"tables", "cache", "noangles"};

  // The token-wide norm, with every weight kind, both styles, every angle source and head count.
  for (const Heads& heads : heads_list) {
    for (bool neox : {false, true}) {
      for (Weights weights : {Weights::kNone, Weights::kBoth, Weights::kOffset}) {
        for (int angles = 0; angles < 3; ++angles) {
          ref::Rope rope;
          rope.heads = heads.q;
          rope.kv_heads = heads.kv;
          rope.neox = neox;
          rope.token_norm = true;
          RopeSpec spec;
          set_angles(angles, rope, spec);
          if (angles != 2 && index % 3 == 2) rope.rotary_dim = 2;  // partial rotary
          apply_weights(weights, rope, spec);
          std::ostringstream tag;
          tag << "token_Hq" << heads.q << "Hkv" << heads.kv << (neox ? "_neox_" : "_inter_")
              << int(weights) << "_" << angle_names[angles];
          add(rope, spec, tag.str());
        }
      }
    }
  }
  // The V norm: V widths 1, 3, 64, with and without the QK norm, both scopes of Q/K... head only.
  for (int64_t v_dim : {1, 3, 64}) {
    for (bool normalize : {true, false}) {
      for (int angles = 0; angles < 3; ++angles) {
        ref::Rope rope;
        rope.heads = 4;
        rope.kv_heads = 2;
        rope.neox = true;
        rope.normalize = normalize;
        rope.normalize_v = true;
        RopeSpec spec;
        spec.v_dim = v_dim;
        set_angles(angles, rope, spec);
        apply_weights(normalize ? Weights::kBoth : Weights::kNone, rope, spec);
        std::ostringstream tag;
        tag << "vnorm_Dv" << v_dim << (normalize ? "_rms_" : "_nonorm_") << angle_names[angles];
        add(rope, spec, tag.str());
      }
    }
  }
  // Query-only calls: with and without the weight, both norm scopes, every angle source.
  for (bool token : {false, true}) {
    for (Weights weights : {Weights::kNone, Weights::kQueryOnly}) {
      for (int angles = 0; angles < 3; ++angles) {
        ref::Rope rope;
        rope.heads = 3;
        rope.query_only = true;
        rope.token_norm = token;
        rope.neox = angles == 1;
        RopeSpec spec;
        set_angles(angles, rope, spec);
        apply_weights(weights, rope, spec);
        std::ostringstream tag;
        tag << "queryonly" << (token ? "_token_" : "_head_") << int(weights) << "_"
            << angle_names[angles];
        add(rope, spec, tag.str());
      }
    }
  }
  // Section 8's key offset and paired heads with the token norm and without angles.
  for (int variant = 0; variant < 6; ++variant) {
    ref::Rope rope;
    rope.heads = 2;
    rope.head_dim = 34;
    rope.token_norm = variant % 2 == 0;
    RopeSpec spec;
    if (variant < 4) {
      rope.key_offset = true;
      rope.rotary_dim = variant < 2 ? 16 : -1;
      set_angles(variant < 2 ? 1 : 2, rope, spec);
      rope.neox = variant < 2;
    } else {
      rope.paired = true;
      set_angles(0, rope, spec);
    }
    apply_weights(variant % 3 == 0 ? Weights::kOffset : Weights::kBoth, rope, spec);
    std::ostringstream tag;
    tag << (rope.paired ? "paired" : "keyoffset") << (rope.token_norm ? "_token" : "_head")
        << (rope.angles ? "" : "_noangles") << "_v" << variant;
    add(rope, spec, tag.str());
  }
  // D above 256 alone: head norm, weights, cache (the widths sweep the rest).
  for (int64_t width : {258, 384, 512}) {
    ref::Rope rope;
    rope.heads = 2;
    rope.kv_heads = 1;
    rope.head_dim = width;
    rope.neox = true;
    RopeSpec spec;
    set_angles(1, rope, spec);
    rope.rotary_dim = width / 4;
    apply_weights(Weights::kBoth, rope, spec);
    add(rope, spec, "wide");
  }
  return params;
}

// ---- the families' real shapes -------------------------------------------------------------------

/// `tokens` when positive, else `cpu` (the real shapes' small token counts of the CPU tests).
int64_t pick(int64_t tokens, int64_t cpu) { return tokens > 0 ? tokens : cpu; }

/// A family's layer: its heads, width, rotary and norm, with a cos/sin cache at packed positions.
RopeData family_layer(std::mt19937_64& rng, int64_t tokens, int64_t q_heads, int64_t kv_heads,
                      int64_t head_dim, int64_t rotary_dim, bool q_weight, bool k_weight,
                      double weight_offset, const std::function<void(ref::Rope&, RopeSpec&)>& more) {
  ref::Rope rope;
  rope.tokens = tokens;
  rope.heads = q_heads;
  rope.kv_heads = kv_heads;
  rope.head_dim = head_dim;
  rope.rotary_dim = rotary_dim;
  rope.neox = true;
  rope.eps = double(1e-6f);
  rope.weight_offset = weight_offset;
  RopeSpec spec;
  spec.cache = true;
  spec.packed = true;
  spec.q_weight = q_weight;
  spec.k_weight = k_weight;
  spec.weight_mean = weight_offset != 0 ? 0.0 : 1.0;
  more(rope, spec);
  return RopeData(rope, spec, rng);
}

void gemma4_layers(std::mt19937_64& rng, const FamilyRunner& runner, int64_t tokens) {
  // Sliding layers: 32 / 16 heads of 256 (Gemma 4 31B), q/k norm weights, the V norm on Dv = D.
  RopeData sliding = family_layer(rng, pick(tokens, 5), 32, 16, 256, 256, true, true, 0.0,
                                  [](ref::Rope& r, RopeSpec&) { r.normalize_v = true; });
  check_all(sliding, rng, runner);
  // Global layers: 32 / 4 heads of 512, proportional rotary (full width, zero frequencies past
  // a quarter: the cache's zero-angle lanes), the V norm.
  RopeData global = family_layer(rng, pick(tokens, 3), 32, 4, 512, 512, true, true, 0.0,
                                 [](ref::Rope& r, RopeSpec&) { r.normalize_v = true; });
  check_all(global, rng, runner);
  // KV-shared layers: the query heads alone.
  RopeData shared = family_layer(rng, pick(tokens, 4), 8, 0, 512, 512, true, false, 0.0,
                                 [](ref::Rope& r, RopeSpec&) { r.query_only = true; });
  check_all(shared, rng, runner);
}

void gemma4_key_equals_value(std::mt19937_64& rng, const FamilyRunner& runner, int64_t tokens) {
  // attention_k_eq_v: v is the key rows of qk itself (before k_norm). The op's outputs equal
  // those of a separate copy of those rows, bit for bit, and its gradients the same.
  RopeData data = family_layer(rng, pick(tokens, 4), 8, 2, 512, 512, true, true, 0.0,
                               [](ref::Rope& r, RopeSpec& s) {
                                 r.normalize_v = true;
                                 s.v_dim = 512;
                               });
  const int64_t T = data.rope.tokens, Hq = 8, Hkv = 2, D = 512;
  // The copy: v = qk's key rows.
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t d = 0; d < D; ++d) {
        data.v[size_t((t * Hkv + h) * D + d)] = data.qk[size_t((t * (Hq + Hkv) + Hq + h) * D + d)];
      }
    }
  }
  data.refresh();
  ForwardOut copied = run_forward(data, runner);
  TensorView key_rows = data.qk_tensor->view();
  key_rows.data = static_cast<uint16_t*>(key_rows.data) + Hq * D;
  key_rows.sizes[1] = Hkv;
  HostTensor q(DType::kBFloat16, {T, Hq, D}), k(DType::kBFloat16, {T, Hkv, D}),
      v_out(DType::kBFloat16, {T, Hkv, D});
  QkNormRopeParams p{data.qk_tensor->view(), q.view(), k.view(), data.layout()};
  p.v = key_rows;
  p.v_out = v_out.view();
  runner.forward(p);
  EXPECT_TRUE(same_bits(q, copied.q));
  EXPECT_TRUE(same_bits(k, copied.k));
  EXPECT_TRUE(same_bits(v_out, *copied.v_out));
  check_all(data, rng, runner);  // and the copy itself against the model
}

void qwen3_next(std::mt19937_64& rng, const FamilyRunner& runner, int64_t tokens) {
  // Qwen3-Next / Qwen3.5: 16 / 2 heads of 256, rotary on 64 lanes, (1 + w) norms.
  RopeData layer = family_layer(rng, pick(tokens, 6), 16, 2, 256, 64, true, true, 1.0,
                                [](ref::Rope&, RopeSpec&) {});
  check_all(layer, rng, runner);
  // The gated query as the projection lays it out: [T, Hq, 2D], query lanes [0, D) of each head
  // (head stride 2D), read as it is by a query-only call.
  RopeData query = family_layer(rng, pick(tokens, 5), 16, 0, 256, 64, true, false, 1.0,
                                [](ref::Rope& r, RopeSpec&) { r.query_only = true; });
  query.qk_tensor.emplace(DType::kBFloat16, std::vector<int64_t>{query.rope.tokens, 16, 256},
                          std::vector<int64_t>{16 * 512, 512, 1});
  query.refresh();
  check_all(query, rng, runner);
  EXPECT_EQ(query.qk_tensor->padding_touched(), 0) << "the gate lanes were written";
}

void olmo_token_norm(std::mt19937_64& rng, const FamilyRunner& runner, int64_t tokens) {
  // OLMo 3 7B: 32 heads of 128 (MHA), norm over the token's 4096 query and 4096 key values.
  RopeData olmo3 = family_layer(rng, pick(tokens, 5), 32, 32, 128, 128, true, true, 0.0,
                                [](ref::Rope& r, RopeSpec&) { r.token_norm = true; });
  check_all(olmo3, rng, runner);
  // OLMo 2 1B: 16 heads of 128.
  RopeData olmo2 = family_layer(rng, pick(tokens, 7), 16, 16, 128, 128, true, true, 0.0,
                                [](ref::Rope& r, RopeSpec&) { r.token_norm = true; });
  check_all(olmo2, rng, runner);
}

void glm45_and_smollm3(std::mt19937_64& rng, const FamilyRunner& runner, int64_t tokens) {
  // GLM-4.5: 96 / 8 heads of 128, rotary on half, with and without use_qk_norm.
  RopeData glm_norm = family_layer(rng, pick(tokens, 3), 96, 8, 128, 64, true, true, 0.0,
                                   [](ref::Rope&, RopeSpec&) {});
  check_all(glm_norm, rng, runner);
  RopeData glm = family_layer(rng, pick(tokens, 3), 96, 8, 128, 64, false, false, 0.0,
                              [](ref::Rope& r, RopeSpec&) { r.normalize = false; });
  check_all(glm, rng, runner);
  // SmolLM3 3B: 16 / 4 heads of 128, no QK norm; its NoPE layers have no angles at all.
  RopeData nope = family_layer(rng, pick(tokens, 5), 16, 4, 128, 0, false, false, 0.0,
                               [](ref::Rope& r, RopeSpec&) {
                                 r.normalize = false;
                                 r.angles = false;
                               });
  check_all(nope, rng, runner);
}

void no_angles_is_the_identity(std::mt19937_64& rng, const FamilyRunner& runner) {
  // A NoPE layer without a norm: q and k are qk's rows exactly (one rounding of an exact value).
  ref::Rope rope{3, 4, 34};
  rope.kv_heads = 2;
  rope.normalize = false;
  rope.angles = false;
  RopeData data(rope, RopeSpec{}, rng);
  ForwardOut out = run_forward(data, runner);
  const std::vector<double> q = out.q.get(), k = out.k.get();
  for (int64_t t = 0; t < 3; ++t) {
    for (int64_t h2 = 0; h2 < 6; ++h2) {
      for (int64_t d = 0; d < 34; ++d) {
        const double got = h2 < 4 ? q[size_t((t * 4 + h2) * 34 + d)]
                                  : k[size_t((t * 2 + h2 - 4) * 34 + d)];
        ASSERT_EQ(got, data.qk[size_t((t * 6 + h2) * 34 + d)]);
      }
    }
  }
}

void empty_calls(std::mt19937_64& rng, const FamilyRunner& runner) {
  // T = 0 with token-norm weights [H*D] and the V norm: nothing to compute, zero gradients.
  ref::Rope rope{0, 2, 8};
  rope.kv_heads = 1;
  rope.token_norm = true;
  RopeSpec spec;
  spec.q_weight = spec.k_weight = true;
  spec.cache = true;
  spec.cache_rows = 4;
  RopeData data(rope, spec, rng);
  check_backward(data, rng, runner);
  ref::Rope v_rope{0, 2, 8};
  v_rope.normalize_v = true;
  RopeData v_data(v_rope, RopeSpec{}, rng);
  check_forward(v_data, runner);
  check_backward(v_data, rng, runner);
}

}  // namespace qkvfuse::test::families
