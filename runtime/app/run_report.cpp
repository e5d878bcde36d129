#include "run_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "ctxplan/models/units.h"
#include "ctxplan/runtime/plan/plan_geometry.h"

namespace ctxplan::train {

double Startup::other() const {
  return std::max(0.0, total - context - weights - arena - pinning);
}

std::string SecondsText(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%.6f", seconds);
  return text;
}

namespace {

std::string RoundedOrNull(double value) {
  return value > 0 ? std::to_string(std::lround(value)) : "null";
}

}  // namespace

void PrintRunReportJson(const RunReport& r) {
  // {"fill": MHz, "recompute": MHz, "backward": MHz}, a pass without readings null; null
  // without a traced CUDA step.
  std::string pass_clocks = "null";
  if (sim::HasReadings(r.traced_pass_clocks)) {
    pass_clocks.clear();
    for (int p = 0; p < sim::kPowerPassCount; ++p) {
      const sim::MeasuredPassClock& c = r.traced_pass_clocks[static_cast<size_t>(p)];
      pass_clocks += std::string(p == 0 ? "{" : ",") + "\"" +
                     sim::PowerPassName(static_cast<sim::PowerPass>(p)) +
                     "\":" + (c.samples > 0 ? std::to_string(std::lround(c.sm_clock_mhz)) : "null");
    }
    pass_clocks += "}";
  }
  std::string shares = "null";
  if (!r.read_shares.empty()) {
    std::string earliest, per_layer, overall;
    for (const PageReadShares& s : r.read_shares) {
      if (!earliest.empty()) earliest += ',', per_layer += ',', overall += ',';
      earliest += std::to_string(s.earliest);
      per_layer += std::to_string(s.most_read_per_layer);
      overall += std::to_string(s.most_read);
    }
    shares = "{\"fractions\":[0.1,0.25,0.5],\"earliest\":[" + earliest +
             "],\"most_read_per_layer\":[" + per_layer + "],\"most_read\":[" + overall + "]}";
  }
  const Startup& st = r.startup;
  std::printf(
      "{\"backend\":\"%s\",\"model\":\"%s\",\"context_tokens\":%lld,\"steps\":%lld,"
      "\"loss\":%.6f,\"tokens_per_second\":%.2f,\"arena_allocated_peak_bytes\":%lld,"
      "\"arena_reserved_bytes\":%lld,\"device_bytes\":%s,\"pinned_host_peak_bytes\":%lld,"
      "\"plan_gpu_peak_bytes\":%lld,\"plan_host_peak_bytes\":%lld,"
      "\"startup_seconds\":%.6f,\"startup_context_seconds\":%.6f,"
      "\"startup_weights_seconds\":%.6f,\"startup_arena_seconds\":%.6f,"
      "\"startup_pinning_seconds\":%.6f,\"startup_other_seconds\":%.6f,"
      "\"steps_seconds\":%.6f,\"first_step_seconds\":%.6f,\"later_step_seconds\":%s,"
      "\"sm_clock_mhz\":%s,\"board_watts\":%s,\"traced_pass_sm_clock_mhz\":%s,"
      "\"gpu_tier_pages\":%lld,"
      "\"page_read_shares\":%s,\"selection_draw_scale\":%s}\n",
      r.backend.c_str(), r.model.c_str(), static_cast<long long>(r.context_tokens),
      static_cast<long long>(r.steps), r.loss, r.tokens_per_second,
      static_cast<long long>(r.arena_allocated), static_cast<long long>(r.arena_reserved),
      r.device_used >= 0 ? std::to_string(r.device_used).c_str() : "null",
      static_cast<long long>(r.pinned_host), static_cast<long long>(r.plan_arena_peak),
      static_cast<long long>(r.plan_host_peak), st.total, st.context, st.weights, st.arena,
      st.pinning, st.other(), r.steps_seconds, r.first_step_seconds,
      r.steps > 1 ? SecondsText(r.later_step_seconds).c_str() : "null",
      RoundedOrNull(r.sm_clock_mhz).c_str(), RoundedOrNull(r.board_watts).c_str(),
      pass_clocks.c_str(), static_cast<long long>(r.gpu_tier_pages), shares.c_str(),
      r.selection_draw_scale > 0 ? std::to_string(r.selection_draw_scale).c_str() : "null");
}

void PrintRunReportText(const RunReport& r) {
  const Startup& st = r.startup;
  std::printf("ctxtrain (%s): %s, %s tokens, %lld step(s)\n", r.backend.c_str(), r.model.c_str(),
              FormatTokens(r.context_tokens).c_str(), static_cast<long long>(r.steps));
  // The CPU backend has no context, arena reservation or pinning: its start-up is the weights
  // and the rest.
  if (r.cuda)
    std::printf(
        "  start-up %.1f s (context %.1f, weights %.1f, arena %.1f, pinning %.1f, other %.1f); "
        "first step after %.1f s\n",
        st.total, st.context, st.weights, st.arena, st.pinning, st.other(), st.total);
  else
    std::printf("  start-up %.1f s (weights %.1f, other %.1f); first step after %.1f s\n", st.total,
                st.weights, st.other(), st.total);
  if (r.steps > 1)
    std::printf("  steps %.1f s, start-up excluded: first %.3f s, then %.3f s a step\n",
                r.steps_seconds, r.first_step_seconds, r.later_step_seconds);
  else
    std::printf("  steps %.1f s, start-up excluded\n", r.steps_seconds);
  std::printf("  loss %.6f, %.1f tokens/s\n", r.loss, r.tokens_per_second);
  if (r.selection_draw_scale > 0)
    std::printf(
        "  page selection: the tiles' unions fit the planner's union rule at draw scale %.3g "
        "(its default %.2g); plan this model and data with --selection disjoint:%.3g\n",
        r.selection_draw_scale, kUnionDrawScale, r.selection_draw_scale);
  if (r.gpu_tier_pages > 0)
    std::printf("  page store: GPU tier of the first %lld of %lld pages a layer (KV and dKV)\n",
                static_cast<long long>(r.gpu_tier_pages),
                static_cast<long long>(r.pages_per_layer));
  if (!r.read_shares.empty()) {
    std::string shares;
    for (size_t i = 0; i < r.read_shares.size(); ++i) {
      const PageReadShares& s = r.read_shares[i];
      char line[160];
      std::snprintf(line, sizeof line, "%s%.0f%%: %.1f / %.1f / %.1f%%", i == 0 ? "" : "; ",
                    100 * kTierFractions[i], 100 * s.earliest, 100 * s.most_read_per_layer,
                    100 * s.most_read);
      shares += line;
    }
    std::printf(
        "  page reads kept off PCIe by a GPU tier of each layer's pages (earliest / most-read "
        "per layer / most-read overall): %s\n",
        shares.c_str());
  }
  if (r.sm_clock_mhz > 0)
    std::printf("  GPU over those steps: SM clock %.0f MHz, board power %.0f W (NVML means)\n",
                r.sm_clock_mhz, r.board_watts);
  if (sim::HasReadings(r.traced_pass_clocks)) {
    // As `ctxplan plan` prints its clock by pass: the power model's error, pass by pass.
    std::string passes;
    for (int p = 0; p < sim::kPowerPassCount; ++p) {
      const sim::MeasuredPassClock& c = r.traced_pass_clocks[static_cast<size_t>(p)];
      if (c.samples == 0) continue;
      char text[96];
      std::snprintf(text, sizeof(text), "%s%s %.0f MHz (%d readings)", passes.empty() ? "" : ", ",
                    sim::PowerPassName(static_cast<sim::PowerPass>(p)), c.sm_clock_mhz, c.samples);
      passes += text;
    }
    std::printf("  SM clock by pass of the traced step (NVML, while its compute ops ran): %s\n",
                passes.c_str());
  }
  if (!r.machine.empty()) std::printf("  machine: %s\n", r.machine.c_str());
  std::printf("  GPU memory: arena allocated peak %s, reserved %s",
              FormatGiB(r.arena_allocated).c_str(), FormatGiB(r.arena_reserved).c_str());
  if (r.device_used >= 0)
    std::printf(", device-level peak %s (as nvidia-smi counts it)",
                FormatGiB(r.device_used).c_str());
  std::printf("; the plan's ops account %s\n", FormatGiB(r.plan_arena_peak).c_str());
  // Two meanings of host memory: what this process pinned (the KV and dKV stores of every homed
  // page up front, as `ctxplan plan` predicts it) and the peak of the plan's host alloc/free ops
  // (a page-sparse step touches fewer dKV pages than it pins).
  std::printf(
      "  host memory (pinned pages, optimizer state and staging) %s; the plan's host alloc/free "
      "ops peak at %s\n",
      FormatGiB(r.pinned_host).c_str(), FormatGiB(r.plan_host_peak).c_str());
}

#ifdef CTXPLAN_HAVE_CUDA_BACKEND
void PrintTracedCopies(const gpu::TraceStepSummary& summary) {
  auto gbs = [](const gpu::TracedCopies::Bucket& b) {
    return b.busy_ns > 0 ? static_cast<double>(b.bytes) / static_cast<double>(b.busy_ns) : 0.0;
  };
  auto direction = [&](const char* name, const gpu::TracedCopies& c) {
    if (c.all.calls == 0) return;
    std::printf(
        "  traced step, %s copies: %llu, %.2f GiB, busy %.3f s (%.1f GB/s), active %.3f s\n", name,
        static_cast<unsigned long long>(c.all.calls),
        static_cast<double>(c.all.bytes) / double(1ull << 30), c.all.busy_ns * 1e-9, gbs(c.all),
        c.active_ns * 1e-9);
    uint64_t lower = 0;
    for (size_t i = 0; i < c.by_size.size(); ++i) {
      const gpu::TracedCopies::Bucket& b = c.by_size[i];
      const uint64_t upper = gpu::TracedCopies::kBucketMaxBytes[i];
      if (b.calls > 0) {
        const std::string range = upper == UINT64_MAX
                                      ? "> " + std::to_string(lower >> 10) + " KiB"
                                      : "<= " + std::to_string(upper >> 10) + " KiB";
        std::printf("    %-14s %9llu copies, mean %8.1f KiB, %7.2f us each, %5.1f GB/s\n",
                    range.c_str(), static_cast<unsigned long long>(b.calls),
                    static_cast<double>(b.bytes) / static_cast<double>(b.calls) / 1024.0,
                    static_cast<double>(b.busy_ns) / static_cast<double>(b.calls) * 1e-3, gbs(b));
      }
      lower = upper;
    }
  };
  direction("H2D", summary.h2d);
  direction("D2H", summary.d2h);
  if (summary.duplex_ns > 0)
    std::printf("  traced step, both directions at once %.3f s\n", summary.duplex_ns * 1e-9);
  for (size_t d = 0; d < 2; ++d)
    for (size_t p = 0; p < summary.copy_ops[d].size(); ++p) {
      const gpu::TracedCopyOps& t = summary.copy_ops[d][p];
      if (t.ops == 0) continue;
      std::printf(
          "  traced step, %s ops of %s: %llu, spans %.3f s; copies busy %.3f s, %llu memsets "
          "%.3f s\n",
          d == 0 ? "copy_h2d" : "copy_d2h", std::string(PhaseName(static_cast<Phase>(p))).c_str(),
          static_cast<unsigned long long>(t.ops), t.span_ns * 1e-9, t.memcpy_ns * 1e-9,
          static_cast<unsigned long long>(t.memsets), t.memset_ns * 1e-9);
    }
}
#endif

}  // namespace ctxplan::train
