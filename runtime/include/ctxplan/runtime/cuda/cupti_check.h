// Every CUPTI call is checked: a failure throws CuptiError naming the call, the file and line and
// CUPTI's own description of the result (cuptiGetResultString). Library code throws; only main()
// decides how to exit.
#pragma once

#include <cupti.h>

#include <stdexcept>
#include <string>

namespace ctxplan::gpu {

class CuptiError : public std::runtime_error {
 public:
  CuptiError(const std::string& message, CUptiResult result)
      : std::runtime_error(message), result_(result) {}
  CUptiResult result() const { return result_; }

 private:
  CUptiResult result_;
};

inline std::string CuptiResultString(CUptiResult result) {
  const char* text = nullptr;
  if (cuptiGetResultString(result, &text) != CUPTI_SUCCESS || text == nullptr)
    return "CUPTI result " + std::to_string(static_cast<int>(result));
  return text;
}

[[noreturn]] inline void ThrowCupti(CUptiResult result, const char* call, const char* file,
                                    int line) {
  throw CuptiError(std::string(file) + ":" + std::to_string(line) + ": " + call + ": " +
                       CuptiResultString(result),
                   result);
}

}  // namespace ctxplan::gpu

#define CTXPLAN_CUPTI_CHECK(call)                                                   \
  do {                                                                              \
    const CUptiResult ctxplan_cupti_status_ = (call);                               \
    if (ctxplan_cupti_status_ != CUPTI_SUCCESS)                                     \
      ::ctxplan::gpu::ThrowCupti(ctxplan_cupti_status_, #call, __FILE__, __LINE__); \
  } while (false)
