// Torch's C++ errors under their Python names (engine_error.h).
#include "runtime/engine_error.h"

#include <c10/util/Exception.h>

#include <string>

#include "runtime/errors.h"

namespace zbpipe::runtime {

namespace {

// The Python exception torch raises for `e` (torch/csrc/Exceptions.h's translation).
const char* python_name(const c10::Error& e) {
  if (dynamic_cast<const c10::IndexError*>(&e)) return "IndexError";
  if (dynamic_cast<const c10::ValueError*>(&e)) return "ValueError";
  if (dynamic_cast<const c10::TypeError*>(&e)) return "TypeError";
  if (dynamic_cast<const c10::NotImplementedError*>(&e)) return "NotImplementedError";
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e)) return "torch.OutOfMemoryError";
  if (dynamic_cast<const c10::LinAlgError*>(&e)) return "torch.linalg.LinAlgError";
  return "RuntimeError";
}

}  // namespace

std::exception_ptr name_engine_error(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error& e) {
    return std::make_exception_ptr(StageError(std::string(python_name(e)) + ": " + e.what_without_backtrace(), ""));
  } catch (...) {
    return error;
  }
}

}  // namespace zbpipe::runtime
