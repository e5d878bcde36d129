// Output shared by ctxplan's commands: the --json and --output flags, a result written whole (to
// stdout or atomically to a file), and errors kept to one line on stderr.
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <string>
#include <string_view>

#include "ctxplan/models/errors.h"
#include "ctxplan/traces/atomic_file.h"

namespace ctxplan::cli {

struct OutputFlags {
  bool json = false;
  std::string output;  // empty: stdout
};

void AddOutputFlags(CLI::App& app, OutputFlags& f);

// AtomicFileWriter's errors name the path only; the flag and what it accepts make them actionable.
[[noreturn]] void ThrowOutputError(const InputError& e);

std::unique_ptr<AtomicFileWriter> OpenOutput(const std::string& path);
void CommitOutput(AtomicFileWriter& file);

// Writes the whole result at once: to stdout, or to a temp file renamed onto the target, so a
// failure never leaves half an output behind.
void Emit(const std::string& text, const std::string& path);

// Every error is one line on stderr, whatever the user typed: control characters echoed back
// from a flag value or a file name are escaped.
std::string OneLine(std::string_view message);

}  // namespace ctxplan::cli
