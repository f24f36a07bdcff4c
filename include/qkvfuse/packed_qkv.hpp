// qkvfuse/packed_qkv.hpp: the packed FP8 QKV projection, forward and backward (SPEC.md section 6),
// composed from the library's ops with no PyTorch. Every output and workspace is the caller's (the
// PyTorch binding hands in tensors from its caching allocator); the GEMMs use fp8_gemm's own
// per-stream cuBLASLt workspace (qkvfuse/fp8_gemm.hpp).
#pragma once

#include <cstdint>

#include "qkvfuse/qk_norm_rope.hpp"
#include "qkvfuse/tensor.hpp"

namespace qkvfuse {

/// Forward: qkv = (x_f8 @ weight_f8^T) * x_scale * weight_scale * qkv_scale (fast accumulation,
/// bf16 out), then q, k = qk_norm_rope(qkv[:, :QK]) and v = qkv[:, QK:], QK = (Hq + Hkv) * D.
///
///   x_f8        e4m3 [T, C], row-major
///   weight_f8   e4m3 [qkv_dim, C], the cached packed [Wq; Wk; Wv], qkv_dim(layout, D, Dv)
///   x_scale, weight_scale, qkv_scale   float32 scalars on the device
///   qk          output bf16 [T, Hq + Hkv, D]: the GEMM's Q/K columns, saved for the backward
///   v           output bf16 [T, Hkv, Dv]
///   q, k        outputs as qk_norm_rope; layout as qk_norm_rope (its tables and weights too)
///   v_out       with layout.normalize_v only: output bf16 [T, Hkv, Dv] contiguous, v normalized
///               (qk_norm_rope's v_out); v then keeps the GEMM's raw V for the backward
/// When qk and v are the two column slices of one row-major [T, qkv_dim] buffer (v starts at
/// column QK of qk's rows), one GEMM writes both. Otherwise (paired layers, where attention
/// needs v dense) two GEMMs over the Q/K rows and the V rows of the weight write them apart.
/// qk and v keep each token's heads packed in one row (head stride D, resp. Dv). On CUDA every
/// GEMM step takes fp8_gemm's requirements: T, C and qkv_dim (with two GEMMs also QK and Hkv*Dv)
/// multiples of 16, row strides of x_f8, weight_f8, qk and v multiples of 16 elements and their
/// pointers 16-byte aligned; the op checks them all before anything runs. T = 0 is a no-op.
struct PackedQkvForwardParams {
  TensorView x_f8;
  TensorView weight_f8;
  TensorView x_scale;
  TensorView weight_scale;
  TensorView qkv_scale;
  TensorView qk;
  TensorView v;
  TensorView q;
  TensorView k;
  RopeLayout layout;
  Stream stream = nullptr;
  // SPEC.md section 9, after stream so that aggregate initializations of the fields above keep
  // their meaning.
  TensorView v_out;
};

/// Number of float32 partial sums the backward's grad_qkv_scale reduction uses. A fixed count
/// keeps the reduction order, and so its bits, independent of the GPU model and of the run. The
/// CPU backend splits the sum into the same number of partials, but its ranges and order differ:
/// CPU and CUDA results agree to fp32 rounding, not bit for bit.
inline constexpr int64_t kGradScalePartials = 264;

/// Backward from grad_q, grad_k, grad_v:
///   grad_row, grad_t = qkv_backward_fp8(...)
///   grad_weight      = (grad_t @ x_f8_t^T) * grad_scale * x_scale       (no fast accumulation)
///   grad_x           = (grad_row @ weight_f8_t^T) * grad_scale * weight_scale * qkv_scale
///   grad_qkv_scale   = sum(grad_weight * [qk_weight; v_weight])  (products and sum in fp32)
///   grad_qk_weight, grad_v_weight = split(grad_weight) * qkv_scale
///
///   grad_q, grad_k, grad_v, qk, layout: as qkv_backward_fp8
///   x_f8_t          e4m3 [C, T], x quantized with x_scale, transposed
///   weight_f8_t     e4m3 [C, qkv_dim], the cached packed weight, transposed
///   qk_weight       bf16 [(Hq+Hkv)*D, C], v_weight bf16 [Hkv*Dv, C]: the master weights
///   grad_row        workspace e4m3 [T, qkv_dim];  grad_t workspace e4m3 [qkv_dim, T]
///   partials        workspace float32 [kGradScalePartials]
///   grad_q_weight, grad_k_weight, rope_workspace: the norm weights' gradients and their
///                   workspace, as qkv_backward_fp8's grad_q_weight, grad_k_weight, workspace
///                   (size: backward_workspace_size of these params)
///   grad_x          output bf16 [T, C]
///   grad_qk_weight  output bf16 [(Hq+Hkv)*D, C];  grad_v_weight output bf16 [Hkv*Dv, C]
///                   (one wgrad GEMM when grad_v_weight directly follows grad_qk_weight in
///                   memory, as two row slices of one [qkv_dim, C] buffer; two otherwise)
///   grad_qkv_scale  output float32 scalar
///   v               with layout.normalize_v only: the forward's raw V (its v), bf16
///                   [T, Hkv, Dv]; grad_v is then the gradient of v_out
/// layout.query_only: v_weight [0, C], grad_v [T, 0, Dv], qkv_dim = Hq * D.
/// On CUDA the GEMM requirements above apply to grad_row, grad_t, x_f8_t, weight_f8_t, grad_x and
/// the weight gradients; the master weights and their gradients must be row-major contiguous
/// and partials 16-byte aligned. T = 0 is a no-op for the projection: nothing is written, the
/// projection's weight gradients and grad_qkv_scale included (the PyTorch binding returns zeros
/// for them); the norm weights' gradients are written as zeros, as qkv_backward_fp8 writes them.
struct PackedQkvBackwardParams {
  TensorView grad_q;
  TensorView grad_k;
  TensorView grad_v;
  TensorView qk;
  TensorView x_f8_t;
  TensorView weight_f8_t;
  TensorView qk_weight;
  TensorView v_weight;
  TensorView x_scale;
  TensorView weight_scale;
  TensorView qkv_scale;
  TensorView grad_scale;
  TensorView grad_row;
  TensorView grad_t;
  TensorView partials;
  TensorView grad_q_weight;
  TensorView grad_k_weight;
  TensorView rope_workspace;
  TensorView grad_x;
  TensorView grad_qk_weight;
  TensorView grad_v_weight;
  TensorView grad_qkv_scale;
  RopeLayout layout;
  Stream stream = nullptr;
  // SPEC.md section 9, after stream so that aggregate initializations of the fields above keep
  // their meaning.
  TensorView v;
};

void packed_qkv_forward(const PackedQkvForwardParams& params);
void packed_qkv_backward(const PackedQkvBackwardParams& params);

/// Float32 elements rope_workspace must hold (the qkv_backward_fp8 step's workspace).
int64_t backward_workspace_size(const PackedQkvBackwardParams& params);

}  // namespace qkvfuse
