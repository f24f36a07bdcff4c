// rope_config.cuh: from a call's key to the template arguments of its kernel, and each
// configuration's launch policy, for the three rope ops. Internal, host side (the policies are
// also read by the kernels, as constants).
//
// dispatch<kOp>(key, f) is the one dispatcher of the family: the configuration that serves the key
// (rope_dispatch.hpp visit_config: the first matching row of the table, the restored rows' with
// QKVFUSE_ROPE_RESTORED_ROWS=1, else General or Section9), then the compile-time parameters that
// shape a kernel's registers, each switched once from the key:
//   access width  V = 8, 2 or 1 (16-byte, 4-byte, 2-byte chunks)
//   head width    the lane geometry of its width class (lanes_for), with the configuration's
//                 NeoX-pairs form where it asks for it, and D as a constant at the power-of-two
//                 widths of the ops its exact_width lists
//   angle dtype   bf16 or fp32 for 16-byte kernels (their angle registers), a run-time value in
//                 the narrow ones and in a configuration that asks for it (RunTimeAngles)
// and calls f(Config{}, Geom{}, TypeTag<AngleT>{}, std::bool_constant<kExactWidth>{}). Only the
// values a configuration lists are instantiated: the table decides which kernels exist.
// Everything else (rotary style and span, norm, weights, angle source, placement) is a run-time
// value of the kernel unless its configuration fixes it (rope_rows.cuh Fixed).
//
// Policy<kOp, Config, Geom, AngleT> is the launch policy of a kernel, written once for all ops:
// threads per block, resident blocks per SM (__launch_bounds__: the register budget, chosen so
// that ptxas spills nothing or little; perf_notes.md records the measured choices) and work rows
// per lane group.
#pragma once

#include <cuda_bf16.h>

#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "cuda/rope_common.cuh"
#include "cuda/rope_dispatch.hpp"
#include "cuda/rope_rows.cuh"
#include "cuda/static_switch.hpp"
#include "qkvfuse/error.hpp"

namespace qkvfuse::cuda::rope {

// ------------------------------------------------------------------------------------------------
// Geometry of a width class
// ------------------------------------------------------------------------------------------------

/// Lanes per row and chunks per lane for (op, chunk width V, width class); {0, 0} where the
/// access width does not take that class (16-byte chunks need D >= 32).
struct Lanes {
  int G;
  int C;
};

/// V = 8: exact geometries for 32 (4 lanes x 1 chunk), 64 (8 x 1), 128 (16 x 1), 256 (16 x 2)
/// and 512 (32 x 2: the whole warp on one row, 16 elements per lane as at 256); the widths
/// between run on the next larger one, masked. D = 96: 4 lanes x 3 chunks in the row kernels
/// (every lane busy), 16 x 1 with 12 lanes active in the FP8 backward (its Q/K rows of a token
/// load together within 64 registers; 4 x 3 measured slower there, perf_notes.md).
/// V = 2: 16 or 32 lanes, up to 16 elements per lane; V = 1: 32 lanes of 8 elements, 16 past 256
/// (rows that start on an odd element: rare, one geometry per range).
/// `fewest` (Spec::fewest_geometries): D = 96 on 16 x 1 in every op; the row kernels' narrow rows
/// on one geometry per access width, the widest (V = 2: 32 x 8, V = 1: 32 x 16); the FP8
/// backward's V = 2 rows on 32 x 4 up to 256 and 32 x 8 past it (its tile follows the geometry's
/// width, the host's plan the call's: the split stays at 256).
constexpr Lanes lanes_for(Op op, int V, HeadWidth width, bool fewest = false) {
  const bool past_256 = width == HeadWidth::kUpTo512 || width == HeadWidth::k512;
  if (fewest && V == 8 && width == HeadWidth::k96) return {16, 1};
  if (fewest && V == 2) {
    return op == Op::kBackwardFp8 && !past_256 ? Lanes{32, 4} : Lanes{32, 8};
  }
  if (fewest && V == 1 && op != Op::kBackwardFp8) return {32, 16};
  if (V == 8) {
    switch (width) {
      case HeadWidth::kUpTo32: return {0, 0};
      case HeadWidth::k32: return {4, 1};
      case HeadWidth::kUpTo64: case HeadWidth::k64: return {8, 1};
      case HeadWidth::k96: return op == Op::kBackwardFp8 ? Lanes{16, 1} : Lanes{4, 3};
      case HeadWidth::kUpTo128: case HeadWidth::k128: return {16, 1};
      case HeadWidth::kUpTo256: case HeadWidth::k256: return {16, 2};
      case HeadWidth::kUpTo512: case HeadWidth::k512: return {32, 2};
    }
    return {0, 0};
  }
  if (V == 2) {
    switch (width) {
      case HeadWidth::kUpTo32: case HeadWidth::k32: return {16, 1};
      case HeadWidth::kUpTo64: case HeadWidth::k64: return {32, 1};
      case HeadWidth::k96: case HeadWidth::kUpTo128: case HeadWidth::k128: return {32, 2};
      case HeadWidth::kUpTo256: case HeadWidth::k256: return {32, 4};
      case HeadWidth::kUpTo512: case HeadWidth::k512: return {32, 8};
    }
    return {0, 0};
  }
  return past_256 ? Lanes{32, 16} : Lanes{32, 8};
}

/// The row geometry of (op, V, width class) for Config: its NeoX-pairs form where the
/// configuration asks for it (rope_common.cuh NeoxPairGeometry).
template <Op kOp, int V, HeadWidth kWidth, class Config>
struct GeometryOf {
  static constexpr Lanes kLanes =
      lanes_for(kOp, V, kWidth, Config::kSpec.fewest_geometries.value);
  static constexpr bool kValid = kLanes.G > 0;
  using Base = RowGeometry<V, kValid ? kLanes.G : 32, kValid ? kLanes.C : 1>;
  using type = std::conditional_t<Config::kSpec.neox_pairs_in_lane.value,
                                  typename NeoxPairGeometry<Base>::type, Base>;
};

// ------------------------------------------------------------------------------------------------
// The dispatcher
// ------------------------------------------------------------------------------------------------

template <HeadWidth kWidth>
using WidthTag = std::integral_constant<HeadWidth, kWidth>;

/// f(WidthTag<w>{}) for the key's width class w, among the classes Config lists.
template <class Config, typename F>
void width_switch(const char* op, const RopeKey& key, F&& f) {
  const auto take = [&](auto tag) {
    if constexpr (Config::kSpec.width.contains(decltype(tag)::value)) {
      f(tag);
    } else {
      QKVF_FAIL(op, " (CUDA): ", Config::kSpec.name, " has no kernel for head width ",
                key.head_dim);
    }
  };
  switch (key.width) {
    case HeadWidth::kUpTo32: return take(WidthTag<HeadWidth::kUpTo32>{});
    case HeadWidth::k32: return take(WidthTag<HeadWidth::k32>{});
    case HeadWidth::kUpTo64: return take(WidthTag<HeadWidth::kUpTo64>{});
    case HeadWidth::k64: return take(WidthTag<HeadWidth::k64>{});
    case HeadWidth::k96: return take(WidthTag<HeadWidth::k96>{});
    case HeadWidth::kUpTo128: return take(WidthTag<HeadWidth::kUpTo128>{});
    case HeadWidth::k128: return take(WidthTag<HeadWidth::k128>{});
    case HeadWidth::kUpTo256: return take(WidthTag<HeadWidth::kUpTo256>{});
    case HeadWidth::k256: return take(WidthTag<HeadWidth::k256>{});
    case HeadWidth::kUpTo512: return take(WidthTag<HeadWidth::kUpTo512>{});
    case HeadWidth::k512: return take(WidthTag<HeadWidth::k512>{});
  }
  QKVF_FAIL(op, " (CUDA): no kernel for head width D = ", key.head_dim);
}

/// f(std::integral_constant<int, V>{}) for the key's access width, among those Config lists.
template <class Config, typename F>
void access_switch(const char* op, const RopeKey& key, F&& f) {
  constexpr Served<Access> kListed = Config::kSpec.access;  // not captured: no lambda here
  switch (key.access) {
    case Access::k16B:
      if constexpr (kListed.contains(Access::k16B)) return f(std::integral_constant<int, 8>{});
      break;
    case Access::k4B:
      if constexpr (kListed.contains(Access::k4B)) return f(std::integral_constant<int, 2>{});
      break;
    case Access::k2B:
      if constexpr (kListed.contains(Access::k2B)) return f(std::integral_constant<int, 1>{});
      break;
  }
  QKVF_FAIL(op, " (CUDA): ", Config::kSpec.name, " has no kernel for this access width");
}

/// f(TypeTag<AngleT>{}): bf16 or float for 16-byte kernels, among the dtypes Config lists;
/// RunTimeAngles for the narrow ones and where Config reads the dtype at run time.
template <class Config, int V, typename F>
void angle_type_switch(const char* op, const RopeKey& key, F&& f) {
  constexpr Served<AngleType> kListed = Config::kSpec.angle_type;
  if constexpr (V != 8 || Config::kSpec.angle_dtype_at_run_time.value) {
    f(TypeTag<RunTimeAngles>{});
  } else {
    switch (key.angle_type) {
      case AngleType::kBf16:
        if constexpr (kListed.contains(AngleType::kBf16)) return f(TypeTag<__nv_bfloat16>{});
        break;
      case AngleType::kFp32:
        if constexpr (kListed.contains(AngleType::kFp32)) return f(TypeTag<float>{});
        break;
    }
    QKVF_FAIL(op, " (CUDA): ", Config::kSpec.name, " has no kernel for this angle dtype");
  }
}

/// Lets `kernel` take `smem` bytes of dynamic shared memory (the current device): above the 48 KB
/// every kernel may use, an opt-in (SPEC.md section 9's token-wide norm: its weights, and in the
/// backward their gradient sums, are [Hq*D + Hkv*D] floats each); past the 227 KB a block may
/// have, an error naming the layout's size.
template <typename Kernel>
void allow_shared_memory(const char* op, Kernel kernel, size_t smem) {
  constexpr size_t kDefault = 48 * 1024;
  constexpr size_t kMax = 227 * 1024;
  if (smem <= kDefault) return;
  QKVF_CHECK(smem <= kMax, op, " (CUDA): layout.norm_scope = NormScope::kToken needs ", smem,
             " bytes of shared memory per block for its norm weights ([Hq*D + Hkv*D] floats, "
             "and their gradients' sums in the backward), above the ", kMax,
             " a block may have: fewer heads or a narrower D");
  QKVF_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(smem)));
}

/// QKVFUSE_ROPE_GENERAL_ONLY=1 (read once per process): every call runs a general kernel
/// (rope_dispatch.hpp Generals), the specializations unused. The A/B of each specialization
/// against the general kernel in one build and run (scripts/device_run.sh ab); the rows compute
/// the same bits either way.
inline bool general_only() {
  static const bool value = [] {
    const char* v = std::getenv("QKVFUSE_ROPE_GENERAL_ONLY");
    return v != nullptr && std::string_view(v) == "1";
  }();
  return value;
}

/// QKVFUSE_ROPE_RESTORED_ROWS=1 (read once per process): the dispatcher also tries the restored
/// rows (rope_dispatch.hpp RestoredRows), after the specializations; off (the default) it never
/// does. Their A/B against the default in one build and run (scripts/device_run.sh ab, side
/// "restored-rows"); QKVFUSE_ROPE_GENERAL_ONLY=1 overrides it (Generals alone).
inline bool restored_rows() {
  static const bool value = [] {
    const char* v = std::getenv("QKVFUSE_ROPE_RESTORED_ROWS");
    return v != nullptr && std::string_view(v) == "1";
  }();
  return value;
}

/// The kernel for (kOp, key): f(Config{}, Geom{}, TypeTag<AngleT>{}, std::bool_constant<kExact>{})
/// (see the file comment). `op` names the op in errors.
template <Op kOp, typename F>
void dispatch(const char* op, const RopeKey& key, F&& f) {
  const auto run = [&](auto config) {
    using Config = decltype(config);
    access_switch<Config>(op, key, [&](auto chunk) {
      constexpr int V = decltype(chunk)::value;
      width_switch<Config>(op, key, [&](auto width) {
        constexpr HeadWidth kWidth = decltype(width)::value;
        using Of = GeometryOf<kOp, V, kWidth, Config>;
        if constexpr (!Of::kValid) {
          QKVF_FAIL(op, " (CUDA): head width D = ", key.head_dim, " has no ", 2 * V,
                    "-byte kernel");
        } else {
          using Geom = typename Of::type;
          constexpr bool kExact =
              Config::kSpec.exact_width.contains(kOp) && exact_power_of_two(kWidth) && V == 8;
          static_assert(!kExact || has_full_width<Geom>(),
                        "exact widths: the geometry's full width, a power of two");
          static_assert(!Config::kSpec.neox_pairs_in_lane.value ||
                            (kExact && Geom::kNeoxPairsInLane),
                        "NeoX pairs in lane: exact widths of 64, 128 or 256");
          angle_type_switch<Config, V>(op, key, [&](auto angle) {
            f(config, Geom{}, angle, std::bool_constant<kExact>{});
          });
        }
      });
    });
  };
  if (!visit_config<kOp>(key, run, general_only(), restored_rows())) {
    QKVF_FAIL(op, " (CUDA): no kernel configuration serves this layout");
  }
}

// ------------------------------------------------------------------------------------------------
// Launch policy
// ------------------------------------------------------------------------------------------------

/// Threads per block of the row kernels (forward, bf16 backward): 4 warps, fine-grained
/// occupancy; and of the FP8 backward's token tiles.
inline constexpr int kRowThreads = 128;
inline constexpr int kFp8Threads = 256;

/// Tokens per CTA tile of the FP8 backward, by the widest row its geometry holds: 128 (one full
/// 128-byte line of grad_t per feature and CTA), 64 past 256 (a 128-token tile of 2*512 + 512
/// e4m3 bytes per token with the weights' gradient sums behind it would exceed the 227 KB of
/// shared memory a CTA may have; 64 tokens take 132 KB at D = Dv = 512). The host sizes its grid
/// and workspace with the row width of the call (D, or Dv of the V norm when wider), the kernel
/// with its geometry's: the same class (rope_key's width class).
constexpr int fp8_tile_tokens(int64_t row_width) { return row_width > 256 ? 64 : 128; }

/// The launch policy of kernel (kOp, Config, Geom, AngleT): threads, resident blocks per SM (the
/// register budget of __launch_bounds__) and rows per lane group (row kernels). One place for the
/// three ops, so that configurations that share a geometry share their reasons.
template <Op kOp, class Config, class Geom, typename AngleT>
struct Policy {
  static constexpr int V = Geom::V;
  static constexpr int G = Geom::G;
  static constexpr int C = Geom::C;
  /// fp32 angle chunks take twice the registers of bf16 ones; 16-byte kernels that read the dtype
  /// at run time hold fp32 values (kAngleValues: Section9's).
  static constexpr bool kAngleValues = V == 8 && std::is_same_v<AngleT, RunTimeAngles>;
  static constexpr bool kWideAngles = std::is_same_v<AngleT, float> || kAngleValues;
  static constexpr bool kKeyOffset = Fixed<Config>::kKeyOffset;
  /// The kernels that may hold norm weights (their shared-memory copy and, in the backward, their
  /// gradient sums) and the partners' exchange: General and the weighted configurations.
  static constexpr bool kWeightCode = !Fixed<Config>::kWeightless;

  static constexpr int kThreads = kOp == Op::kBackwardFp8 ? kFp8Threads : kRowThreads;
  /// FP8 backward: tokens per CTA tile.
  static constexpr int kTileTokens = fp8_tile_tokens(Geom::kMaxWidth);

  /// Rows per lane group (row kernels). Forward: 3 rows of one 16-byte chunk in flight per
  /// thread (plus the angle chunks), wider rows 4 / C (one at C = 3); bf16 backward: each row
  /// needs g and x, so 2 rows of one chunk, one of wider rows. NeoX pairs in lane on 8 lanes
  /// (D = 128): 4 rows forward, 2 backward, every row load before the first row sum (the per-row
  /// scalars, the position and the cos/sin row amortized over more rows). Narrow chunks: 8
  /// elements of rows per thread (the forward at D = 100: 27.9 % of copy with 2 rows, 22.3 %
  /// with 8).
  static constexpr int rows_per_group() {
    if constexpr (V == 8) {
      if constexpr (Geom::kNeoxPairsInLane && G == 8) return kOp == Op::kForward ? 4 : 2;
      if constexpr (kOp == Op::kForward) return C == 1 ? 3 : (4 / C > 0 ? 4 / C : 1);
      return C == 1 ? 2 : 1;
    }
    return V * C >= 8 ? 1 : 8 / (V * C);
  }

  /// Resident blocks per SM.
  static constexpr int min_blocks() {
    if constexpr (kOp == Op::kForward) {
      // NeoX pairs in lane (weights in shared memory): 5 blocks (<= 96 registers: 4 rows of 16
      // elements per lane on 8 lanes, one row at D = 256 on 16).
      if constexpr (Geom::kNeoxPairsInLane) return 5;
      // With weights and partners: 8 for one bf16 chunk per lane on 16 lanes (D in (64, 128],
      // fits 64 registers), else 6, and 4 for more than 8 elements per lane.
      if constexpr (kWeightCode || V != 8) {
        return V == 8 && C == 1 && G == 16 && !kWideAngles ? 8 : (V * C > 8 ? 4 : 6);
      }
      // Interleaved pairs without weights: 8 (<= 64 registers, 32 warps) with bf16 tables.
      return kWideAngles ? (C == 3 ? 5 : 6) : 8;
    } else if constexpr (kOp == Op::kBackward) {
      // NeoX pairs in lane (weights and their sums in shared memory): 5 blocks (<= 96
      // registers: 2 rows on 8 lanes, one at D = 256 on 16), one fewer with fp32 angles.
      if constexpr (Geom::kNeoxPairsInLane) return 5 - (kWideAngles ? 1 : 0);
      // With weights, partners and key offset at run time (General): 5 at one 16-byte chunk per
      // lane (92-96 registers, no spill; add6545's weighted general kernel ran 5 with 94), 4 for
      // wider rows, 3 at C = 3 and more; 2 for 4-byte chunks past D = 256 (8 of them per lane
      // spilled 20 bytes at 3).
      if constexpr (V == 2 && C == 8) return 2;
      // 16-byte rows with the angles as fp32 values (Section9's kernels): 4 (5 spilled 32 bytes
      // at one chunk per lane).
      if constexpr (kAngleValues) return C >= 3 ? 3 : 4;
      if constexpr (kWeightCode || V != 8) return C >= 3 ? 3 : (V == 8 && C == 1 ? 5 : 4);
      // Without weights but with NeoX pairs possible (partners shuffled, a cos/sin cache; the
      // restored general/no-weight row): 7 (<= 72 registers), add6545's weightless general
      // kernel's budget.
      if constexpr (Fixed<Config>::kMayNeox) return 7;
      // Interleaved pairs without weights: 8 (<= 64 registers) for one chunk per lane, key
      // offset included; C = 3 (D = 96 on 4 lanes) holds g, x (and g_next) and 6 factor chunks
      // of its one row at once: 6 (80 registers), 5 (92) under key offset.
      if constexpr (C == 1) return kKeyOffset && kWideAngles ? 5 : (kWideAngles ? 6 : 8);
      if constexpr (C == 3) return kWideAngles ? 4 : (kKeyOffset ? 5 : 6);
      return kWideAngles || kKeyOffset ? 4 : 5;
    } else {
      // 256-thread CTAs: 4 (<= 64 registers; 4 x 48 KB of tile fit the shared memory) with one
      // chunk per lane and bf16 factors, 3 with fp32 ones, 2 for wider rows. Weighted cache
      // kernels on 16 lanes fit 3; the general kernel 2, and 1 for more than 8 elements per lane.
      if constexpr (Fixed<Config>::kSpec.weights.only(Weights::kWeighted) && V == 8 && C == 1 &&
                    !kWideAngles) {
        return 3;
      }
      if constexpr (kWeightCode && V * C > 8) return 1;
      if constexpr (kWeightCode || V * C > 8) return 2;
      if constexpr (V != 8) return 3;
      if constexpr (C == 1) return kWideAngles ? 3 : 4;
      return 2;
    }
  }

  /// Resident blocks per SM of a token-wide norm's kernel (SPEC.md section 9, the row kernels:
  /// qk_norm_rope.cu, qk_norm_rope_backward.cu): rows one at a time in a loop over the token's
  /// rows, the angles as fp32 values (one kernel for both dtypes): the per-head budget less a
  /// block. Not measured.
  static constexpr int token_min_blocks() {
    return min_blocks() > 2 ? min_blocks() - 1 : min_blocks();
  }

  static_assert(kThreads % 32 == 0 && 32 % G == 0, "lane groups must tile whole warps");
  static_assert(kOp != Op::kBackwardFp8 || (kTileTokens % 16 == 0 && kTileTokens <= 128 &&
                                            kTileTokens % (kThreads / G) == 0),
                "FP8 tiles: whole 16-token blocks, at most 8 of them (the tile's swizzle), and "
                "the same token count for every lane group");
  static_assert(rows_per_group() >= 1 && rows_per_group() * V * C <= 64,
                "rows per lane group: keep the loads in registers (64 elements: 32 registers)");
};

}  // namespace qkvfuse::cuda::rope
