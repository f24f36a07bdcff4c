// quantize.cpp: the public dual-layout quantize entry points (plain, batched, weight bank):
// validate, skip empty work, dispatch.
#include "qkvfuse/quantize.hpp"

#include <vector>

#include "backend.hpp"
#include "qkvfuse/error.hpp"
#include "validate.hpp"

namespace qkvfuse {
namespace {

using validate::Arg;
using validate::Checker;

/// The source and the two e4m3 layouts, shared by both ops: src bf16 [M, N] or [B, M, N] (3-D
/// only when `batched_only`), last dim contiguous; row [(B,) M, N] and t [(B,) N, M] contiguous.
void check_src_and_layouts(const Checker& check, const TensorView& src, const TensorView& row,
                           const TensorView& t, Device device, bool batched_only) {
  check.dtype(src, "src", DType::kBFloat16);
  if (batched_only) {
    check.ndim(src, "src", 3);
  } else {
    QKVF_CHECK(src.ndim == 2 || src.ndim == 3, check.op(),
               ": src: expected shape [M, N] or, batched, [B, M, N], got ", src.describe());
  }
  check.last_dim_contiguous(src, "src");
  check.aligned(src, "src", device);
  check.dtype(row, "row", DType::kFloat8E4M3);
  check.dtype(t, "t", DType::kFloat8E4M3);
  if (src.ndim == 3) {
    const int64_t b = src.sizes[0], m = src.sizes[1], n = src.sizes[2];
    check.shape(row, "row", {b, m, n}, "(src's shape)");
    check.shape(t, "t", {b, n, m}, "(src's shape, last two dims swapped)");
  } else {
    const int64_t m = src.sizes[0], n = src.sizes[1];
    check.shape(row, "row", {m, n}, "(src's shape)");
    check.shape(t, "t", {n, m}, "(src transposed)");
  }
  for (const Arg& out : {Arg{row, "row"}, Arg{t, "t"}}) {
    check.contiguous(out.view, out.name);
    check.aligned(out.view, out.name, device);
  }
}

/// One float32 per batch entry: a scalar ([] or [1]) for a plain src, [B] contiguous when batched.
void check_per_entry_f32(const Checker& check, const TensorView& view, const char* name,
                         const TensorView& src, Device device) {
  if (src.ndim == 3) {
    check.dtype(view, name, DType::kFloat32);
    check.shape(view, name, {src.sizes[0]}, "(one per batch entry of src)");
    check.contiguous(view, name);
  } else {
    check.scalar_f32(view, name);
  }
  check.aligned(view, name, device);
}

Device validate_quantize_dual(const QuantizeDualParams& p) {
  const Checker check("quantize_dual_layout");
  const std::vector<Arg> inputs = {{p.src, "src"}, {p.scale, "scale"}};
  const std::vector<Arg> outputs = {
      {p.row, "row"}, {p.t, "t"}, {p.amax, "amax", /*optional=*/true}};
  const Device device = check.same_device(validate::concat(inputs, outputs));
  check_src_and_layouts(check, p.src, p.row, p.t, device, /*batched_only=*/false);
  check_per_entry_f32(check, p.scale, "scale", p.src, device);
  if (!is_absent(p.amax)) check_per_entry_f32(check, p.amax, "amax", p.src, device);
  check.no_overlap(outputs, inputs);
  return device;
}

Device validate_weight_bank(const QuantizeWeightBankParams& p) {
  const Checker check("quantize_weight_bank");
  const std::vector<Arg> inputs = {{p.src, "src"}};
  const std::vector<Arg> outputs = {{p.scale, "scale"}, {p.row, "row"}, {p.t, "t"}};
  const Device device = check.same_device(validate::concat(inputs, outputs));
  check_src_and_layouts(check, p.src, p.row, p.t, device, /*batched_only=*/true);
  check_per_entry_f32(check, p.scale, "scale", p.src, device);
  check.no_overlap(outputs, inputs);
  return device;
}

}  // namespace

// An empty src is a no-op: nothing is written, amax and the weight-bank scales included (the
// max of no elements is left undefined rather than invented).
void quantize_dual_layout(const QuantizeDualParams& params) {
  const Device device = validate_quantize_dual(params);
  if (params.src.numel() == 0) return;
  if (device.type == DeviceType::kCUDA) {
    cuda::quantize_dual_layout(params);
  } else {
    cpu::quantize_dual_layout(params);
  }
}

void quantize_weight_bank(const QuantizeWeightBankParams& params) {
  const Device device = validate_weight_bank(params);
  if (params.src.numel() == 0) return;
  if (device.type == DeviceType::kCUDA) {
    cuda::quantize_weight_bank(params);
  } else {
    cpu::quantize_weight_bank(params);
  }
}

}  // namespace qkvfuse
