// fused_qkv_gemm_d128_simple.cu: the fused QKV GEMM for head width D = 128 and the simple layout
// (EpilogueLayout::kSimple: interleaved, r = D, no key offset, not paired), the hot path
// (fused_qkv_gemm_kernel.cuh). One CUTLASS kernel per file: each takes about a minute of nvcc, and
// separate files build in parallel.
#include "cuda/fused_qkv_gemm_kernel.cuh"

namespace qkvfuse::cuda {
template void launch_fused_qkv_gemm<128, EpilogueLayout::kSimple, FusedFactor>(
    const FusedQkvKernelArgs& args, Stream stream);
}  // namespace qkvfuse::cuda
