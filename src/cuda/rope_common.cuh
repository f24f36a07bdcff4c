// rope_common.cuh: device code shared by the three QK-norm + rotary kernels (forward, bf16
// backward, fused FP8 backward). Internal.
//
// Row geometry. A row (one input head of one token: D bf16 values, D a multiple of 8) is split
// into D/8 chunks of 8 elements, 16 bytes of bf16: one LDG.128 / STG.128 each. A lane group of G
// consecutive lanes (G = 4, 8 or 16, a power of two dividing 32) owns a row; lane l of the group
// holds chunks l, l + G, ..., l + (C-1)G, so that for every chunk slot the G lanes touch G*16
// contiguous bytes (full 32-byte sectors, coalesced). The row sums (sum x^2 and sum dn*n) are a
// per-lane partial over 8*C values followed by a log2(G)-step xor-shuffle butterfly inside the
// group; every lane ends with the same bits (a + b == b + a in IEEE arithmetic), so the result is
// deterministic and identical across the group. Widths that are not 8*G*C exactly use the next
// larger geometry with the missing chunks masked (loads return 0, stores are skipped). D = 96, a
// real model width that no power-of-two group holds in one chunk per lane, is the kernel's choice
// (Width96): 16 lanes x 1 chunk with 12 lanes active keeps 16 lanes' worth of loads per row and
// shares each factor chunk among the K rows of a unit, but a quarter of every warp's lanes and
// load slots idle; 4 lanes x 3 chunks keeps every lane busy, at the price of one row per unit in
// the row kernels (K * C <= 4: the factor chunks are loaded once per row, not per K rows) and of
// a row held by 4 lanes only.
//
// Rounding. The CPU backend is the contract: the element-wise formulas of SPEC.md are evaluated
// with explicitly rounded fp32 operations (__fmul_rn / __fadd_rn / __fdiv_rn / __fsqrt_rn, and
// UniformDivisor, which is __fdiv_rn bit for bit), in the CPU's order, so nvcc's FMA contraction
// and any fast-math flag cannot change them; the only difference from the CPU is the order of the
// fp32 row sums (sum x^2 and sum dn*n).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

#include "cuda/check.hpp"
#include "cuda/device_math.cuh"
#include "cuda/static_switch.hpp"
#include "qkvfuse/error.hpp"
#include "qkvfuse/numeric.hpp"

namespace qkvfuse::cuda::rope {

// ------------------------------------------------------------------------------------------------
// Row geometry and the head-width switch
// ------------------------------------------------------------------------------------------------

/// G lanes per row, C 16-byte chunks per lane: rows up to 8*G*C elements.
template <int G_, int C_>
struct RowGeometry {
  static constexpr int G = G_;
  static constexpr int C = C_;
  static constexpr int kMaxWidth = 8 * G * C;
  static_assert(G == 4 || G == 8 || G == 16,
                "a lane group is 4, 8 or 16 lanes: a power of two, so that the xor-shuffle "
                "reduction stays inside the group and groups tile a warp");
  static_assert(C >= 1 && C <= 4, "1 to 4 chunks of 8 elements per lane (registers)");
};

inline constexpr int kMinHeadWidth = 32;
inline constexpr int kMaxHeadWidth = 256;

/// How a kernel runs D = 96 (see the header): each kernel states its choice at its call of
/// kernel_switch, so that the geometry of every kernel is an A/B-able, per-kernel decision.
enum class Width96 {
  kMasked16x1,  ///< RowGeometry<16, 1>, 12 of 16 lanes active
  kFull4x3,     ///< RowGeometry<4, 3>, every lane active
};

/// Calls f(RowGeometry<G, C>{}) for the geometry serving head width D. Exact geometries for 32
/// (4 lanes x 1 chunk), 64 (8 x 1), 128 (16 x 1) and 256 (16 x 2), and for 96 under
/// Width96::kFull4x3 (4 x 3); every other multiple of 8 in [32, 256] runs on the next larger one,
/// masked (96 under Width96::kMasked16x1: 16 x 1 with 12 lanes active; 72 .. 88 stay on 16 x 1
/// either way: on 4 x 3 they would be masked too). Other widths never get here: rope_paths.hpp
/// sends them (and rows not 16-byte aligned) to the element-pair kernels of rope_generic.cu.
template <Width96 kWidth96, typename F>
void head_width_switch(const char* op, int64_t D, F&& f) {
  QKVF_CHECK(D % 8 == 0 && D >= kMinHeadWidth && D <= kMaxHeadWidth, op,
             " (CUDA): unsupported head width D = ", D,
             "; the CUDA kernels take D a multiple of 8 in [32, 256] (16-byte vector rows)");
  switch (D / 8) {
    case 4: f(RowGeometry<4, 1>{}); break;                                  // 32
    case 5: case 6: case 7: case 8: f(RowGeometry<8, 1>{}); break;          // 40 .. 64
    case 12:                                                                // 96
      if constexpr (kWidth96 == Width96::kFull4x3) {
        f(RowGeometry<4, 3>{});
      } else {
        f(RowGeometry<16, 1>{});
      }
      break;
    case 9: case 10: case 11: case 13: case 14: case 15: case 16:
      f(RowGeometry<16, 1>{}); break;                                       // 72 .. 128
    case 17: case 18: case 19: case 20: case 21: case 22: case 23: case 24:
    case 25: case 26: case 27: case 28: case 29: case 30: case 31: case 32:
      f(RowGeometry<16, 2>{}); break;                                       // 136 .. 256
    default:
      QKVF_FAIL(op, " (CUDA): no kernel for head width D = ", D);
  }
}

/// Whether the kernels have a full-width form for Geom: rows of exactly 8GC elements (32, 64, 128,
/// 256; every model width but 96), a power of two. In that form D is a compile-time constant:
/// no chunk is masked, the offsets that depend on D fold, and each division of a row sum by D is
/// one FMUL (PowerOfTwoWidth) instead of UniformDivisor's 5-12 instructions. On the H200 against
/// the run-time width (bench/results/2026-11-30_4933b51_h200_full_width_ab.txt): the key-offset
/// bf16 backward 4.8 % faster at D = 128 and 5.4 % at D = 64, the FP8 backward 0.2-2.7 %, the
/// forward (memory-bound) unchanged within 1 %; the masked kernels keep their SASS.
template <class Geom>
constexpr bool has_full_width() {
  return (Geom::kMaxWidth & (Geom::kMaxWidth - 1)) == 0;
}

/// Host side: f(std::true_type{}) when rows of width D take Geom's full-width form, else
/// f(std::false_type{}). Each form is its own kernel (own register allocation).
template <class Geom, typename F>
void full_width_switch(int64_t D, F&& f) {
  if constexpr (has_full_width<Geom>()) {
    if (D == Geom::kMaxWidth) return f(std::true_type{});
  }
  f(std::false_type{});
}

/// Device side: the row width the kernel computes with, and the divisor of its row sums.
template <class Geom, bool kFullWidth>
__device__ __forceinline__ int row_width(int head_dim) {
  return kFullWidth ? Geom::kMaxWidth : head_dim;
}
template <class Geom, bool kFullWidth>
__device__ __forceinline__ auto row_width_divisor(int D) {
  if constexpr (kFullWidth) {
    return PowerOfTwoWidth<Geom::kMaxWidth>{};
  } else {
    return UniformDivisor{float(D)};
  }
}

/// The four compile-time choices every vector rope kernel is instantiated over, from their
/// runtime values: f(Geom{}, FullWidth{}, KeyOffset{}, TypeTag<FactorT>{}) with Geom from
/// head_width_switch (D = 96 as kWidth96 says), FullWidth from full_width_switch and the other two
/// from key_offset_factor_switch (static_switch.hpp).
template <Width96 kWidth96, typename F>
void kernel_switch(const char* op, int64_t head_dim, bool key_offset, DType factor_dtype, F&& f) {
  head_width_switch<kWidth96>(op, head_dim, [&](auto geometry) {
    full_width_switch<decltype(geometry)>(head_dim, [&](auto full_width) {
      key_offset_factor_switch(op, key_offset, factor_dtype,
                               [&](auto key_offset_tag, auto factor_tag) {
                                 f(geometry, full_width, key_offset_tag, factor_tag);
                               });
    });
  });
}

// ------------------------------------------------------------------------------------------------
// Global memory access: 16-byte vectors
// ------------------------------------------------------------------------------------------------

/// Read-once stream (the kernel never reads it again): bypass L1 allocation so that the lines
/// other warps do reuse (factor rows, neighbouring grads) stay resident. The inputs are never
/// written during a launch (outputs overlap no input), so the non-coherent path is valid.
__device__ __forceinline__ Vec16 ld_stream(const void* p) {
  Vec16 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
      : "l"(p));
  return v;
}

/// Data read by several warps of the SM close in time (factor rows of a token, which all its
/// heads use; a key grad that is the next token's neighbour): cached in L1.
__device__ __forceinline__ Vec16 ld_cached(const void* p) {
  Vec16 v;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
      : "l"(p));
  return v;
}

/// Asks L2 for the line that holds p (prefetch.global.L2): no register is held and there is no
/// completion to wait for, so the lines a thread will load one token step later, or that the CTA
/// which takes this one's place will load first, are on their way from DRAM while the thread
/// computes. p must lie inside an allocation (the kernels guard the token index).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

/// prefetch_l2 at L2 evict-last priority: the line should outlive the evict-first traffic around
/// it until its load comes.
__device__ __forceinline__ void prefetch_l2_evict_last(const void* p) {
  asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p));
}

/// The L2 cache policy "evict first" for .L2::cache_hint accesses: the value that
/// createpolicy.fractional.L2::evict_first.b64 with fraction 1.0 produces (CUTLASS's
/// CacheHintSm90::EVICT_FIRST). As a constant it costs no register (the policy from createpolicy
/// made ptxas spill in the FP8 backward).
constexpr uint64_t kL2EvictFirst = 0x12F0000000000000ull;

/// ld_stream whose line is the first L2 evicts: read once, never again.
__device__ __forceinline__ Vec16 ld_stream_evict_first(const void* p) {
  Vec16 v;
  asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
      : "l"(p), "l"(kL2EvictFirst));
  return v;
}

__device__ __forceinline__ void st_vec16(void* p, const Vec16& v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.w[0]), "r"(v.w[1]),
               "r"(v.w[2]), "r"(v.w[3])
               : "memory");
}

/// Stores of outputs no kernel of the launch reads again, marked L2 evict-first so that they do
/// not push out lines that are still to be loaded.
__device__ __forceinline__ void st_vec16_evict_first(void* p, const Vec16& v) {
  asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p),
               "r"(v.w[0]), "r"(v.w[1]), "r"(v.w[2]), "r"(v.w[3]), "l"(kL2EvictFirst)
               : "memory");
}

__device__ __forceinline__ void st_u64_evict_first(void* p, uint32_t lo, uint32_t hi) {
  asm volatile("st.global.L2::cache_hint.v2.u32 [%0], {%1, %2}, %3;" ::"l"(p), "r"(lo), "r"(hi),
               "l"(kL2EvictFirst)
               : "memory");
}

__device__ __forceinline__ void st_u32(void* p, uint32_t v) {
  asm volatile("st.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_u64(void* p, uint32_t lo, uint32_t hi) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(lo), "r"(hi) : "memory");
}

__device__ __forceinline__ Vec16 zero_vec16() {
  Vec16 v;
  v.w[0] = v.w[1] = v.w[2] = v.w[3] = 0u;
  return v;
}

/// Stores the 32-bit words w of a bf16 chunk whose element pair (2w, 2w+1) lies in [lo, hi)
/// (element indices inside the chunk; lo and hi even, pairs are never split because rotary_dim
/// is even). A whole chunk goes as one 16-byte store.
__device__ __forceinline__ void st_chunk_range(__nv_bfloat16* p, const Vec16& v, int lo, int hi) {
  if (lo <= 0 && hi >= 8) {
    st_vec16(p, v);
    return;
  }
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    if (2 * w >= lo && 2 * w + 2 <= hi) st_u32(p + 2 * w, v.w[w]);
  }
}

// ------------------------------------------------------------------------------------------------
// Rotary factor chunks: 8 consecutive columns of factor1 or factor2, bf16 or fp32
// ------------------------------------------------------------------------------------------------

template <typename FactorT>
struct FactorChunk;

template <>
struct FactorChunk<__nv_bfloat16> {
  Vec16 raw;
  __device__ __forceinline__ void load(const __nv_bfloat16* p, bool valid) {
    raw = valid ? ld_cached(p) : zero_vec16();
  }
  /// Element i (0..7) as fp32: bf16 is the high half of an fp32, a shift or a mask.
  __device__ __forceinline__ float operator[](int i) const {
    return (i & 1) ? __uint_as_float(raw.w[i >> 1] & 0xffff0000u)
                   : __uint_as_float(raw.w[i >> 1] << 16);
  }
};

template <>
struct FactorChunk<float> {
  Vec16 raw[2];
  __device__ __forceinline__ void load(const float* p, bool valid) {
    raw[0] = valid ? ld_cached(p) : zero_vec16();
    raw[1] = valid ? ld_cached(p + 4) : zero_vec16();
  }
  __device__ __forceinline__ float operator[](int i) const {
    return __uint_as_float(raw[i >> 2].w[i & 3]);
  }
};

// ------------------------------------------------------------------------------------------------
// Row math
// ------------------------------------------------------------------------------------------------

/// The element formulas of SPEC.md sections 1-2, each operation rounded as the CPU backend rounds
/// it. Both the vector kernels and the element-pair kernels (rope_generic.cu) compute with these.
///   rstd = 1 / sqrt(mean(x^2) + eps)
__device__ __forceinline__ float rstd_of_mean(float mean_square) {
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean_square, kRmsNormEps)));
}
///   a*b + c*d: the rotation y[d] = f1[d]*n[d] + f2[d]*n[d^1] and its gradient
///   dn[d] = f1[d]*g[d] + f2[d^1]*g[d^1]. forward_chunk and backward_row write it out instead of
///   calling it: the call (the same operations) changed ptxas's instruction schedule of the
///   measured forward and FP8 kernels, whose SASS is kept as benchmarked.
__device__ __forceinline__ float rotate(float a, float b, float c, float d) {
  return __fadd_rn(__fmul_rn(a, b), __fmul_rn(c, d));
}
///   key offset, stationary key dims: dn = g_next + (t == 0 ? g : 0)
__device__ __forceinline__ float shifted_grad(float g_next, float g, bool first_token) {
  return __fadd_rn(g_next, first_token ? g : 0.0f);
}
///   dx = rstd * (dn - n * correction), correction = sum(dn * n) / D
__device__ __forceinline__ float norm_grad(float rstd, float dn, float n, float correction) {
  return __fmul_rn(rstd, __fsub_rn(dn, __fmul_rn(n, correction)));
}

/// Packed feature (row of grad_t, column of grad_row) of feature f of logical head h's slice
/// [Q row (D) | K row (D) | V row (Dv)] in the fused FP8 backward's layout (SPEC.md section 3):
/// Q h*D + d, K (H + h)*D + d, V 2*H*D + h*Dv + d.
__device__ __forceinline__ int64_t packed_feature(int f, int h, int H, int D, int Dv) {
  if (f < D) return int64_t(h) * D + f;
  if (f < 2 * D) return int64_t(H + h) * D + (f - D);
  return 2 * int64_t(H) * D + int64_t(h) * Dv + (f - 2 * D);
}

/// Sum over the G lanes of a lane group (aligned, consecutive lanes). Must be reached by all 32
/// lanes of the warp (full mask): the kernels keep their loops warp-uniform and mask work
/// instead of branching around it.
template <int G>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int offset = G / 2; offset > 0; offset >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

/// rstd = 1 / sqrt(sum(x*x) / D + eps) of a row held as bf16 chunks, true fp32 division and
/// square root. The fp32 values are re-derived from the bf16 bits where they are needed (a shift
/// or a mask), so no fp32 copy of the row stays live across the shuffles.
/// kBranchFree: the same bits through divide_by_width and reciprocal_sqrt_rn, with no branch
/// (backward_row's choice; the forward keeps the branches: without them ptxas spilled in some of
/// its instantiations at their register budgets). `width` divides by D: UniformDivisor, or
/// PowerOfTwoWidth in the full-width kernels (row_width_divisor).
template <int G, int C, bool kBranchFree = false, typename Width>
__device__ __forceinline__ float row_rstd(const Vec16 (&x_raw)[C], const Width& width) {
  float partial = 0.0f;
#pragma unroll
  for (int c = 0; c < C; ++c) {
    float x[8];
    bf16x8_to_float(x_raw[c], x);
#pragma unroll
    for (int i = 0; i < 8; ++i) partial = fmaf(x[i], x[i], partial);
  }
  const float sum = group_sum<G>(partial);
  if constexpr (kBranchFree) {
    // rstd_of_mean(width(sum)) without a branch (device_math.cuh): mean + eps >= eps.
    return reciprocal_sqrt_rn(__fadd_rn(divide_by_width(sum, width), kRmsNormEps));
  } else {
    return rstd_of_mean(width(sum));
  }
}

/// Forward of one chunk: n = x * rstd, y[d] = f1[d] * n[d] + f2[d] * n[d ^ 1], both as bf16.
template <typename FactorT>
__device__ __forceinline__ void forward_chunk(const Vec16& x_raw, float rstd,
                                              const FactorChunk<FactorT>& f1,
                                              const FactorChunk<FactorT>& f2, Vec16& y_out,
                                              Vec16* n_out) {
  float x[8];
  bf16x8_to_float(x_raw, x);
  float n[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) n[i] = __fmul_rn(x[i], rstd);
  float y[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    y[i] = __fadd_rn(__fmul_rn(f1[i], n[i]), __fmul_rn(f2[i], n[i ^ 1]));  // rotate, spelled out
  }
  y_out = float_to_bf16x8(y);
  if (n_out != nullptr) *n_out = float_to_bf16x8(n);
}

/// Backward of one row (SPEC.md section 2):
///   dn[d] = f1[d] * g[d] + f2[d ^ 1] * g[d ^ 1]
///   key offset key rows, d >= rotary_dim: dn[d] = g_next[d] + (t == 0 ? g[d] : 0)
///   dx    = rstd * (dn - n * (sum(dn * n) / D))
/// `stationary_from` is, per chunk, the first element index (0..8) at or beyond rotary_dim;
/// those elements take the key-offset path when `shift_row` (a key row under key offset), and
/// only they read `g_next`.
/// kBranchFree: the row's divisions and square root without branches (divide_by_width,
/// reciprocal_sqrt_rn: the same bits), so that ptxas can schedule across the row scalars. A
/// per-kernel choice, as measured on the H200 (the kernels' launch code says which and why).
/// `width` as in row_rstd.
template <int G, int C, bool kBranchFree, typename FactorT, typename Width>
__device__ __forceinline__ void backward_row(const Vec16 (&g_raw)[C], const Vec16 (&x_raw)[C],
                                             const FactorChunk<FactorT> (&f1)[C],
                                             const FactorChunk<FactorT> (&f2)[C],
                                             const Vec16 (&g_next_raw)[C],
                                             const int (&stationary_from)[C], bool shift_row,
                                             bool first_token, const Width& width,
                                             float (&dx)[C][8]) {
  // One chunk per lane: keep n (8 registers); wider rows recompute it from the bf16 bits.
  constexpr bool kKeepN = C == 1;
  const float rstd = row_rstd<G, C, kBranchFree>(x_raw, width);
  float kept_n[kKeepN ? C : 1][8];
  float partial = 0.0f;
#pragma unroll
  for (int c = 0; c < C; ++c) {
    float x[8];
    float g[8];
    float g_next[8];
    bf16x8_to_float(x_raw[c], x);
    bf16x8_to_float(g_raw[c], g);
    bf16x8_to_float(g_next_raw[c], g_next);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float n = __fmul_rn(x[i], rstd);
      if constexpr (kKeepN) kept_n[c][i] = n;
      // rotate(f1[c][i], g[i], f2[c][i ^ 1], g[i ^ 1]), spelled out: see rotate.
      const float rotated = __fadd_rn(__fmul_rn(f1[c][i], g[i]), __fmul_rn(f2[c][i ^ 1], g[i ^ 1]));
      const float shifted = shifted_grad(g_next[i], g[i], first_token);
      dx[c][i] = shift_row && i >= stationary_from[c] ? shifted : rotated;  // dn for now
      partial = fmaf(dx[c][i], n, partial);
    }
  }
  const float sum = group_sum<G>(partial);
  float correction;
  if constexpr (kBranchFree) {
    correction = divide_by_width(sum, width);
  } else {
    correction = width(sum);
  }
#pragma unroll
  for (int c = 0; c < C; ++c) {
    float x[8];
    bf16x8_to_float(x_raw[c], x);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float n = kKeepN ? kept_n[kKeepN ? c : 0][i] : __fmul_rn(x[i], rstd);
      dx[c][i] = norm_grad(rstd, dx[c][i], n, correction);
    }
  }
}

/// Element index inside the chunk starting at d0 from which dims are stationary (>= rotary_dim),
/// clamped to [0, 8]: 8 means the whole chunk rotates.
__device__ __forceinline__ int stationary_start(int d0, int rotary_dim) {
  return min(8, max(0, rotary_dim - d0));
}

// ------------------------------------------------------------------------------------------------
// Work decomposition of the row kernels (forward and bf16 backward), host side
// ------------------------------------------------------------------------------------------------

/// Threads per block of the row kernels: 4 warps (small blocks: fine-grained occupancy).
inline constexpr int kRowThreads = 128;

/// The 2H input heads of a token are split into `row_sets` sets {s, s + NS, s + 2NS, ...}, NS
/// even, so a set holds heads of one parity: under paired placement they all read the same half
/// of the factor row. A work unit is one set of one token; unit u = t * NS + s is owned by one
/// lane group, which issues every load of the unit (its K rows and the token's factor chunks)
/// before any math, computes, stores and is done. The grid is simply one lane group per unit
/// (no persistence, no token walk): at the model's sizes that is ~10^5 warps, the block
/// scheduler keeps every SM full, nothing waits on a serial chain of loads, and the tail is one
/// short block. Units are token-major, so the NS groups that share a token's factor row are
/// adjacent (one coalesced request, then L1 hits).
struct RowWork {
  int row_sets = 2;      ///< NS
  int64_t units = 1;     ///< T * NS
  int64_t blocks = 1;    ///< grid size: ceil(units / groups per block)
};

inline RowWork plan_row_work(int64_t tokens, int64_t heads2, int rows_per_group, int group_lanes) {
  RowWork work;
  int64_t sets = (heads2 + rows_per_group - 1) / rows_per_group;  // NS * K >= 2H: every head
  sets = sets < 2 ? 2 : sets + (sets & 1);
  work.row_sets = int(sets);
  work.units = tokens * sets;
  const int64_t groups_per_block = kRowThreads / group_lanes;
  work.blocks = (work.units + groups_per_block - 1) / groups_per_block;
  QKVF_CHECK(work.blocks <= int64_t(0x7fffffff), "qk_norm_rope (CUDA): ", tokens,
             " tokens need more blocks than one launch holds");
  return work;
}

}  // namespace qkvfuse::cuda::rope
