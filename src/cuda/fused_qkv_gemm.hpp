// fused_qkv_gemm.hpp: the CUTLASS FP8 GEMMs of the forward (issue 22): the fused QKV projection,
// whose epilogue does the per-head QK RMS-norm + rotary (SPEC.md section 1) and writes q, k and v
// in their final layouts, and the same GEMM with a plain epilogue. Internal, host side; the packed
// op's forward runs it when asked (ForwardGemm, qkvfuse/packed_qkv.hpp).
//
//   qkv    = bf16((x_f8 @ weight_f8^T) * ((scale_a * scale_b) * alpha))       fp32 accumulation
//   q, k   = rotary(rms_norm(qkv[:, :(Hq+Hkv)*D] viewed [T, Hq+Hkv, D]))       SPEC.md 1 and 8
//   v      = qkv[:, (Hq+Hkv)*D:] viewed [T, Hkv, Dv]
// qkv itself is never written (its Q/K columns optionally are, as `qk`, for the backward).
//
// Both need the library built with CUTLASS 4.2 (cmake/cutlass.cmake, scripts/fetch_cutlass.sh);
// without it they throw qkvfuse::Error saying so. Both run on CUDA only (sm_90a).
#pragma once

#include <cstdint>
#include <string>

#include "cuda/fused_qkv_gemm_args.hpp"
#include "qkvfuse/fp8_gemm.hpp"
#include "qkvfuse/packed_qkv.hpp"
#include "qkvfuse/qk_norm_rope.hpp"
#include "qkvfuse/tensor.hpp"

namespace qkvfuse::cuda {

/// Whether this build has the CUTLASS GEMMs (QKVFUSE_WITH_CUTLASS).
bool cutlass_gemms_available();

/// fp8_gemm (qkvfuse/fp8_gemm.hpp) on CUTLASS's ping-pong FP8 kernel with its stock TMA epilogue:
/// d = bf16(acc * ((scale_a * scale_b) * alpha)), the three scalars read on the device by the
/// epilogue (no folding kernel, unlike the cuBLASLt path). Same arguments and validation as
/// fp8_gemm; additionally fast_accum must be true (the one instantiation) and a, b need K a
/// multiple of 16 and 16-byte aligned rows (TMA). Any M and N (the tiles at the edges are
/// predicated). The diagnostic baseline of the fused GEMM: same main loop, plain epilogue.
void cutlass_fp8_gemm(const Fp8GemmParams& params);

/// The fused forward projection. Shapes (plain layout; SPEC.md section 1 for paired):
///
///   x_f8       e4m3 [T, C] row-major (row stride a multiple of 16 elements, 16-byte aligned)
///   weight_f8  e4m3 [(Hq+Hkv)*D + Hkv*Dv, C] row-major, rows [Wq heads | Wk heads | Wv heads]
///   scale_a, scale_b   fp32 device scalars ([] or [1]): x_scale and weight_scale
///   alpha      optional fp32 device scalar (qkv_scale); absent = 1
///   layout     the norm + rotary, as qk_norm_rope takes it (qkvfuse/qk_norm_rope.hpp): Hq =
///              num_heads, Hkv = kv_heads(layout), rotary_style, rotary_dim, eps, paired,
///              key_offset, and the factor tables layout.factor1, factor2 [T, D] ([T, 2D] when
///              paired), bf16 (fp32 tables are refused: FusedFactor, fused_qkv_gemm_args.hpp),
///              last dim contiguous
///   q          bf16 [T, Hq, D] ([2T, Hq/2, D] when paired), last dim contiguous
///   k          bf16 [T, Hkv, D] ([2T, Hkv/2, D] when paired), likewise
///   v          bf16 [T, Hkv, Dv], last dim contiguous
///   qk         optional bf16 [T, Hq+Hkv, D] with head stride D (a [T, (Hq+Hkv)*D] matrix with a
///              row stride >= (Hq+Hkv)*D): the pre-norm GEMM output of the Q/K columns, rounded
///              to bf16, which is what qk_norm_rope_backward / qkv_backward_fp8 read
/// q and k equal qk_norm_rope's on that qk and layout within 1 bf16 ulp (the row sums add in
/// another order). The epilogue reads and writes 16-byte chunks: every pointer 16-byte aligned and
/// every stride but the last a multiple of 16 bytes (the library's CUDA row alignment,
/// validate.hpp).
///
/// Supported here: D = 128, 96 and 64 (the CTA tile is 128 columns, one head or two; 96 columns
/// at D = 96), Dv a multiple of 8, any Hq a multiple of Hkv (GQA; paired and key offset need Hq =
/// Hkv), (Hq+Hkv)*D a multiple of the tile's columns (no tile holds both Q/K and V columns), C a
/// multiple of 16, any T >= 1. The layout: RMS-norm without weights (normalize = true, q_weight
/// and k_weight absent) with eps >= 2^-100, factor tables (no cos/sin cache); interleaved rotary
/// with r = rotary_dim = D, or any even r with key offset (lanes >= r pass through, keys' from
/// token t-1); NeoX with r = D, D a multiple of 64, no key offset. Everything else is refused
/// with an error naming it.
struct FusedQkvGemmParams {
  TensorView x_f8;
  TensorView weight_f8;
  TensorView scale_a;
  TensorView scale_b;
  TensorView alpha;     ///< optional
  TensorView q;
  TensorView k;
  TensorView v;
  TensorView qk;        ///< optional output
  RopeLayout layout;    ///< the norm + rotary and its factor tables (see above)
  /// The persistent scheduler's tile order, a tuning knob (the benchmark sweeps it): raster 0 is
  /// CUTLASS's heuristic (along N when there are more M tiles than N tiles, as at the op's
  /// shape), 1 along M, 2 along N; swizzle 1, 2, 4 or 8 (tiles of that many rows or columns
  /// walked together). Neither changes the results.
  int raster = 0;
  int swizzle = 1;
  Stream stream = nullptr;
};

/// The fused GEMM's arguments for the packed op's forward (ForwardGemm::kFused): the same
/// operands and scales, q, k and v, and qk, the raw Q/K columns the backward reads.
inline FusedQkvGemmParams fused_qkv_params(const PackedQkvForwardParams& p) {
  return {.x_f8 = p.x_f8,
          .weight_f8 = p.weight_f8,
          .scale_a = p.x_scale,
          .scale_b = p.weight_scale,
          .alpha = p.qkv_scale,
          .q = p.q,
          .k = p.k,
          .v = p.v,
          .qk = p.qk,
          .layout = p.layout,
          .stream = p.stream};
}

/// The sizes fused_qkv_unsupported decides on (the heads come from the layout).
struct FusedQkvSizes {
  int64_t tokens;    ///< T
  int64_t head_dim;  ///< D
  int64_t v_dim;     ///< Dv
};

/// Why no fused kernel is built for this layout and these sizes, or "" when one is: the layout's
/// options (angle source, norm and its weights, rotary width and style, eps, factor dtype) and D,
/// Dv, T against what the instantiations take (see FusedQkvGemmParams). The one list of it:
/// fused_qkv_gemm's validation throws this reason, and the packed op's forward asks it
/// (ForwardGemm::kAuto falls back to cuBLASLt, kFused throws it). Messages name the layout field or
/// the size, without an op prefix. Assumes the library's own layout rules hold at this D
/// (validate::Checker::rope_options). The tensors' dtypes, shapes, strides and alignment are
/// fused_qkv_gemm's argument checks, not this. Host code built in every configuration
/// (fused_qkv_gemm_support.cpp), so that a build without CUDA refuses the same layouts.
std::string fused_qkv_unsupported(const RopeLayout& layout, const FusedQkvSizes& sizes);

/// Validates (throwing qkvfuse::Error naming the argument) and launches on params.stream.
/// T = 0 is a no-op.
void fused_qkv_gemm(const FusedQkvGemmParams& params);

/// fused_qkv_gemm's validation and its translation into the kernel's arguments, without the
/// launch: for callers that validate first and launch later (the packed op, which checks all its
/// steps before it runs any; the benchmark's partial epilogues, launch_fused_qkv_gemm<128,
/// EpilogueWork::...>, fused_qkv_gemm_args.hpp). `op` prefixes the messages. m = 0: nothing to
/// launch. The caller makes args.device current for the launch.
FusedQkvKernelArgs fused_qkv_kernel_args(const FusedQkvGemmParams& params,
                                         const std::string& op = "fused_qkv_gemm");

/// Launches fused_qkv_kernel_args' result on `stream` (its head width and epilogue layout pick
/// the instantiation; m = 0 launches nothing). Without CUTLASS it throws, saying so.
void run_fused_qkv_gemm(const FusedQkvKernelArgs& args, Stream stream);

}  // namespace qkvfuse::cuda
