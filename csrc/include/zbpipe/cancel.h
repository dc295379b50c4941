// Cooperative cancellation of the core's long loops (builders, passes, validation, the
// simulator, the list search), so that an embedding layer can stop a call, for example on
// Ctrl-C. The core stays free of Python: the embedding layer supplies the test.
//
// A CancelScope installs a poller on the calling thread for its lifetime. Long loops call
// poll_cancel(), which costs a thread-local countdown almost every time; every kPollStride
// calls it reads the clock and, at most once per interval, runs the poller. The poller cancels
// by throwing; that exception propagates out of the core call unchanged, and from then on
// every thread sharing the scope (CancelShare) throws Cancelled at its next poll.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <memory>

namespace zbpipe {

// What a thread sharing a cancelled scope throws. Not a ScheduleError: `except ScheduleError`
// must not swallow an interrupt.
class Cancelled : public std::exception {
 public:
  const char* what() const noexcept override { return "zbpipe: cancelled"; }
};

namespace detail {
struct CancelState;
}

// Contract: constructed and destroyed on the same thread; not nested on one thread (an inner
// scope replaces the outer one until it ends). Blocks nothing; the poller runs on this thread.
class CancelScope {
 public:
  CancelScope(std::function<void()> poller, std::chrono::milliseconds interval);
  ~CancelScope();
  CancelScope(const CancelScope&) = delete;
  CancelScope& operator=(const CancelScope&) = delete;

 private:
  std::shared_ptr<detail::CancelState> state_;
  std::shared_ptr<detail::CancelState> outer_;
};

// Carries the calling thread's scope (if any) into a thread the core starts: construct it on
// the parent, then call join() first thing in the child. Polls there only check whether the
// scope was cancelled (the poller itself runs on its own thread only).
class CancelShare {
 public:
  CancelShare();
  // Installs the parent's scope on this thread until the returned guard ends.
  class Joined {
   public:
    explicit Joined(std::shared_ptr<detail::CancelState> state);
    ~Joined();
    Joined(const Joined&) = delete;
    Joined& operator=(const Joined&) = delete;

   private:
    std::shared_ptr<detail::CancelState> outer_;
  };
  Joined join() const { return Joined(state_); }

 private:
  std::shared_ptr<detail::CancelState> state_;
};

namespace detail {
extern thread_local int cancel_countdown;
void poll_cancel_slow();
}  // namespace detail

// Polls between kPollStride calls: cheap enough for inner loops of a few hundred nanoseconds.
inline constexpr int kPollStride = 256;
inline void poll_cancel() {
  if (--detail::cancel_countdown <= 0) detail::poll_cancel_slow();
}
// Polls now, without the countdown: for a thread about to block a while (the poller still
// runs at most once per interval).
inline void poll_cancel_now() { detail::poll_cancel_slow(); }
// Throws Cancelled at once if the calling thread's scope was cancelled (no poller call).
void throw_if_cancelled();

}  // namespace zbpipe
