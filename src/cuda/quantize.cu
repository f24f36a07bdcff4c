// placeholder: src/cuda/quantize.cu
