// rope_paths.hpp: which instantiation of the rope kernels serves a call on CUDA. Internal, host
// side.
//
// Every rope op has one kernel template (qk_norm_rope.cu, qk_norm_rope_backward.cu,
// qkv_backward_fp8.cu), instantiated over the chunk width V its rows are read and written with:
// - V = 8, 16-byte vectors, tuned for the model's widths: D a multiple of 8 in [32, 512], every
//   bf16 row and every table row 16-byte aligned (pointers and all strides but the last), NeoX
//   rotary widths a multiple of 16 and, with a cos/sin cache and interleaved lanes, of 8 (a
//   chunk's partners and frequencies are then whole vectors);
// - V = 2, 4-byte pairs, for every other call whose bf16 rows are 4-byte aligned;
// - V = 1, single elements, for the rest (rows that start on an odd element).
// Same math in the same rounding order (rope_rows.cuh), hence the same results as the CPU
// backend within the tests' tolerances. The choice is made here, in one place, from validated
// arguments.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "qkvfuse/qk_norm_rope.hpp"
#include "qkvfuse/qkv_backward_fp8.hpp"
#include "qkvfuse/tensor.hpp"
#include "rope_math.hpp"
#include "validate.hpp"

namespace qkvfuse::cuda::rope {

/// The widest head the CUDA rope kernels take, the CPU backend's (validate.hpp kMaxHeadDim; past
/// kMaxCudaTestedHeadDim only with QKVFUSE_CUDA_SECTION9=1): the geometries' top (rope_config.cuh
/// lanes_for) and the FP8 backward's shared tile (rope_config.cuh fp8_tile_tokens) bound it.
inline constexpr int64_t kMaxHeadWidth = validate::kMaxHeadDim;

/// True when the view's data pointer and every stride but the last (of dims longer than 1) are
/// multiples of `bytes`: every row starts on a `bytes` boundary. Absent views pass.
inline bool rows_aligned(const TensorView& view, int64_t bytes) {
  if (is_absent(view)) return true;
  const int64_t element = int64_t(dtype_size(view.dtype));
  if (int64_t(reinterpret_cast<uintptr_t>(view.data) % uint64_t(bytes)) != 0) return false;
  for (int d = 0; d + 1 < view.ndim; ++d) {
    if (view.sizes[d] > 1 && (view.strides[d] * element) % bytes != 0) return false;
  }
  return true;
}

inline bool all_rows_aligned(std::initializer_list<const TensorView*> views, int64_t bytes) {
  for (const TensorView* view : views) {
    if (!rows_aligned(*view, bytes)) return false;
  }
  return true;
}

/// Dv of the V norm's rows (layout.normalize_v: v's last dim), else 0.
inline int64_t v_width(const RopeLayout& layout, const TensorView& v) {
  return layout.normalize_v && !is_absent(v) ? v.sizes[2] : 0;
}

/// The chunk width (8, 2 or 1 elements) for a call whose bf16 rows are `rows` (qk, the
/// gradients, the outputs, and the V norm's rows) and whose layout is `layout`, D = head_dim;
/// `v_dim` the V norm's Dv (0 without it): its rows take the same chunks, so Dv must be a
/// multiple of the chunk too.
inline int chunk_width(const RopeLayout& layout, int64_t head_dim,
                       std::initializer_list<const TensorView*> rows, int64_t v_dim = 0) {
  const int64_t r = qkvfuse::rope::resolved_rotary_dim(layout, head_dim);
  const bool neox = layout.rotary_style == RotaryStyle::kNeox;
  const bool cache = !is_absent(layout.cos_sin);
  const bool width_ok = head_dim % 8 == 0 && head_dim >= 32 && head_dim <= kMaxHeadWidth &&
                        v_dim % 8 == 0;
  const bool rotary_ok = neox ? r % 16 == 0 : (!cache || r % 8 == 0);
  const bool tables_ok = all_rows_aligned({&layout.factor1, &layout.factor2, &layout.cos_sin,
                                           &layout.q_weight, &layout.k_weight},
                                          16);
  if (width_ok && rotary_ok && tables_ok && all_rows_aligned(rows, 16)) return 8;
  return all_rows_aligned(rows, 4) && v_dim % 2 == 0 ? 2 : 1;
}

inline int chunk_width(const QkNormRopeParams& p) {
  return chunk_width(p.layout, p.qk.sizes[2], {&p.qk, &p.q, &p.k, &p.v, &p.v_out},
                     v_width(p.layout, p.v));
}

inline int chunk_width(const QkNormRopeBackwardParams& p) {
  return chunk_width(p.layout, p.qk.sizes[2],
                     {&p.qk, &p.grad_q, &p.grad_k, &p.grad_qk, &p.v, &p.grad_v_out, &p.grad_v},
                     v_width(p.layout, p.v));
}

/// The fused FP8 backward's 16-byte chunks also write 8-byte codes into grad_row's rows and
/// 16-byte blocks of grad_t: both outputs 16-byte aligned and Dv a multiple of 8 (so qkv_dim is
/// one, and the tile's parts start on whole words). Its V rows are read as 16-byte vectors when
/// their rows are aligned too (fp8_v_vectors); the element-wise V loop takes the rest. With the
/// V norm the V rows (grad_v and v) take the Q/K rows' chunks.
inline int chunk_width(const QkvBackwardFp8Params& p) {
  const bool v_norm = p.layout.normalize_v;
  const int chunk =
      chunk_width(p.layout, p.qk.sizes[2],
                  {&p.qk, &p.grad_q, &p.grad_k, v_norm ? &p.grad_v : &p.qk, &p.v},
                  v_width(p.layout, p.v));
  const auto aligned16 = [](const void* data) {
    return reinterpret_cast<uintptr_t>(data) % 16 == 0;
  };
  const bool outputs_aligned = aligned16(p.grad_row.data) && aligned16(p.grad_t.data) &&
                               p.grad_v.sizes[2] % 8 == 0;
  return chunk == 8 && !outputs_aligned ? 2 : chunk;
}

inline bool fp8_v_vectors(const QkvBackwardFp8Params& p, int chunk) {
  return chunk == 8 && p.grad_v.sizes[2] % 8 == 0 && rows_aligned(p.grad_v, 16);
}

}  // namespace qkvfuse::cuda::rope
