// errors.cpp: qkvfuse::Error rewritten in Python's terms (errors.hpp).
#include "errors.hpp"

#include <c10/util/Exception.h>

#include <cctype>

namespace qkvfuse::torch_binding {
namespace {

/// The library's dtype names (qkvfuse::dtype_name) are torch's without the `torch.` prefix.
constexpr std::string_view kDtypes[] = {"bfloat16",      "float16",     "float32", "float64",
                                        "float8_e4m3fn", "float8_e5m2", "int32",   "int64"};

/// Enum values of the C++ API that the Python API takes as strings, spelled qualified in the
/// library's messages so that no other word can match.
constexpr Rename kEnumValues[] = {
    {"RotaryStyle::kInterleaved", "\"interleaved\""},
    {"RotaryStyle::kNeox", "\"neox\""},
    {"NormScope::kHead", "\"head\""},
    {"NormScope::kToken", "\"token\""},
    {"true", "True"},
    {"false", "False"},
};

constexpr std::string_view kLayoutPrefix = "layout.";

bool is_word(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

std::string python_token(std::string_view token, std::initializer_list<Rename> renames) {
  const size_t prefix = kLayoutPrefix.size();
  if (token.size() > prefix && token.substr(0, prefix) == kLayoutPrefix) {
    token.remove_prefix(prefix);
  }
  for (std::string_view dtype : kDtypes) {
    if (token == dtype) return "torch." + std::string(dtype);
  }
  for (const Rename& value : kEnumValues) {
    if (token == value.library) return std::string(value.python);
  }
  for (const Rename& rename : renames) {
    if (token == rename.library) return std::string(rename.python);
  }
  return std::string(token);
}

}  // namespace

std::string python_message(std::string_view message, std::initializer_list<Rename> renames) {
  std::string out;
  out.reserve(message.size() + 32);
  size_t i = 0;
  while (i < message.size()) {
    if (!is_word(message[i])) {
      out += message[i++];
      continue;
    }
    // One token: words joined by '.' or "::" (layout.factor1, RotaryStyle::kNeox, 1.5e).
    size_t end = i;
    for (;;) {
      while (end < message.size() && is_word(message[end])) ++end;
      if (end + 1 < message.size() && message[end] == '.' && is_word(message[end + 1])) {
        end += 1;
      } else if (end + 2 < message.size() && message.compare(end, 2, "::") == 0 &&
                 is_word(message[end + 2])) {
        end += 2;
      } else {
        break;
      }
    }
    out += python_token(message.substr(i, end - i), renames);
    i = end;
  }
  return out;
}

void rethrow_for_python(const Error& error, std::initializer_list<Rename> renames) {
  // c10::SourceLocation keeps the pointers: the function name is a literal and the file is the
  // library's __FILE__ (a literal too), so both outlive the exception.
  const c10::SourceLocation where{"qkvfuse", *error.file() ? error.file() : "qkvfuse",
                                  uint32_t(error.line())};
  throw c10::Error(where, python_message(error.message(), renames));
}

}  // namespace qkvfuse::torch_binding
