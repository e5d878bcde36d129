// libFuzzer target: the JSON reader behind safetensors headers, indexes, config.json and traces.
// A document that parses is walked whole. Anything but InputError is a bug and aborts.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "ctxplan/models/errors.h"
#include "ctxplan/traces/json_reader.h"

namespace {

size_t Walk(const ctxplan::JsonValue& v) {
  size_t n = 1 + v.text.size();
  for (const ctxplan::JsonValue& e : v.items) n += Walk(e);
  for (const auto& m : v.members) n += m.first.size() + Walk(m.second);
  return n;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const ctxplan::JsonValue root = ctxplan::JsonParser(text, "fuzz.json", 0).ParseDocument();
    if (Walk(root) == 0) __builtin_trap();
  } catch (const ctxplan::InputError&) {
  }
  return 0;
}
