#include "ctxplan/runtime/plan/run_options.h"

#include <charconv>
#include <cmath>
#include <string>

#include "ctxplan/models/errors.h"

namespace ctxplan {

namespace {
void Require(bool ok, std::string_view option, const std::string& problem) {
  if (!ok) throw InputError("option " + std::string(option) + ": " + problem);
}
std::string Num(int64_t v) {
  return std::to_string(v);
}
}  // namespace

void RunOptions::Validate(const ModelSpec& model) const {
  Require(context_tokens >= 1 && context_tokens <= kMaxContextTokens, "--context",
          Num(context_tokens) + " tokens is out of range; accepted: 1 to " +
              Num(kMaxContextTokens) + " tokens");
  Require(page_tokens >= 1 && page_tokens <= (1 << 20), "--page",
          Num(page_tokens) + " is out of range; accepted: 1 to 1048576 tokens per page");
  Require(chunk_tokens >= 1 && chunk_tokens <= (1 << 24), "--chunk",
          Num(chunk_tokens) + " is out of range; accepted: 1 to 16777216 tokens per chunk");
  Require(chunk_tokens % page_tokens == 0, "--chunk",
          Num(chunk_tokens) + " is not a multiple of the page size " + Num(page_tokens) +
              "; accepted: chunks that hold whole pages");
  Require(page_budget >= 0 && page_budget <= (int64_t{1} << 31), "--budget",
          Num(page_budget) + " is out of range; accepted: a positive number of pages or 'all'");
  Require(sink_pages >= 0 && sink_pages <= (int64_t{1} << 31), "--sinks",
          Num(sink_pages) + " is out of range; accepted: 0 or more pages");
  Require(query_tile >= 1 && query_tile <= chunk_tokens, "--query-tile",
          Num(query_tile) + " is out of range; accepted: 1 to the chunk size " + Num(chunk_tokens));
  const int64_t smallest = std::min(model.hidden_size, model.kv_dim());
  Require(lora_rank >= 0 && lora_rank <= smallest, "--lora-rank",
          Num(lora_rank) + " is out of range; accepted: 0 (full fine-tune) to " + Num(smallest));
  Require(gpu_tier_pages >= 0 && gpu_tier_pages <= (int64_t{1} << 31), "--gpu-tier",
          Num(gpu_tier_pages) + " pages is out of range; accepted: off, auto or a size");
  Require(pipeline_stages >= 1 && pipeline_stages <= model.num_hidden_layers, "--gpus",
          Num(pipeline_stages) + " is out of range; accepted: 1 to the model's " +
              Num(model.num_hidden_layers) + " layers (one layer or more a GPU)");
  // A tied LM head: the first and last GPU share the embedding over the world's all-reduce, which
  // only they join with two GPUs (cuda_backend.cpp).
  Require(pipeline_stages <= 2 || !model.tie_word_embeddings, "--gpus",
          Num(pipeline_stages) + " GPUs with model " + model.name +
              ", whose LM head is tied to the embedding: not yet over more than two; accepted: "
              "1 or 2 GPUs with a tied model");
  Require(pipeline_stages == 1 || !keep_layer_inputs, "--keep-layer-inputs",
          "not with several GPUs yet; accepted: recomputing the layer inputs (the default)");
  Require(std::isfinite(selection.overlap_fraction) && selection.overlap_fraction >= 0.0 &&
              selection.overlap_fraction <= 1.0,
          "--selection", "overlap fraction must lie in [0, 1]");
}

std::string_view GradDtypeName(GradDtype dtype) {
  return dtype == GradDtype::kFp32 ? "fp32" : "bf16";
}

std::string_view OptimizerName(OptimizerKind optimizer) {
  switch (optimizer) {
    case OptimizerKind::kAdamWGpu:
      return "adamw-gpu";
    case OptimizerKind::kAdamWHost:
      return "adamw-host";
    case OptimizerKind::kNone:
      return "none";
  }
  return "?";
}

std::string SelectionModelName(const SelectionModel& model) {
  switch (model.kind) {
    case SelectionModelKind::kShared:
      return "shared";
    case SelectionModelKind::kDisjoint: {
      if (model.draw_scale <= 0) return "disjoint";
      char buf[32];
      std::snprintf(buf, sizeof buf, "disjoint:%g", model.draw_scale);
      return buf;
    }
    case SelectionModelKind::kOverlap: {
      char buf[32];
      std::snprintf(buf, sizeof buf, "overlap:%g", model.overlap_fraction);
      return buf;
    }
  }
  return "?";
}

GradDtype ParseGradDtype(std::string_view text, std::string_view what) {
  if (text == "bf16") return GradDtype::kBf16;
  if (text == "fp32") return GradDtype::kFp32;
  throw InputError(std::string(what) + ": '" + std::string(text) + "' is not a gradient dtype; " +
                   "accepted: bf16, fp32");
}

OptimizerKind ParseOptimizer(std::string_view text, std::string_view what) {
  if (text == "adamw-gpu" || text == "adamw") return OptimizerKind::kAdamWGpu;
  if (text == "adamw-host") return OptimizerKind::kAdamWHost;
  if (text == "none") return OptimizerKind::kNone;
  throw InputError(std::string(what) + ": '" + std::string(text) + "' is not an optimizer; " +
                   "accepted: adamw-gpu, adamw-host, none");
}

SelectionModel ParseSelectionModel(std::string_view text, std::string_view what) {
  if (text == "shared") return {SelectionModelKind::kShared, 1.0};
  if (text == "disjoint") return {SelectionModelKind::kDisjoint, 0.0};
  // The number after `prefix`, or NaN when `text` is not prefix:NUMBER.
  auto number_after = [text](std::string_view prefix) {
    if (text.substr(0, prefix.size()) != prefix) return std::nan("");
    const std::string number(text.substr(prefix.size()));
    char* end = nullptr;
    const double value = std::strtod(number.c_str(), &end);
    if (number.empty() || end != number.c_str() + number.size()) return std::nan("");
    return value;
  };
  if (const double f = number_after("overlap:"); std::isfinite(f) && f >= 0.0 && f <= 1.0)
    return {SelectionModelKind::kOverlap, f};
  // The rule's scale: at most `tiles` draws whatever it is, so a bound keeps typos out.
  if (const double s = number_after("disjoint:"); std::isfinite(s) && s > 0.0 && s <= 100.0)
    return {SelectionModelKind::kDisjoint, 0.0, s};
  throw InputError(std::string(what) + ": '" + std::string(text) +
                   "' is not a selection model; accepted: shared, disjoint, disjoint:S with S "
                   "in (0, 100] (the union rule's measured scale), overlap:F with F in [0, 1]");
}

int64_t ParsePageBudget(std::string_view text, std::string_view what) {
  if (text == "all" || text == "dense") return RunOptions::kAllPages;
  int64_t value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || ptr != text.data() + text.size() || value <= 0)
    throw InputError(std::string(what) + ": '" + std::string(text) +
                     "' is not a page budget; accepted: a positive number of pages, or 'all'");
  return value;
}

}  // namespace ctxplan
