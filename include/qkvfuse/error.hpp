// qkvfuse/error.hpp: the library's one error type and the checks that raise it.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace qkvfuse {

/// Every failure the library reports: bad arguments, unsupported configurations, CUDA and
/// cuBLASLt errors. The message names the offending argument and what was expected, and ends
/// with the source location that raised it.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
template <typename... Args>
[[noreturn]] void throw_error(const char* file, int line, const Args&... args) {
  std::ostringstream message;
  (message << ... << args);
  message << " [" << file << ":" << line << "]";
  throw Error(message.str());
}
}  // namespace detail

}  // namespace qkvfuse

/// Throws qkvfuse::Error built from the streamed arguments when `cond` is false:
///   QKVF_CHECK(heads == 2 * num_heads, "qk: expected 2*num_heads = ", 2 * num_heads,
///              " heads, got ", heads);
#define QKVF_CHECK(cond, ...)                                                \
  do {                                                                        \
    if (!(cond)) ::qkvfuse::detail::throw_error(__FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

#define QKVF_FAIL(...) ::qkvfuse::detail::throw_error(__FILE__, __LINE__, __VA_ARGS__)
