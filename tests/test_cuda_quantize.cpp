// placeholder: tests/test_cuda_quantize.cpp
