// ops.cpp: the torch.ops.qkvfuse operators.
//
// Each op allocates its outputs (and workspaces) with torch's allocator, wraps everything as
// TensorViews and calls the public C++ entry point, which validates the arguments and runs on the
// device the tensors live on. So CPU and CUDA register the same functions.
//
// The rope ops (qk_norm_rope, qkv_norm_rope, their backwards, qkv_backward_fp8 and the packed op's
// forward and backward) share one description of the layout: the schema fragment
// kRopeLayoutSchema, appended to each of their schemas, read back into a qkvfuse::RopeLayout by
// rope_layout(). Its last three fields (SPEC.md section 9) have defaults, so calls written
// before them keep working; for the same reason the V norm's saved input `v` of the FP8 and packed
// backwards is a trailing optional argument after the fragment, and the V norm's forward and bf16
// backward, which return one tensor more, are ops of their own (qkv_norm_rope[_backward]). They are boxed
// kernels, reading their arguments by name (BoxedCall, convert.hpp), so the fragment is read in one
// place. python/qkvfuse/_layout.py's RopeLayout holds the same fields in the same order.
//
// Every op is functional: its outputs are fresh tensors that alias no input and no other output
// (torch.library's rule for custom ops, which torch.compile relies on). Where the library writes two
// results into one buffer (the packed forward's Q/K and V columns, the backward's two weight
// gradients), the op returns that buffer whole and the Python package cuts the views
// (python/qkvfuse/_layout.py). The schemas have no optional outputs: a norm weight's gradient is
// returned as an empty float32 [0] tensor when that weight is absent. Fake (meta) kernels live in
// the Python package, and so does the packed op's autograd; qk_norm_rope's is autograd.cpp.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "autograd.hpp"
#include "convert.hpp"
#include "errors.hpp"
#include "qkvfuse/error.hpp"
#include "qkvfuse/qkvfuse.hpp"

namespace qkvfuse::torch_binding {
namespace {

using at::Tensor;
using torch::jit::Stack;

// ---- the rope layout ----------------------------------------------------------------------------

// The arguments of qkvfuse::RopeLayout (include/qkvfuse/qk_norm_rope.hpp), in its field order,
// appended to every rope op's schema. None is the C++ default: num_kv_heads = num_heads;
// rotary_dim = D with factor tables, cos_sin's width with a cos/sin cache.
constexpr const char* kRopeLayoutSchema =
    "int num_heads, int? num_kv_heads, int? rotary_dim, str rotary_style, bool normalize, "
    "float eps, float weight_offset, bool paired, bool key_offset, Tensor? factor1, "
    "Tensor? factor2, Tensor? cos_sin, Tensor? positions, Tensor? q_weight, Tensor? k_weight, "
    "bool normalize_v=False, str norm_scope=\"head\", bool query_only=False";

/// The schema "name(args, <layout>[, trailing]) -> returns" of a rope op.
std::string rope_schema(const char* name, const char* args, const char* returns,
                        const char* trailing = nullptr) {
  return std::string(name) + "(" + args + ", " + kRopeLayoutSchema +
         (trailing ? std::string(", ") + trailing : std::string()) + ") -> " + returns;
}

/// The layout fragment of a rope op's call. The library validates every field; checked here is
/// only what sizes the outputs (head counts) and what has no C++ counterpart (the style's name).
/// Messages name the fields as the library does: layout.<name>.
RopeLayout rope_layout(const BoxedCall& call, const OpArgs& args) {
  const int64_t num_heads = call.integer("num_heads");
  args.expect_positive(num_heads, "layout.num_heads");
  const std::optional<int64_t> num_kv_heads = call.optional_integer("num_kv_heads");
  if (num_kv_heads) args.expect_positive(*num_kv_heads, "layout.num_kv_heads");
  const std::optional<int64_t> rotary_dim = call.optional_integer("rotary_dim");
  const std::string style = call.text("rotary_style");
  QKVF_CHECK(style == "interleaved" || style == "neox", args.op(),
             ": layout.rotary_style: expected \"interleaved\" or \"neox\", got \"", style, "\"");
  RopeLayout layout{
      .num_heads = num_heads,
      .num_kv_heads = num_kv_heads.value_or(0),
      .rotary_dim = rotary_dim.value_or(-1),
      .rotary_style = style == "neox" ? RotaryStyle::kNeox : RotaryStyle::kInterleaved,
      .normalize = call.flag("normalize"),
      .eps = float(call.real("eps")),
      .weight_offset = float(call.real("weight_offset")),
      .paired = call.flag("paired"),
      .key_offset = call.flag("key_offset"),
      .factor1 = args.optional_view(call.optional_tensor("factor1"), "layout.factor1"),
      .factor2 = args.optional_view(call.optional_tensor("factor2"), "layout.factor2"),
      .cos_sin = args.optional_view(call.optional_tensor("cos_sin"), "layout.cos_sin"),
      .positions = args.optional_view(call.optional_tensor("positions"), "layout.positions"),
      .q_weight = args.optional_view(call.optional_tensor("q_weight"), "layout.q_weight"),
      .k_weight = args.optional_view(call.optional_tensor("k_weight"), "layout.k_weight")};
  // SPEC.md section 9's fields, read in the schema's order (they come last there).
  layout.normalize_v = call.flag("normalize_v");
  const std::string scope = call.text("norm_scope");
  QKVF_CHECK(scope == "head" || scope == "token", args.op(),
             ": layout.norm_scope: expected \"head\" or \"token\", got \"", scope, "\"");
  layout.norm_scope = scope == "token" ? NormScope::kToken : NormScope::kHead;
  layout.query_only = call.flag("query_only");
  return layout;
}

/// The view of the call's tensor argument `name`, named as the argument in messages.
TensorView input_view(const BoxedCall& call, const OpArgs& args, const char* name) {
  return args.view(call.tensor(name), name);
}

/// q's and k's shapes: [T, Hq, D] and [T, Hkv, D], or [2T, Hq/2, D] each when paired (the
/// library checks that Hq = Hkv is even).
struct RopeOutputShapes {
  std::vector<int64_t> q;
  std::vector<int64_t> k;
};

RopeOutputShapes rope_output_shapes(const OpArgs& args, const Tensor& qk,
                                    const RopeLayout& layout) {
  args.expect_dims(qk, 3, "qk", "[T, Hq + Hkv, D]");
  const int64_t tokens = qk.size(0);
  const int64_t dim = qk.size(2);
  const int64_t q_heads = layout.num_heads;
  const int64_t k_heads = kv_heads(layout);
  if (layout.paired) return {{2 * tokens, q_heads / 2, dim}, {2 * tokens, k_heads / 2, dim}};
  return {{tokens, q_heads, dim}, {tokens, k_heads, dim}};
}

/// The gradients of the norm weights and the backward's workspace, allocated by the op.
struct WeightGrads {
  Tensor q;          ///< [D] in q_weight's dtype, or an empty float32 [0] without q_weight
  Tensor k;          ///< likewise for k_weight
  Tensor workspace;  ///< float32, backward_workspace_size elements (undefined when 0)

  /// Allocates q and k from the call's weights (their views go in the params).
  WeightGrads(const BoxedCall& call, const Tensor& like)
      : q(grad_of(call.optional_tensor("q_weight"), like)),
        k(grad_of(call.optional_tensor("k_weight"), like)) {}

  TensorView q_view(const OpArgs& args, const RopeLayout& layout) const {
    return is_absent(layout.q_weight) ? TensorView{} : args.view(q, "grad_q_weight");
  }
  TensorView k_view(const OpArgs& args, const RopeLayout& layout) const {
    return is_absent(layout.k_weight) ? TensorView{} : args.view(k, "grad_k_weight");
  }

  /// Allocates the workspace the params need and returns its view (absent when none).
  template <typename Params>
  TensorView workspace_for(const OpArgs& args, const Params& params, const Tensor& like) {
    const int64_t size = backward_workspace_size(params);
    if (size == 0) return {};
    workspace = at::empty({size}, like.options().dtype(at::kFloat));
    return args.view(workspace, "workspace");
  }

 private:
  static Tensor grad_of(const std::optional<Tensor>& weight, const Tensor& like) {
    if (weight) return at::empty(weight->sizes(), weight->options());
    return at::empty({0}, like.options().dtype(at::kFloat));
  }
};

at::TensorOptions e4m3_like(const Tensor& tensor) {
  return tensor.options().dtype(at::kFloat8_e4m3fn);
}

// ---- the rope ops (boxed) -----------------------------------------------------------------------

/// The forward of qk_norm_rope and qkv_norm_rope (`with_v`: the V norm's v in, v_out out).
void rope_forward(const c10::OperatorHandle& op, Stack* stack, const char* name, bool with_v) {
  BoxedCall call(op, stack);
  const OpArgs args(name);
  const Tensor& qk = call.tensor("qk");
  const c10::DeviceGuard guard(qk.device());
  Tensor v;
  if (with_v) {
    v = call.tensor("v");
    args.expect_dims(v, 3, "v", "[T, Hkv, Dv]");
  }
  const RopeLayout layout = rope_layout(call, args);
  const RopeOutputShapes shapes = rope_output_shapes(args, qk, layout);
  Tensor q = at::empty(shapes.q, qk.options());
  Tensor k = at::empty(shapes.k, qk.options());
  QkNormRopeParams params{.qk = args.view(qk, "qk"),
                          .q = args.view(q, "q"),
                          .k = args.view(k, "k"),
                          .layout = layout,
                          .stream = current_stream(qk),
                          .v = {},       // the V norm's, set below
                          .v_out = {}};
  Tensor v_out;
  if (with_v) {
    v_out = at::empty(v.sizes(), qk.options());
    params.v = args.view(v, "v");
    params.v_out = args.view(v_out, "v_out");
  }
  qkvfuse::qk_norm_rope(params);
  if (with_v) {
    call.finish(std::move(q), std::move(k), std::move(v_out));
  } else {
    call.finish(std::move(q), std::move(k));
  }
}

// qk_norm_rope(Tensor qk, <layout>) -> (Tensor q, Tensor k)
void qk_norm_rope(const c10::OperatorHandle& op, Stack* stack) {
  rope_forward(op, stack, "qk_norm_rope", /*with_v=*/false);
}

// qkv_norm_rope(Tensor qk, Tensor v, <layout>) -> (Tensor q, Tensor k, Tensor v_out): the same
// with the V norm (layout.normalize_v; SPEC.md section 9).
void qkv_norm_rope(const c10::OperatorHandle& op, Stack* stack) {
  rope_forward(op, stack, "qkv_norm_rope", /*with_v=*/true);
}

/// The bf16 backward of qk_norm_rope and qkv_norm_rope (`with_v`: grad_v_out and v in, grad_v
/// out).
void rope_backward(const c10::OperatorHandle& op, Stack* stack, const char* name, bool with_v) {
  BoxedCall call(op, stack);
  const OpArgs args(name);
  const Tensor& qk = call.tensor("qk");
  const c10::DeviceGuard guard(qk.device());
  args.expect_dims(qk, 3, "qk", "[T, Hq + Hkv, D]");
  TensorView grad_v_out;
  Tensor v;
  if (with_v) {
    grad_v_out = input_view(call, args, "grad_v_out");
    v = call.tensor("v");
    args.expect_dims(v, 3, "v", "[T, Hkv, Dv]");
  }
  const RopeLayout layout = rope_layout(call, args);
  Tensor grad_qk = at::empty(qk.sizes(), qk.options());
  WeightGrads weights(call, qk);
  QkNormRopeBackwardParams params{.grad_q = input_view(call, args, "grad_q"),
                                  .grad_k = input_view(call, args, "grad_k"),
                                  .qk = args.view(qk, "qk"),
                                  .grad_qk = args.view(grad_qk, "grad_qk"),
                                  .grad_q_weight = weights.q_view(args, layout),
                                  .grad_k_weight = weights.k_view(args, layout),
                                  .workspace = {},  // sized from these params, below
                                  .layout = layout,
                                  .stream = current_stream(qk),
                                  .grad_v_out = {},  // the V norm's, set below
                                  .v = {},
                                  .grad_v = {}};
  Tensor grad_v;
  if (with_v) {
    grad_v = at::empty(v.sizes(), qk.options());
    params.grad_v_out = grad_v_out;
    params.v = args.view(v, "v");
    params.grad_v = args.view(grad_v, "grad_v");
  }
  params.workspace = weights.workspace_for(args, params, qk);
  qkvfuse::qk_norm_rope_backward(params);
  if (with_v) {
    call.finish(std::move(grad_qk), std::move(grad_v), std::move(weights.q), std::move(weights.k));
  } else {
    call.finish(std::move(grad_qk), std::move(weights.q), std::move(weights.k));
  }
}

// qk_norm_rope_backward(Tensor grad_q, Tensor grad_k, Tensor qk, <layout>)
//   -> (Tensor grad_qk, Tensor grad_q_weight, Tensor grad_k_weight)
void qk_norm_rope_backward(const c10::OperatorHandle& op, Stack* stack) {
  rope_backward(op, stack, "qk_norm_rope_backward", /*with_v=*/false);
}

// qkv_norm_rope_backward(Tensor grad_q, Tensor grad_k, Tensor grad_v_out, Tensor qk, Tensor v,
//                        <layout>) -> (Tensor grad_qk, Tensor grad_v, Tensor grad_q_weight,
//                                      Tensor grad_k_weight)
void qkv_norm_rope_backward(const c10::OperatorHandle& op, Stack* stack) {
  rope_backward(op, stack, "qkv_norm_rope_backward", /*with_v=*/true);
}

// qkv_backward_fp8(Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor qk, Tensor grad_scale,
//                  <layout>, Tensor? v=None) -> (Tensor grad_row, Tensor grad_t,
//                                                Tensor grad_q_weight, Tensor grad_k_weight)
// v: the V norm's saved input (layout.normalize_v).
void qkv_backward_fp8(const c10::OperatorHandle& op, Stack* stack) {
  BoxedCall call(op, stack);
  const OpArgs args("qkv_backward_fp8");
  const Tensor& qk = call.tensor("qk");
  const Tensor& grad_v = call.tensor("grad_v");
  const c10::DeviceGuard guard(qk.device());
  args.expect_dims(qk, 3, "qk", "[T, Hq + Hkv, D]");
  args.expect_dims(grad_v, 3, "grad_v", "[T, Hkv, Dv]");
  const RopeLayout layout = rope_layout(call, args);
  const int64_t tokens = qk.size(0);
  const int64_t features = qkv_dim(layout, qk.size(2), grad_v.size(2));
  Tensor grad_row = at::empty({tokens, features}, e4m3_like(qk));
  Tensor grad_t = at::empty({features, tokens}, e4m3_like(qk));
  WeightGrads weights(call, qk);
  QkvBackwardFp8Params params{.grad_q = input_view(call, args, "grad_q"),
                              .grad_k = input_view(call, args, "grad_k"),
                              .grad_v = args.view(grad_v, "grad_v"),
                              .qk = args.view(qk, "qk"),
                              .grad_scale = input_view(call, args, "grad_scale"),
                              .grad_row = args.view(grad_row, "grad_row"),
                              .grad_t = args.view(grad_t, "grad_t"),
                              .grad_q_weight = weights.q_view(args, layout),
                              .grad_k_weight = weights.k_view(args, layout),
                              .workspace = {},  // sized from these params, below
                              .layout = layout,
                              .stream = current_stream(qk),
                              .v = args.optional_view(call.optional_tensor("v"), "v")};
  params.workspace = weights.workspace_for(args, params, qk);
  qkvfuse::qkv_backward_fp8(params);
  call.finish(std::move(grad_row), std::move(grad_t), std::move(weights.q),
              std::move(weights.k));
}

// packed_qkv_forward(Tensor x_f8, Tensor weight_f8, Tensor x_scale, Tensor weight_scale,
//                    Tensor qkv_scale, int qk_dim, int v_dim, <layout>)
//   -> (Tensor q, Tensor k, Tensor qkv)
// qkv is one flat bf16 buffer of T * qkv_dim holding the GEMM's Q/K columns (saved for the
// backward) and V. Plain layers store it as row-major [T, qkv_dim] so that one GEMM writes both
// column slices; paired layers store [T, (Hq+Hkv)*D] then [T, Hkv*Dv] so that V is dense (two
// GEMMs). With the V norm (layout.normalize_v) T * Hkv * Dv more elements follow: v_out, dense
// [T, Hkv, Dv] (the GEMM's V stays raw, for the backward). python/qkvfuse/_layout.py's
// qkv_views cuts the same views from the returned buffer.
void packed_qkv_forward(const c10::OperatorHandle& op, Stack* stack) {
  BoxedCall call(op, stack);
  const OpArgs args("packed_qkv_forward");
  const Tensor& x_f8 = call.tensor("x_f8");
  const c10::DeviceGuard guard(x_f8.device());
  args.expect_dims(x_f8, 2, "x_f8", "[T, C]");
  const int64_t qk_dim = call.integer("qk_dim");
  const int64_t v_dim = call.integer("v_dim");
  args.expect_positive(qk_dim, "qk_dim");
  args.expect_positive(v_dim, "v_dim");
  const RopeLayout layout = rope_layout(call, args);
  const int64_t tokens = x_f8.size(0);
  const int64_t qk_heads = layout.num_heads + kv_heads(layout);
  const int64_t qk_features = qk_heads * qk_dim;
  const int64_t v_features = kv_heads(layout) * v_dim;
  const auto bf16 = x_f8.options().dtype(at::kBFloat16);
  const int64_t v_out_elements = layout.normalize_v ? tokens * v_features : 0;
  Tensor qkv = at::empty({tokens * (qk_features + v_features) + v_out_elements}, bf16);
  Tensor qk_flat, v_flat;
  if (layout.paired) {
    qk_flat = qkv.narrow(0, 0, tokens * qk_features).view({tokens, qk_features});
    v_flat = qkv.narrow(0, tokens * qk_features, tokens * v_features).view({tokens, v_features});
  } else {
    const Tensor rows =
        qkv.narrow(0, 0, tokens * (qk_features + v_features)).view({tokens, qk_features + v_features});
    qk_flat = rows.narrow(1, 0, qk_features);
    v_flat = rows.narrow(1, qk_features, v_features);
  }
  const Tensor qk = qk_flat.view({tokens, qk_heads, qk_dim});
  const Tensor v = v_flat.view({tokens, kv_heads(layout), v_dim});
  const RopeOutputShapes shapes = rope_output_shapes(args, qk, layout);
  Tensor q = at::empty(shapes.q, bf16);
  Tensor k = at::empty(shapes.k, bf16);
  qkvfuse::packed_qkv_forward(
      {.x_f8 = args.view(x_f8, "x_f8"),
       .weight_f8 = input_view(call, args, "weight_f8"),
       .x_scale = input_view(call, args, "x_scale"),
       .weight_scale = input_view(call, args, "weight_scale"),
       .qkv_scale = input_view(call, args, "qkv_scale"),
       .qk = args.view(qk, "qk"),
       .v = args.view(v, "v"),
       .q = args.view(q, "q"),
       .k = args.view(k, "k"),
       .layout = layout,
       .stream = current_stream(x_f8),
       .v_out = layout.normalize_v
                    ? args.view(qkv.narrow(0, tokens * (qk_features + v_features), v_out_elements)
                                    .view({tokens, kv_heads(layout), v_dim}),
                                "v_out")
                    : TensorView{}});
  call.finish(std::move(q), std::move(k), std::move(qkv));
}

// packed_qkv_backward(Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor qk, Tensor x_f8_t,
//                     Tensor weight_f8_t, Tensor qk_weight, Tensor v_weight, Tensor x_scale,
//                     Tensor weight_scale, Tensor qkv_scale, Tensor grad_scale, <layout>,
//                     Tensor? v=None)
//   -> (Tensor grad_x, Tensor grad_weight, Tensor grad_qkv_scale, Tensor grad_q_weight,
//       Tensor grad_k_weight)
// v: the forward's raw V with the V norm (layout.normalize_v), grad_v then v_out's gradient.
// grad_weight is [qkv_dim, C]: the gradients of qk_weight (its first (Hq+Hkv)*D rows) and
// v_weight (the rest), written by one wgrad GEMM.
void packed_qkv_backward(const c10::OperatorHandle& op, Stack* stack) {
  BoxedCall call(op, stack);
  const OpArgs args("packed_qkv_backward");
  const Tensor& qk = call.tensor("qk");
  const Tensor& x_f8_t = call.tensor("x_f8_t");
  const Tensor& qk_weight = call.tensor("qk_weight");
  const Tensor& v_weight = call.tensor("v_weight");
  const Tensor& qkv_scale = call.tensor("qkv_scale");
  const c10::DeviceGuard guard(qk.device());
  args.expect_dims(qk, 3, "qk", "[T, Hq + Hkv, D]");
  args.expect_dims(x_f8_t, 2, "x_f8_t", "[C, T]");
  args.expect_dims(qk_weight, 2, "qk_weight", "[(Hq+Hkv)*D, C]");
  args.expect_dims(v_weight, 2, "v_weight", "[Hkv*Dv, C]");
  const RopeLayout layout = rope_layout(call, args);
  const TensorView qkv_scale_view = args.view(qkv_scale, "qkv_scale");
  const int64_t tokens = qk.size(0);
  const int64_t channels = x_f8_t.size(0);
  const int64_t qk_features = qk_weight.size(0);
  const int64_t v_features = v_weight.size(0);
  const auto bf16 = qk.options().dtype(at::kBFloat16);
  const auto f32 = qk.options().dtype(at::kFloat);

  Tensor grad_x = at::empty({tokens, channels}, bf16);
  Tensor grad_weight = at::empty({qk_features + v_features, channels}, bf16);
  Tensor grad_qkv_scale = at::empty(qkv_scale.sizes(), f32);
  WeightGrads weights(call, qk);
  // Workspaces: the caching allocator takes them back when the op returns; on CUDA the stream
  // order makes the memory safe to reuse for work queued after this op.
  Tensor grad_row = at::empty({tokens, qk_features + v_features}, e4m3_like(qk));
  Tensor grad_t = at::empty({qk_features + v_features, tokens}, e4m3_like(qk));
  Tensor partials = at::empty({kGradScalePartials}, f32);

  PackedQkvBackwardParams params{
      .grad_q = input_view(call, args, "grad_q"),
      .grad_k = input_view(call, args, "grad_k"),
      .grad_v = input_view(call, args, "grad_v"),
      .qk = args.view(qk, "qk"),
      .x_f8_t = args.view(x_f8_t, "x_f8_t"),
      .weight_f8_t = input_view(call, args, "weight_f8_t"),
      .qk_weight = args.view(qk_weight, "qk_weight"),
      .v_weight = args.view(v_weight, "v_weight"),
      .x_scale = input_view(call, args, "x_scale"),
      .weight_scale = input_view(call, args, "weight_scale"),
      .qkv_scale = qkv_scale_view,
      .grad_scale = input_view(call, args, "grad_scale"),
      .grad_row = args.view(grad_row, "grad_row"),
      .grad_t = args.view(grad_t, "grad_t"),
      .partials = args.view(partials, "partials"),
      .grad_q_weight = weights.q_view(args, layout),
      .grad_k_weight = weights.k_view(args, layout),
      .rope_workspace = {},  // sized from these params, below
      .grad_x = args.view(grad_x, "grad_x"),
      .grad_qk_weight = args.view(grad_weight.narrow(0, 0, qk_features), "grad_qk_weight"),
      .grad_v_weight = args.view(grad_weight.narrow(0, qk_features, v_features), "grad_v_weight"),
      .grad_qkv_scale = args.view(grad_qkv_scale, "grad_qkv_scale"),
      .layout = layout,
      .stream = current_stream(qk),
      .v = args.optional_view(call.optional_tensor("v"), "v")};
  params.rope_workspace = weights.workspace_for(args, params, qk);
  qkvfuse::packed_qkv_backward(params);
  if (tokens == 0) {
    // The library writes no projection gradient at T = 0; a sum over no tokens is 0.
    grad_weight.zero_();
    grad_qkv_scale.zero_();
  }
  call.finish(std::move(grad_x), std::move(grad_weight), std::move(grad_qkv_scale),
              std::move(weights.q), std::move(weights.k));
}

void check_positions(const Tensor& positions, int64_t num_positions) {
  python_errors([&] {
    const OpArgs args("check_positions");
    const c10::DeviceGuard guard(positions.device());
    qkvfuse::check_positions(args.view(positions, "positions"), num_positions,
                             current_stream(positions));
  });
}

// ---- the FP8 producers (unboxed) ----------------------------------------------------------------

// The e4m3 outputs of a dual-layout quantize of src [M, N] or [B, M, N]: row (src's shape) and t
// (the last two dims swapped).
std::tuple<Tensor, Tensor> alloc_dual_layout(const OpArgs& args, const Tensor& src) {
  args.expect_dims(src, src.dim() == 3 ? 3 : 2, "src", "[M, N] or [B, M, N]");
  auto t_shape = src.sizes().vec();
  std::swap(t_shape[t_shape.size() - 1], t_shape[t_shape.size() - 2]);
  return {at::empty(src.sizes(), e4m3_like(src)), at::empty(t_shape, e4m3_like(src))};
}

// amax (nullopt for none) has scale's shape: [] or [1] for one matrix, [B] for a batch. An empty
// src leaves the library's outputs unwritten (a no-op there): the amax of no elements is returned
// as 0 here, the value an all-zero source gives, rather than uninitialized memory.
std::tuple<Tensor, Tensor, std::optional<Tensor>> run_quantize_dual(const char* op,
                                                                     const Tensor& src,
                                                                     const Tensor& scale,
                                                                     bool with_amax) {
  const OpArgs args(op);
  const c10::DeviceGuard guard(src.device());
  auto [row, t] = alloc_dual_layout(args, src);
  std::optional<Tensor> amax;
  if (with_amax) {
    const auto f32 = src.options().dtype(at::kFloat);
    amax = src.numel() == 0 ? at::zeros(scale.sizes(), f32) : at::empty(scale.sizes(), f32);
  }
  qkvfuse::quantize_dual_layout({.src = args.view(src, "src"),
                                 .scale = args.view(scale, "scale"),
                                 .row = args.view(row, "row"),
                                 .t = args.view(t, "t"),
                                 .amax = args.optional_view(amax, "amax"),
                                 .stream = current_stream(src)});
  return {row, t, amax};
}

// The library calls the source `src`; the Python functions call it `x` (and `weights` below).
std::tuple<Tensor, Tensor> quantize_dual_layout(const Tensor& x, const Tensor& scale) {
  return python_errors(
      [&]() -> std::tuple<Tensor, Tensor> {
        auto [row, t, amax] = run_quantize_dual("quantize_dual_layout", x, scale, false);
        return {row, t};
      },
      {{"src", "x"}});
}

std::tuple<Tensor, Tensor, Tensor> quantize_dual_layout_amax(const Tensor& x, const Tensor& scale) {
  return python_errors(
      [&]() -> std::tuple<Tensor, Tensor, Tensor> {
        auto [row, t, amax] = run_quantize_dual("quantize_dual_layout", x, scale, true);
        return {row, t, *amax};
      },
      {{"src", "x"}});
}

std::tuple<Tensor, Tensor, Tensor> quantize_weight_bank(const Tensor& weights) {
  return python_errors(
      [&]() -> std::tuple<Tensor, Tensor, Tensor> {
        const OpArgs args("quantize_weight_bank");
        const c10::DeviceGuard guard(weights.device());
        args.expect_dims(weights, 3, "src", "[B, M, N]");
        auto [row, t] = alloc_dual_layout(args, weights);
        // Empty entries get scale 1, as all-zero ones do (the library writes nothing for an
        // empty src).
        const auto f32 = weights.options().dtype(at::kFloat);
        Tensor scale = weights.numel() == 0 ? at::ones({weights.size(0)}, f32)
                                            : at::empty({weights.size(0)}, f32);
        qkvfuse::quantize_weight_bank({.src = args.view(weights, "src"),
                                       .scale = args.view(scale, "scale"),
                                       .row = args.view(row, "row"),
                                       .t = args.view(t, "t"),
                                       .stream = current_stream(weights)});
        return {row, t, scale};
      },
      {{"src", "weights"}});
}

Tensor fp8_gemm(const Tensor& a, const Tensor& b, const Tensor& scale_a, const Tensor& scale_b,
                const std::optional<Tensor>& alpha, bool fast_accum) {
  return python_errors([&] {
    const OpArgs args("fp8_gemm");
    const c10::DeviceGuard guard(a.device());
    args.expect_dims(a, 2, "a", "[M, K]");
    args.expect_dims(b, 2, "b", "[N, K]");
    Tensor d = at::empty({a.size(0), b.size(0)}, a.options().dtype(at::kBFloat16));
    qkvfuse::fp8_gemm({.a = args.view(a, "a"),
                       .b = args.view(b, "b"),
                       .scale_a = args.view(scale_a, "scale_a"),
                       .scale_b = args.view(scale_b, "scale_b"),
                       .alpha = args.optional_view(alpha, "alpha"),
                       .d = args.view(d, "d"),
                       .fast_accum = fast_accum,
                       .stream = current_stream(a)});
    return d;
  });
}

// ---- registration -------------------------------------------------------------------------------

// The ops whose Autograd kernel is run_without_gradient (autograd.hpp): the FP8 producers, the
// backward ops, the packed forward (whose gradient python/qkvfuse/packed.py defines around it) and
// check_positions. (qk_norm_rope's and qkv_norm_rope's Autograd kernel is rope_autograd.)
constexpr const char* kOpsWithoutGradient[] = {
    "qk_norm_rope_backward", "qkv_norm_rope_backward", "qkv_backward_fp8", "quantize_dual_layout",
    "quantize_dual_layout_amax", "quantize_weight_bank", "fp8_gemm",
    "packed_qkv_forward",    "packed_qkv_backward",  "check_positions",
};

template <void (*kernel)(const c10::OperatorHandle&, Stack*)>
void boxed_for_python(const c10::OperatorHandle& op, Stack* stack) {
  python_errors([&] { kernel(op, stack); });
}

/// A boxed kernel whose errors Python sees in its own terms (errors.hpp).
template <void (*kernel)(const c10::OperatorHandle&, Stack*)>
torch::CppFunction boxed() {
  return torch::CppFunction::makeFromBoxedFunction<&boxed_for_python<kernel>>();
}

void register_kernels(torch::Library& m) {
  m.impl("qk_norm_rope", boxed<&qk_norm_rope>());
  m.impl("qk_norm_rope_backward", boxed<&qk_norm_rope_backward>());
  m.impl("qkv_norm_rope", boxed<&qkv_norm_rope>());
  m.impl("qkv_norm_rope_backward", boxed<&qkv_norm_rope_backward>());
  m.impl("qkv_backward_fp8", boxed<&qkv_backward_fp8>());
  m.impl("packed_qkv_forward", boxed<&packed_qkv_forward>());
  m.impl("packed_qkv_backward", boxed<&packed_qkv_backward>());
  m.impl("check_positions", &check_positions);
  m.impl("quantize_dual_layout", &quantize_dual_layout);
  m.impl("quantize_dual_layout_amax", &quantize_dual_layout_amax);
  m.impl("quantize_weight_bank", &quantize_weight_bank);
  m.impl("fp8_gemm", &fp8_gemm);
}

void define_ops(torch::Library& m) {
  // Tells torch where the fake kernels are registered, so it can name the module to import.
  m.set_python_module("qkvfuse._fake");
  // pt2_compliant_tag: each op has a fake kernel (python/qkvfuse/_fake.py) and passes
  // torch.library.opcheck.
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  // Argument names match the Python package and the C++ params structs.
  const std::string rope_ops[] = {
      rope_schema("qk_norm_rope", "Tensor qk", "(Tensor q, Tensor k)"),
      rope_schema("qk_norm_rope_backward", "Tensor grad_q, Tensor grad_k, Tensor qk",
                  "(Tensor grad_qk, Tensor grad_q_weight, Tensor grad_k_weight)"),
      rope_schema("qkv_norm_rope", "Tensor qk, Tensor v", "(Tensor q, Tensor k, Tensor v_out)"),
      rope_schema("qkv_norm_rope_backward",
                  "Tensor grad_q, Tensor grad_k, Tensor grad_v_out, Tensor qk, Tensor v",
                  "(Tensor grad_qk, Tensor grad_v, Tensor grad_q_weight, Tensor grad_k_weight)"),
      rope_schema("qkv_backward_fp8",
                  "Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor qk, Tensor grad_scale",
                  "(Tensor grad_row, Tensor grad_t, Tensor grad_q_weight, Tensor grad_k_weight)",
                  "Tensor? v=None"),
      rope_schema("packed_qkv_forward",
                  "Tensor x_f8, Tensor weight_f8, Tensor x_scale, Tensor weight_scale, "
                  "Tensor qkv_scale, int qk_dim, int v_dim",
                  "(Tensor q, Tensor k, Tensor qkv)"),
      rope_schema("packed_qkv_backward",
                  "Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor qk, Tensor x_f8_t, "
                  "Tensor weight_f8_t, Tensor qk_weight, Tensor v_weight, Tensor x_scale, "
                  "Tensor weight_scale, Tensor qkv_scale, Tensor grad_scale",
                  "(Tensor grad_x, Tensor grad_weight, Tensor grad_qkv_scale, "
                  "Tensor grad_q_weight, Tensor grad_k_weight)",
                  "Tensor? v=None"),
  };
  for (const std::string& schema : rope_ops) m.def(schema.c_str(), tags);
  m.def("check_positions(Tensor positions, int num_positions) -> ()", tags);
  m.def("quantize_dual_layout(Tensor x, Tensor scale) -> (Tensor row, Tensor t)", tags);
  m.def("quantize_dual_layout_amax(Tensor x, Tensor scale) -> (Tensor row, Tensor t, Tensor amax)",
        tags);
  m.def("quantize_weight_bank(Tensor weights) -> (Tensor row, Tensor t, Tensor scale)", tags);
  m.def("fp8_gemm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, Tensor? alpha=None, "
        "bool fast_accum=False) -> Tensor",
        tags);
}

}  // namespace
}  // namespace qkvfuse::torch_binding

TORCH_LIBRARY(qkvfuse, m) { qkvfuse::torch_binding::define_ops(m); }
TORCH_LIBRARY_IMPL(qkvfuse, CPU, m) { qkvfuse::torch_binding::register_kernels(m); }
TORCH_LIBRARY_IMPL(qkvfuse, CUDA, m) { qkvfuse::torch_binding::register_kernels(m); }
TORCH_LIBRARY_IMPL(qkvfuse, Autograd, m) {
  for (const char* name : {"qk_norm_rope", "qkv_norm_rope"}) {
    m.impl(name,
           torch::CppFunction::makeFromBoxedFunction<&qkvfuse::torch_binding::rope_autograd>());
  }
  for (const char* name : qkvfuse::torch_binding::kOpsWithoutGradient) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<
                     &qkvfuse::torch_binding::run_without_gradient>());
  }
}
