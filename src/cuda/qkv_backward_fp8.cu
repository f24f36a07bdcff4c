// qkv_backward_fp8.cu: the fused backward of the packed QKV projection output into FP8, in the
// two layouts the dgrad and wgrad GEMMs read (SPEC.md section 3), CUDA backend.
//
// Math, per token t and logical head h, fp32:
//   Q and K rows: dx of the norm/rotary backward (SPEC.md section 2, as qk_norm_rope_backward.cu)
//                 rounded to bf16, then e4m3(dx_bf16 / grad_scale) (true division, satfinite)
//   V row:        e4m3(grad_v[t, h] / grad_scale)
//   grad_row[t, f] and grad_t[f, t] for the features f = [Q h*D+d | K (H+h)*D+d | V 2HD+h*Dv+d].
//
// Design. Bytes at T = 49152, H = 6, D = Dv = 128: read grad q/k/v and qk (377 MB) and the factor
// rows, write the two e4m3 copies (226 MB); the kernel must touch each once, coalesced.
// - One CTA (256 threads) owns a tile of kTileTokens = 128 tokens x one logical head h: the
//   h-th Q row, K row and V row of each token, F = 2D + Dv features. The grid runs head-fastest,
//   so the H CTAs that read the same factor rows run together and the rows come from L2 after
//   the first (the factors are about 4% of the bytes).
// - Q/K rows are computed in registers by lane groups of G lanes (rope_common.cuh: 16-byte
//   loads, shuffle row sums; the Q and K rows of a token share its factor chunks). V is an
//   element-wise convert over the tile. Each lane's 8 e4m3 bytes of a chunk go straight to
//   grad_row (8-byte stores, contiguous across the group: full sectors) and into a shared-memory
//   copy of the tile, [token][feature] e4m3, 128 x roundup(F, 128) bytes (48 KB at F = 384).
// - After one barrier the tile leaves transposed, as TransformerEngine's cast-transpose does:
//   a thread reads a 16 token x 4 feature block (16 x 4-byte reads), transposes it in registers
//   (8 byte-permutes per 4x4), and writes 4 feature rows of 16 tokens with 16-byte stores; the 8
//   consecutive lanes of a feature cover its 128 tokens, so each warp store is 4 full 128-byte
//   lines of grad_t.
// - Shared-memory banks: the word w of tile row r lives at r*pitch + (w ^ swizzle(r)), with the
//   pitch a multiple of 128 bytes and swizzle(r) = ((r/16 mod 8) << 2) ^ ((r mod 4) bit-reversed
//   into bits 3-4). The transposed read (8 token blocks x 4 feature words per warp and
//   instruction) then hits 32 distinct banks, and the 8-byte row writes of groups of 4 or 8
//   lanes (two or four tokens per half-warp) land on disjoint banks.
// - A CTA has one token step's loads in flight at a time (64 registers: 4 CTAs per SM), and no
//   load at all while it waits at its barrier and stores grad_t. L2 prefetches, which hold no
//   register, cover part of that: the next step's rows during the current one, and, in the
//   kernels where it measured faster, the V rows and the first step of the CTA that will take
//   this one's place (Fp8Prefetch). Read-once loads and the outputs are marked L2 evict-first,
//   the prefetched rows evict-last, so that 226 MB of stores do not evict them before use.
// - When T is not a multiple of 16 the rows of grad_t are not 16-byte aligned: the same blocks
//   are written byte by byte (correct, slower; the model's T is a multiple of 128).
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>

#include "backend.hpp"
#include "cuda/check.hpp"
#include "cuda/device_math.cuh"
#include "cuda/rope_common.cuh"
#include "cuda/rope_paths.hpp"
#include "cuda/static_switch.hpp"

namespace qkvfuse::cuda {
namespace {

using rope::FactorChunk;

// 128 tokens per CTA: 64-token tiles (twice the CTAs, a finer tail) measured the same or up to
// 3 % slower on the H200 (bench/results/2026-11-30_23b89cc_h200_fp8_tile_ab.txt).
constexpr int kFp8Threads = 256;
constexpr int kTileTokens = 128;             // tokens per CTA: one full 128-byte line of grad_t
constexpr int kTokenBlock = 16;              // tokens per 16-byte grad_t store
constexpr int kTokenBlocks = kTileTokens / kTokenBlock;
static_assert(kTileTokens % kTokenBlock == 0 && kTokenBlocks == 8,
              "the shared-memory swizzle spreads 8 token blocks over the 32 banks");
static_assert(kFp8Threads % 32 == 0, "whole warps");

/// Everything the fused FP8 backward kernel reads. Strides in elements (multiples of 8).
struct QkvBackwardFp8KernelParams {
  const __nv_bfloat16* grad_q;  ///< [T, H, D] ([2T, H/2, D] paired): (t', h', d) at
                                ///< t'*grad_q_stride_t + h'*grad_q_stride_h + d
  int64_t grad_q_stride_t;
  int64_t grad_q_stride_h;
  const __nv_bfloat16* grad_k;  ///< same shape as grad_q, its own strides
  int64_t grad_k_stride_t;
  int64_t grad_k_stride_h;
  const __nv_bfloat16* grad_v;  ///< [T, H, Dv]: (t, h, d) at t*grad_v_stride_t + h*grad_v_stride_h + d
  int64_t grad_v_stride_t;
  int64_t grad_v_stride_h;
  const __nv_bfloat16* qk;      ///< [T, 2H, D]: (t, h2, d) at t*qk_stride_t + h2*qk_stride_h + d
  int64_t qk_stride_t;
  int64_t qk_stride_h;
  const void* factor1;          ///< [T, D] ([T, 2D] paired), bf16 or fp32 (FactorT)
  const void* factor2;          ///< same shape and dtype
  int64_t factor1_stride_t;
  int64_t factor2_stride_t;
  const float* grad_scale;      ///< fp32 scalar in device memory
  uint8_t* grad_row;            ///< e4m3 [T, qkv_dim] row-major contiguous
  uint8_t* grad_t;              ///< e4m3 [qkv_dim, T] row-major contiguous
  int64_t tokens;               ///< T >= 1
  int64_t qkv_dim;              ///< 2*H*D + H*Dv
  int num_heads;                ///< H
  int head_dim;                 ///< D, multiple of 8 in [32, 256]
  int v_dim;                    ///< Dv, multiple of 8 in [8, 256]
  int rotary_dim;               ///< key offset: dims >= rotary_dim of keys; even, in [0, D]
  bool paired;
  int tile_pitch;               ///< bytes per token row of the shared tile: roundup(2D + Dv, 128)
  int resident_blocks;          ///< CTAs the device holds at once for this launch (>= 1)
};

/// Register budget, as resident 256-thread CTAs per SM: 4 (<= 64 registers; 4 x 48 KB of tile
/// fit the 227 KB of shared memory) with one chunk per lane and bf16 factors, so that 32 warps
/// per SM keep their loads in flight and the CTAs' phases (loads, transposed stores) overlap;
/// fp32 factor chunks take 8 more registers (3: <= 80); wider rows hold 2C more 16-byte chunks
/// per token (Q and K rows, g and x), so they get 2 (<= 128 registers). The branch-free kernels
/// with bf16 factors (16 lanes; 8 and 4 lanes under key offset) spill 12-16 bytes at 64
/// registers; at 3 CTAs per SM (80 registers, no spill) they measured 1-2 % slower
/// (bench/results/2026-11-30_289d2bb_h200_branch_free_ab.txt, fp8_b3). The others spill nothing.
template <int C, typename FactorT>
constexpr int fp8_min_blocks() {
  if constexpr (C == 1) return sizeof(FactorT) == 2 ? 4 : 3;
  return 2;
}

// ------------------------------------------------------------------------------------------------
// Shared-memory tile addressing
// ------------------------------------------------------------------------------------------------

/// XOR pattern of tile row r (bits 2-4 of the word index): token block r/16 in bits 2-4, r mod 4
/// bit-reversed into bits 3-4. Bit 0 is never touched, so 8-byte pairs stay adjacent.
__device__ __forceinline__ int tile_swizzle(int row) {
  return (((row >> 4) & 7) << 2) ^ (((row & 1) << 4) | ((row & 2) << 2));
}

/// Byte address (offset into the tile) of word `word` of row `row`.
__device__ __forceinline__ uint32_t tile_offset(int row, int word, int pitch) {
  return uint32_t(row * pitch + 4 * (word ^ tile_swizzle(row)));
}

__device__ __forceinline__ void sts_u64(uint32_t addr, uint32_t lo, uint32_t hi) {
  asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(addr), "r"(lo), "r"(hi) : "memory");
}

__device__ __forceinline__ uint32_t lds_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ void st_u8(void* p, uint32_t v) {
  asm volatile("st.global.u8 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// ------------------------------------------------------------------------------------------------
// The kernel
// ------------------------------------------------------------------------------------------------

/// How a tile's e4m3 codes divide by the grad scale: E4m3Scaler's own fast / general test on
/// every call, or the fast or the general division as the kernel decided once for the launch.
enum class ScaleDivision { kTestPerCall, kFast, kGeneral };

template <ScaleDivision kDivision>
__device__ __forceinline__ void encode_e4m3(const E4m3Scaler& scale, const float (&v)[8],
                                            uint32_t& lo, uint32_t& hi) {
  if constexpr (kDivision == ScaleDivision::kTestPerCall) {
    scale(v, lo, hi);
  } else {
    scale.template codes<kDivision == ScaleDivision::kFast>(v, lo, hi);
  }
}

/// Branch-free Q/K rows (rope::backward_row) and the scale test hoisted out of the token loop:
/// with no branch left in the loop, ptxas overlaps the Q row's serial chain (sum, shuffles,
/// divisions) with the K row's. Where it measured faster on the H200: 16-lane rows (D = 128 key
/// offset 73.4 against 70.8 % of copy, plain and paired equal; D = 96 65.2 / 65.7 / 63.7 against
/// 64.1 / 64.7 / 60.8 %) and key offset at D = 64 (71.6 against 70.5 %); D = 64 plain and paired
/// lost 2-3 % with it (bench/results/2026-11-30_289d2bb_h200_branch_free_ab.txt).
template <int G, bool kKeyOffset>
constexpr bool fp8_branch_free() {
  return G == 16 || kKeyOffset;
}

/// L2 prefetches of the token loop (rope::prefetch_l2; they hold no register). Each thread issues
/// the next token step's Q/K rows and factor chunks after its current loads, so that every step
/// after the first loads from L2. Where it measured faster, the kernel also fetches the V rows
/// during the second half of the loop and, after it, the first token step of the CTA that will
/// take this one's place (blockIdx + resident CTAs: blocks start in index order as others
/// retire). On the H200 (bench/results/2026-11-30_421a627_h200_fp8_prefetch_ab.txt), against no
/// prefetch: the next step's rows and factors 5-8 % faster at D = 64 and 128, 2-4 % at D = 96 (two
/// steps ahead spilled and was slower); the next CTA's first step and the V rows another 0-3 % for
/// plain and paired rows; under key offset the next CTA's step was 5 % slower and the V rows 2.5 %
/// faster at D = 64 (G = 8) but 3 % slower at D = 96 and 128; the tile's V rows fetched at its
/// start (bulk prefetch) were slower everywhere.
///
/// L2 eviction priority. The kernel reads its inputs once and writes 226 MB of outputs that no
/// kernel of the launch reads: those loads and stores are marked evict-first, and the Q/K rows
/// prefetched for the next step evict-last, so that the stream of stores does not push them out
/// of L2 before their loads come; the factor rows (read by the H CTAs of a tile) and the V-row
/// prefetches keep the normal priority. 1-2.6 % faster in every mode and width than without the
/// hints (bench/results/2026-11-30_8cc1e2f_h200_fp8_evict_ab.txt: D = 128 plain 0.1841 against
/// 0.1879 ms); evict-first loads or stores alone gained less than half of that.
template <int G, bool kKeyOffset>
struct Fp8Prefetch {
  static constexpr bool kNextCta = !kKeyOffset;
  static constexpr bool kVRows = !kKeyOffset || G == 8;
};

/// The Q and K rows of logical head h: where token 0's rows start and how far apart consecutive
/// tokens are (grad_q and grad_k at their output position, plain (t, h), paired
/// (2t + h / (H/2), h mod (H/2))), and the head's factor columns.
template <typename FactorT>
struct QkRowBases {
  const __nv_bfloat16* gq;
  const __nv_bfloat16* gk;
  int64_t gq_step;
  int64_t gk_step;
  const __nv_bfloat16* xq;
  const __nv_bfloat16* xk;
  const FactorT* factor1;
  const FactorT* factor2;

  __device__ __forceinline__ QkRowBases(const QkvBackwardFp8KernelParams& p, int h) {
    const int H = p.num_heads;
    const int half = H / 2;
    const int sub_token = p.paired && h >= half ? 1 : 0;
    const int out_head = h - sub_token * half;
    gq_step = p.paired ? 2 * p.grad_q_stride_t : p.grad_q_stride_t;
    gk_step = p.paired ? 2 * p.grad_k_stride_t : p.grad_k_stride_t;
    gq = p.grad_q + sub_token * p.grad_q_stride_t + int64_t(out_head) * p.grad_q_stride_h;
    gk = p.grad_k + sub_token * p.grad_k_stride_t + int64_t(out_head) * p.grad_k_stride_h;
    xq = p.qk + int64_t(h) * p.qk_stride_h;
    xk = p.qk + int64_t(H + h) * p.qk_stride_h;
    const int factor_offset = p.paired ? (h & 1) * p.head_dim : 0;
    factor1 = static_cast<const FactorT*>(p.factor1) + factor_offset;
    factor2 = static_cast<const FactorT*>(p.factor2) + factor_offset;
  }

  /// L2 prefetch of token t's chunks at d0 (the lines this lane will load), if t exists.
  template <int C>
  __device__ __forceinline__ void prefetch(const QkvBackwardFp8KernelParams& p, int64_t t,
                                           const int (&d0)[C], const bool (&chunk_ok)[C]) const {
    if (t >= p.tokens) return;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      if (!chunk_ok[c]) continue;
      rope::prefetch_l2_evict_last(gq + t * gq_step + d0[c]);
      rope::prefetch_l2_evict_last(xq + t * p.qk_stride_t + d0[c]);
      rope::prefetch_l2_evict_last(gk + t * gk_step + d0[c]);
      rope::prefetch_l2_evict_last(xk + t * p.qk_stride_t + d0[c]);
      rope::prefetch_l2(factor1 + t * p.factor1_stride_t + d0[c]);
      rope::prefetch_l2(factor2 + t * p.factor2_stride_t + d0[c]);
    }
  }
};

/// The kernel's work on its tile.
template <class Geom, bool kKeyOffset, typename FactorT, bool kBranchFree,
          ScaleDivision kDivision, bool kFullWidth>
__device__ __forceinline__ void fp8_tile(const QkvBackwardFp8KernelParams& p,
                                         const E4m3Scaler& scale) {
  constexpr int G = Geom::G;
  constexpr int C = Geom::C;
  constexpr int kGroups = kFp8Threads / G;
  constexpr int kTokensPerGroup = kTileTokens / kGroups;
  static_assert(kTileTokens % kGroups == 0, "lane groups must tile the token tile evenly");

  extern __shared__ __align__(128) uint8_t tile[];
  const uint32_t tile_base = uint32_t(__cvta_generic_to_shared(tile));

  const int H = p.num_heads;
  const int D = rope::row_width<Geom, kFullWidth>(p.head_dim);
  const int Dv = p.v_dim;
  const int h = int(blockIdx.x % unsigned(H));
  const int64_t t0 = int64_t(blockIdx.x / unsigned(H)) * kTileTokens;
  const auto width = rope::row_width_divisor<Geom, kFullWidth>(D);
  const int pitch = p.tile_pitch;

  // ---- Phase A1: Q and K rows -------------------------------------------------------------
  {
    const int group = int(threadIdx.x) / G;
    const int lane = int(threadIdx.x) % G;
    int d0[C];
    bool chunk_ok[C];
    int stationary_from[C];
#pragma unroll
    for (int c = 0; c < C; ++c) {
      d0[c] = 8 * (c * G + lane);
      chunk_ok[c] = d0[c] < D;
      stationary_from[c] = kKeyOffset ? rope::stationary_start(d0[c], p.rotary_dim) : 8;
    }
    const QkRowBases<FactorT> bases(p, h);
    const int64_t q_feature = int64_t(h) * D;
    const int64_t k_feature = int64_t(H + h) * D;
    // V rows in the loop's second half: at step j >= kTokensPerGroup / 2 the group fetches the
    // rows of its tokens of steps j - kTokensPerGroup / 2 and j, one 128-byte line per lane.
    auto prefetch_v_row = [&](const int64_t tv) {
      if (tv >= p.tokens) return;
      const __nv_bfloat16* v_row =
          p.grad_v + int64_t(h) * p.grad_v_stride_h + tv * p.grad_v_stride_t;
      for (int d = 64 * lane; d < Dv; d += 64 * G) rope::prefetch_l2(v_row + d);
    };

#pragma unroll 1
    for (int j = 0; j < kTokensPerGroup; ++j) {  // block-uniform trip count
      const int row = group + kGroups * j;       // consecutive groups: consecutive tokens
      const int64_t t = t0 + row;
      const bool token_ok = t < p.tokens;
      if (Fp8Prefetch<G, kKeyOffset>::kVRows && j >= kTokensPerGroup / 2) {
        prefetch_v_row(t - kTileTokens / 2);
        prefetch_v_row(t);
      }

      FactorChunk<FactorT> f1[C];
      FactorChunk<FactorT> f2[C];
#pragma unroll
      for (int c = 0; c < C; ++c) {
        f1[c].load(bases.factor1 + t * p.factor1_stride_t + d0[c], token_ok && chunk_ok[c]);
        f2[c].load(bases.factor2 + t * p.factor2_stride_t + d0[c], token_ok && chunk_ok[c]);
      }

      // One row: the Q row (part 0) or the K row (part 1) of the token; both share the factor
      // chunks. With one chunk per lane the loads of both rows are issued before either is
      // computed (6 16-byte loads in flight per lane); wider rows go one row at a time.
      struct RowLoads {
        Vec16 g[C], x[C], g_next[C];
      };
      auto load_row = [&](const int part, RowLoads& r) {
        const __nv_bfloat16* g_row =
            part == 0 ? bases.gq + t * bases.gq_step : bases.gk + t * bases.gk_step;
        const __nv_bfloat16* x_row = (part == 0 ? bases.xq : bases.xk) + t * p.qk_stride_t;
        const bool next_ok = kKeyOffset && part == 1 && token_ok && t + 1 < p.tokens;
#pragma unroll
        for (int c = 0; c < C; ++c) {
          const bool ok = token_ok && chunk_ok[c];
          // Key offset: grad_k rows are read again as the previous token's g_next (by the
          // neighbouring lane group, at about the same time): keep them in L1.
          r.g[c] = ok ? (part == 1 && kKeyOffset ? rope::ld_cached(g_row + d0[c])
                                                 : rope::ld_stream_evict_first(g_row + d0[c]))
                      : rope::zero_vec16();
          if constexpr (G == 16) {
            // The same load with its address named first: at G = 16 ptxas then issues the six
            // loads of a token step back to back instead of over ~160 instructions, 0.5-2.4 %
            // faster; at G = 8 under key offset this source spilled more, so the other widths
            // keep the SASS they were measured with
            // (bench/results/2026-11-30_c3427a5_h200_fp8_xsrc_abs_ab.txt).
            const __nv_bfloat16* x_src = x_row + d0[c];
            r.x[c] = ok ? rope::ld_stream_evict_first(x_src) : rope::zero_vec16();
          } else {
            r.x[c] = ok ? rope::ld_stream_evict_first(x_row + d0[c]) : rope::zero_vec16();
          }
          r.g_next[c] = next_ok && chunk_ok[c] && stationary_from[c] < 8
                            ? rope::ld_cached(g_row + bases.gk_step + d0[c])
                            : rope::zero_vec16();
        }
      };
      auto emit_row = [&](const int part, const RowLoads& r) {
        float dx[C][8];
        rope::backward_row<G, C, kBranchFree>(r.g, r.x, f1, f2, r.g_next, stationary_from,
                                              kKeyOffset && part == 1, t == 0, width, dx);
        if (!token_ok) return;
        uint8_t* out_row = p.grad_row + t * p.qkv_dim + (part == 0 ? q_feature : k_feature);
#pragma unroll
        for (int c = 0; c < C; ++c) {
          if (!chunk_ok[c]) continue;
          // Round to bf16 first (the aten chain materialized the QK gradient in bf16).
          float rounded[8];
          bf16x8_to_float(float_to_bf16x8(dx[c]), rounded);
          uint32_t lo, hi;
          encode_e4m3<kDivision>(scale, rounded, lo, hi);
          rope::st_u64_evict_first(out_row + d0[c], lo, hi);
          sts_u64(tile_base + tile_offset(row, (part * D + d0[c]) / 4, pitch), lo, hi);
        }
      };
      if constexpr (C == 1) {
        RowLoads q_row, k_row;
        load_row(0, q_row);
        load_row(1, k_row);
        if (j + 1 < kTokensPerGroup) bases.prefetch(p, t + kGroups, d0, chunk_ok);
        emit_row(0, q_row);
        emit_row(1, k_row);
      } else {
        RowLoads r;
        load_row(0, r);
        if (j + 1 < kTokensPerGroup) bases.prefetch(p, t + kGroups, d0, chunk_ok);
        emit_row(0, r);
        load_row(1, r);
        emit_row(1, r);
      }
    }
    if constexpr (Fp8Prefetch<G, kKeyOffset>::kNextCta) {
      const unsigned next = blockIdx.x + unsigned(p.resident_blocks);
      if (next < gridDim.x) {
        const int next_h = int(next % unsigned(H));
        const int64_t next_t0 = int64_t(next / unsigned(H)) * kTileTokens;
        QkRowBases<FactorT>(p, next_h).prefetch(p, next_t0 + group, d0, chunk_ok);
      }
    }
  }

  // ---- Phase A2: the V row, element-wise ----------------------------------------------------
  {
    const int chunks_per_row = Dv / 8;
    const int tile_chunks = kTileTokens * chunks_per_row;
    // u / chunks_per_row as a multiply-shift: exact for u < 2^12 and divisors <= 32.
    const uint32_t magic = ((1u << 20) + uint32_t(chunks_per_row) - 1) / uint32_t(chunks_per_row);
    const __nv_bfloat16* gv_base = p.grad_v + int64_t(h) * p.grad_v_stride_h;
    const int64_t v_feature = 2 * int64_t(H) * D + int64_t(h) * Dv;
    constexpr int kUnroll = 4;
#pragma unroll 1
    for (int base = int(threadIdx.x); base < tile_chunks; base += kFp8Threads * kUnroll) {
      Vec16 v[kUnroll];
      int rows[kUnroll];
      int cols[kUnroll];
#pragma unroll
      for (int m = 0; m < kUnroll; ++m) {
        const int u = base + m * kFp8Threads;
        rows[m] = int((uint32_t(u) * magic) >> 20);
        cols[m] = 8 * (u - rows[m] * chunks_per_row);
        const bool ok = u < tile_chunks && t0 + rows[m] < p.tokens;
        v[m] = ok ? rope::ld_stream_evict_first(gv_base + (t0 + rows[m]) * p.grad_v_stride_t +
                                                cols[m])
                  : rope::zero_vec16();
      }
#pragma unroll
      for (int m = 0; m < kUnroll; ++m) {
        const int u = base + m * kFp8Threads;
        if (!(u < tile_chunks && t0 + rows[m] < p.tokens)) continue;
        float values[8];
        bf16x8_to_float(v[m], values);
        uint32_t lo, hi;
        encode_e4m3<kDivision>(scale, values, lo, hi);
        rope::st_u64_evict_first(p.grad_row + (t0 + rows[m]) * p.qkv_dim + v_feature + cols[m],
                                 lo, hi);
        sts_u64(tile_base + tile_offset(rows[m], (2 * D + cols[m]) / 4, pitch), lo, hi);
      }
    }
  }

  __syncthreads();

  // ---- Phase B: the transposed copy, 16 tokens x 4 features per thread and step ---------------
  {
    const int feature_words = (2 * D + Dv) / 4;
    const int units = feature_words * kTokenBlocks;
    const bool aligned = (p.tokens % kTokenBlock) == 0;
#pragma unroll 1
    for (int u = int(threadIdx.x); u < units; u += kFp8Threads) {
      const int token_block = u % kTokenBlocks;  // consecutive lanes: consecutive token blocks
      const int word = u / kTokenBlocks;         // 4 features 4*word .. 4*word + 3
      const int64_t t_first = t0 + token_block * kTokenBlock;
      if (t_first >= p.tokens) continue;
      uint32_t in[kTokenBlock];
#pragma unroll
      for (int r = 0; r < kTokenBlock; ++r) {
        in[r] = lds_u32(tile_base + tile_offset(token_block * kTokenBlock + r, word, pitch));
      }
      // 4x4 byte transposes: out[e].w[k] = byte e of in[4k], in[4k+1], in[4k+2], in[4k+3].
      Vec16 out[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t a = in[4 * k], b = in[4 * k + 1], c = in[4 * k + 2], d = in[4 * k + 3];
        const uint32_t ab_lo = __byte_perm(a, b, 0x5140);  // a0 b0 a1 b1
        const uint32_t ab_hi = __byte_perm(a, b, 0x7362);  // a2 b2 a3 b3
        const uint32_t cd_lo = __byte_perm(c, d, 0x5140);
        const uint32_t cd_hi = __byte_perm(c, d, 0x7362);
        out[0].w[k] = __byte_perm(ab_lo, cd_lo, 0x5410);  // a0 b0 c0 d0
        out[1].w[k] = __byte_perm(ab_lo, cd_lo, 0x7632);  // a1 b1 c1 d1
        out[2].w[k] = __byte_perm(ab_hi, cd_hi, 0x5410);
        out[3].w[k] = __byte_perm(ab_hi, cd_hi, 0x7632);
      }
      // Tile feature 4*word + e -> packed feature (parts never straddle a word: D % 8 == 0).
      const int64_t feature = rope::packed_feature(4 * word, h, H, D, Dv);
      uint8_t* dst = p.grad_t + feature * p.tokens + t_first;
      if (aligned) {
#pragma unroll
        for (int e = 0; e < 4; ++e) rope::st_vec16_evict_first(dst + e * p.tokens, out[e]);
      } else {
        const int64_t remaining = p.tokens - t_first;
        const int count = remaining < kTokenBlock ? int(remaining) : kTokenBlock;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
#pragma unroll
          for (int r = 0; r < kTokenBlock; ++r) {  // unrolled: out[] stays in registers
            if (r < count) st_u8(dst + e * p.tokens + r, (out[e].w[r >> 2] >> (8 * (r & 3))) & 0xffu);
          }
        }
      }
    }
  }
}

/// kFullWidth: rows of exactly Geom's full width (rope::has_full_width).
template <class Geom, bool kKeyOffset, typename FactorT, bool kFullWidth>
__global__ void __launch_bounds__(kFp8Threads, fp8_min_blocks<Geom::C, FactorT>())
    qkv_backward_fp8_kernel(const __grid_constant__ QkvBackwardFp8KernelParams p) {
  const E4m3Scaler scale{*p.grad_scale};
  if constexpr (fp8_branch_free<Geom::G, kKeyOffset>()) {
    if (scale.fast) {
      fp8_tile<Geom, kKeyOffset, FactorT, true, ScaleDivision::kFast, kFullWidth>(p, scale);
    } else {
      fp8_tile<Geom, kKeyOffset, FactorT, true, ScaleDivision::kGeneral, kFullWidth>(p, scale);
    }
  } else {
    fp8_tile<Geom, kKeyOffset, FactorT, false, ScaleDivision::kTestPerCall, kFullWidth>(p, scale);
  }
}

/// Largest dynamic shared memory any launch of the kernel can ask for: a tile of the widest
/// features, 2*256 + 256 bytes per token.
constexpr size_t kMaxTileBytes = size_t(kTileTokens) * ((2 * 256 + 256 + 127) / 128 * 128);

/// Once per kernel instantiation and device (the current one, `device`): opts `kKernel` in to
/// kMaxTileBytes of dynamic shared memory and the largest shared-memory carveout (the attributes
/// belong to the function on the current device). The limit is set once to the maximum any
/// launch needs rather than to each launch's size: a cache keyed by the launcher (several
/// launchers share a kernel) or a limit lowered by a smaller launch let a later, larger launch
/// fail with cudaErrorInvalidValue. The limit does not change occupancy, which follows the bytes
/// a launch actually asks for.
///
/// Returns the CTAs with `smem` bytes of tile the device holds at once (occupancy x SMs, under
/// the carveout just set), for the next-CTA prefetch; cached per device and tile size (a
/// multiple of 128 bytes per token up to kMaxTileBytes).
template <auto kKernel>
int prepare_kernel(int device, size_t smem) {
  constexpr int kDevices = 64;
  constexpr size_t kSizes = kMaxTileBytes / (kTileTokens * 128) + 1;
  static std::array<std::atomic<bool>, kDevices> opted_in{};
  static std::array<std::atomic<int>, kDevices * kSizes> resident{};
  QKVF_CHECK(device >= 0 && device < kDevices, "device ordinal ", device,
             " beyond the supported 64");
  if (!opted_in[device].load(std::memory_order_acquire)) {
    QKVF_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(kMaxTileBytes)));
    // The largest shared-memory carveout: 4 CTAs of 48 KB (fp8_min_blocks) need 196 KB of it.
    QKVF_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         int(cudaSharedmemCarveoutMaxShared)));
    opted_in[device].store(true, std::memory_order_release);
  }
  std::atomic<int>& slot = resident[size_t(device) * kSizes + smem / (kTileTokens * 128)];
  int blocks = slot.load(std::memory_order_relaxed);
  if (blocks == 0) {
    int per_sm = 0;
    QKVF_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kFp8Threads, smem));
    blocks = std::max(per_sm, 1) * multiprocessor_count();
    slot.store(blocks, std::memory_order_relaxed);
  }
  return blocks;
}

template <class Geom, bool kKeyOffset, typename FactorT, bool kFullWidth>
void launch_fp8(QkvBackwardFp8KernelParams kp, int device, cudaStream_t stream) {
  constexpr auto kernel = qkv_backward_fp8_kernel<Geom, kKeyOffset, FactorT, kFullWidth>;
  const size_t smem = size_t(kTileTokens) * size_t(kp.tile_pitch);
  QKVF_CHECK(smem <= kMaxTileBytes, "qkv_backward_fp8 (CUDA): tile of ", smem, " bytes");
  // Above 48 KB a kernel must opt in to its dynamic shared memory; done for every kernel so that
  // the carveout preference applies at 48 KB too.
  kp.resident_blocks = prepare_kernel<kernel>(device, smem);
  const int64_t tiles = (kp.tokens + kTileTokens - 1) / kTileTokens;
  const int64_t blocks = tiles * kp.num_heads;
  QKVF_CHECK(blocks <= int64_t(0x7fffffff), "qkv_backward_fp8 (CUDA): ", kp.tokens,
             " tokens need more blocks than one launch holds");
  kernel<<<dim3(unsigned(blocks)), dim3(kFp8Threads), smem, stream>>>(kp);
  QKVF_CUDA_CHECK_LAUNCH("qkv_backward_fp8_kernel");
}

}  // namespace

void qkv_backward_fp8(const QkvBackwardFp8Params& params) {
  if (!rope::vector_path(params)) return generic::qkv_backward_fp8(params);
  DeviceGuard guard(params.qk.device);
  const int64_t tokens = params.qk.size(0);
  if (tokens == 0) return;
  const RopeLayout& layout = params.layout;
  const int64_t H = layout.num_heads;
  const int64_t head_dim = params.qk.size(2);
  const int64_t v_dim = params.grad_v.size(2);
  const int64_t qkv_dim = 2 * H * head_dim + H * v_dim;
  // Validated by the entry point; restated because the kernel's addressing relies on them.
  QKVF_CHECK(v_dim % 8 == 0 && v_dim >= 8 && v_dim <= 256, "qkv_backward_fp8 (CUDA): unsupported V "
             "width Dv = ", v_dim, "; the CUDA kernel takes Dv a multiple of 8 in [8, 256]");
  QKVF_CHECK(params.grad_row.is_contiguous() && params.grad_t.is_contiguous(),
             "qkv_backward_fp8 (CUDA): grad_row and grad_t must be row-major contiguous, got ",
             params.grad_row.describe(), " and ", params.grad_t.describe());

  QkvBackwardFp8KernelParams kp{};
  kp.grad_q = static_cast<const __nv_bfloat16*>(params.grad_q.data);
  kp.grad_q_stride_t = params.grad_q.strides[0];
  kp.grad_q_stride_h = params.grad_q.strides[1];
  kp.grad_k = static_cast<const __nv_bfloat16*>(params.grad_k.data);
  kp.grad_k_stride_t = params.grad_k.strides[0];
  kp.grad_k_stride_h = params.grad_k.strides[1];
  kp.grad_v = static_cast<const __nv_bfloat16*>(params.grad_v.data);
  kp.grad_v_stride_t = params.grad_v.strides[0];
  kp.grad_v_stride_h = params.grad_v.strides[1];
  kp.qk = static_cast<const __nv_bfloat16*>(params.qk.data);
  kp.qk_stride_t = params.qk.strides[0];
  kp.qk_stride_h = params.qk.strides[1];
  kp.factor1 = params.factor1.data;
  kp.factor2 = params.factor2.data;
  kp.factor1_stride_t = params.factor1.strides[0];
  kp.factor2_stride_t = params.factor2.strides[0];
  kp.grad_scale = static_cast<const float*>(params.grad_scale.data);
  kp.grad_row = static_cast<uint8_t*>(params.grad_row.data);
  kp.grad_t = static_cast<uint8_t*>(params.grad_t.data);
  kp.tokens = tokens;
  kp.qkv_dim = qkv_dim;
  kp.num_heads = int(H);
  kp.head_dim = int(head_dim);
  kp.v_dim = int(v_dim);
  kp.rotary_dim = layout.key_offset ? int(layout.rotary_dim) : int(head_dim);
  kp.paired = layout.paired;
  kp.tile_pitch = int((2 * head_dim + v_dim + 127) / 128 * 128);

  const cudaStream_t stream = to_cuda(params.stream);
  // D = 96 on 16 lanes x 1 chunk (12 active): the Q and K rows of a token are loaded together
  // (the C == 1 path of phase A1) within the 64-register budget of 4 CTAs per SM. On 4 x 3 the
  // kernel needs 126-128 registers (2 CTAs per SM) and measured 50.8 % of copy against 64.1 %
  // (H200, bench/results/2026-11-30_0f61d58_h200_d96_geometry_ab.txt).
  rope::kernel_switch<rope::Width96::kMasked16x1>(
      "qkv_backward_fp8", head_dim, layout.key_offset, params.factor1.dtype,
      [&](auto geometry, auto full_width, auto key_offset, auto factor_tag) {
        using FactorT = typename decltype(factor_tag)::type;
        launch_fp8<decltype(geometry), decltype(key_offset)::value, FactorT,
                   decltype(full_width)::value>(kp, params.qk.device.index, stream);
      });
}

}  // namespace qkvfuse::cuda
