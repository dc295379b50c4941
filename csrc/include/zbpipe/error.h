// One error header for the whole project: ZB_CHECK for internal invariants and backend calls,
// ZB_SCHEDULE_CHECK for user-facing schedule constraints (surfaces as zbpipe.ScheduleError).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace zbpipe {

namespace detail {
// what() is a C string: a NUL in a message (from a user's text) would end it there, so each is
// written out as \x00.
inline std::string without_nul(const std::string& what) {
  if (what.find('\0') == std::string::npos) return what;
  std::string out;
  out.reserve(what.size() + 16);
  for (char c : what) {
    if (c == '\0')
      out += "\\x00";
    else
      out += c;
  }
  return out;
}
}  // namespace detail

// An invalid schedule request or an invalid program: bound to Python as zbpipe.ScheduleError,
// a ValueError subclass. The message names the constraint and the values given.
class ScheduleError : public std::invalid_argument {
 public:
  explicit ScheduleError(const std::string& what) : std::invalid_argument(detail::without_nul(what)) {}
};

// Anything else that went wrong (internal invariant, backend failure): a RuntimeError.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(detail::without_nul(what)) {}
};

namespace detail {
inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
void append(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  append(os, rest...);
}
template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  append(os, args...);
  return os.str();
}
}  // namespace detail

}  // namespace zbpipe

// Throws zbpipe::Error with file:line, the failed condition and the streamed values.
#define ZB_CHECK(cond, ...)                                                              \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      throw ::zbpipe::Error(::zbpipe::detail::str(__FILE__, ":", __LINE__, ": check `",  \
                                                  #cond, "` failed: ", ##__VA_ARGS__));  \
    }                                                                                    \
  } while (0)

// Throws zbpipe::ScheduleError with the streamed message (no file:line: it is user input).
#define ZB_SCHEDULE_CHECK(cond, ...)                                           \
  do {                                                                         \
    if (!(cond)) {                                                             \
      throw ::zbpipe::ScheduleError(::zbpipe::detail::str(__VA_ARGS__));      \
    }                                                                          \
  } while (0)
