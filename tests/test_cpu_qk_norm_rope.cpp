// placeholder: tests/test_cpu_qk_norm_rope.cpp
