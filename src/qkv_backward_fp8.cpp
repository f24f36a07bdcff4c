// placeholder: src/qkv_backward_fp8.cpp
