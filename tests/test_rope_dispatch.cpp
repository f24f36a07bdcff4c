// test_rope_dispatch.cpp: which kernel configuration of the CUDA rope family serves a call
// (src/cuda/rope_dispatch.hpp: the key of a call and the table of specializations). Host code
// only, so it runs everywhere: the views carry made-up device addresses and are never read. The
// GPU tests check every configuration's results; this pins the choice, and that a layout value
// no specialization names takes the general kernel.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda/rope_dispatch.hpp"
#include "qkvfuse/tensor.hpp"

namespace qkvfuse::test {
namespace {

using cuda::rope::AngleSource;
using cuda::rope::AngleType;
using cuda::rope::config_name;
using cuda::rope::Heads;
using cuda::rope::HeadWidth;
using cuda::rope::Norm;
using cuda::rope::Op;
using cuda::rope::Placement;
using cuda::rope::RopeKey;
using cuda::rope::Rotary;
using cuda::rope::RotarySpan;
using cuda::rope::Served;
using cuda::rope::Spec;
using cuda::rope::VNorm;
using cuda::rope::Weights;

const Device kGpu{DeviceType::kCUDA, 0};
constexpr Op kOps[] = {Op::kForward, Op::kBackward, Op::kBackwardFp8};

void* at(uintptr_t byte_offset) { return reinterpret_cast<void*>((uintptr_t(1) << 32) + byte_offset); }

/// A layer of a model (or of the speedrun) as the ops see it: 16-byte aligned rows throughout, so
/// that the 16-byte access serves it where its width allows.
struct Shape {
  const char* name;
  int64_t heads, kv_heads, dim;
  bool cache = false;  ///< cos/sin cache (else factor tables [T, D])
  bool neox = false;
  bool normalize = true;
  bool weights = false;  ///< q_weight and k_weight
  float weight_offset = 0.0f;
  int64_t rotary = -1;
  bool paired = false;
  bool key_offset = false;
  DType angle_dtype = DType::kBFloat16;
  // SPEC.md section 9
  bool token_norm = false;
  int64_t v_dim = 0;  ///< > 0: the V norm on rows of this width
  bool query_only = false;
  bool no_angles = false;

  RopeLayout layout() const {
    RopeLayout l;
    l.num_heads = heads;
    l.num_kv_heads = kv_heads;
    l.rotary_dim = rotary;
    l.rotary_style = neox ? RotaryStyle::kNeox : RotaryStyle::kInterleaved;
    l.normalize = normalize;
    l.paired = paired;
    l.key_offset = key_offset;
    l.weight_offset = weight_offset;
    l.norm_scope = token_norm ? NormScope::kToken : NormScope::kHead;
    l.normalize_v = v_dim > 0;
    l.query_only = query_only;
    if (query_only) l.num_kv_heads = 0;
    const int64_t tokens = 64;
    if (no_angles) {
      // nothing rotates
    } else if (cache) {
      l.cos_sin = make_view(at(uintptr_t(1) << 28), angle_dtype, kGpu, {4096, dim});
      l.positions = make_view(at(uintptr_t(2) << 28), DType::kInt64, kGpu, {tokens});
    } else {
      const int64_t width = paired ? 2 * dim : dim;
      l.factor1 = make_view(at(uintptr_t(1) << 28), angle_dtype, kGpu, {tokens, width});
      l.factor2 = make_view(at(uintptr_t(2) << 28), angle_dtype, kGpu, {tokens, width});
    }
    if (weights) {
      const int64_t kv = query_only ? 0 : kv_heads;
      l.q_weight = make_view(at(uintptr_t(3) << 28), DType::kBFloat16, kGpu,
                             {token_norm ? heads * dim : dim});
      if (!query_only) {
        l.k_weight = make_view(at(uintptr_t(4) << 28), DType::kBFloat16, kGpu,
                               {token_norm ? kv * dim : dim});
      }
    }
    return l;
  }
  /// The key of a call whose rows take 16-byte chunks (the access every model shape gets).
  RopeKey key() const { return cuda::rope::rope_key(layout(), dim, 8, v_dim); }
};

Shape speedrun(int64_t dim, Placement placement) {
  Shape s{"speedrun", dim == 64 ? 12 : 6, dim == 64 ? 12 : 6, dim};
  s.paired = placement == Placement::kPaired;
  s.key_offset = placement == Placement::kKeyOffset;
  if (s.key_offset) s.rotary = dim / 2;  // the speedrun's keys keep half their lanes
  return s;
}
Shape qwen3(int64_t heads) {  // Qwen3-8B (32 / 8) and Qwen3-0.6B (16 / 8)
  Shape s{"Qwen3", heads, 8, 128};
  s.cache = s.neox = s.weights = true;
  return s;
}
Shape gemma3_12b() {
  Shape s{"Gemma3-12B", 16, 8, 256};
  s.cache = s.neox = s.weights = true;
  s.weight_offset = 1.0f;
  return s;
}
Shape llama_rotary_only() {  // Llama 3.1 8B: no QK norm
  Shape s{"Llama (rotary only)", 32, 8, 128};
  s.cache = s.neox = true;
  s.normalize = false;
  return s;
}

/// Every named shape of the kernel-family issue.
std::vector<Shape> named_shapes() {
  std::vector<Shape> shapes;
  for (const int64_t dim : {128, 96, 64}) {
    for (const Placement p : {Placement::kPlain, Placement::kPaired, Placement::kKeyOffset}) {
      shapes.push_back(speedrun(dim, p));
    }
  }
  shapes.push_back(qwen3(32));
  shapes.push_back(qwen3(16));
  shapes.push_back(gemma3_12b());
  shapes.push_back(llama_rotary_only());
  return shapes;
}

std::string describe(const Shape& s) {
  return std::string(s.name) + " D=" + std::to_string(s.dim) + (s.paired ? " paired" : "") +
         (s.key_offset ? " key offset" : "");
}

// ---- the rules of the table ----------------------------------------------------------------------

// A row must state every property: Served and Knob have no default, so a row that leaves one out
// does not compile.
template <class T>
constexpr bool spec_without_placement() {
  return requires {
    T{.name = "x",
      .ops = {Op::kForward},
      .access = {cuda::rope::Access::k16B},
      .width = {HeadWidth::k128},
      .rotary = {Rotary::kNeox},
      .span = {RotarySpan::kWhole},
      .norm = {Norm::kRms},
      .weights = {Weights::kNone},
      .angles = {AngleSource::kCache},
      .angle_type = {AngleType::kBf16},
      .scope = {NormScope::kHead},
      .v_norm = {VNorm::kNone},
      .heads = {Heads::kQueryAndKey},
      .exact_width = Served<Op>::none(),
      .neox_pairs_in_lane = false,
      .angle_dtype_at_run_time = false,
      .fewest_geometries = false};
  };
}
template <class T>
constexpr bool spec_without_knob() {
  return requires {
    T{.name = "x",
      .ops = {Op::kForward},
      .access = {cuda::rope::Access::k16B},
      .width = {HeadWidth::k128},
      .rotary = {Rotary::kNeox},
      .span = {RotarySpan::kWhole},
      .norm = {Norm::kRms},
      .weights = {Weights::kNone},
      .angles = {AngleSource::kCache},
      .angle_type = {AngleType::kBf16},
      .placement = {Placement::kPlain},
      .scope = {NormScope::kHead},
      .v_norm = {VNorm::kNone},
      .heads = {Heads::kQueryAndKey},
      .exact_width = Served<Op>::none(),
      .angle_dtype_at_run_time = false,
      .fewest_geometries = false};
  };
}
template <class T>
constexpr bool spec_complete() {
  return requires {
    T{.name = "x",
      .ops = {Op::kForward},
      .access = {cuda::rope::Access::k16B},
      .width = {HeadWidth::k128},
      .rotary = {Rotary::kNeox},
      .span = {RotarySpan::kWhole},
      .norm = {Norm::kRms},
      .weights = {Weights::kNone},
      .angles = {AngleSource::kCache},
      .angle_type = {AngleType::kBf16},
      .placement = {Placement::kPlain},
      .scope = {NormScope::kHead},
      .v_norm = {VNorm::kNone},
      .heads = {Heads::kQueryAndKey},
      .exact_width = Served<Op>::none(),
      .neox_pairs_in_lane = false,
      .angle_dtype_at_run_time = false,
      .fewest_geometries = false};
  };
}
static_assert(spec_complete<Spec>(), "a row that states every property compiles");
static_assert(!spec_without_placement<Spec>(), "a row that omits a property does not compile");
static_assert(!spec_without_knob<Spec>(), "a row that omits a knob does not compile");
static_assert(!std::is_default_constructible_v<Served<Norm>>, "no default value list");

TEST(RopeDispatch, ListedValuesMatchAndNothingElse) {
  constexpr Served<Placement> plain_or_paired{Placement::kPlain, Placement::kPaired};
  EXPECT_TRUE(plain_or_paired.contains(Placement::kPlain));
  EXPECT_TRUE(plain_or_paired.contains(Placement::kPaired));
  EXPECT_FALSE(plain_or_paired.contains(Placement::kKeyOffset));
  EXPECT_FALSE(plain_or_paired.only(Placement::kPlain));
  // A value added to the enum later (here one past the last), or any value outside it, is in no
  // list: the rows written before it never serve it.
  EXPECT_FALSE(plain_or_paired.contains(static_cast<Placement>(3)));
  EXPECT_FALSE(plain_or_paired.contains(static_cast<Placement>(200)));
  constexpr Served<Norm> rms{Norm::kRms};
  EXPECT_TRUE(rms.only(Norm::kRms));
  EXPECT_FALSE(rms.contains(static_cast<Norm>(2)));
}

/// The key with one property set to a value that no enum has yet (a value a later option would
/// add: a norm over the whole token, a V norm, head width 512, ...).
std::vector<std::pair<std::string, RopeKey>> keys_with_a_new_value(const RopeKey& key) {
  std::vector<std::pair<std::string, RopeKey>> out;
  const auto add = [&](const char* property, auto mutate) {
    RopeKey k = key;
    mutate(k);
    out.emplace_back(property, k);
  };
  add("access", [](RopeKey& k) { k.access = static_cast<cuda::rope::Access>(3); });
  add("width", [](RopeKey& k) { k.width = static_cast<HeadWidth>(11); });
  add("rotary", [](RopeKey& k) { k.rotary = static_cast<Rotary>(2); });
  add("span", [](RopeKey& k) { k.span = static_cast<RotarySpan>(2); });
  add("norm", [](RopeKey& k) { k.norm = static_cast<Norm>(2); });
  add("weights", [](RopeKey& k) { k.weights = static_cast<Weights>(2); });
  add("angles", [](RopeKey& k) { k.angles = static_cast<AngleSource>(3); });
  add("angle_type", [](RopeKey& k) { k.angle_type = static_cast<AngleType>(2); });
  add("placement", [](RopeKey& k) { k.placement = static_cast<Placement>(3); });
  add("scope", [](RopeKey& k) { k.scope = static_cast<NormScope>(2); });
  add("v_norm", [](RopeKey& k) { k.v_norm = static_cast<VNorm>(2); });
  add("heads", [](RopeKey& k) { k.heads = static_cast<Heads>(2); });
  return out;
}

/// The general configurations (rope_dispatch.hpp Generals): General, whose kernels are those of
/// SPEC.md sections 1-8, and Section9, which serves every key with a value of section 9.
constexpr const char* kGeneral = "general";
constexpr const char* kSection9 = "general/section-9";

/// `shape` with each of SPEC.md section 9's options (those its layout takes).
std::vector<std::pair<std::string, Shape>> section9_variants(const Shape& shape) {
  std::vector<std::pair<std::string, Shape>> variants;
  Shape token = shape;
  token.token_norm = true;
  variants.emplace_back("norm_scope token", token);
  for (const int64_t dim : {264, 512}) {
    Shape wide = shape;
    wide.dim = dim;
    variants.emplace_back("D = " + std::to_string(dim), wide);
  }
  Shape v_norm = shape;
  v_norm.v_dim = shape.dim;
  variants.emplace_back("normalize_v", v_norm);
  Shape wide_v = shape;
  wide_v.v_dim = 512;
  variants.emplace_back("normalize_v, Dv = 512", wide_v);
  if (!shape.paired && !shape.key_offset) {
    Shape query = shape;
    query.query_only = true;
    variants.emplace_back("query_only", query);
  }
  if (!shape.paired) {
    Shape no_angles = shape;
    no_angles.no_angles = true;
    no_angles.rotary = -1;
    variants.emplace_back("no angle source", no_angles);
  }
  return variants;
}

// General lists only the values of SPEC.md sections 1-8 of the properties section 9 extends: its
// kernels fix a per-head norm, no V rows, key heads and an angle source as constants and keep the
// code that ran on a GPU before section 9. Section9 lists every value of every property.
static_assert(!cuda::rope::General::kSpec.width.contains(HeadWidth::kUpTo512) &&
              !cuda::rope::General::kSpec.width.contains(HeadWidth::k512) &&
              !cuda::rope::General::kSpec.angles.contains(AngleSource::kNone) &&
              cuda::rope::General::kSpec.scope.only(NormScope::kHead) &&
              cuda::rope::General::kSpec.v_norm.only(VNorm::kNone) &&
              cuda::rope::General::kSpec.heads.only(Heads::kQueryAndKey));
static_assert(cuda::rope::Section9::kSpec.access.contains(cuda::rope::Access::k2B) &&
              cuda::rope::Section9::kSpec.width.contains(HeadWidth::kUpTo32) &&
              cuda::rope::Section9::kSpec.angles.contains(AngleSource::kTables) &&
              cuda::rope::Section9::kSpec.scope.contains(NormScope::kHead) &&
              cuda::rope::Section9::kSpec.ops.contains(Op::kBackwardFp8));

// SPEC.md section 9's options, each on every named shape and at every access width: values no
// specialization and not General names, so Section9's kernels serve them (also with the
// specializations off, QKVFUSE_ROPE_GENERAL_ONLY=1), never one that would hold them as constants.
TEST(RopeDispatch, SectionNineOptionsTakeTheSectionNineKernels) {
  for (const Shape& shape : named_shapes()) {
    for (const auto& [what, variant] : section9_variants(shape)) {
      for (const int chunk : {8, 2, 1}) {
        const RopeKey key =
            cuda::rope::rope_key(variant.layout(), variant.dim, chunk, variant.v_dim);
        for (const Op op : kOps) {
          EXPECT_STREQ(config_name(op, key), kSection9)
              << describe(shape) << ", " << what << ", chunk " << chunk << ", op " << int(op);
          EXPECT_STREQ(config_name(op, key, /*general_only=*/true), kSection9)
              << describe(shape) << ", " << what << ", chunk " << chunk << ", op " << int(op);
        }
      }
    }
  }
  Shape no_angles = qwen3(32);
  no_angles.no_angles = true;
  EXPECT_EQ(no_angles.key().angles, AngleSource::kNone);
  EXPECT_EQ(no_angles.key().span, RotarySpan::kPartial);  // r = 0
  Shape token = qwen3(32);
  token.token_norm = true;
  EXPECT_EQ(token.key().scope, NormScope::kToken);
  Shape query = qwen3(32);
  query.query_only = true;
  EXPECT_EQ(query.key().heads, Heads::kQueryOnly);
  Shape v_norm = qwen3(32);
  v_norm.v_dim = 64;
  EXPECT_EQ(v_norm.key().v_norm, VNorm::kRms);
  EXPECT_EQ(v_norm.key().width, HeadWidth::k128) << "Dv <= D: the width class of D";
  v_norm.v_dim = 256;
  EXPECT_EQ(v_norm.key().width, HeadWidth::k256) << "the V rows share the row geometry";
  v_norm.v_dim = 512;
  EXPECT_EQ(v_norm.key().width, HeadWidth::k512);
  EXPECT_STREQ(config_name(Op::kForward, v_norm.key()), kSection9) << "Dv past 256";
}

// The properties whose section 9 values General does not list (its kernels hold them as
// constants): a value added to one of them later runs Section9's kernels, which read it at run
// time; a new value of any other property runs General's.
bool general_fixes(const std::string& property) {
  return property == "width" || property == "angles" || property == "scope" ||
         property == "v_norm" || property == "heads";
}

TEST(RopeDispatch, AValueNoRowNamesTakesTheGeneralKernel) {
  for (const Shape& shape : named_shapes()) {
    for (const auto& [property, key] : keys_with_a_new_value(shape.key())) {
      for (const Op op : kOps) {
        EXPECT_STREQ(config_name(op, key), general_fixes(property) ? kSection9 : kGeneral)
            << describe(shape) << ", a new value of " << property << ", op " << int(op);
      }
    }
  }
}

// ---- the key of a call ---------------------------------------------------------------------------

TEST(RopeDispatch, KeysOfRealShapes) {
  const RopeKey qwen = qwen3(32).key();
  EXPECT_EQ(qwen.access, cuda::rope::Access::k16B);
  EXPECT_EQ(qwen.width, HeadWidth::k128);
  EXPECT_EQ(qwen.rotary, Rotary::kNeox);
  EXPECT_EQ(qwen.span, RotarySpan::kWhole);
  EXPECT_EQ(qwen.norm, Norm::kRms);
  EXPECT_EQ(qwen.weights, Weights::kWeighted);
  EXPECT_EQ(qwen.angles, AngleSource::kCache);
  EXPECT_EQ(qwen.angle_type, AngleType::kBf16);
  EXPECT_EQ(qwen.placement, Placement::kPlain);
  EXPECT_EQ(qwen.scope, NormScope::kHead);
  EXPECT_EQ(qwen.v_norm, VNorm::kNone);
  EXPECT_EQ(qwen.heads, Heads::kQueryAndKey);
  const RopeKey shifted = speedrun(128, Placement::kKeyOffset).key();
  EXPECT_EQ(shifted.span, RotarySpan::kPartial);
  EXPECT_EQ(shifted.placement, Placement::kKeyOffset);
  EXPECT_EQ(shifted.angles, AngleSource::kTables);
  EXPECT_EQ(shifted.weights, Weights::kNone);
  EXPECT_EQ(speedrun(64, Placement::kPaired).key().placement, Placement::kPaired);
  EXPECT_EQ(llama_rotary_only().key().norm, Norm::kNone);
  for (const auto& [dim, width] :
       std::vector<std::pair<int64_t, HeadWidth>>{{2, HeadWidth::kUpTo32},
                                                  {32, HeadWidth::k32},
                                                  {40, HeadWidth::kUpTo64},
                                                  {64, HeadWidth::k64},
                                                  {96, HeadWidth::k96},
                                                  {100, HeadWidth::kUpTo128},
                                                  {128, HeadWidth::k128},
                                                  {136, HeadWidth::kUpTo256},
                                                  {256, HeadWidth::k256},
                                                  {258, HeadWidth::kUpTo512},
                                                  {504, HeadWidth::kUpTo512},
                                                  {512, HeadWidth::k512}}) {
    EXPECT_EQ(cuda::rope::head_width_class(dim), width) << "D = " << dim;
  }
  Shape fp32 = qwen3(16);
  fp32.angle_dtype = DType::kFloat32;
  EXPECT_EQ(fp32.key().angle_type, AngleType::kFp32);
  // The access width comes from the rows' alignment (rope_paths.hpp, test_rope_paths.cpp).
  EXPECT_EQ(cuda::rope::rope_key(qwen3(16).layout(), 128, 2).access, cuda::rope::Access::k4B);
  EXPECT_EQ(cuda::rope::rope_key(qwen3(16).layout(), 128, 1).access, cuda::rope::Access::k2B);
}

// ---- which configuration each real shape runs ------------------------------------------------------

/// The configuration each named shape is meant to run, per op.
struct Expected {
  const char* forward;
  const char* backward;
  const char* backward_fp8;
};

Expected expected_for(const Shape& s) {
  if (!s.cache && !s.weights && !s.neox && s.normalize) {  // the speedrun's layers
    if (s.key_offset) {
      const char* shifted = "tables/interleaved/rms/no-weight/key-offset";
      return {shifted, shifted, shifted};
    }
    const char* plain = "tables/interleaved/rms/no-weight";
    return {plain, plain, plain};
  }
  if (s.cache && s.neox && s.weights && s.normalize && (s.dim == 128 || s.dim == 256)) {
    // Qwen3, Gemma 3: the FP8 backward on its own row (16 lanes, no NeoX pairs in lane).
    return {"cache/neox/rms/weighted/pairs-in-lane", "cache/neox/rms/weighted/pairs-in-lane",
            "cache/neox/rms/weighted"};
  }
  return {kGeneral, kGeneral, kGeneral};
}

TEST(RopeDispatch, NamedShapesSelectTheirConfiguration) {
  for (const Shape& shape : named_shapes()) {
    const Expected expected = expected_for(shape);
    const RopeKey key = shape.key();
    EXPECT_STREQ(config_name(Op::kForward, key), expected.forward) << describe(shape);
    EXPECT_STREQ(config_name(Op::kBackward, key), expected.backward) << describe(shape);
    EXPECT_STREQ(config_name(Op::kBackwardFp8, key), expected.backward_fp8) << describe(shape);
  }
}

// One value off a row's lists, each: the general kernel (no row is matched by a near miss).
TEST(RopeDispatch, OneValueOffARowTakesTheGeneralKernel) {
  std::vector<std::pair<std::string, Shape>> misses;
  for (const int64_t dim : {32, 256, 80}) {  // widths the speedrun's rows do not list
    Shape s = speedrun(128, Placement::kPlain);
    s.dim = dim;
    misses.emplace_back("speedrun D=" + std::to_string(dim), s);
  }
  Shape fp32_tables = speedrun(128, Placement::kPaired);
  fp32_tables.angle_dtype = DType::kFloat32;
  misses.emplace_back("speedrun, fp32 tables", fp32_tables);
  Shape partial = speedrun(96, Placement::kPlain);
  partial.rotary = 48;  // r < D without key offset
  misses.emplace_back("speedrun, partial rotary", partial);
  Shape weighted = speedrun(128, Placement::kKeyOffset);
  weighted.weights = true;
  misses.emplace_back("speedrun, weights", weighted);
  Shape no_norm = speedrun(64, Placement::kPlain);
  no_norm.normalize = false;
  misses.emplace_back("speedrun, no norm", no_norm);
  Shape cache = speedrun(128, Placement::kPlain);
  cache.cache = true;
  misses.emplace_back("speedrun, a cos/sin cache", cache);
  Shape glm = qwen3(32);  // GLM: half the lanes rotate
  glm.rotary = 64;
  misses.emplace_back("Qwen3, partial rotary", glm);
  Shape qwen_fp32 = qwen3(32);
  qwen_fp32.angle_dtype = DType::kFloat32;
  misses.emplace_back("Qwen3, fp32 cache", qwen_fp32);
  Shape qwen_tables = qwen3(16);
  qwen_tables.cache = false;
  misses.emplace_back("Qwen3, factor tables", qwen_tables);
  Shape interleaved = gemma3_12b();
  interleaved.neox = false;
  misses.emplace_back("Gemma3, interleaved", interleaved);
  Shape narrow = qwen3(16);
  narrow.dim = 64;
  misses.emplace_back("Qwen3 at D=64", narrow);
  Shape unweighted = qwen3(32);
  unweighted.weights = false;
  misses.emplace_back("Qwen3, no weights", unweighted);
  Shape paired = qwen3(8);
  paired.kv_heads = 8;
  paired.paired = true;
  misses.emplace_back("Qwen3, paired", paired);
  for (const auto& [what, shape] : misses) {
    for (const Op op : kOps) {
      EXPECT_STREQ(config_name(op, shape.key()), kGeneral) << what << ", op " << int(op);
    }
  }
}

TEST(RopeDispatch, NarrowAccessTakesTheGeneralKernel) {
  for (const Shape& shape : named_shapes()) {
    for (const int chunk : {2, 1}) {
      const RopeKey key = cuda::rope::rope_key(shape.layout(), shape.dim, chunk);
      for (const Op op : kOps) {
        EXPECT_STREQ(config_name(op, key), kGeneral) << describe(shape) << ", chunk " << chunk;
      }
    }
  }
}

// ---- the restored rows (QKVFUSE_ROPE_RESTORED_ROWS=1) --------------------------------------------

// rope_dispatch.hpp RestoredRows: add6545's kernels for the layouts the rebuilt family lost time
// on, awaiting their A/B. config_name's last argument is the switch (rope_config.cuh
// restored_rows reads the environment for the kernels' dispatcher).
constexpr const char* kNoWeight = "general/no-weight";
constexpr const char* kNarrow = "tables/interleaved/rms/no-weight/4-byte";

const char* with_restored_rows(Op op, const RopeKey& key) {
  return config_name(op, key, /*general_only=*/false, /*restored_rows=*/true);
}

Shape qwen3_no_weights(int64_t heads) {  // Qwen3-8B/no-weights: the norm without its weights
  Shape s = qwen3(heads);
  s.weights = false;
  return s;
}
/// The speedrun's layer at D = 100 (H = 6): rows 200 bytes apart, 4-byte access.
Shape speedrun_narrow(int64_t dim, Placement placement) {
  Shape s = speedrun(dim, placement);
  s.name = "speedrun (narrow)";
  return s;
}
RopeKey narrow_key(const Shape& s) { return cuda::rope::rope_key(s.layout(), s.dim, 2); }

/// The weightless layouts at D = 128 that the bf16 backward's general/no-weight row serves and
/// no specialization does.
std::vector<std::pair<std::string, Shape>> weightless_shapes() {
  std::vector<std::pair<std::string, Shape>> shapes;
  shapes.emplace_back("Qwen3-8B/no-norm (Llama's rotary only)", llama_rotary_only());
  shapes.emplace_back("Qwen3-8B/no-weights", qwen3_no_weights(32));
  shapes.emplace_back("Qwen3-0.6B/no-weights", qwen3_no_weights(16));
  Shape tables = llama_rotary_only();
  tables.cache = false;
  shapes.emplace_back("rotary only, factor tables", tables);
  Shape interleaved = qwen3_no_weights(32);
  interleaved.neox = false;
  shapes.emplace_back("no weights, interleaved cache", interleaved);
  Shape partial = qwen3_no_weights(32);
  partial.rotary = 64;
  shapes.emplace_back("no weights, half the lanes rotate", partial);
  Shape paired = qwen3_no_weights(8);
  paired.kv_heads = 8;
  paired.paired = true;
  shapes.emplace_back("no weights, paired", paired);
  Shape speedrun_cache = speedrun(128, Placement::kPlain);
  speedrun_cache.cache = true;
  shapes.emplace_back("speedrun, a cos/sin cache", speedrun_cache);
  return shapes;
}

TEST(RopeDispatch, RestoredRowsNeverMatchWithoutTheSwitch) {
  std::vector<std::pair<std::string, RopeKey>> keys;
  for (const auto& [what, shape] : weightless_shapes()) keys.emplace_back(what, shape.key());
  for (const Placement p : {Placement::kPlain, Placement::kPaired, Placement::kKeyOffset}) {
    const Shape s = speedrun_narrow(100, p);
    keys.emplace_back(describe(s), narrow_key(s));
  }
  for (const auto& [what, key] : keys) {
    for (const Op op : kOps) {
      EXPECT_STREQ(config_name(op, key), kGeneral) << what << ", op " << int(op);
      EXPECT_STREQ(config_name(op, key, /*general_only=*/false, /*restored_rows=*/false),
                   kGeneral)
          << what << ", op " << int(op);
      // QKVFUSE_ROPE_GENERAL_ONLY=1 wins over the switch.
      EXPECT_STREQ(config_name(op, key, /*general_only=*/true, /*restored_rows=*/true), kGeneral)
          << what << ", op " << int(op);
    }
  }
}

TEST(RopeDispatch, RestoredRowsServeTheirKeysWithTheSwitch) {
  for (const auto& [what, shape] : weightless_shapes()) {
    const RopeKey key = shape.key();
    EXPECT_STREQ(with_restored_rows(Op::kBackward, key), kNoWeight) << what;
    EXPECT_STREQ(with_restored_rows(Op::kForward, key), kGeneral) << what << ": backward only";
    EXPECT_STREQ(with_restored_rows(Op::kBackwardFp8, key), kGeneral) << what;
  }
  for (const int64_t dim : {100, 66, 120}) {
    for (const Placement p : {Placement::kPlain, Placement::kPaired, Placement::kKeyOffset}) {
      const Shape s = speedrun_narrow(dim, p);
      const RopeKey key = narrow_key(s);
      EXPECT_EQ(key.access, cuda::rope::Access::k4B);
      EXPECT_EQ(key.width, HeadWidth::kUpTo128);
      for (const Op op : kOps) {
        EXPECT_STREQ(with_restored_rows(op, key), kNarrow) << describe(s) << ", op " << int(op);
      }
    }
  }
}

/// The restored row that serves `s` at chunk width `chunk` in `op` with the switch on, by the
/// rows' documented layouts (nullptr: none, the call goes where it goes without the switch).
const char* restored_row(const Shape& s, int chunk, Op op) {
  const bool section9 = s.token_norm || s.v_dim > 0 || s.query_only || s.no_angles || s.dim > 256;
  const bool bf16 = s.angle_dtype == DType::kBFloat16;
  if (section9 || s.weights || !bf16) return nullptr;
  const bool whole = s.rotary < 0 || s.rotary == s.dim;
  const bool speedrun_layout = !s.cache && !s.neox && s.normalize;
  // 16-byte rows of the speedrun's layout, r = D, plain or paired: its specialization first.
  const bool speedrun_row = speedrun_layout && whole && !s.key_offset;
  if (chunk == 8 && op == Op::kBackward && s.dim == 128 && !s.key_offset && !speedrun_row) {
    return kNoWeight;
  }
  if (chunk == 2 && s.dim > 64 && s.dim < 128 && s.dim != 96 && speedrun_layout) return kNarrow;
  return nullptr;
}

// Every key the earlier tests name, at every access width, with the switch on: the restored row
// where one serves it, else exactly where it goes without the switch.
TEST(RopeDispatch, KeysTheRestoredRowsDoNotNameGoWhereTheyGoToday) {
  std::vector<std::pair<std::string, Shape>> shapes;
  for (const Shape& shape : named_shapes()) {
    shapes.emplace_back(describe(shape), shape);
    for (const auto& [what, variant] : section9_variants(shape)) {
      shapes.emplace_back(describe(shape) + ", " + what, variant);
    }
  }
  for (const auto& entry : weightless_shapes()) shapes.push_back(entry);
  for (const int64_t dim : {100, 80, 72, 96, 64, 40, 136}) {
    for (const Placement p : {Placement::kPlain, Placement::kPaired, Placement::kKeyOffset}) {
      const Shape s = speedrun_narrow(dim, p);
      shapes.emplace_back(describe(s), s);
      // One value off the narrow row's lists, each.
      Shape fp32 = s;
      fp32.angle_dtype = DType::kFloat32;
      shapes.emplace_back(describe(s) + ", fp32 tables", fp32);
      Shape weighted = s;
      weighted.weights = true;
      shapes.emplace_back(describe(s) + ", weights", weighted);
      Shape no_norm = s;
      no_norm.normalize = false;
      shapes.emplace_back(describe(s) + ", no norm", no_norm);
      Shape cache = s;
      cache.cache = true;
      shapes.emplace_back(describe(s) + ", a cos/sin cache", cache);
      Shape neox = s;
      neox.neox = true;
      shapes.emplace_back(describe(s) + ", NeoX", neox);
    }
  }
  // One value off general/no-weight's lists, each.
  Shape fp32 = llama_rotary_only();
  fp32.angle_dtype = DType::kFloat32;
  shapes.emplace_back("rotary only, fp32 cache", fp32);
  Shape weighted = llama_rotary_only();
  weighted.weights = true;
  shapes.emplace_back("rotary only, weights", weighted);
  Shape shifted = qwen3_no_weights(32);
  shifted.key_offset = true;
  shifted.rotary = 64;
  shapes.emplace_back("no weights, key offset", shifted);
  for (const int64_t dim : {64, 96, 120, 256}) {
    Shape other = llama_rotary_only();
    other.dim = dim;
    shapes.emplace_back("rotary only at D=" + std::to_string(dim), other);
  }
  int restored = 0;
  for (const auto& [what, shape] : shapes) {
    for (const int chunk : {8, 2, 1}) {
      const RopeKey key = cuda::rope::rope_key(shape.layout(), shape.dim, chunk, shape.v_dim);
      for (const Op op : kOps) {
        const char* row = restored_row(shape, chunk, op);
        const char* today = config_name(op, key);
        if (row != nullptr) {
          ++restored;
          EXPECT_STREQ(today, kGeneral) << what << ", chunk " << chunk << ", op " << int(op);
        }
        EXPECT_STREQ(with_restored_rows(op, key), row != nullptr ? row : today)
            << what << ", chunk " << chunk << ", op " << int(op);
      }
    }
  }
  EXPECT_GT(restored, 20) << "the sweep reaches the restored rows";
  // A value added to a property later: in neither restored row's lists either.
  for (const auto& [what, shape] : weightless_shapes()) {
    for (const auto& [property, key] : keys_with_a_new_value(shape.key())) {
      for (const Op op : kOps) {
        EXPECT_STREQ(with_restored_rows(op, key), config_name(op, key))
            << what << ", a new value of " << property << ", op " << int(op);
      }
    }
  }
}

}  // namespace
}  // namespace qkvfuse::test
