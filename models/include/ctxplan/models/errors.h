// Typed errors shared by every ctxplan library. Library code throws; only main() exits.
//
// InputError is the user's fault (a bad file, key, flag or value): the CLI prints its one-line
// what() and exits with code 2. InternalError is ours (a broken invariant in the planner or
// simulator): it must never be reachable from user input.
#pragma once

#include <stdexcept>
#include <string>

namespace ctxplan {

class InputError : public std::runtime_error {
 public:
  explicit InputError(const std::string& message) : std::runtime_error(message) {}
};

class InternalError : public std::logic_error {
 public:
  explicit InternalError(const std::string& message) : std::logic_error(message) {}
};

// Checks an invariant of our own code; failing it is a bug, never a user error.
#define CTXPLAN_CHECK(condition, message)                                                     \
  do {                                                                                        \
    if (!(condition))                                                                         \
      throw ::ctxplan::InternalError(std::string(__FILE__) + ":" + std::to_string(__LINE__) + \
                                     ": invariant failed: " #condition ": " + (message));     \
  } while (false)

}  // namespace ctxplan
