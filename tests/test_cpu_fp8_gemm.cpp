// placeholder: tests/test_cpu_fp8_gemm.cpp
