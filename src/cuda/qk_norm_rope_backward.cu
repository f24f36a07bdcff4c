// placeholder: src/cuda/qk_norm_rope_backward.cu
