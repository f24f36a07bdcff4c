// placeholder: tests/test_cuda_numeric.cu
