// reference.hpp: the fused QKV GEMM's norm + rotary written as plainly as possible, for its tests:
// SPEC.md sections 1 and 8 (GQA, NeoX, lanes >= r passed through) on the bf16 pre-norm rows, in
// fp32 with the row sum in index order (the CPU backend's order, src/cpu/qk_norm_rope.cpp: the two
// agree bit for bit, which epilogue_host_test checks). Plain C++, host only.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "qkvfuse/numeric.hpp"

namespace qkvfuse::fused_test {

/// The geometry of one fused QKV problem.
struct QkvShape {
  int64_t tokens = 0;    ///< T
  int64_t q_heads = 0;   ///< Hq
  int64_t kv_heads = 0;  ///< Hkv
  int64_t head_dim = 0;  ///< D
  int64_t v_dim = 0;     ///< Dv
  bool paired = false;
  bool key_offset = false;
  bool neox = false;
  int64_t rotary_dim = 0;  ///< r: lanes >= r pass through (keys' shift under key offset); the
                           ///< fused GEMM takes r < D only with key offset, NeoX r = D only
  float eps = kRmsNormEps;

  int64_t qk_cols() const { return (q_heads + kv_heads) * head_dim; }
  int64_t n() const { return qk_cols() + kv_heads * v_dim; }
  int64_t out_tokens() const { return paired ? 2 * tokens : tokens; }
  int64_t factor_width() const { return paired ? 2 * head_dim : head_dim; }
};

/// A plain problem (interleaved, r = D, no pairing or key offset) of the given sizes.
inline QkvShape make_shape(int64_t tokens, int64_t hq, int64_t hkv, int64_t d, int64_t dv) {
  QkvShape s;
  s.tokens = tokens;
  s.q_heads = hq;
  s.kv_heads = hkv;
  s.head_dim = d;
  s.v_dim = dv;
  s.rotary_dim = d;
  return s;
}

/// q [T_out, Hq_out, D] and k [T_out, Hkv_out, D] (contiguous, bf16 bits) from the pre-norm rows
/// x (bf16 bits, row t at x + t * x_stride, columns [Q heads | K heads]) and the factor tables
/// (fp32 values, [T, factor_width]).
inline void reference_qk(const QkvShape& s, const uint16_t* x, int64_t x_stride, const float* f1,
                         const float* f2, std::vector<uint16_t>& q, std::vector<uint16_t>& k) {
  const int64_t D = s.head_dim;
  const int64_t fw = s.factor_width();
  // [T, H, D] or, paired, [2T, H/2, D]: T*H*D elements either way.
  q.assign(size_t(s.tokens * s.q_heads * D), 0);
  k.assign(size_t(s.tokens * s.kv_heads * D), 0);
  std::vector<float> n(static_cast<size_t>(D)), previous(static_cast<size_t>(D));
  auto normalize = [&](int64_t t, int64_t h2, std::vector<float>& out) {
    float sum = 0.0f;
    for (int64_t d = 0; d < D; ++d) {
      out[size_t(d)] = bf16_to_float(x[t * x_stride + h2 * D + d]);
      sum += out[size_t(d)] * out[size_t(d)];
    }
    const float rstd = 1.0f / std::sqrt(sum / float(D) + s.eps);
    for (int64_t d = 0; d < D; ++d) out[size_t(d)] *= rstd;
  };
  auto partner = [&](int64_t d) {
    if (!s.neox) return d ^ 1;
    return d < D / 2 ? d + D / 2 : d - D / 2;
  };
  for (int64_t t = 0; t < s.tokens; ++t) {
    for (int64_t h2 = 0; h2 < s.q_heads + s.kv_heads; ++h2) {
      const bool is_key = h2 >= s.q_heads;
      const int64_t h = is_key ? h2 - s.q_heads : h2;
      const int64_t heads = is_key ? s.kv_heads : s.q_heads;
      int64_t token = t, head = h, off = 0, out_heads = heads;
      if (s.paired) {
        token = 2 * t + h / (heads / 2);
        head = h % (heads / 2);
        off = (h % 2) * D;
        out_heads = heads / 2;
      }
      normalize(t, h2, n);
      const bool shifted = s.key_offset && is_key && t > 0;
      if (shifted) normalize(t - 1, h2, previous);
      uint16_t* y = (is_key ? k : q).data() + (token * out_heads + head) * D;
      for (int64_t d = 0; d < D; ++d) {
        float value = n[size_t(d)];  // lanes >= r pass through; the tables are not read there
        if (d < s.rotary_dim) {
          value = f1[t * fw + off + d] * n[size_t(d)] + f2[t * fw + off + d] * n[size_t(partner(d))];
        }
        if (shifted && d >= s.rotary_dim) value = previous[size_t(d)];
        y[d] = float_to_bf16(value);
      }
    }
  }
}

/// Distance between two bf16 values in units in the last place (0 for equal bits; NaN vs
/// anything else counts as far).
inline int64_t bf16_ulps(uint16_t a, uint16_t b) {
  auto is_nan = [](uint16_t v) { return (v & 0x7fffu) > 0x7f80u; };
  if (is_nan(a) || is_nan(b)) return (is_nan(a) && is_nan(b)) ? 0 : (int64_t(1) << 20);
  // Map sign-magnitude to a monotonic integer line (+0 and -0 both to 0).
  auto line = [](uint16_t v) { return (v & 0x8000u) ? -int64_t(v & 0x7fffu) : int64_t(v); };
  const int64_t d = line(a) - line(b);
  return d < 0 ? -d : d;
}

/// Below this absolute difference a q or k element is explained by cancellation, not an error.
/// Normalized rows have unit RMS and |f1|, |f2| <= 1, so the two products of y = f1*n + f2*n'
/// are of order 1; where they cancel, y is tiny and an fp32 rounding difference upstream (the
/// row sum's order changes rstd by an ulp: 2^-24 relative) moves it by about 2^-24, which can be
/// many bf16 ulps of a tiny y. 2^-14 is far above that and far below one bf16 ulp at unit scale
/// (2^-8), so a wrong element (a wrong factor, partner, row or head) cannot hide under it.
inline constexpr double kCancellationSlack = 0x1p-14;

/// Counts of an element-wise comparison in bf16 ulps.
struct UlpStats {
  int64_t count = 0;
  int64_t exact = 0;
  int64_t within1 = 0;
  int64_t cancelled = 0;   ///< beyond 1 ulp but |diff| <= kCancellationSlack
  int64_t max_ulps = 0;
  double max_abs = 0.0;
  double max_abs_beyond1 = 0.0;  ///< the largest |diff| among the elements beyond 1 ulp
  int64_t first_bad = -1;  ///< first index beyond 1 ulp and beyond the slack
  int64_t worst = -1;      ///< first index at max_ulps (when max_ulps > 0), and its two values:
  uint16_t worst_got = 0;  ///< a large max_ulps with both values near zero is a cancellation
  uint16_t worst_want = 0; ///< (a sign flip at +-2^-24 counts 2 x 0x3380 = 26368 ulps)

  void add(int64_t index, uint16_t got, uint16_t want) {
    const int64_t u = bf16_ulps(got, want);
    const double diff = std::fabs(double(bf16_to_float(got)) - double(bf16_to_float(want)));
    ++count;
    exact += u == 0;
    within1 += u <= 1;
    if (u > 1 && diff <= kCancellationSlack) ++cancelled;
    if (u > 1 && !(diff <= max_abs_beyond1)) max_abs_beyond1 = std::isnan(diff) ? INFINITY : diff;
    if (u > max_ulps) {
      max_ulps = u;
      worst = index;
      worst_got = got;
      worst_want = want;
    }
    if (u > 1 && !(diff <= kCancellationSlack) && first_bad < 0) first_bad = index;
    if (diff > max_abs || std::isnan(diff)) max_abs = std::isnan(diff) ? INFINITY : diff;
  }
  /// Adds another comparison's counts (e.g. k's to q's); the worst element is the other's when it
  /// is further apart (its index then refers to the other's elements).
  void merge(const UlpStats& o) {
    count += o.count;
    exact += o.exact;
    within1 += o.within1;
    cancelled += o.cancelled;
    if (!(o.max_abs <= max_abs)) max_abs = o.max_abs;
    if (!(o.max_abs_beyond1 <= max_abs_beyond1)) max_abs_beyond1 = o.max_abs_beyond1;
    if (first_bad < 0) first_bad = o.first_bad;
    if (o.max_ulps > max_ulps) {
      max_ulps = o.max_ulps;
      worst = o.worst;
      worst_got = o.worst_got;
      worst_want = o.worst_want;
    }
  }
  /// Elements more than 1 ulp apart, and those of them that are not cancellations.
  int64_t beyond1() const { return count - within1; }
  int64_t beyond_slack() const { return count - within1 - cancelled; }
  /// Every element within 1 ulp, or off by a cancellation (see kCancellationSlack).
  bool all_explained() const { return within1 + cancelled == count; }
  double exact_fraction() const { return count ? double(exact) / double(count) : 1.0; }
  double within1_fraction() const { return count ? double(within1) / double(count) : 1.0; }
};

}  // namespace qkvfuse::fused_test
