// Tasks handed from one thread to another, oldest first, under a std::mutex (never a Qt lock:
// ThreadSanitizer sees through this one, see explorer_model.h). The explorer's models hand their
// jobs to their worker threads, and the workers' answers back, through it.
#pragma once

#include <deque>
#include <functional>
#include <mutex>

namespace ctxplan::gui {

class Mailbox {
 public:
  Mailbox() = default;
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;
  ~Mailbox();  // takes the lock: the last thread to touch the queue may be another one

  void Push(std::function<void()> task);
  std::function<void()> Pop();  // empty when there is none

 private:
  std::mutex mutex_;
  std::deque<std::function<void()>> tasks_;
};

}  // namespace ctxplan::gui
