// reference.cpp: the float64 model of SPEC.md and the comparisons (see reference.hpp).
//
// The rope backward is written as the transpose of the forward's reads: every output element
// scatters its gradient onto the normalized values it was computed from. That is the chain rule
// applied to section 1 directly, a different route from section 2's gather formula, so the two
// meet only if both are right (and the tests check both against finite differences).
#include "reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "qkvfuse/error.hpp"
#include "test_util.hpp"

namespace qkvfuse::ref {
namespace {

constexpr double kEps = 1.0 / 8388608.0;  // 2^-23, F.rms_norm's fp32 default
constexpr double kE4m3Max = 448.0;
const double kNaN = std::numeric_limits<double>::quiet_NaN();

/// x rounded to `bits` significant bits, ties to even, with the quantum of 2^min_exponent's
/// binade below it (gradual underflow). Exact: x / quantum is a power-of-two scaling.
double round_significant(double x, int bits, int min_exponent) {
  if (!std::isfinite(x) || x == 0.0) return x;
  int exponent = 0;
  std::frexp(x, &exponent);  // |x| in [2^(exponent-1), 2^exponent)
  const int lead = std::max(exponent - 1, min_exponent);
  const double quantum = std::ldexp(1.0, lead - (bits - 1));
  // nearbyint rounds in the current mode, which the tests leave at its default, to nearest even.
  return std::nearbyint(x / quantum) * quantum;
}

/// Element (i, j) of a dense row-major matrix with `cols` columns.
size_t at(int64_t i, int64_t j, int64_t cols) { return size_t(i * cols + j); }

/// Output token, output head and factor column offset of input row (t, h2) (SPEC.md 1 and 8):
/// rows h2 < Hq are query heads, the rest key heads h2 - Hq.
struct Target {
  int64_t token;
  int64_t head;
  int64_t factor_offset;
  bool key;
};

Target target_of(const Rope& rope, int64_t t, int64_t h2) {
  const bool key = h2 >= rope.heads;
  const int64_t h = key ? h2 - rope.heads : h2;
  if (!rope.paired) return {t, h, 0, key};
  const int64_t half = rope.heads / 2;
  return {2 * t + h / half, h % half, (h % 2) * rope.head_dim, key};
}

/// Index of output row (token, head) in q or k.
size_t out_row(const Rope& rope, const Target& target) {
  const int64_t heads = target.key ? rope.k_out_heads() : rope.q_out_heads();
  return size_t(target.token * heads + target.head);
}

/// A rotary pair of lanes and the frequency it turns at. Interleaved: (2i, 2i + 1); NeoX:
/// (i, i + r/2); i in [0, r/2).
struct Pair {
  int64_t first;
  int64_t second;
  int64_t frequency;
};

std::vector<Pair> rotary_pairs(const Rope& rope) {
  const int64_t half = rope.rotary() / 2;
  std::vector<Pair> pairs;
  for (int64_t i = 0; i < half; ++i) {
    pairs.push_back(rope.neox ? Pair{i, i + half, i} : Pair{2 * i, 2 * i + 1, i});
  }
  return pairs;
}

/// [y_first, y_second] = M [nw_first, nw_second] for one pair of one row.
struct Rotation {
  double m00, m01, m10, m11;
};

/// The rotation of `pair` at token t for rows reading factor columns from `offset`. Tables:
/// y[d] = f1[d] nw[d] + f2[d] nw[partner]. Cache: the rotation by the angle whose cos and sin
/// are cached at row positions[t]: (c, -s; s, c); NaN outside [0, P).
Rotation rotation(const Rope& rope, const RopeTensors& tensors, int64_t t, int64_t offset,
                  const Pair& pair) {
  if (!tensors.cache) {
    const int64_t width = rope.factor_width();
    const size_t a = at(t, offset + pair.first, width);
    const size_t b = at(t, offset + pair.second, width);
    return {tensors.factor1[a], tensors.factor2[a], tensors.factor2[b], tensors.factor1[b]};
  }
  const int64_t position = tensors.positions[size_t(t)];
  if (position < 0 || position >= tensors.cache_rows) return {kNaN, kNaN, kNaN, kNaN};
  const int64_t r = rope.rotary();
  const double c = tensors.cos_sin[at(position, pair.frequency, r)];
  const double s = tensors.cos_sin[at(position, r / 2 + pair.frequency, r)];
  return {c, -s, s, c};
}

/// The row's weight w + offset ([D]), or empty without one.
std::vector<double> effective_weight(const Rope& rope, const RopeTensors& tensors, bool key) {
  std::vector<double> w = key ? tensors.k_weight : tensors.q_weight;
  for (double& value : w) value += rope.weight_offset;
  return w;
}

/// The rows of qk [T][Hq + Hkv][D] one RMS of row (t, h2) spans: the row itself, or with
/// token_norm every row of its kind at token t. Returns (first row, count).
std::pair<int64_t, int64_t> norm_rows(const Rope& rope, int64_t h2) {
  if (!rope.token_norm) return {h2, 1};
  const bool key = h2 >= rope.heads;
  return key ? std::pair<int64_t, int64_t>{rope.heads, rope.k_heads()}
             : std::pair<int64_t, int64_t>{0, rope.heads};
}

/// The normalized row n (unweighted) of row (t, h2) of qk; returns rstd (1 without the norm).
double normalize(const Rope& rope, const std::vector<double>& qk, int64_t t, int64_t h2,
                 std::vector<double>& n) {
  const int64_t D = rope.head_dim;
  const int64_t rows = rope.input_heads();
  const double* x = &qk[at(t * rows + h2, 0, D)];
  n.assign(x, x + D);
  if (!rope.normalize) return 1.0;
  const auto [first, count] = norm_rows(rope, h2);
  double squares = 0;
  for (int64_t h = first; h < first + count; ++h) {
    for (int64_t d = 0; d < D; ++d) squares += std::pow(qk[at(t * rows + h, d, D)], 2);
  }
  const double rstd = 1.0 / std::sqrt(squares / double(count * D) + rope.eps);
  for (double& value : n) value *= rstd;
  return rstd;
}

/// Where row h2's weight lanes start in its kind's weight: 0, or h * D with token_norm.
int64_t weight_lane(const Rope& rope, int64_t h2) {
  if (!rope.token_norm) return 0;
  return (h2 >= rope.heads ? h2 - rope.heads : h2) * rope.head_dim;
}

/// nw = n * (w[first + d] + offset), or n without a weight.
std::vector<double> weighted(const std::vector<double>& n, const std::vector<double>& w,
                             int64_t first) {
  std::vector<double> nw = n;
  if (!w.empty()) {
    for (size_t d = 0; d < nw.size(); ++d) nw[d] *= w[size_t(first) + d];
  }
  return nw;
}

/// True when lane d of key row (t, h2) is the previous token's (key offset, d >= r).
bool shifted(const Rope& rope, int64_t t, int64_t d, bool key) {
  return rope.key_offset && key && t > 0 && d >= rope.rotary();
}

}  // namespace

// ---- rounding and encodings --------------------------------------------------------------------

double round_bf16(double x) {
  const double rounded = round_significant(x, 8, -126);
  // The largest bf16 is (2 - 2^-7) * 2^127; anything that rounds beyond it is infinite.
  if (std::fabs(rounded) >= std::ldexp(1.0, 128)) return std::copysign(INFINITY, x);
  return rounded;
}

uint16_t bf16_bits(double representable) {
  if (std::isnan(representable)) return 0x7fc0;
  const float value = float(representable);  // exact for a bf16 value
  uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof(bits));
  return uint16_t(bits >> 16);
}

double bf16_value(uint16_t bits) {
  const uint32_t wide = uint32_t(bits) << 16;
  float value = 0;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

double e4m3_value(uint8_t code) {
  const double sign = (code & 0x80) ? -1.0 : 1.0;
  const int exponent = (code >> 3) & 0xf;
  const int mantissa = code & 0x7;
  if (exponent == 0xf && mantissa == 0x7) return kNaN;
  if (exponent == 0) return sign * mantissa * std::ldexp(1.0, -9);
  return sign * (1.0 + mantissa / 8.0) * std::ldexp(1.0, exponent - 7);
}

double round_e4m3(double x) {
  if (std::isnan(x)) return x;
  if (std::fabs(x) > kE4m3Max) return std::copysign(kE4m3Max, x);
  return round_significant(x, 4, -6);
}

uint8_t e4m3_code(double representable) {
  if (std::isnan(representable)) return 0x7f;
  const int sign = std::signbit(representable) ? 0x80 : 0x00;
  const double magnitude = std::fabs(representable);
  int code = 0;
  if (magnitude < std::ldexp(1.0, -6)) {
    code = int(magnitude / std::ldexp(1.0, -9));  // subnormal: m * 2^-9
  } else {
    int exponent = 0;
    const double fraction = std::frexp(magnitude, &exponent);  // magnitude = f * 2^exponent
    const int mantissa = int((2 * fraction - 1) * 8);          // (1 + m/8) * 2^(exponent - 1)
    code = ((exponent - 1 + 7) << 3) | mantissa;
  }
  if (code > 0x7e || e4m3_value(uint8_t(code)) != magnitude) {
    throw std::logic_error("e4m3_code: not an e4m3 value");
  }
  return uint8_t(sign | code);
}

uint8_t quantize_code(double bf16_value, float scale) {
  const float quotient = float(bf16_value) / scale;  // the spec's fp32 division
  return e4m3_code(round_e4m3(quotient));
}

// ---- QK-norm + rotary --------------------------------------------------------------------------

QkPair rope_forward(const Rope& rope, const std::vector<double>& qk, const RopeTensors& tensors) {
  const int64_t D = rope.head_dim;
  const int64_t rows = rope.input_heads();
  const std::vector<Pair> pairs = rotary_pairs(rope);
  QkPair out{std::vector<double>(rope.q_count(), kNaN), std::vector<double>(rope.k_count(), kNaN)};
  std::vector<double> n, n_prev;
  for (int64_t t = 0; t < rope.tokens; ++t) {
    for (int64_t h2 = 0; h2 < rows; ++h2) {
      const Target target = target_of(rope, t, h2);
      const std::vector<double> w = effective_weight(rope, tensors, target.key);
      normalize(rope, qk, t, h2, n);
      const std::vector<double> nw = weighted(n, w, weight_lane(rope, h2));
      std::vector<double> nw_prev;
      if (t > 0) {
        normalize(rope, qk, t - 1, h2, n_prev);
        nw_prev = weighted(n_prev, w, weight_lane(rope, h2));
      }
      std::vector<double> y = nw;  // lanes >= r pass through
      for (const Pair& pair : pairs) {
        const Rotation m = rotation(rope, tensors, t, target.factor_offset, pair);
        const double a = nw[size_t(pair.first)], b = nw[size_t(pair.second)];
        y[size_t(pair.first)] = m.m00 * a + m.m01 * b;
        y[size_t(pair.second)] = m.m10 * a + m.m11 * b;
      }
      std::vector<double>& dest = target.key ? out.k : out.q;
      const size_t row = out_row(rope, target);
      for (int64_t d = 0; d < D; ++d) {
        dest[at(int64_t(row), d, D)] = shifted(rope, t, d, target.key) ? nw_prev[size_t(d)]
                                                                       : y[size_t(d)];
      }
    }
  }
  return out;
}

QkPair rope_forward(const Rope& rope, const std::vector<double>& qk,
                    const std::vector<double>& factor1, const std::vector<double>& factor2) {
  RopeTensors tensors;
  tensors.factor1 = factor1;
  tensors.factor2 = factor2;
  return rope_forward(rope, qk, tensors);
}

RopeGradients rope_gradients(const Rope& rope, const std::vector<double>& grad_q,
                             const std::vector<double>& grad_k, const std::vector<double>& qk,
                             const RopeTensors& tensors) {
  const int64_t D = rope.head_dim;
  const int64_t rows = rope.input_heads();
  const std::vector<Pair> pairs = rotary_pairs(rope);
  // Gradient with respect to the weighted normalized rows nw, scattered from every output
  // element (y = M nw per pair, so dnw += M^T g), and the magnitudes of its terms.
  std::vector<double> grad_nw(rope.qk_count(), 0.0), magnitude(rope.qk_count(), 0.0);
  for (int64_t t = 0; t < rope.tokens; ++t) {
    for (int64_t h2 = 0; h2 < rows; ++h2) {
      const Target target = target_of(rope, t, h2);
      const std::vector<double>& grad = target.key ? grad_k : grad_q;
      const double* g = &grad[at(int64_t(out_row(rope, target)), 0, D)];
      const size_t self = at(t * rows + h2, 0, D);
      const auto add = [&](size_t index, double term) {
        grad_nw[index] += term;
        magnitude[index] += std::fabs(term);
      };
      for (const Pair& pair : pairs) {
        const Rotation m = rotation(rope, tensors, t, target.factor_offset, pair);
        const double ga = g[pair.first], gb = g[pair.second];
        add(self + size_t(pair.first), m.m00 * ga);
        add(self + size_t(pair.first), m.m10 * gb);
        add(self + size_t(pair.second), m.m01 * ga);
        add(self + size_t(pair.second), m.m11 * gb);
      }
      for (int64_t d = rope.rotary(); d < D; ++d) {
        const size_t source = shifted(rope, t, d, target.key) ? at((t - 1) * rows + h2, d, D)
                                                              : self + size_t(d);
        add(source, g[d]);
      }
    }
  }

  RopeGradients out;
  out.grad_qk.assign(grad_nw.size(), 0.0);
  out.grad_q_weight.assign(size_t(rope.weight_width(false)), 0.0);
  out.grad_k_weight.assign(size_t(rope.weight_width(true)), 0.0);
  out.q_weight_magnitude.assign(size_t(rope.weight_width(false)), 0.0);
  out.k_weight_magnitude.assign(size_t(rope.weight_width(true)), 0.0);
  // Each weight lane sums over the tokens, and (one weight per head row) over the kind's heads.
  out.q_weight_terms = rope.tokens * (rope.token_norm ? 1 : rope.heads);
  out.k_weight_terms = rope.tokens * (rope.token_norm ? 1 : rope.k_heads());
  out.term_scale.assign(size_t(rope.tokens * rows), 0.0);
  // Per token: every row's n and dn first (through the weight), then each row's dx through the
  // norm, whose mean runs over the row or, with token_norm, over the token's rows of its kind.
  std::vector<double> n;
  std::vector<double> all_n(size_t(rows * D)), all_dn(size_t(rows * D)),
      all_size(size_t(rows * D));
  std::vector<double> rstds(static_cast<size_t>(rows));
  for (int64_t t = 0; t < rope.tokens; ++t) {
    for (int64_t h2 = 0; h2 < rows; ++h2) {
      const bool key = h2 >= rope.heads;
      rstds[size_t(h2)] = normalize(rope, qk, t, h2, n);
      const std::vector<double> w = effective_weight(rope, tensors, key);
      const int64_t lane = weight_lane(rope, h2);
      const size_t base = at(t * rows + h2, 0, D);
      // Through the weight: d(nw)/dw = n, d(nw)/dn = w + offset.
      for (int64_t d = 0; d < D; ++d) {
        const size_t i = size_t(h2 * D + d), wi = size_t(lane + d);
        all_n[i] = n[size_t(d)];
        all_dn[i] = grad_nw[base + size_t(d)];
        all_size[i] = magnitude[base + size_t(d)];
        if (w.empty()) continue;
        (key ? out.grad_k_weight : out.grad_q_weight)[wi] += grad_nw[base + size_t(d)] * n[size_t(d)];
        (key ? out.k_weight_magnitude : out.q_weight_magnitude)[wi] +=
            magnitude[base + size_t(d)] * std::fabs(n[size_t(d)]);
        all_dn[i] *= w[wi];
        all_size[i] *= std::fabs(w[wi]);
      }
    }
    // Through the norm: n = x * rstd gives dx = rstd * (dn - n * mean(dn * n)), the mean over the
    // values the RMS spans.
    for (int64_t h2 = 0; h2 < rows; ++h2) {
      const auto [first, count] = norm_rows(rope, h2);
      double dot = 0, dot_size = 0;
      for (int64_t i = first * D; i < (first + count) * D; ++i) {
        dot += all_dn[size_t(i)] * all_n[size_t(i)];
        dot_size += all_size[size_t(i)] * std::fabs(all_n[size_t(i)]);
      }
      const double values = double(count * D);
      const double rstd = rstds[size_t(h2)];
      const size_t base = at(t * rows + h2, 0, D);
      double largest = 0;
      for (int64_t d = 0; d < D; ++d) {
        const size_t i = size_t(h2 * D + d);
        const double correction = rope.normalize ? all_n[i] * dot / values : 0.0;
        out.grad_qk[base + size_t(d)] = rstd * (all_dn[i] - correction);
        const double size_correction =
            rope.normalize ? std::fabs(all_n[i]) * dot_size / values : 0.0;
        largest = std::max(largest, all_size[i] + size_correction);
      }
      const double scale = rstd * largest;
      out.term_scale[size_t(t * rows + h2)] = std::isfinite(scale) ? scale : 0.0;
    }
  }
  return out;
}

std::vector<double> rope_backward(const Rope& rope, const std::vector<double>& grad_q,
                                  const std::vector<double>& grad_k, const std::vector<double>& qk,
                                  const std::vector<double>& factor1,
                                  const std::vector<double>& factor2) {
  RopeTensors tensors;
  tensors.factor1 = factor1;
  tensors.factor2 = factor2;
  return rope_gradients(rope, grad_q, grad_k, qk, tensors).grad_qk;
}

// ---- fused FP8 backward ------------------------------------------------------------------------

int64_t qkv_dim(const Rope& rope, int64_t v_dim) {
  return rope.input_heads() * rope.head_dim + rope.k_heads() * v_dim;
}

std::vector<double> v_norm_forward(int64_t rows, int64_t v_dim, double eps,
                                   const std::vector<double>& v) {
  std::vector<double> out(v.size());
  for (int64_t row = 0; row < rows; ++row) {
    double squares = 0;
    for (int64_t d = 0; d < v_dim; ++d) squares += std::pow(v[at(row, d, v_dim)], 2);
    const double rstd = 1.0 / std::sqrt(squares / double(v_dim) + eps);
    for (int64_t d = 0; d < v_dim; ++d) out[at(row, d, v_dim)] = v[at(row, d, v_dim)] * rstd;
  }
  return out;
}

VNormGradients v_norm_gradients(int64_t rows, int64_t v_dim, double eps,
                                const std::vector<double>& v, const std::vector<double>& grad_v_out) {
  VNormGradients out{std::vector<double>(v.size()), std::vector<double>(size_t(rows))};
  for (int64_t row = 0; row < rows; ++row) {
    double squares = 0;
    for (int64_t d = 0; d < v_dim; ++d) squares += std::pow(v[at(row, d, v_dim)], 2);
    const double rstd = 1.0 / std::sqrt(squares / double(v_dim) + eps);
    double dot = 0, dot_size = 0;
    for (int64_t d = 0; d < v_dim; ++d) {
      const double n = v[at(row, d, v_dim)] * rstd, g = grad_v_out[at(row, d, v_dim)];
      dot += g * n;
      dot_size += std::fabs(g * n);
    }
    double largest = 0;
    for (int64_t d = 0; d < v_dim; ++d) {
      const double n = v[at(row, d, v_dim)] * rstd, g = grad_v_out[at(row, d, v_dim)];
      out.grad_v[at(row, d, v_dim)] = rstd * (g - n * dot / double(v_dim));
      largest = std::max(largest, std::fabs(g) + std::fabs(n) * dot_size / double(v_dim));
    }
    const double scale = rstd * largest;
    out.term_scale[size_t(row)] = std::isfinite(scale) ? scale : 0.0;
  }
  return out;
}

std::vector<double> qkv_backward_values(const Rope& rope, int64_t v_dim,
                                        const std::vector<double>& grad_q,
                                        const std::vector<double>& grad_k,
                                        const std::vector<double>& grad_v_in,
                                        const std::vector<double>& qk, const RopeTensors& tensors,
                                        const std::vector<double>& v) {
  const std::vector<double> grad_qk = rope_gradients(rope, grad_q, grad_k, qk, tensors).grad_qk;
  const std::vector<double> grad_v =
      rope.normalize_v
          ? v_norm_gradients(rope.tokens * rope.k_heads(), v_dim, rope.eps, v, grad_v_in).grad_v
          : grad_v_in;
  const int64_t qk_features = rope.input_heads() * rope.head_dim;
  const int64_t v_features = rope.k_heads() * v_dim;
  const int64_t features = qkv_dim(rope, v_dim);
  std::vector<double> values(size_t(rope.tokens * features));
  for (int64_t t = 0; t < rope.tokens; ++t) {
    for (int64_t f = 0; f < qk_features; ++f) {
      values[at(t, f, features)] = grad_qk[at(t, f, qk_features)];
    }
    for (int64_t f = 0; f < v_features; ++f) {
      values[at(t, qk_features + f, features)] = grad_v[at(t, f, v_features)];
    }
  }
  return values;
}

std::vector<double> qkv_backward_values(const Rope& rope, int64_t v_dim,
                                        const std::vector<double>& grad_q,
                                        const std::vector<double>& grad_k,
                                        const std::vector<double>& grad_v,
                                        const std::vector<double>& qk,
                                        const std::vector<double>& factor1,
                                        const std::vector<double>& factor2) {
  RopeTensors tensors;
  tensors.factor1 = factor1;
  tensors.factor2 = factor2;
  return qkv_backward_values(rope, v_dim, grad_q, grad_k, grad_v, qk, tensors);
}

// ---- quantize ----------------------------------------------------------------------------------

Quantized quantize(const std::vector<double>& src, int64_t rows, int64_t cols, float scale) {
  Quantized out{std::vector<uint8_t>(src.size()), std::vector<uint8_t>(src.size())};
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t n = 0; n < cols; ++n) {
      const uint8_t code = quantize_code(src[at(m, n, cols)], scale);
      out.row[at(m, n, cols)] = code;
      out.t[at(n, m, rows)] = code;
    }
  }
  return out;
}

double amax(const std::vector<double>& values) {
  double result = 0;
  for (double v : values) {
    if (std::isnan(v)) return kNaN;
    result = std::max(result, std::fabs(v));
  }
  return result;
}

// ---- GEMM and the packed projection ------------------------------------------------------------

std::vector<double> gemm(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, int64_t m,
                         int64_t n, int64_t k, double scale) {
  std::vector<double> a_values(a.size()), b_values(b.size());
  for (size_t i = 0; i < a.size(); ++i) a_values[i] = e4m3_value(a[i]);
  for (size_t i = 0; i < b.size(); ++i) b_values[i] = e4m3_value(b[i]);
  std::vector<double> d(size_t(m * n));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0;
      for (int64_t l = 0; l < k; ++l) sum += a_values[at(i, l, k)] * b_values[at(j, l, k)];
      d[at(i, j, n)] = sum * scale;
    }
  }
  return d;
}

std::vector<double> packed_projection(const std::vector<uint8_t>& x_f8,
                                      const std::vector<uint8_t>& weight_f8, int64_t tokens,
                                      int64_t qkv_dim, int64_t channels, float x_scale,
                                      float weight_scale, float qkv_scale) {
  const double scale = double(x_scale) * double(weight_scale) * double(qkv_scale);
  return gemm(x_f8, weight_f8, tokens, qkv_dim, channels, scale);
}

WeightGrads packed_weight_grads(const std::vector<double>& grad_weight,
                                const std::vector<double>& weight, float qkv_scale) {
  WeightGrads out;
  out.grad_weight.resize(grad_weight.size());
  for (size_t i = 0; i < grad_weight.size(); ++i) {
    out.grad_weight[i] = grad_weight[i] * double(qkv_scale);
    out.grad_qkv_scale += grad_weight[i] * weight[i];
  }
  return out;
}

}  // namespace qkvfuse::ref

namespace qkvfuse::test {
namespace {

/// Position on the number line in steps: +0 and -0 are both 0, and adjacent values differ by 1
/// across zero too (both formats are sign-magnitude).
int ordinal_bf16(uint16_t bits) { return (bits & 0x8000) ? -int(bits & 0x7fff) : int(bits); }
int ordinal_e4m3(uint8_t code) { return (code & 0x80) ? -int(code & 0x7f) : int(code); }

/// Files one element: `got`, the expected ordinal, and the lowest/highest acceptable ordinals
/// before the one-step allowance.
/// `detail()` describes the element; it is only called for the first failure.
template <typename Detail>
void classify(Comparison& c, size_t index, bool got_nan, bool expect_nan, int got, int expected,
              int low, int high, const Detail& detail) {
  if (expect_nan || got_nan) {
    if (expect_nan && got_nan) {
      ++c.exact;
      return;
    }
  } else if (got == expected) {
    ++c.exact;
    return;
  } else if (std::abs(got - expected) == 1) {
    ++c.one_step;
    return;
  } else if (got >= low - 1 && got <= high + 1) {
    ++c.in_noise;
    return;
  }
  if (c.bad++ == 0) c.first_bad = "element " + std::to_string(index) + ": " + detail();
}

double noise_at(const std::vector<double>& noise, size_t i) {
  return noise.empty() ? 0.0 : noise[i];
}

}  // namespace

namespace {

/// The bytes of one poisoned element of `dtype`.
std::vector<unsigned char> poison_bytes(DType dtype) {
  std::vector<unsigned char> bytes(dtype_size(dtype));
  const float nan32 = std::numeric_limits<float>::quiet_NaN();
  switch (dtype) {
    case DType::kBFloat16: std::memcpy(bytes.data(), &kPoisonBF16, 2); break;
    case DType::kFloat32: std::memcpy(bytes.data(), &nan32, 4); break;
    case DType::kFloat64: std::memcpy(bytes.data(), &ref::kNaN, 8); break;
    case DType::kFloat8E4M3: bytes[0] = kPoisonE4M3; break;
    case DType::kInt32:
    case DType::kInt64: std::memset(bytes.data(), 0x7f, bytes.size()); bytes[0] = 0xc1; break;
    // NaN in both; tensors of these dtypes only test that the ops refuse them.
    case DType::kFloat16:
    case DType::kFloat8E5M2: std::memset(bytes.data(), 0xff, bytes.size()); break;
  }
  return bytes;
}

}  // namespace

HostTensor::HostTensor(DType dtype, std::vector<int64_t> sizes, std::vector<int64_t> strides,
                       int64_t offset)
    : dtype_(dtype), sizes_(std::move(sizes)), strides_(std::move(strides)), offset_(offset) {
  if (strides_.empty()) {
    strides_.resize(sizes_.size());
    int64_t stride = 1;
    for (size_t d = sizes_.size(); d-- > 0;) {
      strides_[d] = stride;
      stride *= sizes_[d];
    }
  }
  int64_t last = offset_;  // the highest element the view reaches
  for (size_t d = 0; d < sizes_.size(); ++d)
    last += std::max<int64_t>(0, sizes_[d] - 1) * strides_[d];
  bytes_.resize(size_t(last + 1) * dtype_size(dtype_));
  poison();
}

TensorView HostTensor::view() {
  TensorView view;
  view.data = slot(offset_);
  view.dtype = dtype_;
  view.device = kCPU;
  view.ndim = int(sizes_.size());
  for (size_t d = 0; d < sizes_.size(); ++d) {
    view.sizes[d] = sizes_[d];
    view.strides[d] = strides_[d];
  }
  return view;
}

int64_t HostTensor::numel() const {
  int64_t count = 1;
  for (int64_t size : sizes_) count *= size;
  return count;
}

int64_t HostTensor::buffer_index(int64_t dense_index) const {
  int64_t index = offset_;
  for (size_t d = sizes_.size(); d-- > 0;) {
    index += (dense_index % sizes_[d]) * strides_[d];
    dense_index /= sizes_[d];
  }
  return index;
}

unsigned char* HostTensor::slot(int64_t element) {
  return bytes_.data() + size_t(element) * dtype_size(dtype_);
}
const unsigned char* HostTensor::slot(int64_t element) const {
  return bytes_.data() + size_t(element) * dtype_size(dtype_);
}

namespace {
/// float16 and float8_e5m2 tensors exist only to be refused by the ops: they hold no values.
void check_has_values(DType dtype) {
  if (dtype == DType::kFloat16 || dtype == DType::kFloat8E5M2) {
    throw std::logic_error(std::string("HostTensor: no values for dtype ") + dtype_name(dtype));
  }
}
}  // namespace

void HostTensor::set(const std::vector<double>& values) {
  check_has_values(dtype_);
  if (dtype_ == DType::kFloat8E4M3) {
    std::vector<uint8_t> codes(values.size());
    for (size_t i = 0; i < values.size(); ++i)
      codes[i] = ref::e4m3_code(ref::round_e4m3(values[i]));
    set_codes(codes);
    return;
  }
  if (dtype_ == DType::kInt32 || dtype_ == DType::kInt64) {
    std::vector<int64_t> ints(values.size());
    for (size_t i = 0; i < values.size(); ++i) ints[i] = int64_t(values[i]);
    set_ints(ints);
    return;
  }
  for (int64_t i = 0; i < numel(); ++i) {
    unsigned char* out = slot(buffer_index(i));
    const double value = values[size_t(i)];
    if (dtype_ == DType::kBFloat16) {
      const uint16_t bits = ref::bf16_bits(ref::round_bf16(value));
      std::memcpy(out, &bits, sizeof(bits));
    } else if (dtype_ == DType::kFloat32) {
      const float narrow = float(value);
      std::memcpy(out, &narrow, sizeof(narrow));
    } else {
      std::memcpy(out, &value, sizeof(value));
    }
  }
}

void HostTensor::set_ints(const std::vector<int64_t>& values) {
  for (int64_t i = 0; i < numel(); ++i) {
    unsigned char* out = slot(buffer_index(i));
    if (dtype_ == DType::kInt32) {
      const auto narrow = int32_t(values[size_t(i)]);
      std::memcpy(out, &narrow, sizeof(narrow));
    } else {
      std::memcpy(out, &values[size_t(i)], sizeof(int64_t));
    }
  }
}

void HostTensor::set_codes(const std::vector<uint8_t>& codes) {
  for (int64_t i = 0; i < numel(); ++i) *slot(buffer_index(i)) = codes[size_t(i)];
}

std::vector<double> HostTensor::get() const {
  check_has_values(dtype_);
  std::vector<double> out(static_cast<size_t>(numel()));
  for (int64_t i = 0; i < numel(); ++i) {
    const unsigned char* in = slot(buffer_index(i));
    if (dtype_ == DType::kBFloat16) {
      uint16_t bits = 0;
      std::memcpy(&bits, in, sizeof(bits));
      out[size_t(i)] = ref::bf16_value(bits);
    } else if (dtype_ == DType::kFloat32) {
      float value = 0;
      std::memcpy(&value, in, sizeof(value));
      out[size_t(i)] = value;
    } else if (dtype_ == DType::kFloat64) {
      std::memcpy(&out[size_t(i)], in, sizeof(double));
    } else if (dtype_ == DType::kInt32) {
      int32_t value = 0;
      std::memcpy(&value, in, sizeof(value));
      out[size_t(i)] = double(value);
    } else if (dtype_ == DType::kInt64) {
      int64_t value = 0;
      std::memcpy(&value, in, sizeof(value));
      out[size_t(i)] = double(value);
    } else {
      out[size_t(i)] = ref::e4m3_value(*in);
    }
  }
  return out;
}

std::vector<uint16_t> HostTensor::get_bf16_bits() const {
  std::vector<uint16_t> out(static_cast<size_t>(numel()));
  for (int64_t i = 0; i < numel(); ++i) std::memcpy(&out[size_t(i)], slot(buffer_index(i)), 2);
  return out;
}

std::vector<uint8_t> HostTensor::get_codes() const {
  std::vector<uint8_t> out(static_cast<size_t>(numel()));
  for (int64_t i = 0; i < numel(); ++i) out[size_t(i)] = *slot(buffer_index(i));
  return out;
}

void HostTensor::poison() {
  const std::vector<unsigned char> pattern = poison_bytes(dtype_);
  for (size_t i = 0; i < bytes_.size(); i += pattern.size()) {
    std::memcpy(bytes_.data() + i, pattern.data(), pattern.size());
  }
}

int64_t HostTensor::touched(bool outside_view_only) const {
  const size_t element = dtype_size(dtype_);
  std::vector<bool> skip(bytes_.size() / element, false);
  if (outside_view_only) {
    for (int64_t i = 0; i < numel(); ++i) skip[size_t(buffer_index(i))] = true;
  }
  const std::vector<unsigned char> pattern = poison_bytes(dtype_);
  int64_t count = 0;
  for (size_t e = 0; e < skip.size(); ++e) {
    if (!skip[e] && std::memcmp(bytes_.data() + e * element, pattern.data(), element) != 0) {
      ++count;
    }
  }
  return count;
}

int64_t HostTensor::padding_touched() const { return touched(true); }

int64_t HostTensor::elements_touched() const { return touched(false); }

std::vector<double> random_values(std::mt19937_64& rng, size_t count, DType dtype, double scale) {
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<double> values(count);
  for (double& v : values) {
    v = normal(rng);
    switch (dtype) {
      case DType::kBFloat16: v = ref::round_bf16(v); break;
      case DType::kFloat32: v = double(float(v)); break;
      case DType::kFloat64: break;
      case DType::kFloat8E4M3: v = ref::round_e4m3(v); break;
      case DType::kInt32:
      case DType::kInt64: v = std::nearbyint(v); break;
      case DType::kFloat16:
      case DType::kFloat8E5M2: check_has_values(dtype); break;
    }
  }
  return values;
}

std::vector<double> e4m3_tie_inputs(float scale) {
  std::vector<double> out;
  for (int code = 0; code + 1 < 0x7f; ++code) {
    const double midpoint =
        (ref::e4m3_value(uint8_t(code)) + ref::e4m3_value(uint8_t(code + 1))) / 2;
    const double x = midpoint * double(scale);
    const bool bf16_exact = ref::round_bf16(x) == x;
    if (bf16_exact && double(float(x) / scale) == midpoint) {
      out.push_back(x);
      out.push_back(-x);
    }
  }
  return out;
}

void rotary_factor_values(std::mt19937_64& rng, int64_t tokens, int64_t head_dim, int64_t copies,
                          int64_t rotary_dim, bool off_bf16_grid, std::vector<double>& factor1,
                          std::vector<double>& factor2) {
  std::vector<float> f1, f2;
  rotary_tables(tokens, head_dim, copies, rotary_dim, f1, f2);
  std::uniform_real_distribution<double> nudge(-1.0 / 4096, 1.0 / 4096);
  factor1.resize(f1.size());
  factor2.resize(f2.size());
  for (size_t i = 0; i < f1.size(); ++i) {
    factor1[i] = f1[i];
    factor2[i] = f2[i];
    const bool stationary = f1[i] == 1.0f && f2[i] == 0.0f;
    if (off_bf16_grid && !stationary) {
      factor1[i] = double(float(factor1[i] * (1 + nudge(rng))));
      factor2[i] = double(float(factor2[i] * (1 + nudge(rng))));
    }
  }
}

::testing::AssertionResult passes(const Comparison& comparison) {
  std::printf("[compare] %s\n", comparison.summary().c_str());
  if (comparison.ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << comparison.summary();
}

std::string Comparison::summary() const {
  std::ostringstream out;
  out << what << ": " << count << " elements, " << exact << " exact, " << one_step << " by 1 step, "
      << in_noise << " in noise, " << unwritten << " unwritten, " << bad << " bad";
  if (bad) out << " (first: " << first_bad << ")";
  return out.str();
}

std::vector<double> row_noise(const std::vector<double>& ref, int64_t row_length, double relative) {
  std::vector<double> noise(ref.size());
  for (size_t start = 0; start < ref.size(); start += size_t(row_length)) {
    const size_t end = std::min(ref.size(), start + size_t(row_length));
    double largest = 0;
    for (size_t i = start; i < end; ++i) largest = std::max(largest, std::fabs(ref[i]));
    for (size_t i = start; i < end; ++i) noise[i] = relative * largest;
  }
  return noise;
}

std::vector<double> qkv_feature_noise(const ref::Rope& rope, int64_t v_dim,
                                      const std::vector<double>& values, double relative,
                                      const std::vector<double>& term_scale,
                                      const std::vector<double>& v_term_scale) {
  const int64_t rows = rope.input_heads();
  const int64_t qkv_dim = ref::qkv_dim(rope, v_dim);
  std::vector<double> noise(values.size(), 0.0);
  for (int64_t t = 0; t < rope.tokens; ++t) {
    for (int64_t h2 = 0; h2 < rows; ++h2) {
      const size_t base = size_t(t * qkv_dim + h2 * rope.head_dim);
      double largest = 0;
      for (int64_t d = 0; d < rope.head_dim; ++d) {
        const double v = values[base + size_t(d)];
        if (std::isfinite(v)) largest = std::max(largest, std::fabs(v));
      }
      if (!term_scale.empty()) largest = std::max(largest, term_scale[size_t(t * rows + h2)]);
      for (int64_t d = 0; d < rope.head_dim; ++d) noise[base + size_t(d)] = relative * largest;
    }
    if (!rope.normalize_v) continue;
    for (int64_t h = 0; h < rope.k_heads(); ++h) {
      const size_t base = size_t(t * qkv_dim + rows * rope.head_dim + h * v_dim);
      double largest = 0;
      for (int64_t d = 0; d < v_dim; ++d) {
        const double v = values[base + size_t(d)];
        if (std::isfinite(v)) largest = std::max(largest, std::fabs(v));
      }
      if (!v_term_scale.empty()) {
        largest = std::max(largest, v_term_scale[size_t(t * rope.k_heads() + h)]);
      }
      for (int64_t d = 0; d < v_dim; ++d) noise[base + size_t(d)] = relative * largest;
    }
  }
  return noise;
}

void widen_by_terms(std::vector<double>& noise, const std::vector<double>& term_scale,
                    int64_t row_length, double relative) {
  for (size_t i = 0; i < noise.size(); ++i) {
    noise[i] = std::max(noise[i], relative * term_scale[i / size_t(row_length)]);
  }
}

std::vector<double> fp32_sum_tolerance(const std::vector<double>& magnitude, int64_t terms) {
  std::vector<double> tolerance(magnitude.size());
  const double factor = std::ldexp(16.0 + std::sqrt(double(terms)), -24);
  // Products below float32's normal range lose bits absolutely: half a subnormal step (2^-150)
  // per rounding, a few roundings per term.
  const double underflow = double(terms + 16) * std::ldexp(1.0, -147);
  for (size_t i = 0; i < magnitude.size(); ++i) tolerance[i] = factor * magnitude[i] + underflow;
  return tolerance;
}

Comparison compare_bf16(const std::string& what, const std::vector<uint16_t>& got,
                        const std::vector<double>& ref, const std::vector<double>& noise) {
  Comparison c;
  c.what = what;
  c.count = int64_t(ref.size());
  if (got.size() != ref.size()) {
    c.bad = c.count;
    c.first_bad = "size " + std::to_string(got.size()) + " vs " + std::to_string(ref.size());
    return c;
  }
  for (size_t i = 0; i < ref.size(); ++i) {
    if (got[i] == kPoisonBF16 && !std::isnan(ref[i])) {
      ++c.unwritten;
      continue;
    }
    const uint16_t expected = ref::bf16_bits(ref::round_bf16(ref[i]));
    const uint16_t low = ref::bf16_bits(ref::round_bf16(ref[i] - noise_at(noise, i)));
    const uint16_t high = ref::bf16_bits(ref::round_bf16(ref[i] + noise_at(noise, i)));
    const auto detail = [&] {
      std::ostringstream out;
      out << "got " << ref::bf16_value(got[i]) << ", expected " << ref[i] << " (rounded "
          << ref::bf16_value(expected) << ")";
      return out.str();
    };
    classify(c, i, std::isnan(ref::bf16_value(got[i])), std::isnan(ref[i]), ordinal_bf16(got[i]),
             ordinal_bf16(expected), ordinal_bf16(low), ordinal_bf16(high), detail);
  }
  return c;
}

Comparison compare_e4m3(const std::string& what, const std::vector<uint8_t>& got,
                        const std::vector<double>& values, float scale,
                        const std::vector<double>& noise) {
  Comparison c;
  c.what = what;
  c.count = int64_t(values.size());
  if (got.size() != values.size()) {
    c.bad = c.count;
    c.first_bad = "size " + std::to_string(got.size()) + " vs " + std::to_string(values.size());
    return c;
  }
  const auto code_of = [scale](double value) {
    return ref::quantize_code(ref::round_bf16(value), scale);
  };
  for (size_t i = 0; i < values.size(); ++i) {
    const uint8_t expected = code_of(values[i]);
    const bool expect_nan = (expected & 0x7f) == 0x7f;
    const uint8_t low = code_of(values[i] - noise_at(noise, i));
    const uint8_t high = code_of(values[i] + noise_at(noise, i));
    if (scale == 0.0f && zero_scale_ambiguous(values[i], noise_at(noise, i))) {
      const bool may_be_positive = values[i] + noise_at(noise, i) > 0;
      const bool may_be_negative = values[i] - noise_at(noise, i) < 0;
      if ((got[i] & 0x7f) == 0x7f || (got[i] == 0x7e && may_be_positive) ||
          (got[i] == 0xfe && may_be_negative)) {
        ++c.in_noise;
        continue;
      }
    }
    if (got[i] == kPoisonE4M3 && !expect_nan) {
      ++c.unwritten;
      continue;
    }
    const auto detail = [&] {
      std::ostringstream out;
      out << "got code 0x" << std::hex << int(got[i]) << ", expected 0x" << int(expected)
          << std::dec << " (value " << values[i] << " / scale " << scale << ")";
      return out.str();
    };
    classify(c, i, (got[i] & 0x7f) == 0x7f, expect_nan, ordinal_e4m3(got[i]),
             ordinal_e4m3(expected), ordinal_e4m3(low), ordinal_e4m3(high), detail);
  }
  return c;
}

Comparison compare_close(const std::string& what, const std::vector<double>& got,
                         const std::vector<double>& ref, const std::vector<double>& tolerance) {
  Comparison c;
  c.what = what;
  c.count = int64_t(ref.size());
  if (got.size() != ref.size()) {
    c.bad = c.count;
    c.first_bad = "size " + std::to_string(got.size()) + " vs " + std::to_string(ref.size());
    return c;
  }
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(got[i]) && !std::isnan(ref[i])) {
      ++c.unwritten;  // the poison (a NaN result would be just as wrong)
    } else if (got[i] == ref[i] || (std::isnan(got[i]) && std::isnan(ref[i]))) {
      ++c.exact;
    } else if (std::fabs(got[i] - ref[i]) <= tolerance[i]) {
      ++c.in_noise;
    } else if (c.bad++ == 0) {
      std::ostringstream detail;
      detail.precision(17);
      detail << "element " << i << ": got " << got[i] << ", expected " << ref[i] << " (tolerance "
             << tolerance[i] << ")";
      c.first_bad = detail.str();
    }
  }
  return c;
}

Comparison compare_bf16_gpu_cpu(const std::string& what, const std::vector<uint16_t>& gpu,
                                const std::vector<uint16_t>& cpu, int64_t row_length,
                                double relative_noise, const std::vector<double>& term_scale) {
  Comparison c;
  c.what = what;
  c.count = int64_t(cpu.size());
  if (gpu.size() != cpu.size()) {
    c.bad = c.count;
    c.first_bad = "sizes differ";
    return c;
  }
  const auto hex = [](uint16_t bits) {
    char text[16];
    std::snprintf(text, sizeof(text), "0x%x", unsigned(bits));
    return std::string(text);
  };
  for (size_t start = 0; start < cpu.size(); start += size_t(row_length)) {
    double row_max = 0;  // over finite values: an inf must match exactly, not widen the row
    for (size_t i = start; i < start + size_t(row_length); ++i) {
      const double v = std::fabs(double(bf16_to_float(cpu[i])));
      if (std::isfinite(v)) row_max = std::max(row_max, v);
    }
    if (!term_scale.empty()) row_max = std::max(row_max, term_scale[start / size_t(row_length)]);
    for (size_t i = start; i < start + size_t(row_length); ++i) {
      const uint16_t a = gpu[i], b = cpu[i];
      const double va = bf16_to_float(a), vb = bf16_to_float(b);
      bool ok = true;
      if (a == kPoisonBF16) {
        ++c.unwritten;
        continue;
      } else if (std::isnan(va) || std::isnan(vb)) {
        ok = std::isnan(va) && std::isnan(vb);
        if (ok) ++c.exact;
      } else if (a == b) {
        ++c.exact;
      } else if (std::abs(ordinal_bf16(a) - ordinal_bf16(b)) <= 1) {
        ++c.one_step;
      } else if (std::isfinite(va) && std::isfinite(vb) &&
                 std::fabs(va - vb) <= relative_noise * row_max + std::fabs(vb) / 256) {
        ++c.in_noise;
      } else {
        ok = false;
      }
      if (!ok && c.bad++ == 0) {
        std::ostringstream out;
        out << "element " << i << " (row " << i / size_t(row_length) << ", col "
            << i % size_t(row_length) << "): gpu " << va << " (" << hex(a) << ") cpu " << vb
            << " (" << hex(b) << "), row max " << row_max;
        c.first_bad = out.str();
      }
    }
  }
  return c;
}

// ---- rope inputs --------------------------------------------------------------------------------

void rope_tables(std::mt19937_64& rng, const ref::Rope& rope, bool off_bf16_grid,
                 std::vector<double>& factor1, std::vector<double>& factor2) {
  const int64_t D = rope.head_dim, r = rope.rotary(), width = rope.factor_width();
  std::uniform_real_distribution<double> angle(-4.0, 4.0);
  std::uniform_real_distribution<double> junk(-4.0, 4.0);
  std::uniform_real_distribution<double> nudge(-1.0 / 4096, 1.0 / 4096);
  const auto value = [&](double x) {
    const double rounded = ref::round_bf16(x);
    return off_bf16_grid ? double(float(rounded * (1 + nudge(rng)))) : rounded;
  };
  factor1.assign(size_t(rope.tokens * width), 0.0);
  factor2.assign(factor1.size(), 0.0);
  for (int64_t t = 0; t < rope.tokens; ++t) {
    for (int64_t chunk = 0; chunk < width; chunk += D) {
      const size_t base = size_t(t * width + chunk);
      for (int64_t d = r; d < D; ++d) {
        factor1[base + size_t(d)] = ref::round_bf16(junk(rng));
        factor2[base + size_t(d)] = ref::round_bf16(junk(rng));
      }
      for (int64_t i = 0; i < r / 2; ++i) {
        const double theta = angle(rng);
        const int64_t first = rope.neox ? i : 2 * i;
        const int64_t second = rope.neox ? i + r / 2 : 2 * i + 1;
        // Interleaved (the speedrun's tables): f2 = +sin at the first lane, -sin at the second.
        // NeoX (Hugging Face's rotate_half): -sin at the first, +sin at the second.
        const double sign = rope.neox ? -1.0 : 1.0;
        factor1[base + size_t(first)] = value(std::cos(theta));
        factor1[base + size_t(second)] = value(std::cos(theta));
        factor2[base + size_t(first)] = value(sign * std::sin(theta));
        factor2[base + size_t(second)] = value(-sign * std::sin(theta));
      }
    }
  }
}

std::vector<double> cos_sin_cache(int64_t rows, int64_t rotary, DType dtype, double base) {
  std::vector<double> cache(size_t(rows * rotary));
  const auto round = [dtype](double x) {
    return dtype == DType::kBFloat16 ? ref::round_bf16(x)
           : dtype == DType::kFloat32 ? double(float(x))
                                      : x;
  };
  for (int64_t p = 0; p < rows; ++p) {
    for (int64_t i = 0; i < rotary / 2; ++i) {
      const double theta = double(p) * std::pow(base, -2.0 * double(i) / double(rotary));
      cache[size_t(p * rotary + i)] = round(std::cos(theta));
      cache[size_t(p * rotary + rotary / 2 + i)] = round(std::sin(theta));
    }
  }
  return cache;
}

std::vector<int64_t> packed_positions(std::mt19937_64& rng, int64_t tokens, int64_t rows) {
  std::uniform_int_distribution<int64_t> length(1, std::max<int64_t>(1, std::min(rows, tokens)));
  std::vector<int64_t> positions;
  while (int64_t(positions.size()) < tokens) {
    const int64_t document = length(rng);
    for (int64_t p = 0; p < document && int64_t(positions.size()) < tokens; ++p) {
      positions.push_back(p);
    }
  }
  return positions;
}

std::string describe(const ref::Rope& rope) {
  std::ostringstream out;
  out << "T=" << rope.tokens << " Hq=" << rope.heads << " Hkv=" << rope.k_heads()
      << " D=" << rope.head_dim << " r=" << rope.rotary() << (rope.neox ? " neox" : " interleaved")
      << (rope.paired ? " paired" : "") << (rope.key_offset ? " key_offset" : "")
      << (rope.normalize ? " rms eps=" : " no-norm");
  if (rope.normalize) out << rope.eps;
  if (rope.weight_offset != 0) out << " weight_offset=" << rope.weight_offset;
  if (rope.token_norm) out << " token-norm";
  if (rope.query_only) out << " query-only";
  if (!rope.angles) out << " no-angles";
  if (rope.normalize_v) out << " v-norm";
  return out.str();
}

std::string RopeSpec::describe() const {
  std::ostringstream out;
  out << "qk " << dtype_name(qk_dtype) << (cache ? " cos_sin " : " tables ")
      << dtype_name(angle_dtype);
  if (cache) {
    out << " positions " << dtype_name(position_dtype) << (packed ? " packed" : " random")
        << " P=" << cache_rows;
  }
  if (q_weight || k_weight) {
    out << " weights" << (q_weight ? " q" : "") << (k_weight ? " k" : "") << " "
        << dtype_name(weight_dtype);
  }
  if (qk_row_pad) out << " qk row pad " << qk_row_pad;
  return out.str();
}

RopeData::RopeData(const ref::Rope& r, const RopeSpec& s, std::mt19937_64& rng)
    : rope(r), spec(s) {
  const int64_t T = rope.tokens, D = rope.head_dim, rows = rope.input_heads();
  qk = random_values(rng, rope.qk_count(), spec.qk_dtype, spec.qk_scale);
  qk_tensor.emplace(spec.qk_dtype, std::vector<int64_t>{T, rows, D},
                    std::vector<int64_t>{rows * D + spec.qk_row_pad, D, 1});
  tensors.cache = spec.cache && rope.angles;
  if (!rope.angles) {
    // No angle source: nothing rotates (SPEC.md section 9).
  } else if (spec.cache) {
    if (spec.cache_rows <= 0) spec.cache_rows = T + 5;
    const int64_t P = spec.cache_rows, rotary = rope.rotary();
    tensors.cache_rows = P;
    tensors.cos_sin = cos_sin_cache(P, rotary, spec.angle_dtype);
    if (spec.packed) {
      tensors.positions = packed_positions(rng, T, P);
    } else {
      std::uniform_int_distribution<int64_t> position(0, P - 1);
      tensors.positions.resize(size_t(T));
      for (int64_t& p : tensors.positions) p = position(rng);
    }
    cos_sin.emplace(spec.angle_dtype, std::vector<int64_t>{P, rotary});
    positions.emplace(spec.position_dtype, std::vector<int64_t>{T});
  } else {
    rope_tables(rng, rope, spec.angle_dtype != DType::kBFloat16, tensors.factor1,
                tensors.factor2);
    factor1.emplace(spec.angle_dtype, std::vector<int64_t>{T, rope.factor_width()});
    factor2.emplace(spec.angle_dtype, std::vector<int64_t>{T, rope.factor_width()});
  }
  for (int kind = 0; kind < 2; ++kind) {
    if (!(kind == 0 ? spec.q_weight : spec.k_weight)) continue;
    std::vector<double> w = random_values(rng, size_t(rope.weight_width(kind == 1)), DType::kFloat64, 0.5);
    for (double& value : w) {
      value += spec.weight_mean;
      value = spec.weight_dtype == DType::kBFloat16  ? ref::round_bf16(value)
              : spec.weight_dtype == DType::kFloat32 ? double(float(value))
                                                     : value;
    }
    (kind == 0 ? tensors.q_weight : tensors.k_weight) = w;
    (kind == 0 ? q_weight : k_weight)
        .emplace(spec.weight_dtype, std::vector<int64_t>{rope.weight_width(kind == 1)});
  }
  if (rope.normalize_v) {
    const int64_t Dv = spec.v_dim > 0 ? spec.v_dim : D, H = rope.k_heads();
    spec.v_dim = Dv;
    v = random_values(rng, size_t(T * H * Dv), spec.qk_dtype, spec.qk_scale);
    v_tensor.emplace(spec.qk_dtype, std::vector<int64_t>{T, H, Dv},
                     std::vector<int64_t>{H * Dv + spec.v_row_pad, Dv, 1});
  }
  refresh();
}

void RopeData::refresh() {
  qk_tensor->set(qk);
  if (factor1) factor1->set(tensors.factor1);
  if (factor2) factor2->set(tensors.factor2);
  if (cos_sin) cos_sin->set(tensors.cos_sin);
  if (positions) positions->set_ints(tensors.positions);
  if (q_weight) q_weight->set(tensors.q_weight);
  if (k_weight) k_weight->set(tensors.k_weight);
  if (v_tensor) v_tensor->set(v);
}

RopeLayout tables_layout(int64_t heads, int64_t rotary_dim, bool paired, bool key_offset,
                         const TensorView& factor1, const TensorView& factor2) {
  RopeLayout layout;
  layout.num_heads = heads;
  layout.rotary_dim = rotary_dim;
  layout.paired = paired;
  layout.key_offset = key_offset;
  layout.factor1 = factor1;
  layout.factor2 = factor2;
  return layout;
}

RopeLayout RopeData::layout() {
  RopeLayout layout;
  layout.num_heads = rope.heads;
  layout.num_kv_heads = rope.kv_heads;
  layout.rotary_dim = rope.rotary_dim;
  layout.rotary_style = rope.neox ? RotaryStyle::kNeox : RotaryStyle::kInterleaved;
  layout.normalize = rope.normalize;
  layout.eps = float(rope.eps);
  layout.weight_offset = float(rope.weight_offset);
  layout.paired = rope.paired;
  layout.key_offset = rope.key_offset;
  layout.normalize_v = rope.normalize_v;
  layout.norm_scope = rope.token_norm ? NormScope::kToken : NormScope::kHead;
  layout.query_only = rope.query_only;
  if (factor1) layout.factor1 = factor1->view();
  if (factor2) layout.factor2 = factor2->view();
  if (cos_sin) layout.cos_sin = cos_sin->view();
  if (positions) layout.positions = positions->view();
  if (q_weight) layout.q_weight = q_weight->view();
  if (k_weight) layout.k_weight = k_weight->view();
  return layout;
}

::testing::AssertionResult throws_error(const std::function<void()>& call,
                                        const std::vector<std::string>& parts) {
  try {
    call();
  } catch (const Error& error) {
    const std::string message = error.what();
    for (const std::string& part : parts) {
      if (message.find(part) == std::string::npos) {
        return ::testing::AssertionFailure() << "the message lacks \"" << part << "\": " << message;
      }
    }
    return ::testing::AssertionSuccess() << message;
  } catch (const std::exception& other) {
    return ::testing::AssertionFailure() << "threw a non-qkvfuse exception: " << other.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

}  // namespace qkvfuse::test
