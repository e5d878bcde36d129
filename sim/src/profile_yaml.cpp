#include "ctxplan/sim/calibration.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <string>

namespace ctxplan::sim {

std::string GpuProfileYaml(const GpuSpec& g) {
  std::ostringstream o;
  o.precision(6);
  auto spec = [&](const char* key, const SpecValue& v) {
    std::string note = v.note;
    std::replace(note.begin(), note.end(), '"', '\'');
    o << key << ": {value: " << v.value << ", source: " << ProvenanceName(v.provenance)
      << ", note: \"" << note << "\"}\n";
  };
  const KernelProfile& k = g.kernels;
  o << "# " << g.display_name << ". Written by `ctxplan calibrate` from ctxplan-measure's samples";
  if (!k.samples.empty()) o << " (" << k.samples << ")";
  o << ";\n# values marked measured come from them, the others from the catalogue entry.\n";
  o << "name: " << g.name << "\n";
  o << "display_name: " << g.display_name << "\n";
  o << "sm_count: " << g.sm_count << "\n";
  if (g.boost_clock_mhz > 0) o << "boost_clock_mhz: " << g.boost_clock_mhz << "\n";
  if (g.tdp_w > 0) o << "tdp_w: " << g.tdp_w << "\n";
  o << "host_link: " << g.host_link << "\n";
  spec("memory_gib", g.memory_gib);
  spec("memory_bandwidth_gbs", g.memory_bandwidth_gbs);
  spec("d2d_copy_gbs", g.d2d_copy_gbs);
  spec("bf16_dense_tflops", g.bf16_dense_tflops);
  spec("bf16_gemm_tflops", g.bf16_gemm_tflops);
  spec("attention_fwd_tflops", g.attention_fwd_tflops);
  spec("attention_bwd_tflops", g.attention_bwd_tflops);
  spec("host_h2d_gbs", g.host_h2d_gbs);
  spec("host_d2h_gbs", g.host_d2h_gbs);
  spec("host_duplex_gbs", g.host_duplex_gbs);
  spec("cuda_context_gib", g.cuda_context_gib);
  if (k.empty()) return o.str();
  auto table = [&](const std::map<int64_t, double>& t) {
    std::string s = "{";
    for (const auto& [p, f] : t) {
      if (s.size() > 1) s += ", ";
      std::ostringstream v;
      v.precision(4);
      v << p << ": " << f;
      s += v.str();
    }
    return s + "}";
  };
  o << "kernel_model:\n";
  o << "  source: " << ProvenanceName(k.provenance) << "\n";
  if (k.provenance != Provenance::kMeasured) {
    o << "  derived_from: " << k.derived_from << "\n";
    return o.str();
  }
  o << "  gpu_name: \"" << k.gpu_name << "\"\n";
  o << "  driver: \"" << k.driver << "\"\n";
  o << "  date: \"" << k.date << "\"\n";
  o << "  commit: \"" << k.commit << "\"\n";
  if (!k.samples.empty()) o << "  samples: \"" << k.samples << "\"\n";
  o << "  launch_us: " << k.launch_us << "\n";
  o << "  gemm_tflops: " << k.gemm_tflops << "\n";
  o << "  gemm_tile_rows: " << k.gemm_tile_rows << "\n";
  o << "  gemm_tile_cols: " << k.gemm_tile_cols << "\n";
  o << "  gemm_split_max: " << k.gemm_split_max << "\n";
  o << "  gemm_wave_us: " << k.gemm_wave_us << "\n";
  o << "  gemm_accumulate_tflops: " << k.gemm_accumulate_tflops << "\n";
  o << "  gemm_accumulate_tile_rows: " << k.gemm_accumulate_tile_rows << "\n";
  o << "  gemm_accumulate_tile_cols: " << k.gemm_accumulate_tile_cols << "\n";
  o << "  gemm_accumulate_wave_us_per_byte: " << k.gemm_accumulate_wave_us_per_byte << "\n";
  o << "  loss_efficiency: " << k.loss_efficiency << "\n";
  if (k.loss_ns_per_logit > 0) o << "  loss_ns_per_logit: " << k.loss_ns_per_logit << "\n";
  o << "  attention_fwd_tflops_d128: " << k.attention_fwd_tflops_d128 << "\n";
  o << "  attention_fwd_tflops_d64: " << k.attention_fwd_tflops_d64 << "\n";
  o << "  attention_bwd_tflops_d128: " << k.attention_bwd_tflops_d128 << "\n";
  o << "  attention_bwd_tflops_d64: " << k.attention_bwd_tflops_d64 << "\n";
  o << "  attention_fwd_item_us: " << k.attention_fwd_item_us << "\n";
  if (k.attention_fwd_rows128_efficiency_d64 > 0)
    o << "  attention_fwd_rows128_efficiency_d64: " << k.attention_fwd_rows128_efficiency_d64
      << "\n";
  if (k.attention_fwd_slices_d64) o << "  attention_fwd_slices_d64: true\n";
  o << "  attention_bwd_item_us: " << k.attention_bwd_item_us << "\n";
  o << "  page_fwd_efficiency: " << table(k.page_fwd_efficiency) << "\n";
  o << "  page_bwd_efficiency: " << table(k.page_bwd_efficiency) << "\n";
  if (!k.page_fwd_efficiency_d64.empty())
    o << "  page_fwd_efficiency_d64: " << table(k.page_fwd_efficiency_d64) << "\n";
  if (!k.page_bwd_efficiency_d64.empty())
    o << "  page_bwd_efficiency_d64: " << table(k.page_bwd_efficiency_d64) << "\n";
  o << "  sparse_fwd_efficiency: " << k.sparse_fwd_efficiency << "\n";
  o << "  sparse_bwd_efficiency: " << k.sparse_bwd_efficiency << "\n";
  if (k.sparse_bwd_gathered) o << "  sparse_bwd_gathered: true\n";
  if (k.own_bwd_split) o << "  own_bwd_split: true\n";
  if (k.attention_bwd_gathered_item_us > 0)
    o << "  attention_bwd_gathered_item_us: " << k.attention_bwd_gathered_item_us << "\n";
  if (k.attention_bwd_gathered_item_us_d64 > 0)
    o << "  attention_bwd_gathered_item_us_d64: " << k.attention_bwd_gathered_item_us_d64 << "\n";
  if (k.attention_bwd_union_block_us > 0) {
    o << "  attention_bwd_union_block_us: " << k.attention_bwd_union_block_us << "\n";
    o << "  sparse_bwd_union_efficiency: " << k.sparse_bwd_union_efficiency << "\n";
    if (k.attention_bwd_union64_block_us > 0) {
      o << "  attention_bwd_union64_block_us: " << k.attention_bwd_union64_block_us << "\n";
      o << "  sparse_bwd_union64_efficiency: " << k.sparse_bwd_union64_efficiency << "\n";
      if (k.sparse_bwd_union64_efficiency_d64 > 0)
        o << "  sparse_bwd_union64_efficiency_d64: " << k.sparse_bwd_union64_efficiency_d64 << "\n";
    }
  }
  if (k.attention_bwd_own_item_us > 0)
    o << "  attention_bwd_own_item_us: " << k.attention_bwd_own_item_us << "\n";
  if (!k.sparse_fwd_page_efficiency.empty())
    o << "  sparse_fwd_page_efficiency: " << table(k.sparse_fwd_page_efficiency) << "\n";
  if (!k.sparse_bwd_page_efficiency.empty())
    o << "  sparse_bwd_page_efficiency: " << table(k.sparse_bwd_page_efficiency) << "\n";
  if (!k.sparse_fwd_page_efficiency_d64.empty())
    o << "  sparse_fwd_page_efficiency_d64: " << table(k.sparse_fwd_page_efficiency_d64) << "\n";
  if (!k.sparse_bwd_page_efficiency_d64.empty())
    o << "  sparse_bwd_page_efficiency_d64: " << table(k.sparse_bwd_page_efficiency_d64) << "\n";
  o << "  memory_efficiency: " << k.memory_efficiency << "\n";
  if (!k.memory_kernel_fixed_us.empty()) {
    auto names = [](const std::map<std::string, double>& m) {
      std::ostringstream t;
      t << "{";
      for (auto it = m.begin(); it != m.end(); ++it)
        t << (it == m.begin() ? "" : ", ") << it->first << ": " << it->second;
      t << "}";
      return t.str();
    };
    o << "  memory_kernel_fixed_us: " << names(k.memory_kernel_fixed_us) << "\n";
    o << "  memory_kernel_efficiency: " << names(k.memory_kernel_efficiency) << "\n";
    if (!k.memory_kernel_warm_efficiency.empty()) {
      o << "  memory_kernel_warm_fixed_us: " << names(k.memory_kernel_warm_fixed_us) << "\n";
      o << "  memory_kernel_warm_efficiency: " << names(k.memory_kernel_warm_efficiency) << "\n";
    }
  }
  if (k.l2_cache_mib > 0) o << "  l2_cache_mib: " << k.l2_cache_mib << "\n";
  if (k.lora_efficiency != 1.0)  // 1: the samples had no lora group
    o << "  lora_efficiency: " << k.lora_efficiency << "\n";
  o << "  page_score_fixed_us: " << k.page_score_fixed_us << "\n";
  o << "  page_score_ns_per_tile_element: " << k.page_score_ns_per_tile_element << "\n";
  o << "  page_score_ns_per_tile_page: " << k.page_score_ns_per_tile_page << "\n";
  o << "  page_topk_fixed_us: " << k.page_topk_fixed_us << "\n";
  o << "  page_topk_ns_per_page: " << k.page_topk_ns_per_page << "\n";
  o << "  copy_call_us: " << k.copy_call_us << "\n";
  o << "  pin_gbs: " << k.pin_gbs << "\n";
  o << "  host_memcpy_gbs: " << k.host_memcpy_gbs << "\n";
  o << "  host_adamw_gparams: " << k.host_adamw_gparams << "\n";
  o << "  weights_init_gparams: " << k.weights_init_gparams << "\n";
  if (k.weights_upload_gparams > 0)
    o << "  weights_upload_gparams: " << k.weights_upload_gparams << "\n";
  o << "  device_alloc_gbs: " << k.device_alloc_gbs << "\n";
  if (k.has_power()) {
    o << "  max_sm_clock_mhz: " << k.max_sm_clock_mhz << "\n";
    o << "  power_limit_w: " << k.power_limit_w << "\n";
    o << "  idle_w: " << k.idle_w << "\n";
    o << "  gemm_w: " << k.gemm_w << "\n";
    o << "  attention_fwd_w: " << k.attention_fwd_w << "\n";
    o << "  attention_bwd_w: " << k.attention_bwd_w << "\n";
    if (k.attention_fwd_w_d64 > 0) o << "  attention_fwd_w_d64: " << k.attention_fwd_w_d64 << "\n";
    if (k.attention_bwd_w_d64 > 0) o << "  attention_bwd_w_d64: " << k.attention_bwd_w_d64 << "\n";
    o << "  memory_w: " << k.memory_w << "\n";
    if (k.nvml_clock_speed_error >= 0)
      o << "  nvml_clock_speed_error: " << k.nvml_clock_speed_error << "\n";
  }
  return o.str();
}

}  // namespace ctxplan::sim
