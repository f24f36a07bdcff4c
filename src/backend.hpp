// backend.hpp: the two backends behind the public API. Internal.
//
// The public entry points (src/*.cpp) validate every argument and then call exactly one of these
// by where the tensors live. Backend functions may therefore assume valid, consistent arguments:
// dtypes, shapes, strides, alignment, devices and non-overlap have all been checked.
#pragma once

#include "qkvfuse/fp8_gemm.hpp"
#include "qkvfuse/qk_norm_rope.hpp"
#include "qkvfuse/qkv_backward_fp8.hpp"
#include "qkvfuse/quantize.hpp"
#include "qkvfuse/tensor.hpp"

namespace qkvfuse {

/// The last step of the packed backward: grad_qkv_scale = sum(grad_weight * weight) over both
/// parts, then grad_weight *= qkv_scale in place. One pass, since the reduction must read
/// grad_weight anyway; the multiply rides along instead of costing a pass of its own.
///
///   grad_qk_weight, grad_v_weight  bf16 [2HD, C], [HDv, C], row-major: in the unscaled wgrad
///                                  GEMM output, out scaled by qkv_scale (rounded to bf16)
///   qk_weight, v_weight            bf16, same shapes
///   qkv_scale                      float32 scalar
///   partials                       float32 [kGradScalePartials] workspace
///   grad_qkv_scale                 float32 scalar output: products exact in fp32, summed in
///                                  fp32 in a fixed order (deterministic)
struct GradWeightFinalizeParams {
  TensorView grad_qk_weight;
  TensorView grad_v_weight;
  TensorView qk_weight;
  TensorView v_weight;
  TensorView qkv_scale;
  TensorView partials;
  TensorView grad_qkv_scale;
  Stream stream = nullptr;
};

/// The first token whose rotary position lies outside [0, P) (index -1 when none), and its value.
struct BadPosition {
  int64_t index = -1;
  int64_t value = 0;
};

namespace cpu {
BadPosition find_bad_position(const TensorView& positions, int64_t num_positions);
void qk_norm_rope(const QkNormRopeParams& params);
void qk_norm_rope_backward(const QkNormRopeBackwardParams& params);
void qkv_backward_fp8(const QkvBackwardFp8Params& params);
void quantize_dual_layout(const QuantizeDualParams& params);
void quantize_weight_bank(const QuantizeWeightBankParams& params);
void fp8_gemm(const Fp8GemmParams& params);
void grad_weight_finalize(const GradWeightFinalizeParams& params);
}  // namespace cpu

// Built from src/cuda/ when nvcc is found; src/cuda/unavailable.cpp otherwise, whose functions
// throw "qkvfuse was built without CUDA".
namespace cuda {
/// Widest V head qkv_backward_fp8 takes on CUDA: its kernel stages a tile of 128 tokens x
/// (2D + Dv) e4m3 bytes in shared memory (src/cuda/qkv_backward_fp8.cu).
inline constexpr int64_t kMaxVWidth = 512;

void qk_norm_rope(const QkNormRopeParams& params);
void qk_norm_rope_backward(const QkNormRopeBackwardParams& params);
void qkv_backward_fp8(const QkvBackwardFp8Params& params);
void quantize_dual_layout(const QuantizeDualParams& params);
void quantize_weight_bank(const QuantizeWeightBankParams& params);
void fp8_gemm(const Fp8GemmParams& params);
void grad_weight_finalize(const GradWeightFinalizeParams& params);

/// Float32 elements of the weight-gradient workspace of a call with norm weights: the per-block
/// partial sums (src/cuda/weight_grad.hpp). Depends on the shapes and the layout only.
int64_t backward_workspace_size(const QkNormRopeBackwardParams& params);
int64_t backward_workspace_size(const QkvBackwardFp8Params& params);
/// Synchronizes `stream`; refuses to run while it is being captured.
BadPosition find_bad_position(const TensorView& positions, int64_t num_positions, Stream stream);

/// Throws unless `device` is a usable CUDA device and `pointer` is memory the CUDA runtime
/// knows to be on it (device or managed memory); `name` goes into the message.
void check_pointer_on_device(const void* pointer, Device device, const char* name);
}  // namespace cuda

}  // namespace qkvfuse
