#include "ctxplan/models/gpu_spec.h"

#include <cmath>

#include "ctxplan/models/units.h"

namespace ctxplan {

const char* ProvenanceName(Provenance provenance) {
  switch (provenance) {
    case Provenance::kDatasheet:
      return "datasheet";
    case Provenance::kMeasured:
      return "measured";
    case Provenance::kEstimate:
      return "estimate";
  }
  return "unknown";
}

int64_t GpuSpec::memory_bytes() const {
  return static_cast<int64_t>(std::llround(memory_gib.value * static_cast<double>(kGiB)));
}

KernelProfile ScaleKernelProfile(const GpuSpec& sibling, const GpuSpec& target) {
  KernelProfile k = sibling.kernels;
  const double compute = target.bf16_dense_tflops.value / sibling.bf16_dense_tflops.value;
  const double clock = sibling.boost_clock_mhz > 0 && target.boost_clock_mhz > 0
                           ? target.boost_clock_mhz / sibling.boost_clock_mhz
                           : 1.0;
  const double memory = target.d2d_copy_gbs.value / sibling.d2d_copy_gbs.value;
  k.provenance = Provenance::kEstimate;
  k.derived_from = sibling.name;
  k.gemm_tflops *= compute;
  k.gemm_accumulate_tflops *= compute;
  k.attention_fwd_tflops_d128 *= compute;
  k.attention_fwd_tflops_d64 *= compute;
  k.attention_bwd_tflops_d128 *= compute;
  k.attention_bwd_tflops_d64 *= compute;
  // An accumulating GEMM's per-wave cost is its output tiles' read-modify-write in HBM (per byte
  // of the output element: kernel_time_model.cpp GemmComputeSeconds).
  k.gemm_accumulate_wave_us_per_byte /= memory;
  k.page_score_ns_per_tile_page /= memory;
  // page_score_ns_per_tile_element stays: short blocks waiting on their loads' latency.
  k.page_topk_ns_per_page /= clock;
  if (k.has_power() && target.tdp_w > 0 && sibling.tdp_w > 0) {
    k.power_limit_w = target.tdp_w;
    k.idle_w *= target.tdp_w / sibling.tdp_w;
    k.gemm_w *= compute;
    k.attention_fwd_w *= compute;
    k.attention_bwd_w *= compute;
    k.attention_fwd_w_d64 *= compute;
    k.attention_bwd_w_d64 *= compute;
    k.memory_w *= memory;
    if (target.boost_clock_mhz > 0) k.max_sm_clock_mhz = target.boost_clock_mhz;
  } else {
    k.power_limit_w = 0;  // no power model
  }
  k.nvml_clock_speed_error = -1;  // the sibling's NVML, not the target's: unknown
  return k;
}

}  // namespace ctxplan
