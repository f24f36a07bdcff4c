// qkvfuse/qk_norm_rope.hpp: fused per-head QK RMS-norm + interleaved rotary (SPEC.md 1 and 2).
#pragma once

#include "qkvfuse/tensor.hpp"

namespace qkvfuse {

/// Where the rotated rows go and which factor columns they read (SPEC.md section 1).
struct RopeLayout {
  int64_t num_heads = 0;    ///< H: logical heads of Q (and of K). `qk` holds 2H input heads.
  int64_t rotary_dim = 0;   ///< dims >= rotary_dim are stationary; read by key_offset only.
                            ///< Even, in [0, D]. Ignored (may be D) when key_offset is false.
  bool paired = false;      ///< outputs [2T, H/2, D]; needs H even; factors are [T, 2D]
  bool key_offset = false;  ///< keys' stationary dims come from token t-1; not with paired
};

/// Forward: q, k = rotary(rms_norm(qk)).
///
///   qk       bf16 [T, 2H, D]: input heads 0..H-1 are queries, H..2H-1 keys. Last dim contiguous,
///            token and head strides arbitrary (a column slice of the QKV GEMM output).
///            On CPU, float32 and float64 are accepted too (gradient checks).
///   factor1  [T, D] ([T, 2D] when paired), bf16 or float32 (or qk's dtype), last dim contiguous:
///            cos(theta); 1 for stationary dims.
///   factor2  same shape and dtype as factor1: sin(theta) with odd lanes negated; 0 if stationary.
///   q, k     outputs, qk's dtype, [T, H, D] ([2T, H/2, D] when paired), each row-major
///            contiguous, separate allocations that overlap nothing.
/// D is any even width from 2 to 256 on both backends; pointers need only their elements'
/// alignment. On CUDA the fast kernels (16-byte vectors) serve D a multiple of 8 in [32, 256]
/// with 16-byte aligned pointers and strides; every other call runs on element-pair kernels,
/// several times slower, whose row sums add in another order (results within 1 bf16 ulp of the
/// fast kernels' and of the CPU backend's, more only where a row sum cancels).
struct QkNormRopeParams {
  TensorView qk;
  TensorView factor1;
  TensorView factor2;
  TensorView q;
  TensorView k;
  RopeLayout layout;
  Stream stream = nullptr;  ///< CUDA stream for the launch; ignored on CPU
};

/// Backward of qk_norm_rope: dqk from dq, dk. rstd is recomputed from the saved pre-norm qk.
///
///   grad_q, grad_k  [T, H, D] ([2T, H/2, D] when paired), qk's dtype, last dim contiguous,
///                   token and head strides arbitrary
///   qk, factor1, factor2, layout: as in the forward
///   grad_qk         output, qk's dtype, [T, 2H, D] row-major contiguous
struct QkNormRopeBackwardParams {
  TensorView grad_q;
  TensorView grad_k;
  TensorView qk;
  TensorView factor1;
  TensorView factor2;
  TensorView grad_qk;
  RopeLayout layout;
  Stream stream = nullptr;
};

/// Validates every argument (throws qkvfuse::Error naming the argument) and runs on the device
/// the tensors live on. T = 0 is a no-op.
void qk_norm_rope(const QkNormRopeParams& params);
void qk_norm_rope_backward(const QkNormRopeBackwardParams& params);

}  // namespace qkvfuse
