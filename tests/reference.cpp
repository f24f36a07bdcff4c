// placeholder: tests/reference.cpp
