#include "report_format.h"

#include <algorithm>
#include <cstdio>

#include "ctxplan/models/units.h"
#include "ctxplan/runtime/plan/plan_geometry.h"
#include "ctxplan/sim/kernel_changes.h"
#include "ctxplan/sim/kernel_time_model.h"
#include "run_flags.h"

namespace ctxplan::cli {

namespace {

std::string Printf(const char* format, double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, format, value);
  return buffer;
}

std::string Gib(int64_t bytes) {
  return Printf("%9.2f GiB", static_cast<double>(bytes) / kGiB);
}

std::string Header(const PlanContext& c) {
  std::string s = c.model.name + " on " + c.machine.name + " (" + c.machine.gpu.display_name +
                  ", " + FormatGiB(c.machine.host_ram_bytes) + " host RAM)\n";
  s += "  " + DescribeOptions(c.options) + "\n";
  return s;
}

// Whether the run's page-sparse backward would take key blocks over the union's pages
// (AttentionBackwardOverUnion, the rule the kernel and the time model share), and whether the
// GPU's profile has timed those blocks (else the time model takes gathered ones).
bool RunsUnionBlocks(const PlanContext& c, int64_t page_tokens) {
  const ModelSpec& m = c.model;
  return AttentionBackwardOverUnion(c.options.chunk_tokens, m.num_attention_heads,
                                    m.num_key_value_heads, m.head_dim, page_tokens,
                                    /*dkv_f32=*/c.options.grad_bytes() == 4);
}
bool RunsUnionBlocks(const PlanContext& c) {
  return RunsUnionBlocks(c, c.options.page_tokens);
}
bool UnionBlocksTimed(const PlanContext& c) {
  return sim::EffectiveKernelProfile(c.machine.gpu).attention_bwd_union_block_us > 0;
}

// The page-sparse backward's per-FLOP rate (FLOP/s) for the last chunk of a run of `model` with
// `options`, as the time model has it.
double LastChunkSparseBackwardRate(const sim::KernelTimeModel& time, const ModelSpec& model,
                                   const RunOptions& options) {
  const PlanGeometry g(model, options);
  const OpCost cost = g.paged_attention_backward_cost(g.Chunk(g.num_chunks() - 1));
  return cost.flops / sim::TicksToSeconds(time.Duration(cost, Phase::kBackward));
}

// The per-FLOP rate of attention over pages of `page_tokens` against pages of 128 (the page
// tables of the GPU's profile). Where the page-sparse backward takes key blocks over the union at
// either size (GQA groups 1-2), the backward's is the time model's for the run's last chunk
// instead, at the same selected tokens a query tile: those blocks' cost goes with the page
// (UnionKeyBlocksOf: 64-key blocks, part-full blocks, halves), which the tables, fitted on
// gathered blocks, do not hold.
sim::KernelTimeModel::PageRate RunPageRate(const PlanContext& c, int64_t page_tokens) {
  const RunOptions& o = c.options;
  const sim::KernelTimeModel time(c.machine);
  sim::KernelTimeModel::PageRate r =
      time.PageRateAgainst128(page_tokens, c.model.head_dim, !o.dense());
  if (o.dense() || o.context_tokens <= o.chunk_tokens || page_tokens == 128 ||
      o.chunk_tokens % 128 != 0 || o.chunk_tokens % page_tokens != 0 || !UnionBlocksTimed(c) ||
      !(RunsUnionBlocks(c, page_tokens) || RunsUnionBlocks(c, 128)))
    return r;
  auto rate = [&](int64_t page) {
    RunOptions at = o;
    at.page_tokens = page;
    at.page_budget = std::max<int64_t>(1, o.page_budget * o.page_tokens / page);
    return LastChunkSparseBackwardRate(time, c.model, at);
  };
  r.backward = rate(page_tokens) / rate(128);
  return r;
}

// Attention over pages of a size off the kernels' fast path runs slower per FLOP; the profile
// knows by how much, or says it never measured the size. Empty when the rate is measured and
// within 10% of pages of 128, or no page is attended.
std::string PageRateWarning(const PlanContext& c) {
  const RunOptions& o = c.options;
  if (o.context_tokens <= o.chunk_tokens || o.page_tokens == 128) return "";
  auto rate = [&](int64_t page) { return RunPageRate(c, page); };
  const sim::KernelTimeModel::PageRate r = rate(o.page_tokens);
  if (r.measured && std::min(r.forward, r.backward) >= 0.9) return "";
  std::string faster;  // page sizes that divide the chunk and run within 10% of 128's rate
  for (const int64_t page : {64, 128, 256}) {
    if (page == o.page_tokens || o.chunk_tokens % page != 0) continue;
    const sim::KernelTimeModel::PageRate other = rate(page);
    if (std::min(other.forward, other.backward) >= 0.9)
      faster += (faster.empty() ? "" : ", ") + std::to_string(page);
  }
  const std::string rates = Printf("%.0f%%", 100.0 * r.forward) + " (forward) and " +
                            Printf("%.0f%%", 100.0 * r.backward) +
                            " (backward) of the per-FLOP rate over pages of 128 on this GPU (" +
                            (o.dense() ? "dense" : "page-sparse");
  const std::string head = "  attention over pages of " + std::to_string(o.page_tokens) + ": ";
  const std::string tail = (faster.empty() ? "" : "; at full rate with --page " + faster) + "\n";
  if (!r.measured) {
    // The kernels choose their loader by the page size (attention_fwd.cu): a size the GPU's
    // calibration never ran may take a path none of its measured sizes took.
    return head + "not measured on this GPU; taken as the nearest measured size's rate, " + rates +
           "; the step time includes it, and may be optimistic)" + tail;
  }
  return head + rates + ", from its profile; the step time includes it)" + tail;
}

// The GPUs of one machine pipelined together share what its host's PCIe gives them copying at
// once (MachineSpec::host_links_*): each GPU's copy rates then, where that is below its link's.
struct SharedLinks {
  bool shared = false;
  int gpus = 1;                     // the machine's GPUs copying at once
  double h2d_gbs = 0, d2h_gbs = 0;  // a GPU's, with the others copying
  double alone_h2d_gbs = 0, alone_d2h_gbs = 0;
  // Several GPUs copying at once on a machine whose host links were never measured: each is
  // taken at its link's rates alone, which the one such host measured did not give them.
  bool unmeasured = false;
};
SharedLinks HostLinkShare(const PlanContext& c) {
  const sim::KernelTimeModel alone(c.machine);
  const sim::KernelTimeModel shared = alone.ForStages(c.options.pipeline_stages);
  SharedLinks l;
  l.gpus = alone.HostCopiers(c.options.pipeline_stages);
  l.h2d_gbs = shared.h2d_bytes_per_second() / 1e9;
  l.d2h_gbs = shared.d2h_bytes_per_second() / 1e9;
  l.alone_h2d_gbs = alone.h2d_bytes_per_second() / 1e9;
  l.alone_d2h_gbs = alone.d2h_bytes_per_second() / 1e9;
  l.shared = l.h2d_gbs < l.alone_h2d_gbs || l.d2h_gbs < l.alone_d2h_gbs;
  l.unmeasured =
      l.gpus > 1 && c.machine.host_links_h2d_gbs <= 0 && c.machine.host_links_d2h_gbs <= 0;
  return l;
}
std::string HostLinkNote(const PlanContext& c) {
  if (!c.options.offload) return "";
  const SharedLinks l = HostLinkShare(c);
  auto gbs = [](double v) { return Printf("%.1f", v); };
  if (l.unmeasured)
    return "  host links: not measured on " + c.machine.name + ": each of the " +
           std::to_string(l.gpus) + " GPUs copying at once is taken at " + gbs(l.alone_h2d_gbs) +
           " / " + gbs(l.alone_d2h_gbs) +
           " GB/s, as alone (on the 4x H100 host measured, each got 0.74 / 0.55 of its link's: "
           "`ctxplan-measure --only links` there gives the machine's own, host_links_* in its "
           "YAML)\n";
  if (!l.shared) return "";
  return "  host links: the " + std::to_string(l.gpus) +
         " GPUs of a machine copy at once and share " + gbs(c.machine.host_links_h2d_gbs) +
         " GB/s up and " + gbs(c.machine.host_links_d2h_gbs) + " down (measured); each copies at " +
         gbs(l.h2d_gbs) + " / " + gbs(l.d2h_gbs) + " GB/s, " + gbs(l.alone_h2d_gbs) + " / " +
         gbs(l.alone_d2h_gbs) + " alone (the step time includes it)\n";
}

// Attention at head dim 64 runs slower per FLOP than at 128 (the same softmax work for half the
// matrix work a tile); the profile knows by how much. Empty within 10% or at head dim 128.
std::string HeadDimRateNote(const PlanContext& c) {
  const sim::KernelTimeModel::PageRate r =
      sim::KernelTimeModel(c.machine).HeadDimRateAgainst128(c.model.head_dim);
  if (std::min(r.forward, r.backward) >= 0.9) return "";
  return "  attention at head dim " + std::to_string(c.model.head_dim) + ": " +
         Printf("%.0f%%", 100.0 * r.forward) + " (forward) and " +
         Printf("%.0f%%", 100.0 * r.backward) +
         " (backward) of the per-FLOP rate at head dim 128 on this GPU (from its profile; the "
         "step time includes it)\n";
}

// Page-sparse attention's backward runs slower per FLOP at a small GQA group: a gathered key block
// serves a 128-query selection tile's two 64-query items a query head, 2 x group items for its
// fixed cost (its keys' gather, its dK/dV atomics into the pages; kernels/PERF.md: on the H200 at
// head dim 64 group 1 ran 0.33x group 8's rate, the profile gives 0.29x). The run's last chunk's
// rate against the same chunk with 8 query heads a KV head; 1 for a dense run, one without
// earlier pages, or a group of 8 and up.
double SparseBackwardGroupRate(const PlanContext& c) {
  const RunOptions& o = c.options;
  const ModelSpec& m = c.model;
  if (o.dense() || o.context_tokens <= o.chunk_tokens || m.num_key_value_heads <= 0 ||
      m.num_attention_heads >= 8 * m.num_key_value_heads)
    return 1.0;
  ModelSpec group8 = m;
  group8.num_attention_heads = m.num_key_value_heads * 8;
  const sim::KernelTimeModel time(c.machine);
  return LastChunkSparseBackwardRate(time, m, o) / LastChunkSparseBackwardRate(time, group8, o);
}

// The note for a rate under half: a model's group is not the user's to choose, so only a cliff
// (groups 1-2) is worth a line; --json carries the rate at every group.
std::string GqaGroupRateNote(const PlanContext& c) {
  const double r = SparseBackwardGroupRate(c);
  if (r >= 0.5) return "";
  const ModelSpec& m = c.model;
  const int64_t group = m.num_attention_heads / m.num_key_value_heads;
  const std::string blocks =
      RunsUnionBlocks(c) && UnionBlocksTimed(c)
          ? "its key blocks over the union of the tiles' pages each serve the tiles that "
            "selected their page"
          : "a gathered key block serves " + std::to_string(2 * group) +
                " query items for its fixed cost";
  return "  page-sparse attention backward at GQA group " + std::to_string(group) + " (" +
         std::to_string(m.num_attention_heads) + " / " + std::to_string(m.num_key_value_heads) +
         " heads): " + Printf("%.0f%%", 100.0 * r) +
         " of its per-FLOP rate at group 8 on this GPU (" + blocks +
         "; from its profile; the step time includes it)\n";
}

// The kernel changes the GPU's profile predates for these options: its kernel times are the
// earlier kernels' there. Empty when it is up to date.
std::vector<sim::KernelChange> PredatedChanges(const PlanContext& c) {
  return sim::ChangesAfterProfile(sim::EffectiveKernelProfile(c.machine.gpu), c.options.page_tokens,
                                  c.model.head_dim);
}

// Whether the run's page-sparse backward takes key blocks over the union where the selection
// applies (GQA groups 1-2, AttentionBackwardOverUnion), on a GPU whose profile has not timed
// them: the plan times the gathered blocks there instead, which ran 1.1-2.0x slower on an H200
// (kernels/PERF.md).
bool UnionBlocksUntimed(const PlanContext& c) {
  return !c.options.dense() && c.options.context_tokens > c.options.chunk_tokens &&
         RunsUnionBlocks(c) && !UnionBlocksTimed(c);
}

// One line a change PredatedChanges names.
std::string ProfilePredatesNote(const PlanContext& c) {
  std::string s;
  if (UnionBlocksUntimed(c))
    s += "  note: this GPU's profile has not timed the page-sparse attention backward's key blocks "
         "over the union of the tiles' pages, which ctxtrain runs at GQA groups 1-2 (from "
         "2026-11-28): the step time takes gathered blocks there, 1.1-2.0x slower on an H200 "
         "(re-run `ctxplan calibrate` on this GPU)\n";
  const KernelProfile profile = sim::EffectiveKernelProfile(c.machine.gpu);
  for (const sim::KernelChange& change : PredatedChanges(c))
    s += "  note: this GPU's kernel times were calibrated on " + profile.date + ", before " +
         std::string(change.date) + ", when " + std::string(change.what) + ": at pages of " +
         std::to_string(c.options.page_tokens) + ", head dim " + std::to_string(c.model.head_dim) +
         " they time the earlier kernel (re-run `ctxplan calibrate` on this GPU)\n";
  return s;
}

// Page-sparse: how much the query tiles' selections overlap sets what offload copies and what the
// backward's key blocks span; it is the model's and the data's, known only from a run.
std::string SelectionNote(const PlanContext& c) {
  const RunOptions& o = c.options;
  if (o.dense() || o.selection.kind != SelectionModelKind::kDisjoint ||
      o.context_tokens <= (o.page_budget + o.sink_pages) * o.page_tokens)
    return "";
  if (o.selection.draw_scale > 0)
    return "  page unions: the union rule at the measured draw scale " +
           Printf("%.3g", o.selection.draw_scale) + "\n";
  return "  page unions: the union rule fitted on Qwen2.5-7B and Llama-3.2-1B runs (random "
         "tokens); a model's own selection moves copy time (Llama-3.1-8B's: 11% of a 128K offload "
         "step): "
         "`ctxplan selection TRACE` fits it from a traced run, for --selection disjoint:S\n";
}

int64_t CudaContextBytes(const MachineSpec& machine) {
  return static_cast<int64_t>(machine.gpu.cuda_context_gib.value * static_cast<double>(kGiB));
}

}  // namespace

std::string PlanText(const PlanContext& c, const sim::PlanReport& r) {
  std::string s = "ctxplan plan: " + Header(c);
  s += "  context " + FormatTokens(r.context_tokens) + " tokens in " + FormatCount(r.chunks) +
       " chunks; predicted by the " + c.path + " path\n";
  s += "  kernel times: " + sim::DescribeKernelProfile(sim::EffectiveKernelProfile(c.machine.gpu)) +
       "\n";
  s += PageRateWarning(c);
  s += ProfilePredatesNote(c);
  s += HeadDimRateNote(c);
  s += GqaGroupRateNote(c);
  s += SelectionNote(c);
  s += HostLinkNote(c);
  if (c.options.pipeline_stages > 1) {
    // Each GPU its stage of layers; the memory below is the GPU with the highest peak.
    const PlanGeometry g(c.model, c.options);
    s += "  pipelined over " + std::to_string(r.gpus) + " GPUs (" + std::to_string(r.machines) +
         (r.machines == 1 ? " machine" : " machines") + "), arena peak per GPU:";
    for (int32_t st = 0; st < g.stages(); ++st) {
      const auto i = static_cast<size_t>(st);
      s += (st ? "; " : " ") + std::string("layers ") + std::to_string(g.stage_first_layer(st)) +
           "-" + std::to_string(g.stage_first_layer(st + 1) - 1) +
           (i < r.prediction.gpu_peak_by_rank.size()
                ? " " + FormatGiB(r.prediction.gpu_peak_by_rank[i])
                : std::string());
    }
    s += "\n";
  }
  s += "\nGPU memory at peak, by category\n";
  for (int i = 0; i < kMemCategoryCount; ++i) {
    const int64_t bytes = r.prediction.gpu.at_peak[i];
    if (bytes == 0) continue;
    std::string name(MemCategoryName(static_cast<MemCategory>(i)));
    name.resize(16, ' ');
    s += "  " + name + Gib(bytes) + "\n";
  }
  s += "  cuda_context    " + Gib(CudaContextBytes(c.machine)) + "\n";
  s += "  allocated " + FormatGiB(r.gpu_memory.allocated) + " | reserved " +
       FormatGiB(r.gpu_memory.reserved) + " | device " + FormatGiB(r.gpu_memory.device) + " of " +
       FormatGiB(r.gpu_capacity) + (r.fits_gpu ? "  -> fits\n" : "  -> DOES NOT FIT\n");
  s += "Pinned host memory at peak " + FormatGiB(r.host_peak) + " of " +
       FormatGiB(r.host_capacity) + " usable" +
       (r.fits_host ? "  -> fits\n" : "  -> DOES NOT FIT\n");
  for (int i = 0; i < kMemCategoryCount; ++i) {
    const int64_t bytes = r.prediction.host.at_peak[i];
    if (bytes == 0) continue;
    std::string name(MemCategoryName(static_cast<MemCategory>(i)));
    name.resize(16, ' ');
    s += "  " + name + Gib(bytes) + "\n";
  }
  if (c.options.offload) {
    // The page store's two tiers: the GPU tier's pages never cross PCIe.
    const PlanGeometry g(c.model, c.options);
    const int64_t tier = g.gpu_tier_pages();
    s += "Page store: GPU tier " + FormatGiB(g.gpu_tier_bytes()) + " (the first " +
         FormatCount(tier) + " of " + FormatCount(g.total_pages()) +
         " pages a layer, KV and dKV), " + "host tier up to " +
         FormatGiB((g.total_pages() - tier) * g.tier_page_bytes()) +
         "; over PCIe: GPU tier 0, host tier H2D " +
         FormatGiB(static_cast<int64_t>(r.prediction.h2d_bytes)) + ", D2H " +
         FormatGiB(static_cast<int64_t>(r.prediction.d2h_bytes)) + "\n";
  }
  s += "\nStep " + Printf("%.3f s", r.prediction.step_seconds()) + ", " +
       Printf("%.0f tokens/s", r.tokens_per_second) + ", " +
       Printf("%.0f TFLOP/s achieved", r.achieved_tflops) + "\n";
  s += "  busy: compute " + Printf("%.0f%%", 100 * r.compute_utilisation) + ", H2D " +
       Printf("%.0f%%", 100 * r.h2d_utilisation) + ", D2H " +
       Printf("%.0f%%", 100 * r.d2h_utilisation) + "; moved H2D " +
       FormatGiB(static_cast<int64_t>(r.prediction.h2d_bytes)) + ", D2H " +
       FormatGiB(static_cast<int64_t>(r.prediction.d2h_bytes)) + "\n";
  const KernelProfile& k = sim::EffectiveKernelProfile(c.machine.gpu);
  if (k.has_power()) {
    // In MHz where the maximum is known (a measured profile, or a datasheet boost clock). The
    // clock is the compute-bound kernels' speed (clock_model.h): an H100's NVML reads less.
    const double fraction = r.prediction.sm_clock_fraction;
    const bool known = k.provenance == Provenance::kMeasured || c.machine.gpu.boost_clock_mhz > 0;
    s += "  SM clock " + Printf("%.0f%% of its maximum", 100 * fraction) +
         (known ? Printf(" (%.0f MHz by the kernels' speed)", fraction * k.max_sm_clock_mhz)
                : std::string()) +
         (fraction < 1.0 ? ": held at the " : ": under the ") +
         Printf("%.0f W power limit", k.power_limit_w) +
         (fraction < 1.0 ? Printf(" (fill %.0f%%", 100 * r.prediction.pass_clocks[0]) +
                               Printf(", recompute %.0f%%", 100 * r.prediction.pass_clocks[1]) +
                               Printf(", backward %.0f%%)", 100 * r.prediction.pass_clocks[2])
                         : std::string()) +
         "\n";
  }
  s += "Bottleneck: " + std::string(sim::BottleneckName(r.bottleneck)) + "\n";
  const sim::StartupPrediction& st = r.startup;
  s += "Start-up " + Printf("%.1f s", st.total()) + " (context " +
       Printf("%.1f", st.context_seconds) + ", weights " + Printf("%.1f", st.weights_seconds) +
       ", arena " + Printf("%.1f", st.arena_seconds) + ", pinning " +
       Printf("%.1f", st.pinning_seconds) +
       "; random weights, no --weights file): first step after " +
       Printf("%.1f s", st.total() + r.prediction.step_seconds()) + ", then " +
       Printf("%.3f s", r.prediction.step_seconds()) + " a step\n";
  if (r.run_cost) {
    const sim::RunCost& rc = *r.run_cost;
    s += "Training on " + FormatCount(rc.train_tokens) +
         " tokens: " + Printf("%.1f steps", rc.steps) + ", " +
         Printf("%.1f GPU-hours", rc.gpu_hours);
    if (rc.cost)
      s +=
          Printf(", cost %.2f", *rc.cost) + Printf(" at %.2f per GPU-hour", *rc.price_per_gpu_hour);
    s += "\n";
  }
  return s;
}

void PlanJson(JsonOut& j, const PlanContext& c, const sim::PlanReport& r) {
  const RunOptions& o = c.options;
  j.Field("model", c.model.name).Field("machine", c.machine.name);
  j.Field("gpu", c.machine.gpu.display_name).Field("path", c.path);
  j.BeginObject("options")
      .Field("context_tokens", r.context_tokens)
      .Field("chunk_tokens", o.chunk_tokens)
      .Field("page_tokens", o.page_tokens)
      .Field("page_budget", o.dense() ? std::string("all") : std::to_string(o.page_budget))
      .Field("sink_pages", o.sink_pages)
      .Field("query_tile", o.query_tile)
      .Field("offload", o.offload)
      .Field("gpu_tier_pages", o.offload ? o.gpu_tier_pages : 0)
      .Field("grad_dtype", GradDtypeName(o.grad_dtype))
      .Field("optimizer", OptimizerName(o.optimizer))
      .Field("lora_rank", o.lora_rank)
      .Field("selection", SelectionModelName(o.selection))
      .Field("gpus", o.pipeline_stages)
      .EndObject();
  j.Field("chunks", r.chunks);
  {
    const sim::KernelTimeModel::PageRate rate = RunPageRate(c, o.page_tokens);
    j.BeginObject("attention_page_rate_vs_128")
        .Field("forward", rate.forward)
        .Field("backward", rate.backward)
        .Field("measured", rate.measured)
        .EndObject();
    const sim::KernelTimeModel::PageRate head =
        sim::KernelTimeModel(c.machine).HeadDimRateAgainst128(c.model.head_dim);
    j.BeginObject("attention_head_dim_rate_vs_128")
        .Field("forward", head.forward)
        .Field("backward", head.backward)
        .EndObject();
    j.Field("attention_sparse_backward_rate_vs_group_8", SparseBackwardGroupRate(c));
    // The union's key blocks (groups 1-2) timed as gathered ones: the profile has no rate for them.
    j.Field("attention_union_blocks_untimed", UnionBlocksUntimed(c));
    // Kernel changes the GPU's profile predates for these options (dates): empty when current.
    j.BeginArray("profile_predates_kernel_changes");
    for (const sim::KernelChange& change : PredatedChanges(c))
      j.Field("", std::string(change.date));  // an element: no key
    j.EndArray();
  }
  j.Field("gpus", r.gpus).Field("machines", r.machines);
  {  // a GPU's host copy rates in this run, its share where the machine's GPUs share the host's
    const SharedLinks l = HostLinkShare(c);
    j.BeginObject("host_link")
        .Field("h2d_gbs", l.h2d_gbs)
        .Field("d2h_gbs", l.d2h_gbs)
        .Field("shared", l.shared)
        .Field("sharing_unmeasured", l.unmeasured)
        .EndObject();
  }
  {
    const PlanGeometry g(c.model, c.options);
    j.BeginArray("stages");
    for (int32_t st = 0; st < g.stages(); ++st) {
      const auto i = static_cast<size_t>(st);
      j.BeginObject()
          .Field("first_layer", g.stage_first_layer(st))
          .Field("layers", g.stage_layers(st))
          .Field("gpu_allocated_bytes", i < r.prediction.gpu_peak_by_rank.size()
                                            ? r.prediction.gpu_peak_by_rank[i]
                                            : r.gpu_memory.allocated)
          .EndObject();
    }
    j.EndArray();
  }
  j.BeginObject("gpu_memory")
      .Field("allocated_bytes", r.gpu_memory.allocated)
      .Field("reserved_bytes", r.gpu_memory.reserved)
      .Field("device_bytes", r.gpu_memory.device)
      .Field("capacity_bytes", r.gpu_capacity)
      .Field("fits", r.fits_gpu)
      .BeginObject("at_peak");
  for (int i = 0; i < kMemCategoryCount; ++i)
    j.Field(MemCategoryName(static_cast<MemCategory>(i)), r.prediction.gpu.at_peak[i]);
  j.Field("cuda_context", CudaContextBytes(c.machine)).EndObject().EndObject();
  j.BeginObject("host_memory")
      .Field("peak_bytes", r.host_peak)
      .Field("usable_bytes", r.host_capacity)
      .Field("installed_bytes", c.machine.host_ram_bytes)
      .Field("fits", r.fits_host)
      .BeginObject("at_peak");
  for (int i = 0; i < kMemCategoryCount; ++i)
    j.Field(MemCategoryName(static_cast<MemCategory>(i)), r.prediction.host.at_peak[i]);
  j.EndObject().EndObject();
  if (o.offload) {
    const PlanGeometry g(c.model, o);
    const int64_t tier = g.gpu_tier_pages();
    j.BeginObject("page_store")
        .Field("pages_per_layer", g.total_pages())
        .Field("gpu_tier_pages_per_layer", tier)
        .Field("gpu_tier_bytes", g.gpu_tier_bytes())
        .Field("host_tier_max_bytes", (g.total_pages() - tier) * g.tier_page_bytes())
        .Field("host_tier_h2d_bytes", r.prediction.h2d_bytes)
        .Field("host_tier_d2h_bytes", r.prediction.d2h_bytes)
        .EndObject();
  }
  j.BeginObject("step")
      .Field("seconds", r.prediction.step_seconds())
      .Field("tokens_per_second", r.tokens_per_second)
      .Field("flops", r.prediction.flops)
      .Field("achieved_tflops", r.achieved_tflops)
      .Field("h2d_bytes", r.prediction.h2d_bytes)
      .Field("d2h_bytes", r.prediction.d2h_bytes)
      .Field("compute_utilisation", r.compute_utilisation)
      .Field("h2d_utilisation", r.h2d_utilisation)
      .Field("d2h_utilisation", r.d2h_utilisation)
      .Field("sm_clock_fraction", r.prediction.sm_clock_fraction)
      .Field("sm_clock_fraction_fill", r.prediction.pass_clocks[0])
      .Field("sm_clock_fraction_recompute", r.prediction.pass_clocks[1])
      .Field("sm_clock_fraction_backward", r.prediction.pass_clocks[2])
      .EndObject();
  j.BeginObject("startup")
      .Field("seconds", r.startup.total())
      .Field("context_seconds", r.startup.context_seconds)
      .Field("weights_seconds", r.startup.weights_seconds)
      .Field("arena_seconds", r.startup.arena_seconds)
      .Field("pinning_seconds", r.startup.pinning_seconds)
      .Field("first_step_after_seconds", r.startup.total() + r.prediction.step_seconds())
      .EndObject();
  j.Field("bottleneck", sim::BottleneckName(r.bottleneck));
  if (r.run_cost) {
    j.BeginObject("run_cost")
        .Field("train_tokens", r.run_cost->train_tokens)
        .Field("steps", r.run_cost->steps)
        .Field("gpu_hours", r.run_cost->gpu_hours);
    if (r.run_cost->cost)
      j.Field("price_per_gpu_hour", *r.run_cost->price_per_gpu_hour)
          .Field("cost", *r.run_cost->cost);
    j.EndObject();
  }
}

std::string CapacityText(const PlanContext& c, const sim::CapacityResult& result,
                         double slope_mb_per_10k, int64_t slope_from, int64_t slope_to) {
  const sim::PlanReport& r = result.at_max;
  std::string s = "ctxplan max-context: " + Header(c);
  if (result.limit == sim::CapacityLimit::kNothingFits) {
    s += "\nNothing fits: even one token needs " + FormatGiB(r.gpu_memory.device) +
         " of GPU memory (" + FormatGiB(r.gpu_capacity) + " available) and " +
         FormatGiB(r.host_peak) + " of pinned host memory (" + FormatGiB(r.host_capacity) +
         " usable).\n";
    return s;
  }
  s += "\nMax context: " + FormatTokens(result.max_context_tokens) + " tokens, bound by " +
       std::string(sim::CapacityLimitName(result.limit)) + "\n";
  s += "  GPU memory there: " + FormatGiB(r.gpu_memory.device) + " of " +
       FormatGiB(r.gpu_capacity) + " (device level; allocated " +
       FormatGiB(r.gpu_memory.allocated) + ")\n";
  s += "  pinned host memory there: " + FormatGiB(r.host_peak) + " of " +
       FormatGiB(r.host_capacity) + " usable (" + FormatGiB(c.machine.host_ram_bytes) +
       " installed)\n";
  if (const PlanGeometry g(c.model, c.options); g.gpu_tier_pages() > 0) {
    s += "  GPU tier there: the first " + FormatCount(g.gpu_tier_pages()) + " of " +
         FormatCount(g.total_pages()) + " pages a layer (" + FormatGiB(g.gpu_tier_bytes()) +
         ", KV and dKV)\n";
  }
  if (slope_to > slope_from)
    s += "  GPU memory slope: " + Printf("%.2f MB per 10K tokens", slope_mb_per_10k) + " (from " +
         FormatTokens(slope_from) + " to " + FormatTokens(slope_to) + " tokens)\n";
  s += "  step there: " + Printf("%.1f s", r.prediction.step_seconds()) + ", " +
       Printf("%.0f tokens/s", r.tokens_per_second) + ", bottleneck " +
       std::string(sim::BottleneckName(r.bottleneck)) + "\n";
  return s;
}

}  // namespace ctxplan::cli
