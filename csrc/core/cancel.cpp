// The cancellation scope behind poll_cancel() (see cancel.h).
#include "zbpipe/cancel.h"

#include <atomic>
#include <thread>
#include <utility>

namespace zbpipe {

namespace detail {

struct CancelState {
  std::function<void()> poller;
  std::chrono::milliseconds interval;
  std::thread::id owner;
  std::chrono::steady_clock::time_point next_poll;  // owner thread only
  std::atomic<bool> cancelled{false};
};

thread_local int cancel_countdown = kPollStride;

namespace {
thread_local std::shared_ptr<CancelState> t_scope;
}

void poll_cancel_slow() {
  cancel_countdown = kPollStride;
  CancelState* s = t_scope.get();
  if (!s) return;
  if (s->cancelled.load(std::memory_order_relaxed)) throw Cancelled();
  if (s->owner != std::this_thread::get_id()) return;
  const auto now = std::chrono::steady_clock::now();
  if (now < s->next_poll) return;
  s->next_poll = now + s->interval;
  try {
    s->poller();
  } catch (...) {
    s->cancelled.store(true);
    throw;
  }
}

}  // namespace detail

CancelScope::CancelScope(std::function<void()> poller, std::chrono::milliseconds interval)
    : state_(std::make_shared<detail::CancelState>()), outer_(std::move(detail::t_scope)) {
  state_->poller = std::move(poller);
  state_->interval = interval;
  state_->owner = std::this_thread::get_id();
  state_->next_poll = std::chrono::steady_clock::now() + interval;
  detail::t_scope = state_;
}

CancelScope::~CancelScope() { detail::t_scope = std::move(outer_); }

CancelShare::CancelShare() : state_(detail::t_scope) {}

CancelShare::Joined::Joined(std::shared_ptr<detail::CancelState> state)
    : outer_(std::move(detail::t_scope)) {
  detail::t_scope = std::move(state);
}

CancelShare::Joined::~Joined() { detail::t_scope = std::move(outer_); }

void throw_if_cancelled() {
  if (detail::t_scope && detail::t_scope->cancelled.load()) throw Cancelled();
}

}  // namespace zbpipe
