// placeholder: tests/test_tensor.cpp
