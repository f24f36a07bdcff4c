// placeholder: tests/test_numeric.cpp
