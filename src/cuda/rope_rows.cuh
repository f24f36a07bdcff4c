// rope_rows.cuh: the per-row math of the rope kernels, for every layout of SPEC.md sections 1 and
// 8, on the chunks of rope_common.cuh. Internal.
//
// A lane holds chunk slots c = 0..C-1 of a row (elements d0[c] .. d0[c] + V - 1). What a row needs
// besides its own elements:
// - its token's angles (TokenAngles): factor tables, or the cos/sin cache row at positions[t];
// - its weight (SharedWeights): w + offset, 1 without one, from the block's shared-memory copy;
// - the elements of its rotary partners. Interleaved pairs (d, d ^ 1) sit in one chunk when
//   V >= 2. A NeoX partner (d +- r/2) sits in another chunk, usually another lane's: the lane
//   group exchanges it with shuffles (Partners). With V = 8 (r a multiple of 16) a chunk's
//   partners form one chunk; with V <= 2 each element finds its own.
//
// Configurations. Each kernel is instantiated for one configuration, a row of rope_dispatch.hpp's
// table (or General), and reads it through Fixed<Config>: a property the row fixes to one value is
// a constant in its kernels (known() writes it into the kernel's copy of the arguments, so every
// test of it folds), every other property is read at run time. The kernels' shapes follow from the
// same facts: no weight code where the row fixes "no weights", the per-chunk forward
// (forward_chunk) where it fixes interleaved pairs, RMS and no weights, no cos/sin cache code where
// it fixes factor tables.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/device_math.cuh"
#include "cuda/rope_args.hpp"
#include "cuda/rope_common.cuh"
#include "cuda/rope_dispatch.hpp"
#include "rope_math.hpp"

namespace qkvfuse::cuda::rope {

/// What configuration Config (a row of rope_dispatch.hpp, or General) fixes, as its kernels ask.
template <class Config>
struct Fixed {
  static constexpr Spec kSpec = Config::kSpec;
  /// Key offset as a compile-time form (its own loads and stores); the rows that may take it at
  /// run time read in.key_offset.
  static constexpr bool kKeyOffset = kSpec.placement.only(Placement::kKeyOffset);
  /// r = D and no key offset: every lane of a row rotates (LaneChunks drops the pass-through).
  static constexpr bool kAllRotary =
      kSpec.span.only(RotarySpan::kWhole) && !kSpec.placement.contains(Placement::kKeyOffset);
  static constexpr bool kWeightless = kSpec.weights.only(Weights::kNone);
  static constexpr bool kMayCache = kSpec.angles.contains(AngleSource::kCache);
  static constexpr bool kMayNeox = kSpec.rotary.contains(Rotary::kNeox);
  static constexpr bool kTablesOnly = kSpec.angles.only(AngleSource::kTables);
  static constexpr bool kCacheNeoxWhole = kSpec.angles.only(AngleSource::kCache) &&
                                          kSpec.rotary.only(Rotary::kNeox) &&
                                          kSpec.span.only(RotarySpan::kWhole);
  /// One RMS per head row (no token-wide norm) and no V rows: the kernels of sections 1-8, which
  /// hold no code of section 9's (its token-wide kernels, its V rows) and never read the
  /// arguments' Section9Inputs.
  static constexpr bool kHeadScope = kSpec.scope.only(NormScope::kHead);
  static constexpr bool kNoVNorm = kSpec.v_norm.only(VNorm::kNone);
  /// Interleaved pairs, RMS, no weights: the forward rotates chunk by chunk (forward_chunk).
  static constexpr bool kChunkRotation = kSpec.norm.only(Norm::kRms) && kWeightless &&
                                         kSpec.rotary.only(Rotary::kInterleaved);

  /// The inputs as this configuration's kernels see them, their rows D wide (row_width): what
  /// the row fixes to one value written in as constants, so that the compiler folds every test
  /// of it; the rest as they come.
  __device__ __forceinline__ static RopeInputs known(const RopeInputs& in, int D) {
    RopeInputs out = in;
    if constexpr (kSpec.angles.only(AngleSource::kCache)) out.angles.cache = true;
    if constexpr (kSpec.angles.only(AngleSource::kTables)) out.angles.cache = false;
    // The angles' dtype: a run-time value of the narrow kernels (RunTimeAngles), a constant where
    // the row fixes it.
    if constexpr (kSpec.angle_type.only(AngleType::kBf16)) out.angles.fp32 = false;
    if constexpr (kSpec.angle_type.only(AngleType::kFp32)) out.angles.fp32 = true;
    if constexpr (kSpec.rotary.only(Rotary::kNeox)) out.dims.neox = true;
    if constexpr (kSpec.rotary.only(Rotary::kInterleaved)) out.dims.neox = false;
    if constexpr (kSpec.span.only(RotarySpan::kWhole)) out.dims.rotary_dim = D;
    if constexpr (kSpec.norm.only(Norm::kRms)) out.normalize = true;
    if constexpr (kSpec.norm.only(Norm::kNone)) out.normalize = false;
    if constexpr (kWeightless) {
      out.weights.q = nullptr;
      out.weights.k = nullptr;
    }
    if constexpr (!kSpec.placement.contains(Placement::kPaired)) out.dims.paired = false;
    if constexpr (kSpec.placement.only(Placement::kPaired)) out.dims.paired = true;
    if constexpr (!kSpec.placement.contains(Placement::kKeyOffset)) out.key_offset = false;
    if constexpr (kKeyOffset) out.key_offset = true;
    out.dims.head_dim = D;  // the row width: a constant in the exact-width kernels
    return out;
  }
};

/// The narrow kernels' angle type: the dtype of the tables or cache read at run time
/// (RopeInputs::angles.fp32), one kernel for both.
struct RunTimeAngles {};

/// bf16 tables as their bits (uint16_t) or fp32: the element type the kernels load tables as.
template <typename T>
using TableT = std::conditional_t<std::is_same_v<T, float>, float, uint16_t>;

/// Element `offset` of a bf16 (`fp32` false) or fp32 table, as an untyped address.
__device__ __forceinline__ const void* table_row(const void* base, int64_t offset, bool fp32) {
  return fp32 ? static_cast<const void*>(static_cast<const float*>(base) + offset)
              : static_cast<const void*>(static_cast<const uint16_t*>(base) + offset);
}

// ------------------------------------------------------------------------------------------------
// The lane's chunks of a row
// ------------------------------------------------------------------------------------------------

/// Chunk slot c of the lane: its first element, whether it lies inside the row, and how many of
/// its elements are rotary lanes (the rest, d >= r, pass through or, for keys under key offset,
/// come from the neighbouring token).
template <class Geom>
struct LaneChunks {
  static constexpr int V = Geom::V;
  static constexpr int C = Geom::C;
  int d0[C];
  bool ok[C];
  int rot_end[C];  ///< elements [0, rot_end) of the chunk are rotary lanes; in [0, V]

  /// `all_rotary` (a compile-time constant at every call: Fixed::kAllRotary, the kernels of a
  /// configuration that fixes r = D and no key offset) lets the compiler drop the pass-through
  /// selects.
  __device__ __forceinline__ LaneChunks(int lane, int D, int r, bool all_rotary = false) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
      d0[c] = V * (c * Geom::G + lane);
      ok[c] = d0[c] < D;
      rot_end[c] = all_rotary ? V : min(V, max(0, r - d0[c]));
    }
  }
};

// ------------------------------------------------------------------------------------------------
// Partners: NeoX lanes (and interleaved ones at V = 1) from other chunks
// ------------------------------------------------------------------------------------------------

/// Where the partners of the lane's elements are held: lane and slot of the group, and the
/// element inside that chunk. Lanes without a partner (d >= r) point at themselves.
template <class Geom>
struct Partners {
  static constexpr int V = Geom::V;
  static constexpr int C = Geom::C;
  static constexpr int G = Geom::G;
  // V = 8: one source per chunk (NeoX with r a multiple of 16: element i pairs with element i).
  // V <= 2: one source per element.
  static constexpr int kPerChunk = V == 8 ? 1 : V;
  int lane[C][kPerChunk];
  int slot[C][kPerChunk];
  int pos[C][kPerChunk];

  __device__ __forceinline__ Partners(const LaneChunks<Geom>& lanes, int own_lane, int r,
                                      bool neox) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
#pragma unroll
      for (int e = 0; e < kPerChunk; ++e) {
        const int d = lanes.d0[c] + e;
        const int p = d < r ? qkvfuse::rope::partner(d, r, neox) : d;
        const int chunk = p / V;
        lane[c][e] = d < r ? chunk % G : own_lane;
        slot[c][e] = d < r ? chunk / G : c;
        pos[c][e] = V == 8 ? e : p % V;
      }
    }
  }

  /// The partners of chunk slot c's elements, from the group's chunks `x` (every lane of the
  /// warp must call it: shuffles).
  __device__ __forceinline__ Chunk<V> of(const Chunk<V> (&x)[C], int c) const {
    Chunk<V> out;
    if constexpr (Geom::kNeoxPairsInLane) {
      out = x[1 - c];  // the lane's other slot
    } else if constexpr (V == 8) {
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        uint32_t value = 0u;
#pragma unroll
        for (int s = 0; s < C; ++s) {
          const uint32_t got = __shfl_sync(0xffffffffu, x[s].w[w], lane[c][0], G);
          value = C == 1 || s == slot[c][0] ? got : value;  // one slot: no select
        }
        out.w[w] = value;
      }
    } else {
      uint32_t halves[V];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        uint32_t word = 0u;
#pragma unroll
        for (int s = 0; s < C; ++s) {
          const uint32_t got = __shfl_sync(0xffffffffu, x[s].w[0], lane[c][e], G);
          word = s == slot[c][e] ? got : word;
        }
        halves[e] = pos[c][e] == 0 ? (word & 0xffffu) : (word >> 16);
      }
      out.w[0] = V == 2 ? (halves[0] | (halves[V - 1] << 16)) : halves[0];
    }
    return out;
  }

  /// The partners' fp32 values of chunk slot c (from `v`, the lane group's values per chunk slot);
  /// every lane of the warp must call it.
  __device__ __forceinline__ void values_of(const float (&v)[C][V], int c, float (&out)[V]) const {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      float value = 0.0f;
      if constexpr (Geom::kNeoxPairsInLane) {
        value = v[1 - c][e];  // the lane's other slot
      } else {
        const int source_lane = lane[c][V == 8 ? 0 : e];
        const int source_slot = slot[c][V == 8 ? 0 : e];
#pragma unroll
        for (int s = 0; s < C; ++s) {
          if constexpr (V == 8) {
            const float got = __shfl_sync(0xffffffffu, v[s][e], source_lane, G);
            value = C == 1 || s == source_slot ? got : value;  // one slot: no select
          } else {
#pragma unroll
            for (int q = 0; q < V; ++q) {
              const float got = __shfl_sync(0xffffffffu, v[s][q], source_lane, G);
              value = s == source_slot && q == pos[c][e] ? got : value;
            }
          }
        }
      }
      out[e] = value;
    }
  }
};

/// True when the kernel must fetch partners from other chunks: NeoX lanes, or V = 1. `in` as the
/// kernel sees it (Fixed::known): a constant where the configuration fixes the rotary style.
template <int V>
__device__ __forceinline__ bool exchanges_partners(const RopeInputs& in) {
  return V == 1 || in.dims.neox;
}

// ------------------------------------------------------------------------------------------------
// Angles of a token
// ------------------------------------------------------------------------------------------------

/// A row's rotation factors per element (SPEC.md section 8): y[d] = f1[d] * nw[d] + f2[d] *
/// nw[p(d)], and in the backward gw[d] = f1[d] * g[d] + f2p[d] * g[p(d)] with f2p[d] = f2[p(d)].
/// From factor tables f1 and f2 are the table values; from the cache f1 = cos_i and f2 = -sin_i
/// for the first lane of a pair, +sin_i for the second (so f2p = -f2).
///
/// V = 8 keeps the loaded words (tables: f1, f2, and f2 at the partner chunk for NeoX; cache: the
/// cos and sin of the chunk's frequencies, 8 for NeoX, 4 interleaved), typed by AngleT. V <= 2
/// keeps fp32 values, read with the dtype as a run-time value (AngleT = RunTimeAngles), and so
/// does V = 8 with RunTimeAngles (the token-wide norm's kernels: one kernel for both dtypes).
/// A position outside [0, P) loads nothing and leaves NaN everywhere (SPEC: never out of bounds).
template <class Geom, typename AngleT, class Config>
struct TokenAngles {
  static constexpr int V = Geom::V;
  static constexpr int C = Geom::C;
  using T = TableT<AngleT>;
  using Fix = Fixed<Config>;
  static constexpr bool kWords = V == 8 && !std::is_same_v<AngleT, RunTimeAngles>;
  static_assert(V == 8 || std::is_same_v<AngleT, RunTimeAngles>,
                "the narrow kernels read the angles' dtype at run time");

  // NeoX pairs in lane (a cos/sin cache, NeoX over the whole row): slot 1's frequencies are slot
  // 0's, loaded once.
  static_assert(!Geom::kNeoxPairsInLane || Fix::kCacheNeoxWhole,
                "NeoX pairs in lane: a configuration that fixes a cos/sin cache, NeoX and r = D");
  static constexpr int kSlots = Geom::kNeoxPairsInLane ? 1 : C;
  __device__ __forceinline__ static constexpr int slot(int c) {
    return Geom::kNeoxPairsInLane ? 0 : c;
  }

  // V = 8: a = f1 or cos, b = f2 or sin, pb = f2 at the partner chunk (NeoX tables, backward).
  Values<T, 8> a[kWords ? kSlots : 1];
  Values<T, 8> b[kWords ? kSlots : 1];
  static constexpr bool kPartnerTables =
      kWords && Fix::kMayNeox && !Fix::kSpec.angles.only(AngleSource::kCache);
  Values<T, 8> pb[kPartnerTables ? kSlots : 1];
  // V <= 2.
  float f1v[kWords ? 1 : C][V];
  float f2v[kWords ? 1 : C][V];
  float f2pv[kWords ? 1 : C][V];
  bool lead[C];  ///< cache, V = 8: the chunk's lanes lead their pairs (NeoX: d < r/2)

  /// The cos/sin cache row of token t: positions[t], or -1 outside [0, P) (validation keeps P
  /// below 2^31); 0 for tables and for a token past the end. Its own step because the cache row
  /// waits for it: kernels issue it before their row loads, which need not wait (perf_notes.md,
  /// "The general layouts").
  __device__ __forceinline__ static int cache_row(const RopeInputs& in, int64_t t, bool token_ok) {
    if (!in.angles.cache || !token_ok) return 0;
    const int64_t position =
        in.angles.positions_int64
            ? __ldg(static_cast<const long long*>(in.angles.positions) +
                    t * in.angles.positions_stride)
            : int64_t(__ldg(static_cast<const int*>(in.angles.positions) +
                            t * in.angles.positions_stride));
    return position >= 0 && position < in.angles.num_positions ? int(position) : -1;
  }

  /// Loads the angles of token t for rows whose table columns start at `angle_offset` (paired
  /// heads); `row` is cache_row's for t. `backward` also loads what f2p needs. Only the rotary
  /// chunks load.
  __device__ __forceinline__ void load(const RopeInputs& in, int64_t t, int row,
                                       int angle_offset, const LaneChunks<Geom>& lanes,
                                       bool token_ok, bool backward) {
    const int r = in.dims.rotary_dim;
    const bool neox = in.dims.neox;
    if (!in.angles.cache) {
      const T* f1 = static_cast<const T*>(in.angles.factor1) + t * in.angles.factor1_stride +
                    angle_offset;
      const T* f2 = static_cast<const T*>(in.angles.factor2) + t * in.angles.factor2_stride +
                    angle_offset;
      // Narrow kernels: the same rows with the dtype read at run time.
      const void* f1_row = table_row(in.angles.factor1, t * in.angles.factor1_stride + angle_offset,
                                     in.angles.fp32);
      const void* f2_row = table_row(in.angles.factor2, t * in.angles.factor2_stride + angle_offset,
                                     in.angles.fp32);
#pragma unroll
      for (int c = 0; c < kSlots; ++c) {
        const bool valid = token_ok && lanes.ok[c] && lanes.rot_end[c] > 0;
        const int d0 = lanes.d0[c];
        if constexpr (kWords) {
          a[c].load(f1 + d0, valid);
          b[c].load(f2 + d0, valid);
          if constexpr (kPartnerTables) {
            const int pd0 = d0 < r / 2 ? d0 + r / 2 : d0 - r / 2;
            pb[c].load(f2 + pd0, valid && neox && backward);
          }
        } else {
#pragma unroll
          for (int e = 0; e < V; ++e) {
            const int d = d0 + e;
            const bool rotary = valid && d < r;
            const int p = rotary ? qkvfuse::rope::partner(d, r, neox) : d;
            f1v[c][e] = rotary ? load_value(f1_row, d, in.angles.fp32) : 0.0f;
            f2v[c][e] = rotary ? load_value(f2_row, d, in.angles.fp32) : 0.0f;
            f2pv[c][e] = rotary && backward ? load_value(f2_row, p, in.angles.fp32) : 0.0f;
          }
        }
      }
      return;
    }
    // The cos/sin cache row of the token's position.
    const bool inside = row >= 0;
    const T* cos = static_cast<const T*>(in.angles.cos_sin) +
                   int64_t(inside ? row : 0) * in.angles.cos_sin_stride;
    const T* sin = cos + r / 2;
    const void* cos_row = table_row(in.angles.cos_sin,
                                    int64_t(inside ? row : 0) * in.angles.cos_sin_stride,
                                    in.angles.fp32);
    const void* sin_row = table_row(cos_row, r / 2, in.angles.fp32);
    const float nan = __uint_as_float(0x7fc00000u);
#pragma unroll
    for (int c = 0; c < kSlots; ++c) {
      const int d0 = lanes.d0[c];
      const bool valid = token_ok && lanes.ok[c] && lanes.rot_end[c] > 0;
      if constexpr (kWords) {
        // NeoX: frequencies d0 .. d0+7 (or d0 - r/2 ..), 8 values; interleaved: d0/2 .. d0/2+3.
        const int first = neox ? (d0 < r / 2 ? d0 : d0 - r / 2) : d0 / 2;
        lead[c] = d0 < r / 2;
        if (neox) {
          a[c].load(cos + first, valid && inside);
          b[c].load(sin + first, valid && inside);
        } else {
          a[c].load_half(cos + first, valid && inside);
          b[c].load_half(sin + first, valid && inside);
        }
        if (valid && !inside) {
          a[c].fill_nan();
          b[c].fill_nan();
        }
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const int d = d0 + e;
          const bool rotary = valid && d < r;
          const int i = qkvfuse::rope::frequency(d, r, neox);
          // NaN only in the rotary lanes of a token whose position is outside the cache: masked
          // lanes and tokens must stay 0 (they still feed the weight-gradient sums, times 0).
          const float cos_i =
              rotary ? (inside ? load_value(cos_row, i, in.angles.fp32) : nan) : 0.0f;
          const float sin_i =
              rotary ? (inside ? load_value(sin_row, i, in.angles.fp32) : nan) : 0.0f;
          const bool leads = qkvfuse::rope::leads_pair(d, r, neox);
          f1v[c][e] = cos_i;
          f2v[c][e] = leads ? -sin_i : sin_i;
          f2pv[c][e] = leads ? sin_i : -sin_i;
        }
      }
    }
  }

  // `in` as the kernel sees it (Fixed::known): the tests below fold where the configuration fixes
  // the angle source and the rotary style.
  __device__ __forceinline__ float f1(const RopeInputs& in, int c, int i) const {
    if constexpr (!kWords) {
      return f1v[c][i];
    } else {
      return in.angles.cache && !in.dims.neox ? a[slot(c)][i >> 1] : a[slot(c)][i];
    }
  }

  __device__ __forceinline__ float f2(const RopeInputs& in, int c, int i) const {
    if constexpr (!kWords) {
      return f2v[c][i];
    } else {
      if (!in.angles.cache) return b[slot(c)][i];
      const float sin = in.dims.neox ? b[slot(c)][i] : b[slot(c)][i >> 1];
      const bool leads =
          in.dims.neox ? (Geom::kNeoxPairsInLane ? c == 0 : lead[c]) : (i & 1) == 0;
      return leads ? -sin : sin;
    }
  }

  /// f2 at the partner of element i (backward).
  __device__ __forceinline__ float f2p(const RopeInputs& in, int c, int i) const {
    if constexpr (!kWords) {
      return f2pv[c][i];
    } else {
      if (!in.angles.cache) {
        if constexpr (kPartnerTables) {
          if (in.dims.neox) return pb[slot(c)][i];
        }
        return b[slot(c)][i ^ 1];
      }
      return -f2(in, c, i);
    }
  }
};

// ------------------------------------------------------------------------------------------------
// Norm weights
// ------------------------------------------------------------------------------------------------

/// Where a row's weights (and their gradient sums) start in the kinds' rows [query | key]: the
/// key rows at `key_start` and head h of a kind at h * head_stride, `floats` in all. Per head:
/// [2][D] (every head of a kind shares its D weights); under SPEC.md section 9's token-wide norm
/// (its own kernels) [Hq*D + Hkv*D], weights [H*D] of each kind.
struct WeightLanes {
  int key_start;
  int head_stride;
  int floats;

  QKVF_HOST_DEVICE static WeightLanes per_head(int D) { return {D, 0, 2 * D}; }
  QKVF_HOST_DEVICE static WeightLanes per_token(const Dims& dims, int D) {
    return {dims.q_heads * D, D, (dims.q_heads + dims.kv_heads) * D};
  }
  /// The first float of head `head` of a kind.
  __device__ __forceinline__ int row(bool is_key, int head) const {
    return (is_key ? key_start : 0) + head * head_stride;
  }
};

/// The norm weights as the rows use them: fp32 w + offset for query rows and key rows (D floats
/// each; Hq*D and Hkv*D under a token-wide norm: WeightLanes), 1 where a kind has no weight, in
/// the block's shared memory. The block fills them once (fill, then a barrier) and a row reads its
/// own values per chunk (two 16-byte shared loads at V = 8): per-lane registers for both kinds
/// took 2 x C x V registers and a select per element, and their load and conversion ran once per
/// work unit.
struct SharedWeights {
  const float* rows;  ///< [at.floats] shared memory: query rows, then key rows
  WeightLanes at;

  /// Writes the lanes.floats floats at `rows`; every thread of the block takes part (a barrier
  /// must follow before any row reads them).
  __device__ __forceinline__ static void fill(const RopeInputs& in, const WeightLanes& lanes,
                                              float* rows) {
    for (int i = int(threadIdx.x); i < lanes.floats; i += int(blockDim.x)) {
      const int kind = i >= lanes.key_start ? 1 : 0;
      const void* weight = kind ? in.weights.k : in.weights.q;
      const bool fp32 = kind ? in.weights.k_fp32 : in.weights.q_fp32;
      rows[i] = weight == nullptr ? 1.0f
                                  : effective(load_value(weight, i - kind * lanes.key_start, fp32),
                                              in.weights.offset);
    }
  }

  /// The weights of chunk slot c of row `head` of that kind (1 in a chunk outside the row).
  template <class Geom>
  __device__ __forceinline__ void chunk(bool is_key, int head, const LaneChunks<Geom>& lanes,
                                        int c, float (&w)[Geom::V]) const {
    load_row_values<Geom::V>(rows + at.row(is_key, head), lanes.d0[c], lanes.ok[c], 1.0f, w);
  }

  /// V floats of a shared-memory row from element d0 (16-byte loads at V = 8), or `fill` when
  /// !ok (a chunk past the row's end, whose address may lie past the row).
  template <int V>
  __device__ __forceinline__ static void load_row_values(const float* row, int d0, bool ok,
                                                         float fill, float (&out)[V]) {
    if constexpr (V == 8) {
      const float4 lo = ok ? *reinterpret_cast<const float4*>(row + d0)
                           : make_float4(fill, fill, fill, fill);
      const float4 hi = ok ? *reinterpret_cast<const float4*>(row + d0 + 4)
                           : make_float4(fill, fill, fill, fill);
      out[0] = lo.x; out[1] = lo.y; out[2] = lo.z; out[3] = lo.w;
      out[4] = hi.x; out[5] = hi.y; out[6] = hi.z; out[7] = hi.w;
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) out[e] = ok ? row[d0 + e] : fill;
    }
  }

 private:
  /// w + offset, or w itself for offset 0 (so that a weight of -0 keeps its sign, as the CPU).
  __device__ __forceinline__ static float effective(float w, float offset) {
    return offset == 0.0f ? w : __fadd_rn(w, offset);
  }
};

/// The lane group's weight-gradient sums in shared memory: [2][D] floats (query rows, key rows)
/// per lane group, each lane adding into its own columns only, in the group's row order (so no
/// barrier until the block adds its groups, write_partial_row, and the same bits on every run).
/// Under a token-wide norm the block has one row of WeightLanes::per_token's floats: each head's
/// columns belong to one lane group (the block's work plan, qk_norm_rope_backward.cu). The sums
/// are laid out as the weights are: add() takes the row's place from the weights' WeightLanes
/// (one value for both: a second copy here, though equal, changed the per-head kernels' SASS).
struct WeightGradSums {
  float* rows;  ///< the group's [2][D] (the block's [Hq*D + Hkv*D] under a token-wide norm)

  /// Zeroes the lane's columns (before the group's first row).
  template <class Geom>
  __device__ __forceinline__ void clear(const LaneChunks<Geom>& lanes, int D) const {
#pragma unroll
    for (int kind = 0; kind < 2; ++kind) {
#pragma unroll
      for (int c = 0; c < Geom::C; ++c) {
#pragma unroll
        for (int i = 0; i < Geom::V; ++i) {
          if (lanes.ok[c] && lanes.d0[c] + i < D) rows[kind * D + lanes.d0[c] + i] = 0.0f;
        }
      }
    }
  }

  /// sums[kind][head][d] += gw[i] * n[i] (one fma) for the V elements of chunk slot c; `at` the
  /// weights' layout (SharedWeights::at).
  template <class Geom>
  __device__ __forceinline__ void add(const WeightLanes& at, bool is_key, int head,
                                      const LaneChunks<Geom>& lanes, int c,
                                      const float (&gw)[Geom::V], const float (&n)[Geom::V]) const {
    if (!lanes.ok[c]) return;
    float* row = rows + at.row(is_key, head) + lanes.d0[c];
    float sums[Geom::V];
    SharedWeights::load_row_values<Geom::V>(row, 0, true, 0.0f, sums);
#pragma unroll
    for (int i = 0; i < Geom::V; ++i) sums[i] = fmaf(gw[i], n[i], sums[i]);
    if constexpr (Geom::V == 8) {
      *reinterpret_cast<float4*>(row) = make_float4(sums[0], sums[1], sums[2], sums[3]);
      *reinterpret_cast<float4*>(row + 4) = make_float4(sums[4], sums[5], sums[6], sums[7]);
    } else {
#pragma unroll
      for (int i = 0; i < Geom::V; ++i) row[i] = sums[i];
    }
  }
};

// ------------------------------------------------------------------------------------------------
// Row math
// ------------------------------------------------------------------------------------------------

/// rstd = 1 / sqrt(mean(x^2) + eps), each operation rounded as the CPU backend rounds it.
__device__ __forceinline__ float rstd_of_mean(float mean_square, float eps) {
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean_square, eps)));
}

/// reciprocal_sqrt_rn for every v > 0: below 2^-100 (a tiny eps with an all-zero row) v is
/// scaled by 2^128 first and the result by 2^64, both exact: sqrt and the reciprocal each
/// commute with the power-of-two scaling, so the bits are those of __fdiv_rn(1, __fsqrt_rn(v)).
__device__ __forceinline__ float reciprocal_sqrt_any(float v) {
  const bool tiny = v < 0x1p-100f;
  const float q = reciprocal_sqrt_rn(tiny ? __fmul_rn(v, 0x1p128f) : v);
  return tiny ? __fmul_rn(q, 0x1p64f) : q;
}

///   key offset, lanes >= r of a key row: gw = g_next + (t == 0 ? g : 0)
__device__ __forceinline__ float shifted_grad(float g_next, float g, bool first_token) {
  return __fadd_rn(g_next, first_token ? g : 0.0f);
}
///   dx = rstd * (dn - n * correction), correction = sum(dn * n) / D
__device__ __forceinline__ float norm_grad(float rstd, float dn, float n, float correction) {
  return __fmul_rn(rstd, __fsub_rn(dn, __fmul_rn(n, correction)));
}

/// rstd of a row held as chunks, true fp32 division and square root, or 1 without the norm.
/// kBranchFree: the same bits through divide_by_width and reciprocal_sqrt_any, with no branch
/// (the backward kernels' choice where it measured faster, perf_notes.md). `width` divides by D:
/// UniformDivisor, or PowerOfTwoWidth in the full-width kernels.
template <int G, int V, int C, bool kBranchFree = false, typename Width>
__device__ __forceinline__ float row_rstd(const Chunk<V> (&x)[C], const Width& width, float eps) {
  float partial = 0.0f;
#pragma unroll
  for (int c = 0; c < C; ++c) {
#pragma unroll
    for (int i = 0; i < V; ++i) partial = fmaf(x[c][i], x[c][i], partial);
  }
  const float sum = group_sum<G>(partial);
  if constexpr (kBranchFree) {
    // rstd_of_mean(width(sum)) without a branch (device_math.cuh): mean + eps >= eps > 0.
    return reciprocal_sqrt_any(__fadd_rn(divide_by_width(sum, width), eps));
  } else {
    return rstd_of_mean(width(sum), eps);
  }
}

/// y[d] = f1[d] * nw[d] + f2[d] * nw[p(d)] for the rotary lanes (i < rot_end), nw[d] beyond:
/// the one rotation every forward path computes, each operation rounded as the CPU rounds it.
template <class Geom, class Config, typename AngleT>
__device__ __forceinline__ float rotate_lane(const RopeInputs& in,
                                            const TokenAngles<Geom, AngleT, Config>& angles,
                                            int c, int i, float nw, float nw_partner,
                                            int rot_end) {
  const float rotated = __fadd_rn(__fmul_rn(angles.f1(in, c, i), nw),
                                  __fmul_rn(angles.f2(in, c, i), nw_partner));
  return i < rot_end ? rotated : nw;
}

/// Forward of chunk slot c of a row whose configuration fixes interleaved pairs (inside the
/// chunk), RMS and no weight: n = x * rstd, y = its rotation. One chunk at a time, so that a row's
/// outputs need not all be live at once. `n_out` (key offset) receives n as bf16.
template <class Geom, class Config, typename AngleT>
__device__ __forceinline__ void forward_chunk(const RopeInputs& in,
                                              const Chunk<Geom::V> (&x)[Geom::C], int c,
                                              float rstd,
                                              const TokenAngles<Geom, AngleT, Config>& angles,
                                              const LaneChunks<Geom>& lanes, Chunk<Geom::V>& y,
                                              Chunk<Geom::V>* n_out) {
  constexpr int V = Geom::V;
  static_assert(V >= 2 && Fixed<Config>::kChunkRotation,
                "a configuration that fixes interleaved pairs (in the chunk), RMS and no weights");
  float n[V];
#pragma unroll
  for (int i = 0; i < V; ++i) n[i] = __fmul_rn(x[c][i], rstd);
  float out[V];
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = rotate_lane(in, angles, c, i, n[i], n[i ^ 1], lanes.rot_end[c]);
  y = to_bf16<V>(out);
  if (n_out != nullptr) *n_out = to_bf16<V>(n);
}

/// Forward of a whole row of a general layout: nw = n * w for every chunk first (n = x * rstd, or
/// x without the norm; w the weights of row `head` of its kind), then per chunk the partners'
/// nw (from the chunk, or shuffled from the lane group) and the rotation; store(c, y, nw) receives
/// each chunk's outputs as bf16. Every lane of the warp must call it (shuffles).
template <class Geom, class Config, typename AngleT, typename Store>
__device__ __forceinline__ void forward_row(const RopeInputs& in,
                                            const Chunk<Geom::V> (&x)[Geom::C], float rstd,
                                            const SharedWeights& weights, bool is_key, int head,
                                            const TokenAngles<Geom, AngleT, Config>& angles,
                                            const LaneChunks<Geom>& lanes,
                                            const Partners<Geom>& partners, bool exchange,
                                            Store&& store) {
  constexpr int V = Geom::V;
  constexpr int C = Geom::C;
  float nw[C][V];
#pragma unroll
  for (int c = 0; c < C; ++c) {
    float w[V];
    weights.chunk(is_key, head, lanes, c, w);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float n = in.normalize ? __fmul_rn(x[c][i], rstd) : x[c][i];
      nw[c][i] = __fmul_rn(n, w[i]);
    }
  }
#pragma unroll
  for (int c = 0; c < C; ++c) {
    float np[V] = {};
    if (exchange) {
      partners.values_of(nw, c, np);
    } else if constexpr (V >= 2) {
#pragma unroll
      for (int i = 0; i < V; ++i) np[i] = nw[c][i ^ 1];
    }
    float out[V];
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = rotate_lane(in, angles, c, i, nw[c][i], np[i], lanes.rot_end[c]);
    store(c, to_bf16<V>(out), to_bf16<V>(nw[c]));
  }
}

/// A token-wide norm's scalars of a row's token and kind (SPEC.md section 9): rstd over the
/// token's rows of the kind and, in the backward, the correction sum(dn * n) / (H * D) over them.
/// Not `given`: the row's own (a per-head norm), which the row functions compute.
struct KindScalars {
  bool given = false;
  float rstd = 1.0f;
  float correction = 0.0f;
};

/// Whether the backward reads the saved rows qk: for rstd and n (the norm, and the weights'
/// gradients gw * n; validation gives weights only with the norm). Rotary alone (Llama's and
/// Mistral's layout) needs only the incoming gradients, dx = gw: a third of the bf16 backward's
/// reads fewer. `in` as the kernel sees it (Fixed::known): a constant where the configuration
/// fixes the norm.
__device__ __forceinline__ bool reads_saved_rows(const RopeInputs& in) {
  return in.normalize || in.weights.q != nullptr || in.weights.k != nullptr;
}

/// Backward of one row (SPEC.md sections 2 and 8):
///   gw[d] = f1[d] * g[d] + f2p[d] * g[p(d)]                    (rotary lanes)
///   gw[d] = g[d], or for a key row under key offset g_next[d] + (t == 0 ? g[d] : 0)
///   with a weight: grad_w[d] += gw[d] * n[d] (into `sums`, row `head` of the row's kind, when
///   neither it nor its rows are null, and `row_present`), dn = gw * w (w of `weights`, when not
///   null)
///   dx    = rstd * (dn - n * (sum(dn * n) / D))                (dx = dn without the norm)
/// `kind`: under a token-wide norm the rstd and the correction sum(dn * n) / (H * D) of the row's
/// token and kind (given: the row's own are not computed).
/// `row_present`: the row is one of the op's (a real head of a real token). The kernels also run
/// this on rows that are not (the slots past Hq + Hkv of a token's last unit or job, tokens past
/// the end): their g and x loads are 0 but they share the token's angles, so an inf or NaN angle
/// would make their gw * n = inf * 0 = NaN; such rows must add nothing to the weight sums.
/// kBranchFree as row_rstd. Every lane of the warp must call it (shuffles).
template <class Geom, class Config, bool kBranchFree, typename AngleT, typename Width>
__device__ __forceinline__ void backward_row(
    const RopeInputs& in, const Chunk<Geom::V> (&g)[Geom::C], const Chunk<Geom::V> (&x)[Geom::C],
    const TokenAngles<Geom, AngleT, Config>& angles, const Chunk<Geom::V> (&g_next)[Geom::C],
    const LaneChunks<Geom>& lanes, const Partners<Geom>& partners, bool exchange,
    const SharedWeights* weights, const WeightGradSums* sums, int head,
    bool is_key, bool row_present, bool shift_row, bool first_token, const Width& width,
    float (&dx)[Geom::C][Geom::V], const KindScalars& kind = KindScalars{}) {
  constexpr int G = Geom::G;
  constexpr int V = Geom::V;
  constexpr int C = Geom::C;
  const bool normalize = in.normalize;
  // One chunk per lane: keep n (V registers); wider rows recompute it from the bf16 bits.
  constexpr bool kKeepN = C == 1;
  const float rstd = kind.given ? kind.rstd
                                : (normalize ? row_rstd<G, V, C, kBranchFree>(x, width, in.eps)
                                             : 1.0f);
  float kept_n[kKeepN ? C : 1][V];
  float partial = 0.0f;
#pragma unroll
  for (int c = 0; c < C; ++c) {
    Chunk<V> gp;
    if (exchange) gp = partners.of(g, c);
    float n[V];
    float gw[V];
#pragma unroll
    for (int i = 0; i < V; ++i) {
      n[i] = normalize ? __fmul_rn(x[c][i], rstd) : x[c][i];
      if constexpr (kKeepN) kept_n[c][i] = n[i];
      const float g_partner = exchange ? gp[i] : g[c][i ^ 1];
      const float rotated = __fadd_rn(__fmul_rn(angles.f1(in, c, i), g[c][i]),
                                      __fmul_rn(angles.f2p(in, c, i), g_partner));
      const float passed = shift_row ? shifted_grad(g_next[c][i], g[c][i], first_token) : g[c][i];
      gw[i] = i < lanes.rot_end[c] ? rotated : passed;
      if (weights == nullptr) {
        dx[c][i] = gw[i];  // dn for now
        partial = fmaf(gw[i], n[i], partial);
      }
    }
    if (weights != nullptr) {
      // Absent rows add nothing to the sums (see row_present above).
      if (sums != nullptr && sums->rows != nullptr && row_present) {
        sums->add(weights->at, is_key, head, lanes, c, gw, n);
      }
      float w[V];
      weights->chunk(is_key, head, lanes, c, w);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        dx[c][i] = __fmul_rn(gw[i], w[i]);  // dn for now
        partial = fmaf(dx[c][i], n[i], partial);
      }
    }
  }
  const float sum = kind.given ? 0.0f : group_sum<G>(partial);
  if (!normalize) return;
  float correction;
  if (kind.given) {
    correction = kind.correction;
  } else if constexpr (kBranchFree) {
    correction = divide_by_width(sum, width);
  } else {
    correction = width(sum);
  }
#pragma unroll
  for (int c = 0; c < C; ++c) {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const float n = kKeepN ? kept_n[kKeepN ? c : 0][i] : __fmul_rn(x[c][i], rstd);
      dx[c][i] = norm_grad(rstd, dx[c][i], n, correction);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// The V norm (SPEC.md section 9): a weightless RMS norm of each V row, Dv wide
// ------------------------------------------------------------------------------------------------
//
// A V row takes the kernel's row geometry (its width class covers Dv: rope_key), chunks past Dv
// masked (loads 0). The same rounding as the Q/K rows and the CPU backend:
//   rstd = 1 / sqrt(sum(v^2) / Dv + eps),  v_out = v * rstd
//   dv   = rstd * (g - n * (sum(g * n) / Dv)),  n = v * rstd (v_out unrounded)

/// v_out of the lane's chunks of one V row. Every lane of the warp must call it (shuffles).
template <class Geom>
__device__ __forceinline__ void v_norm_forward(const Chunk<Geom::V> (&x)[Geom::C],
                                               const UniformDivisor& width, float eps,
                                               float (&out)[Geom::C][Geom::V]) {
  const float rstd = row_rstd<Geom::G, Geom::V, Geom::C>(x, width, eps);
#pragma unroll
  for (int c = 0; c < Geom::C; ++c) {
#pragma unroll
    for (int i = 0; i < Geom::V; ++i) out[c][i] = __fmul_rn(x[c][i], rstd);
  }
}

/// dv of the lane's chunks of one V row from g (the gradient of v_out) and the saved v. Every lane
/// of the warp must call it (shuffles).
template <class Geom>
__device__ __forceinline__ void v_norm_backward(const Chunk<Geom::V> (&g)[Geom::C],
                                                const Chunk<Geom::V> (&x)[Geom::C],
                                                const UniformDivisor& width, float eps,
                                                float (&dv)[Geom::C][Geom::V]) {
  const float rstd = row_rstd<Geom::G, Geom::V, Geom::C>(x, width, eps);
  float partial = 0.0f;
#pragma unroll
  for (int c = 0; c < Geom::C; ++c) {
#pragma unroll
    for (int i = 0; i < Geom::V; ++i) partial = fmaf(g[c][i], __fmul_rn(x[c][i], rstd), partial);
  }
  const float correction = width(group_sum<Geom::G>(partial));
#pragma unroll
  for (int c = 0; c < Geom::C; ++c) {
#pragma unroll
    for (int i = 0; i < Geom::V; ++i) {
      dv[c][i] = norm_grad(rstd, g[c][i], __fmul_rn(x[c][i], rstd), correction);
    }
  }
}

/// The block's partial row of the norm weights' gradients (weight_grad.hpp): after a barrier the
/// block adds its lane groups' sums (WeightGradSums, `group_sums` [kGroups][d_rows][D] in shared
/// memory: d_rows = 2, the query and key weights; Hq + Hkv under a token-wide norm, with one group
/// row for the block) in group order (fixed, so the bits do not depend on scheduling) into
/// partials[blockIdx.x]. partials == nullptr (a layout without weights on the weighted kernel)
/// writes nothing. Every thread of the block must call it (barrier).
template <int kGroups, int kThreads>
__device__ __forceinline__ void write_partial_row(int d_rows, int D, const float* group_sums,
                                                  float* partials) {
  __syncthreads();
  if (partials == nullptr) return;
  float* partial = partials + int64_t(blockIdx.x) * d_rows * D;
  for (int column = int(threadIdx.x); column < d_rows * D; column += kThreads) {
    float total = 0.0f;
    for (int g = 0; g < kGroups; ++g) total = __fadd_rn(total, group_sums[g * d_rows * D + column]);
    partial[column] = total;
  }
}

}  // namespace qkvfuse::cuda::rope
