// An exception the autograd engine threw out of a stage's backward, named as Python names it:
// torch's C++ errors (c10::Error and its kinds) become a StageError whose summary is
// "<PythonType>: <message>", without the C++ backtrace that c10::Error::what() carries.
#pragma once

#include <exception>

namespace zbpipe::runtime {

// `error` as the step's failure reports it: a c10::Error as a StageError, anything else as it is.
std::exception_ptr name_engine_error(std::exception_ptr error);

}  // namespace zbpipe::runtime
