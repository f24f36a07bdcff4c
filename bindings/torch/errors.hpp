// errors.hpp: the library's errors as Python users see them.
//
// qkvfuse::Error messages speak the C++ API (qkvfuse/error.hpp): the layout's fields are
// `layout.factor1`, enum values `RotaryStyle::kNeox`, dtypes `bfloat16`, flags `true`, and the
// message ends with the throwing file and line. A Python caller passed `factor1=`, the string
// "neox" and torch.bfloat16, and has no use for a path into the build tree. So every kernel of
// the binding runs under python_errors, which rethrows a qkvfuse::Error as a c10::Error (Python's
// RuntimeError, as for torch's own argument errors) whose message is the library's in Python's
// terms (python_message) and whose C++ source location is the library's file and line: Python
// shows it, with the C++ stack, when TORCH_SHOW_CPP_STACKTRACES=1 (torch's own switch for its
// C++ locations; README.md). The C++ API's messages are unchanged.
#pragma once

#include <initializer_list>
#include <string>
#include <string_view>

#include "qkvfuse/error.hpp"

namespace qkvfuse::torch_binding {

/// A library argument name and the Python argument it is (e.g. the quantize ops' `src` is
/// quantize_dual_layout's `x`).
struct Rename {
  std::string_view library;
  std::string_view python;
};

/// The message in Python's terms. Each name-like token (letters, digits, `_`, joined by `.` or
/// `::`) is rewritten: `layout.<field>` to `<field>` (the Python functions take the layout's
/// fields as arguments of the same names), a dtype to its torch name (`torch.bfloat16`), an enum
/// value to the string the Python API takes (`RotaryStyle::kNeox` to `"neox"`), `true`/`false` to
/// `True`/`False`, and `renames`' library names to their Python names. Other text is kept.
std::string python_message(std::string_view message, std::initializer_list<Rename> renames = {});

/// Rethrows `error` as described above.
[[noreturn]] void rethrow_for_python(const Error& error, std::initializer_list<Rename> renames);

/// `body()`, with a qkvfuse::Error escaping it rethrown for Python.
template <typename Body>
decltype(auto) python_errors(Body&& body, std::initializer_list<Rename> renames = {}) {
  try {
    return body();
  } catch (const Error& error) {
    rethrow_for_python(error, renames);
  }
}

}  // namespace qkvfuse::torch_binding
