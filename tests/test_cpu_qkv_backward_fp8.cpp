// placeholder: tests/test_cpu_qkv_backward_fp8.cpp
