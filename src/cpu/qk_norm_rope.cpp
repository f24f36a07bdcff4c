// cpu/qk_norm_rope.cpp: the CPU reference of QK-norm + rotary, forward and backward (SPEC.md
// sections 1, 2, 8 and 9).
//
// Per input row x = qk[t, h2, :] (fp32 math for bf16/fp32 storage, fp64 for fp64 storage), with
// the placement, partner p(d), frequency and sign of rope_math.hpp:
//   rstd  = 1 / sqrt(sum(x*x) / D + eps)                           (norm_scope kHead)
//         = 1 / sqrt(sum over the token's rows of the kind / (H*D) + eps)   (kToken)
//   n     = x * rstd                                               (normalize = false: n = x)
//   nw    = n * w_eff, w_eff = w + weight_offset                   (the row's weight, if any:
//                                                                   [D], or lanes h*D.. of [H*D])
//   (f1, f2)[d] = the factor tables at column d + off, or (cos_i, -+sin_i) of the cache row
//                 positions[t] (minus for the first lane of a pair); NaN for a position outside
//                 [0, P); no angle source: r = 0
//   forward:  y[d] = f1[d] * nw[d] + f2[d] * nw[p(d)]              (d < r)
//             y[d] = nw[d]                                         (d >= r)
//             key offset (keys, t > 0, d >= r): y[d] = nw_prev[d] (row t-1, same head)
//   backward: g = the gradient at the output position the row was written to
//             gw[d] = f1[d] * g[d] + f2[p(d)] * g[p(d)]           (d < r)
//             gw[d] = g[d]                                         (d >= r)
//             key offset (keys, d >= r): gw[d] = g_next[d] + (t == 0 ? g[d] : 0)
//             grad_w[wi] += gw[d] * n[d];  dn[d] = gw[d] * w_eff[wi]  (with a weight; else dn = gw)
//             dx = rstd * (dn - n * dot / count)                   (normalize = false: dx = dn)
//             dot, count = sum(dn * n) and D over the row (kHead), over the token's rows of the
//             kind and H*D (kToken)
//   V norm (normalize_v), per V row of width Dv: v_out = v * rstd_v;
//             grad_v = rstd_v * (g - v_out * sum(g * v_out) / Dv)
//
// Work is split over tokens: every output row of token t (paired: output tokens 2t and 2t+1) is
// written by the thread that owns t, and each row's sums run in index order (a token's sums in
// row order, then index order). The weight gradients are summed per block of kTokensPerSum
// tokens in token order, then the blocks in order, so every result is the same for any thread
// count.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "backend.hpp"
#include "cpu/parallel.hpp"
#include "qkvfuse/error.hpp"
#include "qkvfuse/numeric.hpp"
#include "rope_math.hpp"

namespace qkvfuse::cpu {
namespace {

constexpr int64_t kTokensPerSum = 64;

// ---- element access ----------------------------------------------------------------------------
// Storage types: uint16_t holds bf16 bits; float and double hold themselves.

template <typename Compute, typename Storage>
Compute load(const Storage* row, int64_t i) {
  if constexpr (std::is_same_v<Storage, uint16_t>) {
    return Compute(bf16_to_float(row[i]));
  } else {
    return Compute(row[i]);
  }
}

template <typename Storage, typename Compute>
void store(Storage* row, int64_t i, Compute value) {
  if constexpr (std::is_same_v<Storage, uint16_t>) {
    row[i] = float_to_bf16(float(value));  // the one rounding to bf16
  } else {
    row[i] = Storage(value);
  }
}

/// Element i of a float view of any storage dtype (tables, weights: small, read per row).
template <typename Compute>
Compute load_any(const TensorView& view, int64_t offset) {
  switch (view.dtype) {
    case DType::kBFloat16: return Compute(bf16_to_float(view.ptr<const uint16_t>()[offset]));
    case DType::kFloat32: return Compute(view.ptr<const float>()[offset]);
    case DType::kFloat64: return Compute(view.ptr<const double>()[offset]);
    default: QKVF_FAIL("cpu qk_norm_rope: unsupported table dtype ", dtype_name(view.dtype));
  }
}

/// Calls f with a value of the storage type of `dtype` (its type selects the instantiation).
template <typename F>
void visit_storage(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kBFloat16: f(uint16_t{}); return;
    case DType::kFloat32: f(float{}); return;
    case DType::kFloat64: f(double{}); return;
    default: QKVF_FAIL("cpu qk_norm_rope: unsupported dtype ", dtype_name(dtype));
  }
}

/// &view[i0][i1][0] of a 3-D view whose last dim is contiguous.
template <typename Storage>
Storage* row_of(const TensorView& view, int64_t i0, int64_t i1) {
  return view.ptr<Storage>() + i0 * view.strides[0] + i1 * view.strides[1];
}

int64_t position_at(const TensorView& positions, int64_t t) {
  const int64_t offset = t * positions.strides[0];
  return positions.dtype == DType::kInt32 ? int64_t(positions.ptr<const int32_t>()[offset])
                                          : positions.ptr<const int64_t>()[offset];
}

/// 1 / sqrt(mean of squares + eps) over `count` rows of width W (the view's last dim) from row
/// (t, first) of a [T, H, W] view: each row's squares summed in index order, then the row sums in
/// row order (a token's thousands of squares in one running sum would lose more bits).
template <typename Compute, typename Storage>
Compute rms_rstd(const TensorView& view, int64_t t, int64_t first, int64_t count, float eps) {
  const int64_t width = view.sizes[2];
  Compute sum = 0;
  for (int64_t h = first; h < first + count; ++h) {
    const Storage* x = row_of<const Storage>(view, t, h);
    Compute row = 0;
    for (int64_t d = 0; d < width; ++d) {
      const Compute value = load<Compute>(x, d);
      row += value * value;
    }
    sum += row;
  }
  return Compute(1) / std::sqrt(sum / Compute(count * width) + Compute(eps));
}

// ---- the per-row rules -------------------------------------------------------------------------

/// What one row's math reads besides the row: the layout resolved, the angles of its token, its
/// weight.
template <typename Compute>
class Rules {
 public:
  explicit Rules(const RopeLayout& layout, int64_t head_dim)
      : layout_(layout), dims_(rope::dims_of(layout, head_dim)),
        token_scope_(layout.norm_scope == NormScope::kToken),
        f1_(size_t(head_dim)), f2_(size_t(head_dim)),
        w_q_(weights(layout.q_weight)), w_k_(weights(layout.k_weight)) {}

  const rope::Dims& dims() const { return dims_; }
  int64_t width() const { return dims_.head_dim; }
  int64_t rotary() const { return dims_.rotary_dim; }
  bool token_scope() const { return token_scope_; }

  /// Loads (f1, f2) of token t for rows placed at `at` (lanes d < r; none without angles).
  void load_angles(int64_t t, const rope::Place& at) {
    const int r = dims_.rotary_dim;
    if (r == 0) return;
    if (!is_absent(layout_.factor1)) {
      const int64_t base = t * layout_.factor1.strides[0] + at.angle_offset;
      const int64_t base2 = t * layout_.factor2.strides[0] + at.angle_offset;
      for (int d = 0; d < r; ++d) {
        f1_[d] = load_any<Compute>(layout_.factor1, base + d);
        f2_[d] = load_any<Compute>(layout_.factor2, base2 + d);
      }
      return;
    }
    const int64_t position = position_at(layout_.positions, t);
    const int64_t rows = layout_.cos_sin.sizes[0];
    const bool inside = position >= 0 && position < rows;
    const int64_t base = inside ? position * layout_.cos_sin.strides[0] : 0;
    for (int d = 0; d < r; ++d) {
      if (!inside) {
        f1_[d] = f2_[d] = std::numeric_limits<Compute>::quiet_NaN();
        continue;
      }
      const int i = rope::frequency(d, r, dims_.neox);
      const Compute sin = load_any<Compute>(layout_.cos_sin, base + r / 2 + i);
      f1_[d] = load_any<Compute>(layout_.cos_sin, base + i);
      f2_[d] = rope::leads_pair(d, r, dims_.neox) ? -sin : sin;
    }
  }

  /// rstd of `count` rows of width D starting at row (t, first) of a [T, H, D] view: kHead's per
  /// row (count 1), kToken's over a token's rows of one kind. 1 without the norm.
  template <typename Storage>
  Compute rstd(const TensorView& view, int64_t t, int64_t first, int64_t count) const {
    if (!layout_.normalize) return Compute(1);
    return rms_rstd<Compute, Storage>(view, t, first, count, layout_.eps);
  }

  /// n = x * rstd (unweighted).
  template <typename Storage>
  void normalize(const Storage* x, Compute rstd, Compute* n) const {
    for (int64_t d = 0; d < dims_.head_dim; ++d) n[d] = load<Compute>(x, d) * rstd;
  }

  /// The weight (w + offset per lane) of logical head h of a kind, or nullptr without one.
  const Compute* weight(bool is_key, int64_t h) const {
    const std::vector<Compute>& w = is_key ? w_k_ : w_q_;
    if (w.empty()) return nullptr;
    return w.data() + (token_scope_ ? h * dims_.head_dim : 0);
  }

  /// nw = n * w_eff.
  void apply_weight(const Compute* w, const Compute* n, Compute* nw) const {
    for (int64_t d = 0; d < dims_.head_dim; ++d) nw[d] = w ? n[d] * w[d] : n[d];
  }

  /// y[d] for d < r: f1 * nw[d] + f2 * nw[p(d)].
  Compute rotate(const Compute* nw, int d) const {
    return f1_[d] * nw[d] + f2_[d] * nw[rope::partner(d, dims_.rotary_dim, dims_.neox)];
  }

  /// gw[d] for d < r: f1[d] * g[d] + f2[p(d)] * g[p(d)].
  template <typename Storage>
  Compute rotate_back(const Storage* g, int d) const {
    const int p = rope::partner(d, dims_.rotary_dim, dims_.neox);
    return f1_[d] * load<Compute>(g, d) + f2_[p] * load<Compute>(g, p);
  }

 private:
  std::vector<Compute> weights(const TensorView& view) const {
    std::vector<Compute> w;
    if (is_absent(view)) return w;
    w.resize(size_t(view.sizes[0]));
    const Compute offset = Compute(layout_.weight_offset);
    for (size_t d = 0; d < w.size(); ++d) {
      const Compute value = load_any<Compute>(view, int64_t(d));
      w[d] = layout_.weight_offset == 0.0f ? value : value + offset;
    }
    return w;
  }

  const RopeLayout& layout_;
  rope::Dims dims_;
  bool token_scope_;
  std::vector<Compute> f1_;
  std::vector<Compute> f2_;
  std::vector<Compute> w_q_;
  std::vector<Compute> w_k_;
};

/// The V norm's rstd of row (t, h) of v [T, Hkv, Dv].
template <typename Compute, typename Storage>
Compute v_rstd(const TensorView& v, int64_t t, int64_t h, float eps) {
  return rms_rstd<Compute, Storage>(v, t, h, 1, eps);
}

// ---- forward -----------------------------------------------------------------------------------

template <typename QkT>
void forward(const QkNormRopeParams& p) {
  using Compute = std::conditional_t<std::is_same_v<QkT, double>, double, float>;
  const RopeLayout& layout = p.layout;
  const int64_t tokens = p.qk.sizes[0];
  const int64_t heads2 = p.qk.sizes[1];
  const int64_t D = p.qk.sizes[2];

  parallel_for(tokens, 4, [&](int64_t begin, int64_t end) {
    Rules<Compute> rules(layout, D);
    const int64_t r = rules.rotary();
    const int64_t q_heads = rules.dims().q_heads;
    const int64_t kv = rules.dims().kv_heads;
    const size_t width = size_t(D);
    std::vector<Compute> n(width), nw(width), previous(width);
    // The rstd of a row: its own (kHead) or its token's kind's (kToken), of token `at`.
    const auto row_rstd = [&](int64_t at, int64_t h2, bool is_key) {
      if (!rules.token_scope()) return rules.template rstd<QkT>(p.qk, at, h2, 1);
      return is_key ? rules.template rstd<QkT>(p.qk, at, q_heads, kv)
                    : rules.template rstd<QkT>(p.qk, at, 0, q_heads);
    };
    for (int64_t t = begin; t < end; ++t) {
      // kToken: each kind's rstd once per token (and the previous token's keys under key offset).
      Compute token_rstd[2] = {1, 1};
      Compute previous_key_rstd = 1;
      if (rules.token_scope()) {
        token_rstd[0] = row_rstd(t, 0, false);
        if (kv > 0) token_rstd[1] = row_rstd(t, q_heads, true);
        if (layout.key_offset && t > 0) previous_key_rstd = row_rstd(t - 1, q_heads, true);
      }
      for (int64_t h2 = 0; h2 < heads2; ++h2) {
        const rope::Place at = rope::place(rules.dims(), t, int(h2));
        rules.load_angles(t, at);
        const Compute* w = rules.weight(at.is_key, at.is_key ? h2 - q_heads : h2);
        const Compute rstd = rules.token_scope() ? token_rstd[at.is_key] : row_rstd(t, h2, false);
        rules.normalize(row_of<const QkT>(p.qk, t, h2), rstd, n.data());
        rules.apply_weight(w, n.data(), nw.data());
        const bool shifted = layout.key_offset && at.is_key && t > 0;
        if (shifted) {
          const Compute rstd_previous =
              rules.token_scope() ? previous_key_rstd : row_rstd(t - 1, h2, true);
          rules.normalize(row_of<const QkT>(p.qk, t - 1, h2), rstd_previous, n.data());
          rules.apply_weight(w, n.data(), previous.data());
        }
        QkT* y = row_of<QkT>(at.is_key ? p.k : p.q, at.token, at.head);
        for (int64_t d = 0; d < D; ++d) {
          Compute value = d < r ? rules.rotate(nw.data(), int(d)) : nw[d];
          if (shifted && d >= r) value = previous[d];
          store(y, d, value);
        }
      }
      if (!layout.normalize_v) continue;
      const int64_t v_dim = p.v.sizes[2];
      for (int64_t h = 0; h < kv; ++h) {
        const Compute rstd = v_rstd<Compute, QkT>(p.v, t, h, layout.eps);
        const QkT* x = row_of<const QkT>(p.v, t, h);
        QkT* y = row_of<QkT>(p.v_out, t, h);
        for (int64_t d = 0; d < v_dim; ++d) store(y, d, load<Compute>(x, d) * rstd);
      }
    }
  });
}

// ---- backward ----------------------------------------------------------------------------------

/// Gradient sums of one block of tokens (or the total): the Q weight's lanes, then the K
/// weight's ([D] each, or [Hq*D] and [Hkv*D] under kToken).
template <typename Compute>
using WeightSums = std::vector<Compute>;

template <typename QkT>
void backward(const QkNormRopeBackwardParams& p) {
  using Compute = std::conditional_t<std::is_same_v<QkT, double>, double, float>;
  const RopeLayout& layout = p.layout;
  const int64_t tokens = p.qk.sizes[0];
  const int64_t heads2 = p.qk.sizes[1];
  const int64_t D = p.qk.sizes[2];
  const bool token_scope = layout.norm_scope == NormScope::kToken;
  const int64_t q_heads = layout.num_heads;
  const int64_t kv = kv_heads(layout);
  // Lanes of each weight's gradient, and where the K weight's start in a block's sums.
  const int64_t q_width = token_scope ? q_heads * D : D;
  const int64_t k_width = token_scope ? kv * D : D;
  const int64_t blocks = (tokens + kTokensPerSum - 1) / kTokensPerSum;
  std::vector<WeightSums<Compute>> block_sums(size_t(blocks),
                                              WeightSums<Compute>(size_t(q_width + k_width)));

  parallel_for(blocks, 1, [&](int64_t first_block, int64_t last_block) {
    Rules<Compute> rules(layout, D);
    const int64_t r = rules.rotary();
    // A token's rows at once: kToken's dot spans all rows of a kind.
    const size_t row_values = size_t(heads2 * D);
    std::vector<Compute> n(row_values), dn(row_values);
    std::vector<Compute> rstds(static_cast<size_t>(heads2));
    for (int64_t block = first_block; block < last_block; ++block) {
      Compute* sums = block_sums[size_t(block)].data();
      const int64_t end = std::min(tokens, (block + 1) * kTokensPerSum);
      for (int64_t t = block * kTokensPerSum; t < end; ++t) {
        Compute token_rstd[2] = {1, 1};
        if (token_scope) {
          token_rstd[0] = rules.template rstd<QkT>(p.qk, t, 0, q_heads);
          if (kv > 0) token_rstd[1] = rules.template rstd<QkT>(p.qk, t, q_heads, kv);
        }
        // Pass 1, per row: n, the gradient dn of n, and the weight sums.
        for (int64_t h2 = 0; h2 < heads2; ++h2) {
          const rope::Place at = rope::place(rules.dims(), t, int(h2));
          const int64_t h = at.is_key ? h2 - q_heads : h2;
          rules.load_angles(t, at);
          const Compute* w = rules.weight(at.is_key, h);
          Compute* nr = n.data() + h2 * D;
          Compute* dnr = dn.data() + h2 * D;
          rstds[size_t(h2)] = token_scope ? token_rstd[at.is_key]
                                          : rules.template rstd<QkT>(p.qk, t, h2, 1);
          rules.normalize(row_of<const QkT>(p.qk, t, h2), rstds[size_t(h2)], nr);
          const TensorView& grad = at.is_key ? p.grad_k : p.grad_q;
          const QkT* g = row_of<const QkT>(grad, at.token, at.head);
          for (int64_t d = 0; d < D; ++d) {
            dnr[d] = d < r ? rules.rotate_back(g, int(d)) : load<Compute>(g, d);
          }
          if (layout.key_offset && at.is_key) {
            // Row t's lanes >= r were read by token t+1 (and by token 0 itself).
            const QkT* g_next = t + 1 < tokens ? row_of<const QkT>(grad, t + 1, at.head) : nullptr;
            for (int64_t d = r; d < D; ++d) {
              const Compute from_next = g_next ? load<Compute>(g_next, d) : Compute(0);
              dnr[d] = from_next + (t == 0 ? load<Compute>(g, d) : Compute(0));
            }
          }
          if (w != nullptr) {
            Compute* sum = sums + (at.is_key ? q_width : 0) + (token_scope ? h * D : 0);
            for (int64_t d = 0; d < D; ++d) {
              sum[d] += dnr[d] * nr[d];
              dnr[d] *= w[d];
            }
          }
        }
        // Pass 2, per row: dx through the norm, with the row's or the token's kind's dot.
        Compute token_dot[2] = {0, 0};
        if (token_scope && layout.normalize) {
          for (int64_t h2 = 0; h2 < heads2; ++h2) {
            Compute& dot = token_dot[h2 >= q_heads];
            for (int64_t d = 0; d < D; ++d) dot += dn[size_t(h2 * D + d)] * n[size_t(h2 * D + d)];
          }
        }
        for (int64_t h2 = 0; h2 < heads2; ++h2) {
          const Compute* nr = n.data() + h2 * D;
          const Compute* dnr = dn.data() + h2 * D;
          QkT* dx = row_of<QkT>(p.grad_qk, t, h2);
          if (!layout.normalize) {
            for (int64_t d = 0; d < D; ++d) store(dx, d, dnr[d]);
            continue;
          }
          const bool is_key = h2 >= q_heads;
          Compute correction = 0;
          if (token_scope) {
            correction = token_dot[is_key] / Compute((is_key ? kv : q_heads) * D);
          } else {
            Compute dot = 0;
            for (int64_t d = 0; d < D; ++d) dot += dnr[d] * nr[d];
            correction = dot / Compute(D);
          }
          const Compute rstd = rstds[size_t(h2)];
          for (int64_t d = 0; d < D; ++d) store(dx, d, rstd * (dnr[d] - nr[d] * correction));
        }
        if (!layout.normalize_v) continue;
        const int64_t v_dim = p.v.sizes[2];
        for (int64_t h = 0; h < kv; ++h) {
          const Compute rstd = v_rstd<Compute, QkT>(p.v, t, h, layout.eps);
          const QkT* x = row_of<const QkT>(p.v, t, h);
          const QkT* g = row_of<const QkT>(p.grad_v_out, t, h);
          // n_v = v * rstd (v_out unrounded), then the norm's gradient as for Q and K rows.
          Compute dot = 0;
          for (int64_t d = 0; d < v_dim; ++d) {
            dot += load<Compute>(g, d) * (load<Compute>(x, d) * rstd);
          }
          const Compute correction = dot / Compute(v_dim);
          QkT* dv = row_of<QkT>(p.grad_v, t, h);
          for (int64_t d = 0; d < v_dim; ++d) {
            const Compute nv = load<Compute>(x, d) * rstd;
            store(dv, d, rstd * (load<Compute>(g, d) - nv * correction));
          }
        }
      }
    }
  });

  for (int kind = 0; kind < 2; ++kind) {
    const TensorView& out = kind == 0 ? p.grad_q_weight : p.grad_k_weight;
    if (is_absent(out)) continue;
    const int64_t first = kind == 0 ? 0 : q_width;
    const int64_t lanes = kind == 0 ? q_width : k_width;
    for (int64_t d = 0; d < lanes; ++d) {
      Compute total = 0;
      for (const WeightSums<Compute>& sums : block_sums) total += sums[size_t(first + d)];
      switch (out.dtype) {
        case DType::kBFloat16: out.ptr<uint16_t>()[d] = float_to_bf16(float(total)); break;
        case DType::kFloat32: out.ptr<float>()[d] = float(total); break;
        case DType::kFloat64: out.ptr<double>()[d] = double(total); break;
        default: QKVF_FAIL("cpu qk_norm_rope_backward: unsupported weight dtype");
      }
    }
  }
}

}  // namespace

BadPosition find_bad_position(const TensorView& positions, int64_t num_positions) {
  for (int64_t t = 0; t < positions.sizes[0]; ++t) {
    const int64_t position = position_at(positions, t);
    if (position < 0 || position >= num_positions) return {t, position};
  }
  return {};
}

void qk_norm_rope(const QkNormRopeParams& params) {
  visit_storage(params.qk.dtype, [&](auto qk_tag) { forward<decltype(qk_tag)>(params); });
}

void qk_norm_rope_backward(const QkNormRopeBackwardParams& params) {
  visit_storage(params.qk.dtype, [&](auto qk_tag) { backward<decltype(qk_tag)>(params); });
}

}  // namespace qkvfuse::cpu
