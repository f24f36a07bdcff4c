// placeholder: src/cpu/fp8_gemm.cpp
