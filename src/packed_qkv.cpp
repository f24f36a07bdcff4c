// packed_qkv.cpp: the packed FP8 QKV projection (SPEC.md section 6), composed from the public ops,
// so it runs unchanged on either backend.
//
// Forward:   qkv  = fp8_gemm(x_f8, weight_f8; scale_a = x_scale, scale_b = weight_scale,
//                            alpha = qkv_scale, fast accumulation)  -> qk [T, 2HD], v [T, HDv]
//            q, k = qk_norm_rope(qk)       (qk is also the backward's saved input)
// Backward:  grad_row, grad_t = qkv_backward_fp8(grad_q, grad_k, grad_v)
//            grad_weight      = fp8_gemm(grad_t, x_f8_t; grad_scale, x_scale)      (unscaled)
//            grad_x           = fp8_gemm(grad_row, weight_f8_t; grad_scale, weight_scale,
//                                        alpha = qkv_scale)
//            grad_weight_finalize: grad_qkv_scale = sum(grad_weight * weight),
//                                  grad_weight *= qkv_scale
// (the norm weights' gradients come from the qkv_backward_fp8 step).
// The three scale factors go to the GEMM as scale_a, scale_b and alpha, so no kernel has to
// multiply scales on the device first.
//
// One GEMM writes two outputs when they are adjacent in memory (qk and v as column slices of one
// [T, qkv_dim] buffer; grad_qk_weight and grad_v_weight as row slices of one [qkv_dim, C] buffer),
// otherwise one GEMM per output over the matching rows of the other operand. Sub-views are made
// by moving data pointers and sizes. Every argument, and every step's own arguments, are
// validated before the first launch: a bad call throws without having written anything.
#include "qkvfuse/packed_qkv.hpp"

#include <string>
#include <vector>

#include "backend.hpp"
#include "qkvfuse/error.hpp"
#include "qkvfuse/fp8_gemm.hpp"
#include "qkvfuse/qkv_backward_fp8.hpp"
#include "validate.hpp"

namespace qkvfuse {
namespace {

using validate::Arg;
using validate::Checker;
using validate::Dim;

// ---- sub-views ---------------------------------------------------------------------------------

char* byte_pointer(const TensorView& view) { return static_cast<char*>(view.data); }
int64_t element_bytes(const TensorView& view) { return int64_t(dtype_size(view.dtype)); }

/// Rows [first, first + count) of a 2-D view.
TensorView row_slice(TensorView view, int64_t first, int64_t count) {
  view.data = byte_pointer(view) + first * view.strides[0] * element_bytes(view);
  view.sizes[0] = count;
  return view;
}

/// A [T, heads, width] view whose heads are packed in each row, as the [T, heads * width] matrix
/// the GEMM writes.
TensorView heads_as_matrix(const TensorView& view) {
  TensorView matrix = view;
  matrix.ndim = 2;
  matrix.sizes[1] = view.sizes[1] * view.sizes[2];
  matrix.strides[1] = 1;
  matrix.sizes[2] = 0;
  matrix.strides[2] = 0;
  return matrix;
}

/// True when `right`'s columns directly follow `left`'s in the same rows of one buffer.
bool adjacent_columns(const TensorView& left, const TensorView& right) {
  return left.strides[0] == right.strides[0] &&
         byte_pointer(right) == byte_pointer(left) + left.sizes[1] * element_bytes(left);
}

/// True when contiguous `lower`'s rows directly follow contiguous `upper`'s in memory.
bool adjacent_rows(const TensorView& upper, const TensorView& lower) {
  return byte_pointer(lower) == byte_pointer(upper) + upper.numel() * element_bytes(upper);
}

/// The GEMMs writing two output parts: one GEMM into `joined` when the parts are adjacent in
/// memory, otherwise one per part, over rows [0, split) and [split, end) of operand a
/// (`slice_a`) or operand b.
std::vector<Fp8GemmParams> split_gemm(const Fp8GemmParams& whole, bool slice_a, int64_t split,
                                      const TensorView& first, const TensorView& second,
                                      bool adjacent, const TensorView& joined) {
  if (adjacent) {
    Fp8GemmParams gemm = whole;
    gemm.d = joined;
    return {gemm};
  }
  const TensorView& operand = slice_a ? whole.a : whole.b;
  Fp8GemmParams upper = whole;
  Fp8GemmParams lower = whole;
  (slice_a ? upper.a : upper.b) = row_slice(operand, 0, split);
  (slice_a ? lower.a : lower.b) = row_slice(operand, split, operand.sizes[0] - split);
  upper.d = first;
  lower.d = second;
  return {upper, lower};
}

/// The sizes both packed ops derive from their arguments.
struct PackedDims {
  int64_t tokens;       ///< T
  int64_t channels;     ///< C
  int64_t q_heads;      ///< Hq
  int64_t kv_heads;     ///< Hkv
  int64_t head_dim;     ///< D
  int64_t v_dim;        ///< Dv
  int64_t qk_features;  ///< (Hq + Hkv) * D
  int64_t qkv_dim;      ///< (Hq + Hkv) * D + Hkv * Dv
};

std::string qkv_dim_why(const PackedDims& dims) {
  return "(qkv_dim = (Hq + Hkv)*D + Hkv*Dv = " + std::to_string(dims.qkv_dim) + ")";
}

/// Hq, Hkv and the Q/K feature count, once D and the layout are known.
void set_heads(PackedDims& dims, const RopeLayout& layout) {
  dims.q_heads = layout.num_heads;
  dims.kv_heads = kv_heads(layout);
  dims.qk_features = (dims.q_heads + dims.kv_heads) * dims.head_dim;
}

std::string heads_why(const PackedDims& dims) {
  return "(num_heads + num_kv_heads = " + std::to_string(dims.q_heads + dims.kv_heads) +
         " heads)";
}

void check_scalars(const Checker& check, const std::vector<Arg>& scalars, Device device) {
  for (const Arg& scalar : scalars) {
    check.scalar_f32(scalar.view, scalar.name);
    check.aligned(scalar.view, scalar.name, device);
  }
}

// ---- forward -----------------------------------------------------------------------------------

/// Checks a [T, heads, width] GEMM output whose heads are packed in each row.
void check_packed_heads(const Checker& check, const TensorView& view, const char* name,
                        std::initializer_list<Dim> shape, const std::string& why) {
  check.dtype(view, name, DType::kBFloat16);
  check.shape(view, name, shape, why);
  check.last_dim_contiguous(view, name);
  QKVF_CHECK(view.sizes[1] <= 1 || view.strides[1] == view.sizes[2], check.op(), ": ", name,
             ": expected its heads packed in each row (head stride ", view.sizes[2],
             "), as the GEMM writes them, got ", view.describe());
  // Checked here so that the message names this argument, not the GEMM step's output d.
  const int64_t row = view.sizes[1] * view.sizes[2];
  QKVF_CHECK(view.sizes[0] <= 1 || view.strides[0] >= row, check.op(), ": ", name,
             ": expected a token stride >= its ", row, " elements per token (heads x width), got ",
             view.describe());
}

/// The forward's own arguments (the layout's tensors, q and k are the qk_norm_rope step's).
PackedDims check_forward_args(const Checker& check, const PackedQkvForwardParams& p,
                              Device device) {
  PackedDims dims{};
  check.dtype(p.x_f8, "x_f8", DType::kFloat8E4M3);
  check.ndim(p.x_f8, "x_f8", 2);
  check.row_major(p.x_f8, "x_f8");
  dims.tokens = p.x_f8.sizes[0];
  dims.channels = p.x_f8.sizes[1];

  check.ndim(p.qk, "qk", 3);
  dims.head_dim = p.qk.sizes[2];
  check.rope_options(p.layout, dims.head_dim);
  set_heads(dims, p.layout);
  check_packed_heads(check, p.qk, "qk",
                     {dims.tokens, dims.q_heads + dims.kv_heads, dims.head_dim},
                     "(T from x_f8) " + heads_why(dims));
  check_packed_heads(check, p.v, "v", {dims.tokens, dims.kv_heads, Dim::any("Dv")},
                     "(T from x_f8, num_kv_heads)");
  dims.v_dim = p.v.sizes[2];
  QKVF_CHECK(dims.v_dim >= 1, check.op(), ": v: expected a V head width Dv >= 1, got ",
             p.v.describe());
  dims.qkv_dim = qkv_dim(p.layout, dims.head_dim, dims.v_dim);

  check.dtype(p.weight_f8, "weight_f8", DType::kFloat8E4M3);
  check.shape(p.weight_f8, "weight_f8", {dims.qkv_dim, dims.channels},
              qkv_dim_why(dims) + " (C from x_f8)");
  check.row_major(p.weight_f8, "weight_f8");
  check_scalars(
      check, {{p.x_scale, "x_scale"}, {p.weight_scale, "weight_scale"}, {p.qkv_scale, "qkv_scale"}},
      device);
  return dims;
}

struct ForwardPlan {
  std::vector<Fp8GemmParams> gemms;
  QkNormRopeParams rope;
};

ForwardPlan plan_forward(const PackedQkvForwardParams& p) {
  const Checker check("packed_qkv_forward");
  check.not_pending_on_cuda(p.layout, p.qk);
  const std::vector<Arg> inputs = validate::concat({{p.x_f8, "x_f8"},
                                                    {p.weight_f8, "weight_f8"},
                                                    {p.x_scale, "x_scale"},
                                                    {p.weight_scale, "weight_scale"},
                                                    {p.qkv_scale, "qkv_scale"}},
                                                   validate::rope_tensor_args(p.layout));
  const std::vector<Arg> outputs = {
      {p.qk, "qk"}, {p.v, "v"}, {p.q, "q"}, {p.k, "k"}, {p.v_out, "v_out", true}};
  const Device device = check.same_device(validate::concat(inputs, outputs));
  const PackedDims dims = check_forward_args(check, p, device);
  check.no_overlap(outputs, inputs);

  Fp8GemmParams whole;
  whole.a = p.x_f8;
  whole.b = p.weight_f8;
  whole.scale_a = p.x_scale;
  whole.scale_b = p.weight_scale;
  whole.alpha = p.qkv_scale;
  whole.fast_accum = true;
  whole.stream = p.stream;
  const TensorView qk_matrix = heads_as_matrix(p.qk);
  const TensorView v_matrix = heads_as_matrix(p.v);
  TensorView qkv_matrix = qk_matrix;
  qkv_matrix.sizes[1] = dims.qkv_dim;

  ForwardPlan plan;
  if (dims.kv_heads * dims.v_dim == 0) {
    // query_only: the weight has the Q rows alone, and one GEMM writes qk.
    Fp8GemmParams gemm = whole;
    gemm.d = qk_matrix;
    plan.gemms = {gemm};
  } else {
    plan.gemms = split_gemm(whole, /*slice_a=*/false, dims.qk_features, qk_matrix, v_matrix,
                            adjacent_columns(qk_matrix, v_matrix), qkv_matrix);
  }
  for (const Fp8GemmParams& gemm : plan.gemms) {
    validate::validate_fp8_gemm(gemm, check.op() + ": QKV GEMM x_f8 @ weight_f8^T");
  }
  // With the V norm, the GEMM's raw V (kept for the backward) is normalized into v_out.
  plan.rope = {.qk = p.qk,
               .q = p.q,
               .k = p.k,
               .layout = p.layout,
               .stream = p.stream,
               .v = p.layout.normalize_v ? p.v : TensorView{},
               .v_out = p.v_out};
  validate::validate_qk_norm_rope(plan.rope, check.op() + ": qk_norm_rope");
  return plan;
}

// ---- backward ----------------------------------------------------------------------------------

/// The backward's own arguments (grad_q, grad_k, the layout, grad_row, grad_t and the norm
/// weights' gradients are also the qkv_backward_fp8 step's).
PackedDims check_backward_args(const Checker& check, const PackedQkvBackwardParams& p,
                               Device device) {
  PackedDims dims{};
  check.dtype(p.qk, "qk", DType::kBFloat16);
  check.ndim(p.qk, "qk", 3);
  dims.tokens = p.qk.sizes[0];
  dims.head_dim = p.qk.sizes[2];
  check.rope_options(p.layout, dims.head_dim);
  set_heads(dims, p.layout);
  check.shape(p.qk, "qk", {Dim::any("T"), dims.q_heads + dims.kv_heads, dims.head_dim},
              heads_why(dims));
  check.dtype(p.grad_v, "grad_v", DType::kBFloat16);
  check.shape(p.grad_v, "grad_v", {dims.tokens, dims.kv_heads, Dim::any("Dv")},
              "(T from qk, num_kv_heads)");
  dims.v_dim = p.grad_v.sizes[2];
  dims.qkv_dim = qkv_dim(p.layout, dims.head_dim, dims.v_dim);

  check.dtype(p.x_f8_t, "x_f8_t", DType::kFloat8E4M3);
  check.shape(p.x_f8_t, "x_f8_t", {Dim::any("C"), dims.tokens}, "(T from qk)");
  check.row_major(p.x_f8_t, "x_f8_t");
  dims.channels = p.x_f8_t.sizes[0];
  check.dtype(p.weight_f8_t, "weight_f8_t", DType::kFloat8E4M3);
  check.shape(p.weight_f8_t, "weight_f8_t", {dims.channels, dims.qkv_dim},
              "(C from x_f8_t) " + qkv_dim_why(dims));
  check.row_major(p.weight_f8_t, "weight_f8_t");

  // The master weights and their gradients: bf16 [rows, C], row-major contiguous.
  const auto check_weight = [&](const TensorView& view, const char* name, int64_t rows,
                                const char* why) {
    check.dtype(view, name, DType::kBFloat16);
    check.shape(view, name, {rows, dims.channels}, std::string(why) + " (C from x_f8_t)");
    check.contiguous(view, name);
    check.aligned(view, name, device);
  };
  check_weight(p.qk_weight, "qk_weight", dims.qk_features, "([(Hq+Hkv)*D, C])");
  check_weight(p.grad_qk_weight, "grad_qk_weight", dims.qk_features, "([(Hq+Hkv)*D, C])");
  check_weight(p.v_weight, "v_weight", dims.kv_heads * dims.v_dim, "([Hkv*Dv, C])");
  check_weight(p.grad_v_weight, "grad_v_weight", dims.kv_heads * dims.v_dim, "([Hkv*Dv, C])");
  // The V norm's saved input is checked with the qkv_backward_fp8 step, under that step's name;
  // its presence is the packed op's own rule.
  QKVF_CHECK(p.layout.normalize_v == !is_absent(p.v), check.op(), ": v: ",
             p.layout.normalize_v ? "missing (layout.normalize_v: the forward's raw V)"
                                  : "given, but layout.normalize_v is false");

  check_scalars(check,
                {{p.x_scale, "x_scale"},
                 {p.weight_scale, "weight_scale"},
                 {p.qkv_scale, "qkv_scale"},
                 {p.grad_scale, "grad_scale"},
                 {p.grad_qkv_scale, "grad_qkv_scale"}},
                device);
  // The layout's tensors, then the norm weights' gradients and their workspace under the packed
  // op's own names (the qkv_backward_fp8 step calls the workspace `workspace`).
  const validate::RopeShape shape =
      validate::rope_inputs(check, p.qk, p.layout, device, /*wide_qk_on_cpu=*/false);
  validate::rope_weight_grads(check, p.layout, shape, {p.grad_q_weight, "grad_q_weight", true},
                              {p.grad_k_weight, "grad_k_weight", true},
                              {p.rope_workspace, "rope_workspace", true},
                              backward_workspace_size(p));
  check.dtype(p.partials, "partials", DType::kFloat32);
  check.shape(p.partials, "partials", {kGradScalePartials}, "(kGradScalePartials)");
  check.contiguous(p.partials, "partials");
  check.aligned(p.partials, "partials", device);
  check.dtype(p.grad_x, "grad_x", DType::kBFloat16);
  check.shape(p.grad_x, "grad_x", {dims.tokens, dims.channels}, "(T from qk, C from x_f8_t)");
  check.row_major(p.grad_x, "grad_x");
  return dims;
}

/// The qkv_backward_fp8 step of the backward.
QkvBackwardFp8Params fp8_step(const PackedQkvBackwardParams& p) {
  return {.grad_q = p.grad_q,
          .grad_k = p.grad_k,
          .grad_v = p.grad_v,
          .qk = p.qk,
          .grad_scale = p.grad_scale,
          .grad_row = p.grad_row,
          .grad_t = p.grad_t,
          .grad_q_weight = p.grad_q_weight,
          .grad_k_weight = p.grad_k_weight,
          .workspace = p.rope_workspace,
          .layout = p.layout,
          .stream = p.stream,
          .v = p.v};
}

struct BackwardPlan {
  QkvBackwardFp8Params grad;
  std::vector<Fp8GemmParams> wgrad;
  Fp8GemmParams dgrad;
  GradWeightFinalizeParams finalize;
  Device device;
};

BackwardPlan plan_backward(const PackedQkvBackwardParams& p) {
  const Checker check("packed_qkv_backward");
  check.not_pending_on_cuda(p.layout, p.qk);
  const std::vector<Arg> inputs =
      validate::concat({{p.grad_q, "grad_q"},       {p.grad_k, "grad_k"},
                        {p.grad_v, "grad_v"},       {p.qk, "qk"},
                        {p.x_f8_t, "x_f8_t"},       {p.weight_f8_t, "weight_f8_t"},
                        {p.qk_weight, "qk_weight"}, {p.v_weight, "v_weight"},
                        {p.x_scale, "x_scale"},     {p.weight_scale, "weight_scale"},
                        {p.qkv_scale, "qkv_scale"}, {p.grad_scale, "grad_scale"},
                        {p.v, "v", true}},
                       validate::rope_tensor_args(p.layout));
  const std::vector<Arg> outputs = {{p.grad_row, "grad_row"},
                                    {p.grad_t, "grad_t"},
                                    {p.partials, "partials"},
                                    {p.grad_q_weight, "grad_q_weight", true},
                                    {p.grad_k_weight, "grad_k_weight", true},
                                    {p.rope_workspace, "rope_workspace", true},
                                    {p.grad_x, "grad_x"},
                                    {p.grad_qk_weight, "grad_qk_weight"},
                                    {p.grad_v_weight, "grad_v_weight"},
                                    {p.grad_qkv_scale, "grad_qkv_scale"}};
  BackwardPlan plan;
  plan.device = check.same_device(validate::concat(inputs, outputs));
  const PackedDims dims = check_backward_args(check, p, plan.device);
  check.no_overlap(outputs, inputs);

  plan.grad = fp8_step(p);
  validate::validate_qkv_backward_fp8(plan.grad, check.op() + ": qkv_backward_fp8");

  // wgrad: [qkv_dim, T] x [C, T] -> [qkv_dim, C], left unscaled by qkv_scale for the reduction.
  Fp8GemmParams wgrad;
  wgrad.a = p.grad_t;
  wgrad.b = p.x_f8_t;
  wgrad.scale_a = p.grad_scale;
  wgrad.scale_b = p.x_scale;
  wgrad.fast_accum = false;
  wgrad.stream = p.stream;
  TensorView grad_weight = p.grad_qk_weight;
  grad_weight.sizes[0] = dims.qkv_dim;
  if (dims.kv_heads * dims.v_dim == 0) {
    // query_only: no V rows, one GEMM into grad_qk_weight.
    wgrad.d = p.grad_qk_weight;
    plan.wgrad = {wgrad};
  } else {
    plan.wgrad =
        split_gemm(wgrad, /*slice_a=*/true, dims.qk_features, p.grad_qk_weight, p.grad_v_weight,
                   adjacent_rows(p.grad_qk_weight, p.grad_v_weight), grad_weight);
  }
  // Its K is T: cuBLASLt takes no K = 0, and at T = 0 the op runs nothing (no-op), so the wgrad
  // is validated only when it will run.
  if (dims.tokens > 0) {
    for (const Fp8GemmParams& gemm : plan.wgrad) {
      validate::validate_fp8_gemm(gemm, check.op() + ": wgrad GEMM grad_t @ x_f8_t^T");
    }
  }

  // dgrad: [T, qkv_dim] x [C, qkv_dim] -> [T, C].
  plan.dgrad.a = p.grad_row;
  plan.dgrad.b = p.weight_f8_t;
  plan.dgrad.scale_a = p.grad_scale;
  plan.dgrad.scale_b = p.weight_scale;
  plan.dgrad.alpha = p.qkv_scale;
  plan.dgrad.d = p.grad_x;
  plan.dgrad.fast_accum = false;
  plan.dgrad.stream = p.stream;
  validate::validate_fp8_gemm(plan.dgrad, check.op() + ": dgrad GEMM grad_row @ weight_f8_t^T");

  plan.finalize = {p.grad_qk_weight, p.grad_v_weight, p.qk_weight,      p.v_weight,
                   p.qkv_scale,      p.partials,      p.grad_qkv_scale, p.stream};
  return plan;
}

}  // namespace

// The plans are validated as a whole, every step included, before anything runs; the steps then
// go straight to the backend of the tensors' device. (Through the public entry points each step
// would validate its tensors again, a CUDA pointer lookup per tensor, on the host's hot path.)
void packed_qkv_forward(const PackedQkvForwardParams& params) {
  const ForwardPlan plan = plan_forward(params);
  if (params.x_f8.sizes[0] == 0) return;  // T = 0: nothing to compute
  validate::check_positions_if_asked(params.layout, params.stream);
  if (params.x_f8.device.type == DeviceType::kCUDA) {
    for (const Fp8GemmParams& gemm : plan.gemms) cuda::fp8_gemm(gemm);
    cuda::qk_norm_rope(plan.rope);
  } else {
    for (const Fp8GemmParams& gemm : plan.gemms) cpu::fp8_gemm(gemm);
    cpu::qk_norm_rope(plan.rope);
  }
}

// At T = 0 only the norm weights' gradients are written (zeros, by the qkv_backward_fp8 step).
void packed_qkv_backward(const PackedQkvBackwardParams& params) {
  const BackwardPlan plan = plan_backward(params);
  validate::check_positions_if_asked(params.layout, params.stream);
  if (params.qk.sizes[0] == 0) {
    if (plan.device.type == DeviceType::kCUDA) {
      cuda::qkv_backward_fp8(plan.grad);
    } else {
      cpu::qkv_backward_fp8(plan.grad);
    }
    return;
  }
  if (plan.device.type == DeviceType::kCUDA) {
    cuda::qkv_backward_fp8(plan.grad);
    for (const Fp8GemmParams& gemm : plan.wgrad) cuda::fp8_gemm(gemm);
    cuda::fp8_gemm(plan.dgrad);
    cuda::grad_weight_finalize(plan.finalize);
  } else {
    cpu::qkv_backward_fp8(plan.grad);
    for (const Fp8GemmParams& gemm : plan.wgrad) cpu::fp8_gemm(gemm);
    cpu::fp8_gemm(plan.dgrad);
    cpu::grad_weight_finalize(plan.finalize);
  }
}

int64_t backward_workspace_size(const PackedQkvBackwardParams& params) {
  return backward_workspace_size(fp8_step(params));
}

}  // namespace qkvfuse
