// `ctxplan sweep`: a grid of configurations (the run flags take comma lists), each planned and
// predicted, to CSV or JSON.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "run_flags.h"

namespace ctxplan::cli {

struct SweepFlags {
  RunFlags run;
  std::string format = "csv";
  std::string output;
  std::string path = "analytic";
};

CLI::App* AddSweepCommand(CLI::App& app, SweepFlags& flags);
// The grid's results, CSV or JSON. Throws InputError for a bad format or path, or a value no
// combination runs with; says on stderr how many combinations were skipped, and draws progress.
std::string SweepReport(const SweepFlags& f);

}  // namespace ctxplan::cli
