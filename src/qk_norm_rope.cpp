// placeholder: src/qk_norm_rope.cpp
