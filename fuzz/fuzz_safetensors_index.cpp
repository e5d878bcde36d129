// libFuzzer target: a sharded checkpoint's index (model.safetensors.index.json) as ctxtrain's
// --weights reads it, for the tiny model, beside one valid-looking shard name. Anything but
// InputError (a damaged or foreign index) is a bug and aborts.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "ctxplan/models/catalog.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const ctxplan::ModelSpec model = ctxplan::LoadModel("tiny");
  // A directory of this process's own: the index names shards relative to it.
  static const std::filesystem::path dir = [] {
    const std::filesystem::path d = std::filesystem::temp_directory_path() /
                                    ("ctxplan-fuzz-index-" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    std::ofstream(d / "shard-1.safetensors", std::ios::binary) << std::string(8, '\0');
    return d;
  }();
  const std::filesystem::path index = dir / "model.safetensors.index.json";
  {
    std::ofstream out(index, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    (void)ctxplan::LoadSafetensorsWeights(index, model);
  } catch (const ctxplan::InputError&) {
  }
  return 0;
}
