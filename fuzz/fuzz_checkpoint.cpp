// libFuzzer target: safetensors headers and checkpoints (of fuzz/fuzz-model.yaml, whose checkpoints
// are a few KiB), read from a file as ctxtrain reads them (pread). Anything but InputError (a
// damaged file) is a bug.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "ctxplan/models/catalog.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/io/checkpoint.h"
#include "ctxplan/runtime/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const ctxplan::ModelSpec model = [] {
    std::ifstream in(CTXPLAN_FUZZ_MODEL);
    const std::string yaml((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return ctxplan::ParseModelYaml(yaml, CTXPLAN_FUZZ_MODEL);
  }();
  static const std::string path =
      (std::filesystem::temp_directory_path() / ("ctxplan-fuzz-" + std::to_string(::getpid())))
          .string();
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  try {
    const ctxplan::SafetensorsFile file(path);
    for (const ctxplan::SafetensorsTensorInfo& t : file.tensors())
      if (t.elements() <= (int64_t{1} << 16)) (void)file.ReadF32(t.name);
  } catch (const ctxplan::InputError&) {
  }
  try {
    (void)ctxplan::LoadCheckpoint(path, model);
  } catch (const ctxplan::InputError&) {
  }
  return 0;
}
