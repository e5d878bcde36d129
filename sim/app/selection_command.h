// `ctxplan selection`: how a model's query tiles overlap in the pages they select, measured from
// traced page-sparse runs. The planner's union rule (runtime/plan/plan_geometry.h) was fitted on
// two models' runs; another model or other data draws its pages more or less independently, and
// the fitted scale given back as `--selection disjoint:S` times its copies and key blocks.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace ctxplan::cli {

struct SelectionFlags {
  std::vector<std::string> traces;  // .ctxtrace files of page-sparse runs, one model
  std::string model;                // the traces' model, when it is not in the catalogue
  bool json = false;
  bool csv = false;    // the chunks' unions, a row each, instead of the fit
  std::string output;  // empty: stdout
};

CLI::App* AddSelectionCommand(CLI::App& app, SelectionFlags& flags);
// The report, text or JSON. Throws InputError for a trace that does not read, names no model,
// mixes models with the others, or holds no informative union.
std::string SelectionReport(const SelectionFlags& flags);

}  // namespace ctxplan::cli
