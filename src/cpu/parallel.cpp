// placeholder: src/cpu/parallel.cpp
