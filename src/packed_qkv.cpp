// placeholder: src/packed_qkv.cpp
