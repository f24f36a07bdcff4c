// qkvfuse/qkv_backward_fp8.hpp: the fused backward of the packed QKV projection output into FP8,
// in both layouts the dgrad and wgrad GEMMs read (SPEC.md sections 3 and 8).
#pragma once

#include "qkvfuse/qk_norm_rope.hpp"
#include "qkvfuse/tensor.hpp"

namespace qkvfuse {

/// One pass: the norm/rotary gradient of Q and K (rounded to bf16), the V gradient, both divided
/// by grad_scale and cast to e4m3 with saturation, written row-major and transposed; and the norm
/// weights' gradients as in qk_norm_rope_backward.
///
///   grad_q, grad_k  bf16, q's and k's shapes (qk_norm_rope.hpp), last dim contiguous
///   grad_v          bf16 [T, Hkv, Dv], last dim contiguous, token and head strides arbitrary;
///                   Dv >= 1 on the CPU, in [1, 512] on CUDA (16-byte vectors for Dv a multiple
///                   of 8 up to 256): the gradient of the V the forward returned (v_out under
///                   layout.normalize_v)
///   qk              bf16 [T, Hq + Hkv, D], the saved pre-norm projection (as the forward)
///   grad_scale      float32 scalar, shape [] or [1], on the same device
///   grad_row        output e4m3 [T, qkv_dim] row-major contiguous, qkv_dim(layout, D, Dv):
///                   features [Q: h*D+d | K: (Hq+h)*D+d | V: (Hq+Hkv)*D + h*Dv + d]
///   grad_t          output e4m3 [qkv_dim, T] row-major contiguous (grad_row transposed)
///   grad_q_weight, grad_k_weight, workspace: as qk_norm_rope_backward
///                   (workspace size: backward_workspace_size of these params; on CUDA a
///                   token-wide norm also keeps its bf16 Q/K gradient there)
///   v               with layout.normalize_v only: bf16 [T, Hkv, Dv], the forward's pre-norm V
///                   (last dim contiguous); the V features are then the V norm's gradient,
///                   rounded to bf16 first as the Q/K features are (SPEC.md section 9)
struct QkvBackwardFp8Params {
  TensorView grad_q;
  TensorView grad_k;
  TensorView grad_v;
  TensorView qk;
  TensorView grad_scale;
  TensorView grad_row;
  TensorView grad_t;
  TensorView grad_q_weight;
  TensorView grad_k_weight;
  TensorView workspace;
  RopeLayout layout;
  Stream stream = nullptr;
  // SPEC.md section 9, after stream so that aggregate initializations of the fields above keep
  // their meaning.
  TensorView v;
};

void qkv_backward_fp8(const QkvBackwardFp8Params& params);

/// Float32 elements the workspace must hold (see qk_norm_rope.hpp).
int64_t backward_workspace_size(const QkvBackwardFp8Params& params);

}  // namespace qkvfuse
