// fused_qkv_gemm_args.hpp: what the fused QKV GEMM reads, as plain pointers and strides: filled
// by fused_qkv_gemm.cpp from the validated views, read by the kernel (fused_qkv_gemm_kernel.cuh),
// its epilogue (fused_qkv_epilogue.cuh) and the epilogue's host test. Internal; no CUDA or CUTLASS
// types, so that host-only translation units can fill it.
#pragma once

#include <cstdint>

#include "qkvfuse/tensor.hpp"  // Stream

namespace qkvfuse::cuda {

/// The epilogue of the fused QKV GEMM: which tile is what, where each output row goes. Strides
/// are in elements. GEMM columns are [Q heads (Hq*D) | K heads (Hkv*D) | V heads (Hkv*Dv)] (the
/// rows of weight_f8); a CTA tile (128 columns, 96 at D = 96) holds whole Q/K heads (at D = 64
/// possibly a Q and a K head) or V columns, never both.
struct FusedQkvEpilogueArgs {
  // ---- the GEMM output value: bf16(acc * ((*scale_a * *scale_b) * *alpha)) -------------------
  const float* scale_a = nullptr;  ///< fp32 device scalar (x_scale)
  const float* scale_b = nullptr;  ///< fp32 device scalar (weight_scale)
  const float* alpha = nullptr;    ///< fp32 device scalar (qkv_scale), or null for 1

  // ---- geometry ------------------------------------------------------------------------------
  int tokens = 0;       ///< T = M, rows of the GEMM
  int head_dim = 0;     ///< D (the kernel's compile-time width; kept for the checks)
  int q_heads = 0;      ///< Hq: input heads [0, Hq) of the Q/K columns are queries
  int kv_heads = 0;     ///< Hkv: input heads [Hq, Hq+Hkv) are keys, and V has Hkv heads
  int v_dim = 0;        ///< Dv, a multiple of 8
  int rotary_dim = 0;   ///< r (resolved, never -1): lanes >= r pass through, y = n (keys' from
                        ///< token t-1 under key offset); r = D but with key offset
  bool paired = false;  ///< SPEC.md 1: output token 2t + h/(H/2), head h mod (H/2), factor
                        ///< columns (h mod 2)*D; needs Hq = Hkv, even
  bool key_offset = false;  ///< SPEC.md 1 (keys, t > 0); not with paired
  bool neox = false;    ///< rotary partner of d is d +- D/2 (SPEC.md 8, rotary width D)
  float eps = 0.0f;     ///< RMS-norm epsilon (2^-23 for the speedrun)

  // ---- rotary factor tables: [T, D] or [T, 2D] (paired), of the kernel's FactorT ---------------
  const void* factor1 = nullptr;   ///< (t, j) at t * factor1_stride + j: cos(theta)
  const void* factor2 = nullptr;   ///< sin(theta), odd lanes negated (the sign of the partner)
  int64_t factor1_stride = 0;      ///< 16-byte multiple (16-byte chunk loads)
  int64_t factor2_stride = 0;      ///< likewise

  // ---- outputs, bf16 (uint16_t bits); pointers 16-byte aligned and strides multiples of 8: the
  // epilogue stores 16-byte chunks of 8 columns (4-byte words where r splits a chunk) ---
  uint16_t* q = nullptr;  ///< [T, Hq, D] (paired [2T, Hq/2, D]): (t, h, d) at t*q_stride_t + h*q_stride_h + d
  int64_t q_stride_t = 0;
  int64_t q_stride_h = 0;
  uint16_t* k = nullptr;  ///< [T, Hkv, D] (paired [2T, Hkv/2, D]), likewise
  int64_t k_stride_t = 0;
  int64_t k_stride_h = 0;
  uint16_t* v = nullptr;  ///< [T, Hkv, Dv]: (t, h, d) at t*v_stride_t + h*v_stride_h + d
  int64_t v_stride_t = 0;
  int64_t v_stride_h = 0;
  uint16_t* qk = nullptr; ///< optional pre-norm Q/K columns [T, (Hq+Hkv)*D]: (t, c) at t*qk_stride_t + c
  int64_t qk_stride_t = 0;
};

/// The epilogue addresses q, k, v, qk and the factor tables as a 64-bit pointer to a tile's first
/// row plus 32-bit offsets inside the tile: fused_qkv_gemm validates that this many rows of every
/// row stride, plus the columns of a row, fit in int32 (a tile's 128 rows, twice that for paired
/// outputs, whose tile rows are 2 output tokens apart).
inline constexpr int64_t kTileOffsetRows = 256;

/// The whole launch: the GEMM operands and the epilogue.
struct FusedQkvKernelArgs {
  const void* a = nullptr;  ///< x_f8, e4m3 [M, K] row-major, 16-byte aligned
  int64_t lda = 0;          ///< multiple of 16
  const void* b = nullptr;  ///< weight_f8, e4m3 [N, K] row-major, 16-byte aligned
  int64_t ldb = 0;          ///< multiple of 16
  int m = 0;                ///< T
  int n = 0;                ///< (Hq+Hkv)*D + Hkv*Dv
  int k = 0;                ///< C, multiple of 16
  int device = 0;           ///< CUDA ordinal (current during the launch)
  int sm_count = 0;         ///< multiprocessors: the persistent grid
  int raster = 0;           ///< scheduler tile order: 0 heuristic, 1 along M, 2 along N
  int swizzle = 1;          ///< scheduler swizzle: 1, 2, 4 or 8
  FusedQkvEpilogueArgs epilogue;
};

/// The CTA tile's columns for head width D: 96 for D = 96, else 128 (fused_qkv_gemm_kernel.cuh).
inline constexpr int fused_tile_n(int head_dim) { return head_dim == 96 ? 96 : 128; }

/// What the epilogue computes. The library instantiates kFull only; the other two write wrong q
/// and k and exist for the benchmark, which times them at D = 128 to tell where the epilogue's
/// time goes (bench/fused_qkv_gemm_variants.cu). V tiles and the raw qk are the same in all three.
enum class EpilogueWork {
  kFull,       ///< q, k = rotary(rms_norm(x)): the op
  kStoreOnly,  ///< q, k = x, the bf16 GEMM output, stored in their layouts: no factor loads, no
               ///< row sums, no rotary
  kNormOnly,   ///< q, k = x * rstd: the row sums, their quad butterfly and rstd, no factor loads,
               ///< no rotary
};

/// The layouts an epilogue is compiled for. kSimple is the common case (the speedrun's layers but
/// the long-window ones, Qwen3): interleaved rotary over the whole head (r = D), no key offset, not
/// paired, compiled without the options' code. kGeneral serves every layout fused_qkv_gemm
/// accepts (the simple one too), reading the options at run time. The library builds kSimple at
/// D = 128 only and kGeneral at every width (fused_qkv_gemm_d<D>*.cu): one CUTLASS kernel per
/// width where the simple layout is not the hot path.
enum class EpilogueLayout {
  kSimple,   ///< interleaved, rotary_dim = D, no key offset, not paired
  kGeneral,  ///< paired, key offset (any even r), NeoX, and everything kSimple takes
};

/// The layout a problem needs: kSimple where it applies, else kGeneral.
inline EpilogueLayout epilogue_layout(const FusedQkvEpilogueArgs& e) {
  const bool simple = e.rotary_dim == e.head_dim && !e.key_offset && !e.paired && !e.neox;
  return simple ? EpilogueLayout::kSimple : EpilogueLayout::kGeneral;
}

/// The factor tables' element type the library's fused kernels are built for: bf16 (as uint16_t
/// bits), what speedrun_factor_tables makes. The epilogue takes the dtype as a template parameter
/// (fp32 too: the host test runs it), but every instantiation is a whole CUTLASS kernel (1-2
/// minutes of nvcc on CI's cores), so the library builds one dtype and fused_qkv_gemm refuses
/// fp32 tables, which stay on the unfused forward (fp8_gemm + qk_norm_rope). fp32 tables would
/// also double the epilogue's largest read (128 instead of 64 KiB of factors per 128 x 128 tile).
using FusedFactor = uint16_t;

/// Launches the fused GEMM for head width kHeadDim, the epilogue layout kLayout and factor tables
/// of FactorT (defined in fused_qkv_gemm_d<D>*.cu, one instantiation per file so that they compile
/// in parallel; fused_qkv_gemm picks the instantiation).
template <int kHeadDim, EpilogueLayout kLayout, typename FactorT,
          EpilogueWork kWork = EpilogueWork::kFull>
void launch_fused_qkv_gemm(const FusedQkvKernelArgs& args, Stream stream);

}  // namespace qkvfuse::cuda
