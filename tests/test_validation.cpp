// placeholder: tests/test_validation.cpp
