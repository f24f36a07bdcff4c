// qkvfuse/qk_norm_rope.hpp: fused per-head QK-norm + rotary embedding, forward and bf16 backward
// (SPEC.md sections 1, 2 and 8).
#pragma once

#include <cstdint>

#include "qkvfuse/numeric.hpp"
#include "qkvfuse/tensor.hpp"

namespace qkvfuse {

/// Which lane a rotary lane turns with (SPEC.md section 8).
enum class RotaryStyle : int8_t {
  kInterleaved,  ///< d and d ^ 1 (the speedrun, GPT-J)
  kNeox,         ///< half split: d and d + r/2 for d < r/2 (Llama, Qwen, Gemma, GLM)
};

/// What one RMS norm of Q and K spans (SPEC.md section 9).
enum class NormScope : int8_t {
  kHead,   ///< one RMS per head row of D values; weights [D] (Qwen3, Gemma, GLM)
  kToken,  ///< one RMS over a token's Hq*D query values and one over its Hkv*D key values;
           ///< weights [Hq*D] and [Hkv*D] (OLMo 2, OLMo 3)
};

/// The one description of a QK-norm + rotary layout, from the public API to the kernels: the
/// heads, the norm, the rotary and the tensors they read. Every field's default is the speedrun's
/// layout of SPEC.md sections 1-7 (equal Q and K heads, weightless RMS-norm, interleaved rotary
/// from per-token factor tables).
///
/// Heads: `qk` holds Hq + Hkv input heads of width D, queries first; q is [T, Hq, D] and k is
/// [T, Hkv, D] (paired: [2T, Hq/2, D] each).
///
/// Angles, at most one of (none: no rotary, r = 0; SPEC.md section 9):
///   factor tables  factor1, factor2 [T, D] ([T, 2D] when paired), bf16 or float32 (or qk's
///                  dtype on the CPU), last dim contiguous: y[d] = f1[d] * n[d] + f2[d] * n[p(d)]
///                  for the rotary lanes d < r, p the partner of the style; the tables carry the
///                  signs (SPEC.md section 1).
///   cos/sin cache  cos_sin [P, r] (1 <= P <= 2^31 - 1; bf16 or float32, last dim contiguous;
///                  columns [0, r/2) are cos, [r/2, r) sin of frequency i) read at positions[t]
///                  (int32 or int64 [T]):
///                  y[d] = cos_i * n[d] - sin_i * n[p(d)] for the first lane of a pair and
///                  + for the second. A position outside [0, P) reads nothing: its token's
///                  rotary lanes come out NaN (check_positions raises instead).
/// Lanes d >= r pass through unrotated (y[d] = n[d]; under key_offset, keys' lanes d >= r come
/// from the previous token).
///
/// Norm: normalize = false leaves n = x; otherwise n = x / sqrt(mean(x^2) + eps), the mean over
/// the row's D values (norm_scope kHead) or over all of its token's values of its kind (kToken:
/// Hq*D for query rows, Hkv*D for key rows), times (w + weight_offset) when the row's weight
/// (q_weight for query rows, k_weight for key rows; [D], or [H*D] of the kind under kToken,
/// bf16 or float32) is given. Each weight may be given or not on its own.
///
/// V: normalize_v adds a weightless RMS norm of each V head row (width Dv, the same eps) to the
/// op: the params' v is normalized into v_out (SPEC.md section 9). query_only: qk holds the
/// query heads only (Hkv = 0, k is [T, 0, D]), for layers whose keys come from another layer.
///
/// On CUDA, D > 256, normalize_v, norm_scope kToken, query_only and a call without angles are
/// refused ("not yet on the CUDA backend") unless the environment variable
/// QKVFUSE_CUDA_SECTION9=1 lets them run on kernels that have not yet run on a GPU.
struct RopeLayout {
  int64_t num_heads = 0;     ///< Hq >= 1: query heads
  int64_t num_kv_heads = 0;  ///< Hkv: key heads, Hq % Hkv == 0; 0 means Hq (none: query_only)
  /// r: rotary lanes [0, r), even, in [0, D]; -1 means the whole head (D) with factor tables
  /// and cos_sin's width with a cos/sin cache (which r must then equal).
  int64_t rotary_dim = -1;
  /// The factor tables' default is the speedrun's. A cos/sin cache does not say how its lanes
  /// pair: set the style of the convention it was built for (Hugging Face's rotate_half is
  /// kNeox); the Python functions require it with a cache.
  RotaryStyle rotary_style = RotaryStyle::kInterleaved;
  bool normalize = true;        ///< false: rotary only (models without QK norm)
  float eps = kRmsNormEps;      ///< > 0 and finite; read when normalize
  float weight_offset = 0.0f;   ///< 1 for Gemma's (1 + w); read when a weight is given
  bool paired = false;      ///< outputs [2T, Hq/2, D], factor tables [T, 2D]; Hq = Hkv, even
  bool key_offset = false;  ///< keys' lanes >= r come from token t-1; Hq = Hkv; not with paired
  bool normalize_v = false;  ///< also v_out = v * rstd(v) per V head row; not with query_only
  NormScope norm_scope = NormScope::kHead;  ///< what one RMS of Q and K spans
  bool query_only = false;   ///< qk [T, Hq, D], no key heads; num_kv_heads must be 0

  TensorView factor1;    ///< factor tables (absent with a cos/sin cache)
  TensorView factor2;
  TensorView cos_sin;    ///< cos/sin cache [P, r] (absent with factor tables)
  TensorView positions;  ///< [T] int32 or int64, with cos_sin
  TensorView q_weight;   ///< [D] ([Hq*D] under kToken) bf16 or float32, optional
  TensorView k_weight;   ///< [D] ([Hkv*D] under kToken) bf16 or float32, optional
};

/// Hkv of the layout: num_kv_heads, or num_heads when that is 0; 0 when query_only.
inline int64_t kv_heads(const RopeLayout& layout) {
  if (layout.query_only) return 0;
  return layout.num_kv_heads > 0 ? layout.num_kv_heads : layout.num_heads;
}

/// Features of the packed QKV projection: (Hq + Hkv) * D + Hkv * Dv (SPEC.md section 8).
inline int64_t qkv_dim(const RopeLayout& layout, int64_t head_dim, int64_t v_dim) {
  return (layout.num_heads + kv_heads(layout)) * head_dim + kv_heads(layout) * v_dim;
}

/// Forward: q, k = rotary(norm(qk)); with normalize_v also v_out = v * rstd(v).
///
///   qk      bf16 [T, Hq + Hkv, D], last dim contiguous, token and head strides arbitrary (a
///           column slice of the QKV GEMM output). On the CPU float32 and float64 too.
///   q, k    outputs, qk's dtype, [T, Hq, D] and [T, Hkv, D] ([2T, Hq/2, D] when paired), each
///           row-major contiguous, separate allocations that overlap nothing.
///   v       with normalize_v only: qk's dtype, [T, Hkv, Dv] (Dv >= 1), last dim contiguous,
///           other strides free (a column slice of the GEMM output, or qk's key rows)
///   v_out   with normalize_v only: output, qk's dtype, [T, Hkv, Dv], row-major contiguous
/// D is any even width from 2 to 256 on both backends (to 512 on the CPU); pointers need only
/// their elements' alignment. On CUDA the fast kernels (16-byte vectors) serve D a multiple of 8 in [32, 256]
/// with 16-byte aligned rows (and, for NeoX, r a multiple of 16; with a cos/sin cache and
/// interleaved lanes, of 8); every other call runs on the same kernels with 4- or 2-byte
/// accesses. Results agree with the CPU backend's within 1 bf16 ulp (the row sums add in
/// another order).
struct QkNormRopeParams {
  TensorView qk;
  TensorView q;
  TensorView k;
  RopeLayout layout;
  Stream stream = nullptr;  ///< CUDA stream for the launch; ignored on the CPU
  // SPEC.md section 9, after stream so that aggregate initializations of the fields above keep
  // their meaning.
  TensorView v;
  TensorView v_out;
};

/// Backward: grad_qk from grad_q, grad_k (rstd recomputed from the saved pre-norm qk), and the
/// norm weights' gradients grad_w[d] = sum over that weight's rows of dL/d(n*w)[d] * n[d]
/// (n unweighted), summed in float32 in a fixed order (the same bits on every run).
///
///   grad_q, grad_k  q's and k's shapes, qk's dtype, last dim contiguous, strides arbitrary
///   qk, layout      as in the forward
///   grad_qk         output, qk's dtype, [T, Hq + Hkv, D] row-major contiguous
///   grad_q_weight   output [D] of q_weight's dtype, exactly when q_weight is given
///   grad_k_weight   output [D] of k_weight's dtype, exactly when k_weight is given
///   workspace       float32 [>= backward_workspace_size(params)], contiguous: per-block partial
///                   sums of the weight gradients on CUDA; may be absent when that size is 0
///   grad_v_out, v   with normalize_v only: the gradient of v_out (v's shape, qk's dtype, last
///                   dim contiguous) and the forward's v
///   grad_v          with normalize_v only: output, the gradient of v, [T, Hkv, Dv] contiguous
struct QkNormRopeBackwardParams {
  TensorView grad_q;
  TensorView grad_k;
  TensorView qk;
  TensorView grad_qk;
  TensorView grad_q_weight;
  TensorView grad_k_weight;
  TensorView workspace;
  RopeLayout layout;
  Stream stream = nullptr;
  // SPEC.md section 9, after stream so that aggregate initializations of the fields above keep
  // their meaning.
  TensorView grad_v_out;
  TensorView v;
  TensorView grad_v;
};

/// Validates every argument (throws qkvfuse::Error naming the argument and what was expected)
/// and runs on the device the tensors live on. T = 0 is a no-op (the weight gradients are then
/// written as zeros). With the environment variable QKVFUSE_CHECK_POSITIONS=1 every call with a
/// cos/sin cache first runs check_positions (which synchronizes).
void qk_norm_rope(const QkNormRopeParams& params);
void qk_norm_rope_backward(const QkNormRopeBackwardParams& params);

/// Float32 elements the backward's workspace must hold: 0 without norm weights or on the CPU
/// (qkv_backward_fp8's: also on CUDA a norm_scope kToken call's bf16 gradient, T*(Hq+Hkv)*D/2).
/// Reads the shapes, the layout and the device of params (its other tensors may be absent).
int64_t backward_workspace_size(const QkNormRopeBackwardParams& params);

/// Throws qkvfuse::Error naming the first token whose position lies outside [0, num_positions).
/// positions: int32 or int64 [T] on the CPU or a CUDA device; on CUDA it synchronizes the stream
/// and refuses to run while the stream is being captured into a graph.
void check_positions(const TensorView& positions, int64_t num_positions, Stream stream = nullptr);

}  // namespace qkvfuse
