// Multi-process plumbing: the rank read from each launcher's environment variables (every
// convention, their precedence, every error), rank 0's TCP rendezvous (threads as ranks on
// 127.0.0.1: the payload arrives byte for byte; a missing root, a world-size mismatch and a
// duplicate rank fail with DistError), and the one-node launcher (/bin/sh scripts as ranks: their
// environment, success, the first failure stopping the others, signals forwarded).
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/dist/local_launcher.h"
#include "ctxplan/runtime/dist/poll_pause.h"
#include "ctxplan/runtime/dist/rank_env.h"
#include "ctxplan/runtime/dist/rendezvous.h"
#include "support/process.h"

namespace ctxplan::dist {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// --- helpers ------------------------------------------------------------------------------------

using Variables = std::map<std::string, std::string>;

std::optional<RankEnv> FromVariables(const Variables& variables) {
  return RankEnvFromEnvironment([&](const char* name) -> const char* {
    const auto found = variables.find(name);
    return found == variables.end() ? nullptr : found->second.c_str();
  });
}

// The InputError message FromVariables(variables) throws ("" if none).
std::string ErrorOf(const Variables& variables) {
  try {
    FromVariables(variables);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

RankEnv Local(int rank, int world, int port) {
  return RankEnv{rank, world, rank, "127.0.0.1", port};
}

std::vector<std::byte> RandomBytes(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> bytes(n);
  for (std::byte& b : bytes) b = static_cast<std::byte>(rng() & 0xff);
  return bytes;
}

// Runs ShareFromRankZero on a thread, keeping its result or exception.
struct RankThread {
  std::vector<std::byte> result;
  std::exception_ptr error;
  std::thread thread;

  RankThread(RankEnv env, std::vector<std::byte> payload, milliseconds timeout)
      : thread([this, env, payload, timeout] {
          try {
            result = ShareFromRankZero(env, payload, timeout);
          } catch (...) {
            error = std::current_exception();
          }
        }) {}
  // The DistError message it ended with ("" if it succeeded); waits for it.
  std::string Join() {
    thread.join();
    if (!error) return "";
    try {
      std::rethrow_exception(error);
    } catch (const DistError& e) {
      return e.what();
    }
  }
};

class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = (fs::temp_directory_path() / "ctxplan_dist_XXXXXX").string();
    EXPECT_NE(::mkdtemp(pattern.data()), nullptr);
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// --- RankEnvFromEnvironment -------------------------------------------------------------------

TEST(RankEnvTest, NoRankVariableIsAOneProcessRun) {
  EXPECT_FALSE(FromVariables({}).has_value());
  // The rendezvous variables alone name no rank.
  EXPECT_FALSE(FromVariables({{"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}).has_value());
}

TEST(RankEnvTest, Torchrun) {
  const auto env = FromVariables({{"RANK", "3"},
                                  {"WORLD_SIZE", "8"},
                                  {"LOCAL_RANK", "1"},
                                  {"MASTER_ADDR", "10.0.0.1"},
                                  {"MASTER_PORT", "29500"}});
  ASSERT_TRUE(env.has_value());
  EXPECT_EQ(env->rank, 3);
  EXPECT_EQ(env->world_size, 8);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->master_addr, "10.0.0.1");
  EXPECT_EQ(env->master_port, 29500);
  EXPECT_EQ(Describe(*env), "rank 3 of 8 (local 1), rendezvous 10.0.0.1:29500");
}

TEST(RankEnvTest, OpenMpi) {
  const auto env = FromVariables({{"OMPI_COMM_WORLD_RANK", "1"},
                                  {"OMPI_COMM_WORLD_SIZE", "2"},
                                  {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                                  {"MASTER_ADDR", "node0"},
                                  {"MASTER_PORT", "1234"}});
  ASSERT_TRUE(env.has_value());
  EXPECT_EQ(Describe(*env), "rank 1 of 2 (local 0), rendezvous node0:1234");
}

TEST(RankEnvTest, Slurm) {
  const auto env = FromVariables({{"SLURM_PROCID", "5"},
                                  {"SLURM_NTASKS", "6"},
                                  {"SLURM_LOCALID", "2"},
                                  {"MASTER_ADDR", "::1"},
                                  {"MASTER_PORT", "65535"}});
  ASSERT_TRUE(env.has_value());
  EXPECT_EQ(Describe(*env), "rank 5 of 6 (local 2), rendezvous [::1]:65535");
}

TEST(RankEnvTest, TorchrunThenOpenMpiThenSlurm) {
  const Variables slurm = {{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "3"}};
  const Variables mpi = {{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "3"}};
  const Variables torchrun = {{"RANK", "0"}, {"WORLD_SIZE", "3"}};
  Variables all = {{"MASTER_ADDR", "h"}, {"MASTER_PORT", "9"}};
  all.insert(slurm.begin(), slurm.end());
  EXPECT_EQ(FromVariables(all)->rank, 2);
  all.insert(mpi.begin(), mpi.end());
  EXPECT_EQ(FromVariables(all)->rank, 1);
  all.insert(torchrun.begin(), torchrun.end());
  EXPECT_EQ(FromVariables(all)->rank, 0);
}

TEST(RankEnvTest, LocalRankDefaultsToRank) {
  const auto env = FromVariables(
      {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "9"}});
  EXPECT_EQ(env->local_rank, 1);
}

TEST(RankEnvTest, WorldOfOneNeedsNoRendezvous) {
  const auto env = FromVariables({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  ASSERT_TRUE(env.has_value());
  EXPECT_EQ(env->world_size, 1);
  EXPECT_EQ(env->master_addr, "");
  EXPECT_EQ(env->master_port, 0);
  EXPECT_EQ(Describe(*env), "rank 0 of 1 (local 0)");
  // ...but one given is still checked.
  EXPECT_EQ(ErrorOf({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "0"}}),
            "environment MASTER_PORT=\"0\": out of range; accepted: a TCP port, 1..65535");
}

TEST(RankEnvTest, ErrorsNameTheVariableAndWhatIsAccepted) {
  const Variables good = {
      {"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "29500"}};
  const auto with = [&](const std::string& name, const char* value) {
    Variables v = good;
    if (value == nullptr)
      v.erase(name);
    else
      v[name] = value;
    return ErrorOf(v);
  };
  EXPECT_EQ(with("RANK", "1"), "");
  EXPECT_EQ(with("RANK", "x"),
            "environment RANK=\"x\": not an integer; accepted: 0..WORLD_SIZE-1 = 0..1");
  EXPECT_EQ(with("RANK", ""),
            "environment RANK=\"\": not an integer; accepted: 0..WORLD_SIZE-1 = 0..1");
  EXPECT_EQ(with("RANK", "1 "),
            "environment RANK=\"1 \": not an integer; accepted: 0..WORLD_SIZE-1 = 0..1");
  EXPECT_EQ(with("RANK", "2"),
            "environment RANK=\"2\": out of range; accepted: 0..WORLD_SIZE-1 = 0..1");
  EXPECT_EQ(with("RANK", "-1"),
            "environment RANK=\"-1\": out of range; accepted: 0..WORLD_SIZE-1 = 0..1");
  EXPECT_EQ(with("RANK", "99999999999"),
            "environment RANK=\"99999999999\": out of range; accepted: 0..WORLD_SIZE-1 = 0..1");
  EXPECT_EQ(with("WORLD_SIZE", nullptr),
            "environment WORLD_SIZE is not set, but RANK is (\"1\"); accepted: the number of "
            "ranks, 1 or more");
  EXPECT_EQ(with("WORLD_SIZE", "0"),
            "environment WORLD_SIZE=\"0\": out of range; accepted: 1 or more");
  EXPECT_EQ(with("WORLD_SIZE", "two"),
            "environment WORLD_SIZE=\"two\": not an integer; accepted: 1 or more");
  EXPECT_EQ(with("LOCAL_RANK", "2"),
            "environment LOCAL_RANK=\"2\": out of range; accepted: 0..WORLD_SIZE-1 = 0..1");
  EXPECT_EQ(with("MASTER_ADDR", nullptr),
            "environment MASTER_ADDR is not set; accepted: rank 0's host name or IP address, "
            "required when WORLD_SIZE=2 > 1");
  EXPECT_EQ(with("MASTER_ADDR", ""),
            "environment MASTER_ADDR is empty; accepted: rank 0's host name or IP address, "
            "required when WORLD_SIZE=2 > 1");
  EXPECT_EQ(with("MASTER_PORT", nullptr),
            "environment MASTER_PORT is not set; accepted: rank 0's rendezvous TCP port, "
            "1..65535, required when WORLD_SIZE=2 > 1");
  EXPECT_EQ(with("MASTER_PORT", "65536"),
            "environment MASTER_PORT=\"65536\": out of range; accepted: a TCP port, 1..65535");
  EXPECT_EQ(with("MASTER_PORT", "http"),
            "environment MASTER_PORT=\"http\": not an integer; accepted: a TCP port, 1..65535");

  // The other conventions name their own variables.
  EXPECT_EQ(ErrorOf({{"OMPI_COMM_WORLD_RANK", "4"}, {"OMPI_COMM_WORLD_SIZE", "4"}}),
            "environment OMPI_COMM_WORLD_RANK=\"4\": out of range; accepted: "
            "0..OMPI_COMM_WORLD_SIZE-1 = 0..3");
  EXPECT_EQ(ErrorOf({{"OMPI_COMM_WORLD_RANK", "0"},
                     {"OMPI_COMM_WORLD_SIZE", "4"},
                     {"OMPI_COMM_WORLD_LOCAL_RANK", "a"}}),
            "environment OMPI_COMM_WORLD_LOCAL_RANK=\"a\": not an integer; accepted: "
            "0..OMPI_COMM_WORLD_SIZE-1 = 0..3");
  EXPECT_EQ(ErrorOf({{"SLURM_PROCID", "0"}}),
            "environment SLURM_NTASKS is not set, but SLURM_PROCID is (\"0\"); accepted: the "
            "number of ranks, 1 or more");
  EXPECT_EQ(ErrorOf({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}}),
            "environment MASTER_ADDR is not set; accepted: rank 0's host name or IP address, "
            "required when SLURM_NTASKS=2 > 1");
}

// --- ShareFromRankZero --------------------------------------------------------------------------

TEST(RendezvousTest, WorldOfOneReturnsThePayload) {
  const std::vector<std::byte> payload = RandomBytes(128, 1);
  EXPECT_EQ(ShareFromRankZero(RankEnv{}, payload, milliseconds(1)), payload);
}

TEST(RendezvousTest, EveryRankGetsRankZerosPayload) {
  const int port = FreeLocalPort();
  const std::vector<std::byte> id = RandomBytes(128, 7);  // an ncclUniqueId's size
  // The other ranks start first: they must wait for rank 0 (retrying), not fail.
  RankThread rank2(Local(2, 3, port), RandomBytes(128, 2), milliseconds(5000));
  RankThread rank1(Local(1, 3, port), {}, milliseconds(5000));
  std::this_thread::sleep_for(milliseconds(150));
  RankThread rank0(Local(0, 3, port), id, milliseconds(5000));
  EXPECT_EQ(rank0.Join(), "");
  EXPECT_EQ(rank1.Join(), "");
  EXPECT_EQ(rank2.Join(), "");
  EXPECT_EQ(rank0.result, id);
  EXPECT_EQ(rank1.result, id);
  EXPECT_EQ(rank2.result, id);
}

TEST(RendezvousTest, NoRootFailsAfterTheTimeoutNamingTheAddress) {
  const int port = FreeLocalPort();
  const auto start = Clock::now();
  RankThread rank1(Local(1, 2, port), {}, milliseconds(300));
  const std::string error = rank1.Join();
  const auto took = Clock::now() - start;
  EXPECT_EQ(error, "rank 1: no rendezvous at 127.0.0.1:" + std::to_string(port) +
                       " after 300 ms: connection refused");
  EXPECT_GE(took, milliseconds(300));
  EXPECT_LT(took, milliseconds(1500));
}

TEST(RendezvousTest, RootWithoutPeersFailsNamingTheMissingRanks) {
  const int port = FreeLocalPort();
  RankThread rank0(Local(0, 3, port), RandomBytes(8, 1), milliseconds(200));
  EXPECT_EQ(rank0.Join(), "rank 0: only 0 of 2 other ranks reached the rendezvous on port " +
                              std::to_string(port) + " after 200 ms; missing: ranks 1, 2");
}

TEST(RendezvousTest, WorldSizeMismatchFailsOnEveryRank) {
  const int port = FreeLocalPort();
  RankThread rank0(Local(0, 2, port), RandomBytes(128, 1), milliseconds(3000));
  RankThread rank1(Local(1, 3, port), {}, milliseconds(3000));
  const std::string root_error = rank0.Join();
  const std::string peer_error = rank1.Join();
  EXPECT_NE(root_error.find("rank 0: rank 1 at 127.0.0.1:"), std::string::npos) << root_error;
  EXPECT_NE(root_error.find("was started with 3 ranks, rank 0 with 2"), std::string::npos)
      << root_error;
  EXPECT_EQ(peer_error,
            "rank 1: waiting for the payload from rank 0 at 127.0.0.1:" + std::to_string(port) +
                ": rank 0 closed the connection (it failed or rejected this rank; "
                "see its log)");
}

TEST(RendezvousTest, DuplicateRankFails) {
  const int port = FreeLocalPort();
  RankThread rank0(Local(0, 3, port), RandomBytes(128, 1), milliseconds(3000));
  RankThread first(Local(1, 3, port), {}, milliseconds(3000));
  RankThread second(Local(1, 3, port), {}, milliseconds(3000));
  const std::string root_error = rank0.Join();
  EXPECT_NE(root_error.find("rank 0: rank 1 came twice, from 127.0.0.1:"), std::string::npos)
      << root_error;
  EXPECT_NE(first.Join(), "");
  EXPECT_NE(second.Join(), "");
}

// --- LaunchLocalRanks ---------------------------------------------------------------------------

int Launch(const std::string& script, int ranks, std::string* err) {
  std::ostringstream stream;
  const int code = LaunchLocalRanks("/bin/sh", {"-c", script}, ranks, stream);
  *err = stream.str();
  return code;
}

TEST(LocalLauncherTest, AllRanksSucceed) {
  std::string err;
  EXPECT_EQ(Launch("exit 0", 3, &err), 0);
  EXPECT_EQ(err, "");
}

TEST(LocalLauncherTest, ChildrenGetTheRankVariables) {
  ScratchDir dir;
  // An inherited NCCL_NVLS_ENABLE=1 must not switch NVLink multicast on; others pass through.
  ::setenv("NCCL_NVLS_ENABLE", "1", 1);
  ::setenv("CTXPLAN_DIST_TEST_MARK", "kept", 1);
  std::string err;
  const int code = Launch(
      "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $MASTER_ADDR $MASTER_PORT $NCCL_NVLS_ENABLE "
      "$CTXPLAN_DIST_TEST_MARK\" > " +
          (dir.path() / "env.").string() + "$RANK",
      2, &err);
  ::unsetenv("NCCL_NVLS_ENABLE");
  ::unsetenv("CTXPLAN_DIST_TEST_MARK");
  EXPECT_EQ(code, 0);
  EXPECT_EQ(err, "");
  const std::regex line(R"(([0-9]+) 2 ([0-9]+) 127\.0\.0\.1 ([0-9]+) 0 kept\n)");
  std::string ports[2];
  for (int rank = 0; rank < 2; ++rank) {
    const std::string text = ReadFile(dir.path() / ("env." + std::to_string(rank)));
    std::smatch match;
    ASSERT_TRUE(std::regex_match(text, match, line)) << text;
    EXPECT_EQ(match[1], std::to_string(rank));
    EXPECT_EQ(match[2], std::to_string(rank));
    ports[rank] = match[3];
    EXPECT_GT(std::stoi(ports[rank]), 0);
    EXPECT_LE(std::stoi(ports[rank]), 65535);
  }
  EXPECT_EQ(ports[0], ports[1]);
}

TEST(LocalLauncherTest, FirstFailureStopsTheOthers) {
  ScratchDir dir;
  const std::string pid0 = (dir.path() / "pid0").string();
  // Rank 0 records its pid and sleeps (exec: the rank's process is the sleep itself); rank 1
  // fails with 3 once rank 0 is surely asleep.
  const std::string script = "if [ \"$RANK\" = 0 ]; then echo $$ > " + pid0 + ".tmp && mv " + pid0 +
                             ".tmp " + pid0 + "; exec sleep 30; fi; while [ ! -s " + pid0 +
                             " ]; do sleep 0.01; done; exit 3";
  const auto start = Clock::now();
  std::string err;
  EXPECT_EQ(Launch(script, 2, &err), 3);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(15));
  EXPECT_EQ(err, "ctxtrain: rank 1 failed (exit code 3); stopped the other ranks\n");
  // Rank 0 was stopped and reaped: its pid is gone.
  const pid_t sleeper = std::stoi(ReadFile(pid0));
  const int killed = ::kill(sleeper, 0);
  const int error = errno;
  EXPECT_EQ(killed, -1);
  EXPECT_EQ(error, ESRCH);
}

// A rank that said why it failed (it claimed the run's error line first) gets no second line from
// the launcher; when every rank fails the same way, one of them says it.
TEST(LocalLauncherTest, TheRunsErrorLineIsSaidOnce) {
  test::ScratchDir dir;
  const std::string said = (dir.path() / "said").string();
  // What ctxtrain's ErrorLine does: ignore the launcher's stop from here on, create the report
  // path exclusively, and say the line if it won.
  const std::string claim =
      "trap '' TERM INT; if (set -C; : > \"$CTXPLAN_LOCAL_LAUNCH_REPORT\") 2>/dev/null; then echo "
      "\"rank $RANK\" "
      ">> " +
      said + "; fi; ";
  std::ostringstream err;
  EXPECT_EQ(
      LaunchLocalRanks("/bin/sh",
                       {"-c", "if [ \"$RANK\" = 1 ]; then " + claim + "exit 3; fi; exec sleep 30"},
                       2, err),
      3);
  EXPECT_EQ(err.str(), "");
  EXPECT_EQ(test::ReadAll(said), "rank 1\n");
  std::filesystem::remove(said);
  std::ostringstream err_all;
  EXPECT_EQ(LaunchLocalRanks("/bin/sh", {"-c", claim + "exit 2"}, 3, err_all), 2);
  EXPECT_EQ(err_all.str(), "");
  const std::string lines = test::ReadAll(said);
  EXPECT_EQ(std::count(lines.begin(), lines.end(), '\n'), 1) << lines;
}

TEST(LocalLauncherTest, RankKilledByASignal) {
  std::string err;
  EXPECT_EQ(Launch("if [ \"$RANK\" = 1 ]; then kill -KILL $$; fi; exec sleep 30", 2, &err), 137);
  EXPECT_EQ(err,
            "ctxtrain: rank 1 failed (killed by signal 9: SIGKILL); stopped the other ranks\n");
}

TEST(LocalLauncherTest, SigtermToTheLauncherReachesEveryRank) {
  // Rank 0 sends SIGTERM to its parent, the launcher (this test): it must be forwarded to both
  // ranks, not end this process.
  std::string err;
  const int code =
      Launch("if [ \"$RANK\" = 0 ]; then kill -TERM $PPID; fi; exec sleep 30", 2, &err);
  EXPECT_EQ(code, 128 + SIGTERM);
  EXPECT_TRUE(std::regex_match(
      err, std::regex("ctxtrain: rank [01] failed \\(killed by signal 15: SIGTERM\\); stopped the "
                      "other ranks\n")))
      << err;
  // The previous disposition is back.
  struct sigaction now {};
  ::sigaction(SIGTERM, nullptr, &now);
  EXPECT_EQ(now.sa_handler, SIG_DFL);
}

TEST(LocalLauncherTest, UnstartableProgramIsADistError) {
  std::ostringstream err;
  try {
    LaunchLocalRanks("/nonexistent/ctxtrain", {}, 2, err);
    FAIL() << "no DistError";
  } catch (const DistError& e) {
    EXPECT_EQ(std::string(e.what()),
              "cannot start rank 0 of 2: /nonexistent/ctxtrain: no such file or directory");
  }
}

TEST(LocalLauncherTest, ExecutablePathIsThisTest) {
  // dist_test, or a sanitizer build's copy of it.
  const std::string name = fs::path(ExecutablePath()).filename().string();
  EXPECT_EQ(name.rfind("dist_test", 0), 0u) << name;
  EXPECT_TRUE(fs::path(ExecutablePath()).is_absolute());
}

// --- PollPause ---------------------------------------------------------------------------------

// A layer-chunk's wait (1-30 ms) must not sleep: a millisecond's sleep woke half a millisecond
// late on average, with the GPU idle meanwhile. Long waits sleep, late by at most 1% of the wait.
TEST(PollPauseTest, YieldsThroughALayerLongWaitAndSleepsOnlyOnLongOnes) {
  using std::chrono::microseconds;
  for (const auto waited : {microseconds(0), microseconds(700), microseconds(2500),
                            microseconds(12000), microseconds(30000), microseconds(49999)})
    EXPECT_EQ(PollPause(waited).count(), 0) << waited.count() << " us waited";
  EXPECT_EQ(PollPause(milliseconds(50)).count(), 500);
  EXPECT_EQ(PollPause(milliseconds(80)).count(), 800);
  for (const auto waited : {milliseconds(100), milliseconds(5000), milliseconds(600000)})
    EXPECT_EQ(PollPause(waited).count(), 1000) << waited.count() << " ms waited";
  for (int ms = 50; ms < 2000; ms += 7) {
    const auto pause = PollPause(milliseconds(ms));
    EXPECT_GT(pause.count(), 0);
    EXPECT_LE(pause.count() * 100, ms * 1000) << "late by more than 1% of a " << ms << " ms wait";
  }
}

}  // namespace
}  // namespace ctxplan::dist
