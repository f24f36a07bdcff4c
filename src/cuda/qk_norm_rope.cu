// placeholder: src/cuda/qk_norm_rope.cu
