// placeholder: tests/test_cuda_qk_norm_rope.cpp
