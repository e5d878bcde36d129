#include "ctxplan/runtime/dist/local_launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/dist/rendezvous.h"

extern char** environ;

namespace ctxplan::dist {

namespace {

using Clock = std::chrono::steady_clock;

// How long stopped ranks get to end on SIGTERM (ctxtrain finishes its step and saves) before
// SIGKILL; and how often the supervisor looks at its children.
constexpr auto kStopGrace = std::chrono::seconds(10);
constexpr timespec kPollInterval{0, 20'000'000};  // 20 ms

// The variables each child gets from the launcher, replacing inherited ones of the same name.
constexpr const char* kReportVariable = "CTXPLAN_LOCAL_LAUNCH_REPORT";
constexpr const char* kSetVariables[] = {"RANK",         "WORLD_SIZE",  "LOCAL_RANK",
                                         "MASTER_ADDR",  "MASTER_PORT", "NCCL_NVLS_ENABLE",
                                         kReportVariable};

std::string Cause(int error) {
  std::string text = std::strerror(error);
  if (!text.empty()) text[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(text[0])));
  return text;
}

// The last SIGINT or SIGTERM received while supervising, 0 when none is pending. The handler only
// stores it (a lock-free atomic store is async-signal-safe); the supervising loop sends it on to
// the children it has not reaped, so no signal can reach a process id already recycled.
std::atomic<int> pending_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "a signal handler stores into it");

void RecordSignal(int signal) {
  pending_signal.store(signal);
}

// While alive: SIGINT and SIGTERM are recorded for forwarding instead of ending this process,
// and SIGCHLD is at its default, so no inherited SIG_IGN lets the kernel reap the children (and
// their exit codes) before waitpid. The previous dispositions come back on destruction.
class SupervisorSignals {
 public:
  SupervisorSignals() {
    pending_signal.store(0);
    struct sigaction record {};
    record.sa_handler = RecordSignal;
    sigemptyset(&record.sa_mask);
    record.sa_flags = 0;  // no SA_RESTART: the supervisor's sleep ends at once
    ::sigaction(SIGINT, &record, &previous_int_);
    ::sigaction(SIGTERM, &record, &previous_term_);
    struct sigaction child_default {};
    child_default.sa_handler = SIG_DFL;
    sigemptyset(&child_default.sa_mask);
    ::sigaction(SIGCHLD, &child_default, &previous_chld_);
  }
  ~SupervisorSignals() {
    ::sigaction(SIGINT, &previous_int_, nullptr);
    ::sigaction(SIGTERM, &previous_term_, nullptr);
    ::sigaction(SIGCHLD, &previous_chld_, nullptr);
  }
  SupervisorSignals(const SupervisorSignals&) = delete;
  SupervisorSignals& operator=(const SupervisorSignals&) = delete;

  // The signal received since the last call, 0 if none.
  int Take() { return pending_signal.exchange(0); }

 private:
  struct sigaction previous_int_ {};
  struct sigaction previous_term_ {};
  struct sigaction previous_chld_ {};
};

// posix_spawn's attributes: the children start with no signal blocked, and SIGINT and SIGTERM at
// their default action even where this process ignores them (a background job of a script
// ignores SIGINT), so the signals the supervisor forwards do stop them.
class SpawnAttributes {
 public:
  SpawnAttributes() {
    posix_spawnattr_init(&attr_);
    sigset_t none;
    sigemptyset(&none);
    posix_spawnattr_setsigmask(&attr_, &none);
    sigset_t defaults;
    sigemptyset(&defaults);
    sigaddset(&defaults, SIGINT);
    sigaddset(&defaults, SIGTERM);
    posix_spawnattr_setsigdefault(&attr_, &defaults);
    posix_spawnattr_setflags(&attr_, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  }
  ~SpawnAttributes() { posix_spawnattr_destroy(&attr_); }
  SpawnAttributes(const SpawnAttributes&) = delete;
  SpawnAttributes& operator=(const SpawnAttributes&) = delete;
  const posix_spawnattr_t* get() const { return &attr_; }

 private:
  posix_spawnattr_t attr_;
};

// This process's environment without the variables the launcher sets, then those, for `rank`.
std::vector<std::string> ChildEnvironment(int rank, int ranks, int port,
                                          const std::string& report) {
  std::vector<std::string> variables;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string_view text(*entry);
    const std::string_view name = text.substr(0, text.find('='));
    bool replaced = false;
    for (const char* set : kSetVariables) replaced = replaced || name == set;
    if (!replaced) variables.emplace_back(text);
  }
  variables.push_back("RANK=" + std::to_string(rank));
  variables.push_back("WORLD_SIZE=" + std::to_string(ranks));
  variables.push_back("LOCAL_RANK=" + std::to_string(rank));
  variables.push_back("MASTER_ADDR=127.0.0.1");
  variables.push_back("MASTER_PORT=" + std::to_string(port));
  variables.push_back("NCCL_NVLS_ENABLE=0");
  variables.push_back(std::string(kReportVariable) + "=" + report);
  return variables;
}

// A null-terminated array of pointers into `strings`, as exec wants argv and envp.
std::vector<char*> Pointers(std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  for (std::string& s : strings) pointers.push_back(s.data());
  pointers.push_back(nullptr);
  return pointers;
}

// "exit code 3", "killed by signal 9: SIGKILL".
std::string HowItEnded(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  const int signal = WTERMSIG(status);
  const char* name = ::sigabbrev_np(signal);
  return "killed by signal " + std::to_string(signal) +
         (name != nullptr ? std::string(": SIG") + name : std::string());
}

// The children, by rank. Whatever is still running when this is destroyed (an exception, or a
// spawn that failed halfway) is killed and reaped: no rank outlives the launcher.
class Children {
 public:
  ~Children() {
    Signal(SIGKILL);
    for (pid_t& pid : pids_) {
      if (pid <= 0) continue;
      while (::waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
      }
      pid = 0;
    }
  }

  // Starts rank `rank` (the next one); DistError if it cannot be.
  void Spawn(const std::string& executable, const std::vector<std::string>& args, int rank,
             int ranks, int port, const std::string& report) {
    std::vector<std::string> argv_strings{executable};
    argv_strings.insert(argv_strings.end(), args.begin(), args.end());
    std::vector<std::string> env_strings = ChildEnvironment(rank, ranks, port, report);
    std::vector<char*> argv = Pointers(argv_strings);
    std::vector<char*> envp = Pointers(env_strings);
    pid_t pid = 0;
    const int error = ::posix_spawn(&pid, executable.c_str(), nullptr, attributes_.get(),
                                    argv.data(), envp.data());
    if (error != 0)
      throw DistError("cannot start rank " + std::to_string(rank) + " of " + std::to_string(ranks) +
                      ": " + executable + ": " + Cause(error));
    pids_.push_back(pid);
  }

  // Sends `signal` to every child not yet reaped.
  void Signal(int signal) {
    for (const pid_t pid : pids_)
      if (pid > 0) ::kill(pid, signal);
  }

  // Reaps rank `rank` if it has ended, returning its wait status; nullopt while it runs or once
  // reaped.
  std::optional<int> Reap(int rank) {
    pid_t& pid = pids_[static_cast<size_t>(rank)];
    if (pid <= 0) return std::nullopt;
    int status = 0;
    const pid_t got = ::waitpid(pid, &status, WNOHANG);
    if (got == 0 || (got < 0 && errno == EINTR)) return std::nullopt;
    CTXPLAN_CHECK(got == pid, "waitpid(rank " + std::to_string(rank) + "): " + Cause(errno));
    pid = 0;
    return status;
  }

  int running() const {
    int count = 0;
    for (const pid_t pid : pids_) count += pid > 0 ? 1 : 0;
    return count;
  }

 private:
  SpawnAttributes attributes_;
  std::vector<pid_t> pids_;  // 0 once reaped
};

}  // namespace

namespace {

// Creates `path` if no one has: the one who does says the run's error line.
bool Claim(const std::string& path) {
  const int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
  if (fd < 0) return errno != EEXIST;  // unusable path: better two lines than none
  ::close(fd);
  return true;
}

// The claim's path, removed when the launch ends.
struct ReportPath {
  std::string path;
  explicit ReportPath(int port) {
    const char* tmp = std::getenv("TMPDIR");
    path = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/ctxtrain-report-" +
           std::to_string(::getpid()) + "-" + std::to_string(port);
    ::unlink(path.c_str());
  }
  ~ReportPath() { ::unlink(path.c_str()); }
};

}  // namespace

bool LaunchedByLocalLauncher() {
  const char* value = std::getenv(kReportVariable);
  return value != nullptr && *value != '\0';
}

bool ClaimTheErrorLine() {
  return !LaunchedByLocalLauncher() || Claim(std::getenv(kReportVariable));
}

int LaunchLocalRanks(const std::string& executable, const std::vector<std::string>& args, int ranks,
                     std::ostream& err) {
  CTXPLAN_CHECK(ranks >= 1, "LaunchLocalRanks needs at least one rank");
  const int port = FreeLocalPort();
  const ReportPath report(port);
  // Declared in this order so that the children are reaped (on any path) before the signal
  // dispositions are restored: a signal until then is forwarded, not fatal to us alone.
  SupervisorSignals signals;
  Children children;
  for (int rank = 0; rank < ranks; ++rank)
    children.Spawn(executable, args, rank, ranks, port, report.path);

  int failed_rank = -1;
  int failed_code = 0;
  std::optional<Clock::time_point> kill_at;  // set once the others are being stopped
  bool killed = false;
  // Polled rather than woken by SIGCHLD: simpler, no race between a check and a sleep, and 20 ms
  // is nothing next to a rank's start-up.
  while (children.running() > 0) {
    if (const int signal = signals.Take(); signal != 0) children.Signal(signal);
    for (int rank = 0; rank < ranks; ++rank) {
      const std::optional<int> status = children.Reap(rank);
      if (!status || (WIFEXITED(*status) && WEXITSTATUS(*status) == 0) || failed_rank >= 0)
        continue;
      // The first failure: the run is over; the others would only wait for it in NCCL.
      failed_rank = rank;
      failed_code = WIFEXITED(*status) ? WEXITSTATUS(*status) : 128 + WTERMSIG(*status);
      children.Signal(SIGTERM);
      kill_at = Clock::now() + kStopGrace;
      if (Claim(report.path))  // no rank said why: this line does
        err << "ctxtrain: rank " << rank << " failed (" << HowItEnded(*status) << ")"
            << (ranks > 1 ? "; stopped the other ranks" : "") << std::endl;
    }
    if (kill_at && !killed && Clock::now() >= *kill_at) {
      children.Signal(SIGKILL);
      killed = true;
    }
    if (children.running() > 0) ::nanosleep(&kPollInterval, nullptr);  // a signal ends it early
  }
  return failed_rank >= 0 ? failed_code : 0;
}

int FreeLocalPort() {
  const int socket = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (socket < 0) throw DistError("cannot create a socket to find a free port: " + Cause(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;  // the kernel picks a free one
  socklen_t length = sizeof address;
  const bool ok =
      ::bind(socket, reinterpret_cast<const sockaddr*>(&address), sizeof address) == 0 &&
      ::getsockname(socket, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  const int error = errno;
  ::close(socket);
  if (!ok) throw DistError("cannot find a free TCP port on 127.0.0.1: " + Cause(error));
  return ntohs(address.sin_port);
}

std::string ExecutablePath() {
  std::error_code error;
  const std::filesystem::path path = std::filesystem::read_symlink("/proc/self/exe", error);
  if (error)
    throw DistError("cannot read this program's path from /proc/self/exe (to start its ranks): " +
                    error.message());
  return path.string();
}

}  // namespace ctxplan::dist
