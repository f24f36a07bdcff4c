// rope_dispatch.hpp: which kernel configuration serves a rope call on CUDA. Internal, host side,
// no CUDA headers (tests/test_rope_dispatch.cpp runs it on any machine).
//
// The three rope ops (forward, bf16 backward, fused FP8 backward) share one kernel family:
// - A call's layout is reduced ONCE, from its validated arguments, to a small key of properties
//   (RopeKey: access width, head-width class, rotary style and span, norm, weights, angle source
//   and dtype, placement).
// - Two general configurations serve what no specialization serves (Generals): General every key
//   of SPEC.md sections 1-8, Section9 the keys with a value of section 9 (D past 256, the V norm,
//   a token-wide norm, query-only heads, no angle source; QKVFUSE_CUDA_SECTION9=1, validate.hpp).
//   General lists only sections 1-8's values of those properties, so its kernels hold none of
//   section 9's code: they are the kernels that ran on a GPU before section 9 (SASS-identical,
//   docs/perf_notes.md), and a section 9 value never reaches them. Section9 lists every value
//   (present and future) of every property: it serves what General does not, on fewer
//   geometries (Spec::fewest_geometries).
// - A specialization is a row of the table below (Specializations): the properties it fixes, each
//   as the list of values it serves, the ops it serves, and four kernel knobs. The first row that
//   serves (op, key) wins; no row: the first of Generals that serves it.
// - Restored rows (RestoredRows) are rows awaiting their A/B: their kernels are built, but the
//   dispatcher tries them (after Specializations, before Generals) only with
//   QKVFUSE_ROPE_RESTORED_ROWS=1; off, its choice is the table's without them.
// - Matching is conservative by construction: a row lists values (Served<E> has no "any" and no
//   default, so a row that omits a property does not compile), and a value added to a property
//   later is in no existing row's list, so it runs a general kernel until a row names it:
//   General's where General reads the property at run time, else Section9's (General fixes
//   the properties section 9 extends). A property added to RopeKey must be added to Spec, and
//   then every row must state it.
// - The kernels read the row too (rope_rows.cuh, Fixed<Config>): a property a row fixes to one
//   value is a compile-time constant in that row's kernels, every other one a run-time value read
//   through the code all kernels share. So a kernel can never treat as constant what its row does
//   not fix.
// A specialization stays only while a same-run A/B shows it >= 3 % faster than the general kernel
// at a named shape (docs/perf_notes.md, "The kernel family"); each row says which.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/rope_paths.hpp"
#include "qkvfuse/qk_norm_rope.hpp"
#include "qkvfuse/qkv_backward_fp8.hpp"
#include "rope_math.hpp"

namespace qkvfuse::cuda::rope {

// ------------------------------------------------------------------------------------------------
// Properties
// ------------------------------------------------------------------------------------------------

enum class Op : uint8_t { kForward, kBackward, kBackwardFp8 };

/// How the bf16 rows are read and written (rope_paths.hpp chunk_width): 16-byte vectors (8
/// elements), 4-byte pairs, single elements.
enum class Access : uint8_t { k16B, k4B, k2B };

/// The head width D as the kernels' row geometries see it (rope_config.cuh lanes_for): the
/// exact widths each with its own geometry, and the ranges masked on the next geometry up.
/// A new width class is a new value here, in head_width_class, and a case of lanes_for and
/// width_switch (rope_config.cuh; a value either misses throws, naming D).
enum class HeadWidth : uint8_t {
  kUpTo32,   ///< D < 32 (narrow access only)
  k32,
  kUpTo64,   ///< 32 < D < 64
  k64,
  k96,
  kUpTo128,  ///< 64 < D < 128, D != 96
  k128,
  kUpTo256,  ///< 128 < D < 256
  k256,
  kUpTo512,  ///< 256 < D < 512 (SPEC.md section 9)
  k512,      ///< Gemma 4's global layers
};

enum class Rotary : uint8_t { kInterleaved, kNeox };
/// r == D, or r < D (r = 0: no lane rotates).
enum class RotarySpan : uint8_t { kWhole, kPartial };
enum class Norm : uint8_t { kNone, kRms };
/// Norm weights: none, or q_weight and/or k_weight (any offset: a run-time value).
enum class Weights : uint8_t { kNone, kWeighted };
/// Factor tables, a cos/sin cache, or none (SPEC.md section 9: nothing rotates, r = 0).
enum class AngleSource : uint8_t { kTables, kCache, kNone };
/// The angles' dtype (bf16 without angles: no kernel reads them).
enum class AngleType : uint8_t { kBf16, kFp32 };
enum class Placement : uint8_t { kPlain, kPaired, kKeyOffset };
/// What one RMS of Q and K spans (SPEC.md section 9): the public qkvfuse::NormScope, a head row
/// or a token's rows of one kind.
using qkvfuse::NormScope;
/// The V heads' weightless RMS norm in the same op (SPEC.md section 9: normalize_v).
enum class VNorm : uint8_t { kNone, kRms };
/// Query and key heads, or the query heads alone (SPEC.md section 9: query_only, Hkv = 0).
enum class Heads : uint8_t { kQueryAndKey, kQueryOnly };

/// A call's properties, computed once per call (rope_key) from validated arguments. A property
/// added here is added to Spec too, and then every row states it.
struct RopeKey {
  Access access;
  int head_dim;
  HeadWidth width;
  Rotary rotary;
  RotarySpan span;
  Norm norm;
  Weights weights;
  AngleSource angles;
  AngleType angle_type;
  Placement placement;
  NormScope scope;
  VNorm v_norm;
  Heads heads;
};

/// The values of one property that a row serves. No default and no "any": every row states every
/// property by listing values, and a value outside the list (one added to the enum later, or any
/// value outside the enum) never matches.
template <typename E>
class Served {
  static_assert(std::is_enum_v<E>, "a property is an enum");

 public:
  template <typename... Rest>
    requires(std::is_same_v<Rest, E> && ...)
  constexpr Served(E first, Rest... rest) : bits_((bit(first) | ... | bit(rest))) {}

  /// Every value, present and future: the general configuration only (it is never matched, it
  /// is what runs when no row matches).
  static constexpr Served every() { return Served(~0u); }
  /// No value: for the kernel knobs that list ops (Spec::exact_width), never for a property.
  static constexpr Served none() { return Served(0u); }

  constexpr bool contains(E value) const { return (bits_ & bit(value)) != 0u; }
  /// Exactly `value`: a compile-time constant in the row's kernels.
  constexpr bool only(E value) const { return bits_ == bit(value); }

 private:
  constexpr explicit Served(uint32_t bits) : bits_(bits) {}
  static constexpr uint32_t bit(E value) {
    return unsigned(value) < 32u ? (1u << unsigned(value)) : 0u;
  }
  uint32_t bits_;
};

/// A kernel knob that every row must state (no default).
template <typename T>
struct Knob {
  constexpr Knob(T v) : value(v) {}  // NOLINT: rows write `.knob = true`
  T value;
};

/// A row of the table: the ops and the property values it serves, and how its kernels are built.
struct Spec {
  const char* name;  ///< by the properties it fixes, as docs/STATUS.md's table names it
  Served<Op> ops;
  Served<Access> access;
  Served<HeadWidth> width;
  Served<Rotary> rotary;
  Served<RotarySpan> span;
  Served<Norm> norm;
  Served<Weights> weights;
  Served<AngleSource> angles;
  Served<AngleType> angle_type;
  Served<Placement> placement;
  Served<NormScope> scope;
  Served<VNorm> v_norm;
  Served<Heads> heads;
  /// The ops whose kernels take D as a compile-time constant at the row's power-of-two widths
  /// (32, 64, 128, 256, 512; the others run with D at run time): the masks and D-dependent offsets
  /// fold and each division by D is one FMUL (PowerOfTwoWidth).
  Served<Op> exact_width;
  /// NeoX pairs in one lane (rope_common.cuh NeoxPairGeometry): both halves of each pair in the
  /// same thread, no partner shuffles; needs NeoX, r = D and exact widths of 64, 128 or 256.
  Knob<bool> neox_pairs_in_lane;
  /// The 16-byte kernels read the angles' dtype at run time (one kernel for bf16 and fp32, their
  /// values held as fp32, as the narrow kernels always do) instead of one kernel per dtype.
  Knob<bool> angle_dtype_at_run_time;
  /// Fewer row geometries (rope_config.cuh lanes_for), for layouts too rare to pay a kernel per
  /// width class: D = 96 on 16 lanes (as the FP8 backward always), and the narrow rows of the
  /// row kernels on their access width's widest geometry, masked below it (the FP8 backward keeps
  /// its narrow split at 256, where its tile shrinks: fp8_tile_tokens).
  Knob<bool> fewest_geometries;

  constexpr bool serves(Op op, const RopeKey& key) const {
    return ops.contains(op) && access.contains(key.access) && width.contains(key.width) &&
           rotary.contains(key.rotary) && span.contains(key.span) && norm.contains(key.norm) &&
           weights.contains(key.weights) && angles.contains(key.angles) &&
           angle_type.contains(key.angle_type) && placement.contains(key.placement) &&
           scope.contains(key.scope) && v_norm.contains(key.v_norm) && heads.contains(key.heads);
  }
};

// ------------------------------------------------------------------------------------------------
// The table
// ------------------------------------------------------------------------------------------------

inline constexpr Served<Op> kEveryOp{Op::kForward, Op::kBackward, Op::kBackwardFp8};
/// The 16-byte access's widths: multiples of 8 in [32, 256].
inline constexpr Served<HeadWidth> kVectorWidths{
    HeadWidth::k32,      HeadWidth::kUpTo64, HeadWidth::k64,      HeadWidth::k96,
    HeadWidth::kUpTo128, HeadWidth::k128,    HeadWidth::kUpTo256, HeadWidth::k256};

/// The widths of SPEC.md sections 1-8: D up to 256.
inline constexpr Served<HeadWidth> kWidthsTo256{
    HeadWidth::kUpTo32, HeadWidth::k32,   HeadWidth::kUpTo64,  HeadWidth::k64,
    HeadWidth::k96,     HeadWidth::kUpTo128, HeadWidth::k128, HeadWidth::kUpTo256,
    HeadWidth::k256};

/// Every layout of SPEC.md sections 1-8: each property a run-time value (access width, geometry
/// and the 16-byte kernels' angle dtype excepted: they shape the registers, so each has its own
/// kernel). It lists sections 1-8's values of the properties section 9 extends (width, angle
/// source, norm scope, V norm, heads), so its kernels hold a per-head norm and no V rows as
/// constants (rope_rows.cuh Fixed): the code that ran on a GPU.
struct General {
  static constexpr Spec kSpec{
      .name = "general",
      .ops = Served<Op>::every(),
      .access = Served<Access>::every(),
      .width = kWidthsTo256,
      .rotary = Served<Rotary>::every(),
      .span = Served<RotarySpan>::every(),
      .norm = Served<Norm>::every(),
      .weights = Served<Weights>::every(),
      .angles = {AngleSource::kTables, AngleSource::kCache},
      .angle_type = Served<AngleType>::every(),
      .placement = Served<Placement>::every(),
      .scope = {NormScope::kHead},
      .v_norm = {VNorm::kNone},
      .heads = {Heads::kQueryAndKey},
      .exact_width = Served<Op>::none(),
      .neox_pairs_in_lane = false,
      .angle_dtype_at_run_time = false,
      .fewest_geometries = false,
  };
};

/// Every value of every property, present and future, each a run-time value (as General's):
/// what General does not serve, which is every key with a value of SPEC.md section 9 (D past
/// 256, a token-wide norm in its own kernels, the V norm, query-only heads, no angle source).
/// Reached only with QKVFUSE_CUDA_SECTION9=1 (validation refuses section 9's options without
/// it); its kernels have not run on a GPU. Fewer kernels than General's, to keep the family's
/// entries in budget (docs/STATUS.md): the angles' dtype at run time and the fewest geometries.
struct Section9 {
  static constexpr Spec kSpec{
      .name = "general/section-9",
      .ops = Served<Op>::every(),
      .access = Served<Access>::every(),
      .width = Served<HeadWidth>::every(),
      .rotary = Served<Rotary>::every(),
      .span = Served<RotarySpan>::every(),
      .norm = Served<Norm>::every(),
      .weights = Served<Weights>::every(),
      .angles = Served<AngleSource>::every(),
      .angle_type = Served<AngleType>::every(),
      .placement = Served<Placement>::every(),
      .scope = Served<NormScope>::every(),
      .v_norm = Served<VNorm>::every(),
      .heads = Served<Heads>::every(),
      .exact_width = Served<Op>::none(),
      .neox_pairs_in_lane = false,
      .angle_dtype_at_run_time = true,
      .fewest_geometries = true,
  };
};

/// The 16-byte widths the speedrun's layers use (D = 64, 96, 128): its named shapes.
inline constexpr Served<HeadWidth> kSpeedrunWidths{HeadWidth::k64, HeadWidth::k96,
                                                   HeadWidth::k128};

/// Factor tables, interleaved pairs, RMS without weights, every lane rotary (the speedrun's
/// layers, plain and paired). Its kernels hold no weight, cache or partner-exchange code and
/// rotate chunk by chunk; the general code cost the speedrun's kernels 0-6 % (5b85f3d against
/// 68ac3a6) and 14-17 % for the forward with place()'s selects (2e387f1), perf_notes.md.
struct TablesInterleavedRms {
  static constexpr Spec kSpec{
      .name = "tables/interleaved/rms/no-weight",
      .ops = kEveryOp,
      .access = {Access::k16B},
      .width = kSpeedrunWidths,
      .rotary = {Rotary::kInterleaved},
      .span = {RotarySpan::kWhole},
      .norm = {Norm::kRms},
      .weights = {Weights::kNone},
      .angles = {AngleSource::kTables},
      .angle_type = {AngleType::kBf16},
      .placement = {Placement::kPlain, Placement::kPaired},
      .scope = {NormScope::kHead},
      .v_norm = {VNorm::kNone},
      .heads = {Heads::kQueryAndKey},
      .exact_width = Served<Op>::none(),
      .neox_pairs_in_lane = false,
      .angle_dtype_at_run_time = false,
      .fewest_geometries = false,
  };
};

/// The same under key offset (keys' lanes >= r from the previous token; the speedrun's r = D / 2).
/// The bf16 backward with D a constant at D = 64 and 128: 4.8 / 5.4 % faster at D = 128 / 64
/// (707eb03; the forward within 0.5 %, the FP8 backward 0.2-2.7 %, not kept there).
struct TablesInterleavedRmsKeyOffset {
  static constexpr Spec kSpec{
      .name = "tables/interleaved/rms/no-weight/key-offset",
      .ops = kEveryOp,
      .access = {Access::k16B},
      .width = kSpeedrunWidths,
      .rotary = {Rotary::kInterleaved},
      .span = {RotarySpan::kWhole, RotarySpan::kPartial},
      .norm = {Norm::kRms},
      .weights = {Weights::kNone},
      .angles = {AngleSource::kTables},
      .angle_type = {AngleType::kBf16},
      .placement = {Placement::kKeyOffset},
      .scope = {NormScope::kHead},
      .v_norm = {VNorm::kNone},
      .heads = {Heads::kQueryAndKey},
      .exact_width = {Op::kBackward},
      .neox_pairs_in_lane = false,
      .angle_dtype_at_run_time = false,
      .fewest_geometries = false,
  };
};

/// A cos/sin cache, NeoX over the whole row, RMS times a weight, plain placement: Qwen3 (D = 128)
/// and Gemma 3 (D = 256, 1 + w), forward and bf16 backward. The layout's options are constants
/// (1.25-1.40x at Qwen3-8B, a11dade) and D too, on 8 lanes x 2 chunks at D = 128 (16 x 2 at 256)
/// with both halves of each NeoX pair in one lane (1.12x forward, 1.08x backward at Qwen3-8B,
/// d51cb4d / 41f246d), perf_notes.md; Gemma3-12B's 88 % target was set on these kernels (f0006af).
/// bf16 angles only (fp32 never timed: general).
struct CacheNeoxRmsWeightedPairs {
  static constexpr Spec kSpec{
      .name = "cache/neox/rms/weighted/pairs-in-lane",
      .ops = {Op::kForward, Op::kBackward},
      .access = {Access::k16B},
      .width = {HeadWidth::k128, HeadWidth::k256},
      .rotary = {Rotary::kNeox},
      .span = {RotarySpan::kWhole},
      .norm = {Norm::kRms},
      .weights = {Weights::kWeighted},
      .angles = {AngleSource::kCache},
      .angle_type = {AngleType::kBf16},
      .placement = {Placement::kPlain},
      .scope = {NormScope::kHead},
      .v_norm = {VNorm::kNone},
      .heads = {Heads::kQueryAndKey},
      .exact_width = {Op::kForward, Op::kBackward},
      .neox_pairs_in_lane = true,
      .angle_dtype_at_run_time = false,
      .fewest_geometries = false,
  };
};

/// The same layout in the FP8 backward, on its 16-lane geometry: NeoX pairs in lane would need 32
/// lane groups' weight-gradient rows in shared memory per CTA, 2 CTAs per SM instead of 3
/// (perf_notes.md). The options as constants: 0.6220 -> 0.4693 ms at Qwen3-8B (a11dade with
/// b26e0ad-a444adf). D = 256 (Gemma 3) is add6545's kernel there, not timed alone: the general
/// one takes 186 registers against its 121 (one CTA per SM); the general-only A/B decides.
struct CacheNeoxRmsWeighted {
  static constexpr Spec kSpec{
      .name = "cache/neox/rms/weighted",
      .ops = {Op::kBackwardFp8},
      .access = {Access::k16B},
      .width = {HeadWidth::k128, HeadWidth::k256},
      .rotary = {Rotary::kNeox},
      .span = {RotarySpan::kWhole},
      .norm = {Norm::kRms},
      .weights = {Weights::kWeighted},
      .angles = {AngleSource::kCache},
      .angle_type = {AngleType::kBf16},
      .placement = {Placement::kPlain},
      .scope = {NormScope::kHead},
      .v_norm = {VNorm::kNone},
      .heads = {Heads::kQueryAndKey},
      .exact_width = {Op::kBackwardFp8},
      .neox_pairs_in_lane = false,
      .angle_dtype_at_run_time = false,
      .fewest_geometries = false,
  };
};

/// The specializations, in the order they are tried (the first that serves a call runs it).
template <class... Rows>
struct Table {};
using Specializations = Table<TablesInterleavedRms, TablesInterleavedRmsKeyOffset,
                             CacheNeoxRmsWeightedPairs, CacheNeoxRmsWeighted>;

// ------------------------------------------------------------------------------------------------
// Restored rows (QKVFUSE_ROPE_RESTORED_ROWS=1)
// ------------------------------------------------------------------------------------------------
// add6545's kernels for the layouts where the rebuilt family runs slower than add6545 did
// (docs/perf_notes.md, "The kernel family"), as rows of the table. Not yet timed against the
// default: the dispatcher tries them only with the switch on (rope_config.cuh restored_rows), so
// that one build's A/B (scripts/device_run.sh ab, side "restored-rows") decides. A row >= 3 %
// faster at its named shapes joins Specializations (and the switch goes); else it is deleted.

/// Every layout without norm weights at D = 128 in the bf16 backward (16-byte rows, bf16 angles,
/// plain or paired): rotary alone (Llama's and Mistral's layers; Qwen3-8B/no-norm) and the norm
/// without weights (Qwen3-8B/no-weights). General's kernel holds the weight code (shared-memory
/// weights, gradient sums) and runs 5 blocks (92 registers); without it this row's kernel has
/// add6545's weightless general kernel's budget, 7 blocks (72 registers). Layouts a
/// specialization serves (TablesInterleavedRms) stay there.
struct GeneralWeightless {
  static constexpr Spec kSpec{
      .name = "general/no-weight",
      .ops = {Op::kBackward},
      .access = {Access::k16B},
      .width = {HeadWidth::k128},
      .rotary = {Rotary::kInterleaved, Rotary::kNeox},
      .span = {RotarySpan::kWhole, RotarySpan::kPartial},
      .norm = {Norm::kNone, Norm::kRms},
      .weights = {Weights::kNone},
      .angles = {AngleSource::kTables, AngleSource::kCache},
      .angle_type = {AngleType::kBf16},
      .placement = {Placement::kPlain, Placement::kPaired},
      .scope = {NormScope::kHead},
      .v_norm = {VNorm::kNone},
      .heads = {Heads::kQueryAndKey},
      .exact_width = Served<Op>::none(),
      .neox_pairs_in_lane = false,
      .angle_dtype_at_run_time = false,
      .fewest_geometries = false,
  };
};

/// The speedrun's layout (factor tables, interleaved pairs, RMS without weights; plain, paired and
/// key offset in one kernel, key offset read at run time) on 4-byte chunks at 64 < D < 128
/// (D = 100: rows not 16-byte aligned), all three ops: add6545's narrow speedrun kernels
/// (8e30f53) on RowGeometry<2, 32, 2>, chunk by chunk (forward_chunk) with no weight, cache or
/// partner code; General's narrow kernels hold all of it.
struct TablesInterleavedRmsNarrow {
  static constexpr Spec kSpec{
      .name = "tables/interleaved/rms/no-weight/4-byte",
      .ops = kEveryOp,
      .access = {Access::k4B},
      .width = {HeadWidth::kUpTo128},
      .rotary = {Rotary::kInterleaved},
      .span = {RotarySpan::kWhole, RotarySpan::kPartial},
      .norm = {Norm::kRms},
      .weights = {Weights::kNone},
      .angles = {AngleSource::kTables},
      .angle_type = {AngleType::kBf16},
      .placement = {Placement::kPlain, Placement::kPaired, Placement::kKeyOffset},
      .scope = {NormScope::kHead},
      .v_norm = {VNorm::kNone},
      .heads = {Heads::kQueryAndKey},
      .exact_width = Served<Op>::none(),
      .neox_pairs_in_lane = false,
      .angle_dtype_at_run_time = false,
      .fewest_geometries = false,
  };
};

/// The restored rows, in the order they are tried (after Specializations, with the switch on).
using RestoredRows = Table<GeneralWeightless, TablesInterleavedRmsNarrow>;

// ------------------------------------------------------------------------------------------------
// Selection
// ------------------------------------------------------------------------------------------------

/// The configurations that serve what no specialization serves, in the order they are tried.
using Generals = Table<General, Section9>;

/// Calls f(Row{}) for the first row of `table` that serves (kOp, key); false when none does. Rows
/// that do not serve kOp are not instantiated.
template <Op kOp, class... Rows, typename F>
bool visit_first(Table<Rows...>, const RopeKey& key, F&& f) {
  bool done = false;
  const auto try_row = [&](auto row) {
    using Row = decltype(row);
    if constexpr (Row::kSpec.ops.contains(kOp)) {
      if (!done && Row::kSpec.serves(kOp, key)) {
        done = true;
        f(row);
      }
    }
  };
  (try_row(Rows{}), ...);
  return done;
}

/// Calls f(Row{}) for the configuration that serves (kOp, key): the first row of Specializations
/// whose every property lists the key's value and whose ops list kOp, then (`restored_rows`) the
/// first such row of RestoredRows, else the first of Generals that serves it (`general_only`:
/// Generals alone, whatever `restored_rows` says). False when none serves (Section9 serves every
/// key: none so far). Every row's kernels are instantiated whatever the flags say.
template <Op kOp, typename F>
bool visit_config(const RopeKey& key, F&& f, bool general_only = false,
                  bool restored_rows = false) {
  if (!general_only && visit_first<kOp>(Specializations{}, key, f)) return true;
  // The restored rows' kernels are instantiated either way (a run-time test): every build has them.
  if (!general_only && restored_rows && visit_first<kOp>(RestoredRows{}, key, f)) return true;
  return visit_first<kOp>(Generals{}, key, f);
}

/// The name of the configuration that serves (op, key), or nullptr (tests, error messages).
inline const char* config_name(Op op, const RopeKey& key, bool general_only = false,
                               bool restored_rows = false) {
  const char* name = nullptr;
  const auto take = [&](auto row) { name = decltype(row)::kSpec.name; };
  switch (op) {
    case Op::kForward: visit_config<Op::kForward>(key, take, general_only, restored_rows); break;
    case Op::kBackward: visit_config<Op::kBackward>(key, take, general_only, restored_rows); break;
    case Op::kBackwardFp8:
      visit_config<Op::kBackwardFp8>(key, take, general_only, restored_rows);
      break;
  }
  return name;
}

// ------------------------------------------------------------------------------------------------
// The key of a call
// ------------------------------------------------------------------------------------------------

/// The width classes of one power-of-two width each (Spec::exact_width).
constexpr bool exact_power_of_two(HeadWidth width) {
  return width == HeadWidth::k32 || width == HeadWidth::k64 || width == HeadWidth::k128 ||
         width == HeadWidth::k256 || width == HeadWidth::k512;
}

/// The class of head width D (even, in [2, 512]).
inline HeadWidth head_width_class(int64_t D) {
  if (D < 32) return HeadWidth::kUpTo32;
  if (D == 32) return HeadWidth::k32;
  if (D < 64) return HeadWidth::kUpTo64;
  if (D == 64) return HeadWidth::k64;
  if (D == 96) return HeadWidth::k96;
  if (D < 128) return HeadWidth::kUpTo128;
  if (D == 128) return HeadWidth::k128;
  if (D < 256) return HeadWidth::kUpTo256;
  if (D == 256) return HeadWidth::k256;
  if (D < 512) return HeadWidth::kUpTo512;
  return HeadWidth::k512;
}

/// The key of a validated layout with head width D whose rows take chunks of `chunk` elements;
/// `v_dim` the V norm's Dv (its rows take the kernel's row geometry: the width class covers both).
inline RopeKey rope_key(const RopeLayout& layout, int64_t D, int chunk, int64_t v_dim = 0) {
  const bool cache = !is_absent(layout.cos_sin);
  const bool angles = qkvfuse::rope::has_angles(layout);
  const DType angle_dtype = cache ? layout.cos_sin.dtype : layout.factor1.dtype;
  const int64_t row_width = layout.normalize_v && v_dim > D ? v_dim : D;
  return {
      .access = chunk == 8 ? Access::k16B : (chunk == 2 ? Access::k4B : Access::k2B),
      .head_dim = int(D),
      .width = head_width_class(row_width),
      .rotary = layout.rotary_style == RotaryStyle::kNeox ? Rotary::kNeox : Rotary::kInterleaved,
      .span = qkvfuse::rope::resolved_rotary_dim(layout, D) == D ? RotarySpan::kWhole
                                                                  : RotarySpan::kPartial,
      .norm = layout.normalize ? Norm::kRms : Norm::kNone,
      .weights = is_absent(layout.q_weight) && is_absent(layout.k_weight) ? Weights::kNone
                                                                          : Weights::kWeighted,
      .angles = !angles ? AngleSource::kNone
                        : (cache ? AngleSource::kCache : AngleSource::kTables),
      .angle_type = angles && angle_dtype == DType::kFloat32 ? AngleType::kFp32 : AngleType::kBf16,
      .placement = layout.key_offset ? Placement::kKeyOffset
                                     : (layout.paired ? Placement::kPaired : Placement::kPlain),
      .scope = layout.norm_scope,
      .v_norm = layout.normalize_v ? VNorm::kRms : VNorm::kNone,
      .heads = layout.query_only ? Heads::kQueryOnly : Heads::kQueryAndKey,
  };
}

inline RopeKey rope_key(const QkNormRopeParams& p) {
  return rope_key(p.layout, p.qk.sizes[2], chunk_width(p), v_width(p.layout, p.v));
}
inline RopeKey rope_key(const QkNormRopeBackwardParams& p) {
  return rope_key(p.layout, p.qk.sizes[2], chunk_width(p), v_width(p.layout, p.v));
}
inline RopeKey rope_key(const QkvBackwardFp8Params& p) {
  return rope_key(p.layout, p.qk.sizes[2], chunk_width(p), v_width(p.layout, p.v));
}

}  // namespace qkvfuse::cuda::rope
