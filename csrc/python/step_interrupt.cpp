// StepInterrupt: one process-wide pipe and watcher thread, armed per step.
#include "python/step_interrupt.h"

#include <Python.h>
#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <mutex>
#include <thread>

namespace zbpipe::python {

namespace {

struct Watcher {
  int read_fd = -1, write_fd = -1;
  std::mutex mu;                    // guards on_sigint and forward_fd against disarming
  std::function<void()> on_sigint;  // the armed step's, or empty
  int forward_fd = -1;              // where bytes go on (the previous wakeup fd)

  // Reads signal numbers until the process ends (a daemon: it never touches Python).
  void loop() {
    unsigned char buf[64];
    for (;;) {
      pollfd p{read_fd, POLLIN, 0};
      if (::poll(&p, 1, -1) <= 0) continue;
      const ssize_t n = ::read(read_fd, buf, sizeof(buf));
      if (n <= 0) continue;
      std::lock_guard<std::mutex> lock(mu);
      if (forward_fd >= 0) (void)!::write(forward_fd, buf, static_cast<size_t>(n));
      for (ssize_t i = 0; i < n; ++i)
        if (buf[i] == SIGINT && on_sigint) {
          on_sigint();
          break;
        }
    }
  }
};

// Made on first use; lives for the process (its thread is detached).
Watcher* watcher() {
  static Watcher* w = [] {
    int fds[2];
    if (::pipe(fds) != 0) return static_cast<Watcher*>(nullptr);
    for (int fd : fds) {
      ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);  // Python requires it of a wakeup fd
      ::fcntl(fd, F_SETFD, FD_CLOEXEC);
    }
    auto* made = new Watcher{fds[0], fds[1]};
    std::thread([made] { made->loop(); }).detach();
    return made;
  }();
  return w;
}

bool on_main_thread() {
  PyObject* threading = PyImport_ImportModule("threading");
  if (!threading) {
    PyErr_Clear();
    return false;
  }
  PyObject* main = PyObject_CallMethod(threading, "main_thread", nullptr);
  PyObject* current = PyObject_CallMethod(threading, "current_thread", nullptr);
  const bool same = main && current && main == current;
  Py_XDECREF(main);
  Py_XDECREF(current);
  Py_DECREF(threading);
  if (PyErr_Occurred()) PyErr_Clear();
  return same;
}

// signal.set_wakeup_fd(fd): the previous fd, or -2 where it failed (the error is cleared).
int set_wakeup_fd(int fd) {
  PyObject* signal = PyImport_ImportModule("signal");
  PyObject* previous = signal ? PyObject_CallMethod(signal, "set_wakeup_fd", "i", fd) : nullptr;
  const int out = previous ? static_cast<int>(PyLong_AsLong(previous)) : -2;
  Py_XDECREF(previous);
  Py_XDECREF(signal);
  if (PyErr_Occurred()) PyErr_Clear();
  return out;
}

}  // namespace

StepInterrupt::StepInterrupt(std::function<void()> on_sigint) {
  if (!on_main_thread()) return;
  Watcher* w = watcher();
  if (!w) return;
  std::lock_guard<std::mutex> lock(w->mu);
  previous_fd_ = set_wakeup_fd(w->write_fd);
  if (previous_fd_ == -2) return;
  w->forward_fd = previous_fd_ == w->write_fd ? -1 : previous_fd_;
  w->on_sigint = std::move(on_sigint);
  armed_ = true;
}

StepInterrupt::~StepInterrupt() {
  if (!armed_) return;
  Watcher* w = watcher();
  std::lock_guard<std::mutex> lock(w->mu);  // waits for a call of on_sigint in progress
  set_wakeup_fd(previous_fd_);
  w->on_sigint = nullptr;
  w->forward_fd = -1;
}

}  // namespace zbpipe::python
