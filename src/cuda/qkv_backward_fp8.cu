// placeholder: src/cuda/qkv_backward_fp8.cu
