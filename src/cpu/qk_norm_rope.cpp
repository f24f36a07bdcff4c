// cpu/qk_norm_rope.cpp: the CPU reference of QK-norm + rotary, forward and backward (SPEC.md
// sections 1, 2 and 8).
//
// Per input row x = qk[t, h2, :] (fp32 math for bf16/fp32 storage, fp64 for fp64 storage), with
// the placement, partner p(d), frequency and sign of rope_math.hpp:
//   n     = x * rstd, rstd = 1 / sqrt(sum(x*x) / D + eps)          (normalize = false: n = x)
//   nw    = n * w_eff, w_eff = w + weight_offset                   (the row's weight, if any)
//   (f1, f2)[d] = the factor tables at column d + off, or (cos_i, -+sin_i) of the cache row
//                 positions[t] (minus for the first lane of a pair); NaN for a position outside
//                 [0, P)
//   forward:  y[d] = f1[d] * nw[d] + f2[d] * nw[p(d)]              (d < r)
//             y[d] = nw[d]                                         (d >= r)
//             key offset (keys, t > 0, d >= r): y[d] = nw_prev[d] (row t-1, same head)
//   backward: g = the gradient at the output position the row was written to
//             gw[d] = f1[d] * g[d] + f2[p(d)] * g[p(d)]           (d < r)
//             gw[d] = g[d]                                         (d >= r)
//             key offset (keys, d >= r): gw[d] = g_next[d] + (t == 0 ? g[d] : 0)
//             grad_w[d] += gw[d] * n[d];  dn[d] = gw[d] * w_eff[d]  (with a weight; else dn = gw)
//             dx = rstd * (dn - n * (sum(dn * n) / D))             (normalize = false: dx = dn)
//
// Work is split over tokens: every output row of token t (paired: output tokens 2t and 2t+1) is
// written by the thread that owns t, and each row's sums run in index order. The weight
// gradients are summed per block of kTokensPerSum tokens in token order, then the blocks in
// order, so every result is the same for any thread count.
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

// ---- the per-row rules -------------------------------------------------------------------------

/// What one row's math reads besides the row: the layout resolved, the angles of its token, its
/// weight.
template <typename Compute>
class Rules {
 public:
  explicit Rules(const RopeLayout& layout, int64_t head_dim)
      : layout_(layout), dims_(rope::dims_of(layout, head_dim)),
        f1_(size_t(head_dim)), f2_(size_t(head_dim)),
        w_q_(weights(layout.q_weight)), w_k_(weights(layout.k_weight)) {}

  const rope::Dims& dims() const { return dims_; }
  int64_t width() const { return dims_.head_dim; }
  int64_t rotary() const { return dims_.rotary_dim; }

  /// Loads (f1, f2) of token t for rows placed at `at` (lanes d < r).
  void load_angles(int64_t t, const rope::Place& at) {
    const int r = dims_.rotary_dim;
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

  /// n (unweighted) of a row; returns rstd (1 without the norm).
  template <typename Storage>
  Compute normalize(const Storage* x, Compute* n) const {
    const int64_t D = dims_.head_dim;
    for (int64_t d = 0; d < D; ++d) n[d] = load<Compute>(x, d);
    if (!layout_.normalize) return Compute(1);
    Compute sum = 0;
    for (int64_t d = 0; d < D; ++d) sum += n[d] * n[d];
    const Compute rstd = Compute(1) / std::sqrt(sum / Compute(D) + Compute(layout_.eps));
    for (int64_t d = 0; d < D; ++d) n[d] *= rstd;
    return rstd;
  }

  /// The row's weight (w + offset per lane), or nullptr without one.
  const Compute* weight(bool is_key) const {
    const std::vector<Compute>& w = is_key ? w_k_ : w_q_;
    return w.empty() ? nullptr : w.data();
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
  std::vector<Compute> f1_;
  std::vector<Compute> f2_;
  std::vector<Compute> w_q_;
  std::vector<Compute> w_k_;
};

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
    const size_t width = size_t(D);
    std::vector<Compute> n(width), nw(width), previous(width);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h2 = 0; h2 < heads2; ++h2) {
        const rope::Place at = rope::place(rules.dims(), t, int(h2));
        rules.load_angles(t, at);
        const Compute* w = rules.weight(at.is_key);
        rules.normalize(row_of<const QkT>(p.qk, t, h2), n.data());
        rules.apply_weight(w, n.data(), nw.data());
        const bool shifted = layout.key_offset && at.is_key && t > 0;
        if (shifted) {
          rules.normalize(row_of<const QkT>(p.qk, t - 1, h2), n.data());
          rules.apply_weight(w, n.data(), previous.data());
        }
        QkT* y = row_of<QkT>(at.is_key ? p.k : p.q, at.token, at.head);
        for (int64_t d = 0; d < D; ++d) {
          Compute value = d < r ? rules.rotate(nw.data(), int(d)) : nw[d];
          if (shifted && d >= r) value = previous[d];
          store(y, d, value);
        }
      }
    }
  });
}

// ---- backward ----------------------------------------------------------------------------------

/// Gradient sums of one block of tokens (or the total): [2][D], Q weight then K weight.
template <typename Compute>
using WeightSums = std::vector<Compute>;

template <typename QkT>
void backward(const QkNormRopeBackwardParams& p) {
  using Compute = std::conditional_t<std::is_same_v<QkT, double>, double, float>;
  const RopeLayout& layout = p.layout;
  const int64_t tokens = p.qk.sizes[0];
  const int64_t heads2 = p.qk.sizes[1];
  const int64_t D = p.qk.sizes[2];
  const int64_t blocks = (tokens + kTokensPerSum - 1) / kTokensPerSum;
  std::vector<WeightSums<Compute>> block_sums(size_t(blocks), WeightSums<Compute>(size_t(2 * D)));

  parallel_for(blocks, 1, [&](int64_t first_block, int64_t last_block) {
    Rules<Compute> rules(layout, D);
    const int64_t r = rules.rotary();
    const size_t width = size_t(D);
    std::vector<Compute> n(width), dn(width);
    for (int64_t block = first_block; block < last_block; ++block) {
      Compute* sums = block_sums[size_t(block)].data();
      const int64_t end = std::min(tokens, (block + 1) * kTokensPerSum);
      for (int64_t t = block * kTokensPerSum; t < end; ++t) {
        for (int64_t h2 = 0; h2 < heads2; ++h2) {
          const rope::Place at = rope::place(rules.dims(), t, int(h2));
          rules.load_angles(t, at);
          const Compute* w = rules.weight(at.is_key);
          const Compute rstd = rules.normalize(row_of<const QkT>(p.qk, t, h2), n.data());
          const TensorView& grad = at.is_key ? p.grad_k : p.grad_q;
          const QkT* g = row_of<const QkT>(grad, at.token, at.head);
          for (int64_t d = 0; d < D; ++d) {
            dn[d] = d < r ? rules.rotate_back(g, int(d)) : load<Compute>(g, d);
          }
          if (layout.key_offset && at.is_key) {
            // Row t's lanes >= r were read by token t+1 (and by token 0 itself).
            const QkT* g_next = t + 1 < tokens ? row_of<const QkT>(grad, t + 1, at.head) : nullptr;
            for (int64_t d = r; d < D; ++d) {
              const Compute from_next = g_next ? load<Compute>(g_next, d) : Compute(0);
              dn[d] = from_next + (t == 0 ? load<Compute>(g, d) : Compute(0));
            }
          }
          if (w != nullptr) {
            Compute* sum = sums + (at.is_key ? D : 0);
            for (int64_t d = 0; d < D; ++d) {
              sum[d] += dn[d] * n[d];
              dn[d] *= w[d];
            }
          }
          QkT* dx = row_of<QkT>(p.grad_qk, t, h2);
          if (!layout.normalize) {
            for (int64_t d = 0; d < D; ++d) store(dx, d, dn[d]);
            continue;
          }
          Compute dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += dn[d] * n[d];
          const Compute correction = dot / Compute(D);
          for (int64_t d = 0; d < D; ++d) store(dx, d, rstd * (dn[d] - n[d] * correction));
        }
      }
    }
  });

  for (int kind = 0; kind < 2; ++kind) {
    const TensorView& out = kind == 0 ? p.grad_q_weight : p.grad_k_weight;
    if (is_absent(out)) continue;
    for (int64_t d = 0; d < D; ++d) {
      Compute total = 0;
      for (const WeightSums<Compute>& sums : block_sums) total += sums[size_t(kind * D + d)];
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
