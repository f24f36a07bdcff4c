// placeholder: src/cpu/qk_norm_rope.cpp
