// validate.cpp: the argument checks shared by the public entry points (see validate.hpp).
#include "validate.hpp"

#include <vector>

#include "backend.hpp"
#include "qkvfuse/error.hpp"

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

void Checker::rope_layout(const RopeLayout& layout, int64_t head_dim) const {
  QKVF_CHECK(layout.num_heads >= 1, op_, ": layout.num_heads: expected >= 1, got ",
             layout.num_heads);
  // Rotary pairs (2i, 2i+1) need an even D; 256 bounds the kernels' registers per row.
  QKVF_CHECK(head_dim % 2 == 0 && head_dim >= 2 && head_dim <= 256, op_, ": qk: head width D = ",
             head_dim, " is not supported: expected an even D in [2, 256]");
  QKVF_CHECK(!(layout.paired && layout.key_offset), op_,
             ": layout: paired and key_offset cannot both be set");
  QKVF_CHECK(!layout.paired || layout.num_heads % 2 == 0, op_,
             ": layout.paired: needs an even num_heads, got num_heads = ", layout.num_heads);
  if (layout.key_offset) {
    const int64_t rotary = layout.rotary_dim;
    QKVF_CHECK(rotary % 2 == 0 && rotary >= 0 && rotary <= head_dim, op_,
               ": layout.rotary_dim: expected an even value in [0, D = ", head_dim,
               "] with key_offset, got ", rotary);
  }
}

RopeShape rope_inputs(const Checker& check, const TensorView& qk, const TensorView& factor1,
                      const TensorView& factor2, const RopeLayout& layout, Device device,
                      bool wide_qk_on_cpu) {
  if (wide_qk_on_cpu && device.type == DeviceType::kCPU) {
    check.dtype_in(qk, "qk", {DType::kBFloat16, DType::kFloat32, DType::kFloat64});
  } else {
    check.dtype(qk, "qk", DType::kBFloat16);
  }
  check.ndim(qk, "qk", 3);
  const int64_t head_dim = qk.sizes[2];
  check.rope_layout(layout, head_dim);
  const int64_t heads = layout.num_heads;
  check.shape(qk, "qk", {Dim::any("T"), 2 * heads, head_dim},
              "(2*num_heads = " + std::to_string(2 * heads) + " heads)");
  check.last_dim_contiguous(qk, "qk");
  check.element_aligned(qk, "qk");

  const int64_t tokens = qk.sizes[0];
  RopeShape shape{tokens, heads, head_dim, tokens, heads, head_dim};
  if (layout.paired) shape = {tokens, heads, head_dim, 2 * tokens, heads / 2, 2 * head_dim};

  // The CPU also takes factors in qk's own dtype (float64 gradient checks); CUDA reads bf16/fp32.
  if (device.type == DeviceType::kCUDA) {
    check.dtype_in(factor1, "factor1", {DType::kBFloat16, DType::kFloat32});
  } else {
    check.dtype_in(factor1, "factor1", {DType::kBFloat16, DType::kFloat32, qk.dtype});
  }
  const char* why = layout.paired ? "(paired: [T, 2*D])" : "";
  for (const Arg& factor : {Arg{factor1, "factor1"}, Arg{factor2, "factor2"}}) {
    check.dtype(factor.view, factor.name, factor1.dtype);
    check.shape(factor.view, factor.name, {tokens, shape.factor_width}, why);
    check.last_dim_contiguous(factor.view, factor.name);
    check.element_aligned(factor.view, factor.name);
  }
  return shape;
}

void rope_output_pair(const Checker& check, Arg first, Arg second, const RopeShape& shape,
                      DType dtype, bool contiguous) {
  const char* why = shape.out_tokens != shape.tokens ? "(paired: [2T, H/2, D])" : "([T, H, D])";
  for (const Arg& arg : {first, second}) {
    check.dtype(arg.view, arg.name, dtype);
    check.shape(arg.view, arg.name, {shape.out_tokens, shape.out_heads, shape.head_dim}, why);
    if (contiguous) {
      check.contiguous(arg.view, arg.name);
    } else {
      check.last_dim_contiguous(arg.view, arg.name);
    }
    check.element_aligned(arg.view, arg.name);
  }
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
