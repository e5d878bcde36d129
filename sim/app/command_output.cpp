#include "command_output.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>

namespace ctxplan::cli {

void AddOutputFlags(CLI::App& app, OutputFlags& f) {
  app.add_flag("--json", f.json, "print JSON instead of text");
  app.add_option("--output,-o", f.output, "write to this file (atomically) instead of stdout");
}

void ThrowOutputError(const InputError& e) {
  throw InputError(std::string("--output: ") + e.what() +
                   "; accepted: a file in an existing, writable directory");
}

std::unique_ptr<AtomicFileWriter> OpenOutput(const std::string& path) {
  try {
    return std::make_unique<AtomicFileWriter>(path);
  } catch (const InputError& e) {
    ThrowOutputError(e);
  }
}

void CommitOutput(AtomicFileWriter& file) {
  try {
    file.Commit();
  } catch (const InputError& e) {
    ThrowOutputError(e);
  }
}

void Emit(const std::string& text, const std::string& path) {
  if (path.empty()) {
    // A full disk or a closed pipe must not pass for success: a script would read a cut result.
    errno = 0;
    std::cout << text << std::flush;
    if (!std::cout)
      throw InputError(std::string("standard output: write failed (") +
                       (errno != 0 ? std::strerror(errno) : "stream error") +
                       "); accepted: a writable stdout, or --output FILE");
    return;
  }
  const auto file = OpenOutput(path);
  file->stream() << text;
  CommitOutput(*file);
}

std::string OneLine(std::string_view message) {
  std::string line;
  for (const char c : message) {
    if (c == '\n') {
      line += "\\n";
    } else if (c == '\r') {
      line += "\\r";
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", static_cast<unsigned char>(c));
      line += hex;
    } else {
      line += c;
    }
  }
  return line;
}

}  // namespace ctxplan::cli
