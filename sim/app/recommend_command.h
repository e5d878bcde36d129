// `ctxplan recommend`: the fastest configuration of a model on a machine that fits at a context,
// the longest-context and least-GPU-memory ones beside it, and the ctxtrain command of each.
#pragma once

#include <CLI/CLI.hpp>

#include "command_output.h"
#include "run_flags.h"

namespace ctxplan::cli {

struct RecommendFlags {
  RunFlags run;
  OutputFlags out;
  bool gpu_tier_given = false;  // else recommend searches the tier too
};

CLI::App* AddRecommendCommand(CLI::App& app, RecommendFlags& flags);
// Writes the recommendation, text or JSON, to flags.out; returns the exit code: 0, or 3 when no
// configuration fits.
int RunRecommend(const RecommendFlags& f);

}  // namespace ctxplan::cli
