// placeholder: tests/test_cpu_quantize.cpp
