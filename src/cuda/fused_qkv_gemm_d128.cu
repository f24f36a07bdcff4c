// fused_qkv_gemm_d128.cu: the fused QKV GEMM for head width D = 128, every layout
// (EpilogueLayout::kGeneral; fused_qkv_gemm_kernel.cuh). One
// CUTLASS kernel per file: each takes about a minute of nvcc, and separate files build in parallel.
#include "cuda/fused_qkv_gemm_kernel.cuh"

namespace qkvfuse::cuda {
template void launch_fused_qkv_gemm<128, EpilogueLayout::kGeneral, FusedFactor>(
    const FusedQkvKernelArgs& args, Stream stream);
}  // namespace qkvfuse::cuda
