// libFuzzer target: the .ctxtrace reader. Anything but InputError (a damaged file) is a bug.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "ctxplan/models/errors.h"
#include "ctxplan/traces/op_trace.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    (void)ctxplan::ParseOpTrace(std::string_view(reinterpret_cast<const char*>(data), size),
                                "fuzz.ctxtrace");
  } catch (const ctxplan::InputError&) {
  }
  return 0;
}
