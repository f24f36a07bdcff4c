// qkvfuse/error.hpp: the library's one error type and the checks that raise it.
#pragma once

#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace qkvfuse {

/// Every failure the library reports: bad arguments, unsupported configurations, CUDA and
/// cuBLASLt errors. The message names the offending argument and what was expected, and ends
/// with the source location that raised it.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

// Messages are built with std::to_string and snprintf, not iostreams: numeric insertion into a
// stream goes through the process's global locale facets, and inside a PyTorch process on the GPU
// machine that crashed in this library's copy of ostream::_M_insert<long> (seen with torch 2.11).
inline void append(std::string& out, const std::string& text) { out += text; }
inline void append(std::string& out, std::string_view text) { out += text; }
inline void append(std::string& out, const char* text) { out += text ? text : "(null)"; }
inline void append(std::string& out, char c) { out += c; }
inline void append(std::string& out, bool value) { out += value ? "true" : "false"; }
inline void append(std::string& out, const void* pointer) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%p", pointer);
  out += buffer;
}
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
void append(std::string& out, T value) {
  out += std::to_string(value);
}
template <typename T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
void append(std::string& out, T value) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.9g", double(value));
  out += buffer;
}

/// The arguments formatted and joined, as QKVF_CHECK formats its messages.
template <typename... Args>
std::string concat(const Args&... args) {
  std::string out;
  (append(out, args), ...);
  return out;
}

template <typename... Args>
[[noreturn]] void throw_error(const char* file, int line, const Args&... args) {
  std::string message = concat(args...);
  append(message, " [");
  append(message, file);
  append(message, ":");
  append(message, line);
  append(message, "]");
  throw Error(message);
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
