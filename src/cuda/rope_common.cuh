// rope_common.cuh: the memory access and row geometry shared by the three rope kernels (forward,
// bf16 backward, fused FP8 backward). Internal.
//
// Chunks. A row (one input head of one token, D bf16 values) is read and written in chunks of V
// consecutive elements: V = 8 (16 bytes, one LDG.128 / STG.128: the fast path), 2 (4 bytes) or 1
// (2 bytes), whichever the row's alignment allows (rope_paths.hpp). The same kernels serve every
// V; only the access width and the partner exchange of NeoX lanes change with it.
//
// Row geometry. A lane group of G consecutive lanes (G = 4, 8, 16 or 32, a power of two dividing
// 32) owns a row; lane l of the group holds chunks l, l + G, ..., l + (C-1)G, so that for every
// chunk slot the G lanes touch G*V contiguous elements (coalesced). The row sums (sum x^2 and
// sum dn*n) are a per-lane partial followed by a log2(G)-step xor-shuffle butterfly inside the
// group; every lane ends with the same bits, so the result is deterministic. Widths that are not
// V*G*C exactly use the next larger geometry with the missing chunks masked (loads return 0,
// stores are skipped). Which geometry serves which head width is rope_config.cuh's lanes_for.
//
// Rounding. The CPU backend is the contract: the element formulas of SPEC.md are evaluated with
// explicitly rounded fp32 operations (__fmul_rn / __fadd_rn / __fdiv_rn / __fsqrt_rn, and
// UniformDivisor, which is __fdiv_rn bit for bit) in the CPU's order, so nvcc's FMA contraction
// cannot change them; the only difference from the CPU is the order of the fp32 row sums.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

#include "cuda/check.hpp"
#include "cuda/device_math.cuh"
#include "qkvfuse/error.hpp"
#include "qkvfuse/numeric.hpp"

namespace qkvfuse::cuda::rope {

// ------------------------------------------------------------------------------------------------
// Chunks of V bf16 elements and their global memory access
// ------------------------------------------------------------------------------------------------

/// V consecutive bf16 values as 32-bit words (V = 1: the low half of one word).
template <int V>
struct alignas(V >= 2 ? 2 * V : 4) Chunk {
  static_assert(V == 1 || V == 2 || V == 8, "chunks of 1, 2 or 8 elements (2, 4, 16 bytes)");
  static constexpr int kWords = V >= 2 ? V / 2 : 1;
  uint32_t w[kWords];

  /// Element i as fp32 (bf16 is the high half of an fp32: a shift or a mask).
  __device__ __forceinline__ float operator[](int i) const {
    return (i & 1) ? __uint_as_float(w[i >> 1] & 0xffff0000u) : __uint_as_float(w[i >> 1] << 16);
  }
};

template <int V>
__device__ __forceinline__ void to_float(const Chunk<V>& chunk, float (&out)[V]) {
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = chunk[i];
}

/// V fp32 values rounded to bf16 (nearest even, NaN kept).
template <int V>
__device__ __forceinline__ Chunk<V> to_bf16(const float (&in)[V]) {
  Chunk<V> chunk;
  if constexpr (V == 1) {
    chunk.w[0] = float2_to_bf16x2(in[0], 0.0f) & 0xffffu;
  } else {
#pragma unroll
    for (int i = 0; i < V / 2; ++i) chunk.w[i] = float2_to_bf16x2(in[2 * i], in[2 * i + 1]);
  }
  return chunk;
}

template <int V>
__device__ __forceinline__ Chunk<V> zero_chunk() {
  Chunk<V> chunk;
#pragma unroll
  for (int i = 0; i < Chunk<V>::kWords; ++i) chunk.w[i] = 0u;
  return chunk;
}

/// The L2 cache policy "evict first" for .L2::cache_hint accesses: the value that
/// createpolicy.fractional.L2::evict_first.b64 with fraction 1.0 produces (CUTLASS's
/// CacheHintSm90::EVICT_FIRST). As a constant it costs no register (the policy from createpolicy
/// made ptxas spill in the FP8 backward).
constexpr uint64_t kL2EvictFirst = 0x12F0000000000000ull;

/// How a load treats the caches. Inputs are never written during a launch (outputs overlap no
/// input), so every load may take the non-coherent path.
enum class Load {
  kStream,            ///< read once: no L1 allocation, so lines other warps reuse stay
  kCached,            ///< read by several warps close in time (angle rows, neighbouring grads)
  kStreamEvictFirst,  ///< read once, and the first line L2 evicts
};

template <Load kHow, int V>
__device__ __forceinline__ Chunk<V> load_chunk(const uint16_t* p) {
  Chunk<V> c;
  if constexpr (V == 8) {
    if constexpr (kHow == Load::kStream) {
      asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
          : "=r"(c.w[0]), "=r"(c.w[1]), "=r"(c.w[2]), "=r"(c.w[3]) : "l"(p));
    } else if constexpr (kHow == Load::kCached) {
      asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
          : "=r"(c.w[0]), "=r"(c.w[1]), "=r"(c.w[2]), "=r"(c.w[3]) : "l"(p));
    } else {
      asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
          : "=r"(c.w[0]), "=r"(c.w[1]), "=r"(c.w[2]), "=r"(c.w[3])
          : "l"(p), "l"(kL2EvictFirst));
    }
  } else if constexpr (V == 2) {
    c.w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
  } else {
    c.w[0] = uint32_t(__ldg(reinterpret_cast<const unsigned short*>(p)));
  }
  return c;
}

template <Load kHow, int V>
__device__ __forceinline__ Chunk<V> load_chunk_if(bool valid, const uint16_t* p) {
  return valid ? load_chunk<kHow, V>(p) : zero_chunk<V>();
}

template <int V>
__device__ __forceinline__ void store_chunk(uint16_t* p, const Chunk<V>& c) {
  if constexpr (V == 8) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(c.w[0]), "r"(c.w[1]),
                 "r"(c.w[2]), "r"(c.w[3])
                 : "memory");
  } else if constexpr (V == 2) {
    asm volatile("st.global.u32 [%0], %1;" ::"l"(p), "r"(c.w[0]) : "memory");
  } else {
    asm volatile("st.global.u16 [%0], %1;" ::"l"(p), "h"(uint16_t(c.w[0])) : "memory");
  }
}

/// Stores the elements [lo, hi) of a chunk (lo and hi even when V > 1: the rotary width is
/// even, so a pair is never split). A whole chunk goes as one store.
template <int V>
__device__ __forceinline__ void store_chunk_range(uint16_t* p, const Chunk<V>& c, int lo, int hi) {
  if (lo <= 0 && hi >= V) {
    store_chunk(p, c);
    return;
  }
  if constexpr (V == 8) {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      if (2 * w >= lo && 2 * w + 2 <= hi) {
        asm volatile("st.global.u32 [%0], %1;" ::"l"(p + 2 * w), "r"(c.w[w]) : "memory");
      }
    }
  }
}

/// Asks L2 for the line that holds p (prefetch.global.L2): no register is held and there is no
/// completion to wait for. p must lie inside an allocation (the kernels guard the token index).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

/// prefetch_l2 at L2 evict-last priority: the line should outlive the evict-first traffic around
/// it until its load comes.
__device__ __forceinline__ void prefetch_l2_evict_last(const void* p) {
  asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p));
}

__device__ __forceinline__ void st_u64_evict_first(void* p, uint32_t lo, uint32_t hi) {
  asm volatile("st.global.L2::cache_hint.v2.u32 [%0], {%1, %2}, %3;" ::"l"(p), "r"(lo), "r"(hi),
               "l"(kL2EvictFirst)
               : "memory");
}

__device__ __forceinline__ void st_vec16_evict_first(void* p, const Vec16& v) {
  asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p),
               "r"(v.w[0]), "r"(v.w[1]), "r"(v.w[2]), "r"(v.w[3]), "l"(kL2EvictFirst)
               : "memory");
}

__device__ __forceinline__ void st_u8(void* p, uint32_t v) {
  asm volatile("st.global.u8 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void st_u16(void* p, uint32_t v) {
  asm volatile("st.global.u16 [%0], %1;" ::"l"(p), "h"(uint16_t(v)) : "memory");
}

// ------------------------------------------------------------------------------------------------
// Float tables (factor tables, cos/sin cache, norm weights): N consecutive values of bf16 or fp32
// ------------------------------------------------------------------------------------------------

/// N consecutive values of T (bf16 as uint16_t, or float) from one vector load, cached in L1:
/// every row of a token reads the same angles, every row of a kind the same weight.
template <typename T, int N>
struct Values {
  static_assert(std::is_same_v<T, uint16_t> || std::is_same_v<T, float>, "bf16 or fp32 tables");
  static constexpr int kBytes = N * int(sizeof(T));
  static constexpr int kWords = kBytes >= 4 ? kBytes / 4 : 1;
  uint32_t w[kWords];

  __device__ __forceinline__ void load(const T* p, bool valid) {
    if (!valid) {
#pragma unroll
      for (int i = 0; i < kWords; ++i) w[i] = 0u;
      return;
    }
    if constexpr (kBytes == 2) {
      w[0] = uint32_t(__ldg(reinterpret_cast<const unsigned short*>(p)));
    } else if constexpr (kBytes == 4) {
      w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
    } else if constexpr (kBytes == 8) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
      w[0] = v.x;
      w[1] = v.y;
    } else {
#pragma unroll
      for (int i = 0; i < kWords; i += 4) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + i / 4);
        w[i] = v.x;
        w[i + 1] = v.y;
        w[i + 2] = v.z;
        w[i + 3] = v.w;
      }
    }
  }

  /// The first N/2 values only (the rest read as 0): the 4 frequencies of an interleaved chunk.
  __device__ __forceinline__ void load_half(const T* p, bool valid) {
    static_assert(N == 8, "half of a chunk's 8 values");
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = 0u;
    if (!valid) return;
    if constexpr (std::is_same_v<T, float>) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
      w[0] = v.x;
      w[1] = v.y;
      w[2] = v.z;
      w[3] = v.w;
    } else {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
      w[0] = v.x;
      w[1] = v.y;
    }
  }

  /// Every value NaN (a rotary position outside the cache).
  __device__ __forceinline__ void fill_nan() {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = std::is_same_v<T, float> ? 0x7fc00000u : 0x7fc07fc0u;
  }

  __device__ __forceinline__ float operator[](int i) const {
    if constexpr (std::is_same_v<T, float>) {
      return __uint_as_float(w[i]);
    } else {
      return (i & 1) ? __uint_as_float(w[i >> 1] & 0xffff0000u)
                     : __uint_as_float(w[i >> 1] << 16);
    }
  }
};

/// One value of a bf16 (`fp32` false) or fp32 table at p + i, as fp32.
__device__ __forceinline__ float load_value(const void* p, int64_t i, bool fp32) {
  if (fp32) return __ldg(static_cast<const float*>(p) + i);
  return __uint_as_float(uint32_t(__ldg(static_cast<const unsigned short*>(p) + i)) << 16);
}

template <typename T>
__device__ __forceinline__ float load_value(const T* p, int64_t i) {
  return load_value(p, i, std::is_same_v<T, float>);
}

// ------------------------------------------------------------------------------------------------
// Row geometry
// ------------------------------------------------------------------------------------------------

/// G lanes per row, C chunks of V elements per lane: rows up to V*G*C elements. Chunk slot c of
/// lane l holds elements V*(c*G + l) onwards. kNeoxPairsInLane: the geometry of the exact-width
/// NeoX kernels (NeoX over whole rows of exactly V*G*2 elements, NeoxPairGeometry), where
/// slot 1 of each lane holds the NeoX partners (d + D/2) of its slot 0, so that no lane needs
/// another's values.
template <int V_, int G_, int C_, bool kNeoxPairsInLane_ = false>
struct RowGeometry {
  static constexpr int V = V_;
  static constexpr int G = G_;
  static constexpr int C = C_;
  static constexpr int kMaxWidth = V * G * C;
  static constexpr bool kNeoxPairsInLane = kNeoxPairsInLane_;
  static_assert(!kNeoxPairsInLane || (C == 2 && V == 8), "NeoX pairs in lane: two 16-byte chunks");
  static_assert(G == 4 || G == 8 || G == 16 || G == 32,
                "a lane group is 4, 8, 16 or 32 lanes: a power of two, so that the xor-shuffle "
                "reduction stays inside the group and groups tile a warp");
  static_assert(C >= 1 && C <= 16 && V * C <= 32, "up to 32 elements per lane (registers)");
};

/// Whether the kernels have a full-width form for Geom: 16-byte rows of exactly 8GC elements (32,
/// 64, 128, 256, 512: every model width but 96), a power of two. In that form D is a compile-time
/// constant: no chunk is masked, the offsets that depend on D fold, and each division of a row sum
/// by D is one FMUL (PowerOfTwoWidth) instead of UniformDivisor's 5-12 instructions.
template <class Geom>
constexpr bool has_full_width() {
  return Geom::V == 8 && (Geom::kMaxWidth & (Geom::kMaxWidth - 1)) == 0;
}

/// The geometry of the NeoX-pairs kernels (a configuration with neox_pairs_in_lane: NeoX over the
/// whole row, exact widths) for rows of Geom's full width: the same width on half the lanes with two chunks each, the NeoX
/// partners in one lane (RowGeometry's kNeoxPairsInLane): 8 lanes x 2 at D = 128, 4 x 2 at
/// D = 64, 16 x 2 (Geom's own) at D = 256. D = 32 keeps Geom (2 lanes would not tile a warp's
/// reductions), and so do the other geometries.
template <class Geom>
struct NeoxPairGeometry {
  using type = Geom;
};
template <>
struct NeoxPairGeometry<RowGeometry<8, 16, 1>> {
  using type = RowGeometry<8, 8, 2, true>;
};
template <>
struct NeoxPairGeometry<RowGeometry<8, 8, 1>> {
  using type = RowGeometry<8, 4, 2, true>;
};
template <>
struct NeoxPairGeometry<RowGeometry<8, 16, 2>> {
  using type = RowGeometry<8, 16, 2, true>;
};

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

// ------------------------------------------------------------------------------------------------
// Work decomposition of the row kernels (forward and bf16 backward), host side
// ------------------------------------------------------------------------------------------------

/// The Hq + Hkv input heads of a token are split into `row_sets` sets {s, s + NS, s + 2NS, ...},
/// NS even, so a set holds heads of one parity: under paired placement they all read the same
/// half of the factor row. A work unit is one set of one token; unit u = t * NS + s is owned by
/// one lane group, which issues every load of the unit (its K rows and the token's angles)
/// before any math, computes, stores and is done. The grid is one lane group per unit (no
/// persistence, no token walk): at the model's sizes that is ~10^5 warps, the block scheduler
/// keeps every SM full, nothing waits on a serial chain of loads, and the tail is one short
/// block. Units are token-major, so the NS groups that share a token's angle row are adjacent.
/// The backward with norm weights walks several units per group instead (its per-block partial
/// sums must stay few: qk_norm_rope_backward.cu).
struct RowWork {
  int row_sets = 2;   ///< NS
  int64_t units = 1;  ///< T * NS
};

inline RowWork plan_row_work(int64_t tokens, int64_t heads2, int rows_per_group) {
  int64_t sets = (heads2 + rows_per_group - 1) / rows_per_group;  // NS * K >= heads2
  sets = sets < 2 ? 2 : sets + (sets & 1);
  return {int(sets), tokens * sets};
}

/// SPEC.md section 9's token-wide norm: a block takes kTokensPerTokenBlock tokens one after the
/// other (its norm weights [Hq*D + Hkv*D] are filled once for them; in the backward one partial
/// row of their gradients each), and its lane groups take each token's units in turns. NS is
/// rounded up to a multiple of the block's `groups` lane groups, so set s of every token is lane
/// group (s mod groups)'s: each weight-gradient column is one lane's, whatever the token (the
/// sets past ceil((Hq + Hkv) / K) have no rows).
inline constexpr int kTokensPerTokenBlock = 16;

inline RowWork plan_token_work(int64_t tokens, int64_t heads2, int rows_per_group, int groups) {
  int64_t sets = (heads2 + rows_per_group - 1) / rows_per_group;
  sets = (sets + groups - 1) / groups * groups;
  return {int(sets), tokens * sets};
}

inline unsigned grid_size(const char* op, int64_t blocks, int64_t tokens) {
  QKVF_CHECK(blocks <= int64_t(0x7fffffff), op, " (CUDA): ", tokens,
             " tokens need more blocks than one launch holds");
  return unsigned(blocks);
}

}  // namespace qkvfuse::cuda::rope
