// qkvfuse/error.hpp: the library's one error type and the checks that raise it.
#pragma once

#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace qkvfuse {

/// Every failure the library reports: bad arguments, unsupported configurations, CUDA and
/// cuBLASLt errors. what() is the message, which names the offending argument and what was
/// expected, followed by the source location that raised it: "<message> [<file>:<line>]".
/// message(), file() and line() are those parts on their own (the PyTorch binding shows Python
/// users the message in Python's terms and keeps the location for debugging; README.md).
class Error : public std::runtime_error {
 public:
  /// A message with no source location (file() is "", line() 0).
  explicit Error(const std::string& message) : Error(message, "", 0) {}
  /// `file` must outlive the error (QKVF_CHECK passes __FILE__, a string literal).
  Error(const std::string& message, const char* file, int line)
      : std::runtime_error(*file ? message + " [" + file + ":" + std::to_string(line) + "]"
                                 : message),
        message_(message),
        file_(file),
        line_(line) {}

  const std::string& message() const { return message_; }
  const char* file() const { return file_; }
  int line() const { return line_; }

 private:
  std::string message_;
  const char* file_;
  int line_;
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
  throw Error(concat(args...), file, line);
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
