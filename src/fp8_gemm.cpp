// placeholder: src/fp8_gemm.cpp
