// placeholder: tests/test_cuda_packed_qkv.cpp
