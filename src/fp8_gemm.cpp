// fp8_gemm.cpp: the public FP8 GEMM entry point: validate, skip empty work, dispatch.
#include "qkvfuse/fp8_gemm.hpp"

#include <cstdint>
#include <vector>

#include "backend.hpp"
#include "qkvfuse/error.hpp"
#include "validate.hpp"

namespace qkvfuse {

namespace validate {
namespace {

/// cuBLASLt's FP8 requirements: dims and leading dimensions multiples of 16, 16-byte pointers.
void check_cublaslt_fp8(const Checker& check, const Fp8GemmParams& p) {
  const int64_t m = p.a.sizes[0];
  const int64_t n = p.b.sizes[0];
  const int64_t k = p.a.sizes[1];
  QKVF_CHECK(m % 16 == 0 && n % 16 == 0 && k % 16 == 0 && k > 0, check.op(),
             ": a, b: on CUDA, expected M (a's rows), N (b's rows) and K to be multiples of 16 "
             "with K > 0 (cuBLASLt FP8), got M = ",
             m, ", N = ", n, ", K = ", k);
  for (const Arg& matrix : {Arg{p.a, "a"}, Arg{p.b, "b"}, Arg{p.d, "d"}}) {
    const auto address = reinterpret_cast<uintptr_t>(matrix.view.data);
    QKVF_CHECK(matrix.view.strides[0] % 16 == 0 && address % 16 == 0, check.op(), ": ", matrix.name,
               ": on CUDA, expected a row stride that is a multiple of 16 elements ",
               "and a 16-byte aligned pointer (cuBLASLt FP8), got pointer ", matrix.view.data,
               " and ", matrix.view.describe());
  }
}

}  // namespace

Device validate_fp8_gemm(const Fp8GemmParams& p, const std::string& op) {
  const Checker check(op);
  const std::vector<Arg> inputs = {{p.a, "a"},
                                   {p.b, "b"},
                                   {p.scale_a, "scale_a"},
                                   {p.scale_b, "scale_b"},
                                   {p.alpha, "alpha", /*optional=*/true}};
  const std::vector<Arg> outputs = {{p.d, "d"}};
  const Device device = check.same_device(concat(inputs, outputs));
  check.dtype(p.a, "a", DType::kFloat8E4M3);
  check.ndim(p.a, "a", 2);
  const int64_t m = p.a.sizes[0];
  const int64_t k = p.a.sizes[1];
  check.dtype(p.b, "b", DType::kFloat8E4M3);
  check.shape(p.b, "b", {Dim::any("N"), k}, "(K from a: both operands are K-major)");
  const int64_t n = p.b.sizes[0];
  check.dtype(p.d, "d", DType::kBFloat16);
  check.shape(p.d, "d", {m, n}, "([M, N]: M from a, N from b)");
  for (const Arg& matrix : {inputs[0], inputs[1], outputs[0]}) {
    check.row_major(matrix.view, matrix.name);
    check.aligned(matrix.view, matrix.name, device);
  }
  for (const Arg& scalar : {inputs[2], inputs[3], inputs[4]}) {
    if (scalar.optional && is_absent(scalar.view)) continue;
    check.scalar_f32(scalar.view, scalar.name);
    check.aligned(scalar.view, scalar.name, device);
  }
  if (device.type == DeviceType::kCUDA) check_cublaslt_fp8(check, p);
  check.no_overlap(outputs, inputs);
  return device;
}

}  // namespace validate

void fp8_gemm(const Fp8GemmParams& params) {
  const Device device = validate::validate_fp8_gemm(params, "fp8_gemm");
  // M or N = 0: nothing to write. K = 0 (CPU only) writes zeros: the empty sum.
  if (params.d.numel() == 0) return;
  if (device.type == DeviceType::kCUDA) {
    cuda::fp8_gemm(params);
  } else {
    cpu::fp8_gemm(params);
  }
}

}  // namespace qkvfuse
