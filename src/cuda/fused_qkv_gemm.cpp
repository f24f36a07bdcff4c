// fused_qkv_gemm.cpp: the host entry of the fused QKV GEMM (fused_qkv_gemm.hpp): validate every
// argument, translate the views into the kernel's plain arguments (fused_qkv_gemm_args.hpp) and
// dispatch on the head width and layout to the instantiations in fused_qkv_gemm_d<D>*.cu. Built with or
// without CUTLASS: without it (QKVFUSE_WITH_CUTLASS unset) the entry points validate and throw.
// Which layouts and sizes have a kernel is decided in fused_qkv_gemm_support.cpp.
#include "cuda/fused_qkv_gemm.hpp"

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/check.hpp"
#include "cuda/fused_qkv_gemm_args.hpp"
#include "qkvfuse/error.hpp"
#include "qkvfuse/numeric.hpp"
#include "rope_math.hpp"
#include "validate.hpp"

#ifndef QKVFUSE_WITH_CUTLASS
#define QKVFUSE_WITH_CUTLASS 0
#endif

namespace qkvfuse::cuda {
namespace {

constexpr const char* kOp = "fused_qkv_gemm";
constexpr int64_t kInt32Max = (int64_t(1) << 31) - 1;

[[noreturn, maybe_unused]] void throw_without_cutlass(const char* op) {
  QKVF_FAIL(op, ": qkvfuse was built without CUTLASS 4.2, so the CUTLASS FP8 GEMMs are not "
                "available (run scripts/fetch_cutlass.sh before configuring, or pass "
                "-DQKVFUSE_CUTLASS_INCLUDE_DIR=...; see cmake/cutlass.cmake)");
}

/// Everything fused_qkv_gemm needs checked, and the kernel arguments that follow from it.
/// Messages start with `op`.
FusedQkvKernelArgs validate_and_translate(const FusedQkvGemmParams& p, const std::string& op_name,
                                          Device& device) {
  using validate::Arg;
  using validate::Dim;
  const char* op = op_name.c_str();
  const validate::Checker check(op_name);
  const RopeLayout& layout = p.layout;
  // The sizes and the layout first: what no fused kernel is built for is refused with the reason
  // (fused_qkv_unsupported), before the device check, which would otherwise call the factor tables
  // of a cos/sin-cache layout missing.
  check.ndim(p.x_f8, "x_f8", 2);
  check.ndim(p.q, "q", 3);
  check.ndim(p.v, "v", 3);
  const int64_t tokens = p.x_f8.sizes[0];
  const int64_t channels = p.x_f8.sizes[1];
  const int64_t head_dim = p.q.sizes[2];
  const int64_t v_dim = p.v.sizes[2];
  // The library's own rules (heads, rotary_dim, paired, key offset, eps), then the fused kernel's.
  check.rope_options(layout, head_dim);
  const std::string unsupported = fused_qkv_unsupported(layout, {tokens, head_dim, v_dim});
  QKVF_CHECK(unsupported.empty(), op, ": ", unsupported);
  const std::vector<Arg> inputs = {{p.x_f8, "x_f8"},
                                   {p.weight_f8, "weight_f8"},
                                   {p.scale_a, "scale_a"},
                                   {p.scale_b, "scale_b"},
                                   {p.alpha, "alpha", /*optional=*/true},
                                   {layout.factor1, "layout.factor1"},
                                   {layout.factor2, "layout.factor2"}};
  const std::vector<Arg> outputs = {
      {p.q, "q"}, {p.k, "k"}, {p.v, "v"}, {p.qk, "qk", /*optional=*/true}};
  device = check.same_device(validate::concat(inputs, outputs));
  QKVF_CHECK(device.type == DeviceType::kCUDA, op, ": runs on CUDA tensors only, got ",
             device_name(device));

  // ---- operands: x_f8 [T, C], weight_f8 [N, C] -----------------------------------------------
  check.dtype(p.x_f8, "x_f8", DType::kFloat8E4M3);
  QKVF_CHECK(channels > 0 && channels % 16 == 0, op,
             ": x_f8: expected C (the GEMM's K) a positive multiple of 16 (TMA rows), got ", channels);

  // ---- heads and widths (their limits: fused_qkv_unsupported) --------------------------------
  check.dtype(p.q, "q", DType::kBFloat16);
  const int64_t q_heads = layout.num_heads;
  const int64_t kv_heads = qkvfuse::kv_heads(layout);
  const int64_t rotary_dim = rope::resolved_rotary_dim(layout, head_dim);
  const bool neox = layout.rotary_style == RotaryStyle::kNeox;
  const int64_t tile_n = fused_tile_n(int(head_dim));
  const float eps = layout.eps;

  // ---- outputs --------------------------------------------------------------------------------
  const int64_t out_tokens = layout.paired ? 2 * tokens : tokens;
  const int64_t out_q_heads = layout.paired ? q_heads / 2 : q_heads;
  const int64_t out_kv_heads = layout.paired ? kv_heads / 2 : kv_heads;
  const char* why = layout.paired ? "([2T, H/2, D]: paired)" : "([T, H, D])";
  check.shape(p.q, "q", {out_tokens, out_q_heads, head_dim}, why);
  check.dtype(p.k, "k", DType::kBFloat16);
  check.shape(p.k, "k", {out_tokens, out_kv_heads, head_dim}, why);
  check.dtype(p.v, "v", DType::kBFloat16);
  check.shape(p.v, "v", {tokens, kv_heads, Dim::any("Dv")}, "([T, Hkv, Dv])");
  for (const Arg& out : {outputs[0], outputs[1], outputs[2]}) {
    check.last_dim_contiguous(out.view, out.name);
    check.aligned(out.view, out.name, device);
  }
  if (!is_absent(p.qk)) {
    check.dtype(p.qk, "qk", DType::kBFloat16);
    check.shape(p.qk, "qk", {tokens, q_heads + kv_heads, head_dim}, "([T, Hq + Hkv, D])");
    QKVF_CHECK(p.qk.strides[2] == 1 && p.qk.strides[1] == head_dim &&
                   p.qk.strides[0] >= (q_heads + kv_heads) * head_dim,
               op, ": qk: expected heads packed in rows ([T, (Hq+Hkv)*D] with a row stride), got ",
               p.qk.describe());
    check.aligned(p.qk, "qk", device);
  }

  // ---- weight [N, C] ------------------------------------------------------------------------
  const int64_t qk_cols = (q_heads + kv_heads) * head_dim;
  const int64_t n = qk_cols + kv_heads * v_dim;
  check.dtype(p.weight_f8, "weight_f8", DType::kFloat8E4M3);
  check.shape(p.weight_f8, "weight_f8", {n, channels},
              "([(Hq+Hkv)*D + Hkv*Dv, C]: rows [Wq | Wk | Wv])");
  for (const Arg& matrix : {inputs[0], inputs[1]}) {
    check.row_major(matrix.view, matrix.name);
    const auto address = reinterpret_cast<uintptr_t>(matrix.view.data);
    QKVF_CHECK(matrix.view.strides[0] % 16 == 0 && address % 16 == 0, op, ": ", matrix.name,
               ": expected a row stride that is a multiple of 16 elements and a 16-byte aligned "
               "pointer (TMA), got pointer ", matrix.view.data, " and ", matrix.view.describe());
  }
  for (const Arg& scalar : {inputs[2], inputs[3], inputs[4]}) {
    if (scalar.optional && is_absent(scalar.view)) continue;
    check.scalar_f32(scalar.view, scalar.name);
    check.aligned(scalar.view, scalar.name, device);
  }

  // ---- factor tables ----------------------------------------------------------------------
  const int64_t factor_width = layout.paired ? 2 * head_dim : head_dim;
  check.dtype(layout.factor2, "layout.factor2", layout.factor1.dtype);
  for (const Arg& factor : {inputs[5], inputs[6]}) {
    check.shape(factor.view, factor.name, {tokens, factor_width},
                layout.paired ? "([T, 2D]: paired)" : "([T, D])");
    check.last_dim_contiguous(factor.view, factor.name);
    check.aligned(factor.view, factor.name, device);
  }
  check.no_overlap(outputs, inputs);
  QKVF_CHECK(p.raster >= 0 && p.raster <= 2, op, ": raster must be 0, 1 or 2, got ", p.raster);
  QKVF_CHECK(p.swizzle == 1 || p.swizzle == 2 || p.swizzle == 4 || p.swizzle == 8, op,
             ": swizzle must be 1, 2, 4 or 8, got ", p.swizzle);
  // The epilogue's 32-bit offsets inside a tile (kTileOffsetRows, fused_qkv_gemm_args.hpp): the
  // rows of a tile times the row stride, plus the furthest column a row's offset reaches.
  auto check_tile_offsets = [&](const TensorView& view, const char* name, int64_t row_columns) {
    const int64_t stride = view.strides[0];
    QKVF_CHECK(stride >= 0 && row_columns >= 0 &&
                   stride <= (kInt32Max - row_columns) / kTileOffsetRows,
               op, ": ", name, ": the epilogue addresses ", kTileOffsetRows,
               " rows of a tile with 32-bit offsets: expected a non-negative row stride of at "
               "most (2^31 - 1 - ", row_columns, ") / ", kTileOffsetRows, ", got ",
               view.describe());
  };
  check_tile_offsets(p.q, "q", head_dim);
  check_tile_offsets(p.k, "k", head_dim);
  QKVF_CHECK(p.v.strides[1] >= 0 && p.v.strides[1] <= kInt32Max / kv_heads, op,
             ": v: expected a non-negative head stride with Hkv head strides in int32, got ",
             p.v.describe());
  check_tile_offsets(p.v, "v", kv_heads * p.v.strides[1] + v_dim);
  if (!is_absent(p.qk)) check_tile_offsets(p.qk, "qk", tile_n);
  check_tile_offsets(layout.factor1, "layout.factor1", factor_width);
  check_tile_offsets(layout.factor2, "layout.factor2", factor_width);

  // ---- translate ------------------------------------------------------------------------------
  FusedQkvKernelArgs args;
  args.a = p.x_f8.data;
  args.lda = p.x_f8.strides[0];
  args.b = p.weight_f8.data;
  args.ldb = p.weight_f8.strides[0];
  args.m = int(tokens);
  args.n = int(n);
  args.k = int(channels);
  args.device = device.index;
  args.raster = p.raster;
  args.swizzle = p.swizzle;
  FusedQkvEpilogueArgs& e = args.epilogue;
  e.scale_a = static_cast<const float*>(p.scale_a.data);
  e.scale_b = static_cast<const float*>(p.scale_b.data);
  e.alpha = is_absent(p.alpha) ? nullptr : static_cast<const float*>(p.alpha.data);
  e.tokens = int(tokens);
  e.head_dim = int(head_dim);
  e.q_heads = int(q_heads);
  e.kv_heads = int(kv_heads);
  e.v_dim = int(v_dim);
  e.rotary_dim = int(rotary_dim);
  e.paired = layout.paired;
  e.key_offset = layout.key_offset;
  e.neox = neox;
  e.eps = eps;
  e.factor1 = layout.factor1.data;
  e.factor2 = layout.factor2.data;
  e.factor1_stride = layout.factor1.strides[0];
  e.factor2_stride = layout.factor2.strides[0];
  e.q = static_cast<uint16_t*>(p.q.data);
  e.q_stride_t = p.q.strides[0];
  e.q_stride_h = p.q.strides[1];
  e.k = static_cast<uint16_t*>(p.k.data);
  e.k_stride_t = p.k.strides[0];
  e.k_stride_h = p.k.strides[1];
  e.v = static_cast<uint16_t*>(p.v.data);
  e.v_stride_t = p.v.strides[0];
  e.v_stride_h = p.v.strides[1];
  e.qk = is_absent(p.qk) ? nullptr : static_cast<uint16_t*>(p.qk.data);
  e.qk_stride_t = is_absent(p.qk) ? 0 : p.qk.strides[0];
  return args;
}

}  // namespace

FusedQkvKernelArgs fused_qkv_kernel_args(const FusedQkvGemmParams& params, const std::string& op) {
  Device device;
  FusedQkvKernelArgs args = validate_and_translate(params, op, device);
  if (args.m == 0) return args;
  DeviceGuard guard(device);
  args.sm_count = multiprocessor_count();
  return args;
}

void fused_qkv_gemm(const FusedQkvGemmParams& params) {
  run_fused_qkv_gemm(fused_qkv_kernel_args(params), params.stream);
}

#if QKVFUSE_WITH_CUTLASS

void run_fused_qkv_gemm(const FusedQkvKernelArgs& args, Stream stream) {
  if (args.m == 0) return;
  DeviceGuard guard(Device{DeviceType::kCUDA, args.device});
  switch (args.epilogue.head_dim) {
    case 128:
      if (epilogue_layout(args.epilogue) == EpilogueLayout::kSimple) {
        launch_fused_qkv_gemm<128, EpilogueLayout::kSimple, FusedFactor>(args, stream);
      } else {
        launch_fused_qkv_gemm<128, EpilogueLayout::kGeneral, FusedFactor>(args, stream);
      }
      break;
    // D = 96 and 64: the general kernel for every layout (EpilogueLayout).
    case 96: launch_fused_qkv_gemm<96, EpilogueLayout::kGeneral, FusedFactor>(args, stream); break;
    case 64: launch_fused_qkv_gemm<64, EpilogueLayout::kGeneral, FusedFactor>(args, stream); break;
    default: QKVF_FAIL(kOp, ": no kernel for head width D = ", args.epilogue.head_dim);
  }
}

bool cutlass_gemms_available() { return true; }

#else  // !QKVFUSE_WITH_CUTLASS

// fused_qkv_gemm validates before it gets here, so a bad argument is reported as such.
void run_fused_qkv_gemm(const FusedQkvKernelArgs&, Stream) { throw_without_cutlass(kOp); }

void cutlass_fp8_gemm(const Fp8GemmParams&) { throw_without_cutlass("cutlass_fp8_gemm"); }

bool cutlass_gemms_available() { return false; }

#endif  // QKVFUSE_WITH_CUTLASS

}  // namespace qkvfuse::cuda
