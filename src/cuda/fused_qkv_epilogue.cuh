// fused_qkv_epilogue.cuh: the epilogue of the fused QKV GEMM: per-head RMS-norm + rotary of the
// Q and K tiles in registers, q, k, v written in their final layouts. Internal; CUTLASS 4.2.
//
// Math (SPEC.md section 1; the CPU reference is src/cpu/qk_norm_rope.cpp). For a Q/K tile, per
// output row t and head h of width D, in fp32 with every operation rounded as written (no FMA
// contraction: __fmul_rn / __fadd_rn on the device):
//   x[d]  = bf16(acc[d] * ((scale_a * scale_b) * alpha))      the unfused GEMM's bf16 output
//   rstd  = 1 / sqrt(sum_d(x[d] * x[d]) / D + eps)
//   n[d]  = x[d] * rstd
//   y[d]  = f1[t, d + off] * n[d] + f2[t, d + off] * n[p(d)]  p(d) = d ^ 1 (interleaved) or d +- D/2 (NeoX)
//                                                               for the rotary lanes d < r
//   y[d]  = n[d]                                                d >= r: passed through (the
//                                                               tables' values there unused)
//   key offset, keys, d >= r, t > 0: y[d] = n_{t-1}[d]
// and y is rounded to bf16 once. Rounding the accumulator to bf16 first is what makes the fused
// and unfused forwards agree: the only differences left are the GEMMs' accumulation orders and
// the order of the fp32 row sum (here: a thread's columns in order, then the quad butterfly).
// V tiles are x itself. The optional raw output `qk` is x for the Q/K columns (the backward's
// saved pre-norm input).
//
// Where the values are. The ping-pong main loop leaves each consumer warpgroup (128 threads) a
// whole 128 x N tile of fp32 accumulators in the WGMMA register layout (CuTe's CLayout_64xN,
// repeated twice along M):
//   thread i = 32w + 4g + q (warp w, quad g, lane-in-quad q) holds, for mm in {0, 1} and
//   v1 in {0, 1}, tile row 64mm + 16w + 8v1 + g, columns 8j + 2q + {0, 1} for j < N/8.
// A thread owns 4 rows; a row of N columns is spread over the 4 threads of one quad, one bf16
// pair per thread per 8-column group. Read and written in that layout, every global access would
// be a 4-byte word, and a warp instruction would touch 8 rows x 16 bytes: 8 L1 wavefronts for
// 128 bytes. Per 128 x 128 tile the epilogue moves 64 KiB of bf16 factors in and 32 KiB of q or
// k out, about 6000 wavefronts in that layout: more than the ~3000 cycles of the tile's main
// loop that the ping-pong schedule gives it to hide in, and competing with the WGMMAs for the
// shared memory / L1 bandwidth. So the first step is a transpose inside each quad:
//   the words of groups 4b .. 4b+3 (one column pair each) become, in thread q, the 4 words of
//   group 4b + q (its 8 consecutive columns), for each block b of 4 groups and each row:
// two shuffle stages (xor 2, then xor 1), each sending 2 of the 4 words (quad_transpose). Then
// every factor load and every store is a 16-byte vector (8 bf16 columns), and a warp instruction
// moves 8 rows x 64 bytes. After the transpose, for a row of the tile:
//   - thread q holds groups q, 4+q, 8+q, ...: a head of D columns is D/32 whole blocks, so its
//     sum is a thread-local sum followed by a butterfly over the quad (shfl.xor 1, then 2), and
//     every lane of the quad ends with the same bits (D a multiple of 32);
//   - the interleaved rotary partner d ^ 1 is the other half of the same bf16x2 word;
//   - the NeoX partner d +- D/2 is block b +- D/64 of the same thread (D a multiple of 64): no
//     exchange either;
//   - a tile of N = 128 columns is one head at D = 128 and two at D = 64 (blocks 0-1 and 2-3).
// The layout is not re-derived here by hand: each value's (row, column) comes from CuTe's
// identity-tensor partition (fill_fragment), and tests/fused_qkv_gemm/epilogue_host_test.cu checks
// on the host, for all 128 threads of the real TiledMma, every assumption listed above, replays
// the transpose's select logic across the quads, and runs this file's math for whole tiles
// against a reference that is bit-exact with the CPU backend.
//
// Memory. The factor tables are read through the read-only path (L1): every Q and K tile of a
// row block reads the same factor rows, and the scheduler's raster along N keeps them in L2.
// Factor loads for a batch of rows are issued together, before the batch's arithmetic (2 rows
// per batch with bf16 factors, 1 with fp32: 64 registers either way), and the first batch's
// loads are issued before the row sums, so their latency overlaps the reduction. The epilogue of
// one warpgroup runs while the other warpgroup's main loop feeds the tensor cores (ping-pong),
// so it costs time only if it is longer than a main loop (~1.7 us at K = 768).
//
// Key offset without a neighbour exchange: the thread that normalizes key row t writes the
// pass-through lanes (d >= r) of row t+1 (its own n, which is exactly y_{t+1} there) and only
// the rotary lanes of row t (all lanes at t = 0), as the unfused kernel does. Every output
// element is written by exactly one thread, including across tile boundaries (the last row of a
// tile writes into the next tile's first row), so no tile needs another's data.
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda/device_math.cuh"
#include "cuda/fused_qkv_gemm_args.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "qkvfuse/numeric.hpp"

namespace qkvfuse::cuda::fused {

// ------------------------------------------------------------------------------------------------
// Scalar helpers, host and device: the device rounds each operation explicitly (no contraction);
// the host test compiles its half with -ffp-contract=off (x86-64 SSE arithmetic is IEEE per op).
// ------------------------------------------------------------------------------------------------

CUTE_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

CUTE_HOST_DEVICE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

/// 1 / sqrt(sum / D + eps) as the CPU computes it: a correctly rounded division by D, square root
/// and reciprocal. On the device without subroutine calls: __fdiv_rn and __fsqrt_rn branch to
/// slow-path subroutines, and a call site in the middle of the epilogue makes ptxas preserve the
/// tile's live registers around it. reciprocal_sqrt_rn (device_math.cuh) is
/// __fdiv_rn(1, __fsqrt_rn(v)) bit for bit for v >= 2^-100 (eps is validated to be at least
/// that); a division by a power-of-two D is a multiplication by 1/D (exact), any other D takes
/// divide_by_width, which is __fdiv_rn's bits for every non-subnormal quotient.
template <int kHeadDim>
CUTE_HOST_DEVICE float rms_rstd(float sum, float eps) {
#if defined(__CUDA_ARCH__)
  float mean;
  if constexpr ((kHeadDim & (kHeadDim - 1)) == 0) {
    mean = __fmul_rn(sum, 1.0f / float(kHeadDim));
  } else {
    mean = divide_by_width(sum, UniformDivisor(float(kHeadDim)));
  }
  return reciprocal_sqrt_rn(__fadd_rn(mean, eps));
#else
  return 1.0f / std::sqrt(sum / float(kHeadDim) + eps);
#endif
}

/// Two fp32 to a bf16x2 word (round to nearest even), lo in the low half (the even column).
CUTE_HOST_DEVICE uint32_t pack_bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__)
  uint32_t word;
  // cvt packs its first source into the upper half.
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(word) : "f"(hi), "f"(lo));
  return word;
#else
  return uint32_t(float_to_bf16(lo)) | (uint32_t(float_to_bf16(hi)) << 16);
#endif
}

CUTE_HOST_DEVICE float bf16x2_lo(uint32_t word) { return bits_float(word << 16); }
CUTE_HOST_DEVICE float bf16x2_hi(uint32_t word) { return bits_float(word & 0xffff0000u); }

/// A read-only load: the non-coherent path on the device (factor tables and scalars are never
/// written during the kernel).
template <typename T>
CUTE_HOST_DEVICE T load_readonly(const T* p) {
#if defined(__CUDA_ARCH__)
  return __ldg(p);
#else
  return *p;
#endif
}

/// 16 bytes: 8 bf16 columns, or 4 fp32.
struct alignas(16) Chunk {
  uint32_t w[4];
};

/// A read-only 16-byte load (factor tables are never written during the kernel).
CUTE_HOST_DEVICE Chunk load_chunk(const void* p) {
  Chunk c;
#if defined(__CUDA_ARCH__)
  const uint4 v = __ldg(static_cast<const uint4*>(p));
  c.w[0] = v.x;
  c.w[1] = v.y;
  c.w[2] = v.z;
  c.w[3] = v.w;
#else
  std::memcpy(&c, p, sizeof(c));
#endif
  return c;
}

CUTE_HOST_DEVICE void store_chunk(uint16_t* p, const Chunk& c) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint4*>(p) = make_uint4(c.w[0], c.w[1], c.w[2], c.w[3]);
#else
  std::memcpy(p, &c, sizeof(c));
#endif
}

CUTE_HOST_DEVICE void store_word(uint16_t* p, uint32_t word) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint32_t*>(p) = word;
#else
  std::memcpy(p, &word, sizeof(word));
#endif
}

/// A compiler-only barrier: memory operations are not moved across it (no instruction emitted).
CUTE_HOST_DEVICE void compiler_fence() {
#if defined(__CUDA_ARCH__)
  asm volatile("" ::: "memory");
#endif
}

/// The factors of one 8-column group: bf16 (one 16-byte chunk per table) or fp32 (two).
template <typename FactorT>
struct FactorGroup;
template <>
struct FactorGroup<uint16_t> {
  Chunk c;
  CUTE_HOST_DEVICE void load(const void* tile, int offset) {
    c = load_chunk(static_cast<const uint16_t*>(tile) + offset);
  }
  CUTE_HOST_DEVICE void clear() { c = Chunk{}; }
  /// Column 2w (lo) and 2w + 1 (hi) of the group.
  CUTE_HOST_DEVICE float lo(int w) const { return bf16x2_lo(c.w[w]); }
  CUTE_HOST_DEVICE float hi(int w) const { return bf16x2_hi(c.w[w]); }
};
template <>
struct FactorGroup<float> {
  Chunk c[2];
  CUTE_HOST_DEVICE void load(const void* tile, int offset) {
    c[0] = load_chunk(static_cast<const float*>(tile) + offset);
    c[1] = load_chunk(static_cast<const float*>(tile) + offset + 4);
  }
  CUTE_HOST_DEVICE void clear() { c[0] = c[1] = Chunk{}; }
  CUTE_HOST_DEVICE float lo(int w) const { return bits_float(c[w / 2].w[2 * (w % 2)]); }
  CUTE_HOST_DEVICE float hi(int w) const { return bits_float(c[w / 2].w[2 * (w % 2) + 1]); }
};

// ------------------------------------------------------------------------------------------------
// The quad transpose, as a send / receive pair per stage (the device exchanges with shuffles,
// the host test between the four threads' fragments: both run this select logic)
// ------------------------------------------------------------------------------------------------

/// The 4 x 4 transpose of one block (thread q's words w[0..3] are groups 4b .. 4b+3; afterwards
/// w[i] is thread i's word of group 4b + q) in two stages of 2 x 2 block swaps. Stage kXor = 2
/// swaps the off-diagonal 2 x 2 blocks between threads q and q ^ 2; stage kXor = 1 transposes
/// each 2 x 2 block between q and q ^ 1. Each thread sends the 2 words its partner needs.
template <int kXor>
CUTE_HOST_DEVICE void transpose_send(const uint32_t* w, int lane, uint32_t (&out)[2]) {
  static_assert(kXor == 1 || kXor == 2, "the quad transpose has two stages");
  const bool upper = (lane & kXor) != 0;
  if constexpr (kXor == 2) {
    out[0] = upper ? w[0] : w[2];
    out[1] = upper ? w[1] : w[3];
  } else {
    out[0] = upper ? w[0] : w[1];
    out[1] = upper ? w[2] : w[3];
  }
}

template <int kXor>
CUTE_HOST_DEVICE void transpose_receive(uint32_t* w, int lane, const uint32_t (&in)[2]) {
  const bool upper = (lane & kXor) != 0;
  if constexpr (kXor == 2) {
    w[0] = upper ? in[0] : w[0];
    w[1] = upper ? in[1] : w[1];
    w[2] = upper ? w[2] : in[0];
    w[3] = upper ? w[3] : in[1];
  } else {
    w[0] = upper ? in[0] : w[0];
    w[2] = upper ? in[1] : w[2];
    w[1] = upper ? w[1] : in[0];
    w[3] = upper ? w[3] : in[1];
  }
}

// ------------------------------------------------------------------------------------------------
// The per-thread math of one tile, host and device
// ------------------------------------------------------------------------------------------------

/// One thread's share of a kTileM x kTileN tile, and what it does with it: kRows rows per thread.
/// Before the quad transpose x[r][j] holds columns col0 + 8j + {0, 1}; after it, x[r][4b + w]
/// holds columns chunk_col(b) + 2w + {0, 1}, chunk_col(b) = 8 (4b + lane), lane = col0 / 2.
/// FactorT: the factor tables' element type, uint16_t (bf16 bits) or float; a template parameter
/// so that a kernel carries the loads and conversions of one dtype only.
/// kLayout: kSimple compiles the common layout (interleaved, r = D, no key offset, not paired)
/// without the options' code: no placement arithmetic, no NeoX partner, one 16-byte store per
/// chunk; kGeneral reads the options at run time (EpilogueLayout, fused_qkv_gemm_args.hpp).
/// kWork: the whole norm + rotary, or only parts of it for the benchmark's attribution
/// (EpilogueWork, fused_qkv_gemm_args.hpp); the stores are the same in every case.
template <int kTileN_, int kHeadDim_, int kRows_, typename FactorT_, EpilogueLayout kLayout_,
          EpilogueWork kWork_ = EpilogueWork::kFull>
struct TileMath {
  static constexpr int kTileN = kTileN_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kRows = kRows_;
  using FactorT = FactorT_;
  static constexpr EpilogueLayout kLayout = kLayout_;
  static constexpr EpilogueWork kWork = kWork_;
  static_assert(std::is_same_v<FactorT, uint16_t> || std::is_same_v<FactorT, float>,
                "factor tables are bf16 (uint16_t bits) or fp32");
  static constexpr int kGroups = kTileN / 8;       ///< 8-column groups: words per row per thread
  static constexpr int kBlocks = kGroups / 4;      ///< blocks of 4 groups: chunks per row per thread
  static constexpr int kHeadsPerTile = kTileN / kHeadDim;
  static constexpr int kBlocksPerHead = kHeadDim / 32;
  static_assert(kTileN % 32 == 0, "whole blocks of 4 groups (the quad transpose)");
  static_assert(kTileN % kHeadDim == 0,
                "a CTA tile must hold whole heads: the row sum of a head never leaves the quad");
  static_assert(kHeadDim % 32 == 0,
                "D a multiple of 32: after the quad transpose a thread holds every 4th group, so "
                "a head must be whole blocks of 4 groups");
  /// NeoX's partner block (d +- D/2) is in the same thread only when D/2 is whole blocks.
  static constexpr bool kNeoxInThread = kBlocksPerHead % 2 == 0;

  /// The layout options as this instantiation sees them: constants (off) in the simple layout,
  /// so that every branch on them folds away at compile time.
  static constexpr bool kGeneral = kLayout == EpilogueLayout::kGeneral;
  CUTE_HOST_DEVICE static bool paired(const FusedQkvEpilogueArgs& a) { return kGeneral && a.paired; }
  CUTE_HOST_DEVICE static bool key_offset(const FusedQkvEpilogueArgs& a) {
    return kGeneral && a.key_offset;
  }
  CUTE_HOST_DEVICE static bool neox(const FusedQkvEpilogueArgs& a) { return kGeneral && a.neox; }
  /// Whether chunk d0 .. d0 + 7 of a head lies wholly in the rotary lanes (d < r).
  CUTE_HOST_DEVICE static bool chunk_rotates(const FusedQkvEpilogueArgs& a, int d0) {
    return !kGeneral || d0 + 8 <= a.rotary_dim;
  }

  /// Rows whose factors are in registers at once: 2 with bf16 tables (2 x 2 tables x kBlocks
  /// chunks: 64 registers at N = 128), 1 with fp32 tables (the same 64). More would not fit next
  /// to the tile's 64 x words in a ping-pong consumer's 232 registers.
  static constexpr int kFactorBatch = sizeof(FactorT) == 2 ? 2 : 1;
  using Factors = FactorGroup<FactorT>[kFactorBatch][kBlocks];

  struct Fragment {
    uint32_t x[kRows][kGroups];  ///< bf16x2 words (layout above), the low half the even column
    int rows[kRows];             ///< tile-local row of fragment row r
    int col0;                    ///< tile-local column of x[r][0]'s low half before the
                                 ///< transpose: 2 * lane
    CUTE_HOST_DEVICE int lane() const { return col0 / 2; }
    /// Tile-local first column of chunk b after the transpose.
    CUTE_HOST_DEVICE int chunk_col(int b) const { return 8 * (4 * b + lane()); }
  };
  using Sums = float[kRows][kHeadsPerTile];

  /// sums[r][hh] = this thread's part of sum(x*x) over head hh of row r, in its column order.
  CUTE_HOST_DEVICE static void row_sums(const Fragment& f, Sums& sums) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int hh = 0; hh < kHeadsPerTile; ++hh) {
        float s = 0.0f;
        CUTE_UNROLL
        for (int j = hh * kBlocksPerHead * 4; j < (hh + 1) * kBlocksPerHead * 4; ++j) {
          const uint32_t w = f.x[r][j];
          s = add_rn(s, mul_rn(bf16x2_lo(w), bf16x2_lo(w)));
          s = add_rn(s, mul_rn(bf16x2_hi(w), bf16x2_hi(w)));
        }
        sums[r][hh] = s;
      }
    }
  }

  /// Where head hh of the Q/K tile at (m0, n0) goes (SPEC.md sections 1 and 8). Addresses are a
  /// 64-bit pointer to the tile's first row plus 32-bit offsets inside the tile (row * row_stride
  /// + column): fused_qkv_gemm validates that kTileOffsetRows rows of every stride fit in int32.
  struct HeadPlace {
    uint16_t* out;        ///< q or k: head h's column 0 at output token token_mul * m0 + token_add
    int row_stride;       ///< output offset from tile row i to i + 1: token_mul * stride_t
    int next_token;       ///< output offset from token t to t + 1 (key offset): stride_t
    int factor_offset;    ///< factor column of d = 0
    bool shift;           ///< key offset applies (a key head)
  };

  CUTE_HOST_DEVICE static HeadPlace place(const FusedQkvEpilogueArgs& a, int m0, int n0, int hh) {
    const int h2 = n0 / kHeadDim + hh;  // input head in [0, Hq + Hkv)
    const bool is_key = h2 >= a.q_heads;
    const int h = is_key ? h2 - a.q_heads : h2;
    const int64_t stride_t = is_key ? a.k_stride_t : a.q_stride_t;
    const int64_t stride_h = is_key ? a.k_stride_h : a.q_stride_h;
    int token_mul = 1;  // output token = token_mul * t + token_add
    int token_add = 0;
    int out_head = h;
    HeadPlace p;
    p.factor_offset = 0;
    if (paired(a)) {
      const int half = (is_key ? a.kv_heads : a.q_heads) / 2;
      token_mul = 2;
      token_add = h / half;
      out_head = h % half;
      p.factor_offset = (h % 2) * kHeadDim;
    }
    p.out = (is_key ? a.k : a.q) + int64_t(token_mul * m0 + token_add) * stride_t +
            int64_t(out_head) * stride_h;
    p.row_stride = token_mul * int(stride_t);
    p.next_token = int(stride_t);
    p.shift = key_offset(a) && is_key;
    return p;
  }

  /// Column of chunk b inside its head (b in head hh = b / kBlocksPerHead).
  CUTE_HOST_DEVICE static int head_col(const Fragment& f, int b) {
    return f.chunk_col(b) - (b / kBlocksPerHead) * kHeadDim;
  }

  /// The factor groups of fragment rows [r0, r0 + kFactorBatch), one per chunk (zeros past T).
  CUTE_HOST_DEVICE static void load_factors(const FusedQkvEpilogueArgs& a, int m0, int n0,
                                            const Fragment& f, int r0, Factors& f1, Factors& f2) {
    // The tile's first factor rows, and 32-bit offsets from them (HeadPlace).
    const FactorT* f1_tile = static_cast<const FactorT*>(a.factor1) + int64_t(m0) * a.factor1_stride;
    const FactorT* f2_tile = static_cast<const FactorT*>(a.factor2) + int64_t(m0) * a.factor2_stride;
    CUTE_UNROLL
    for (int i = 0; i < kFactorBatch; ++i) {
      const int row = f.rows[r0 + i];
      const bool valid = m0 + row < a.tokens;
      CUTE_UNROLL
      for (int b = 0; b < kBlocks; ++b) {
        // The factor column offset is per head only when paired; for the plain layout it is 0.
        const int off = paired(a) ? place(a, m0, n0, b / kBlocksPerHead).factor_offset : 0;
        const int col = off + head_col(f, b);
        if (valid) {
          f1[i][b].load(f1_tile, row * int(a.factor1_stride) + col);
          f2[i][b].load(f2_tile, row * int(a.factor2_stride) + col);
        } else {
          f1[i][b].clear();
          f2[i][b].clear();
        }
      }
    }
  }

  /// Normalize, rotate and store fragment rows [r0, r0 + kFactorBatch) of a Q/K tile.
  CUTE_HOST_DEVICE static void rotate_store(const FusedQkvEpilogueArgs& a, int m0, int n0,
                                            const Fragment& f, const Sums& sums, int r0,
                                            const Factors& f1, const Factors& f2) {
    CUTE_UNROLL
    for (int hh = 0; hh < kHeadsPerTile; ++hh) {
      const HeadPlace p = place(a, m0, n0, hh);
      CUTE_UNROLL
      for (int i = 0; i < kFactorBatch; ++i) {
        const int r = r0 + i;
        const int t = m0 + f.rows[r];
        if (t >= a.tokens) continue;
        [[maybe_unused]] float rstd = 1.0f;  // kStoreOnly: no row sums
        if constexpr (kWork != EpilogueWork::kStoreOnly) {
          rstd = rms_rstd<kHeadDim>(sums[r][hh], a.eps);
        }
        uint16_t* out = p.out + f.rows[r] * p.row_stride;
        // Key offset: this row's pass-through lanes also go to row t+1 (+ next_token).
        const bool has_next = p.shift && t + 1 < a.tokens;
        const bool first = t == 0;
        CUTE_UNROLL
        for (int bb = 0; bb < kBlocksPerHead; ++bb) {
          const int b = hh * kBlocksPerHead + bb;
          const int d0 = head_col(f, b);  // the chunk's first column in the head
          Chunk y, n;
          CUTE_UNROLL
          for (int w = 0; w < 4; ++w) {
            const uint32_t x = f.x[r][4 * b + w];
            if constexpr (kWork == EpilogueWork::kStoreOnly) {
              y.w[w] = n.w[w] = x;
            } else {
              const float n_lo = mul_rn(bf16x2_lo(x), rstd);
              const float n_hi = mul_rn(bf16x2_hi(x), rstd);
              n.w[w] = pack_bf16x2(n_lo, n_hi);
              if constexpr (kWork == EpilogueWork::kNormOnly) {
                y.w[w] = n.w[w];
              } else {
                // The rotary partners: interleaved, the other half of the word; NeoX, the same
                // word of the chunk D/2 columns away (recomputed: the same product gives the same
                // bits).
                float p_lo = n_hi;
                float p_hi = n_lo;
                if constexpr (kNeoxInThread) {
                  if (neox(a)) {
                    const int bp = hh * kBlocksPerHead + (bb + kBlocksPerHead / 2) % kBlocksPerHead;
                    const uint32_t xp = f.x[r][4 * bp + w];
                    p_lo = mul_rn(bf16x2_lo(xp), rstd);
                    p_hi = mul_rn(bf16x2_hi(xp), rstd);
                  }
                }
                const float y_lo = add_rn(mul_rn(f1[i][b].lo(w), n_lo), mul_rn(f2[i][b].lo(w), p_lo));
                const float y_hi = add_rn(mul_rn(f1[i][b].hi(w), n_hi), mul_rn(f2[i][b].hi(w), p_hi));
                y.w[w] = pack_bf16x2(y_lo, y_hi);
              }
            }
          }
          // Lanes >= r pass through (y = n): at r = D, every layout but key offset's, no chunk
          // takes the last two branches (the simple layout compiles without them). Key offset:
          // row t's pass-through lanes go to row t + 1; token 0 keeps its own.
          const bool own = !p.shift || first;
          if (chunk_rotates(a, d0)) {
            store_chunk(out + d0, y);  // all 8 lanes rotate
          } else if (d0 >= a.rotary_dim) {
            if (own) store_chunk(out + d0, n);
            if (has_next) store_chunk(out + p.next_token + d0, n);
          } else {
            // r splits the chunk (not a multiple of 8): word by word. r is even, so a word (a
            // column pair) is entirely on one side of it.
            CUTE_UNROLL
            for (int w = 0; w < 4; ++w) {
              if (d0 + 2 * w < a.rotary_dim) {
                store_word(out + d0 + 2 * w, y.w[w]);
              } else {
                if (own) store_word(out + d0 + 2 * w, n.w[w]);
                if (has_next) store_word(out + p.next_token + d0 + 2 * w, n.w[w]);
              }
            }
          }
        }
      }
    }
  }

  /// A whole Q/K tile after the quad reduction: batches of rows, each batch's factor loads
  /// issued before its arithmetic; f1 / f2 arrive holding batch 0's factors (loaded by the
  /// caller before the reduction).
  CUTE_HOST_DEVICE static void store_qk_batches(const FusedQkvEpilogueArgs& a, int m0, int n0,
                                                const Fragment& f, const Sums& sums, Factors& f1,
                                                Factors& f2) {
    static_assert(kRows % kFactorBatch == 0, "whole batches of rows");
    CUTE_UNROLL
    for (int r0 = 0; r0 < kRows; r0 += kFactorBatch) {
      if (r0 > 0 && kWork == EpilogueWork::kFull) {
        // Keep each batch's loads behind the previous batch's stores: hoisted (the read-only
        // loads may legally move past stores), every batch's factors could be live at once,
        // beyond the register budget. (Not measured either way yet.)
        compiler_fence();
        load_factors(a, m0, n0, f, r0, f1, f2);
      }
      rotate_store(a, m0, n0, f, sums, r0, f1, f2);
    }
  }

  /// The raw (pre-norm) Q/K columns, when asked for.
  CUTE_HOST_DEVICE static void store_raw_qk(const FusedQkvEpilogueArgs& a, int m0, int n0,
                                            const Fragment& f) {
    if (a.qk == nullptr) return;
    uint16_t* qk_tile = a.qk + int64_t(m0) * a.qk_stride_t + n0;  // 32-bit offsets from here
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int t = m0 + f.rows[r];
      if (t >= a.tokens) continue;
      uint16_t* out = qk_tile + f.rows[r] * int(a.qk_stride_t);
      CUTE_UNROLL
      for (int b = 0; b < kBlocks; ++b) {
        Chunk c;
        CUTE_UNROLL
        for (int w = 0; w < 4; ++w) c.w[w] = f.x[r][4 * b + w];
        store_chunk(out + f.chunk_col(b), c);
      }
    }
  }

  /// A V tile: x itself, to v[t, c / Dv, c % Dv] for V column c (chunks past Hkv*Dv skipped;
  /// Dv a multiple of 8, so a chunk is inside one head).
  CUTE_HOST_DEVICE static void store_v(const FusedQkvEpilogueArgs& a, int m0, int n0,
                                       const Fragment& f) {
    const int v_begin = (a.q_heads + a.kv_heads) * kHeadDim;
    const int v_cols = a.kv_heads * a.v_dim;
    uint16_t* v_tile = a.v + int64_t(m0) * a.v_stride_t;  // 32-bit offsets from here
    CUTE_UNROLL
    for (int b = 0; b < kBlocks; ++b) {
      const int c = n0 - v_begin + f.chunk_col(b);
      if (c >= v_cols) continue;
      const int head = c / a.v_dim;
      const int column = head * int(a.v_stride_h) + (c - head * a.v_dim);
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int t = m0 + f.rows[r];
        if (t >= a.tokens) continue;
        Chunk chunk;
        CUTE_UNROLL
        for (int w = 0; w < 4; ++w) chunk.w[w] = f.x[r][4 * b + w];
        store_chunk(v_tile + f.rows[r] * int(a.v_stride_t) + column, chunk);
      }
    }
  }

  /// The scale of the GEMM output, in the CPU backend's order.
  CUTE_HOST_DEVICE static float output_scale(const FusedQkvEpilogueArgs& a) {
    const float ab = mul_rn(load_readonly(a.scale_a), load_readonly(a.scale_b));
    return a.alpha != nullptr ? mul_rn(ab, load_readonly(a.alpha)) : ab;
  }
};

/// Fills a thread's Fragment from its accumulators, in the WGMMA layout: x = bf16(acc * scale),
/// and the rows and first column from CuTe's partition of an identity tensor (the ground truth of
/// the layout). Indexing assumes the accumulator fragment is ((2, 2, N/8), MMA_M, 1), i.e.
/// (column pair, row half, column group) x M repeats, which the static_asserts pin and the host
/// test checks value by value against the identity partition.
template <class Math, int kTileM, class AccTensor, class TiledMma>
CUTE_HOST_DEVICE void fill_fragment(typename Math::Fragment& f, const AccTensor& acc,
                                    const TiledMma& tiled_mma, int thread_idx, float scale) {
  using namespace cute;
  using AccLayout = typename AccTensor::layout_type;
  static_assert(rank_v<AccLayout> == 3, "accumulators (MMA, MMA_M, MMA_N)");
  constexpr int kPairs = size<0, 0>(AccLayout{});
  constexpr int kHalves = size<0, 1>(AccLayout{});
  constexpr int kGroups = size<0, 2>(AccLayout{});
  constexpr int kMmaM = size<1>(AccLayout{});
  constexpr int kMmaN = size<2>(AccLayout{});
  static_assert(kPairs == 2 && kHalves == 2 && kGroups == Math::kGroups,
                "the WGMMA accumulator layout: (2 columns, 2 row halves, N/8 column groups)");
  static_assert(kMmaN == 1, "one WGMMA atom spans the tile's N (no N repeats)");
  static_assert(2 * kMmaM == Math::kRows, "2 rows per thread per 64-row WGMMA atom");

  auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
  Tensor coords = thr_mma.partition_C(make_identity_tensor(make_shape(Int<kTileM>{}, Int<Math::kTileN>{})));
  f.col0 = get<1>(coords(make_coord(0, 0, 0), 0, 0));
  CUTE_UNROLL
  for (int mm = 0; mm < kMmaM; ++mm) {
    CUTE_UNROLL
    for (int v1 = 0; v1 < 2; ++v1) {
      const int r = 2 * mm + v1;
      f.rows[r] = get<0>(coords(make_coord(0, v1, 0), mm, 0));
      CUTE_UNROLL
      for (int j = 0; j < Math::kGroups; ++j) {
        f.x[r][j] = pack_bf16x2(mul_rn(acc(make_coord(0, v1, j), mm, 0), scale),
                                mul_rn(acc(make_coord(1, v1, j), mm, 0), scale));
      }
    }
  }
}

#if defined(__CUDACC__)
/// The quad transpose on the device (see the header): after it, thread q holds whole groups.
template <class Math>
CUTLASS_DEVICE void quad_transpose(typename Math::Fragment& f) {
  const int lane = f.lane();
  CUTE_UNROLL
  for (int r = 0; r < Math::kRows; ++r) {
    CUTE_UNROLL
    for (int b = 0; b < Math::kBlocks; ++b) {
      uint32_t* w = &f.x[r][4 * b];
      uint32_t send[2], receive[2];
      transpose_send<2>(w, lane, send);
      receive[0] = __shfl_xor_sync(0xffffffffu, send[0], 2);
      receive[1] = __shfl_xor_sync(0xffffffffu, send[1], 2);
      transpose_receive<2>(w, lane, receive);
      transpose_send<1>(w, lane, send);
      receive[0] = __shfl_xor_sync(0xffffffffu, send[0], 1);
      receive[1] = __shfl_xor_sync(0xffffffffu, send[1], 1);
      transpose_receive<1>(w, lane, receive);
    }
  }
}
#endif

// ------------------------------------------------------------------------------------------------
// The CUTLASS epilogue collective
// ------------------------------------------------------------------------------------------------

/// A register-direct epilogue for CUTLASS's sm90 warp-specialized kernels, in the shape of
/// cutlass::epilogue::collective::DefaultEpilogue: the kernel hands it each finished tile's
/// accumulators (wrapped in Sm90TmaWarpSpecializedAdapter, which supplies the empty load/store
/// pipelines a register epilogue does not use). No shared memory, no source tensor C.
template <class TileShape_, int kHeadDim_, EpilogueLayout kLayout, typename FactorT,
          EpilogueWork kWork = EpilogueWork::kFull>
class FusedQkvEpilogue {
 public:
  using TileShape = TileShape_;
  static constexpr int kTileM = cute::size<0>(TileShape{});
  static constexpr int kTileN = cute::size<1>(TileShape{});
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(kTileM % 64 == 0, "the tile's M is a whole number of 64-row WGMMA atoms");
  using Math = TileMath<kTileN, kHeadDim, 2 * (kTileM / 64), FactorT, kLayout, kWork>;

  // What the kernel reads off its epilogue: the element and stride types of C (absent) and D.
  using ElementC = void;
  using ElementD = cutlass::bfloat16_t;
  using StrideC = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using StrideD = StrideC;
  using ElementAccumulator = float;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;

  struct SharedStorage {};
  using TensorStorage = SharedStorage;

  struct Arguments {
    FusedQkvEpilogueArgs args;
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(const ProblemShape&, const Arguments& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(const ProblemShape&, const Arguments&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(const ProblemShape&, const Arguments&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  /// The host entry (fused_qkv_gemm.cpp) validates everything; this is CUTLASS's last word.
  template <class ProblemShape>
  static bool can_implement(const ProblemShape& problem_shape, const Arguments& args) {
    const auto& a = args.args;
    const int n = cute::get<1>(problem_shape);
    const int qk_cols = (a.q_heads + a.kv_heads) * kHeadDim;
    const bool layout_ok = kLayout == EpilogueLayout::kGeneral || epilogue_layout(a) == kLayout;
    return a.head_dim == kHeadDim && layout_ok && qk_cols % kTileN == 0 &&
           n == qk_cols + a.kv_heads * a.v_dim && a.v_dim % 2 == 0;
  }

  CUTLASS_HOST_DEVICE explicit FusedQkvEpilogue(const Params& params,
                                                const SharedStorage& = SharedStorage())
      : params_(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL, BlockShapeMNK, BlockCoordMNKL blk_coord_mnkl,
                                 const cute::Tensor<FrgEngine, FrgLayout>& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    static_assert(is_static<FrgLayout>::value, "accumulator layout must be static");
    constexpr int kBlockM = size<0>(BlockShapeMNK{});
    constexpr int kBlockN = size<1>(BlockShapeMNK{});
    static_assert(kBlockM == kTileM && kBlockN == kTileN, "the kernel's CTA tile must be the epilogue's");
    const FusedQkvEpilogueArgs& a = params_.args;
    const int m0 = int(get<0>(blk_coord_mnkl)) * kTileM;
    const int n0 = int(get<1>(blk_coord_mnkl)) * kTileN;

    typename Math::Fragment f;
    fill_fragment<Math, kTileM>(f, accumulators, tiled_mma, thread_idx, Math::output_scale(a));
    quad_transpose<Math>(f);  // whole 8-column groups per thread: 16-byte loads and stores

    if (n0 >= (a.q_heads + a.kv_heads) * kHeadDim) {
      Math::store_v(a, m0, n0, f);
      return;
    }
    qk_tile(a, m0, n0, f);
  }

 private:
  /// A Q/K tile; tests/fused_qkv_gemm/epilogue_host_test.cu replays these steps on the host.
  CUTLASS_DEVICE void qk_tile(const FusedQkvEpilogueArgs& a, int m0, int n0,
                              const typename Math::Fragment& f) {
    typename Math::Factors f1, f2;
    // The first batch's factors are in flight during the raw stores, the sums and the butterfly.
    if constexpr (kWork == EpilogueWork::kFull) {
      Math::load_factors(a, m0, n0, f, 0, f1, f2);
    }
    // The raw output first: at the end it would keep every x word of the tile live to the last
    // batch (ptxas spilled them).
    Math::store_raw_qk(a, m0, n0, f);
    typename Math::Sums sums;
    if constexpr (kWork != EpilogueWork::kStoreOnly) {
      Math::row_sums(f, sums);
      // The quad butterfly: lanes 4g..4g+3 hold one row; every lane ends with the same bits
      // ((a + b) + (c + d) on lanes 0 and 1, (c + d) + (a + b) on lanes 2 and 3: IEEE addition
      // commutes).
      CUTE_UNROLL
      for (int r = 0; r < Math::kRows; ++r) {
        CUTE_UNROLL
        for (int hh = 0; hh < Math::kHeadsPerTile; ++hh) {
          float s = sums[r][hh];
          s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 1));
          s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, 2));
          sums[r][hh] = s;
        }
      }
    }
    Math::store_qk_batches(a, m0, n0, f, sums, f1, f2);
  }

  Params params_;
};

/// The collective the kernel instantiates: the register epilogue behind the adapter that gives it
/// the TMA warp-specialized interface (empty pipelines, no producer load).
template <class TileShape, int kHeadDim, EpilogueLayout kLayout, typename FactorT,
          EpilogueWork kWork = EpilogueWork::kFull>
using FusedQkvCollectiveEpilogue =
    cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
        FusedQkvEpilogue<TileShape, kHeadDim, kLayout, FactorT, kWork>>;

}  // namespace qkvfuse::cuda::fused
