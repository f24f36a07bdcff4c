// placeholder: tests/test_cpu_packed_qkv.cpp
