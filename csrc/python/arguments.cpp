// The door for argument checks (see arguments.h).
#include "python/arguments.h"

#include "zbpipe/error.h"

namespace zbpipe::python {

namespace py = pybind11;

namespace {

constexpr Py_ssize_t kShownChars = 60;  // a longer repr is cut to 57 and "..."

py::str steal_str(PyObject* s) {
  if (!s) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(s);
}

}  // namespace

// Built as a Python str, never through UTF-8: the message is the text Python shows, whatever
// a repr holds.
py::str wrong_type_message(const char* function, const char* name, const char* takes,
                           const py::handle& value) {
  py::str shown = py::repr(value);
  if (PyUnicode_GetLength(shown.ptr()) > kShownChars) {
    const py::str head = steal_str(PyUnicode_Substring(shown.ptr(), 0, kShownChars - 3));
    shown = steal_str(PyUnicode_FromFormat("%U...", head.ptr()));
  }
  const py::str type_name(py::type::handle_of(value).attr("__name__"));
  return steal_str(PyUnicode_FromFormat("%s: %s must be %s, got %U %U", function, name, takes,
                                        type_name.ptr(), shown.ptr()));
}

void wrong_type(const char* function, const char* name, const char* takes, const py::handle& value) {
  const py::str message = wrong_type_message(function, name, takes, value);
  PyErr_SetObject(PyExc_TypeError, message.ptr());
  throw py::error_already_set();
}

std::string str_arg(const py::handle& value, const char* function, const char* name, const char* takes) {
  if (!py::isinstance<py::str>(value)) wrong_type(function, name, takes, value);
  Py_ssize_t size = 0;
  const char* utf8 = PyUnicode_AsUTF8AndSize(value.ptr(), &size);
  if (!utf8) {
    PyErr_Clear();
    throw ScheduleError(std::string(function) + ": " + name +
                        " is not valid text (it holds a lone surrogate, which UTF-8 cannot encode)");
  }
  return std::string(utf8, static_cast<size_t>(size));
}

std::string path_arg(const py::handle& value, const char* function, const char* name) {
  const char* takes = "a path (str, bytes or os.PathLike)";
  if (!py::isinstance<py::str>(value) && !py::isinstance<py::bytes>(value) &&
      !py::hasattr(value, "__fspath__"))
    wrong_type(function, name, takes, value);
  return arg<std::string>(py::module_::import("os").attr("fspath")(value), function, name, takes);
}

py::str wrong_type_message_arg(const std::string& function, const std::string& name,
                               const std::string& takes, const py::handle& value) {
  return wrong_type_message(function.c_str(), name.c_str(), takes.c_str(), value);
}

void check_text_arg(const std::string& function, const std::string& name, const py::handle& value) {
  str_arg(value, function.c_str(), name.c_str());
}

}  // namespace zbpipe::python
