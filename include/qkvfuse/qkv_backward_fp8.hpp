// qkvfuse/qkv_backward_fp8.hpp: the fused backward of the packed QKV projection output into FP8,
// in both layouts the dgrad and wgrad GEMMs read (SPEC.md section 3).
#pragma once

#include "qkvfuse/qk_norm_rope.hpp"
#include "qkvfuse/tensor.hpp"

namespace qkvfuse {

/// One pass: the norm/rotary gradient of Q and K (rounded to bf16), the V gradient, both divided
/// by grad_scale and cast to e4m3 with saturation, written row-major and transposed.
///
///   grad_q, grad_k  bf16 [T, H, D] ([2T, H/2, D] when paired), last dim contiguous
///   grad_v          bf16 [T, H, Dv], last dim contiguous, token and head strides arbitrary;
///                   Dv >= 1 on the CPU, in [1, 512] on CUDA (the fast kernel: Dv a
///                   multiple of 8 up to 256, see qk_norm_rope.hpp for the rest)
///   qk              bf16 [T, 2H, D], the saved pre-norm projection (as the forward)
///   factor1/2       as the forward
///   grad_scale      float32 scalar, shape [] or [1], on the same device
///   grad_row        output e4m3 [T, qkv_dim] row-major contiguous, qkv_dim = 2*H*D + H*Dv:
///                   features [Q: h*D+d | K: (H+h)*D+d | V: 2*H*D + h*Dv + d]
///   grad_t          output e4m3 [qkv_dim, T] row-major contiguous (grad_row transposed);
///                   the fast CUDA kernel wants both outputs 16-byte aligned
struct QkvBackwardFp8Params {
  TensorView grad_q;
  TensorView grad_k;
  TensorView grad_v;
  TensorView qk;
  TensorView factor1;
  TensorView factor2;
  TensorView grad_scale;
  TensorView grad_row;
  TensorView grad_t;
  RopeLayout layout;
  Stream stream = nullptr;
};

void qkv_backward_fp8(const QkvBackwardFp8Params& params);

}  // namespace qkvfuse
