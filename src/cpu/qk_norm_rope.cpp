// cpu/qk_norm_rope.cpp: the CPU reference of the QK RMS-norm + interleaved rotary, forward and
// backward (SPEC.md sections 1 and 2).
//
// Per input row x = qk[t, h2, :] (fp32 math for bf16/fp32 storage, fp64 for fp64 storage):
//   rstd = 1 / sqrt(sum(x*x) / D + eps),  n = x * rstd
//   forward:  y[d]  = f1[d + off] * n[d] + f2[d + off] * n[d ^ 1]
//             key offset (keys, t > 0, d >= rotary_dim): y[d] = n_prev[d] (row t-1, same head)
//   backward: dn[d] = f1[d + off] * g[d] + f2[(d ^ 1) + off] * g[d ^ 1]
//             key offset (keys, d >= rotary_dim): dn[d] = g_next[d] + (t == 0 ? g[d] : 0)
//             dx    = rstd * (dn - n * (sum(dn * n) / D))
// where g is the gradient at the output position the row was written to, and the placement
// (output token, output head, factor offset off) follows the layout: plain, or paired
// (token 2t + h / (H/2), head h mod (H/2), off = (h mod 2) * D).
//
// Work is split over tokens: every output row of token t (paired: output tokens 2t and 2t+1) is
// written by the thread that owns t, and each row's sums run in index order, so the results are
// the same for any thread count.
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "backend.hpp"
#include "cpu/parallel.hpp"
#include "qkvfuse/error.hpp"
#include "qkvfuse/numeric.hpp"

namespace qkvfuse::cpu {
namespace {

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

// ---- geometry ----------------------------------------------------------------------------------

/// Where the row of input head h2 at token t goes, and which factor columns it reads.
struct Placement {
  int64_t token;
  int64_t head;
  int64_t factor_offset;
  bool is_key;
};

Placement place(const RopeLayout& layout, int64_t head_dim, int64_t t, int64_t h2) {
  const int64_t heads = layout.num_heads;
  const int64_t h = h2 % heads;
  if (layout.paired) {
    const int64_t half = heads / 2;
    return {2 * t + h / half, h % half, (h % 2) * head_dim, h2 >= heads};
  }
  return {t, h, 0, h2 >= heads};
}

/// n = x * rstd for one row; returns rstd. The sum runs in index order (deterministic).
template <typename Compute, typename Storage>
Compute normalize_row(const Storage* x, int64_t head_dim, Compute* n) {
  Compute sum = 0;
  for (int64_t d = 0; d < head_dim; ++d) {
    n[d] = load<Compute>(x, d);
    sum += n[d] * n[d];
  }
  const Compute rstd = Compute(1) / std::sqrt(sum / Compute(head_dim) + Compute(kRmsNormEps));
  for (int64_t d = 0; d < head_dim; ++d) n[d] *= rstd;
  return rstd;
}

/// The factor columns a row of token t placed at `at` reads (paired rows: their half of the row).
template <typename FactorT>
const FactorT* factor_row(const TensorView& factor, int64_t t, const Placement& at) {
  return factor.ptr<const FactorT>() + t * factor.strides[0] + at.factor_offset;
}

// ---- forward -----------------------------------------------------------------------------------

template <typename QkT, typename FactorT>
void forward(const QkNormRopeParams& p) {
  using Compute = std::conditional_t<std::is_same_v<QkT, double>, double, float>;
  const RopeLayout& layout = p.layout;
  const int64_t tokens = p.qk.sizes[0];
  const int64_t heads2 = p.qk.sizes[1];
  const int64_t head_dim = p.qk.sizes[2];

  parallel_for(tokens, 4, [&](int64_t begin, int64_t end) {
    const size_t width = size_t(head_dim);
    std::vector<Compute> n(width), previous(width);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h2 = 0; h2 < heads2; ++h2) {
        normalize_row(row_of<const QkT>(p.qk, t, h2), head_dim, n.data());
        const Placement at = place(layout, head_dim, t, h2);
        const FactorT* f1 = factor_row<FactorT>(p.factor1, t, at);
        const FactorT* f2 = factor_row<FactorT>(p.factor2, t, at);
        const bool shifted = layout.key_offset && at.is_key && t > 0;
        if (shifted) normalize_row(row_of<const QkT>(p.qk, t - 1, h2), head_dim, previous.data());

        QkT* y = row_of<QkT>(at.is_key ? p.k : p.q, at.token, at.head);
        for (int64_t d = 0; d < head_dim; ++d) {
          Compute value = load<Compute>(f1, d) * n[d] + load<Compute>(f2, d) * n[d ^ 1];
          if (shifted && d >= layout.rotary_dim) value = previous[d];
          store(y, d, value);
        }
      }
    }
  });
}

// ---- backward ----------------------------------------------------------------------------------

template <typename QkT, typename FactorT>
void backward(const QkNormRopeBackwardParams& p) {
  using Compute = std::conditional_t<std::is_same_v<QkT, double>, double, float>;
  const RopeLayout& layout = p.layout;
  const int64_t tokens = p.qk.sizes[0];
  const int64_t heads2 = p.qk.sizes[1];
  const int64_t head_dim = p.qk.sizes[2];

  parallel_for(tokens, 4, [&](int64_t begin, int64_t end) {
    const size_t width = size_t(head_dim);
    std::vector<Compute> n(width), dn(width);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h2 = 0; h2 < heads2; ++h2) {
        const Compute rstd = normalize_row(row_of<const QkT>(p.qk, t, h2), head_dim, n.data());
        const Placement at = place(layout, head_dim, t, h2);
        const TensorView& grad = at.is_key ? p.grad_k : p.grad_q;
        const QkT* g = row_of<const QkT>(grad, at.token, at.head);
        const FactorT* f1 = factor_row<FactorT>(p.factor1, t, at);
        const FactorT* f2 = factor_row<FactorT>(p.factor2, t, at);
        for (int64_t d = 0; d < head_dim; ++d) {
          dn[d] = load<Compute>(f1, d) * load<Compute>(g, d) +
                  load<Compute>(f2, d ^ 1) * load<Compute>(g, d ^ 1);
        }
        if (layout.key_offset && at.is_key) {
          // Row t's stationary dims were read by token t+1 (and by token 0 itself).
          const QkT* g_next = t + 1 < tokens ? row_of<const QkT>(grad, t + 1, at.head) : nullptr;
          for (int64_t d = layout.rotary_dim; d < head_dim; ++d) {
            const Compute from_next = g_next ? load<Compute>(g_next, d) : Compute(0);
            dn[d] = from_next + (t == 0 ? load<Compute>(g, d) : Compute(0));
          }
        }
        Compute dot = 0;
        for (int64_t d = 0; d < head_dim; ++d) dot += dn[d] * n[d];
        const Compute correction = dot / Compute(head_dim);
        QkT* dx = row_of<QkT>(p.grad_qk, t, h2);
        for (int64_t d = 0; d < head_dim; ++d) store(dx, d, rstd * (dn[d] - n[d] * correction));
      }
    }
  });
}

}  // namespace

void qk_norm_rope(const QkNormRopeParams& params) {
  visit_storage(params.qk.dtype, [&](auto qk_tag) {
    visit_storage(params.factor1.dtype, [&](auto factor_tag) {
      forward<decltype(qk_tag), decltype(factor_tag)>(params);
    });
  });
}

void qk_norm_rope_backward(const QkNormRopeBackwardParams& params) {
  visit_storage(params.qk.dtype, [&](auto qk_tag) {
    visit_storage(params.factor1.dtype, [&](auto factor_tag) {
      backward<decltype(qk_tag), decltype(factor_tag)>(params);
    });
  });
}

}  // namespace qkvfuse::cpu
