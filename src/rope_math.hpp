// rope_math.hpp: the rules of SPEC.md sections 1 and 8 that every implementation of the rope ops
// shares (the CPU backend and the CUDA kernels, both access widths): where an input row goes, which
// lane a rotary lane turns with, which frequency it reads and with which sign. Host and device.
// Internal.
#pragma once

#include <cstdint>

#include "qkvfuse/numeric.hpp"  // QKVF_HOST_DEVICE
#include "qkvfuse/qk_norm_rope.hpp"

namespace qkvfuse::rope {

/// The integer shape of a validated layout: what the placement and rotation rules read.
struct Dims {
  int q_heads;     ///< Hq
  int kv_heads;    ///< Hkv
  int head_dim;    ///< D
  int rotary_dim;  ///< r (resolved: never -1)
  bool neox;       ///< RotaryStyle::kNeox
  bool paired;     ///< Hq = Hkv, even
};

/// Where input row (t, h2) of qk [T, Hq + Hkv, D] is written, and its angles' column offset.
struct Place {
  int64_t token;     ///< output token: t, or 2t + h / (Hq/2) when paired
  int head;          ///< output head: h, or h mod (Hq/2) when paired
  int angle_offset;  ///< first factor-table column: (h mod 2) * D when paired, else 0
  bool is_key;       ///< h2 >= Hq: a key row (into k), else a query row (into q)
};

/// SPEC.md sections 1 and 8: query rows h2 < Hq to q[t, h2], key rows to k[t, h2 - Hq]; paired
/// heads (a rotary over the [T, H/2, 2D] view, then a reshape to [2T, H/2, D]) place head h at
/// token 2t + h / (H/2), head h mod (H/2), reading columns [(h mod 2) * D, +D) of the tables.
QKVF_HOST_DEVICE Place place(const Dims& dims, int64_t t, int h2) {
  const bool is_key = h2 >= dims.q_heads;
  const int h = is_key ? h2 - dims.q_heads : h2;
  if (dims.paired) {
    // h < H = 2 * half, so h / half is 0 or 1: no integer division on the kernels' hot path.
    const int half = dims.q_heads / 2;
    const int second = h >= half ? 1 : 0;
    return {2 * t + second, h - second * half, (h & 1) * dims.head_dim, is_key};
  }
  return {t, h, 0, is_key};
}

/// The lane rotary lane d (d < r) turns with: d ^ 1 interleaved; d +- r/2 NeoX.
QKVF_HOST_DEVICE int partner(int d, int r, bool neox) {
  if (!neox) return d ^ 1;
  const int half = r / 2;
  return d < half ? d + half : d - half;
}

/// True for the first lane of a pair (even d interleaved, d < r/2 NeoX), whose sin term is
/// subtracted: y[d] = cos * n[d] - sin * n[partner]; the second lane adds it.
QKVF_HOST_DEVICE bool leads_pair(int d, int r, bool neox) {
  return neox ? d < r / 2 : (d & 1) == 0;
}

/// The frequency index i of rotary lane d: its cos is cos_sin[pos, i], its sin cos_sin[pos, r/2 + i].
QKVF_HOST_DEVICE int frequency(int d, int r, bool neox) {
  return neox ? (d < r / 2 ? d : d - r / 2) : d / 2;
}

/// True when the layout has an angle source (factor tables or a cos/sin cache); without one
/// nothing rotates (r = 0, SPEC.md section 9).
inline bool has_angles(const RopeLayout& layout) {
  return !is_absent(layout.factor1) || !is_absent(layout.factor2) || !is_absent(layout.cos_sin) ||
         !is_absent(layout.positions);
}

/// r of a layout whose rotary_dim may be the default -1: D with factor tables, cos_sin's width
/// with a cos/sin cache, 0 without angles.
inline int64_t resolved_rotary_dim(const RopeLayout& layout, int64_t head_dim) {
  if (layout.rotary_dim >= 0) return layout.rotary_dim;
  if (!has_angles(layout)) return 0;
  return is_absent(layout.cos_sin) ? head_dim : layout.cos_sin.sizes[1];
}

inline Dims dims_of(const RopeLayout& layout, int64_t head_dim) {
  return {int(layout.num_heads), int(kv_heads(layout)), int(head_dim),
          int(resolved_rotary_dim(layout, head_dim)),
          layout.rotary_style == RotaryStyle::kNeox, layout.paired};
}

}  // namespace qkvfuse::rope
