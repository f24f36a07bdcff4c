// placeholder: src/cpu/quantize.cpp
