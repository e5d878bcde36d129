// A GPU and its host link, from datasheets, with measured values where we have them.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

namespace ctxplan {

// Where a number comes from. A measured value was read on one of our machines (DESIGN.md);
// a datasheet value is the vendor's and is usually optimistic; an estimate is derived from other
// values (e.g. a GEMM rate assumed as 75% of the datasheet peak for a GPU we never measured).
enum class Provenance { kDatasheet, kMeasured, kEstimate };

// "datasheet", "measured", "estimate": the spelling used in the catalogue's `source:` fields.
const char* ProvenanceName(Provenance provenance);

struct SpecValue {
  double value = 0.0;
  Provenance provenance = Provenance::kDatasheet;
  std::string note;  // how or where it was measured, or which datasheet
};

// The kernel-time model's parameters for one GPU (how each is used: sim/kernel_time_model.h).
// Measured by `ctxplan calibrate` on that GPU, or, for a GPU we have only datasheets for,
// scaled from a calibrated sibling by what differs (SMs x clock, HBM, the host link).
struct KernelProfile {
  Provenance provenance = Provenance::kEstimate;
  // Measured: where and when. Estimated: the calibrated sibling it was scaled from.
  std::string gpu_name, driver, date, commit, samples, derived_from;

  double launch_us = 0;  // one kernel launch or copy call, back to back: the floor of any op
  // GEMMs (cuBLASLt): output tiles of tile_rows x tile_cols fill the SMs in whole waves, each
  // wave paying wave_us beyond its FLOPs; a launch of fewer tiles than SMs splits its depth
  // over up to split_max tiles. GEMMs that add into their output (weight gradients, beta 1)
  // choose other tiles and pay a wave cost per byte of an output element (reading and writing
  // it). The fused loss reaches loss_efficiency of the GEMM rate.
  double gemm_tflops = 0;
  int64_t gemm_tile_rows = 128, gemm_tile_cols = 128, gemm_split_max = 1;
  double gemm_wave_us = 0;
  double gemm_accumulate_tflops = 0;
  int64_t gemm_accumulate_tile_rows = 128, gemm_accumulate_tile_cols = 256;
  double gemm_accumulate_wave_us_per_byte = 0;
  double loss_efficiency = 1;
  // The fused loss's softmax over its [tokens x vocab] logits (exp, max, sums, the gradient's
  // scale), which does not grow with the hidden size as its GEMMs do: ns per logit, at the
  // maximum clock. 0 where the samples had one hidden size (the GEMMs' share then absorbs it).
  double loss_ns_per_logit = 0;
  // Attention: thread blocks ("items") of 128 queries and one head (forward) or 128 keys and one
  // KV head (backward) run one per SM; an item costs item_us plus its 128 x 128 blocks at the
  // head dim's rate (a causal block computed whole). Over pages, per page size, the fraction of
  // that rate reached (a size off the fast path runs another kernel path); over page-sparse
  // selections a further fraction.
  double attention_fwd_tflops_d128 = 0, attention_fwd_tflops_d64 = 0;
  double attention_bwd_tflops_d128 = 0, attention_bwd_tflops_d64 = 0;
  double attention_fwd_item_us = 0, attention_bwd_item_us = 0;
  // The forward the profile timed runs blocks of 192 queries at head dim 64 without a page
  // selection where AttentionForwardQueryRows says (ctxtrain from 2026-11-27T23:50Z on; the d_h 64
  // rate is then theirs), 128-row blocks reaching this fraction of that rate; 0: 128 rows
  // everywhere.
  double attention_fwd_rows128_efficiency_d64 = 0;
  // The forward the profile timed runs page-sparse head dim 64 on three consumers over query-head
  // slices where AttentionForwardSlices says (blocks of two or three 64-query slices of one tile,
  // ForwardSliceBlockAt): blocks of three at the 192-row rate, of two at the 128-row fraction of
  // it. false: one head's 128 queries a block everywhere.
  bool attention_fwd_slices_d64 = false;
  std::map<int64_t, double> page_fwd_efficiency, page_bwd_efficiency;  // page tokens -> fraction
  // The same at head dim 64 (its own kernel path; empty: the head dim 128 tables).
  std::map<int64_t, double> page_fwd_efficiency_d64, page_bwd_efficiency_d64;
  double sparse_fwd_efficiency = 1, sparse_bwd_efficiency = 1;
  // The sparse fraction per page size where measured (empty: the scalar above for every size).
  // Under 128 tokens a key block of a sparse selection is several unrelated pages, loaded apart:
  // at page 64 the forward runs 1.3x slower per key than at 128, where dense launches at either
  // size run alike (H200 samples, 2026-11-24).
  std::map<int64_t, double> sparse_fwd_page_efficiency, sparse_bwd_page_efficiency;
  // The same at head dim 64, where its samples have sparse rows (empty: the tables above). Its
  // backward ran 64-key blocks at every page size from 2026-11-26 until 2026-11-27T21:12Z (128-key
  // blocks since, as at head dim 128), so its page sizes fell otherwise than 128's (pages of 64 at
  // page 128's rate there, at ~0.6 of it at head dim 128).
  std::map<int64_t, double> sparse_fwd_page_efficiency_d64, sparse_bwd_page_efficiency_d64;
  // The page-sparse backward the profile timed gathers each query tile's selected positions into
  // 128-key blocks (ctxtrain from 2026-11-27 on); false: it ran key blocks (64 keys under page
  // 128, over the union's pages else), half masked where tiles select a block's pages apart.
  bool sparse_bwd_gathered = false;
  // The backward the profile timed splits long chunks' own key blocks one a query head
  // (AttentionBackwardSplitsOwnHeads; ctxtrain from 2026-11-27T16:20Z on); false: one a KV head
  // at every chunk, the launch's blocks group times fewer and longer.
  bool own_bwd_split = false;
  // A gathered block's fixed cost (its 128 keys' K and V gathered, its dK and dV added by
  // atomics, its few items' pipeline filled), fitted on the page-sparse rows; 0: the backward's
  // item cost. A GQA group of 4 gives a block 8 items where 7 gives 14, so this cost shows there.
  double attention_bwd_gathered_item_us = 0;
  // Head dim 64's, fitted where its page-sparse rows hold two GQA groups; 0: the one above. (At
  // one group its block cost and per-pair rate are not told apart: the H200's profile put group
  // 8's rate 12-20% above what it ran, kernels/PERF.md.)
  double attention_bwd_gathered_item_us_d64 = 0;
  // A key block's fixed cost over the union of the tiles' selected pages, where the page-sparse
  // backward takes those at GQA groups 1-2 (AttentionBackwardOverUnion; ctxtrain from
  // 2026-11-28T19:00Z): its selection scan, K/V load and dK/dV read-add-write, fitted on those
  // groups' page-sparse rows; 0: the profile timed gathered blocks there.
  double attention_bwd_union_block_us = 0;
  // The per-pair rate of that launch (the union's blocks and the chunk's own ones beside them, on
  // the two warpgroups without the producer) against the dense backward's at the head dim, fitted
  // with the block cost.
  double sparse_bwd_union_efficiency = 1.0;
  // The union's 64-key blocks (pages of 48 and 64 at group 1: one warpgroup, two blocks a
  // multiprocessor, own positions in 64-key blocks too, ctxtrain from 2026-11-28T20:30Z): their
  // block cost and per-pair rate against the 128-key blocks', fitted on their rows; head dim
  // 64's rate apart where the rows hold both head dims (0: the one before it); 0 and 1 where a
  // profile has none (the 128-key blocks' cost and rate).
  double attention_bwd_union64_block_us = 0;
  double sparse_bwd_union64_efficiency = 1.0;
  double sparse_bwd_union64_efficiency_d64 = 0;
  // The backward's items over a chunk's own positions (a launch started heaviest first; split own
  // blocks add their dK/dV by fp32 atomics), fitted on the own-only launches; 0: the backward's
  // item cost, which is then fitted there too.
  double attention_bwd_own_item_us = 0;
  // Memory-bound kernels: fraction of the device copy bandwidth.
  double memory_efficiency = 0.8;
  // The memory-bound kernels measured apart (cost.h MemoryKernelName -> value): each one's fixed
  // cost in place of launch_us (an RMSNorm backward reduces its weight gradient's partials after
  // its rows: 6.8 us where a launch is 3.8 on the H200) and its fraction of the device copy
  // bandwidth. A kernel not listed: launch_us and memory_efficiency.
  std::map<std::string, double> memory_kernel_fixed_us, memory_kernel_efficiency;
  // The same kernels right after the kernel that wrote their input (KernelShape::warm_input),
  // where their traffic fits the L2 (l2_cache_mib, the device's): their fixed cost and fraction
  // there (measured where ctxplan-measure times them so; empty: as cold).
  std::map<std::string, double> memory_kernel_warm_fixed_us, memory_kernel_warm_efficiency;
  double l2_cache_mib = 0;  // 0: unknown (no warm rate)
  // LoRA adapters' thin GEMMs (cuBLASLt, rank-wide): fraction of the memory-bound rate their
  // traffic reaches (kernels/cost.h LoraAdapters). 1 where a profile has not measured them.
  double lora_efficiency = 1;
  // Page selection: scoring pays a fixed cost, a cost per query tile and element of its summed
  // query (KV heads x head dim: short blocks sum it in partials and every score block loads
  // them; the loads' latency, not the queries' bytes, sets the time, at least the queries' read
  // at the memory-bound rate) and a cost per candidate page and query tile; top-k per candidate
  // page (one block a tile: tiles beyond the SMs take another wave).
  double page_score_fixed_us = 0;
  double page_score_ns_per_tile_element = 0;  // 0: the queries' read at the memory rate alone
  double page_score_ns_per_tile_page = 0;
  double page_topk_fixed_us = 0;  // the selections' read-back to the host and its stream sync
  double page_topk_ns_per_page = 0;
  // Host side: one copy call's fixed cost; pinning host memory; host memory copy; AdamW on the
  // host (parameters a second); random weights; the arena's reservation.
  double copy_call_us = 0;
  double pin_gbs = 0;
  double host_memcpy_gbs = 0;
  double host_adamw_gparams = 0;
  double weights_init_gparams = 0;  // ctxtrain's random weights on the host (no --weights file)
  // The weights rounded to bf16 on the host's threads and copied up from pageable staging
  // (weights_upload.h); 0 where not measured (the upload is then timed at the pinned link rate).
  double weights_upload_gparams = 0;
  double device_alloc_gbs = 0;
  // Power: a training step holds the board at its power limit, and the SM clock sinks until the
  // draw fits (sim/include/ctxplan/sim/clock_model.h). The compute rates above are at the
  // maximum SM clock; each kind of kernel draws idle_w plus its own watts at that clock (measured
  // sustained, scaled to the maximum clock). All 0: no power limit modelled.
  double max_sm_clock_mhz = 0;
  double power_limit_w = 0;
  double idle_w = 0;
  double gemm_w = 0;           // GEMMs and the fused loss
  double attention_fwd_w = 0;  // attention forward (head dim 128; both where no d64 below)
  double attention_bwd_w = 0;  // attention backward
  // Head dim 64's attention watts where the power group timed it apart (0: the ones above).
  // At the same clock its kernels draw ~0.6-0.7 of head dim 128's (H200: 703 / 711 W forward /
  // backward against 1121 / 1005; sim/MODEL-LOG.md).
  double attention_fwd_w_d64 = 0;
  double attention_bwd_w_d64 = 0;
  double memory_w = 0;  // HBM-bound kernels
  // How well NVML's SM clock reading explains the kernels' speed under the power limit: the
  // median |error| of 1 / clock over the power group's sustained kernels (ctxplan calibrate's
  // "sustained" residual). The planner's clock is the kernels' speed (clock_model.h), which NVML
  // reports on the H200 (~3%) but not on the H100 (~14% low). < 0: not measured.
  double nvml_clock_speed_error = -1;

  bool empty() const { return gemm_tflops <= 0; }
  // The attention watts of a direction at head dim 64 (d64) or 128.
  double attention_w(bool backward, bool d64) const {
    const double d64_w = backward ? attention_bwd_w_d64 : attention_fwd_w_d64;
    if (d64 && d64_w > 0) return d64_w;
    return backward ? attention_bwd_w : attention_fwd_w;
  }
  // The attention rate of a direction at head dim 64 (d64) or 128.
  double attention_tflops(bool backward, bool d64) const {
    return backward ? (d64 ? attention_bwd_tflops_d64 : attention_bwd_tflops_d128)
                    : (d64 ? attention_fwd_tflops_d64 : attention_fwd_tflops_d128);
  }
  // The page table of a direction, head dim and kind (dense, or the sparse fraction), as stored:
  // a head dim 64 table may be empty (then the head dim 128 one applies: the model's choice).
  std::map<int64_t, double>& page_table(bool backward, bool d64, bool sparse) {
    if (sparse)
      return backward ? (d64 ? sparse_bwd_page_efficiency_d64 : sparse_bwd_page_efficiency)
                      : (d64 ? sparse_fwd_page_efficiency_d64 : sparse_fwd_page_efficiency);
    return backward ? (d64 ? page_bwd_efficiency_d64 : page_bwd_efficiency)
                    : (d64 ? page_fwd_efficiency_d64 : page_fwd_efficiency);
  }
  const std::map<int64_t, double>& page_table(bool backward, bool d64, bool sparse) const {
    return const_cast<KernelProfile*>(this)->page_table(backward, d64, sparse);
  }
  // The table that times head dim 64 (d64) or 128: head dim 64's where the profile has it, else
  // head dim 128's.
  const std::map<int64_t, double>& timing_page_table(bool backward, bool d64, bool sparse) const {
    const auto& own = page_table(backward, d64, sparse);
    return d64 && own.empty() ? page_table(backward, false, sparse) : own;
  }
  bool has_power() const { return power_limit_w > 0 && max_sm_clock_mhz > 0 && gemm_w > 0; }
};

// The memory-bound kernels a profile may time apart (ctxplan-measure's sample names), in the
// order of kernels/cost.h's MemoryKernel after kOther.
inline constexpr std::array<std::string_view, 10> kMemoryKernelNames = {
    "embedding_fwd",  "rmsnorm_fwd", "rmsnorm_bwd", "rope",      "kv_write",
    "dkv_accumulate", "swiglu_fwd",  "swiglu_bwd",  "zero_fill", "adamw"};

struct GpuSpec {
  std::string name;          // catalogue name ("h200")
  std::string display_name;  // "NVIDIA H200 SXM 141GB"
  std::string source_path;

  SpecValue memory_gib;            // usable device memory, GiB
  SpecValue memory_bandwidth_gbs;  // HBM bandwidth, GB/s (datasheet: read+write peak)
  SpecValue d2d_copy_gbs;          // device-to-device copy, GB/s counted read + write
  SpecValue bf16_dense_tflops;     // dense bf16 tensor-core peak, TFLOP/s
  SpecValue bf16_gemm_tflops;      // achieved bf16 GEMM at LLM shapes, TFLOP/s
  SpecValue attention_fwd_tflops;  // achieved attention forward (flash class), TFLOP/s
  SpecValue attention_bwd_tflops;  // achieved attention backward, TFLOP/s
  SpecValue host_h2d_gbs;          // pinned host-to-device, one direction alone, GB/s
  SpecValue host_d2h_gbs;          // pinned device-to-host, one direction alone, GB/s
  SpecValue host_duplex_gbs;       // both directions at once, sum, GB/s
  SpecValue cuda_context_gib;      // CUDA context + library workspaces, GiB
  int64_t sm_count = 0;
  double boost_clock_mhz = 0;  // SM boost clock (datasheet): scales a sibling's compute rates
  double tdp_w = 0;            // board power limit (datasheet); 0: not known
  std::string host_link;       // "pcie-gen5-x16", "nvlink-c2c"
  KernelProfile kernels;       // empty: the planner derives one from the spec values

  int64_t memory_bytes() const;
};

// `target`'s kernel profile estimated from a calibrated `sibling`: tensor-core rates scale with
// the dense bf16 peaks (SMs x clock x architecture), memory-bound work with the device copy
// bandwidth (already in the spec values), the page top-k (one SM a tile) with the SM clock;
// launch and host costs stay (same driver, same host). Power: the target's own limit (tdp_w),
// idle in proportion to it, and each kernel kind's watts with the work a second (the dense
// peaks: the same energy an operation); a target without tdp_w has no power model.
// provenance kEstimate, derived_from set.
KernelProfile ScaleKernelProfile(const GpuSpec& sibling, const GpuSpec& target);

// A GPU in a host with some RAM: what `--machine` or `--gpu` + `--host-ram` select.
struct MachineSpec {
  std::string name;  // preset name ("h200-125g") or "<gpu>+<ram>" for a custom one
  GpuSpec gpu;
  int64_t host_ram_bytes = 0;       // installed host RAM
  int64_t host_reserved_bytes = 0;  // kept for the OS, the process and its pageable buffers
  double host_memory_gbs = 0.0;     // host DRAM bandwidth, for an optimizer step on the host
  // Several GPUs (DESIGN.md, "Ranks"): the GPUs of one machine share its host RAM, each has its
  // own PCIe link; neighbouring pipeline stages exchange activations over the peer link inside
  // a machine and over the network between machines.
  int32_t gpus = 1;              // GPUs in the machine
  double peer_gbs = 0.0;         // GB/s one way between two of its GPUs (NVLink, or PCIe)
  double network_gbs = 0.0;      // GB/s one way from one GPU to another machine's
  double peer_latency_us = 0.0;  // per transfer, either link
  // What the host's side of the PCIe links gives all its GPUs copying one way at once, summed
  // over the GPUs (`ctxplan-measure --only links`). 0: not measured, each link as if alone.
  double host_links_h2d_gbs = 0.0;
  double host_links_d2h_gbs = 0.0;
  // A page-sparse layer's selection read-back (`ctxplan-measure --only readback`): from the end of
  // the top-k on the GPU to the next kernel the host can issue, the host waits for the stream,
  // reads the tiles' selections, sorts their union and writes the layer's page table. The GPU
  // idles meanwhile. Fixed, then per selection entry (tiles x pages a tile) and per earlier page
  // of the layer. 0: not measured, no wait.
  double selection_read_back_us = 0.0;
  double selection_read_back_ns_per_entry = 0.0;
  double selection_read_back_ns_per_page = 0.0;
  std::string note;  // what the preset describes; empty for a custom machine

  int64_t host_usable_bytes() const { return host_ram_bytes - host_reserved_bytes; }
};

}  // namespace ctxplan
