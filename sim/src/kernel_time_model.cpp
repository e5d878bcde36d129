#include "ctxplan/sim/kernel_time_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "ctxplan/models/errors.h"

namespace ctxplan::sim {

namespace {

// The attention kernels' blocks (kernels/src/cuda/attention_*.cu): 128 queries by 128 keys.
constexpr double kAttentionBlock = 128.0;
// Spec-value defaults for a GPU without a kernel profile: the flat rates the planner used before
// profiles (the H200's measured fractions), so that such a GPU predicts as it always did.
constexpr double kSpecLaunchUs = 2.5;
constexpr double kSpecCopyCallUs = 1.0;
constexpr double kSpecLossEfficiency = 0.81;
constexpr double kSpecSparseForward = 0.81;
constexpr double kSpecSparseBackward = 0.77;
constexpr double kSpecMemoryEfficiency = 0.8;

// A launch of `items` items over the SMs, one at a time an SM: whole waves of the mean item, then
// a last, partial wave as long as the longest item; never less than the longest item (fewer
// items than SMs). Exact for equal items (256 items on 132 SMs: two waves, where "the work
// spread evenly plus half the longest item" said 2.44 and over-timed Llama-3.2-1B's chunk-1024
// attention by 18%).
double LaunchSeconds(double work, double longest, double sms, double items) {
  items = std::max(1.0, std::round(items));
  const double full_waves = std::floor(items / sms);
  const double last_wave = items - full_waves * sms > 0 ? longest : 0.0;
  return std::max(full_waves * (work / items) + last_wave, longest);
}

// A launch of unequal items started heaviest first, as the backward's over a chunk's own positions
// starts them (own key block 0 sees every query block, the last one only its own): the
// multiprocessors that drew the heavy items finish as the light ones fill the rest, so the launch
// takes its work spread over the multiprocessors, or its longest item (the fixed waves of
// LaunchSeconds, each as long as the average item and the last as the longest, overstated a
// 16K first chunk's backward by 10-27%).
double HeaviestFirstSeconds(double work, double longest, double sms) {
  return std::max(work / sms, longest);
}

bool FastPage(int64_t p) {
  return p >= 64 && (p & (p - 1)) == 0;
}

}  // namespace

KernelProfile EffectiveKernelProfile(const GpuSpec& gpu) {
  if (!gpu.kernels.empty()) return gpu.kernels;
  KernelProfile k;
  k.provenance = Provenance::kEstimate;
  k.derived_from = "spec values";
  k.launch_us = kSpecLaunchUs;
  k.gemm_tflops = k.gemm_accumulate_tflops = gpu.bf16_gemm_tflops.value;
  k.loss_efficiency = kSpecLossEfficiency;
  k.attention_fwd_tflops_d128 = k.attention_fwd_tflops_d64 = gpu.attention_fwd_tflops.value;
  k.attention_bwd_tflops_d128 = k.attention_bwd_tflops_d64 = gpu.attention_bwd_tflops.value;
  k.page_fwd_efficiency = {{128, 1.0}};
  k.page_bwd_efficiency = {{128, 1.0}};
  k.sparse_fwd_efficiency = kSpecSparseForward;
  k.sparse_bwd_efficiency = kSpecSparseBackward;
  k.memory_efficiency = kSpecMemoryEfficiency;
  k.copy_call_us = kSpecCopyCallUs;
  return k;
}

std::string DescribeKernelProfile(const KernelProfile& k) {
  if (k.provenance == Provenance::kMeasured)
    return "measured (" + k.gpu_name + ", " + k.date + ", driver " + k.driver + ")";
  if (k.derived_from == "spec values") return "estimate (spec values only, no calibrated sibling)";
  return "estimate (scaled from " + k.derived_from + "'s calibration)";
}

KernelTimeModel::KernelTimeModel(const MachineSpec& machine)
    : KernelTimeModel(machine, EffectiveKernelProfile(machine.gpu)) {}

KernelTimeModel::KernelTimeModel(const MachineSpec& machine, KernelProfile profile)
    : profile_(std::move(profile)) {
  const GpuSpec& gpu = machine.gpu;
  sm_count_ = std::max<int64_t>(1, gpu.sm_count);
  hbm_bytes_per_second_ = gpu.d2d_copy_gbs.value * 1e9 * profile_.memory_efficiency;
  h2d_bytes_per_second_ = gpu.host_h2d_gbs.value * 1e9;
  d2h_bytes_per_second_ = gpu.host_d2h_gbs.value * 1e9;
  // Both directions at once, the device-to-host copy keeps its own rate and the host-to-device
  // one takes what is left. The calibration times equal copies started together (sum rate S):
  // the D2H ends at B / D, the H2D has then moved x B / D and finishes alone at H, so
  // 2 / S = 1 / D + (1 - x / D) / H gives x, the H2D rate while a D2H runs. The traces agree:
  // the page-sparse backward's D2H ran at 50-55 GB/s with H2D beside it (H100 and H200), where
  // an even split of S said 47-49.
  const double h = gpu.host_h2d_gbs.value, d = gpu.host_d2h_gbs.value;
  const double sum = gpu.host_duplex_gbs.value;
  double h2d_beside = sum / 2.0;  // an even split, when the three rates do not fit the above
  if (h > 0 && d > 0 && sum > 0) {
    const double x = d * (1.0 - h * (2.0 / sum - 1.0 / d));
    if (x > 0 && x <= h) h2d_beside = x;
  }
  duplex_bytes_per_second_ = std::min({h2d_beside, h, d}) * 1e9;
  host_bytes_per_second_ = machine.host_memory_gbs * 1e9;
  links_h2d_bytes_per_second_ = machine.host_links_h2d_gbs * 1e9;
  links_d2h_bytes_per_second_ = machine.host_links_d2h_gbs * 1e9;
  gpus_per_machine_ = std::max(1, machine.gpus);
  peer_bytes_per_second_ = (machine.peer_gbs > 0 ? machine.peer_gbs : gpu.host_h2d_gbs.value) * 1e9;
  network_bytes_per_second_ =
      (machine.network_gbs > 0 ? machine.network_gbs : gpu.host_h2d_gbs.value) * 1e9;
  peer_latency_seconds_ = machine.peer_latency_us * 1e-6;
  read_back_seconds_ = machine.selection_read_back_us * 1e-6;
  read_back_seconds_per_entry_ = machine.selection_read_back_ns_per_entry * 1e-9;
  read_back_seconds_per_page_ = machine.selection_read_back_ns_per_page * 1e-9;
  for (size_t i = 0; i < memory_kernels_.size(); ++i) {
    const std::string name(MemoryKernelName(static_cast<MemoryKernel>(i)));
    const auto fixed = profile_.memory_kernel_fixed_us.find(name);
    const auto efficiency = profile_.memory_kernel_efficiency.find(name);
    if (name.empty() || fixed == profile_.memory_kernel_fixed_us.end() ||
        efficiency == profile_.memory_kernel_efficiency.end() || efficiency->second <= 0)
      continue;
    MemoryKernelTime& t = memory_kernels_[i];
    t = {true, fixed->second * 1e-6, profile_.memory_efficiency / efficiency->second};
    const auto warm = profile_.memory_kernel_warm_efficiency.find(name);
    const auto warm_fixed = profile_.memory_kernel_warm_fixed_us.find(name);
    if (warm != profile_.memory_kernel_warm_efficiency.end() && warm->second > 0 &&
        warm_fixed != profile_.memory_kernel_warm_fixed_us.end()) {
      t.warm_fixed_seconds = warm_fixed->second * 1e-6;
      t.warm_slower = profile_.memory_efficiency / warm->second;
    }
  }
  l2_bytes_ = profile_.l2_cache_mib * 1024.0 * 1024.0;
  CTXPLAN_CHECK(profile_.gemm_tflops > 0 && profile_.attention_fwd_tflops_d128 > 0 &&
                    profile_.attention_bwd_tflops_d128 > 0 && hbm_bytes_per_second_ > 0 &&
                    h2d_bytes_per_second_ > 0 && d2h_bytes_per_second_ > 0 &&
                    host_bytes_per_second_ > 0 && profile_.gemm_tile_rows > 0 &&
                    profile_.gemm_tile_cols > 0,
                "machine spec rates must be positive");
}

Tick KernelTimeModel::Duration(const Op& op) const {
  if (op.kind == OpKind::kPeerRecv) {
    // From the stage before (activations) or after (their gradient).
    const int peer = op.stream == Stream::kRecvPrev ? op.rank - 1 : op.rank + 1;
    return PeerDuration(static_cast<int64_t>(op.cost.bytes), peer, op.rank);
  }
  return Duration(op.cost, op.phase);
}

Tick KernelTimeModel::PeerDuration(int64_t bytes, int from, int to) const {
  const bool same_machine = from / gpus_per_machine_ == to / gpus_per_machine_;
  const double per_second = same_machine ? peer_bytes_per_second_ : network_bytes_per_second_;
  return SecondsToTicks(peer_latency_seconds_ + static_cast<double>(bytes) / per_second);
}

double KernelTimeModel::GemmComputeSeconds(const KernelShape& s) const {
  const KernelProfile& k = profile_;
  const bool add = s.accumulates;
  const double tr = static_cast<double>(add ? k.gemm_accumulate_tile_rows : k.gemm_tile_rows);
  const double tc = static_cast<double>(add ? k.gemm_accumulate_tile_cols : k.gemm_tile_cols);
  const double rate_per_sm =
      (add ? k.gemm_accumulate_tflops : k.gemm_tflops) * 1e12 / static_cast<double>(sm_count_);
  const double wave_us = add ? k.gemm_accumulate_wave_us_per_byte * s.out_bytes : k.gemm_wave_us;
  const double tiles =
      std::ceil(static_cast<double>(s.rows) / tr) * std::ceil(static_cast<double>(s.cols) / tc);
  const double sms = static_cast<double>(sm_count_);
  double waves = std::ceil(tiles / sms);
  double split = 1.0;
  if (tiles < sms && !add)
    split = std::max(1.0, std::min(static_cast<double>(k.gemm_split_max), std::floor(sms / tiles)));
  const double tile_seconds = 2.0 * tr * tc * static_cast<double>(s.depth) / split / rate_per_sm;
  return waves * (tile_seconds + wave_us * 1e-6);
}

double KernelTimeModel::LossGemmSeconds(const OpCost& cost) const {
  const KernelShape& s = cost.shape;
  // The loss runs a vocabulary tile at a time, each tile's GEMMs shaped by the chunk: over few
  // tokens the logits are a thin wave, dX [tokens x hidden] a handful of tiles each summing a
  // whole vocabulary tile, and dW [tile x hidden] many tiles summing only the tokens, whose
  // accumulate costs more than their FLOPs. A trainable head runs four GEMMs a tile, else three.
  const double one = 2.0 * static_cast<double>(s.rows) * static_cast<double>(s.cols) *
                     static_cast<double>(s.depth);
  const bool head_trainable = cost.flops > 3.5 * one;
  auto tile_seconds = [&](int64_t cols) {
    KernelShape logits;  // [tokens x cols] fp32 = x W_tile^T, twice (LSE pass, gradient pass)
    logits.rows = s.rows;
    logits.cols = cols;
    logits.depth = s.depth;
    // [tokens x hidden] fp32 += g W_tile, over the tile's columns: timed as a plain GEMM, split
    // over its long sum (as an accumulating one, unsplit, the loss rows fit at 39% max error).
    KernelShape dx;
    dx.rows = s.rows;
    dx.cols = s.depth;
    dx.depth = cols;
    KernelShape dw;  // [cols x hidden] += g^T x, over the tokens
    dw.rows = cols;
    dw.cols = s.depth;
    dw.depth = s.rows;
    dw.accumulates = true;
    dw.out_bytes = s.out_bytes;
    return 2.0 * GemmComputeSeconds(logits) + GemmComputeSeconds(dx) +
           (head_trainable ? GemmComputeSeconds(dw) : 0.0);
  };
  const int64_t tile = s.vocab_tile > 0 ? std::min(s.vocab_tile, s.cols) : s.cols;
  const int64_t rest = s.cols % tile;
  return static_cast<double>(s.cols / tile) * tile_seconds(tile) +
         (rest > 0 ? tile_seconds(rest) : 0.0);
}

double KernelTimeModel::AttentionComputeSeconds(const OpCost& cost) const {
  const KernelProfile& k = profile_;
  const KernelShape& s = cost.shape;
  const bool backward = cost.rate == RateClass::kAttentionBackward ||
                        cost.rate == RateClass::kSparseAttentionBackward;
  const bool sparse = cost.rate == RateClass::kSparseAttentionForward ||
                      cost.rate == RateClass::kSparseAttentionBackward;
  const bool d64 = s.head_dim > 0 && s.head_dim <= 64;
  const double head_dim = s.head_dim > 0 ? s.head_dim : 128.0;
  const double tflops = k.attention_tflops(backward, d64);
  const double sms = static_cast<double>(sm_count_);
  // One 128 x 128 block of (query, key) pairs for one head, and an item's fixed cost.
  const double block = (backward ? 10.0 : 4.0) * kAttentionBlock * kAttentionBlock * head_dim /
                       (tflops * 1e12 / sms);
  const double item = (backward ? k.attention_bwd_item_us : k.attention_fwd_item_us) * 1e-6;
  if (!backward) return AttentionForwardSeconds(cost, block, item, d64, sparse);
  const double heads = std::max(1, s.heads);
  const double kv_heads = std::max(1, s.kv_heads > 0 ? s.kv_heads : s.heads);
  const double group = heads / kv_heads;
  const double q_blocks = std::ceil(static_cast<double>(s.rows) / kAttentionBlock);
  // The chunk's own positions, causal. Over earlier pages the runtime runs them inside the paged
  // launch (`merged`, the own op launches nothing): the paged op's time carries their work.
  // The backward's items are key blocks over the whole GQA group, or (the kernels since
  // 2026-11-27T16:20Z at long chunks, and since 2026-11-27T19:15Z a first chunk's own-only
  // launch from 4096 tokens, AttentionBackwardSplitsOwnHeads) one a query head, as the
  // forward's are.
  const bool own_by_group =
      !(k.own_bwd_split && AttentionBackwardSplitsOwnHeads(s.rows, s.heads, s.kv_heads, s.head_dim,
                                                           s.page_tokens == 0));
  // A profile with an own-launch item cost times the backward's own items by it (and their launch
  // as started heaviest first); one without, by the shared item cost in fixed waves.
  const bool own_fit = k.attention_bwd_own_item_us > 0;
  const double own_item = own_fit ? k.attention_bwd_own_item_us * 1e-6 : item;
  const double own_units = own_by_group ? kv_heads : heads;
  const double unit_heads = own_by_group ? group : 1.0;
  const double own_blocks = q_blocks * (q_blocks + 1.0) / 2.0;
  const double own_work = own_units * (q_blocks * own_item + unit_heads * own_blocks * block);
  const double own_items = own_units * q_blocks;
  if (s.page_tokens == 0) {
    if (s.merged) return 0.0;
    const double longest = own_item + unit_heads * q_blocks * block;
    return own_fit ? HeaviestFirstSeconds(own_work, longest, sms)
                   : LaunchSeconds(own_work, longest, sms, own_items);
  }
  const double p = static_cast<double>(s.page_tokens);
  const double paged_block = block / PagedEfficiency(s.page_tokens, true, d64, sparse);
  // Key blocks (of 128 keys) each query tile attends, and the blocks the launch's items cover.
  const double tile_blocks = static_cast<double>(s.tile_pages) * p / kAttentionBlock;
  const double key_pages = static_cast<double>(std::max(s.key_pages, s.tile_pages));
  // At GQA groups 1-2 the kernel takes key blocks over the union (AttentionBackwardOverUnion); a
  // profile that timed them has their block cost, one that did not times gathered blocks there.
  const bool over_union = sparse && k.attention_bwd_union_block_us > 0 &&
                          AttentionBackwardOverUnion(s.rows, s.heads, s.kv_heads,
                                                     static_cast<int64_t>(head_dim), s.page_tokens,
                                                     /*dkv_f32=*/s.out_bytes == 4);
  if (sparse && k.sparse_bwd_gathered && !over_union) {
    // Gathered blocks: each query tile's selected positions 128 at a time, a block serving that
    // tile's queries only (attention_bwd_kernels.cuh); the same attended pairs, no item masked.
    const double gathered_us = d64 && k.attention_bwd_gathered_item_us_d64 > 0
                                   ? k.attention_bwd_gathered_item_us_d64
                                   : k.attention_bwd_gathered_item_us;
    const double block_item = gathered_us > 0 ? gathered_us * 1e-6 : item;
    const double items = kv_heads * q_blocks * std::ceil(tile_blocks);
    const double work =
        own_work + items * block_item + kv_heads * group * q_blocks * tile_blocks * paged_block;
    const double longest = block_item + group * std::min(1.0, tile_blocks) * paged_block;
    return LaunchSeconds(work, longest, sms, own_items + items);
  }
  // Backward items are key blocks (64 keys over sparse pages under 128 tokens).
  if (over_union) {
    // Over the union the launch is the two-warpgroup kernel without the producer warpgroup, its
    // own key blocks (a KV head's group each, never split) beside the union's: every 128 x 128
    // block of pairs, own or earlier, at the union's rate against the dense launch's at the head
    // dim (taken against the gathered blocks' page tables instead, fitted beside their block
    // cost, the union's pairs at head dim 64 came out 1.8x faster than they ran: sim/MODEL-LOG.md).
    // The union's blocks are UnionKeyBlocksOf's a page, at their block cost, the keys past a
    // page's end in its last block computed masked; a launch of 64-key blocks (one warpgroup, two
    // a multiprocessor) runs its own positions in 64-key blocks too, all at the 64-key rate (its
    // own items still counted a 128 keys).
    const UnionKeyBlocks cut = UnionKeyBlocksOf(s.page_tokens, static_cast<int64_t>(head_dim));
    const double union64_rate = d64 && k.sparse_bwd_union64_efficiency_d64 > 0
                                    ? k.sparse_bwd_union64_efficiency_d64
                                    : k.sparse_bwd_union64_efficiency;
    const double union_block =
        block / k.sparse_bwd_union_efficiency / (cut.keys == 64 ? union64_rate : 1.0);
    const double pair_block = union_block / cut.fill;
    const double block_cost =
        (cut.keys == 64 && k.attention_bwd_union64_block_us > 0 ? k.attention_bwd_union64_block_us
                                                                : k.attention_bwd_union_block_us) *
        1e-6;
    const double own_union_work =
        kv_heads * (q_blocks * own_item + group * own_blocks * union_block);
    const double items = kv_heads * std::ceil(key_pages * cut.per_page);
    const double work = own_union_work + items * block_cost +
                        kv_heads * group * q_blocks * tile_blocks * pair_block;
    const double served = q_blocks * std::min(1.0, s.tile_pages / key_pages);
    const double block_keys = std::min(static_cast<double>(cut.keys), p);
    const double longest =
        block_cost + group * served * (block_keys / kAttentionBlock) * pair_block;
    return LaunchSeconds(work, longest, sms, kv_heads * q_blocks + items);
  }
  const double keys_per_item = sparse && p < kAttentionBlock ? 64.0 : kAttentionBlock;
  const double items = kv_heads * std::ceil(key_pages * p / keys_per_item);
  const double work =
      own_work + items * item + kv_heads * group * q_blocks * tile_blocks * paged_block;
  // A key block serves every query block (dense), or those whose tiles selected it.
  const double served = sparse ? q_blocks * std::min(1.0, s.tile_pages / key_pages) : q_blocks;
  const double longest = item + group * served * (keys_per_item / kAttentionBlock) * paged_block;
  return LaunchSeconds(work, longest, sms, own_items + items);
}

double KernelTimeModel::AttentionForwardSeconds(const OpCost& cost, double block, double item,
                                                bool d64, bool sparse) const {
  const KernelShape& s = cost.shape;
  const double sms = static_cast<double>(sm_count_);
  const int64_t heads_n = std::max(1, s.heads);
  const double heads = static_cast<double>(heads_n);
  // An item a head and block of query rows (128, or 192 at head_dim 64 where the kernel takes
  // three consumers: AttentionForwardQueryRows), over its own positions in 128-key tiles, causal,
  // and its tile's pages. `block` is one 128 x 128 block of (query, key) pairs.
  const KernelProfile& k = profile_;
  const bool selected = sparse && s.page_tokens > 0;
  const bool by_waves = k.attention_fwd_rows128_efficiency_d64 > 0;  // the profile's kernel
  const int64_t rows =
      by_waves ? AttentionForwardQueryRows(s.rows, heads_n, s.head_dim > 0 ? s.head_dim : 128,
                                           selected, sm_count_)
               : 128;
  const double row_blocks = static_cast<double>(rows) / kAttentionBlock;  // 1 or 1.5
  // At head_dim 64 the rate is the 192-row blocks'; 128-row blocks reach a fraction of it.
  if (d64 && by_waves && rows == 128) block /= k.attention_fwd_rows128_efficiency_d64;
  const int64_t q_items = (s.rows + rows - 1) / std::max<int64_t>(rows, 1);
  double own_tiles = 0;  // 128-key tiles the launch's items walk over own positions, one head
  for (int64_t i = 0; i < q_items; ++i)
    own_tiles += std::ceil(static_cast<double>(std::min((i + 1) * rows, s.rows)) / kAttentionBlock);
  const double last_tiles = std::ceil(static_cast<double>(s.rows) / kAttentionBlock);
  const double items = heads * static_cast<double>(q_items);
  double work = items * item + heads * own_tiles * row_blocks * block;
  double longest = item + last_tiles * row_blocks * block;
  if (s.page_tokens == 0) {
    if (s.merged) return 0.0;
    return LaunchSeconds(work, longest, sms, items);
  }
  const double paged_block = block / PagedEfficiency(s.page_tokens, false, d64, sparse);
  const double tile_blocks =
      static_cast<double>(s.tile_pages) * static_cast<double>(s.page_tokens) / kAttentionBlock;
  if (d64 && selected && k.attention_fwd_slices_d64 && by_waves &&
      AttentionForwardSlices(s.rows, heads_n, s.kv_heads, 64, true, sm_count_)) {
    // Query-head slices (ForwardSliceBlockAt): a KV head's 128-query tile in blocks of two or
    // three 64-query slices of its query heads, each walking the tile's pages and its own keys;
    // three at the 192-row blocks' rate, two at the 128-row fraction of it (`block` here is the
    // 128-row blocks' when rows is 128).
    const int64_t kv_heads_n = std::max<int64_t>(1, s.kv_heads);
    const int group = static_cast<int>(std::max<int64_t>(1, heads_n / kv_heads_n));
    const double kv_heads = static_cast<double>(kv_heads_n);
    const double rows128 = k.attention_fwd_rows128_efficiency_d64;
    const double block3 = rows == 128 ? block * rows128 : block;
    const double rows_n = static_cast<double>(s.rows);
    const double tiles = std::ceil(rows_n / kAttentionBlock);
    double slice_work = 0, slice_longest = 0, slice_items = 0;
    for (int b = 0; b < ForwardSliceBlocks(group); ++b) {
      const ForwardSliceBlock sb = ForwardSliceBlockAt(group, b);
      const double at = sb.slices == 3 ? block3 : block3 / rows128;
      const double at_paged = at / PagedEfficiency(s.page_tokens, false, d64, sparse);
      const double slice_rows = sb.slices * 64.0 / kAttentionBlock;
      for (double i = 0; i < tiles; ++i) {
        const double own = std::ceil(std::min((i + 1) * kAttentionBlock, rows_n) / kAttentionBlock);
        const double one = item + slice_rows * (own * at + tile_blocks * at_paged);
        slice_work += kv_heads * one;
        slice_longest = std::max(slice_longest, one);
        slice_items += kv_heads;
      }
    }
    return LaunchSeconds(slice_work, slice_longest, sms, slice_items);
  }
  work += items * tile_blocks * row_blocks * paged_block;
  longest += tile_blocks * row_blocks * paged_block;
  return LaunchSeconds(work, longest, sms, items);
}

double KernelTimeModel::PageEfficiency(const std::map<int64_t, double>& table,
                                       int64_t page_tokens) {
  if (page_tokens <= 0 || table.empty()) return 1.0;
  if (auto it = table.find(page_tokens); it != table.end()) return it->second;
  // An unmeasured page size runs the kernel path of its class (powers of two >= 64 take the
  // fast path): the nearest measured size of that class, else the nearest of any.
  const double log_p = std::log2(static_cast<double>(page_tokens));
  double best = -1, best_distance = 0;
  for (int pass = 0; pass < 2 && best < 0; ++pass) {
    for (const auto& [p, fraction] : table) {
      if (pass == 0 && FastPage(p) != FastPage(page_tokens)) continue;
      const double distance = std::abs(std::log2(static_cast<double>(p)) - log_p);
      if (best < 0 || distance < best_distance) {
        best = fraction;
        best_distance = distance;
      }
    }
  }
  return best;
}

double KernelTimeModel::SelectionReadBackSeconds(const KernelShape& s) const {
  return read_back_seconds_ +
         read_back_seconds_per_entry_ * static_cast<double>(s.rows * s.tile_pages) +
         read_back_seconds_per_page_ * static_cast<double>(s.cols);
}

double KernelTimeModel::PagedEfficiency(int64_t page_tokens, bool backward, bool d64,
                                        bool sparse) const {
  const KernelProfile& k = profile_;
  double efficiency = PageEfficiency(k.timing_page_table(backward, d64, false), page_tokens);
  if (sparse) {
    const auto& fractions = k.timing_page_table(backward, d64, true);
    efficiency *= fractions.empty() ? (backward ? k.sparse_bwd_efficiency : k.sparse_fwd_efficiency)
                                    : PageEfficiency(fractions, page_tokens);
  }
  return efficiency;
}

KernelTimeModel::PageRate KernelTimeModel::PageRateAgainst128(int64_t page_tokens, int64_t head_dim,
                                                              bool sparse) const {
  PageRate r;
  if (page_tokens <= 0) return r;
  const bool d64 = head_dim > 0 && head_dim <= 64;
  r.forward =
      PagedEfficiency(page_tokens, false, d64, sparse) / PagedEfficiency(128, false, d64, sparse);
  r.backward =
      PagedEfficiency(page_tokens, true, d64, sparse) / PagedEfficiency(128, true, d64, sparse);
  // Measured: the table that settles the rate holds the size. A page-sparse size's table was
  // fitted over the dense table's value there (measured or not), so it settles sparse runs.
  const KernelProfile& k = profile_;
  for (const bool backward : {false, true}) {
    const auto& sparse_table = k.timing_page_table(backward, d64, true);
    const auto& settling =
        sparse && !sparse_table.empty() ? sparse_table : k.timing_page_table(backward, d64, false);
    if (!settling.empty() && !settling.contains(page_tokens)) r.measured = false;
  }
  return r;
}

KernelTimeModel::PageRate KernelTimeModel::HeadDimRateAgainst128(int64_t head_dim) const {
  PageRate r;
  if (head_dim <= 0 || head_dim > 64) return r;
  const KernelProfile& k = profile_;
  r.forward = k.attention_tflops(false, true) / k.attention_tflops(false, false);
  r.backward = k.attention_tflops(true, true) / k.attention_tflops(true, false);
  return r;
}

KernelTimeModel KernelTimeModel::AtClock(double fraction) const {
  return AtClocks({fraction, fraction, fraction});
}

KernelTimeModel KernelTimeModel::AtClocks(const PassClocks& fractions) const {
  for (const double fraction : fractions)
    CTXPLAN_CHECK(fraction > 0 && fraction <= 1.0, "clock fraction must be in (0, 1]");
  KernelTimeModel m = *this;
  m.clocks_ = fractions;
  return m;
}

KernelTimeModel KernelTimeModel::ForStages(int stages) const {
  KernelTimeModel m = *this;
  m.ShareHostLinks(stages);
  return m;
}

void KernelTimeModel::ShareHostLinks(int stages) {
  const int copiers = HostCopiers(stages);
  if (copiers < 2) return;
  // The stages run the same chunks side by side, so their copies one way go out together: an
  // even share of what the host gives all its GPUs at once, never more than a link alone. The
  // backward's host-to-device copies keep the lesser of that share and their rate beside a
  // device-to-host copy (the constructor): its two ways are not all busy on every GPU at once.
  const double n = copiers;
  if (links_h2d_bytes_per_second_ > 0)
    h2d_bytes_per_second_ = std::min(h2d_bytes_per_second_, links_h2d_bytes_per_second_ / n);
  if (links_d2h_bytes_per_second_ > 0)
    d2h_bytes_per_second_ = std::min(d2h_bytes_per_second_, links_d2h_bytes_per_second_ / n);
  duplex_bytes_per_second_ = std::min(duplex_bytes_per_second_, h2d_bytes_per_second_);
}

KernelTimeModel::OpTime KernelTimeModel::Time(const OpCost& cost, Phase phase) const {
  const KernelProfile& k = profile_;
  const KernelShape& s = cost.shape;
  const double launches = static_cast<double>(std::max(1, s.launches)) * k.launch_us * 1e-6;
  const double memory = cost.bytes / hbm_bytes_per_second_;
  const double side = s.side_bytes / hbm_bytes_per_second_;
  // Compute-bound seconds at the maximum clock, slowed to this model's clock when they, not
  // the memory traffic, bound the op. Its energy goes with its work: the op's FLOPs at the
  // kind's full rate (`full_seconds`), times what the kind draws there above idle (`watts`) - a
  // kernel on a slow path (small tiles, pages off the fast path) waits more and draws less.
  auto bounded = [&](double fixed, double compute_at_max, double full_seconds, double watts) {
    OpTime t;
    const double compute = compute_at_max / clock_fraction(phase);
    if (compute >= memory) {
      t.seconds = fixed + compute;
      t.energy.clock_bound_seconds = compute;
      t.energy.clock_joules = std::min(full_seconds, compute_at_max) * watts;
    } else {
      t.seconds = fixed + memory;
      t.energy.fixed_joules = memory * k.memory_w;
    }
    return t;
  };
  switch (cost.rate) {
    case RateClass::kNone:
      return {};
    case RateClass::kGemm: {
      if (cost.flops <= 0) return {};
      // A shape left empty (LoRA's thin GEMMs, a hand-made cost) is its FLOPs at the rate.
      const double compute = s.rows > 0 && s.cols > 0 && s.depth > 0
                                 ? GemmComputeSeconds(s)
                                 : cost.flops / (k.gemm_tflops * 1e12);
      OpTime t = bounded(launches, compute, cost.flops / (k.gemm_tflops * 1e12), k.gemm_w);
      t.seconds += side + s.lora_bytes / (hbm_bytes_per_second_ * k.lora_efficiency);
      return t;
    }
    case RateClass::kFusedLoss: {
      const double compute = s.rows > 0 && s.cols > 0 && s.depth > 0
                                 ? LossGemmSeconds(cost)
                                 : cost.flops / (k.gemm_tflops * 1e12);
      const double softmax =
          static_cast<double>(s.rows) * static_cast<double>(s.cols) * k.loss_ns_per_logit * 1e-9;
      return bounded(launches, compute / k.loss_efficiency + softmax,
                     cost.flops / (k.gemm_tflops * 1e12), k.gemm_w);
    }
    case RateClass::kAttentionForward:
    case RateClass::kSparseAttentionForward:
    case RateClass::kAttentionBackward:
    case RateClass::kSparseAttentionBackward: {
      if (cost.flops <= 0) return {launches, {}};
      // The own positions merged into the paged launch: nothing runs here; the paged op's time
      // and energy carry them.
      if (s.merged && s.page_tokens == 0) return {launches, {}};
      const bool backward = cost.rate == RateClass::kAttentionBackward ||
                            cost.rate == RateClass::kSparseAttentionBackward;
      // A shape left empty is timed as a contiguous launch at the head dim 128 rate.
      const bool d64 = s.head_dim > 0 && s.head_dim <= 64;
      const double tflops = k.attention_tflops(backward, d64);
      double flops = cost.flops;
      if (s.page_tokens > 0) {  // with the own positions' causal pairs
        const int64_t t = s.rows, heads = std::max(1, s.heads);
        const int64_t head_dim = s.head_dim > 0 ? s.head_dim : 128;
        const double own_pairs = static_cast<double>(t) * static_cast<double>(t + 1) / 2.0;
        flops += backward ? AttentionBackwardCost(own_pairs, t, t, heads, 0, head_dim, 2).flops
                          : AttentionForwardCost(own_pairs, t, t, heads, 0, head_dim).flops;
      }
      // Page-sparse attention draws its kind's watts for its whole time: its gathered and
      // selected blocks keep the SMs busy where a dense kernel on a slow path waits
      // (sim/MODEL-LOG.md).
      const double compute_at_max = AttentionComputeSeconds(cost);
      const bool sparse = cost.rate == RateClass::kSparseAttentionForward ||
                          cost.rate == RateClass::kSparseAttentionBackward;
      const double full_seconds = sparse ? compute_at_max : flops / (tflops * 1e12);
      return bounded(launches, compute_at_max, full_seconds, k.attention_w(backward, d64));
    }
    case RateClass::kMemoryBound: {
      double fixed = launches, seconds = memory + side;
      if (const MemoryKernelTime& own = memory_kernels_[static_cast<size_t>(s.memory_kernel)];
          own.measured) {
        const bool in_l2 = s.warm_input && own.warm_slower > 0 && cost.bytes <= l2_bytes_;
        fixed = in_l2 ? own.warm_fixed_seconds : own.fixed_seconds;
        seconds *= in_l2 ? own.warm_slower : own.slower;
      }
      OpTime t{fixed + seconds, {}};
      t.energy.fixed_joules = seconds * k.memory_w;
      return t;
    }
    case RateClass::kPageScore: {
      const double per_page = k.page_score_ns_per_tile_page * 1e-9 * static_cast<double>(s.rows) *
                              static_cast<double>(s.cols);
      const double tiles = k.page_score_ns_per_tile_element * 1e-9 * static_cast<double>(s.rows) *
                           static_cast<double>(std::max<int64_t>(1, s.depth));
      return {launches + std::max(memory, tiles) + k.page_score_fixed_us * 1e-6 + per_page, {}};
    }
    case RateClass::kPageTopK: {
      // One block a query tile walks every candidate page; more tiles than SMs take more waves.
      const double waves = std::ceil(static_cast<double>(std::max<int64_t>(1, s.rows)) /
                                     static_cast<double>(sm_count_));
      const double walk = k.page_topk_ns_per_page * 1e-9 * static_cast<double>(s.cols) * waves;
      return {launches + k.page_topk_fixed_us * 1e-6 + std::max(walk, memory) +
                  SelectionReadBackSeconds(s),
              {}};
    }
    case RateClass::kHostToDevice:
    case RateClass::kDeviceToHost: {
      // The backward moves pages both ways at once; only the H2D yields (see the constructor).
      const bool both_ways = phase == Phase::kBackward && cost.rate == RateClass::kHostToDevice;
      const double per_second = both_ways                               ? duplex_bytes_per_second_
                                : cost.rate == RateClass::kHostToDevice ? h2d_bytes_per_second_
                                                                        : d2h_bytes_per_second_;
      const double calls = static_cast<double>(std::max(1, s.launches)) * k.copy_call_us * 1e-6;
      return {calls + cost.bytes / per_second, {}};
    }
    case RateClass::kPeer:
      return {peer_latency_seconds_ + cost.bytes / peer_bytes_per_second_, {}};
    case RateClass::kHostCompute: {
      // AdamW on the host: 12 FLOPs a parameter (kernels/cost.cpp).
      if (k.host_adamw_gparams > 0) return {cost.flops / 12.0 / (k.host_adamw_gparams * 1e9), {}};
      return {cost.bytes / host_bytes_per_second_, {}};
    }
  }
  return {};
}

}  // namespace ctxplan::sim
