// placeholder: src/cuda/grad_weight_finalize.cu
