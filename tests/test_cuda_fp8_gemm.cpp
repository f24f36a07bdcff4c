// placeholder: tests/test_cuda_fp8_gemm.cpp
