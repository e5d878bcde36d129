// libFuzzer target: the catalogue's text parsers (model YAML, Hugging Face config.json, GPU YAML,
// machine YAML), the first byte choosing which; a model that parses is planned at a small context.
// Anything but InputError (a user's bad file) is a bug and aborts.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "ctxplan/models/catalog.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/plan/plan_geometry.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    switch (data[0] % 4) {
      case 0:
      case 1: {
        const ctxplan::ModelSpec model = data[0] % 4 == 0
                                             ? ctxplan::ParseModelYaml(text, "fuzz.yaml")
                                             : ctxplan::ParseHfConfigJson(text, "config.json");
        ctxplan::RunOptions options;
        options.context_tokens = 16384;
        const ctxplan::PlanGeometry geometry(model, options);
        (void)geometry.max_union_pages();
        break;
      }
      case 2:
        (void)ctxplan::ParseGpuYaml(text, "gpu.yaml");
        break;
      case 3:
        (void)ctxplan::ParseMachineYaml(text, "machine.yaml");
        break;
    }
  } catch (const ctxplan::InputError&) {
  }
  return 0;
}
