// Running the project's programs from tests as a user would: argv in, exit code, stdout and
// stderr out, in a scratch directory of their own.
#pragma once

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

extern char** environ;

namespace ctxplan::test {

namespace fs = std::filesystem;

struct RunResult {
  int exit_code = -1;  // 128 + signal when killed by one, as a shell reports it
  std::string out;
  std::string err;
};

inline std::string ReadAll(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The committed GPU profile models/gpu/`name`.yaml, as text.
inline std::string CommittedProfile(const std::string& name) {
  return ReadAll(std::string(CTXPLAN_SOURCE_DIR) + "/models/gpu/" + name + ".yaml");
}
// Where a profile's calibration date line starts in `yaml` (npos: none).
inline size_t ProfileDateLine(const std::string& yaml) {
  return yaml.find("\n  date: \"");
}
// The calibration date of the committed profile `name` ("" if it holds none).
inline std::string ProfileDate(const std::string& name) {
  const std::string yaml = CommittedProfile(name);
  const size_t at = ProfileDateLine(yaml);
  if (at == std::string::npos) return "";
  const size_t from = at + std::string("\n  date: \"").size();
  return yaml.substr(from, yaml.find('"', from) - from);
}
// The committed GPU profile `name` with its calibration dated `date` instead, to stand for a
// calibration before or after a kernel change; empty if it holds no date line.
inline std::string ProfileRedated(const std::string& name, const std::string& date) {
  std::string yaml = CommittedProfile(name);
  const size_t at = ProfileDateLine(yaml);
  if (at == std::string::npos) return "";
  yaml.replace(at, yaml.find('\n', at + 1) - at, "\n  date: \"" + date + "\"");
  return yaml;
}

// A fresh directory per test (tests run in parallel under ctest), removed afterwards.
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = (fs::temp_directory_path() / "ctxplan_test_XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) {
      ADD_FAILURE() << "mkdtemp: " << std::strerror(errno);
    }
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }
  std::string Write(const std::string& name, const std::string& text) const {
    const fs::path file = path_ / name;
    std::ofstream(file, std::ios::binary) << text;
    return file.string();
  }

 private:
  fs::path path_;
};

// Runs argv (argv[0] looked up in PATH when it has no '/'), stdin from /dev/null, stdout and
// stderr captured separately through files, so neither can block on a full pipe. `stdout_path`
// redirects stdout elsewhere instead (e.g. /dev/full). spawn_errno is set when it cannot start.
inline RunResult RunArgv(const std::vector<std::string>& argv, const fs::path& scratch,
                         const std::string& stdout_path = "", int* spawn_errno = nullptr) {
  const std::string out_path =
      stdout_path.empty() ? (scratch / ".run.stdout").string() : stdout_path;
  const std::string err_path = (scratch / ".run.stderr").string();
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, out_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  std::vector<char*> c_argv;
  for (const std::string& arg : argv) c_argv.push_back(const_cast<char*>(arg.c_str()));
  c_argv.push_back(nullptr);

  RunResult result;
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, c_argv[0], &actions, nullptr, c_argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (spawn_errno != nullptr) *spawn_errno = rc;
  if (rc != 0) {
    result.err = "cannot start " + argv[0] + ": " + std::strerror(rc);
    return result;
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) result.exit_code = 128 + WTERMSIG(status);
  if (stdout_path.empty()) result.out = ReadAll(out_path);
  result.err = ReadAll(err_path);
  fs::remove(err_path);
  if (stdout_path.empty()) fs::remove(out_path);
  return result;
}

// A program's one-line error: exit `code`, exactly one line on stderr, starting "<program>: " and
// containing every needle.
inline void ExpectOneLineError(const RunResult& r, const std::string& program, int code,
                               const std::vector<std::string>& needles) {
  EXPECT_EQ(r.exit_code, code) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_EQ(r.err.rfind(program + ": ", 0), 0u) << r.err;
  for (const std::string& needle : needles)
    EXPECT_NE(r.err.find(needle), std::string::npos) << "missing '" << needle << "' in " << r.err;
}

}  // namespace ctxplan::test
