// Sizing the GPU tier of the page store (RunOptions::gpu_tier_pages): off (every page's home is
// the host), a size the user names, auto (what the plan leaves free on the GPU less a margin),
// or all (every page on the GPU: offload off). Offload is thus one setting with two ends. The
// plan itself takes a page count; this turns the user's setting into one for a model, machine
// and context.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "ctxplan/models/gpu_spec.h"
#include "ctxplan/models/model_spec.h"
#include "ctxplan/runtime/plan/run_options.h"

namespace ctxplan::sim {

struct GpuTierSetting {
  enum class Kind : uint8_t { kOff, kAuto, kSize, kAll };
  Kind kind = Kind::kOff;
  int64_t size_bytes = 0;  // kSize: KV and dKV of the tier's pages, every layer
  // kAuto: device memory left free beside the tier (allocator slack, other processes).
  int64_t margin_bytes = int64_t{2} << 30;

  bool off() const { return kind == Kind::kOff; }
};

// "off" | "auto" | "all" | a size ("40GiB", "512MiB"); `margin`: a size. Throws InputError naming
// the flag.
GpuTierSetting ParseGpuTierSetting(std::string_view text, std::string_view margin,
                                   std::string_view flag);
std::string DescribeGpuTierSetting(const GpuTierSetting& setting);
// The --gpu-tier text that parses back to `setting` (its margin aside).
std::string GpuTierFlag(const GpuTierSetting& setting);

// `options` with gpu_tier_pages for `setting`: 0 when off or offload is off; a size's whole pages
// (at most the context's); auto: the pages that fit in the device memory the plan leaves free,
// less the margin; all: offload off (the pages' only home is the GPU).
RunOptions WithGpuTier(const ModelSpec& model, const MachineSpec& machine, RunOptions options,
                       const GpuTierSetting& setting);

}  // namespace ctxplan::sim
