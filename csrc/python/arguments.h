// One-line TypeErrors for wrong argument types, in place of pybind11's dump of every signature.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "zbpipe/error.h"

namespace zbpipe::python {

// "Program.from_actions: ranks must be a list of lists of action strings, got int 5".
[[noreturn]] inline void wrong_type(const char* function, const char* name, const char* takes,
                                    const pybind11::handle& value) {
  namespace py = pybind11;
  std::string shown = py::repr(value).cast<std::string>();
  if (shown.size() > 60) {
    size_t cut = 57;
    while (cut > 0 && (static_cast<unsigned char>(shown[cut]) & 0xC0) == 0x80) --cut;  // UTF-8
    shown = shown.substr(0, cut) + "...";
  }
  throw py::type_error(std::string(function) + ": " + name + " must be " + takes + ", got " +
                       Py_TYPE(value.ptr())->tp_name + " " + shown);
}

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
inline std::string str_arg(const pybind11::handle& value, const char* function, const char* name,
                           const char* takes = "a str") {
  if (!pybind11::isinstance<pybind11::str>(value)) wrong_type(function, name, takes, value);
  Py_ssize_t size = 0;
  const char* utf8 = PyUnicode_AsUTF8AndSize(value.ptr(), &size);
  if (!utf8) {
    PyErr_Clear();
    throw ScheduleError(std::string(function) + ": " + name +
                        " is not valid text (it holds a lone surrogate, which UTF-8 cannot encode)");
  }
  return std::string(utf8, static_cast<size_t>(size));
}

// A filesystem path argument: a str, bytes or os.PathLike, as open() takes.
inline std::string path_arg(const pybind11::handle& value, const char* function, const char* name) {
  namespace py = pybind11;
  const char* takes = "a path (str, bytes or os.PathLike)";
  if (!py::isinstance<py::str>(value) && !py::isinstance<py::bytes>(value) &&
      !py::hasattr(value, "__fspath__"))
    wrong_type(function, name, takes, value);
  return arg<std::string>(py::module_::import("os").attr("fspath")(value), function, name, takes);
}

}  // namespace zbpipe::python
