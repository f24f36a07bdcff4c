// placeholder: src/cuda/fp8_gemm_cublaslt.cpp
