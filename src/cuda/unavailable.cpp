// unavailable.cpp: the CUDA backend of a build without nvcc. Every entry throws, so a CUDA
// tensor handed to a CPU-only build gets a clear error rather than a crash.
#include "backend.hpp"
#include "qkvfuse/error.hpp"
#include "qkvfuse/qkvfuse.hpp"

namespace qkvfuse {

bool built_with_cuda() { return false; }
int cuda_device_count() { return 0; }

namespace cuda {
namespace {
[[noreturn]] void unavailable(const char* op) {
  QKVF_FAIL(op, ": got CUDA tensors, but qkvfuse was built without CUDA (nvcc was not found "
                "when it was configured)");
}
}  // namespace

void qk_norm_rope(const QkNormRopeParams&) { unavailable("qk_norm_rope"); }
void qk_norm_rope_backward(const QkNormRopeBackwardParams&) { unavailable("qk_norm_rope_backward"); }
void qkv_backward_fp8(const QkvBackwardFp8Params&) { unavailable("qkv_backward_fp8"); }
void quantize_dual_layout(const QuantizeDualParams&) { unavailable("quantize_dual_layout"); }
void quantize_weight_bank(const QuantizeWeightBankParams&) { unavailable("quantize_weight_bank"); }
void fp8_gemm(const Fp8GemmParams&) { unavailable("fp8_gemm"); }
void grad_weight_finalize(const GradWeightFinalizeParams&) { unavailable("packed_qkv_backward"); }
void check_pointer_on_device(const void*, Device, const char* name) { unavailable(name); }
int64_t backward_workspace_size(const QkNormRopeBackwardParams&) {
  unavailable("qk_norm_rope_backward");
}
int64_t backward_workspace_size(const QkvBackwardFp8Params&) { unavailable("qkv_backward_fp8"); }
BadPosition find_bad_position(const TensorView&, int64_t, Stream) {
  unavailable("check_positions");
}

}  // namespace cuda

}  // namespace qkvfuse
