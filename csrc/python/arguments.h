// The door for argument checks, in both languages: one-line TypeErrors for wrong argument types
// (in place of pybind11's dump of every signature) and the lone-surrogate ScheduleError. The
// bindings call these directly; zbpipe/_door.py (compile, simulate, refine) through
// zbpipe._C._wrong_type_message and _check_text.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

namespace zbpipe::python {

// "Program.from_actions: ranks must be a list of lists of action strings, got int 5": the
// type's __name__ and its repr, cut to 57 characters (code points, not UTF-8 bytes) and "..."
// when longer than 60.
pybind11::str wrong_type_message(const char* function, const char* name, const char* takes,
                                 const pybind11::handle& value);
// Raises that message as a TypeError.
[[noreturn]] void wrong_type(const char* function, const char* name, const char* takes,
                             const pybind11::handle& value);

// Argument `name` of `function` converted to T, or a one-line TypeError saying what it takes.
// Strings are not sequences here (pybind11 never reads a str as a list of characters).
template <typename T>
T arg(const pybind11::handle& value, const char* function, const char* name, const char* takes) {
  namespace py = pybind11;
  py::detail::make_caster<T> caster;
  if (!caster.load(value, /*convert=*/true)) wrong_type(function, name, takes, value);
  return py::detail::cast_op<T>(std::move(caster));
}

// A str argument (bytes are not text here). One that UTF-8 cannot encode (a lone surrogate)
// is a ScheduleError, as any other text the core cannot read.
std::string str_arg(const pybind11::handle& value, const char* function, const char* name,
                    const char* takes = "a str");

// A filesystem path argument: a str, bytes or os.PathLike, as open() takes.
std::string path_arg(const pybind11::handle& value, const char* function, const char* name);

// The door as zbpipe._C exposes it to zbpipe/_door.py.
pybind11::str wrong_type_message_arg(const std::string& function, const std::string& name,
                                     const std::string& takes, const pybind11::handle& value);
void check_text_arg(const std::string& function, const std::string& name,
                    const pybind11::handle& value);

}  // namespace zbpipe::python
