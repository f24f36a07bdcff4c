// placeholder: src/cpu/grad_weight_finalize.cpp
