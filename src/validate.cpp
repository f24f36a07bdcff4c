// validate.cpp: the argument checks shared by the public entry points (see validate.hpp).
#include "validate.hpp"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "qkvfuse/error.hpp"
#include "rope_math.hpp"

namespace qkvfuse::validate {
namespace {

bool skipped(const Arg& arg) { return arg.optional && is_absent(arg.view); }

std::string dims_text(const TensorView& view) {
  std::string out = "[";
  for (int d = 0; d < view.ndim; ++d) out += (d ? ", " : "") + std::to_string(view.sizes[d]);
  return out + "]";
}

std::string expected_dims_text(std::initializer_list<Dim> expected) {
  std::string out = "[";
  bool first = true;
  for (const Dim& dim : expected) {
    out += first ? "" : ", ";
    out += dim.size < 0 ? std::string(dim.label) : std::to_string(dim.size);
    first = false;
  }
  return out + "]";
}

/// "bfloat16 or float32", listing each dtype once.
std::string dtypes_text(std::initializer_list<DType> dtypes) {
  std::vector<DType> unique;
  for (DType dtype : dtypes) {
    bool seen = false;
    for (DType u : unique) seen = seen || u == dtype;
    if (!seen) unique.push_back(dtype);
  }
  std::string text;
  for (size_t i = 0; i < unique.size(); ++i) {
    if (i) text += (i + 1 == unique.size()) ? " or " : ", ";
    text += dtype_name(unique[i]);
  }
  return text;
}

/// The widest vector (a power of two up to 16 bytes) that tiles one row of the view.
int64_t row_vector_bytes(const TensorView& view) {
  const int64_t element = int64_t(dtype_size(view.dtype));
  const int64_t row_bytes = view.ndim ? view.sizes[view.ndim - 1] * element : element;
  int64_t width = 16;
  while (width > element && row_bytes % width != 0) width /= 2;
  return width;
}

}  // namespace

std::vector<Arg> concat(const std::vector<Arg>& first, const std::vector<Arg>& second) {
  std::vector<Arg> all;
  all.reserve(first.size() + second.size());
  for (const Arg& arg : first) all.push_back(arg);
  for (const Arg& arg : second) all.push_back(arg);
  return all;
}

Device Checker::same_device(const std::vector<Arg>& args) const {
  const Arg* first = nullptr;
  for (const Arg& arg : args) {
    if (skipped(arg)) continue;
    QKVF_CHECK(!is_absent(arg.view), op_, ": ", arg.name, ": missing (a required argument)");
    if (!first) first = &arg;
    QKVF_CHECK(arg.view.device == first->view.device, op_, ": ", arg.name, ": is on ",
               device_name(arg.view.device), ", but ", first->name, " is on ",
               device_name(first->view.device), "; all tensors of one call must share a device");
  }
  const Device device = first ? first->view.device : Device{};
  for (const Arg& arg : args) {
    if (skipped(arg) || arg.view.numel() == 0) continue;
    QKVF_CHECK(arg.view.data != nullptr, op_, ": ", arg.name, ": has ", arg.view.numel(),
               " elements but a null data pointer");
    if (device.type == DeviceType::kCUDA) {
      const std::string name = op_ + ": " + arg.name;
      cuda::check_pointer_on_device(arg.view.data, device, name.c_str());
    }
  }
  return device;
}

void Checker::dtype(const TensorView& view, const char* name, DType expected) const {
  QKVF_CHECK(view.dtype == expected, op_, ": ", name, ": expected dtype ", dtype_name(expected),
             ", got ", dtype_name(view.dtype));
}

void Checker::dtype_in(const TensorView& view, const char* name,
                       std::initializer_list<DType> allowed) const {
  bool ok = false;
  for (DType dtype : allowed) ok = ok || view.dtype == dtype;
  QKVF_CHECK(ok, op_, ": ", name, ": expected dtype ", dtypes_text(allowed), ", got ",
             dtype_name(view.dtype));
}

void Checker::ndim(const TensorView& view, const char* name, int expected) const {
  QKVF_CHECK(view.ndim == expected, op_, ": ", name, ": expected ", expected, " dims, got shape ",
             dims_text(view), " (", view.describe(), ")");
}

void Checker::shape(const TensorView& view, const char* name, std::initializer_list<Dim> expected,
                    const std::string& why) const {
  bool ok = view.ndim == int(expected.size());
  int d = 0;
  for (const Dim& dim : expected) {
    if (!ok) break;
    ok = dim.size < 0 || view.sizes[d] == dim.size;
    ++d;
  }
  QKVF_CHECK(ok, op_, ": ", name, ": expected shape ", expected_dims_text(expected),
             why.empty() ? "" : " ", why, ", got ", dims_text(view), " (", view.describe(), ")");
}

void Checker::last_dim_contiguous(const TensorView& view, const char* name) const {
  const int last = view.ndim - 1;
  const bool ok = view.ndim == 0 || view.sizes[last] <= 1 || view.strides[last] == 1;
  QKVF_CHECK(ok, op_, ": ", name, ": expected its last dim contiguous (stride 1), got ",
             view.describe());
}

void Checker::contiguous(const TensorView& view, const char* name) const {
  // An empty tensor has no element whose place could be wrong (torch calls it contiguous too).
  QKVF_CHECK(view.numel() == 0 || view.is_contiguous(), op_, ": ", name,
             ": expected a row-major contiguous tensor (no padding), got ", view.describe());
}

void Checker::row_major(const TensorView& view, const char* name) const {
  last_dim_contiguous(view, name);
  const bool ok = view.ndim != 2 || view.sizes[0] <= 1 || view.strides[0] >= view.sizes[1];
  QKVF_CHECK(ok, op_, ": ", name, ": expected a row stride >= its ", view.sizes[1],
             " columns, got ", view.describe());
}

void Checker::scalar_f32(const TensorView& view, const char* name) const {
  const bool scalar_shape = view.ndim == 0 || (view.ndim == 1 && view.sizes[0] == 1);
  QKVF_CHECK(view.dtype == DType::kFloat32 && scalar_shape, op_, ": ", name,
             ": expected a float32 scalar of shape [] or [1], got ", view.describe());
}

void Checker::element_aligned(const TensorView& view, const char* name) const {
  if (view.numel() == 0) return;
  const auto address = reinterpret_cast<uintptr_t>(view.data);
  const int64_t element = int64_t(dtype_size(view.dtype));
  QKVF_CHECK(address % element == 0, op_, ": ", name, ": data pointer ", view.data,
             " is not aligned to its ", element, "-byte elements");
}

void Checker::aligned(const TensorView& view, const char* name, Device device) const {
  element_aligned(view, name);
  if (view.numel() == 0 || device.type != DeviceType::kCUDA) return;
  const auto address = reinterpret_cast<uintptr_t>(view.data);
  const int64_t element = int64_t(dtype_size(view.dtype));
  const int64_t vector = row_vector_bytes(view);
  bool ok = address % vector == 0;
  for (int d = 0; d + 1 < view.ndim; ++d) {
    ok = ok && (view.sizes[d] <= 1 || (view.strides[d] * element) % vector == 0);
  }
  QKVF_CHECK(ok, op_, ": ", name,
             ": on CUDA, expected its data pointer and its strides (but the "
             "last) in bytes to be multiples of ",
             vector, " (the vector width of its rows), got ", "pointer ", view.data, " and ",
             view.describe());
}

void Checker::no_overlap(const std::vector<Arg>& outputs, const std::vector<Arg>& inputs) const {
  for (auto out = outputs.begin(); out != outputs.end(); ++out) {
    if (skipped(*out)) continue;
    for (auto other = out + 1; other != outputs.end(); ++other) {
      if (skipped(*other)) continue;
      QKVF_CHECK(!may_overlap(out->view, other->view), op_, ": ", out->name, ": overlaps output ",
                 other->name, "; outputs must not share memory");
    }
    for (const Arg& in : inputs) {
      if (skipped(in)) continue;
      QKVF_CHECK(!may_overlap(out->view, in.view), op_, ": ", out->name, ": overlaps input ",
                 in.name, "; an output must not alias any input");
    }
  }
}

namespace {

/// The switch's state: -1 not read yet, else 0 or 1.
std::atomic<int> cuda_section9_state{-1};

}  // namespace

bool cuda_section9_enabled() {
  int state = cuda_section9_state.load(std::memory_order_acquire);
  if (state < 0) {
    const char* value = std::getenv("QKVFUSE_CUDA_SECTION9");
    const int read = value != nullptr && std::strcmp(value, "1") == 0 ? 1 : 0;
    // The first reader's value stands (a test's override may have come first).
    cuda_section9_state.compare_exchange_strong(state, read, std::memory_order_acq_rel);
    state = cuda_section9_state.load(std::memory_order_acquire);
  }
  return state == 1;
}

void set_cuda_section9_for_testing(bool enabled) {
  cuda_section9_state.store(enabled ? 1 : 0, std::memory_order_release);
}

std::string cuda_pending_option(const RopeLayout& layout, int64_t head_dim) {
  // With the switch: the general kernel takes them (untested on a GPU).
  const bool untested_kernels = cuda_section9_enabled();
  // Past kMaxHeadDim no backend takes it: rope_options refuses it as unsupported.
  if (head_dim > kMaxCudaTestedHeadDim && head_dim <= kMaxHeadDim && !untested_kernels) {
    return "qk: head width D = " + std::to_string(head_dim) + " (above " +
           std::to_string(kMaxCudaTestedHeadDim) + ")";
  }
  if (layout.normalize_v && !untested_kernels) return "layout.normalize_v";
  if (layout.norm_scope != NormScope::kHead && !untested_kernels) {
    return "layout.norm_scope: NormScope::kToken (one RMS over the token)";
  }
  if (layout.query_only && !untested_kernels) return "layout.query_only";
  if (!rope::has_angles(layout) && !untested_kernels) {
    return "layout.factor1, layout.cos_sin: none (a call without rotary)";
  }
  return {};
}

void Checker::not_pending_on_cuda(const RopeLayout& layout, const TensorView& qk) const {
  if (qk.device.type != DeviceType::kCUDA || qk.ndim != 3) return;
  const std::string option = cuda_pending_option(layout, qk.sizes[2]);
  QKVF_CHECK(option.empty(), op_, ": ", option,
             ": not yet on the CUDA backend (the CPU backend runs it; SPEC.md section 9); set "
             "QKVFUSE_CUDA_SECTION9=1 to try the untested kernels");
}

void Checker::rope_options(const RopeLayout& layout, int64_t head_dim) const {
  const int64_t q_heads = layout.num_heads;
  const int64_t kv = kv_heads(layout);
  QKVF_CHECK(q_heads >= 1, op_, ": layout.num_heads: expected >= 1, got ", q_heads);
  if (layout.query_only) {
    QKVF_CHECK(layout.num_kv_heads == 0, op_,
               ": layout.num_kv_heads: expected 0 with layout.query_only (no key heads), got ",
               layout.num_kv_heads);
  } else {
    QKVF_CHECK(layout.num_kv_heads >= 0 && q_heads % kv == 0, op_,
               ": layout.num_kv_heads: expected a divisor of layout.num_heads = ", q_heads,
               ", got ", layout.num_kv_heads);
  }
  // Rotary pairs need an even D; 512 bounds the backends' per-row buffers (Gemma 4's global
  // layers are the widest heads trained).
  QKVF_CHECK(head_dim % 2 == 0 && head_dim >= 2 && head_dim <= kMaxHeadDim, op_,
             ": qk: head width D = ", head_dim, " is not supported: expected an even D in [2, ",
             kMaxHeadDim, "]");
  QKVF_CHECK(layout.rotary_style == RotaryStyle::kInterleaved ||
                 layout.rotary_style == RotaryStyle::kNeox,
             op_,
             ": layout.rotary_style: expected RotaryStyle::kInterleaved or RotaryStyle::kNeox, "
             "got ",
             int(layout.rotary_style));
  QKVF_CHECK(layout.norm_scope == NormScope::kHead || layout.norm_scope == NormScope::kToken,
             op_, ": layout.norm_scope: expected NormScope::kHead or NormScope::kToken, got ",
             int(layout.norm_scope));

  const bool tables = !is_absent(layout.factor1) || !is_absent(layout.factor2);
  const bool cache = !is_absent(layout.cos_sin) || !is_absent(layout.positions);
  QKVF_CHECK(!(tables && cache), op_,
             ": layout.factor1, layout.cos_sin: expected at most one angle source, got both the "
             "factor tables (layout.factor1, layout.factor2) and a cos/sin cache "
             "(layout.cos_sin, layout.positions)");
  if (tables) {
    const bool first = is_absent(layout.factor1);
    QKVF_CHECK(!is_absent(layout.factor1) && !is_absent(layout.factor2), op_, ": ",
               first ? "layout.factor1" : "layout.factor2",
               ": missing: layout.factor1 and layout.factor2 go together, got only ",
               first ? "layout.factor2" : "layout.factor1");
  } else if (cache) {
    const bool first = is_absent(layout.cos_sin);
    QKVF_CHECK(!is_absent(layout.cos_sin) && !is_absent(layout.positions), op_, ": ",
               first ? "layout.cos_sin" : "layout.positions",
               ": missing: layout.cos_sin and layout.positions go together, got only ",
               first ? "layout.positions" : "layout.cos_sin");
    QKVF_CHECK(layout.cos_sin.ndim == 2, op_, ": layout.cos_sin: expected 2 dims [P, r], got ",
               layout.cos_sin.describe());
  } else {
    QKVF_CHECK(layout.rotary_dim == -1 || layout.rotary_dim == 0, op_,
               ": layout.rotary_dim: expected -1 (the default) or 0 without an angle source (no "
               "factor tables, no cos/sin cache: nothing rotates), got ",
               layout.rotary_dim);
  }

  const int64_t rotary = rope::resolved_rotary_dim(layout, head_dim);
  QKVF_CHECK(layout.rotary_dim >= -1, op_,
             ": layout.rotary_dim: expected -1 (the default) or an even value in [0, D = ",
             head_dim, "], got ", layout.rotary_dim);
  QKVF_CHECK(rotary % 2 == 0 && rotary >= 0 && rotary <= head_dim, op_,
             layout.rotary_dim >= 0 ? ": layout.rotary_dim: expected an even value in [0, D = "
                                    : ": layout.cos_sin: expected an even width r in [0, D = ",
             head_dim, "], got ", rotary);
  if (cache) {
    QKVF_CHECK(layout.cos_sin.sizes[1] == rotary, op_, ": layout.cos_sin: expected width r = ",
               rotary, " (layout.rotary_dim), got ", layout.cos_sin.describe());
  }

  // query_only first: its own name says why paired and key_offset cannot apply.
  QKVF_CHECK(!layout.query_only || !(layout.paired || layout.key_offset), op_,
             ": layout.query_only: has no key heads, so neither layout.paired nor "
             "layout.key_offset (both need layout.num_kv_heads = layout.num_heads)");
  QKVF_CHECK(!layout.query_only || is_absent(layout.k_weight), op_,
             ": layout.k_weight: given, but layout.query_only has no key rows");
  QKVF_CHECK(!layout.query_only || !layout.normalize_v, op_,
             ": layout.normalize_v: expected false with layout.query_only (no V heads to "
             "normalize), got true");
  QKVF_CHECK(!layout.normalize_v || layout.norm_scope == NormScope::kHead, op_,
             ": layout.normalize_v: defined with layout.norm_scope = NormScope::kHead only (the V "
             "norm is per head; no family normalizes V over the token)");
  const bool same_heads = kv == q_heads;
  QKVF_CHECK(!(layout.paired && layout.key_offset), op_,
             ": layout.paired, layout.key_offset: cannot both be set");
  QKVF_CHECK(!layout.paired || (same_heads && q_heads % 2 == 0), op_,
             ": layout.paired: needs layout.num_kv_heads = layout.num_heads and an even "
             "layout.num_heads, got ",
             q_heads, " and ", kv);
  QKVF_CHECK(!layout.paired || tables, op_,
             cache ? ": layout.paired: defined with factor tables [T, 2D] only, got a cos/sin cache"
                   : ": layout.paired: defined with factor tables [T, 2D] only, got no angle "
                     "source");
  QKVF_CHECK(!layout.key_offset || same_heads, op_,
             ": layout.key_offset: needs layout.num_kv_heads = layout.num_heads, got ", q_heads,
             " and ", kv);

  const bool weighted = !is_absent(layout.q_weight) || !is_absent(layout.k_weight);
  QKVF_CHECK(!weighted || layout.normalize, op_, ": ",
             is_absent(layout.q_weight) ? "layout.k_weight" : "layout.q_weight",
             ": norm weights need layout.normalize = true, got false");
  QKVF_CHECK(!(layout.normalize || layout.normalize_v) ||
                 (layout.eps > 0.0f && layout.eps <= 3.4e38f),
             op_, ": layout.eps: expected a positive finite value, got ", layout.eps);
  QKVF_CHECK(layout.weight_offset == layout.weight_offset &&
                 layout.weight_offset >= -3.4e38f && layout.weight_offset <= 3.4e38f,
             op_, ": layout.weight_offset: expected a finite value, got ", layout.weight_offset);
}

void check_positions_if_asked(const RopeLayout& layout, Stream stream) {
  static const bool always = [] {
    const char* value = std::getenv("QKVFUSE_CHECK_POSITIONS");
    return value != nullptr && std::strcmp(value, "1") == 0;
  }();
  if (always && !is_absent(layout.positions)) {
    check_positions(layout.positions, layout.cos_sin.sizes[0], stream);
  }
}

RopeShape rope_inputs(const Checker& check, const TensorView& qk, const RopeLayout& layout,
                      Device device, bool wide_qk_on_cpu) {
  const bool cpu = device.type == DeviceType::kCPU;
  if (wide_qk_on_cpu && cpu) {
    check.dtype_in(qk, "qk", {DType::kBFloat16, DType::kFloat32, DType::kFloat64});
  } else {
    check.dtype(qk, "qk", DType::kBFloat16);
  }
  check.ndim(qk, "qk", 3);
  const int64_t head_dim = qk.sizes[2];
  check.rope_options(layout, head_dim);
  const int64_t q_heads = layout.num_heads;
  const int64_t kv = kv_heads(layout);
  check.shape(qk, "qk", {Dim::any("T"), q_heads + kv, head_dim},
              layout.query_only
                  ? "(layout.query_only: layout.num_heads = " + std::to_string(q_heads) + " heads)"
                  : "(num_heads + num_kv_heads = " + std::to_string(q_heads + kv) + " heads)");
  check.last_dim_contiguous(qk, "qk");
  check.element_aligned(qk, "qk");

  const int64_t tokens = qk.sizes[0];
  RopeShape shape{tokens,   q_heads, kv, head_dim, rope::resolved_rotary_dim(layout, head_dim),
                  tokens,   q_heads, kv};
  if (layout.paired) {
    shape.out_tokens = 2 * tokens;
    shape.q_out_heads = q_heads / 2;
    shape.k_out_heads = kv / 2;
  }

  // The CPU also takes tables and weights in qk's own dtype (float64 gradient checks).
  const auto float_dtypes = [&](const TensorView& view, const char* name) {
    if (cpu) {
      check.dtype_in(view, name, {DType::kBFloat16, DType::kFloat32, qk.dtype});
    } else {
      check.dtype_in(view, name, {DType::kBFloat16, DType::kFloat32});
    }
  };
  if (!is_absent(layout.factor1)) {
    float_dtypes(layout.factor1, "layout.factor1");
    const int64_t width = layout.paired ? 2 * head_dim : head_dim;
    const char* why = layout.paired ? "(paired: [T, 2*D])" : "([T, D])";
    for (const Arg& factor : {Arg{layout.factor1, "layout.factor1"},
                              Arg{layout.factor2, "layout.factor2"}}) {
      check.dtype(factor.view, factor.name, layout.factor1.dtype);
      check.shape(factor.view, factor.name, {tokens, width}, why);
      check.last_dim_contiguous(factor.view, factor.name);
      check.element_aligned(factor.view, factor.name);
    }
  } else if (!is_absent(layout.cos_sin)) {
    float_dtypes(layout.cos_sin, "layout.cos_sin");
    // The CUDA kernels address a cache row with a 32-bit index.
    QKVF_CHECK(layout.cos_sin.sizes[0] >= 1 && layout.cos_sin.sizes[0] <= INT32_MAX, check.op(),
               ": layout.cos_sin: expected 1 <= P <= 2^31 - 1 positions, got ",
               layout.cos_sin.describe());
    check.last_dim_contiguous(layout.cos_sin, "layout.cos_sin");
    check.element_aligned(layout.cos_sin, "layout.cos_sin");
    check.dtype_in(layout.positions, "layout.positions", {DType::kInt32, DType::kInt64});
    check.shape(layout.positions, "layout.positions", {tokens}, "([T], T from qk)");
    check.element_aligned(layout.positions, "layout.positions");
  }
  for (const Arg& weight : {Arg{layout.q_weight, "layout.q_weight", true},
                            Arg{layout.k_weight, "layout.k_weight", true}}) {
    if (is_absent(weight.view)) continue;
    const bool key = &weight.view == &layout.k_weight;
    float_dtypes(weight.view, weight.name);
    check.shape(weight.view, weight.name, {weight_width(layout, shape, key)},
                weight_shape_why(layout, key));
    check.last_dim_contiguous(weight.view, weight.name);
    check.element_aligned(weight.view, weight.name);
  }
  return shape;
}

int64_t weight_width(const RopeLayout& layout, const RopeShape& shape, bool key) {
  if (layout.norm_scope == NormScope::kHead) return shape.head_dim;
  return (key ? shape.kv_heads : shape.q_heads) * shape.head_dim;
}

std::string weight_shape_why(const RopeLayout& layout, bool key, const char* also) {
  std::string why = "(";
  if (layout.norm_scope == NormScope::kHead) {
    why += "[D]";
  } else {
    why += key ? "layout.norm_scope = NormScope::kToken: [layout.num_kv_heads * D]"
               : "layout.norm_scope = NormScope::kToken: [layout.num_heads * D]";
  }
  return why + also + ")";
}

int64_t rope_v_input(const Checker& check, const RopeLayout& layout, Arg v,
                     const RopeShape& shape, DType dtype, Device device) {
  if (!layout.normalize_v) {
    QKVF_CHECK(is_absent(v.view), check.op(), ": ", v.name,
               ": given, but layout.normalize_v is false (the V tensors go with the V norm)");
    return 0;
  }
  QKVF_CHECK(!is_absent(v.view), check.op(), ": ", v.name,
             ": missing (layout.normalize_v reads the V heads)");
  check.dtype(v.view, v.name, dtype);
  check.shape(v.view, v.name, {shape.tokens, shape.kv_heads, Dim::any("Dv")},
              "(T from qk, num_kv_heads)");
  const bool cuda = device.type == DeviceType::kCUDA;
  QKVF_CHECK(v.view.sizes[2] >= 1 && (!cuda || v.view.sizes[2] <= cuda::kMaxVWidth), check.op(),
             ": ", v.name, ": expected a V head width Dv ",
             cuda ? "in [1, " + std::to_string(cuda::kMaxVWidth) + "] on " + device_name(device)
                  : std::string(">= 1"),
             ", got ", v.view.describe());
  check.last_dim_contiguous(v.view, v.name);
  check.element_aligned(v.view, v.name);
  return v.view.sizes[2];
}

void rope_v_output(const Checker& check, const RopeLayout& layout, Arg out, const RopeShape& shape,
                   int64_t v_dim, DType dtype, bool contiguous) {
  if (!layout.normalize_v) {
    QKVF_CHECK(is_absent(out.view), check.op(), ": ", out.name,
               ": given, but layout.normalize_v is false (the V tensors go with the V norm)");
    return;
  }
  QKVF_CHECK(!is_absent(out.view), check.op(), ": ", out.name,
             ": missing (layout.normalize_v writes or reads it)");
  check.dtype(out.view, out.name, dtype);
  check.shape(out.view, out.name, {shape.tokens, shape.kv_heads, v_dim}, "(v's shape)");
  if (contiguous) {
    check.contiguous(out.view, out.name);
  } else {
    check.last_dim_contiguous(out.view, out.name);
  }
  check.element_aligned(out.view, out.name);
}

std::vector<Arg> rope_tensor_args(const RopeLayout& layout) {
  return {{layout.factor1, "layout.factor1", true},   {layout.factor2, "layout.factor2", true},
          {layout.cos_sin, "layout.cos_sin", true},   {layout.positions, "layout.positions", true},
          {layout.q_weight, "layout.q_weight", true}, {layout.k_weight, "layout.k_weight", true}};
}

void rope_output_pair(const Checker& check, Arg q, Arg k, const RopeShape& shape, DType dtype,
                      bool contiguous) {
  const bool paired = shape.out_tokens != shape.tokens;
  const auto check_one = [&](const Arg& arg, int64_t heads, const char* why) {
    check.dtype(arg.view, arg.name, dtype);
    check.shape(arg.view, arg.name, {shape.out_tokens, heads, shape.head_dim},
                paired ? "(paired: [2T, H/2, D])" : why);
    if (contiguous) {
      check.contiguous(arg.view, arg.name);
    } else {
      check.last_dim_contiguous(arg.view, arg.name);
    }
    check.element_aligned(arg.view, arg.name);
  };
  check_one(q, shape.q_out_heads, "([T, num_heads, D])");
  check_one(k, shape.k_out_heads, "([T, num_kv_heads, D])");
}

void rope_weight_grads(const Checker& check, const RopeLayout& layout, const RopeShape& shape,
                       Arg grad_q_weight, Arg grad_k_weight, Arg workspace,
                       int64_t workspace_size) {
  for (const auto& [grad, weight] : {std::pair<Arg, const TensorView*>{grad_q_weight,
                                                                        &layout.q_weight},
                                     std::pair<Arg, const TensorView*>{grad_k_weight,
                                                                        &layout.k_weight}}) {
    if (is_absent(*weight)) {
      QKVF_CHECK(is_absent(grad.view), check.op(), ": ", grad.name,
                 ": given, but its weight is not (a gradient goes with its weight)");
      continue;
    }
    QKVF_CHECK(!is_absent(grad.view), check.op(), ": ", grad.name,
               ": missing (the layout has its weight, whose gradient it receives)");
    check.dtype(grad.view, grad.name, weight->dtype);
    const bool key = weight == &layout.k_weight;
    check.shape(grad.view, grad.name, {weight_width(layout, shape, key)},
                weight_shape_why(layout, key, ", as its weight"));
    check.contiguous(grad.view, grad.name);
    check.element_aligned(grad.view, grad.name);
  }
  if (workspace_size == 0 && is_absent(workspace.view)) return;
  check.dtype(workspace.view, workspace.name, DType::kFloat32);
  check.ndim(workspace.view, workspace.name, 1);
  check.contiguous(workspace.view, workspace.name);
  check.element_aligned(workspace.view, workspace.name);
  QKVF_CHECK(workspace.view.sizes[0] >= workspace_size, check.op(), ": ", workspace.name,
             ": expected at least ", workspace_size,
             " float32 elements (backward_workspace_size), got ", workspace.view.describe());
}

ByteRange byte_range(const TensorView& view) {
  if (view.numel() == 0) return {};
  const int64_t element = int64_t(dtype_size(view.dtype));
  int64_t low = 0;
  int64_t high = 0;
  for (int d = 0; d < view.ndim; ++d) {
    const int64_t extent = (view.sizes[d] - 1) * view.strides[d] * element;
    (extent < 0 ? low : high) += extent;
  }
  const auto base = reinterpret_cast<uintptr_t>(view.data);
  return {base + uintptr_t(low), base + uintptr_t(high + element)};
}

// The byte-range test alone would flag the Q/K and V column slices of one [T, qkv_dim] GEMM
// output, whose ranges interleave row by row. So when both views step through rows with the same
// positive byte stride S, every byte of a view lies, modulo S, in the window
// [first mod S, first mod S + row part), where the row part is the bytes the other dims span:
// disjoint windows on that circle of length S mean disjoint views. (A row part longer than S
// covers the whole circle and always intersects.) Anything else that shares a range is reported
// as overlapping.
bool may_overlap(const TensorView& a, const TensorView& b) {
  const ByteRange ra = byte_range(a);
  const ByteRange rb = byte_range(b);
  if (ra.first == ra.last || rb.first == rb.last) return false;
  if (ra.last <= rb.first || rb.last <= ra.first) return false;
  if (a.ndim < 1 || b.ndim < 1) return true;

  const auto row_part = [](const TensorView& view, int64_t* outer) -> int64_t {
    const int64_t element = int64_t(dtype_size(view.dtype));
    *outer = view.strides[0] * element;
    int64_t span = element;
    for (int d = 1; d < view.ndim; ++d) {
      if (view.strides[d] < 0) return -1;
      span += (view.sizes[d] - 1) * view.strides[d] * element;
    }
    return span;
  };
  int64_t stride_a = 0;
  int64_t stride_b = 0;
  const int64_t part_a = row_part(a, &stride_a);
  const int64_t part_b = row_part(b, &stride_b);
  if (stride_a != stride_b || stride_a <= 0 || part_a < 0 || part_b < 0) return true;
  const auto period = uintptr_t(stride_a);
  const uintptr_t start_a = ra.first % period;
  const uintptr_t start_b = rb.first % period;
  return (start_b + period - start_a) % period < uintptr_t(part_a) ||
         (start_a + period - start_b) % period < uintptr_t(part_b);
}

}  // namespace qkvfuse::validate
