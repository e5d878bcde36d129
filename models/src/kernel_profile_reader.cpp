// Reads a GPU file's kernel_model: the kernel-time model's parameters, page-size tables and
// memory-bound kernel tables, each checked against its limit.
#include "kernel_profile_reader.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <string>
#include <utility>

namespace ctxplan::detail {
namespace {

constexpr NumberLimit kNvmlClockErrorLimit{10.0, true};  // a fraction; 0 allowed
constexpr IntLimit kPageTokensLimit{1 << 20};
constexpr std::string_view kPageTableExpected =
    "expected a mapping of page size in tokens to a fraction in (0, 2], e.g. {64: 0.95, 128: 1}";

std::map<int64_t, double> ReadPageTable(const Fields& f, std::string_view key) {
  const Fields table = f.Map(key, kPageTableExpected);
  std::map<int64_t, double> out;
  for (const std::string& page : table.Keys()) {
    char* end = nullptr;
    const long long tokens = std::strtoll(page.c_str(), &end, 10);
    if (end == page.c_str() || *end != '\0' || tokens <= 0 || tokens > kPageTokensLimit.max)
      table.FailKey(page, "not a page size", kPageTableExpected);
    const double fraction = table.Number(page, NumberLimit{2.0});
    if (fraction <= 0) table.FailKey(page, "not positive", kPageTableExpected);
    out[tokens] = fraction;
  }
  if (out.empty()) f.FailKey(key, "the table is empty", kPageTableExpected);
  return out;
}

// A memory-bound kernel table: {rmsnorm_fwd: 2.8, ...}, the names of cost.h MemoryKernelName.
// zero_ok: a fixed cost may be 0 (a warm launch whose latency the L2 hides).
std::map<std::string, double> ReadMemoryKernelTable(const Fields& f, std::string_view key,
                                                    NumberLimit limit, bool zero_ok = false) {
  constexpr std::string_view kExpected =
      "a map of memory-bound kernel names (rmsnorm_fwd, rope, ...) to positive numbers";
  const auto& names = kMemoryKernelNames;
  const Fields table = f.Map(key, kExpected);
  std::map<std::string, double> out;
  for (const std::string& name : table.Keys()) {
    if (std::find(names.begin(), names.end(), name) == names.end())
      table.FailKey(name, "not a memory-bound kernel", kExpected);
    const double value = table.Number(name, limit);
    if (value < 0 || (value == 0 && !zero_ok)) table.FailKey(name, "not positive", kExpected);
    out[name] = value;
  }
  return out;
}

}  // namespace

KernelProfile ReadKernelProfile(const Fields& f) {
  f.RejectUnknown({"source",
                   "gpu_name",
                   "driver",
                   "date",
                   "commit",
                   "samples",
                   "derived_from",
                   "launch_us",
                   "gemm_tflops",
                   "gemm_tile_rows",
                   "gemm_tile_cols",
                   "gemm_split_max",
                   "gemm_wave_us",
                   "gemm_accumulate_tflops",
                   "gemm_accumulate_tile_rows",
                   "gemm_accumulate_tile_cols",
                   "gemm_accumulate_wave_us_per_byte",
                   "loss_efficiency",
                   "attention_fwd_tflops_d128",
                   "attention_fwd_tflops_d64",
                   "attention_bwd_tflops_d128",
                   "attention_bwd_tflops_d64",
                   "attention_fwd_item_us",
                   "attention_bwd_item_us",
                   "attention_fwd_rows128_efficiency_d64",
                   "attention_fwd_slices_d64",
                   "page_fwd_efficiency",
                   "page_bwd_efficiency",
                   "page_fwd_efficiency_d64",
                   "page_bwd_efficiency_d64",
                   "sparse_fwd_efficiency",
                   "sparse_bwd_efficiency",
                   "sparse_fwd_page_efficiency",
                   "sparse_bwd_page_efficiency",
                   "sparse_fwd_page_efficiency_d64",
                   "sparse_bwd_page_efficiency_d64",
                   "sparse_bwd_gathered",
                   "own_bwd_split",
                   "attention_bwd_gathered_item_us",
                   "attention_bwd_gathered_item_us_d64",
                   "attention_bwd_union_block_us",
                   "sparse_bwd_union_efficiency",
                   "attention_bwd_union64_block_us",
                   "sparse_bwd_union64_efficiency",
                   "sparse_bwd_union64_efficiency_d64",
                   "attention_bwd_own_item_us",
                   "memory_efficiency",
                   "memory_kernel_fixed_us",
                   "memory_kernel_efficiency",
                   "memory_kernel_warm_fixed_us",
                   "memory_kernel_warm_efficiency",
                   "l2_cache_mib",
                   "lora_efficiency",
                   "page_score_fixed_us",
                   "page_score_ns_per_tile_page",
                   "page_score_ns_per_tile_element",
                   "page_topk_fixed_us",
                   "page_topk_ns_per_page",
                   "copy_call_us",
                   "pin_gbs",
                   "host_memcpy_gbs",
                   "host_adamw_gparams",
                   "weights_init_gparams",
                   "device_alloc_gbs",
                   "max_sm_clock_mhz",
                   "power_limit_w",
                   "idle_w",
                   "gemm_w",
                   "attention_fwd_w",
                   "attention_bwd_w",
                   "attention_fwd_w_d64",
                   "attention_bwd_w_d64",
                   "memory_w",
                   "nvml_clock_speed_error",
                   "loss_ns_per_logit",
                   "weights_upload_gparams"});
  KernelProfile k;
  const std::string source = f.Choice("source", {"measured", "estimate"});
  k.provenance = source == "measured" ? Provenance::kMeasured : Provenance::kEstimate;
  if (k.provenance == Provenance::kEstimate) {
    // Scaled from a calibrated sibling at load time: only the sibling is named here.
    f.RejectUnknown({"source", "derived_from"});
    k.derived_from = f.String("derived_from");
    return k;
  }
  k.gpu_name = f.String("gpu_name");
  k.driver = f.String("driver");
  k.date = f.String("date");
  k.commit = f.String("commit");
  k.samples = f.OptionalString("samples").value_or("");
  k.launch_us = f.Number("launch_us", kFixedCostLimit);
  k.gemm_tflops = f.Number("gemm_tflops", kTflopsLimit);
  k.gemm_tile_rows = f.Int("gemm_tile_rows", kPageTokensLimit);
  k.gemm_tile_cols = f.Int("gemm_tile_cols", kPageTokensLimit);
  k.gemm_split_max = f.Int("gemm_split_max", kPageTokensLimit);
  k.gemm_wave_us = f.Number("gemm_wave_us", kFixedCostLimit);
  k.gemm_accumulate_tflops = f.Number("gemm_accumulate_tflops", kTflopsLimit);
  k.gemm_accumulate_tile_rows = f.Int("gemm_accumulate_tile_rows", kPageTokensLimit);
  k.gemm_accumulate_tile_cols = f.Int("gemm_accumulate_tile_cols", kPageTokensLimit);
  k.gemm_accumulate_wave_us_per_byte =
      f.Number("gemm_accumulate_wave_us_per_byte", kFixedCostLimit);
  k.loss_efficiency = f.Number("loss_efficiency", NumberLimit{2.0});
  k.loss_ns_per_logit = f.OptionalNumber("loss_ns_per_logit", NumberLimit{1.0, true}).value_or(0.0);
  k.attention_fwd_tflops_d128 = f.Number("attention_fwd_tflops_d128", kTflopsLimit);
  k.attention_fwd_tflops_d64 = f.Number("attention_fwd_tflops_d64", kTflopsLimit);
  k.attention_bwd_tflops_d128 = f.Number("attention_bwd_tflops_d128", kTflopsLimit);
  k.attention_bwd_tflops_d64 = f.Number("attention_bwd_tflops_d64", kTflopsLimit);
  k.attention_fwd_item_us = f.Number("attention_fwd_item_us", kFixedCostLimit);
  k.attention_bwd_item_us = f.Number("attention_bwd_item_us", kFixedCostLimit);
  k.attention_fwd_rows128_efficiency_d64 =
      f.OptionalNumber("attention_fwd_rows128_efficiency_d64", NumberLimit{2.0}).value_or(0.0);
  k.page_fwd_efficiency = ReadPageTable(f, "page_fwd_efficiency");
  k.page_bwd_efficiency = ReadPageTable(f, "page_bwd_efficiency");
  if (f.Has("page_fwd_efficiency_d64"))
    k.page_fwd_efficiency_d64 = ReadPageTable(f, "page_fwd_efficiency_d64");
  if (f.Has("page_bwd_efficiency_d64"))
    k.page_bwd_efficiency_d64 = ReadPageTable(f, "page_bwd_efficiency_d64");
  k.sparse_fwd_efficiency = f.Number("sparse_fwd_efficiency", NumberLimit{2.0});
  k.sparse_bwd_efficiency = f.Number("sparse_bwd_efficiency", NumberLimit{2.0});
  if (f.Has("sparse_fwd_page_efficiency"))
    k.sparse_fwd_page_efficiency = ReadPageTable(f, "sparse_fwd_page_efficiency");
  if (f.Has("sparse_bwd_page_efficiency"))
    k.sparse_bwd_page_efficiency = ReadPageTable(f, "sparse_bwd_page_efficiency");
  if (f.Has("sparse_fwd_page_efficiency_d64"))
    k.sparse_fwd_page_efficiency_d64 = ReadPageTable(f, "sparse_fwd_page_efficiency_d64");
  if (f.Has("sparse_bwd_page_efficiency_d64"))
    k.sparse_bwd_page_efficiency_d64 = ReadPageTable(f, "sparse_bwd_page_efficiency_d64");
  k.attention_fwd_slices_d64 = f.OptionalBool("attention_fwd_slices_d64").value_or(false);
  k.sparse_bwd_gathered = f.OptionalBool("sparse_bwd_gathered").value_or(false);
  k.own_bwd_split = f.OptionalBool("own_bwd_split").value_or(false);
  k.attention_bwd_gathered_item_us =
      f.OptionalNumber("attention_bwd_gathered_item_us", kFixedCostLimit).value_or(0.0);
  k.attention_bwd_gathered_item_us_d64 =
      f.OptionalNumber("attention_bwd_gathered_item_us_d64", kFixedCostLimit).value_or(0.0);
  k.attention_bwd_union_block_us =
      f.OptionalNumber("attention_bwd_union_block_us", kFixedCostLimit).value_or(0.0);
  k.sparse_bwd_union_efficiency =
      f.OptionalNumber("sparse_bwd_union_efficiency", NumberLimit{2.0}).value_or(1.0);
  k.attention_bwd_union64_block_us =
      f.OptionalNumber("attention_bwd_union64_block_us", kFixedCostLimit).value_or(0.0);
  k.sparse_bwd_union64_efficiency =
      f.OptionalNumber("sparse_bwd_union64_efficiency", NumberLimit{2.0}).value_or(1.0);
  k.sparse_bwd_union64_efficiency_d64 =
      f.OptionalNumber("sparse_bwd_union64_efficiency_d64", NumberLimit{2.0}).value_or(0.0);
  k.attention_bwd_own_item_us =
      f.OptionalNumber("attention_bwd_own_item_us", kFixedCostLimit).value_or(0.0);
  k.memory_efficiency = f.Number("memory_efficiency", NumberLimit{2.0});
  if (f.Has("memory_kernel_fixed_us"))
    k.memory_kernel_fixed_us =
        ReadMemoryKernelTable(f, "memory_kernel_fixed_us", kFixedCostLimit, true);
  if (f.Has("memory_kernel_efficiency"))
    k.memory_kernel_efficiency =
        ReadMemoryKernelTable(f, "memory_kernel_efficiency", NumberLimit{2.0});
  if (f.Has("memory_kernel_warm_efficiency"))
    k.memory_kernel_warm_efficiency =
        ReadMemoryKernelTable(f, "memory_kernel_warm_efficiency", NumberLimit{20.0});
  if (f.Has("memory_kernel_warm_fixed_us"))
    k.memory_kernel_warm_fixed_us =
        ReadMemoryKernelTable(f, "memory_kernel_warm_fixed_us", kFixedCostLimit, true);
  k.l2_cache_mib = f.OptionalNumber("l2_cache_mib", NumberLimit{4096.0}).value_or(0.0);
  for (const auto& [name, warm] : k.memory_kernel_warm_efficiency)
    if (!k.memory_kernel_fixed_us.contains(name) || !k.memory_kernel_warm_fixed_us.contains(name) ||
        k.l2_cache_mib <= 0)
      f.FailKey("memory_kernel_warm_efficiency", "has " + name + " without its cold fit",
                "kernels of memory_kernel_fixed_us and memory_kernel_warm_fixed_us, with "
                "l2_cache_mib given");
  for (const auto& [name, fixed] : k.memory_kernel_fixed_us)
    if (!k.memory_kernel_efficiency.contains(name))
      f.FailKey("memory_kernel_efficiency", "has no " + name,
                "the kernels of memory_kernel_fixed_us, each with its fraction");
  k.lora_efficiency = f.OptionalNumber("lora_efficiency", NumberLimit{2.0}).value_or(1.0);
  k.page_score_fixed_us = f.Number("page_score_fixed_us", kFixedCostLimit);
  k.page_score_ns_per_tile_page = f.Number("page_score_ns_per_tile_page", kFixedCostLimit);
  k.page_score_ns_per_tile_element =
      f.OptionalNumber("page_score_ns_per_tile_element", kFixedCostLimit).value_or(0.0);
  k.page_topk_fixed_us = f.Number("page_topk_fixed_us", kFixedCostLimit);
  k.page_topk_ns_per_page = f.Number("page_topk_ns_per_page", kFixedCostLimit);
  k.copy_call_us = f.Number("copy_call_us", kFixedCostLimit);
  k.pin_gbs = f.Number("pin_gbs", kHostGbsLimit);
  k.host_memcpy_gbs = f.Number("host_memcpy_gbs", kHostGbsLimit);
  k.host_adamw_gparams = f.Number("host_adamw_gparams", kProfileLimit);
  k.weights_init_gparams = f.Number("weights_init_gparams", kProfileLimit);
  k.device_alloc_gbs = f.Number("device_alloc_gbs", kDeviceGbsLimit);
  k.weights_upload_gparams =
      f.OptionalNumber("weights_upload_gparams", kProfileLimit).value_or(0.0);
  // Power (optional: a profile measured without NVML has none).
  k.max_sm_clock_mhz = f.OptionalNumber("max_sm_clock_mhz", kProfileLimit).value_or(0.0);
  k.power_limit_w = f.OptionalNumber("power_limit_w", kProfileLimit).value_or(0.0);
  k.idle_w = f.OptionalNumber("idle_w", kProfileLimit).value_or(0.0);
  k.gemm_w = f.OptionalNumber("gemm_w", kProfileLimit).value_or(0.0);
  k.attention_fwd_w = f.OptionalNumber("attention_fwd_w", kProfileLimit).value_or(0.0);
  k.attention_bwd_w = f.OptionalNumber("attention_bwd_w", kProfileLimit).value_or(0.0);
  k.attention_fwd_w_d64 = f.OptionalNumber("attention_fwd_w_d64", kProfileLimit).value_or(0.0);
  k.attention_bwd_w_d64 = f.OptionalNumber("attention_bwd_w_d64", kProfileLimit).value_or(0.0);
  k.memory_w = f.OptionalNumber("memory_w", kProfileLimit).value_or(0.0);
  k.nvml_clock_speed_error =
      f.OptionalNumber("nvml_clock_speed_error", kNvmlClockErrorLimit).value_or(-1.0);
  for (const auto& [key, value] :
       {std::pair<const char*, double>{"gemm_tflops", k.gemm_tflops},
        {"gemm_accumulate_tflops", k.gemm_accumulate_tflops},
        {"gemm_split_max", static_cast<double>(k.gemm_split_max)},
        {"gemm_tile_rows", static_cast<double>(k.gemm_tile_rows)},
        {"gemm_tile_cols", static_cast<double>(k.gemm_tile_cols)},
        {"gemm_accumulate_tile_rows", static_cast<double>(k.gemm_accumulate_tile_rows)},
        {"gemm_accumulate_tile_cols", static_cast<double>(k.gemm_accumulate_tile_cols)},
        {"attention_fwd_tflops_d128", k.attention_fwd_tflops_d128},
        {"attention_fwd_tflops_d64", k.attention_fwd_tflops_d64},
        {"attention_bwd_tflops_d128", k.attention_bwd_tflops_d128},
        {"attention_bwd_tflops_d64", k.attention_bwd_tflops_d64},
        {"memory_efficiency", k.memory_efficiency},
        {"lora_efficiency", k.lora_efficiency},
        {"pin_gbs", k.pin_gbs},
        {"host_memcpy_gbs", k.host_memcpy_gbs},
        {"host_adamw_gparams", k.host_adamw_gparams},
        {"device_alloc_gbs", k.device_alloc_gbs}}) {
    if (value <= 0) f.FailKey(key, "not positive", "expected a positive number");
  }
  return k;
}

}  // namespace ctxplan::detail
