// placeholder: src/quantize.cpp
