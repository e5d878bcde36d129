#include "model/mailbox.h"

namespace ctxplan::gui {

Mailbox::~Mailbox() {
  const std::lock_guard<std::mutex> lock(mutex_);
  tasks_.clear();
}

void Mailbox::Push(std::function<void()> task) {
  const std::lock_guard<std::mutex> lock(mutex_);
  tasks_.push_back(std::move(task));
}

std::function<void()> Mailbox::Pop() {
  const std::lock_guard<std::mutex> lock(mutex_);
  if (tasks_.empty()) return {};
  std::function<void()> task = std::move(tasks_.front());
  tasks_.pop_front();
  return task;
}

}  // namespace ctxplan::gui
