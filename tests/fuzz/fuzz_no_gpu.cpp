// fuzz_no_gpu.cpp: the fuzz harness's GPU hooks when qkvfuse is built without CUDA: GPU mode
// reports why it cannot run (and the driver exits with the skip code).
#include <stdexcept>

#include "fuzz.hpp"

namespace qkvfuse::fuzz {

std::string gpu_unavailable_reason() { return "qkvfuse was built without its CUDA backend"; }

std::unique_ptr<Memory> make_gpu_memory(uint64_t) {
  throw std::logic_error("fuzz: GPU mode in a build without CUDA");
}

std::string gpu_error_state() { return ""; }

std::string gpu_name() { return "none"; }

}  // namespace qkvfuse::fuzz
