// `ctxplan replay TRACE`: a recorded step (.ctxtrace, from ctxtrain or ctxplan timeline) set
// against the prediction for the plan it followed, op by op, by kind, by phase and by chunk.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "command_output.h"
#include "run_flags.h"

namespace ctxplan::cli {

struct ReplayFlags {
  std::string trace;
  std::string by_chunk;   // an op kind, optionally ".part": its ops chunk by chunk
  std::string model;      // the trace's model as a file, when outside the catalogue
  std::string selection;  // the union rule to predict with, instead of the run's
  RunFlags run;
  OutputFlags out;
};

CLI::App* AddReplayCommand(CLI::App& app, ReplayFlags& flags);
// The comparison, text or JSON. Throws InputError for a trace that does not read or names no
// model, a model or machine flag that does not resolve, or a --by-chunk kind the trace lacks.
std::string ReplayReport(const ReplayFlags& f);

}  // namespace ctxplan::cli
