// qkv_backward_fp8.cu: the fused backward of the packed QKV projection output into FP8, in the
// two layouts the dgrad and wgrad GEMMs read (SPEC.md sections 3 and 8), CUDA backend.
//
// Math, per token t, fp32:
//   Q and K rows: dx of the norm/rotary backward (rope_rows.cuh backward_row, as
//                 qk_norm_rope_backward.cu) rounded to bf16, then e4m3(dx_bf16 / grad_scale)
//                 (true division, satfinite); with norm weights also their gradient sums
//   V rows:       e4m3(grad_v[t, h] / grad_scale); with the V norm (SPEC.md section 9) the V
//                 norm's gradient of grad_v at the saved v, rounded to bf16 first, as dx
//   grad_row[t, f] and grad_t[f, t] for f = [Q h*D+d | K (Hq+h)*D+d | V (Hq+Hkv)*D + h*Dv + d].
//
// Design. Bytes at the speedrun's T = 49152, H = 6, D = Dv = 128: read grad q/k/v and qk (377 MB)
// and the angle rows, write the two e4m3 copies (226 MB); the kernel touches each once, coalesced.
// - One CTA (256 threads) owns a tile of 128 tokens (64 for rows wider than 256) x one job: QK
//   input rows j and j + NJ (NJ = ceil((Hq + Hkv) / 2) jobs per tile) and V row j when j < Hkv.
//   With as many query as key heads that is exactly the Q, K and V rows of head j. The grid runs
//   job-fastest, so the CTAs that read a token's angle rows run together and the rows come from
//   L2 after the first.
// - QK rows are computed in registers by lane groups of G lanes (rope_common.cuh; the two rows of
//   a token share its angles). V is an element-wise convert over the tile. Each lane's e4m3 codes
//   of a chunk go straight to grad_row and into a shared-memory copy of the tile, [token][feature]
//   e4m3, tile x roundup(2D + Dv, 128) bytes (48 KB at 128 tokens of 384 features).
// - After one barrier the tile leaves transposed, as TransformerEngine's cast-transpose does: a
//   thread reads a 16 token x 4 feature block (16 x 4-byte reads), transposes it in registers
//   (8 byte-permutes per 4x4), and writes 4 feature rows of 16 tokens with 16-byte stores; the 8
//   consecutive lanes of a feature cover its 128 tokens (full 128-byte lines of grad_t).
// - Shared-memory banks: the word w of tile row r lives at r*pitch + (w ^ swizzle(r)), with the
//   pitch a multiple of 128 bytes and swizzle(r) = ((r/16 mod 8) << 2) ^ ((r mod 4) bit-reversed
//   into bits 3-4): the transposed read hits 32 distinct banks, and the 8-byte row writes of
//   groups of 4 or 8 lanes land on disjoint banks.
// - A CTA has one token step's loads in flight at a time and none while it waits at its barrier
//   and stores grad_t; L2 prefetches, which hold no register, cover part of that (Fp8Prefetch).
//   Read-once loads and the outputs are marked L2 evict-first, the prefetched rows evict-last.
// - The general layouts read their norm weights from the CTA's shared-memory copy behind the tile
//   (rope::SharedWeights). With norm weights each lane group sums its rows' gw * n in its own rows
//   of shared memory behind those (rope::WeightGradSums); after the transposed stores the CTA adds
//   its lane groups' sums in group order and writes one partial row for weight_grad.hpp's
//   fixed-order reduction.
// - Rows of 4- or 2-byte chunks (rope_paths.hpp) take the same phases with narrower accesses; when
//   grad_t's rows are not 16-byte aligned (T not a multiple of 16, or an unaligned grad_t) the
//   same blocks are written byte by byte.
// Measured choices (tile size, register budgets, prefetches, eviction hints, branch-free rows):
// perf_notes.md.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "backend.hpp"
#include "cuda/check.hpp"
#include "cuda/device_math.cuh"
#include "cuda/rope_args.hpp"
#include "cuda/rope_common.cuh"
#include "cuda/rope_config.cuh"
#include "cuda/rope_dispatch.hpp"
#include "cuda/rope_paths.hpp"
#include "cuda/rope_rows.cuh"
#include "cuda/weight_grad.hpp"

namespace qkvfuse::cuda {
namespace {

using rope::Chunk;
using rope::kFp8Threads;
using rope::Op;

// Tokens per CTA tile: the launch policy's (rope_config.cuh fp8_tile_tokens: 128, 64 for rows
// wider than 256). Up to 8 blocks of 16 tokens, which the shared-memory swizzle spreads over the
// 32 banks.
constexpr int kTokenBlock = 16;   // tokens per 16-byte grad_t store
static_assert(kFp8Threads % 32 == 0, "whole warps");

/// Everything the fused FP8 backward kernel reads. Strides in elements.
struct Fp8Args {
  rope::RopeInputs in;
  rope::GradRows grad;
  const uint16_t* grad_v;  ///< [T, Hkv, Dv]: (t, h, d) at t*grad_v_stride_t + h*grad_v_stride_h + d
  int64_t grad_v_stride_t;
  int64_t grad_v_stride_h;
  int v_dim;               ///< Dv in [1, 512]
  bool v_vectors;          ///< Dv a multiple of 8 and grad_v's rows 16-byte aligned
  bool code_pairs;         ///< grad_row's base and qkv_dim even: 2-byte code stores (chunks of 2)
  bool t_blocks;           ///< grad_t's base 16-byte aligned and T a multiple of 16: 16-byte
                           ///< blocks of 16 tokens (else byte stores)
  const float* grad_scale; ///< fp32 scalar in device memory
  uint8_t* grad_row;       ///< e4m3 [T, qkv_dim] row-major contiguous
  uint8_t* grad_t;         ///< e4m3 [qkv_dim, T] row-major contiguous
  int64_t qkv_dim;         ///< (Hq + Hkv) * D + Hkv * Dv
  int jobs;                ///< NJ = ceil((Hq + Hkv) / 2) CTAs per token tile
  int tile_pitch;          ///< bytes per token row of the shared tile: roundup(2D + Dv, 128)
  int resident_blocks;     ///< CTAs the device holds at once for this launch (>= 1)
  float* partials;         ///< weighted kernels: [CTAs][2][D], one row per CTA
  // SPEC.md section 9 (the Section9 configuration's kernels only; after what the kernels of
  // sections 1-8 read, which so keep their parameter offsets): the V norm's saved v.
  rope::Section9Inputs s9;
};

int jobs_per_tile(const RopeLayout& layout) {
  return int((layout.num_heads + kv_heads(layout) + 1) / 2);
}

template <class Config, class Geom, typename AngleT>
using Fp8Policy = rope::Policy<Op::kBackwardFp8, Config, Geom, AngleT>;

// ------------------------------------------------------------------------------------------------
// Shared-memory tile addressing
// ------------------------------------------------------------------------------------------------

/// XOR pattern of tile row r (bits 2-4 of the word index): token block r/16 in bits 2-4, r mod 4
/// bit-reversed into bits 3-4. Bit 0 is never touched, so 8-byte pairs stay adjacent.
__device__ __forceinline__ int tile_swizzle(int row) {
  return (((row >> 4) & 7) << 2) ^ (((row & 1) << 4) | ((row & 2) << 2));
}

/// Byte address (offset into the tile) of byte `byte` of row `row`: the swizzle permutes whole
/// words, so a byte keeps its place inside its word.
__device__ __forceinline__ uint32_t tile_offset(int row, int byte, int pitch) {
  return uint32_t(row * pitch + 4 * ((byte >> 2) ^ tile_swizzle(row)) + (byte & 3));
}

__device__ __forceinline__ void sts_u64(uint32_t addr, uint32_t lo, uint32_t hi) {
  asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(addr), "r"(lo), "r"(hi) : "memory");
}

__device__ __forceinline__ void sts_u16(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(addr), "h"(uint16_t(v)) : "memory");
}

__device__ __forceinline__ void sts_u8(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u8 [%0], %1;" ::"r"(addr), "h"(uint16_t(v)) : "memory");
}

__device__ __forceinline__ uint32_t lds_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

// ------------------------------------------------------------------------------------------------
// The CTA's rows
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

/// Codes of a chunk of 2 or 1 values, element 0 in the low byte.
template <int V>
__device__ __forceinline__ uint32_t encode_e4m3_small(const E4m3Scaler& scale,
                                                      const float (&v)[V]) {
  return float2_to_e4m3x2(scale(v[0]), V == 2 ? scale(v[V - 1]) : 0.0f);
}

/// Branch-free QK rows (rope::backward_row) and the scale test hoisted out of the token loop,
/// where it measured faster on the H200: 16-lane rows and key offset of the 16-byte kernels
/// (perf_notes.md; the narrow kernels keep __fdiv_rn, see qk_norm_rope_backward.cu).
template <class Geom, bool kKeyOffset>
constexpr bool fp8_branch_free() {
  return Geom::V == 8 && (Geom::G == 16 || kKeyOffset);
}

/// L2 prefetches of the token loop, where they measured faster (perf_notes.md): the next token
/// step's QK rows and angles always; for plain and paired rows also the V row during the loop's
/// second half and, after it, the first token step of the CTA that will take this one's place.
template <int G, bool kKeyOffset>
struct Fp8Prefetch {
  static constexpr bool kNextCta = !kKeyOffset;
  static constexpr bool kVRows = !kKeyOffset || G == 8;
};

/// One QK input row of the CTA (part 0: row j, part 1: row j + NJ): where its gradient and its qk
/// row start for token 0 and how far apart consecutive tokens are.
struct PartRows {
  const uint16_t* g;  ///< grad_q / grad_k at the row's output position for token 0
  int64_t g_step;     ///< per token (paired: two output tokens)
  const uint16_t* x;  ///< qk row of token 0
  int h2;             ///< input head
  bool present;       ///< part 1 of the last job when Hq + Hkv is odd: absent
  bool is_key;
  bool read_x;        ///< the backward reads the saved rows (rope::reads_saved_rows)

  /// `in`: p.in as the kernel sees it (Fixed::known).
  __device__ __forceinline__ PartRows(const Fp8Args& p, const rope::RopeInputs& in, int head2) {
    h2 = head2;
    present = head2 < in.dims.q_heads + in.dims.kv_heads;
    const qkvfuse::rope::Place at0 = qkvfuse::rope::place(in.dims, 0, head2);
    is_key = at0.is_key;
    const int64_t stride_t = is_key ? p.grad.k_stride_t : p.grad.q_stride_t;
    const int64_t stride_h = is_key ? p.grad.k_stride_h : p.grad.q_stride_h;
    g = (is_key ? p.grad.k : p.grad.q) + at0.token * stride_t + int64_t(at0.head) * stride_h;
    g_step = in.dims.paired ? 2 * stride_t : stride_t;
    x = in.qk + int64_t(head2) * in.qk_stride_h;
    read_x = rope::reads_saved_rows(in);
  }

  /// L2 prefetch of token t's chunks (the lines this lane will load), if t exists.
  template <class Geom>
  __device__ __forceinline__ void prefetch(const Fp8Args& p, int64_t t,
                                           const rope::LaneChunks<Geom>& lanes) const {
    if (t >= p.in.tokens || !present) return;
#pragma unroll
    for (int c = 0; c < Geom::C; ++c) {
      if (!lanes.ok[c]) continue;
      rope::prefetch_l2_evict_last(g + t * g_step + lanes.d0[c]);
      if (read_x) rope::prefetch_l2_evict_last(x + t * p.in.qk_stride_t + lanes.d0[c]);
    }
  }
};

/// The CTA's tile and job, and the feature layout of its shared tile:
/// [part 0 (D) | part 1 (D, if present) | V row (Dv, if j < Hkv)].
struct Job {
  int64_t t0;       ///< first token of the tile
  int j;            ///< job: QK rows j and j + NJ, V row j
  bool has_v;
  int features;     ///< the CTA's features in the tile
  int v_start;      ///< tile feature of the V row's first

  __device__ __forceinline__ Job(const Fp8Args& p, unsigned block, bool has_part1,
                                 int tile_tokens) {
    j = int(block % unsigned(p.jobs));
    t0 = int64_t(block / unsigned(p.jobs)) * tile_tokens;
    has_v = j < p.in.dims.kv_heads;
    const int D = p.in.dims.head_dim;
    v_start = has_part1 ? 2 * D : D;
    features = v_start + (has_v ? p.v_dim : 0);
  }

  /// The packed feature (row of grad_t, column of grad_row) of tile feature f (< features).
  __device__ __forceinline__ int64_t packed_feature(const Fp8Args& p, int f, int part1_h2) const {
    const int D = p.in.dims.head_dim;
    if (f < D) return int64_t(j) * D + f;
    if (f < v_start) return int64_t(part1_h2) * D + (f - D);
    const int heads2 = p.in.dims.q_heads + p.in.dims.kv_heads;
    return int64_t(heads2) * D + int64_t(j) * p.v_dim + (f - v_start);
  }
};

/// The e4m3 codes of one chunk of V values already rounded to bf16 (a Q/K row's dx, or the V
/// norm's dv): into grad_row at out_row + d, and into the tile (at `tile_base`, pitch `pitch`)
/// at row `row`, byte `byte`.
template <ScaleDivision kDivision, int V>
__device__ __forceinline__ void store_codes(const Fp8Args& p, const E4m3Scaler& scale,
                                            const float (&rounded)[V], uint8_t* out_row, int d,
                                            uint32_t tile_base, int row, int byte, int pitch) {
  if constexpr (V == 8) {
    uint32_t lo, hi;
    encode_e4m3<kDivision>(scale, rounded, lo, hi);
    rope::st_u64_evict_first(out_row + d, lo, hi);
    sts_u64(tile_base + tile_offset(row, byte, pitch), lo, hi);
  } else {
    const uint32_t codes = encode_e4m3_small<V>(scale, rounded);
    if (V == 2 && p.code_pairs) {
      rope::st_u16(out_row + d, codes);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) rope::st_u8(out_row + d + e, codes >> (8 * e));
    }
    if constexpr (V == 2) {
      sts_u16(tile_base + tile_offset(row, byte, pitch), codes);
    } else {
      sts_u8(tile_base + tile_offset(row, byte, pitch), codes);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// The kernel
// ------------------------------------------------------------------------------------------------

/// The kernel's work on its tile.
template <class Config, class Geom, typename AngleT, bool kExactWidth, bool kBranchFree,
          ScaleDivision kDivision>
__device__ __forceinline__ void fp8_tile(const Fp8Args& p, const E4m3Scaler& scale) {
  using Fix = rope::Fixed<Config>;
  constexpr bool kKeyOffset = Fix::kKeyOffset;
  constexpr int G = Geom::G;
  constexpr int V = Geom::V;
  constexpr int C = Geom::C;
  constexpr int kGroups = kFp8Threads / G;
  constexpr int kTileTokens = Fp8Policy<Config, Geom, AngleT>::kTileTokens;
  constexpr int kTokenBlocks = kTileTokens / kTokenBlock;
  constexpr int kTokensPerGroup = kTileTokens / kGroups;
  static_assert(kTileTokens % kGroups == 0, "lane groups must tile the token tile evenly");

  extern __shared__ __align__(128) uint8_t tile[];
  const uint32_t tile_base = uint32_t(__cvta_generic_to_shared(tile));

  const int D = rope::row_width<Geom, kExactWidth>(p.in.dims.head_dim);
  // The inputs with what the configuration fixes as constants.
  // (A token-wide norm never reaches this kernel: qkv_backward_fp8 below runs the bf16 backward
  // for it.)
  const rope::RopeInputs in = Fix::known(p.in, D);
  const int Dv = p.v_dim;
  const auto width = rope::row_width_divisor<Geom, kExactWidth>(D);
  const int pitch = p.tile_pitch;
  const PartRows part0(p, in, int(blockIdx.x % unsigned(p.jobs)));
  const PartRows part1(p, in, part0.h2 + p.jobs);
  const Job job(p, blockIdx.x, part1.present, kTileTokens);

  const int group = int(threadIdx.x) / G;
  const int lane = int(threadIdx.x) % G;
  const rope::LaneChunks<Geom> lanes(lane, D, in.dims.rotary_dim, Fix::kAllRotary);
  const bool exchange = rope::exchanges_partners<V>(in);
  const rope::Partners<Geom> partners(lanes, lane, in.dims.rotary_dim, in.dims.neox);
  // Behind the tile (configurations that may have weights): the norm weights [2][D], then (with
  // weights) the lane groups' weight-gradient sums [kGroups][2][D] (fp8_shared_bytes).
  float* weight_rows = reinterpret_cast<float*>(tile + size_t(kTileTokens) * size_t(pitch));
  float* group_sums = weight_rows + 2 * D;
  const rope::SharedWeights weights{weight_rows, rope::WeightLanes::per_head(D)};
  // Weight gradients to sum: a block-uniform value (a constant where the configuration fixes it).
  const bool weighted = Fix::kSpec.weights.only(rope::Weights::kWeighted) ||
                        (!Fix::kWeightless && p.partials != nullptr);
  // Null rows without weights: one object either way, so that it stays in registers.
  const rope::WeightGradSums sums{weighted ? group_sums + group * 2 * D : nullptr};
  if constexpr (!Fix::kWeightless) {
    rope::SharedWeights::fill(in, weights.at, weight_rows);
    if (weighted) sums.clear(lanes, D);
    __syncthreads();
  }

  // ---- Phase A1: the QK rows ------------------------------------------------------------------
  {
    // V row in the loop's second half: at step s >= kTokensPerGroup / 2 the group fetches the
    // rows of its tokens of steps s - kTokensPerGroup / 2 and s, one 128-byte line per lane.
    auto prefetch_v_row = [&](const int64_t tv) {
      if (tv >= in.tokens || !job.has_v) return;
      const uint16_t* v_row = p.grad_v + int64_t(job.j) * p.grad_v_stride_h + tv * p.grad_v_stride_t;
      for (int d = 64 * lane; d < Dv; d += 64 * G) rope::prefetch_l2(v_row + d);
    };

    // A cos/sin cache: the positions of the group's tokens, one per lane, loaded once, so that a
    // step's cache row waits for a shuffle instead of a load.
    using Angles = rope::TokenAngles<Geom, AngleT, Config>;
    static_assert(kTokensPerGroup <= G, "one token position per lane");
    int lane_row = 0;
    if constexpr (Fix::kMayCache) {
      const int64_t t_lane = job.t0 + group + int64_t(kGroups) * lane;
      lane_row = Angles::cache_row(in, t_lane, lane < kTokensPerGroup && t_lane < in.tokens);
    }

#pragma unroll 1
    for (int step = 0; step < kTokensPerGroup; ++step) {  // block-uniform trip count
      const int row = group + kGroups * step;              // consecutive groups: consecutive tokens
      const int64_t t = job.t0 + row;
      const bool token_ok = t < in.tokens;
      if (Fp8Prefetch<G, kKeyOffset>::kVRows && step >= kTokensPerGroup / 2) {
        prefetch_v_row(t - kTileTokens / 2);
        prefetch_v_row(t);
      }

      int cache_row = 0;
      if constexpr (Fix::kMayCache) cache_row = __shfl_sync(0xffffffffu, lane_row, step, G);
      Angles angles;
      angles.load(in, t, cache_row, qkvfuse::rope::place(in.dims, t, part0.h2).angle_offset, lanes,
                  token_ok, /*backward=*/true);

      // One row: part 0 or part 1 of the token; both share the angles. With one chunk per lane
      // the loads of both rows are issued before either is computed; wider rows go one at a time.
      struct RowLoads {
        Chunk<V> g[C], x[C], g_next[C];
      };
      // Under key offset (as many query as key heads) slot 0 is the head's query row and slot 1
      // its key row (known at compile time where the configuration fixes key offset).
      auto load_row = [&](const int slot, const PartRows& part, RowLoads& r) {
        const bool shifted_row = in.key_offset && slot == 1;
        const uint16_t* g_row = part.g + t * part.g_step;
        const uint16_t* x_row = part.x + t * in.qk_stride_t;
        const bool row_ok = token_ok && part.present;
        const bool next_ok = shifted_row && row_ok && t + 1 < in.tokens;
        // Rotary alone (no norm, no weights) never reads the saved rows (reads_saved_rows).
        const bool x_ok = row_ok && part.read_x;
#pragma unroll
        for (int c = 0; c < C; ++c) {
          const bool ok = row_ok && lanes.ok[c];
          // Key offset: grad_k rows are read again as the previous token's g_next (by the
          // neighbouring lane group, at about the same time): keep them in L1.
          r.g[c] = shifted_row
                       ? rope::load_chunk_if<rope::Load::kCached, V>(ok, g_row + lanes.d0[c])
                       : rope::load_chunk_if<rope::Load::kStreamEvictFirst, V>(ok, g_row + lanes.d0[c]);
          const bool x_chunk_ok = x_ok && lanes.ok[c];
          if constexpr (G == 16) {
            // The same load with its address named first: at G = 16 ptxas then issues the loads
            // of a token step back to back (perf_notes.md).
            const uint16_t* x_src = x_row + lanes.d0[c];
            r.x[c] = rope::load_chunk_if<rope::Load::kStreamEvictFirst, V>(x_chunk_ok, x_src);
          } else {
            r.x[c] = rope::load_chunk_if<rope::Load::kStreamEvictFirst, V>(x_chunk_ok,
                                                                            x_row + lanes.d0[c]);
          }
          r.g_next[c] = rope::load_chunk_if<rope::Load::kCached, V>(
              next_ok && lanes.ok[c] && lanes.rot_end[c] < V, g_row + part.g_step + lanes.d0[c]);
        }
      };
      auto emit_row = [&](const int slot, const PartRows& part, const RowLoads& r) {
        float dx[C][V];
        // An absent part (loads 0, the token's angles) adds nothing to the weight sums.
        rope::backward_row<Geom, Config, kBranchFree>(
            in, r.g, r.x, angles, r.g_next, lanes, partners, exchange,
            Fix::kWeightless ? nullptr : &weights, &sums,
            part.is_key ? part.h2 - in.dims.q_heads : part.h2, part.is_key,
            token_ok && part.present, in.key_offset && slot == 1, t == 0, width, dx);
        if (!(token_ok && part.present)) return;
        uint8_t* out_row = p.grad_row + t * p.qkv_dim + int64_t(part.h2) * D;
#pragma unroll
        for (int c = 0; c < C; ++c) {
          if (!lanes.ok[c]) continue;
          // Round to bf16 first (the aten chain materialized the QK gradient in bf16).
          float rounded[V];
          rope::to_float<V>(rope::to_bf16<V>(dx[c]), rounded);
          store_codes<kDivision>(p, scale, rounded, out_row, lanes.d0[c], tile_base, row,
                                 slot * D + lanes.d0[c], pitch);
        }
      };
      if constexpr (C == 1) {
        RowLoads r0, r1;
        load_row(0, part0, r0);
        load_row(1, part1, r1);
        if (step + 1 < kTokensPerGroup) {
          part0.prefetch(p, t + kGroups, lanes);
          part1.prefetch(p, t + kGroups, lanes);
        }
        emit_row(0, part0, r0);
        emit_row(1, part1, r1);
      } else {
        RowLoads r;
        load_row(0, part0, r);
        if (step + 1 < kTokensPerGroup) {
          part0.prefetch(p, t + kGroups, lanes);
          part1.prefetch(p, t + kGroups, lanes);
        }
        emit_row(0, part0, r);
        load_row(1, part1, r);
        emit_row(1, part1, r);
      }
    }
    if constexpr (Fp8Prefetch<G, kKeyOffset>::kNextCta) {
      const unsigned next = blockIdx.x + unsigned(p.resident_blocks);
      if (next < gridDim.x) {
        const PartRows next0(p, in, int(next % unsigned(p.jobs)));
        const PartRows next1(p, in, next0.h2 + p.jobs);
        const int64_t next_t0 = int64_t(next / unsigned(p.jobs)) * kTileTokens;
        next0.prefetch(p, next_t0 + group, lanes);
        next1.prefetch(p, next_t0 + group, lanes);
      }
    }
  }

  // ---- Phase A2: the V row, element-wise (with the V norm: row by row) -------------------------
  if (job.has_v) {
    const uint16_t* gv_base = p.grad_v + int64_t(job.j) * p.grad_v_stride_h;
    const int64_t v_feature = job.packed_feature(p, job.v_start, part1.h2);
    // The V norm: only in the kernels of a configuration that serves it (a constant false in the
    // others).
    bool v_norm = false;
    if constexpr (!Fix::kNoVNorm) v_norm = p.s9.normalize_v;
    if (v_norm) {
      // The V norm (SPEC.md section 9): a lane group per token as in phase A1, in the Q/K rows'
      // geometry (its width class covers Dv); dv rounded to bf16, then coded as dx is.
      const rope::LaneChunks<Geom> v_lanes(lane, Dv, 0);
      const UniformDivisor v_width{float(Dv)};
      const uint16_t* v_base = p.s9.v + int64_t(job.j) * p.s9.v_stride_h;
#pragma unroll 1
      for (int step = 0; step < kTokensPerGroup; ++step) {  // block-uniform trip count
        const int row = group + kGroups * step;
        const int64_t t = job.t0 + row;
        const bool token_ok = t < in.tokens;
        Chunk<V> g[C], x[C];
#pragma unroll
        for (int c = 0; c < C; ++c) {
          const bool ok = token_ok && v_lanes.ok[c];
          g[c] = rope::load_chunk_if<rope::Load::kStreamEvictFirst, V>(
              ok, gv_base + t * p.grad_v_stride_t + v_lanes.d0[c]);
          x[c] = rope::load_chunk_if<rope::Load::kStreamEvictFirst, V>(
              ok, v_base + t * p.s9.v_stride_t + v_lanes.d0[c]);
        }
        float dv[C][V];
        rope::v_norm_backward<Geom>(g, x, v_width, in.eps, dv);  // all lanes: shuffles
        if (!token_ok) continue;
        uint8_t* out_row = p.grad_row + t * p.qkv_dim + v_feature;
#pragma unroll
        for (int c = 0; c < C; ++c) {
          if (!v_lanes.ok[c]) continue;
          float rounded[V];
          rope::to_float<V>(rope::to_bf16<V>(dv[c]), rounded);
          store_codes<kDivision>(p, scale, rounded, out_row, v_lanes.d0[c], tile_base, row,
                                 job.v_start + v_lanes.d0[c], pitch);
        }
      }
    } else if (p.v_vectors) {
      const int chunks_per_row = Dv / 8;
      const int tile_chunks = kTileTokens * chunks_per_row;
      // u / chunks_per_row as a multiply-shift: exact for u < 2^14 and divisors <= 64.
      const uint32_t magic = ((1u << 20) + uint32_t(chunks_per_row) - 1) / uint32_t(chunks_per_row);
      constexpr int kUnroll = 4;
#pragma unroll 1
      for (int base = int(threadIdx.x); base < tile_chunks; base += kFp8Threads * kUnroll) {
        Chunk<8> v[kUnroll];
        int rows[kUnroll];
        int cols[kUnroll];
#pragma unroll
        for (int m = 0; m < kUnroll; ++m) {
          const int u = base + m * kFp8Threads;
          rows[m] = int((uint32_t(u) * magic) >> 20);
          cols[m] = 8 * (u - rows[m] * chunks_per_row);
          const bool ok = u < tile_chunks && job.t0 + rows[m] < in.tokens;
          v[m] = rope::load_chunk_if<rope::Load::kStreamEvictFirst, 8>(
              ok, gv_base + (job.t0 + rows[m]) * p.grad_v_stride_t + cols[m]);
        }
#pragma unroll
        for (int m = 0; m < kUnroll; ++m) {
          const int u = base + m * kFp8Threads;
          if (!(u < tile_chunks && job.t0 + rows[m] < in.tokens)) continue;
          float values[8];
          rope::to_float<8>(v[m], values);
          uint32_t lo, hi;
          encode_e4m3<kDivision>(scale, values, lo, hi);
          rope::st_u64_evict_first(p.grad_row + (job.t0 + rows[m]) * p.qkv_dim + v_feature +
                                       cols[m],
                                   lo, hi);
          sts_u64(tile_base + tile_offset(rows[m], job.v_start + cols[m], pitch), lo, hi);
        }
      }
    } else {
#pragma unroll 1
      for (int u = int(threadIdx.x); u < kTileTokens * Dv; u += kFp8Threads) {
        const int token = u / Dv;
        const int col = u - token * Dv;
        const int64_t t = job.t0 + token;
        if (t >= in.tokens) continue;
        const float value =
            __uint_as_float(uint32_t(__ldg(gv_base + t * p.grad_v_stride_t + col)) << 16);
        const uint32_t code = float2_to_e4m3x2(scale(value), 0.0f) & 0xffu;
        rope::st_u8(p.grad_row + t * p.qkv_dim + v_feature + col, code);
        sts_u8(tile_base + tile_offset(token, job.v_start + col, pitch), code);
      }
    }
  }

  __syncthreads();

  // ---- Phase B: the transposed copy, 16 tokens x 4 features per thread and step ---------------
  {
    const int feature_words = (job.features + 3) / 4;
    const int units = feature_words * kTokenBlocks;
    const bool aligned = p.t_blocks;
    // 16-byte chunks: the tile's parts start on multiples of 8 features (D and Dv multiples of
    // 8, rope_paths.hpp), so a word never straddles two parts and its 4 features are
    // consecutive packed features.
    constexpr bool whole_words = V == 8;
#pragma unroll 1
    for (int u = int(threadIdx.x); u < units; u += kFp8Threads) {
      const int token_block = u % kTokenBlocks;  // consecutive lanes: consecutive token blocks
      const int word = u / kTokenBlocks;         // 4 features 4*word .. 4*word + 3
      const int64_t t_first = job.t0 + token_block * kTokenBlock;
      if (t_first >= in.tokens) continue;
      uint32_t w[kTokenBlock];
#pragma unroll
      for (int r = 0; r < kTokenBlock; ++r) {
        w[r] = lds_u32(tile_base + tile_offset(token_block * kTokenBlock + r, 4 * word, pitch));
      }
      // 4x4 byte transposes: out[e].w[k] = byte e of w[4k], w[4k+1], w[4k+2], w[4k+3].
      Vec16 out[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t a = w[4 * k], b = w[4 * k + 1], c = w[4 * k + 2], d = w[4 * k + 3];
        const uint32_t ab_lo = __byte_perm(a, b, 0x5140);  // a0 b0 a1 b1
        const uint32_t ab_hi = __byte_perm(a, b, 0x7362);  // a2 b2 a3 b3
        const uint32_t cd_lo = __byte_perm(c, d, 0x5140);
        const uint32_t cd_hi = __byte_perm(c, d, 0x7362);
        out[0].w[k] = __byte_perm(ab_lo, cd_lo, 0x5410);  // a0 b0 c0 d0
        out[1].w[k] = __byte_perm(ab_lo, cd_lo, 0x7632);  // a1 b1 c1 d1
        out[2].w[k] = __byte_perm(ab_hi, cd_hi, 0x5410);
        out[3].w[k] = __byte_perm(ab_hi, cd_hi, 0x7632);
      }
      const int64_t first_feature = job.packed_feature(p, 4 * word, part1.h2);
      const int64_t remaining = in.tokens - t_first;
      const int count = remaining < kTokenBlock ? int(remaining) : kTokenBlock;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int f = 4 * word + e;
        if (!whole_words && f >= job.features) break;
        const int64_t feature = whole_words ? first_feature + e : job.packed_feature(p, f, part1.h2);
        uint8_t* dst = p.grad_t + feature * in.tokens + t_first;
        if (aligned) {
          rope::st_vec16_evict_first(dst, out[e]);
        } else {
#pragma unroll
          for (int r = 0; r < kTokenBlock; ++r) {  // unrolled: out[] stays in registers
            if (r < count) rope::st_u8(dst + r, (out[e].w[r >> 2] >> (8 * (r & 3))) & 0xffu);
          }
        }
      }
    }
  }

  // ---- The weight gradients: this CTA's partial row --------------------------------------------
  if (weighted) rope::write_partial_row<kGroups, kFp8Threads>(2, D, group_sums, p.partials);
}

/// Config: the configuration (rope_dispatch.hpp); kExactWidth: rows of exactly Geom's full width.
template <class Config, class Geom, typename AngleT, bool kExactWidth>
__global__ void __launch_bounds__(Fp8Policy<Config, Geom, AngleT>::kThreads,
                                  Fp8Policy<Config, Geom, AngleT>::min_blocks())
    qkv_backward_fp8_kernel(const __grid_constant__ Fp8Args p) {
  constexpr bool kKeyOffset = rope::Fixed<Config>::kKeyOffset;
  constexpr bool kBranchFree = fp8_branch_free<Geom, kKeyOffset>();
  const E4m3Scaler scale{*p.grad_scale};
  // The kernels with weight code (General, weighted configurations) keep one copy of the tile
  // code (compile time).
  if constexpr (kBranchFree && rope::Fixed<Config>::kWeightless) {
    if (scale.fast) {
      fp8_tile<Config, Geom, AngleT, kExactWidth, true, ScaleDivision::kFast>(p, scale);
    } else {
      fp8_tile<Config, Geom, AngleT, kExactWidth, true, ScaleDivision::kGeneral>(p, scale);
    }
  } else {
    fp8_tile<Config, Geom, AngleT, kExactWidth, kBranchFree, ScaleDivision::kTestPerCall>(p,
                                                                                         scale);
  }
}

/// Bytes of a tile of `tile_tokens` tokens of the widest features of heads up to `head_dim`.
constexpr size_t widest_tile_bytes(int tile_tokens, int64_t head_dim) {
  return size_t(tile_tokens) * size_t((2 * head_dim + kMaxVWidth + 127) / 128 * 128);
}

/// Largest tile any launch can ask for: 128 tokens of 2*256 + 512 bytes (128 KB; 64 tokens of
/// 2*512 + 512 bytes take 96 KB).
constexpr size_t kMaxTileBytes =
    std::max(widest_tile_bytes(rope::fp8_tile_tokens(256), 256),
             widest_tile_bytes(rope::fp8_tile_tokens(rope::kMaxHeadWidth), rope::kMaxHeadWidth));

/// Dynamic shared memory of a launch: the tile, then for the kernels with weight code the norm
/// weights ([2][D] floats) and, with weights, the lane groups' sums ([groups][2][D] floats).
constexpr size_t fp8_shared_bytes(size_t tile_bytes, bool general, bool weight_grad, int groups,
                                  int64_t head_dim) {
  const size_t rows = 2 * size_t(head_dim) * sizeof(float);
  return tile_bytes + (general ? rows : 0) + (weight_grad ? size_t(groups) * rows : 0);
}

/// Largest dynamic shared memory any launch can ask for: the widest tile, the weights at D = 512
/// and 64 KB of sums, above every geometry's (the most: 64 groups of 4 lanes at D = 96, 48 KB;
/// 8 groups of 32 at D = 512, 32 KB); launch_fp8 checks each launch against it. 196 KB.
constexpr size_t kMaxSharedBytes =
    fp8_shared_bytes(kMaxTileBytes, true, false, 0, rope::kMaxHeadWidth) + 64 * 1024;
static_assert(kMaxSharedBytes <= 227 * 1024, "an sm_90 CTA holds at most 227 KB");

/// Once per kernel instantiation and device (the current one, `device`): opts `kKernel` in to
/// kMaxSharedBytes of dynamic shared memory and the largest shared-memory carveout (the attributes
/// belong to the function on the current device). The limit is set once to the maximum any
/// launch needs rather than to each launch's size: a limit lowered by a smaller launch let a
/// later, larger launch fail with cudaErrorInvalidValue. The limit does not change occupancy,
/// which follows the bytes a launch actually asks for.
///
/// Returns the CTAs with `smem` bytes of shared memory the device holds at once (occupancy x
/// SMs, under the carveout just set), for the next-CTA prefetch; cached per device and size class
/// (16 KB: the tile's step, 128 bytes per token of a 128-token tile, and the weights and sums of
/// one instantiation are the same for every launch of one head width).
template <auto kKernel>
int prepare_kernel(int device, size_t smem) {
  constexpr int kDevices = 64;
  constexpr size_t kSizeClass = 16 * 1024;
  constexpr size_t kSizes = kMaxSharedBytes / kSizeClass + 1;
  static std::array<std::atomic<bool>, kDevices> opted_in{};
  static std::array<std::atomic<int>, kDevices * kSizes> resident{};
  QKVF_CHECK(device >= 0 && device < kDevices, "device ordinal ", device,
             " beyond the supported 64");
  if (!opted_in[device].load(std::memory_order_acquire)) {
    QKVF_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(kMaxSharedBytes)));
    // The largest shared-memory carveout: 4 CTAs of 48 KB (fp8_min_blocks) need 196 KB of it.
    QKVF_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         int(cudaSharedmemCarveoutMaxShared)));
    opted_in[device].store(true, std::memory_order_release);
  }
  std::atomic<int>& slot = resident[size_t(device) * kSizes + smem / kSizeClass];
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

/// `planned_tokens`: the tokens per tile the host planned (tile_tokens(params)).
template <class Config, class Geom, typename AngleT, bool kExactWidth>
void launch_fp8(Fp8Args args, int planned_tokens, int device, cudaStream_t stream) {
  using Policy = Fp8Policy<Config, Geom, AngleT>;
  constexpr auto kernel = qkv_backward_fp8_kernel<Config, Geom, AngleT, kExactWidth>;
  // The host's tiles (weight_ctas: the workspace) and the kernel's must agree.
  QKVF_CHECK(Policy::kTileTokens == planned_tokens, "qkv_backward_fp8 (CUDA): tiles of ",
             planned_tokens, " tokens planned, the kernel's are ", Policy::kTileTokens);
  const size_t smem = fp8_shared_bytes(size_t(Policy::kTileTokens) * size_t(args.tile_pitch),
                                       !rope::Fixed<Config>::kWeightless, args.partials != nullptr,
                                       Policy::kThreads / Geom::G, args.in.dims.head_dim);
  QKVF_CHECK(smem <= kMaxSharedBytes, "qkv_backward_fp8 (CUDA): ", smem, " bytes of shared memory");
  // Above 48 KB a kernel must opt in to its dynamic shared memory; done for every kernel so that
  // the carveout preference applies at 48 KB too.
  args.resident_blocks = prepare_kernel<kernel>(device, smem);
  const int64_t tiles = (args.in.tokens + Policy::kTileTokens - 1) / Policy::kTileTokens;
  const unsigned blocks =
      rope::grid_size("qkv_backward_fp8", tiles * args.jobs, args.in.tokens);
  kernel<<<dim3(blocks), dim3(Policy::kThreads), smem, stream>>>(args);
  QKVF_CUDA_CHECK_LAUNCH("qkv_backward_fp8_kernel");
}

/// Tokens per tile of the call (rope::fp8_tile_tokens of its widest row).
int tile_tokens(const QkvBackwardFp8Params& params) {
  const int64_t head_dim = params.qk.sizes[2];
  return rope::fp8_tile_tokens(std::max(head_dim, rope::v_width(params.layout, params.v)));
}

/// Partial rows with weights: one per CTA.
int64_t weight_ctas(const QkvBackwardFp8Params& params) {
  const int64_t tile = tile_tokens(params);
  return (params.qk.sizes[0] + tile - 1) / tile * jobs_per_tile(params.layout);
}

// ---- A token-wide norm (SPEC.md section 9) ------------------------------------------------------
// Its rows' scalars span every head of a token, which this kernel's CTAs (two heads of a tile
// each) do not see together. So the op runs in two steps, as the CPU backend defines it
// (cpu/qkv_backward_fp8.cpp): the bf16 backward (qk_norm_rope_backward.cu's token-wide kernel,
// and the weights' gradients) into a bf16 dx in the workspace, then this kernel on dx with a
// layout whose rows pass through unchanged (no norm, no weights, no angles, plain placement):
// e4m3(dx / grad_scale), dx already rounded to bf16; the V rows as always. It moves dx twice more
// than a fused pass (written, read back); not measured.

/// The bf16 backward's part of a token-wide norm's workspace: its weight-gradient partials, then
/// up to 16 bytes of padding (dx starts on a 16-byte boundary when the workspace does).
int64_t token_partial_floats(const QkvBackwardFp8Params& params) {
  if (!rope::has_weights(params.layout)) return 0;
  const QkNormRopeBackwardParams bf16{.qk = params.qk, .layout = params.layout};
  return (qkvfuse::cuda::backward_workspace_size(bf16) + 3) / 4 * 4;
}

/// Floats of dx [T, Hq + Hkv, D] bf16.
int64_t token_dx_floats(const QkvBackwardFp8Params& params) {
  return (params.qk.numel() + 1) / 2;
}

void token_norm_fp8(const QkvBackwardFp8Params& params) {
  const int64_t T = params.qk.sizes[0], heads2 = params.qk.sizes[1], D = params.qk.sizes[2];
  const int64_t q_heads = params.layout.num_heads;
  float* workspace = static_cast<float*>(params.workspace.data);
  const int64_t partial_floats = token_partial_floats(params);
  uint16_t* dx = reinterpret_cast<uint16_t*>(workspace + partial_floats);
  const Device device = params.qk.device;
  // Step 1: dx and the weights' gradients (the workspace's first part holds their partials).
  QkNormRopeBackwardParams bf16{
      .grad_q = params.grad_q,
      .grad_k = params.grad_k,
      .qk = params.qk,
      .grad_qk = make_view(dx, DType::kBFloat16, device, {T, heads2, D}),
      .grad_q_weight = params.grad_q_weight,
      .grad_k_weight = params.grad_k_weight,
      .workspace = partial_floats > 0
                       ? make_view(workspace, DType::kFloat32, device, {partial_floats})
                       : TensorView{},
      .layout = params.layout,
      .stream = params.stream};
  qkvfuse::cuda::qk_norm_rope_backward(bf16);
  // Step 2: the codes of dx's rows, each passing through as it is.
  RopeLayout through;
  through.num_heads = q_heads;
  through.num_kv_heads = params.layout.num_kv_heads;
  through.query_only = params.layout.query_only;
  through.normalize = false;
  through.rotary_dim = 0;
  QkvBackwardFp8Params codes = params;
  codes.layout = through;
  codes.qk = bf16.grad_qk;
  codes.grad_q = make_view(dx, DType::kBFloat16, device, {T, q_heads, D}, {heads2 * D, D, 1});
  codes.grad_k = make_view(dx + q_heads * D, DType::kBFloat16, device, {T, heads2 - q_heads, D},
                           {heads2 * D, D, 1});
  codes.grad_q_weight = codes.grad_k_weight = codes.workspace = TensorView{};
  qkvfuse::cuda::qkv_backward_fp8(codes);
}

}  // namespace

int64_t backward_workspace_size(const QkvBackwardFp8Params& params) {
  if (params.layout.norm_scope == NormScope::kToken) {
    return token_partial_floats(params) + token_dx_floats(params);
  }
  if (!rope::has_weights(params.layout)) return 0;
  return weight_grad::workspace_floats(weight_ctas(params), 2 * params.qk.sizes[2]);
}

void qkv_backward_fp8(const QkvBackwardFp8Params& params) {
  DeviceGuard guard(params.qk.device);
  if (params.layout.norm_scope == NormScope::kToken) return token_norm_fp8(params);
  const RopeLayout& layout = params.layout;
  const int64_t tokens = params.qk.size(0);
  const int64_t head_dim = params.qk.size(2);
  const int64_t v_dim = params.grad_v.size(2);
  const bool weighted = rope::has_weights(layout);
  const cudaStream_t stream = to_cuda(params.stream);
  float* workspace = static_cast<float*>(params.workspace.data);
  if (tokens == 0) {
    // Nothing to compute; the weight gradients of no rows are zeros.
    if (weighted) {
      weight_grad::reduce(workspace, 0, int(head_dim), int(head_dim), params.grad_q_weight,
                          params.grad_k_weight, stream);
    }
    return;
  }
  const int width = rope::chunk_width(params);
  const int64_t features = qkv_dim(layout, head_dim, v_dim);
  const Fp8Args args{
      .in = rope::make_rope_inputs(layout, params.qk),
      .grad = rope::make_grad_rows(params.grad_q, params.grad_k),
      .grad_v = static_cast<const uint16_t*>(params.grad_v.data),
      .grad_v_stride_t = params.grad_v.strides[0],
      .grad_v_stride_h = params.grad_v.strides[1],
      .v_dim = int(v_dim),
      .v_vectors = rope::fp8_v_vectors(params, width),
      .code_pairs = reinterpret_cast<uintptr_t>(params.grad_row.data) % 2 == 0 && features % 2 == 0,
      .t_blocks = reinterpret_cast<uintptr_t>(params.grad_t.data) % 16 == 0 && tokens % 16 == 0,
      .grad_scale = static_cast<const float*>(params.grad_scale.data),
      .grad_row = static_cast<uint8_t*>(params.grad_row.data),
      .grad_t = static_cast<uint8_t*>(params.grad_t.data),
      .qkv_dim = features,
      .jobs = jobs_per_tile(layout),
      .tile_pitch = int((2 * head_dim + v_dim + 127) / 128 * 128),
      .resident_blocks = 1,
      .partials = weighted ? workspace : nullptr,
      .s9 = rope::make_section9_inputs(layout, params.v),
  };
  const int device = params.qk.device.index;
  rope::dispatch<Op::kBackwardFp8>(
      "qkv_backward_fp8", rope::rope_key(layout, head_dim, width, rope::v_width(layout, params.v)),
      [&](auto config, auto geometry, auto angle, auto exact) {
        launch_fp8<decltype(config), decltype(geometry), typename decltype(angle)::type,
                   decltype(exact)::value>(args, tile_tokens(params), device, stream);
      });
  if (weighted) {
    weight_grad::reduce(workspace, weight_ctas(params), int(head_dim), int(head_dim),
                        params.grad_q_weight, params.grad_k_weight, stream);
  }
}

}  // namespace qkvfuse::cuda
