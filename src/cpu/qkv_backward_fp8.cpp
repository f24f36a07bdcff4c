// placeholder: src/cpu/qkv_backward_fp8.cpp
