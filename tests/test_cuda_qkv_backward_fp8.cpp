// placeholder: tests/test_cuda_qkv_backward_fp8.cpp
