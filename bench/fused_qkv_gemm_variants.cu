// fused_qkv_gemm_variants.cu: the fused QKV GEMM at D = 128 with parts of its epilogue switched
// off (EpilogueWork, src/cuda/fused_qkv_gemm_args.hpp), for bench_fused_qkv_gemm.cu's rows
// "fused store-only" and "fused norm-only": their times against "cutlass" and "fused" say what
// the stores, the norm and the factor loads + rotary each cost, on the simple layout's kernel
// (EpilogueLayout::kSimple, the benchmark's layout). Built into the benchmark only (each CUTLASS
// instantiation is about a minute of nvcc, and the op never runs them); the library instantiates
// EpilogueWork::kFull (fused_qkv_gemm_d128_simple.cu).
#include "cuda/fused_qkv_gemm_kernel.cuh"

namespace qkvfuse::cuda {
template void launch_fused_qkv_gemm<128, EpilogueLayout::kSimple, FusedFactor,
                                    EpilogueWork::kStoreOnly>(const FusedQkvKernelArgs& args,
                                                              Stream stream);
template void launch_fused_qkv_gemm<128, EpilogueLayout::kSimple, FusedFactor,
                                    EpilogueWork::kNormOnly>(const FusedQkvKernelArgs& args,
                                                             Stream stream);
}  // namespace qkvfuse::cuda
