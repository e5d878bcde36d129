// A minimal C++20 coroutine generator: the step plan is written as plain nested loops that
// co_yield ops, and consumers pull them one at a time, so no step is ever materialised.
#pragma once

#include <coroutine>
#include <exception>
#include <utility>

namespace ctxplan {

template <typename T>
class Generator {
 public:
  struct promise_type {
    const T* current = nullptr;
    std::exception_ptr error;

    Generator get_return_object() {
      return Generator(std::coroutine_handle<promise_type>::from_promise(*this));
    }
    std::suspend_always initial_suspend() noexcept { return {}; }
    std::suspend_always final_suspend() noexcept { return {}; }
    std::suspend_always yield_value(const T& value) noexcept {
      current = &value;
      return {};
    }
    void return_void() noexcept {}
    void unhandled_exception() { error = std::current_exception(); }
  };

  explicit Generator(std::coroutine_handle<promise_type> handle) : handle_(handle) {}
  Generator(Generator&& other) noexcept : handle_(std::exchange(other.handle_, {})) {}
  Generator& operator=(Generator&& other) noexcept {
    if (this != &other) {
      if (handle_) handle_.destroy();
      handle_ = std::exchange(other.handle_, {});
    }
    return *this;
  }
  Generator(const Generator&) = delete;
  Generator& operator=(const Generator&) = delete;
  ~Generator() {
    if (handle_) handle_.destroy();
  }

  // Advances to the next value; false at the end. The pointer from Current() is valid until the
  // next call.
  bool Next() {
    if (!handle_ || handle_.done()) return false;
    handle_.resume();
    if (handle_.promise().error) std::rethrow_exception(handle_.promise().error);
    return !handle_.done();
  }
  const T& Current() const { return *handle_.promise().current; }

 private:
  std::coroutine_handle<promise_type> handle_;
};

}  // namespace ctxplan
