// libFuzzer target: a token data file (little-endian uint32 ids) as ctxtrain's --data reads it:
// checked whole against a vocabulary, then windows of a few contexts and steps. The first byte
// picks the vocabulary and the context. Anything but InputError is a bug and aborts.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/io/token_data.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  static const std::string path = (std::filesystem::temp_directory_path() /
                                   ("ctxplan-fuzz-tokens-" + std::to_string(::getpid())))
                                      .string();
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data) + 1, static_cast<std::streamsize>(size - 1));
  }
  const int64_t vocab = (data[0] & 1) ? 256 : int64_t{1} << 31;
  const int64_t context = 1 + (data[0] >> 1);  // 1..128 tokens
  try {
    const ctxplan::TokenFile file(path, vocab);
    for (const int64_t step : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1} << 40}) {
      const ctxplan::TokenSequence s = file.Window(step, context);
      if (s.tokens.size() != static_cast<size_t>(context) || s.labels.size() != s.tokens.size())
        __builtin_trap();  // a window of the wrong length: a bug, not bad input
      for (const int32_t t : s.tokens)
        if (t < 0 || t >= vocab) __builtin_trap();
    }
  } catch (const ctxplan::InputError&) {
  }
  return 0;
}
