// libFuzzer target: the run flags every ctxplan command and ctxtrain share, parsed by CLI11 and
// resolved as the commands resolve them (model, machine, options, the GPU tier). The input is
// argv, split at newlines. Paths are left out (a flag naming /dev/zero would read forever, which
// is the file's problem, not the parser's). Anything but a CLI11 parse error or InputError is a
// bug and aborts.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "ctxplan/models/errors.h"
#include "ctxplan/sim/gpu_tier.h"
#include "run_flags.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> args;
  std::string arg;
  for (size_t i = 0; i < size; ++i) {
    const char c = static_cast<char>(data[i]);
    if (c == '/' || c == '\0') return 0;
    if (c == '\n') {
      args.push_back(arg);
      arg.clear();
    } else {
      arg += c;
    }
  }
  args.push_back(arg);
  if (args.size() > 64) return 0;

  ctxplan::cli::RunFlags flags;
  CLI::App app("fuzz");
  ctxplan::cli::AddRunFlags(app, flags, /*with_context=*/true);
  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 parses from the back
  try {
    app.parse(reversed);
  } catch (const CLI::ParseError&) {
    return 0;
  }
  try {
    const ctxplan::ModelSpec model = ctxplan::cli::ResolveModel(flags);
    const ctxplan::MachineSpec machine = ctxplan::cli::ResolveMachine(flags);
    const ctxplan::RunOptions options = ctxplan::cli::ResolveOptions(flags, model, true);
    const ctxplan::sim::GpuTierSetting tier =
        ctxplan::sim::ParseGpuTierSetting(flags.gpu_tier, flags.gpu_tier_margin, "--gpu-tier");
    if (options.context_tokens <= (int64_t{1} << 24))
      (void)ctxplan::sim::WithGpuTier(model, machine, options, tier);
  } catch (const ctxplan::InputError&) {
  }
  return 0;
}
