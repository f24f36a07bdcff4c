// placeholder: src/validate.cpp
